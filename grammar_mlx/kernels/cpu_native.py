"""The cpu-native path's primitive (`token_bitmask_cpu.cpp`), built from source on first use.

The source is an MLX custom primitive (a `mlx::core::Primitive` with `eval_cpu`, as in MLX's
"Custom Extensions" guide) bound with nanobind. Its functions take and return `mlx.core.array`s, so
the module must share mlx.core's nanobind ABI and domain: it is compiled against the `nanobind`
package (a dependency, its version pinned in pyproject.toml to one whose internals key matches
mlx.core's) with ``NB_DOMAIN=mlx``, and linked against the ``libmlx.so`` of the installed `mlx`
(its headers ship in the wheel). Built with plain compiler calls (nanobind's `nb_combined.cpp` and
the source, in parallel, then one link: no CMake) into the grammar cache directory
(`compiler.native.build_dir()`, beside the row walk's library), keyed by a hash of the source, the mlx and nanobind
versions and location, the compiler's version and the interpreter's extension suffix; installed
atomically, so concurrent first uses build at most once each and never read a partial file.

Loaded once per process and probed (a tiny mask checked against its known result, which also
proves the array type caster works across the two modules). Where anything is missing (no
compiler, no nanobind, no MLX headers), the build or the probe fails, or ``GRAMMAR_MLX_NATIVE=0``,
`module()` is None and `error()` says why; the kernels then take the cpu-fused / cpu-bitwise paths.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Protocol, cast

import mlx.core as mx

__all__ = ["MODULE_NAME", "SOURCE", "Extension", "build_seconds", "error", "module"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("token_bitmask_cpu.cpp")
MODULE_NAME = "_gm_token_bitmask"  # NB_MODULE's name in the source: the init symbol the loader looks for
BUILD_TIMEOUT_S = 600



class Extension(Protocol):
    """The built module's functions (token_bitmask_cpu.cpp's NB_MODULE)."""

    def apply_rows(self, logits: mx.array, table: mx.array, rows: list[int]) -> mx.array:
        """(B, V) logits masked by rows `rows` (B ids) of one table."""

    def apply_picks(self, logits: mx.array, tables: list[mx.array], picks: list[int], rows: list[int]) -> mx.array:
        """(B, V) logits, row b masked by row rows[b] of tables[picks[b]] (-1: every token allowed)."""


_LOCK = threading.Lock()
_MODULE: Extension | None = None
_ERROR: str | None = None
_TRIED = False
_BUILD_SECONDS: float | None = None


def module() -> Extension | None:
    """The loaded extension module (``apply_rows``, ``apply_picks``), built on the first call; None
    where it cannot be (`error` says why)."""
    if not _TRIED:
        _load_once()
    return _MODULE


def error() -> str | None:
    """Why the cpu-native path cannot run here (None: it can). Builds on the first call."""
    if not _TRIED:
        _load_once()
    return _ERROR


def build_seconds() -> float | None:
    """How long this process spent building the extension (None: it was cached, or not built)."""
    return _BUILD_SECONDS


def _load_once() -> None:
    global _MODULE, _ERROR, _TRIED
    with _LOCK:
        if _TRIED:
            return
        try:
            _MODULE = _load()
        except _Unavailable as exc:
            _ERROR = str(exc)
            log.warning("grammar_mlx cpu-native masking unavailable (%s); using the cpu-fused/cpu-bitwise paths",
                        _ERROR)
        _TRIED = True


class _Unavailable(Exception):
    """Why the extension cannot be built or loaded here."""


def _load() -> Extension:
    if os.environ.get("GRAMMAR_MLX_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
        raise _Unavailable("disabled by GRAMMAR_MLX_NATIVE=0")
    target = _built()
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(target))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, target, loader=loader)
        if spec is None:
            raise ImportError(f"no module spec for {target}")
        loaded = importlib.util.module_from_spec(spec)
        loader.exec_module(loaded)
    except ImportError as exc:
        raise _Unavailable(f"{target} did not load: {exc}") from None
    extension = cast(Extension, loaded)
    _probe(extension)
    return extension


def _probe(loaded: Extension) -> None:
    """Mask a known row and compare: an ABI or domain mismatch shows up here (a TypeError from the
    array caster), not in a caller's mask."""
    try:
        out = loaded.apply_rows(mx.array([[1.5, -0.0, 2.0]]), mx.array([[0b101]], dtype=mx.uint32), [0])
        got = out.view(mx.uint32).tolist()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise _Unavailable(f"the built extension does not run with this mlx: {exc}") from None
    if got != [[0x3FC00000, 0xFF800000, 0x40000000]]:
        raise _Unavailable(f"the built extension masks wrongly here: {got}")


