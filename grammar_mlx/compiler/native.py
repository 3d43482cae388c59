"""The token-row walk and mask packing as native code (row_walk.cpp), built from source on first use.

`token_index.walk` (numpy) is the reference: `walk`, `pack` here compute the same rows and masks
(tests/compiler/test_native.py holds them equal on random regexes and corpus schemas), in one loop
per row instead of a few numpy passes per trie level, so a state's first visit costs about one pass
over its live trie nodes.

Built with the system's C++ compiler (`$CXX`, else g++, else c++) into the grammar cache directory
(`cache.default_cache_dir()/native`, keyed by a hash of the source and the platform), atomically,
once per machine; loaded with ctypes. Where no compiler is found, the build fails, or
`GRAMMAR_MLX_NATIVE=0`, `available()` is False and the numpy path runs (same rows). Nothing here
raises to a caller: a failed build is logged once and remembered.

This module imports only the standard library and numpy (the compile worker loads token_index,
which imports it lazily, without the package's `__init__`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..automata.byte_dfa import ByteDFA
    from .token_index import TokenTrie

__all__ = ["available", "pack", "walk"]

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("row_walk.cpp")
MAX_UNKNOWN = 4096  # distinct missing DFA rows reported per call (more: the next call finds them)
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_P = ctypes.c_void_p
_I = ctypes.c_int64


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def _build_dir() -> Path:
    try:
        from .cache import default_cache_dir

        return default_cache_dir() / "native"
    except Exception:  # noqa: BLE001 - the cache module is optional here (bare worker imports)
        return Path(tempfile.gettempdir()) / "grammar_mlx-native"


def _build() -> ctypes.CDLL | None:
    if os.environ.get("GRAMMAR_MLX_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    cxx = _compiler()
    if cxx is None or not SOURCE.exists():
        return None
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + platform.platform().encode() + cxx.encode()).hexdigest()[:16]
    directory = _build_dir()
    target = directory / f"row_walk-{tag}.so"
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
            os.close(fd)
            try:
                subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-std=c++11", "-o", tmp, str(SOURCE)],
                               check=True, capture_output=True, timeout=120)
                os.replace(tmp, target)  # atomic: a concurrent build writes the same file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("native row walk not built (%s: %s); using the numpy walk", type(exc).__name__,
                        detail.decode(errors="replace")[-500:] or exc)
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        log.warning("native row walk not loaded (%s); using the numpy walk", exc)
        return None
    lib.gm_walk.restype = _I
    lib.gm_walk.argtypes = [_P, _I, ctypes.c_int32, _P, _P, _P, _P, _P, _P, _P, _I, _P, _I]
    lib.gm_row.restype = _I
    lib.gm_row.argtypes = [_P, _P, _I, _P, _P, _P, _I, _P, _I, _P, _P]
    lib.gm_pack.restype = None
    lib.gm_pack.argtypes = [_P, _I, _P, _I]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded native library, built on the first call (None where it cannot be)."""
    global _LIB, _TRIED
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                _LIB = _build()
                _TRIED = True
    return _LIB


def available() -> bool:
    return library() is not None


class _TrieBuffers:
    """A trie's constant arrays as pointers (contiguous int32), and per-thread scratch buffers."""

    def __init__(self, trie: TokenTrie) -> None:
        self.child_start = np.ascontiguousarray(trie.child_start, dtype=np.int32)
        self.child_count = np.ascontiguousarray(trie.child_count, dtype=np.int32)
        self.end_first = np.ascontiguousarray(trie.end_first, dtype=np.int32)
        self.more_node = np.ascontiguousarray(trie.end_more_node, dtype=np.int32)
        self.more_id = np.ascontiguousarray(trie.end_more_id, dtype=np.int32)
        self.ptrs = tuple(a.ctypes.data for a in (self.child_start, self.child_count, self.end_first,
                                                  self.more_node, self.more_id))
        self.num_nodes = trie.num_nodes
        self.width = trie.width
        self.local = threading.local()

    def scratch(self) -> tuple[np.ndarray, ...]:
        s = getattr(self.local, "bufs", None)
        if s is None:
            s = self.local.bufs = (
                np.empty(self.num_nodes, np.int32), np.empty(self.num_nodes, np.int32),  # live nodes, states
                np.full(self.width, -1, np.int32),  # per-token scratch (-1 between calls)
                np.empty(self.width, np.int32), np.empty(self.width, np.int32),  # the row, before copying
                np.zeros(3, np.int64), np.empty(MAX_UNKNOWN, np.int32))  # cursor, missing rows
        return s


