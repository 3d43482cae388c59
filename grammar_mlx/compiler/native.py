"""The token-row walk, mask packing and subset construction as native code (row_walk.cpp,
subset.cpp), built from source on first use.

`token_index.walk` (numpy) is the reference: `walk`, `pack` here compute the same rows and masks
(tests/compiler/test_native.py holds them equal on random regexes and corpus schemas), in one loop
per row instead of a few numpy passes per trie level, so a state's first visit costs about one pass
over its live trie nodes; `walk_parts` is a first visit's whole walk (the string slice's loop test,
`loops`, then the row) in one call, and `Walker` the same for one lazy index, its constant arguments
taken once. `set_bits` sets a row's bits in place (a new mask-table row, zeros until then).
`row_ids` reads a packed mask's few set (or clear) ids for the CPU kernels' sparse row forms
(`kernels.cpu.sparse_form`, whose numpy path is its reference). `Subset` is the on-demand subset
construction of a byte NFA's DFA (subset.cpp; `automata.byte_nfa.Determinizer` is its reference and
drives it): a walk over a DFA built on demand computes the rows it meets in place, returning to
Python only when the NFA must be built further or the DFA's arrays grown.
`prepare` loads the library and makes a trie's walk buffers with its string slice (vocabulary
state, not a cost of each process's first compile).

Built (both sources, one library) with the system's C++ compiler (`$CXX`, else g++, else c++) into
the grammar cache directory (`cache.default_cache_dir()/native`, keyed by a hash of the sources and
the platform), atomically, once per machine; loaded with ctypes. Where no compiler is found, the
build fails, or `GRAMMAR_MLX_NATIVE=0`, `available()` is False and the numpy path runs (same rows).
Nothing here raises to a caller but a bad argument (`InvalidArgumentError`) and what building the
NFA or the DFA further raised (`Subset`): a failed build is logged once and remembered.

This module imports only the standard library, numpy and the errors (the compile worker loads token_index,
which imports it lazily, without the package's `__init__`).
"""

from __future__ import annotations

import contextlib
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
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from ..automata.byte_dfa import ByteDFA
    from .token_index import StringSlice, TokenTrie

__all__ = ["Subset", "Walker", "available", "check_pack_ids", "live_nodes", "loops", "merge", "pack", "prepare",
           "row_ids", "set_bits", "unset", "walk"]

log = logging.getLogger(__name__)
SOURCES = (Path(__file__).with_name("row_walk.cpp"), Path(__file__).with_name("subset.cpp"))
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_P = ctypes.c_void_p
_I = ctypes.c_int64
# gm_walk's callback: computes a missing DFA row, returns the table's address (NULL: it raised).
_FETCH = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
_NO_FETCH = _FETCH()  # NULL: a complete DFA's walk (no row is missing)
_SUBSET_FETCH: int | None = None  # gm_subset_fetch's address, a `Subset`'s `fetch` (set as the library loads)
# GmSubset's callbacks (subset.cpp): build what a pending NFA state's closure reaches; grow the arrays.
_EXPAND = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32)
_GROW = ctypes.CFUNCTYPE(ctypes.c_int32)


def find_compiler() -> str | None:
    """The C++ compiler native code here is built with ($CXX, g++ or c++ on PATH); None where none is."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def build_dir() -> Path:
    """Where built native libraries are kept: the grammar cache directory's `native`."""
    try:
        from .cache import default_cache_dir

        return default_cache_dir() / "native"
    except Exception:  # noqa: BLE001 - the cache module is optional here (bare worker imports)
        return Path(tempfile.gettempdir()) / "grammar_mlx-native"


def _platform_tag() -> str:
    """The system, its release, the machine and the C library: what a built library is keyed by
    besides its sources and compiler. Not `platform.platform()`, which runs `uname -p` in a
    subprocess, a cost each new process would pay at its first compile."""
    libc = ""
    if hasattr(os, "confstr") and "CS_GNU_LIBC_VERSION" in os.confstr_names:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    return "-".join((platform.system(), platform.release(), platform.machine(), libc))