def _built() -> Path:
    """The library's path, built first where the cache has none."""
    from ..compiler import native as compiler_native  # (not at import: the compiler package imports kernels)

    try:
        import nanobind
    except ImportError:
        raise _Unavailable("the nanobind package is not installed") from None
    cxx = compiler_native.find_compiler()
    if cxx is None:
        raise _Unavailable("no C++ compiler ($CXX, g++ or c++) on PATH")
    mlx_dir = Path(mx.__file__).resolve().parent
    include, lib = mlx_dir / "include", mlx_dir / "lib"
    if not (include / "mlx" / "primitives.h").exists() or not any(lib.glob("libmlx.*")):
        raise _Unavailable(f"the mlx package at {mlx_dir} ships no C++ headers or libmlx")
    python_include = sysconfig.get_paths()["include"]
    if not Path(python_include, "Python.h").exists():
        raise _Unavailable(f"no Python.h in {python_include} (Python's development headers)")
    nb_dir = Path(nanobind.include_dir()).parent
    source = SOURCE.read_bytes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    mlx_version = str(mx.__version__)  # type: ignore[attr-defined]
    identity = "\0".join([mlx_version, str(mlx_dir), nanobind.__version__, _compiler_version(cxx), suffix,
                          sys.version])
    tag = hashlib.sha256(source + identity.encode()).hexdigest()[:16]
    directory = compiler_native.build_dir()
    target = directory / f"token_bitmask_cpu-{tag}{suffix}"
    if target.exists():
        return target
    common = ["-std=c++20", "-fPIC", "-fvisibility=hidden", "-DNDEBUG", "-DNB_COMPACT_ASSERTIONS",
              f"-I{python_include}", f"-I{nb_dir / 'include'}"]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as work:
            started = time.perf_counter()
            objects = [Path(work, "nanobind.o"), Path(work, "token_bitmask_cpu.o")]
            # nanobind's library part wants -fno-strict-aliasing (its raw CPython code); the two
            # objects compile in parallel, the larger one being nanobind's.
            commands = [
                [cxx, *common, f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}", "-O2", "-fno-strict-aliasing",
                 "-ffunction-sections", "-fdata-sections", "-c", str(nb_dir / "src" / "nb_combined.cpp"),
                 "-o", str(objects[0])],
                [cxx, *common, "-DNB_DOMAIN=mlx", f"-I{include}", "-O3", "-c", str(SOURCE), "-o", str(objects[1])],
            ]
            _run_all(commands)
            tmp = Path(work, "out.so")
            _run_all([[cxx, "-shared", "-Wl,--gc-sections", *map(str, objects), f"-L{lib}", "-lmlx",
                       f"-Wl,-rpath,{lib}", "-o", str(tmp)]])
            os.replace(tmp, target)  # atomic: a concurrent build writes the same file
            global _BUILD_SECONDS
            _BUILD_SECONDS = time.perf_counter() - started
            log.info("built %s in %.1f s", target, _BUILD_SECONDS)
    except OSError as exc:
        raise _Unavailable(f"cannot build in {directory}: {exc}") from None
    return target


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands side by side; raise `_Unavailable` with the first failure's output."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for c in commands]
    failure = None
    for command, proc in zip(commands, procs):
        try:
            output, _ = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failure = failure or f"{Path(command[0]).name} timed out after {BUILD_TIMEOUT_S} s"
            continue
        if proc.returncode != 0 and failure is None:
            tail = output.decode(errors="replace")[-800:].strip()
            failure = f"{Path(command[0]).name} failed (exit {proc.returncode}): {tail}"
    if failure is not None:
        raise _Unavailable(failure)


def _compiler_version(cxx: str) -> str:
    """The compiler's identity for the cache key (its path and ``--version`` banner)."""
    try:
        banner = subprocess.run([cxx, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise _Unavailable(f"{cxx} --version failed: {exc}") from None
    return f"{shutil.which(cxx)} {banner.decode(errors='replace').splitlines()[:1]}"