_BUFFERS: weakref.WeakKeyDictionary[TokenTrie, _TrieBuffers] = weakref.WeakKeyDictionary()


def _buffers(trie: TokenTrie) -> _TrieBuffers:
    b = _BUFFERS.get(trie)
    if b is None:
        with _LOCK:
            b = _BUFFERS.get(trie)
            if b is None:
                b = _BUFFERS[trie] = _TrieBuffers(trie)
    return b


def walk(trie: TokenTrie, dfa: ByteDFA, state: int) -> tuple[np.ndarray, np.ndarray]:
    """`token_index.walk(trie, dfa, state)` (the same row), natively; call only where `available()`."""
    lib = library()
    assert lib is not None, "native.walk without the library (check available() first)"
    if trie.num_nodes == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    pending = not dfa.complete
    if pending:
        dfa.ensure_rows([state])
    buf = _buffers(trie)
    nodes, states, per_token, out_tokens, out_states, cursor, unknown = buf.scratch()
    table, dead, width = dfa.table, dfa.dead, dfa.num_classes
    node_class = dfa.node_classes(trie)
    a, b = trie._levels[0]
    st = table[state * width + node_class[a:b]]
    live = np.flatnonzero(st != dead)
    k = len(live)
    nodes[:k] = live + a
    states[:k] = st[live]
    cursor[:] = (0, k, k)
    child_start, child_count, end_first, more_node, more_id = buf.ptrs
    node_class_ptr = node_class.ctypes.data
    seen = np.zeros(len(table) // width, np.uint8)  # dedupes the missing rows (zero between calls)
    while True:
        missing = lib.gm_walk(table.ctypes.data, width, dead, node_class_ptr, child_start, child_count,
                              nodes.ctypes.data, states.ctypes.data, cursor.ctypes.data, unknown.ctypes.data,
                              MAX_UNKNOWN, seen.ctypes.data, len(seen))
        if missing == 0:
            break
        if missing < 0 or not pending:  # pragma: no cover - a complete DFA has no unknown row
            raise AssertionError("native walk met an unknown row of a complete DFA")
        dfa.ensure_rows(unknown[:missing].copy())
        table = dfa.table  # `ensure_rows` may have grown (replaced) it
        if len(seen) * width < len(table):
            seen = np.zeros(len(table) // width, np.uint8)
    count = int(cursor[2])
    found = lib.gm_row(nodes.ctypes.data, states.ctypes.data, count, end_first, more_node, more_id,
                       len(buf.more_id), per_token.ctypes.data, trie.width, out_tokens.ctypes.data,
                       out_states.ctypes.data)
    return out_tokens[:found].copy(), out_states[:found].copy()


def pack(tokens: np.ndarray, words: int) -> np.ndarray:
    """The packed mask (`words` little-endian uint32, bit t of word t // 32) allowing `tokens`
    (sorted or not, ids below 32 * words); call only where `available()`."""
    lib = library()
    assert lib is not None, "native.pack without the library (check available() first)"
    ids = np.ascontiguousarray(tokens, dtype=np.int32)
    out = np.empty(words, dtype="<u4")
    lib.gm_pack(ids.ctypes.data, len(ids), out.ctypes.data, words)
    return out
