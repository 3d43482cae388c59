"""grammar_mlx.kernels.cpu_native: the cpu-native primitive (token_bitmask_cpu.cpp) bit for bit against the
numpy reference at a real vocabulary's width, through each entry point (batches, single rows, mixed
tables), on MLX's other streams and threads; that it touches no row cache; and the build: once per
cache directory, atomic, and every way it can fail leaves the cpu-fused / cpu-bitwise paths with
the reason shown. (The shared cases, every dtype, mask kind and layout, run on cpu-native too:
test_cpu.py and test_dispatch.py parametrize over every CPU path.)"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mask_cases
import mlx.core as mx
import numpy as np
import pytest
from mask_cases import DTYPES, cached_paths, make_logit_bits, make_table, reference, spy, to_bits, to_mx

from grammar_mlx.compiler import native as compiler_native
from grammar_mlx.errors import KernelError
from grammar_mlx.kernels import cpu, cpu_native, dispatch

fresh_row_cache = mask_cases.fresh_row_cache

REPO = Path(__file__).resolve().parents[2]
TOOLCHAIN = bool(shutil.which(os.environ.get("CXX") or "g++")) and importlib.util.find_spec("nanobind") is not None
needs_native = pytest.mark.skipif(dispatch.cpu_native_error() is not None,
                                  reason=f"cpu-native unavailable here: {dispatch.cpu_native_error()}")
QWEN_V = 151_936  # 4,748 words exactly


def test_it_builds_and_is_the_default_wherever_the_toolchain_is():
    if not TOOLCHAIN:
        pytest.skip("no g++ or no nanobind here")
    assert dispatch.cpu_native_error() is None
    assert dispatch.default_path() == "cpu-native"
    assert dispatch.available_paths()[0] == "cpu-native"


@needs_native
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("vocab, words", [(QWEN_V, 4748), (QWEN_V, 4700), (QWEN_V - 7, 4748)],
                         ids=["V=32W", "V>32W", "padding-bits"])
def test_full_vocabulary_batches_match_reference(dtype, batch, vocab, words):
    rng = np.random.default_rng([batch, words, vocab])
    table_np = np.concatenate([make_table(rng, kind, 2, words) for kind in mask_cases.MASK_KINDS])
    rows = rng.integers(0, len(table_np), batch).tolist()
    bits = make_logit_bits(rng, dtype, batch, vocab)
    out = dispatch.apply_token_bitmask(to_mx(bits, dtype), mx.array(table_np), rows, path="cpu-native")
    assert out.dtype == DTYPES[dtype][0] and out.shape == (batch, vocab)
    np.testing.assert_array_equal(to_bits(out, dtype), reference(bits, table_np, rows, DTYPES[dtype][2]))


@needs_native
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mixed_tables_of_several_widths_and_free_rows_match_each_row_alone(dtype):
    rng = np.random.default_rng(3)
    vocab = 5000
    wide, narrow = make_table(rng, "random", 3, 157), make_table(rng, "sparse", 2, 100)  # narrow: V > 32 W
    tables = (mx.array(wide), mx.array(narrow))
    picks = [(tables[0], 2), None, (tables[1], 1), (tables[0], 0), (tables[1], 1), None]
    bits = make_logit_bits(rng, dtype, len(picks), vocab)
    out = to_bits(dispatch.apply_token_bitmasks(to_mx(bits, dtype), picks, path="cpu-native"), dtype)
    for b, pick in enumerate(picks):
        if pick is None:
            np.testing.assert_array_equal(out[b], bits[b])
        else:
            source = wide if pick[0] is tables[0] else narrow
            np.testing.assert_array_equal(out[b], reference(bits[b : b + 1], source, [pick[1]], DTYPES[dtype][2])[0])
    for path in cached_paths():  # the same batch on the cached paths: equal bit for bit
        np.testing.assert_array_equal(to_bits(dispatch.apply_token_bitmasks(to_mx(bits, dtype), picks, path=path),
                                              dtype), out)


@needs_native
@pytest.mark.parametrize("layout", ["reversed", "broadcast", "sliced-rows"])
def test_strided_logits(layout):
    rng = np.random.default_rng(4)
    vocab, table_np = 1001, make_table(rng, "random", 4, 32)
    bits = make_logit_bits(rng, "float32", 4, vocab)
    base = to_mx(bits, "float32")
    if layout == "reversed":
        logits, expected_bits = base[:, ::-1], bits[:, ::-1]
    elif layout == "broadcast":
        logits, expected_bits = mx.broadcast_to(base[:1], (4, vocab)), np.repeat(bits[:1], 4, axis=0)
    else:
        logits, expected_bits = base[::2], bits[::2]
    rows = list(range(logits.shape[0]))
    out = dispatch.apply_token_bitmask(logits, mx.array(table_np), rows, path="cpu-native")
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(expected_bits, table_np, rows, 0xFF800000))


@needs_native
def test_it_uses_no_row_cache_and_unpacks_nothing(monkeypatch):
    """Single rows (first use and after), the per-token masker, batches and mixed picks: every
    mask is read from the packed words by the primitive, so a row's first use costs its later ones."""
    unpacked, scanned = spy(monkeypatch, cpu, "unpack"), spy(monkeypatch, cpu, "sparse_form")
    rng = np.random.default_rng(5)
    vocab = 3000
    table_np = np.concatenate([make_table(rng, kind, 1, 94) for kind in mask_cases.MASK_KINDS])
    table = mx.array(table_np)
    bits = make_logit_bits(rng, "bfloat16", 3, vocab)
    mask = dispatch.row_masker(table, vocab, mx.bfloat16)
    for r in range(len(table_np)):
        for out in (mask(to_mx(bits[:1], "bfloat16"), r),
                    dispatch.apply_token_bitmask(to_mx(bits[:1], "bfloat16"), table, [r])):
            np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits[:1], table_np, [r], 0xFF80))
    out = dispatch.apply_token_bitmask(to_mx(bits, "bfloat16"), table, [4, 0, 4])
    np.testing.assert_array_equal(to_bits(out, "bfloat16"), reference(bits, table_np, [4, 0, 4], 0xFF80))
    other = mx.array(table_np[::-1].copy())
    out = dispatch.apply_token_bitmasks(to_mx(bits, "bfloat16"), [(table, 1), None, (other, 0)])
    np.testing.assert_array_equal(to_bits(out, "bfloat16")[[0, 2]],
                                  reference(bits[[0, 2]], table_np, [1, 4], 0xFF80))
    assert unpacked == [] and scanned == [] and dispatch._ROW_CACHE.keys() == []