def _build() -> ctypes.CDLL | None:
    if os.environ.get("GRAMMAR_MLX_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    cxx = find_compiler()
    if cxx is None or not all(path.exists() for path in SOURCES):
        return None
    source = b"".join(path.read_bytes() for path in SOURCES)
    tag = hashlib.sha256(source + _platform_tag().encode() + cxx.encode()).hexdigest()[:16]
    directory = build_dir()
    target = directory / f"row_walk-{tag}.so"
    if not target.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
            os.close(fd)
            try:
                subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-std=c++11", "-o", tmp, *map(str, SOURCES)],
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
    lib.gm_walk.argtypes = [_P, _I, ctypes.c_int32, _P, _P, _P, _P, _P, _P, _P, _P, _P]
    lib.gm_subset_new.restype = _P
    lib.gm_subset_new.argtypes = [_P, ctypes.c_int32, _P, _EXPAND, _GROW]
    lib.gm_subset_free.restype = None
    lib.gm_subset_free.argtypes = [_P]
    lib.gm_subset_push.restype = None
    lib.gm_subset_push.argtypes = [_P, _P, _I]
    lib.gm_subset_live.restype = None
    lib.gm_subset_live.argtypes = [_P, _P, _I]
    lib.gm_builder_start.restype = None
    lib.gm_builder_start.argtypes = [_P, _P, _I, _P, _I, _P, _I, _P, _I, _P, _P, _I, _P, _I, _P, _I, _P, _I, _I]
    lib.gm_builder_export.restype = _I
    lib.gm_builder_export.argtypes = [_P, _P, _I]
    lib.gm_builder_stop.restype = None
    lib.gm_builder_stop.argtypes = [_P]
    lib.gm_builder_states.restype = _I
    lib.gm_builder_states.argtypes = [_P, ctypes.c_int32]
    lib.gm_builder_member_dist.restype = _I
    lib.gm_builder_member_dist.argtypes = [_P, ctypes.c_int32]
    lib.gm_subset_start.restype = ctypes.c_int32
    lib.gm_subset_start.argtypes = [_P, ctypes.c_int32]
    lib.gm_subset_fetch.restype = _P
    lib.gm_subset_fetch.argtypes = [_P, ctypes.c_int32]
    lib.gm_subset_members.restype = _I
    lib.gm_subset_members.argtypes = [_P, ctypes.c_int32, ctypes.c_int32, _P, _I]
    lib.gm_subset_bytes.restype = _I
    lib.gm_subset_bytes.argtypes = [_P]
    lib.gm_loops.restype = _I
    lib.gm_loops.argtypes = [_P, _I, ctypes.c_int32, ctypes.c_int32, _P, _P, _P, _I, _P, _P]
    lib.gm_walk_parts.restype = _I
    lib.gm_walk_parts.argtypes = [_P, _I, ctypes.c_int32, _P, ctypes.c_int32, _P, _P, _P, _P, _P, _P]
    lib.gm_walk_with.restype = _I
    lib.gm_walk_with.argtypes = [_P, _P, ctypes.c_int32]
    lib.gm_set_bits.restype = None
    lib.gm_set_bits.argtypes = [_P, _I, _P]
    lib.gm_row.restype = _I
    lib.gm_row.argtypes = [_P, _P, _I, _P, _P, _P, _I, _P, _I, _P, _P]
    lib.gm_merge.restype = _I
    lib.gm_merge.argtypes = [_P, _I, ctypes.c_int32, _P, _P, _I, _P, _P]
    lib.gm_unset.restype = _I
    lib.gm_unset.argtypes = [_P, _I, _I, _P]
    lib.gm_row_ids.restype = _I
    lib.gm_row_ids.argtypes = [_P, _I, _I, _I, _P, _P]
    lib.gm_pack.restype = _I
    lib.gm_pack.argtypes = [_P, _I, _P, _I]
    global _SUBSET_FETCH
    _SUBSET_FETCH = ctypes.cast(lib.gm_subset_fetch, ctypes.c_void_p).value
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


def _address(array: np.ndarray) -> int:
    """The address of a contiguous array's data. A writable one's through a ctypes view of its
    buffer, a fraction of what `__array_interface__` or `.ctypes.data` cost (each builds a Python
    object per call): a compile and its first mask pass a dozen arrays, the per-token path several per
    call. A read-only array (no writable buffer to view) or an empty one (a view needs a byte) through
    `__array_interface__`."""
    if array.flags.writeable:
        try:
            return ctypes.addressof(_CHAR.from_buffer(array))  # type: ignore[arg-type]  # (a buffer at run time)
        except (ValueError, TypeError):  # empty, or not C-contiguous (a caller's mistake: the same address as below)
            pass
    address: int = array.__array_interface__["data"][0]
    return address


_CHAR = ctypes.c_char


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
        self.byte = np.ascontiguousarray(trie.byte, dtype=np.int32)
        self.ptrs = tuple(a.ctypes.data for a in (self.child_start, self.child_count, self.end_first,
                                                  self.more_node, self.more_id, self.byte))
        self.num_nodes = trie.num_nodes
        self.width = trie.width
        self.local = threading.local()
        # gm_walk_parts's descriptor of the trie (see row_walk.cpp).
        child_start, child_count, end_first, more_node, more_id, node_byte = self.ptrs
        self.desc = np.array([node_byte, child_start, child_count, end_first, more_node, more_id, len(self.more_id),
                              trie._levels[0][1] if trie.num_nodes else 0], dtype=np.int64)
        self.desc_address = _address(self.desc)

    def scratch(self) -> _Scratch:
        s = getattr(self.local, "scratch", None)
        if s is None:
            s = self.local.scratch = _Scratch(self.num_nodes, self.width)
        return s


class _Scratch:
    """One thread's buffers for `walk` and their addresses (`ctypes` arguments, taken once)."""

    def __init__(self, num_nodes: int, width: int) -> None:
        self.nodes = np.empty(num_nodes, np.int32)  # live nodes, level by level
        self.states = np.empty(num_nodes, np.int32)  # the state at each
        self.per_token = np.full(width, -1, np.int32)  # -1 between calls (gm_row restores it)
        self.out_tokens = np.empty(width, np.int32)
        self.out_states = np.empty(width, np.int32)
        self.cursor = np.zeros(3, np.int64)
        self.ptrs = tuple(a.ctypes.data for a in (self.nodes, self.states, self.per_token, self.out_tokens,
                                                  self.out_states, self.cursor))
        self.desc = np.array([*self.ptrs[:5], width], dtype=np.int64)  # gm_walk_parts's (see row_walk.cpp)
        self.desc_address = _address(self.desc)
        self.looped = np.zeros(1, np.int64)
        self.looped_address = _address(self.looped)
        # The DFA being walked (its rows computed by `_fetch_row`), the table last handed to the walk
        # (kept alive while the walk reads it) and what computing a row raised: per thread, as walks are.
        self.dfa: ByteDFA | None = None
        self.table: np.ndarray | None = None
        self.address = 0  # the address of `table`'s data
        self.error: BaseException | None = None
        self.fetch = _FETCH(self._fetch_row)

    def _fetch_row(self, _ctx: int | None, state: int) -> int | None:
        """gm_walk's callback: the row of `state` computed, the table's address (None: it raised,
        the error kept for the walk's caller; an exception must not cross the C frames)."""
        try:
            dfa = self.dfa
            assert dfa is not None
            dfa.ensure_row(state)
            table = dfa.table
            if table is not self.table:  # the DFA grew: a new table (`.ctypes` costs a call per read)
                self.table, self.address = table, _address(table)
            return self.address
        except BaseException as exc:  # noqa: BLE001 - re-raised by `_walk_live` once the walk returns
            self.error = exc
            return None


_BUFFERS: weakref.WeakKeyDictionary[TokenTrie, _TrieBuffers] = weakref.WeakKeyDictionary()


def _callback(subset: Callable[[], Subset | None], method: str, *args: int) -> int:
    """A GmSubset callback: 0, or 1 with what it raised kept for `Subset.finish` (an exception must
    not cross the C frames)."""
    me = subset()
    if me is None:  # pragma: no cover - the native side is freed with its Subset
        return 1
    try:
        getattr(me, method)(*args)
        return 0
    except BaseException as exc:  # noqa: BLE001 - raised by `finish` once the native call returns
        me.error = exc
        return 1

# subset.cpp's `io` slots.
(IO_TABLE, IO_ACCEPTING, IO_LIVE, IO_CAPACITY, IO_MAX_STATES, IO_STATES, IO_ROWS, IO_ERROR, IO_LOG,
 IO_LOG_LENGTH) = range(10)


class Subset:
    """A native subset construction (subset.cpp's GmSubset) for `automata.byte_nfa.Determinizer`,
    which pushes the NFA states into it (`push`) and builds what a closure meets pending (`expand`,
    called back from the native side). It writes rows, accepting and live flags straight into the
    bound `ByteDFA`'s arrays (`bind`), has them grown through `ByteDFA._grow`, and tells the DFA its
    new counts after each call (`finish`, which raises what failed). Call only where `available()`,
    under the DFA's lock. It holds the DFA and `expand`'s owner weakly (they own it: no cycle, so
    the native side is freed with the DFA)."""

    def __init__(self, classes: np.ndarray, all_live: bool, expand: Callable[[int], None]) -> None:
        lib = library()
        assert lib is not None, "native.Subset without the library (check available() first)"
        self._lib = lib
        self.io = np.zeros(10, np.int64)
        self._dfa: Callable[[], ByteDFA | None] = lambda: None
        self.error: BaseException | None = None
        self.nfa_too_large: Callable[[], BaseException] | None = None  # the error of io[7] = 3 (the NFA's cap)
        # Hands the NFA's building over at the next call after a row is computed (held weakly: the
        # Determinizer owns this object), set by `automata.byte_nfa.Determinizer.start`.
        self.hand_off_later: weakref.WeakMethod[Callable[[], None]] | None = None
        me = weakref.ref(self)
        expand_ref = weakref.WeakMethod(expand)

        def on_expand(q: int) -> int:  # (a closure, not `_callback`: called for every pending state met)
            try:
                expand_ref()(q)  # type: ignore[misc]
                return 0
            except BaseException as exc:  # noqa: BLE001 - raised by `finish` once the native call returns
                subset = me()
                if subset is not None:
                    subset.error = exc
                return 1

        self._callbacks = (_EXPAND(on_expand), _GROW(lambda: _callback(me, "_grow")))
        classes = np.ascontiguousarray(classes, dtype=np.int32)  # byte -> class (copied there)
        self.handle: int = lib.gm_subset_new(_address(classes), int(all_live), _address(self.io), *self._callbacks)
        # gm_walk's fetch for this DFA: the native row computation, this subset its context.
        self.fetch = _SUBSET_FETCH

    def __del__(self) -> None:
        # (not weakref.finalize: registering one costs as much as the rest of this constructor,
        # and nothing else refers to the handle once this object is gone)
        handle = getattr(self, "handle", None)
        if handle is not None:
            self._lib.gm_subset_free(handle)

    @property
    def dfa(self) -> ByteDFA:
        dfa = self._dfa()
        assert dfa is not None, "native.Subset of a DFA that is gone"
        return dfa

    def bind(self, dfa: ByteDFA) -> None:
        """Write into `dfa`'s arrays (its dead state made, no other state yet)."""
        self._dfa = weakref.ref(dfa)
        self._arrays()

    def _arrays(self) -> None:
        dfa, io = self.dfa, self.io  # (item by item: a fancy-indexed assignment costs several times more)
        io[IO_TABLE] = _address(dfa.table)
        io[IO_ACCEPTING] = _address(dfa.accepting)
        io[IO_LIVE] = _address(dfa.live)
        io[IO_CAPACITY] = len(dfa.accepting)

    def _grow(self) -> None:
        self.dfa._grow()
        self._arrays()

    def push(self, log: array[int], start: int) -> None:
        """Read the NFA's records `log[start:]` (see subset.cpp's gm_subset_push)."""
        assert log.itemsize == 4
        self._lib.gm_subset_push(self.handle, log.buffer_info()[0] + 4 * start, len(log) - start)

    def stage(self, log: array[int], start: int) -> None:
        """From the expand callback: have the native side read `log[start:]` once it returns (one
        native call fewer per callback than `push`)."""
        assert log.itemsize == 4
        self.io[IO_LOG] = log.buffer_info()[0] + 4 * start
        self.io[IO_LOG_LENGTH] = len(log) - start

    def start_building(self, tables: tuple[np.ndarray, ...], dist: array[int], pending: Sequence[tuple[int, ...]],
                       memo: Sequence[tuple[int, ...]], max_states: int) -> None:
        """The native builder takes over building the NFA (`automata.byte_nfa.ByteNFA.hand_off`):
        `tables` its AST (`byte_nfa._native_plan`), `dist` per state made, the pending states as
        (state, node, lo, hi, continuation), the memo as (node, lo, hi, continuation, state)."""
        nodes, children, data, tpl, tstate, ranges = (np.ascontiguousarray(t, dtype=np.int32) for t in tables)
        distances = np.frombuffer(dist, dtype=np.int32) if len(dist) else np.zeros(1, np.int32)
        waiting = np.array(pending, dtype=np.int32).reshape(-1, 5)
        memos = np.array(memo, dtype=np.int32).reshape(-1, 5)
        held = (nodes, children, data, tpl, tstate, ranges, distances, waiting, memos)  # alive through the call
        self._lib.gm_builder_start(
            self.handle, _address(nodes), len(nodes) // 5, _address(children), len(children), _address(data),
            len(data), _address(tpl), len(tpl) - 1, _address(tstate), _address(ranges), len(ranges) // 3,
            _address(distances), len(dist), _address(waiting), len(waiting), _address(memos), len(memos), max_states)
        del held

    def stop_building(self) -> np.ndarray:
        """Stop the native builder (Python builds the NFA from here on): the records of what it made
        (see subset.cpp's gm_builder_export), taken under the DFA's lock (a walk in another thread
        may be building)."""
        dfa = self._dfa()
        with dfa._lock if dfa is not None else contextlib.nullcontext():
            count = self._lib.gm_builder_export(self.handle, 0, 0)
            out = np.empty(max(count, 1), np.int32)
            self._lib.gm_builder_export(self.handle, _address(out), count)
            self._lib.gm_builder_stop(self.handle)
        return out[:count]

    def nfa_states(self, pending: bool = False) -> int:
        """NFA states made (or, `pending`, left pending) while the native builder builds."""
        return int(self._lib.gm_builder_states(self.handle, int(pending)))

    def member_distance(self, state: int) -> int | None:
        """The fewest bytes from DFA state `state`'s NFA states to the match, by the native
        builder's distances (while it builds; `automata.byte_nfa._FAR`: none), None where the row
        is computed."""
        d = int(self._lib.gm_builder_member_dist(self.handle, state))
        return None if d == -2 else d

    def set_live(self, live: bytearray) -> None:
        """The liveness of every NFA state (0/1 per state; the NFA is built whole)."""
        flags = np.frombuffer(live, dtype=np.uint8)
        self._lib.gm_subset_live(self.handle, _address(flags), len(flags))

    def begin(self) -> None:
        """Before a call that may add states: the DFA's current cap; once a row is computed, the
        NFA handed to the native builder where that waits (`hand_off_later`)."""
        self.io[IO_MAX_STATES] = self.dfa.max_states
        if self.hand_off_later is not None and self.io[IO_ROWS]:
            later, self.hand_off_later = self.hand_off_later, None
            hand_off = later()
            if hand_off is not None:
                hand_off()

    def start(self, nfa_state: int) -> int:
        """The DFA state of `nfa_state`'s closure (the initial state)."""
        self.begin()
        sid: int = self._lib.gm_subset_start(self.handle, nfa_state)
        self.finish()
        return sid

    def row(self, state: int) -> None:
        """Compute `state`'s row into the table (if it is unknown)."""
        self.begin()
        self._lib.gm_subset_fetch(self.handle, state)
        self.finish()

    def finish(self) -> None:
        """After a call: the DFA's counts brought up to date, then the error it met raised."""
        dfa, io = self.dfa, self.io
        dfa._grown(int(io[IO_STATES]), 1 + int(io[IO_ROWS]))
        code = int(io[IO_ERROR])
        if code:
            io[IO_ERROR] = 0
            error, self.error = self.error, None
            if code == 2:
                raise dfa.too_large()
            if code == 3 and self.nfa_too_large is not None:
                raise self.nfa_too_large()
            raise error if error is not None else AssertionError("the native subset construction failed")

    @property
    def num_states(self) -> int:
        """DFA states made so far (the dead one not counted)."""
        return int(self.io[IO_STATES])

    def members(self, state: int, ever: bool = False) -> list[int] | None:
        """The NFA states of DFA state `state` while its row is unknown (None after), or ever (`ever`)."""
        out = np.empty(16, np.int32)
        count = self._lib.gm_subset_members(self.handle, state, int(ever), _address(out), len(out))
        if count > len(out):
            out = np.empty(count, np.int32)
            count = self._lib.gm_subset_members(self.handle, state, int(ever), _address(out), len(out))
        return None if count < 0 else out[:count].tolist()

    @property
    def nbytes(self) -> int:
        """The native side's heap, roughly (its vectors and hash tables)."""
        return int(self._lib.gm_subset_bytes(self.handle)) + self.io.nbytes


def _buffers(trie: TokenTrie) -> _TrieBuffers:
    b = _BUFFERS.get(trie)
    if b is None:
        with _LOCK:
            b = _BUFFERS.get(trie)
            if b is None:
                b = _BUFFERS[trie] = _TrieBuffers(trie)
    return b


def prepare(trie: TokenTrie, sl: StringSlice) -> None:
    """Loads the library and makes what every walk of `trie` and of its string slice `sl` reads
    (their int32 arrays and descriptors, this thread's scratch buffers), where the library is
    built: vocabulary state, made with the slice (`TokenTrie.string_slice`) rather than by the
    first grammar each process compiles."""
    if not available() or trie.num_nodes == 0:
        return
    _buffers(trie).scratch()
    _slice_desc(sl)


def walk(trie: TokenTrie, dfa: ByteDFA, state: int) -> tuple[np.ndarray, np.ndarray]:
    """`token_index.walk(trie, dfa, state)` (the same row), natively; call only where `available()`."""
    return walk_parts(trie, None, dfa, state)[1:]


def walk_parts(trie: TokenTrie, sl: StringSlice | None, dfa: ByteDFA, state: int
               ) -> tuple[bool, np.ndarray, np.ndarray]:
    """`token_index.walk_parts` in one native call: (whether `state` loops on the string slice `sl`
    of `trie`, the row of `sl.rest` if so, else of `trie`); without a slice, `walk`'s row. Call only
    where `available()`."""
    lib = library()
    assert lib is not None, "native walk without the library (check available() first)"
    if trie.num_nodes == 0:
        return False, np.zeros(0, np.int32), np.zeros(0, np.int32)
    buf = _buffers(trie)
    sc = buf.scratch()
    # The slice's descriptor (made once per slice): gm_loops reads its byte edges through this DFA's
    # classes and tests "a" first, which most states fail, natively. Without a slice the whole trie is walked.
    held = None if sl is None else _slice_desc(sl)  # (held here: its arrays live through the call)
    slice_address = None if held is None else held[1]
    found = _run(dfa, sc, lambda table, fetch, ctx: lib.gm_walk_parts(
        table, dfa.num_classes, dfa.dead, _address(dfa.classes), state, fetch, ctx, buf.desc_address,
        sc.desc_address, slice_address, sc.looped_address))
    return bool(sc.looped[0]), sc.out_tokens[:found].copy(), sc.out_states[:found].copy()


class Walker:
    """`token_index.walk_parts(trie, dfa, state)` (`walk_parts` here, with `sl` its slice) for one
    (trie, slice, DFA), with the arguments that do not change between walks taken once (row_walk.cpp's
    gm_walk_with descriptor): a lazy index's first visits call it, where each Python step is paid
    on caches the last mask left cold. Call only where `available()`, on a trie with nodes."""

    def __init__(self, trie: TokenTrie, sl: StringSlice | None, dfa: ByteDFA) -> None:
        lib = library()
        assert lib is not None, "native.Walker without the library (check available() first)"
        assert trie.num_nodes, "native.Walker of an empty trie"
        self._fn = lib.gm_walk_with
        self._trie, self._sl, self._dfa = trie, sl, dfa
        self._buf = _buffers(trie)
        self._slice = None if sl is None else _slice_desc(sl)  # held: the descriptor's arrays live as long
        self._classes = np.ascontiguousarray(dfa.classes, dtype=np.int32)  # int32 already: no copy
        self._subset: Subset | None = None  # the subset the descriptor names (0 in it: none)
        self.desc = np.array([0, 0, dfa.num_classes, dfa.dead, _address(self._classes), self._buf.desc_address,
                              0 if self._slice is None else self._slice[1], 0], dtype=np.int64)
        self._desc_address = _address(self.desc)

    def __call__(self, state: int) -> tuple[StringSlice | None, np.ndarray, np.ndarray]:
        """(the slice where `state` loops on it, else None; the row of the slice's rest if so,
        else the trie's), as `token_index.walk_parts` answers."""
        dfa, desc = self._dfa, self.desc
        sc = self._buf.scratch()
        if dfa.complete:
            desc[0] = _address(dfa.table)
            desc[1] = 0
            result = self._fn(self._desc_address, sc.desc_address, state)
        else:
            subset = dfa.subset
            if subset is None:  # rows computed in Python (`_Scratch._fetch_row`)
                looped, tokens, nxt = walk_parts(self._trie, self._sl, dfa, state)
                return (self._sl if looped else None), tokens, nxt
            if subset is not self._subset:
                desc[1] = _address(subset.io)
                desc[7] = subset.handle
                self._subset = subset
            with dfa._lock:
                subset.begin()
                try:
                    result = self._fn(self._desc_address, sc.desc_address, state)
                finally:
                    subset.finish()  # raises the row computation's error
        if result < 0:  # pragma: no cover - a failed row raised above; a complete DFA has every row
            raise AssertionError("a native walk met an unknown row it could not compute")
        found = result >> 1
        return (self._sl if result & 1 else None), sc.out_tokens[:found].copy(), sc.out_states[:found].copy()


_SLICES: weakref.WeakKeyDictionary[StringSlice, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()


def _slice_desc(sl: StringSlice) -> tuple[np.ndarray, int]:
    """(gm_walk_parts's descriptor of `sl`, its address), made once per slice: the addresses of its
    byte edges and where each position's start (`StringSlice.byte_edges`, kept by `sl`), the loop
    test's pair cap, and the descriptor of its rest trie (0: none)."""
    held = _SLICES.get(sl)
    if held is None:
        edges, starts = sl.byte_edges
        rest = _buffers(sl.rest).desc_address if sl.rest.num_nodes else 0  # kept while `sl.rest` lives
        desc = np.array([_address(edges), _address(starts), sl.MAX_PAIRS, rest], np.int64)
        held = _SLICES[sl] = (desc, _address(desc))
    return held


def _run(dfa: ByteDFA, sc: _Scratch, call: Callable[[int, int | None, int | None], int]) -> int:
    """`call(table address, fetch, ctx)`, a native call reading `dfa`'s rows, with the rows it meets
    unknown computed: by `dfa.subset` natively (under the DFA's lock), by the thread's Python callback
    (`_Scratch._fetch_row`) for a DFA whose rows Python computes, by no one for a complete DFA. Raises
    what computing a row raised; else returns the call's result, which is never -2 (a missing row)."""
    if dfa.complete:
        result = call(_address(dfa.table), None, None)
    elif (subset := dfa.subset) is not None:
        with dfa._lock:
            subset.begin()
            try:
                result = call(int(subset.io[IO_TABLE]), subset.fetch, subset.handle)
            finally:
                subset.finish()  # raises the row computation's error
    else:
        table = dfa.table
        sc.dfa, sc.table, sc.address, sc.error = dfa, table, _address(table), None
        try:
            result = call(sc.address, _address_of(sc.fetch), None)
            error = sc.error
        finally:
            sc.dfa = sc.table = sc.error = None
        if error is not None:
            raise error
    if result < 0:  # pragma: no cover - a failed row raised above; a complete DFA has every row
        raise AssertionError("a native walk met an unknown row it could not compute")
    return result


def _address_of(callback: object) -> int:
    """The address of a ctypes callback (a function pointer argument)."""
    address: int = ctypes.cast(callback, ctypes.c_void_p).value  # type: ignore[arg-type, assignment]
    return address


def live_nodes(trie: TokenTrie, dfa: ByteDFA, state: int, below: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """The trie nodes below node `below` (-1: the root) whose bytes from there keep `dfa` alive
    from `state`, and the DFA state at each (what `walk`'s row is read from; the context-free
    engine reads its lexemes' ends from them too); call only where `available()`."""
    walked = _walked(trie, dfa, state, below)
    if walked is None:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    _, _, sc, count = walked
    return sc.nodes[:count].copy(), sc.states[:count].copy()


def _walked(trie: TokenTrie, dfa: ByteDFA, state: int, below: int
            ) -> tuple[ctypes.CDLL, _TrieBuffers, _Scratch, int] | None:
    """The live pairs of a walk in this thread's scratch (None: an empty trie)."""
    lib = library()
    assert lib is not None, "native walk without the library (check available() first)"
    if trie.num_nodes == 0:
        return None
    buf = _buffers(trie)
    sc = buf.scratch()
    return lib, buf, sc, _walk_live(lib, trie, dfa, state, below, buf, sc)


def _walk_live(lib: ctypes.CDLL, trie: TokenTrie, dfa: ByteDFA, state: int, below: int, buf: _TrieBuffers,
               sc: _Scratch) -> int:
    """gm_walk to its end, one call (missing rows computed as it meets them); the pairs' count in `sc`."""
    table, dead, width = dfa.table, dfa.dead, dfa.num_classes
    pending = not dfa.complete
    if pending and table[state * width] < 0:
        dfa.ensure_row(state)
        table = dfa.table
    if below < 0:
        sc.cursor[:] = (-1, trie._levels[0][1], state)  # level 0 from `state` (see gm_walk)
    else:  # the children of `below` that live, as the level the walk expands first
        first = int(trie.child_start[below])
        kids = np.arange(first, first + int(trie.child_count[below]), dtype=np.int32)
        st = table.take(state * width + dfa.classes.take(trie.byte.take(kids)))
        keep = st != dead
        k = int(keep.sum())
        sc.nodes[:k] = kids[keep]
        sc.states[:k] = st[keep]
        sc.cursor[:] = (0, k, k)
    nodes, states, _, _, _, cursor = sc.ptrs
    child_start, child_count, _, _, _, node_byte = buf.ptrs
    classes = np.ascontiguousarray(dfa.classes, dtype=np.int32)  # int32 already: no copy
    subset = dfa.subset if pending else None
    if subset is not None:  # missing rows computed natively, without a return to Python per row
        with dfa._lock:
            subset.begin()
            try:
                done = lib.gm_walk(_address(dfa.table), width, dead, _address(classes), node_byte, child_start,
                                   child_count, nodes, states, cursor, subset.fetch, subset.handle)
            finally:
                subset.finish()
        if done != 0:  # pragma: no cover - a failed row raised in `finish`
            raise AssertionError("native walk met an unknown row it could not compute")
        return int(sc.cursor[2])
    # Missing rows are computed as the walk meets them (`_Scratch._fetch_row`; a row computation
    # never walks a trie, which would reuse this thread's scratch).
    sc.dfa, sc.table, sc.address, sc.error = dfa, table, _address(table), None
    try:
        done = lib.gm_walk(sc.address, width, dead, _address(classes), node_byte, child_start,
                           child_count, nodes, states, cursor, sc.fetch if pending else _NO_FETCH, None)
        error = sc.error
    finally:
        sc.dfa = sc.table = sc.error = None
    if done == -1 and error is not None:
        raise error
    if done != 0:  # pragma: no cover - a complete DFA has no unknown row
        raise AssertionError("native walk met an unknown row of a complete DFA")
    return int(sc.cursor[2])


def loops(dfa: ByteDFA, state: int, edges: np.ndarray, starts: np.ndarray, max_pairs: int) -> bool:
    """`token_index.StringSlice.loops` (the same answer): `edges` the (byte, next position) pairs of
    the slice's character positions (`StringSlice.byte_edges`), int32, flat, position r's from pair
    `starts[r]` to `starts[r + 1]`, in byte order; call only where `available()`."""
    lib = library()
    assert lib is not None, "native.loops without the library (check available() first)"
    classes = np.ascontiguousarray(dfa.classes, dtype=np.int32)  # int32 already: no copy
    edges_address, starts_address = _address(edges), _address(starts)
    return bool(_run(dfa, _scratch(), lambda table, fetch, ctx: lib.gm_loops(
        table, dfa.num_classes, dfa.dead, state, _address(classes), edges_address, starts_address, max_pairs,
        fetch, ctx)))


_LOCAL = threading.local()


def _scratch() -> _Scratch:
    """A thread's scratch for calls that read no trie (its Python row callback only)."""
    sc = getattr(_LOCAL, "scratch", None)
    if sc is None:
        sc = _LOCAL.scratch = _Scratch(0, 0)
    return sc


def merge(base: np.ndarray, base_state: int, tokens: np.ndarray, states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The row of the ids `base` (sorted, each to `base_state`) and `tokens` (sorted, disjoint from
    `base`, each to its `states`), sorted; call only where `available()`."""
    lib = library()
    assert lib is not None, "native.merge without the library (check available() first)"
    base = np.ascontiguousarray(base, dtype=np.int32)
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    states = np.ascontiguousarray(states, dtype=np.int32)
    n = len(base) + len(tokens)
    out_tokens, out_states = np.empty(n, np.int32), np.empty(n, np.int32)
    lib.gm_merge(_address(base), len(base), base_state, _address(tokens), _address(states), len(tokens),
                 _address(out_tokens), _address(out_states))
    return out_tokens, out_states


def unset(words: np.ndarray, width: int) -> np.ndarray:
    """`grammar._unset_ids_reference(words, width)`: the ids below `width` whose bit is clear in
    the packed mask `words` (bit t of word t // 32), sorted, int32; call only where `available()`."""
    lib = library()
    assert lib is not None, "native.unset without the library (check available() first)"
    packed = np.ascontiguousarray(words, dtype="<u4")
    out = np.empty(width, np.int32)  # room for a mask that allows nothing
    count = lib.gm_unset(_address(packed), len(packed), width, _address(out))
    unset: np.ndarray = out[:count].copy()
    return unset


def row_ids(words: np.ndarray, width: int, max_set: int, max_clear: int) -> tuple[int, np.ndarray | int]:
    """The sparse form of the packed mask `words` (contiguous uint32, bit t of word t // 32) below
    bit `width` (at most 32 * len(words)): (1, the set ids) where at most `max_set` bits are set,
    else (2, the clear ids) where at most `max_clear` are clear (negative: never), else (0, the set
    bits' count); ids sorted, int32. One pass to count, one to read the ids; call only where
    `available()`."""
    lib = library()
    assert lib is not None, "native.row_ids without the library (check available() first)"
    assert words.dtype == np.uint32 and words.flags.c_contiguous and 0 <= width <= 32 * len(words)
    out = np.empty(max(max_set, max_clear, 0), np.int32)
    form = np.zeros(1, np.int64)
    found = lib.gm_row_ids(_address(words), width, max_set, max_clear, _address(out), _address(form))
    kind = int(form[0])
    return (kind, out[:found]) if kind else (0, int(found))


def set_bits(ids: np.ndarray, words: np.ndarray) -> None:
    """Set in `words` (contiguous uint32, all zeros: a new mask-table row) the bits of `ids`
    (contiguous int32, each below 32 * len(words): checked by the caller, or a walk's row); call
    only where `available()`."""
    lib = library()
    assert lib is not None, "native.set_bits without the library (check available() first)"
    lib.gm_set_bits(_address(ids), len(ids), _address(words))


def pack(tokens: np.ndarray, words: int) -> np.ndarray:
    """The packed mask (`words` little-endian uint32, bit t of word t // 32) allowing `tokens`
    (a 1-D integer array, sorted or not); call only where `available()`. Raises
    `InvalidArgumentError` for an id outside 0 .. 32 * words - 1 (the words hold no bit for it)."""
    lib = library()
    assert lib is not None, "native.pack without the library (check available() first)"
    if type(words) is not int or words < 0:
        raise InvalidArgumentError(f"pack: words must be an int >= 0, got {words!r:.80}")
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidArgumentError(f"pack: tokens must be a 1-D integer array, got shape {ids.shape} of {ids.dtype}")
    if ids.dtype != np.int32:  # checked before the cast, which would wrap a wider id into range
        check_pack_ids(ids, words)
        ids = ids.astype(np.int32)
    ids = np.ascontiguousarray(ids)
    out = np.empty(words, dtype="<u4")
    bad = lib.gm_pack(_address(ids), len(ids), _address(out), words)
    if bad >= 0:
        check_pack_ids(ids[bad : bad + 1], words)
    return out


def check_pack_ids(ids: np.ndarray, words: int) -> None:
    """`InvalidArgumentError` unless every id of the integer array `ids` has a bit in `words` words
    (what `pack` checks, for the numpy reference)."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 32 * words):
        bad = int(ids[(ids < 0) | (ids >= 32 * words)][0])
        raise InvalidArgumentError(f"pack: token id {bad} is outside the {32 * words} ids that {words} words hold")
