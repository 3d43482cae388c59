"""On-disk cache of compiled tables: one self-checking file per grammar.

Layout of a file: `MAGIC`, a little-endian u32 header length, a JSON header, then the arrays, each
aligned to 64 bytes. The header names the cache key, each array's dtype/shape/offset, free-form
metadata and a CRC-32 of everything after the header. A file is used only when its magic, key and
CRC all match and its arrays have the declared sizes; anything else is treated as absent, so a
corrupt, truncated or foreign file is rebuilt, never trusted. Writes go to a temporary file in the
same directory and are renamed into place, so readers never see half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"GMLXTBL1"
_ALIGN = 64


def default_cache_dir() -> Path:
    """`$GRAMMAR_MLX_CACHE_DIR`, else `$XDG_CACHE_HOME/grammar_mlx`, else `~/.cache/grammar_mlx`."""
    env = os.environ.get("GRAMMAR_MLX_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "grammar_mlx"


def entry_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / key[:2] / f"{key}.gmx"


def write_tables(path: Path, key: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """Write `arrays` and `meta` under `key` to `path` atomically."""
    specs, offset = [], 0
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        offset = -(-offset // _ALIGN) * _ALIGN
        specs.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": offset})
        offset += arr.nbytes
    payload = bytearray(offset)
    for spec, arr in zip(specs, arrays.values()):
        raw = np.ascontiguousarray(arr).tobytes()
        payload[spec["offset"] : spec["offset"] + len(raw)] = raw
    header = json.dumps(
        {"key": key, "arrays": specs, "meta": meta, "size": len(payload), "crc32": zlib.crc32(payload)}
    ).encode()
    pad = (-(len(MAGIC) + 4 + len(header))) % _ALIGN
    header += b" " * pad
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(4, "little") + header)
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_tables(path: Path, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """The arrays and metadata stored under `key`, or None when the file is absent or not trustworthy.

    The file is read into memory, not mapped: a mapped file that someone truncates or rewrites in
    place would change (or crash, SIGBUS) grammars already in use. Arrays are read-only views of it.
    """
    try:
        with open(path, "rb") as f:
            mm = f.read()
    except OSError:
        return None
    try:
        if mm[: len(MAGIC)] != MAGIC:
            return None
        hlen = int.from_bytes(mm[len(MAGIC) : len(MAGIC) + 4], "little")
        start = len(MAGIC) + 4 + hlen
        header = json.loads(bytes(mm[len(MAGIC) + 4 : start]))
        if header.get("key") != key or len(mm) - start != header["size"]:
            return None
        if zlib.crc32(memoryview(mm)[start:]) != header["crc32"]:
            return None
        arrays = {}
        for spec in header["arrays"]:
            dtype = np.dtype(spec["dtype"])
            count = int(np.prod(spec["shape"], dtype=np.int64))
            if spec["offset"] + count * dtype.itemsize > header["size"]:
                return None
            arr = np.frombuffer(mm, dtype=dtype, count=count, offset=start + spec["offset"])
            arrays[spec["name"]] = arr.reshape(spec["shape"])
        return arrays, header["meta"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