@needs_native
def test_masks_on_another_stream_from_several_threads_and_inside_compile():
    """mlx-lm evaluates on a generation stream (`async_eval`) and a server masks from its own
    threads: the primitive runs where MLX schedules it, with no Python in its eval."""
    rng = np.random.default_rng(6)
    vocab, table_np = 2000, make_table(rng, "random", 8, 63)
    table = mx.array(table_np)
    stream = mx.new_stream(mx.cpu)
    bits = make_logit_bits(rng, "float16", 8, vocab)
    with mx.stream(stream):
        out = dispatch.apply_token_bitmask(to_mx(bits, "float16"), table, list(range(8)))
        mx.async_eval(out)
    np.testing.assert_array_equal(to_bits(out, "float16"), reference(bits, table_np, list(range(8)), 0xFC00))

    failures: list[str] = []

    def worker(seed: int) -> None:
        local = np.random.default_rng(seed)
        for _ in range(20):
            rows = local.integers(0, 8, 3).tolist()
            b = make_logit_bits(local, "float32", 3, vocab)
            got = to_bits(dispatch.apply_token_bitmask(to_mx(b, "float32"), table, rows), "float32")
            if not np.array_equal(got, reference(b, table_np, rows, 0xFF800000)):
                failures.append(f"thread {seed}: rows {rows}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []

    compiled = mx.compile(lambda x: dispatch.apply_token_bitmask(x, table, [3, 1], path="cpu-native"))
    b = make_logit_bits(rng, "float32", 2, vocab)
    np.testing.assert_array_equal(to_bits(compiled(to_mx(b, "float32")), "float32"),
                                  reference(b, table_np, [3, 1], 0xFF800000))


@needs_native
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x, t: m.apply_picks(x, [t], [0, 0], [0, 9]), "row id out of range"),
        (lambda m, x, t: m.apply_picks(x, [t], [0], [0, 0]), "one row id and one table pick per row"),
        (lambda m, x, t: m.apply_picks(x, [t], [1, -1], [0, 0]), "table pick out of range"),
        (lambda m, x, t: m.apply_rows(x.astype(mx.int32), t, [0, 0]), "float32, bfloat16 or float16"),
        (lambda m, x, t: m.apply_rows(x, t.astype(mx.int32), [0, 0]), "2-D uint32"),
        (lambda m, x, t: m.apply_rows(x[:, :10], mx.zeros((1, 2), dtype=mx.uint32), [0, 0]), "wider than"),
        (lambda m, x, t: m.apply_rows(x[0], t, [0]), "2-D"),
    ],
)
def test_the_primitive_checks_its_own_inputs(call, message):
    """The entry points check first (KernelError); the primitive refuses bad input by itself too,
    so no call can make it read outside a table."""
    with pytest.raises(ValueError, match=message):
        call(cpu_native.module(), mx.zeros((2, 64)), mx.zeros((4, 2), dtype=mx.uint32))


