"""On-disk cache of compiled automata: one self-checking file per entry.

The compiler keeps two kinds of entries here: outlines-core's byte DFA of a regex, and an eager
grammar's complete tables; beside them, the vocabulary index (a tokenizer's decoded token bytes and
its token tries: `index_cache.py`). Only the compiling process reads and writes them; compile
workers send their results back over their pipe and touch no file.

Layout of a file: `MAGIC`, a little-endian u32 header length, a JSON header, then the arrays, each
aligned to 64 bytes. The header names the cache key, each array's dtype/shape/offset, free-form
metadata and a CRC-32 of everything after the header. A file is used only when its magic, key and
CRC all match and its arrays have the declared sizes; anything else is treated as absent, so a
corrupt, truncated or foreign file is rebuilt, never trusted. Files are read into memory, not
mapped. Writes go to a temporary file in the same directory and are renamed into place, so readers
never see half a file.

Several processes may share one directory (server processes on one host, ranks of `mlx.launch`):
a writer's rename replaces an entry whole while a reader holds the file it opened, so concurrent
writers of one key leave one complete file (the last rename wins; both wrote the same tables) and a
reader gets an old or a new entry, never a mix. Entries get the permissions an ordinary file gets
under the process's umask (not `mkstemp`'s owner-only 0600), so processes of other users that share
a group-writable directory can read them. A writer killed mid-write leaves its temporary file; the
next write of that entry removes such files once they are older than `limits.CACHE_STALE_TEMP_SECONDS`.

The cache is an optimization, never a requirement: `load` and `store` never raise and never block.
A path that is not a regular file (a FIFO, a directory, a device, a symbolic link: opened with
`O_NONBLOCK | O_NOFOLLOW`) is treated as absent; that, and a directory that cannot be read or
written (read-only, full, permissions, a file where a directory should be), is logged once per
directory and kind of failure (logger `grammar_mlx.cache`), and the compile goes on without it.
"""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import stat
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .. import limits

MAGIC = b"GMLXTBL1"
_ALIGN = 64
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever. O_NOFOLLOW: the
# cache never creates links, so one at an entry's path is not ours to follow (to a device, say).
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

log = logging.getLogger("grammar_mlx.cache")
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _file_mode() -> int:
    # The umask can only be read by setting it; done once, at import, before any thread writes.
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()


def default_cache_dir() -> Path:
    """`$GRAMMAR_MLX_CACHE_DIR`, else `$XDG_CACHE_HOME/grammar_mlx`, else `~/.cache/grammar_mlx`."""
    env = os.environ.get("GRAMMAR_MLX_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "grammar_mlx"


def entry_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / key[:2] / f"{key}.gmx"


def load(cache_dir: Path, key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The entry stored under `key` in `cache_dir`, or None (absent, untrustworthy or unreadable)."""
    path = entry_path(cache_dir, key)
    entry, problem = _read(path, key)
    if problem is not None:
        _warn_once(cache_dir, "read: " + problem, f"cannot read {path} ({problem}); compiling without it")
    return entry


def store(cache_dir: Path, key: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> bool:
    """Write an entry under `key` in `cache_dir`; False (and a warning, once) when it cannot be written."""
    path = entry_path(cache_dir, key)
    try:
        write_tables(path, key, arrays, meta)
    except OSError as exc:
        what = errno.errorcode.get(exc.errno, "error") if exc.errno else type(exc).__name__
        _warn_once(cache_dir, "write: " + what,
                   f"cannot write {path} ({exc.strerror or exc}); compiled grammars are not cached there")
        return False
    return True


def _warn_once(cache_dir: Path, kind: str, message: str) -> None:
    key = (os.path.abspath(cache_dir), kind)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning("grammar cache %s: %s", cache_dir, message)


def write_tables(path: Path, key: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write `arrays` and `meta` under `key` to `path` atomically; raises OSError when it cannot."""
    specs, raw, offset, crc = [], {}, 0, 0
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        raw[name] = arr.reshape(-1).view(np.uint8)  # its bytes, without a copy, whatever its dtype and shape
        pad = -offset % _ALIGN
        crc = zlib.crc32(bytes(pad), crc)
        offset += pad
        specs.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset})
        crc = zlib.crc32(raw[name].data, crc)
        offset += arr.nbytes
    header = json.dumps({"key": key, "arrays": specs, "meta": meta, "size": offset, "crc32": crc}).encode()
    header += b" " * (-(len(MAGIC) + 4 + len(header)) % _ALIGN)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, _FILE_MODE)
            _write_all(fd, MAGIC + len(header).to_bytes(4, "little") + header)
            written = 0
            for spec in specs:
                _write_all(fd, bytes(spec["offset"] - written))
                _write_all(fd, raw[spec["name"]].data)
                written = spec["offset"] + raw[spec["name"]].nbytes
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _remove_stale_temporaries(path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _remove_stale_temporaries(path: Path) -> None:
    """Remove what writers of `path` killed mid-write left (their temporary files, past
    `limits.CACHE_STALE_TEMP_SECONDS`); a writer still at work is younger than that."""
    cutoff = time.time() - limits.CACHE_STALE_TEMP_SECONDS
    for leftover in path.parent.glob(glob.escape(path.name) + ".*.tmp"):
        try:
            if leftover.lstat().st_mtime < cutoff:
                leftover.unlink()
        except OSError:  # removed meanwhile by another writer, or not ours to remove
            pass


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_tables(path: Path, key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The arrays and metadata stored under `key` at `path`, or None when the file is absent, not a
    regular file, unreadable or not trustworthy. Never blocks, never raises OSError.

    The file is read into memory, not mapped: a mapped file that someone truncates or rewrites in
    place would change (or crash, SIGBUS) grammars already in use. Arrays are read-only views of it.
    """
    return _read(path, key)[0]


def _read(path: Path, key: str) -> tuple[tuple[dict[str, np.ndarray], dict[str, Any]] | None, str | None]:
    """(entry or None, None or the problem worth a warning: a path that is there but not usable)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None, "a symbolic link, not a regular file"
        return None, exc.strerror or str(exc)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "not a regular file"
        data = bytearray(info.st_size)
        view, filled = memoryview(data), 0
        while filled < len(data):
            n = os.readv(fd, [view[filled:]])
            if n == 0:  # truncated meanwhile: not this entry
                return None, None
            filled += n
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.close(fd)
    return _parse(memoryview(data).toreadonly(), key), None


def _parse(data: memoryview, key: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    try:
        if data[: len(MAGIC)] != MAGIC:
            return None
        hlen = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
        start = len(MAGIC) + 4 + hlen
        header = json.loads(bytes(data[len(MAGIC) + 4 : start]))
        if header.get("key") != key or len(data) - start != header["size"]:
            return None
        if zlib.crc32(data[start:]) != header["crc32"]:
            return None
        arrays = {}
        for spec in header["arrays"]:
            dtype = np.dtype(spec["dtype"])
            count = int(np.prod(spec["shape"], dtype=np.int64))
            if spec["offset"] + count * dtype.itemsize > header["size"]:
                return None
            arr = np.frombuffer(data, dtype=dtype, count=count, offset=start + spec["offset"])
            arrays[spec["name"]] = arr.reshape(spec["shape"])
        return arrays, header["meta"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