def test_without_the_primitive_the_cached_paths_take_over(monkeypatch):
    """A failed build leaves cpu-fused / cpu-bitwise, the reason readable, and every entry point
    exact; naming cpu-native then raises KernelError with the reason."""
    monkeypatch.setattr(cpu_native, "_TRIED", True)
    monkeypatch.setattr(cpu_native, "_MODULE", None)
    monkeypatch.setattr(cpu_native, "_ERROR", "g++ failed (exit 1): boom")
    assert dispatch.cpu_native_error() == "g++ failed (exit 1): boom"
    assert "cpu-native" not in dispatch.available_paths()
    assert dispatch.default_path() == cached_paths()[0]
    rng = np.random.default_rng(7)
    vocab, table_np = 1001, make_table(rng, "random", 4, 32)
    table = mx.array(table_np)
    bits = make_logit_bits(rng, "float32", 3, vocab)
    out = dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, [3, 0, 1])
    np.testing.assert_array_equal(to_bits(out, "float32"), reference(bits, table_np, [3, 0, 1], 0xFF800000))
    mask = dispatch.row_masker(table, vocab, mx.float32)
    np.testing.assert_array_equal(to_bits(mask(to_mx(bits[:1], "float32"), 2), "float32"),
                                  reference(bits[:1], table_np, [2], 0xFF800000))
    out = dispatch.apply_token_bitmasks(to_mx(bits, "float32"), [(table, 1), None, (mx.array(table_np[:2]), 0)])
    np.testing.assert_array_equal(to_bits(out, "float32")[[0, 2]], reference(bits[[0, 2]], table_np, [1, 0],
                                                                                0xFF800000))
    for call in (lambda: dispatch.apply_token_bitmask(to_mx(bits, "float32"), table, [0, 0, 0], path="cpu-native"),
                 lambda: dispatch.row_masker(table, vocab, mx.float32, path="cpu-native")):
        with pytest.raises(KernelError, match="'cpu-native' cannot run here: g\\+\\+ failed"):
            call()


@pytest.mark.parametrize("problem", ["disabled", "no nanobind", "no compiler", "compiler fails", "no headers"])
def test_each_build_problem_is_named(problem, monkeypatch, tmp_path):
    monkeypatch.setattr(compiler_native, "build_dir", lambda: tmp_path)
    if problem == "disabled":
        monkeypatch.setenv("GRAMMAR_MLX_NATIVE", "0")
        expected = "disabled by GRAMMAR_MLX_NATIVE=0"
    elif problem == "no nanobind":
        monkeypatch.setitem(sys.modules, "nanobind", None)  # import raises ImportError
        expected = "nanobind package is not installed"
    elif problem == "no compiler":
        if importlib.util.find_spec("nanobind") is None:
            pytest.skip("needs nanobind to reach the compiler check")
        monkeypatch.setattr(compiler_native, "find_compiler", lambda: None)
        expected = "no C\\+\\+ compiler"
    elif problem == "compiler fails":
        if importlib.util.find_spec("nanobind") is None:
            pytest.skip("needs nanobind to reach the compiler")
        monkeypatch.setattr(compiler_native, "find_compiler", lambda: "false")  # exits 1, prints nothing
        expected = "false failed \\(exit 1\\)"
    else:
        if importlib.util.find_spec("nanobind") is None or shutil.which("g++") is None:
            pytest.skip("needs nanobind and g++ to reach the header check")
        monkeypatch.setattr(mx, "__file__", str(tmp_path / "core.so"))
        expected = "ships no C\\+\\+ headers or libmlx"
    with pytest.raises(cpu_native._Unavailable, match=expected):
        cpu_native._load()
    assert [p.name for p in tmp_path.iterdir()] == [], "a failed build leaves nothing behind"


@pytest.mark.skipif(not TOOLCHAIN, reason="no g++ or no nanobind here")
def test_a_fresh_cache_builds_once_atomically_then_loads(tmp_path):
    """Two processes start on an empty cache directory at once: both build (or one finds the
    other's file), both mask exactly, and one library is left, no temporary; a third loads it
    without building."""
    script = textwrap.dedent(
        """
        import mlx.core as mx
        from grammar_mlx.kernels import cpu_native, dispatch
        assert dispatch.cpu_native_error() is None, dispatch.cpu_native_error()
        out = dispatch.apply_token_bitmask(mx.array([[1.0, 2.0, 3.0]]), mx.array([[5]], dtype=mx.uint32), [0])
        assert out.tolist() == [[1.0, float("-inf"), 3.0]], out.tolist()
        print(cpu_native.build_seconds())
        """
    )
    env = {**os.environ, "GRAMMAR_MLX_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    first = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in first]
    for proc, (_, err) in zip(first, results):
        assert proc.returncode == 0, err[-2000:]
    assert any(out.strip() != "None" for out, _ in results), "someone built it"
    built = sorted((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith("token_bitmask_cpu-"), built
    third = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-2000:]
    assert third.stdout.strip() == "None", "loaded from the cache, not built again"
