"""grammar_mlx.kernels.gpu: Metal and CUDA dispatch with MLX's kernel factory replaced (no GPU here),
and the kernel bodies themselves without a GPU: the exact text of kernels/*.metal and kernels/*.cu is
compiled with g++ inside the signature MLX generates for it (mirrored below from MLX's metal_kernel /
cuda_kernel source builders), with tests/kernel_harness/ supplying host stand-ins for the builtins
and a loop over MLX's launch grid, under AddressSanitizer; the CUDA source under nvcc where it is
installed; the sources shipped in an installed package."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import mask_cases
import mlx.core as mx
import numpy as np
import pytest
from mask_cases import DTYPES, all_cases, make_logit_bits, make_table, reference

from grammar_mlx.errors import KernelError
from grammar_mlx.kernels import dispatch, gpu

# The kernels tests' fixtures (mask_cases), bound here so pytest finds them by name.
fresh_row_cache = mask_cases.fresh_row_cache

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parents[1] / "kernel_harness"


# ---------------------------------------------------------------------------------------------
# Dispatch to the kernels, with a fake kernel factory


class FakeKernelFactory:
    def __init__(self):
        self.built = []
        self.calls = []

    def __call__(self, **spec):
        self.built.append(spec)

        def kernel(**call):
            self.calls.append(call)
            return [mx.full(call["output_shapes"][0], 7.0, dtype=call["output_dtypes"][0])]

        return kernel


@pytest.fixture(params=[("metal", "metal_kernel"), ("cuda", "cuda_kernel")], ids=["metal", "cuda"])
def fake_gpu(request, monkeypatch):
    """(backend, a FakeKernelFactory standing in for mx.fast's kernel factory of that backend)."""
    backend, factory_name = request.param
    factory = FakeKernelFactory()
    monkeypatch.setattr(mx.fast, factory_name, factory)
    monkeypatch.setattr(gpu, f"{backend}_available", lambda: True)
    gpu._kernel.cache_clear()
    yield backend, factory
    gpu._kernel.cache_clear()


def test_gpu_dispatch_builds_once_and_passes_rows_not_masks(fake_gpu):
    backend, factory = fake_gpu
    table = mx.array(np.arange(12, dtype=np.uint32).reshape(3, 4))
    for batch, dtype in ((1, mx.float32), (3, mx.bfloat16), (2, mx.float16)):
        logits = mx.zeros((batch, 100), dtype=dtype)
        out = dispatch.apply_token_bitmask(logits, table, np.arange(batch) % 3, path=backend)
        assert out.shape == (batch, 100) and out.dtype == dtype and out[0, 0].item() == 7.0
    assert factory.built == [
        {
            "name": gpu.KERNEL_NAME,
            "input_names": list(gpu.INPUT_NAMES),
            "output_names": list(gpu.OUTPUT_NAMES),
            "source": gpu.kernel_source(backend),
        }
    ]
    for call, (batch, dtype) in zip(factory.calls, ((1, mx.float32), (3, mx.bfloat16), (2, mx.float16))):
        logits_in, table_in, rows_in = call["inputs"]
        assert logits_in.shape == (batch, 100) and logits_in.dtype == dtype
        assert table_in is table  # the device-resident table itself, no per-call mask data
        assert rows_in.dtype == mx.uint32 and rows_in.tolist() == [i % 3 for i in range(batch)]
        assert call["template"] == [("T", dtype)]
        assert (call["grid"], call["threadgroup"]) == gpu.launch_geometry(batch, 100)
        assert call["output_shapes"] == [(batch, 100)] and call["output_dtypes"] == [dtype]
    assert dispatch._ROW_CACHE.nbytes == 0  # nothing unpacked on the host


def test_gpu_row_masker_passes_one_cached_row_id(fake_gpu):
    backend, factory = fake_gpu
    table = mx.array(np.arange(12, dtype=np.uint32).reshape(3, 4))
    mask = dispatch.row_masker(table, 100, mx.bfloat16, path=backend)
    logits = mx.zeros((1, 100), dtype=mx.bfloat16)
    for row in (2, 2, np.int32(1)):
        out = mask(logits, row)
        assert out.shape == (1, 100) and out.dtype == mx.bfloat16
    first, second, third = (call["inputs"] for call in factory.calls)
    assert first[1] is table and first[2].tolist() == [2] and second[2] is first[2]  # made once
    assert third[2].tolist() == [1] and third[2].dtype == mx.uint32
    with pytest.raises(KernelError, match="out of range"):
        mask(logits, 3)


# ---------------------------------------------------------------------------------------------
# The kernel sources in a C++ harness (g++), and the CUDA source under nvcc


# Mirrors MLX's mx.fast.metal_kernel source builder: attributes it adds when the body names them.
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
# What the harness can supply for an attribute, in terms of its launch loop variables.
METAL_ATTRIBUTE_VALUES = {
    "thread_position_in_grid": "uint3{x, y, z}",
    "threads_per_grid": "uint3{gx, gy, gz}",
    "grid_size": "uint3{gx, gy, gz}",
    "thread_position_in_threadgroup": "uint3{x % tx, y % ty, z % tz}",
    "threadgroup_position_in_grid": "uint3{x / tx, y / ty, z / tz}",
    "threads_per_threadgroup": "uint3{tx, ty, tz}",
    "dispatch_threads_per_threadgroup": "uint3{tx, ty, tz}",
}
# Input dtypes by name (the kernel's inputs in INPUT_NAMES order) per logits dtype.
METAL_TYPES = {"float32": "float", "bfloat16": "bfloat16_t", "float16": "float16_t"}
CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
HARNESS_BUFFERS = {  # C++ expressions for each input/output pointer, given T
    "logits": "reinterpret_cast<const T*>(p.logits.data())",
    "mask_table": "p.mask_table.data()",
    "rows": "p.rows.data()",
    "out": "reinterpret_cast<T*>(out_bytes)",
}
HARNESS_SHAPES = {"logits": "{p.batch, p.vocab}", "mask_table": "{p.num_rows, p.num_words}", "rows": "{p.batch}"}
HARNESS_STRIDES = {"logits": "{p.vocab, 1}", "mask_table": "{p.num_words, 1}", "rows": "{1}"}


def input_types(type_names: dict[str, str], dtype: str) -> list[str]:
    return [type_names[dtype], "uint32_t", "uint32_t"]  # logits, mask_table (uint32), rows (uint32)


def metal_kernel_text(source: str, dtype: str) -> tuple[str, str, list[str]]:
    """(function name, text, call arguments) as MLX's metal_kernel writes the kernel for `dtype`."""
    name = f"custom_kernel_{gpu.KERNEL_NAME}_{METAL_TYPES[dtype]}"
    lines = ["template <typename T>", f"[[kernel]] void {name}("]
    args, index = [], 0
    for input_name, type_name in zip(gpu.INPUT_NAMES, input_types(METAL_TYPES, dtype)):
        lines.append(f"  const device {type_name}* {input_name} [[buffer({index})]],")
        args.append(HARNESS_BUFFERS[input_name])
        index += 1
        for suffix, decl in (
            ("_shape", "const constant int*"),
            ("_strides", "const constant int64_t*"),
            ("_ndim", "const constant int&"),
        ):
            if input_name + suffix in source:
                lines.append(f"  {decl} {input_name}{suffix} [[buffer({index})]],")
                args.append(f"{input_name}{suffix}")
                index += 1
    attributes = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]
    for i, output_name in enumerate(gpu.OUTPUT_NAMES):
        last = i == len(gpu.OUTPUT_NAMES) - 1 and not attributes
        lines.append(f"  device {METAL_TYPES[dtype]}* {output_name} [[buffer({index})]]" + (") {" if last else ","))
        args.append(HARNESS_BUFFERS[output_name])
        index += 1
    for i, (attribute, type_name) in enumerate(attributes):
        if attribute not in METAL_ATTRIBUTE_VALUES:
            raise NotImplementedError(f"the harness cannot supply Metal attribute {attribute}")
        lines.append(f"  {type_name} {attribute} [[{attribute}]]" + (") {" if i == len(attributes) - 1 else ","))
        args.append(METAL_ATTRIBUTE_VALUES[attribute])
    return name, "\n".join(lines) + "\n" + source + "\n}\n", args


def metal_translation_unit(source: str) -> str:
    parts = ['#include "metal_shim.h"\n']
    launchers = []
    for dtype, (_, _, _, code) in DTYPES.items():
        name, text, args = metal_kernel_text(source, dtype)
        parts.append(text)
        launchers.append(
            f"""
static void launch_{code}(const HarnessProblem& p, unsigned char* out_bytes) {{
  using T = {METAL_TYPES[dtype]};
  const int logits_shape[] = {HARNESS_SHAPES["logits"]}, mask_table_shape[] = {HARNESS_SHAPES["mask_table"]};
  const int64_t logits_strides[] = {HARNESS_STRIDES["logits"]}, mask_table_strides[] = {HARNESS_STRIDES["mask_table"]};
  const int logits_ndim = 2, mask_table_ndim = 2;
  (void)logits_shape; (void)mask_table_shape; (void)logits_strides; (void)mask_table_strides;
  (void)logits_ndim; (void)mask_table_ndim;
  // Metal dispatches exactly the grid; threadgroups are clipped to it.
  const uint gx = p.grid[0], gy = p.grid[1], gz = p.grid[2];
  const uint tx = std::min<uint>(p.group_size[0], gx), ty = std::min<uint>(p.group_size[1], gy),
             tz = std::min<uint>(p.group_size[2], gz);
  (void)tx; (void)ty; (void)tz;
  for (uint z = 0; z < gz; ++z)
    for (uint y = 0; y < gy; ++y)
      for (uint x = 0; x < gx; ++x)
        {name}<T>({", ".join(args)});
}}
"""
        )
    parts.append("#include <algorithm>\n#include \"driver.h\"\n")
    parts.extend(launchers)
    parts.append(_dispatch())
    return "\n".join(parts)


def cuda_kernel_text(source: str, dtype: str) -> tuple[str, str, list[str]]:
    """(function name, text, call arguments) as MLX's cuda_kernel writes the kernel for `dtype`."""
    name = f"custom_kernel_{gpu.KERNEL_NAME}_{METAL_TYPES[dtype]}"
    lines = ["namespace mlx::core::cu {", "", "namespace cg = cooperative_groups;", "", f"__global__ void {name}("]
    args = []
    for input_name, type_name in zip(gpu.INPUT_NAMES, input_types(CUDA_TYPES, dtype)):
        lines.append(f"    const {type_name}* {input_name},")
        args.append(HARNESS_BUFFERS[input_name])
        for suffix, decl in (
            ("_shape", "const __grid_constant__ Shape"),
            ("_strides", "const __grid_constant__ Strides"),
            ("_ndim", "const __grid_constant__ int"),
        ):
            if input_name + suffix in source:
                lines.append(f"    {decl} {input_name}{suffix},")
                args.append(f"{input_name}{suffix}")
    for i, output_name in enumerate(gpu.OUTPUT_NAMES):
        last = i == len(gpu.OUTPUT_NAMES) - 1
        lines.append(f"    {CUDA_TYPES[dtype]}* {output_name}" + (") {" if last else ","))
        args.append(HARNESS_BUFFERS[output_name])
    lines += [f"  using T = {CUDA_TYPES[dtype]};", ""]
    return name, "\n".join(lines) + "\n" + source + "\n}\n\n} // namespace mlx::core::cu\n", args


def cuda_translation_unit(source: str) -> str:
    parts = ['#include "cuda_shim.h"\n']
    launchers = []
    for dtype, (_, _, _, code) in DTYPES.items():
        name, text, args = cuda_kernel_text(source, dtype)
        parts.append(text)
        launchers.append(
            f"""
static void launch_{code}(const HarnessProblem& p, unsigned char* out_bytes) {{
  using T = {CUDA_TYPES[dtype]};
  using mlx::core::cu::Shape;
  using mlx::core::cu::Strides;
  const Shape logits_shape{{p.batch, p.vocab}}, mask_table_shape{{p.num_rows, p.num_words}};
  const Strides logits_strides{{p.vocab, 1}}, mask_table_strides{{p.num_words, 1}};
  const int logits_ndim = 2, mask_table_ndim = 2;
  (void)logits_shape; (void)mask_table_shape; (void)logits_strides; (void)mask_table_strides;
  (void)logits_ndim; (void)mask_table_ndim;
  // CUDA launches whole blocks: ceil(grid / block) of them in each dimension, as MLX computes.
  blockDim = {{unsigned(p.group_size[0]), unsigned(p.group_size[1]), unsigned(p.group_size[2])}};
  gridDim = {{(p.grid[0] + blockDim.x - 1) / blockDim.x, (p.grid[1] + blockDim.y - 1) / blockDim.y,
             (p.grid[2] + blockDim.z - 1) / blockDim.z}};
  for (unsigned bz = 0; bz < gridDim.z; ++bz)
    for (unsigned by = 0; by < gridDim.y; ++by)
      for (unsigned bx = 0; bx < gridDim.x; ++bx)
        for (unsigned z = 0; z < blockDim.z; ++z)
          for (unsigned y = 0; y < blockDim.y; ++y)
            for (unsigned x = 0; x < blockDim.x; ++x) {{
              blockIdx = {{bx, by, bz}};
              threadIdx = {{x, y, z}};
              mlx::core::cu::{name}({", ".join(args)});
            }}
}}
"""
        )
    parts.append('#include "driver.h"\n')
    parts.extend(launchers)
    parts.append(_dispatch())
    return "\n".join(parts)


def _dispatch() -> str:
    cases = "\n".join(f"    case {code}: launch_{code}(p, out); return;" for *_, code in DTYPES.values())
    return f"""
void harness_launch(const HarnessProblem& p, unsigned char* out) {{
  switch (p.dtype) {{
{cases}
  }}
  std::fprintf(stderr, "unknown dtype %d\\n", p.dtype);
  std::exit(4);
}}
"""


@pytest.fixture(scope="module")
def harness_binaries(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the kernel harness needs a C++17 compiler")
    out_dir = tmp_path_factory.mktemp("kernel_harness")
    binaries = {}
    for backend, unit in (("metal", metal_translation_unit), ("cuda", cuda_translation_unit)):
        cpp = out_dir / f"{backend}_harness.cpp"
        cpp.write_text(unit(gpu.kernel_source(backend)))
        binary = out_dir / f"{backend}_harness"
        flags = ["-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-Wno-attributes",
                 "-Wno-unused-parameter", "-fno-strict-aliasing", "-D_GLIBCXX_SANITIZE_VECTOR",
                 "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
        build = subprocess.run([gxx, *flags, f"-I{HARNESS}", str(cpp), "-o", str(binary)],
                               capture_output=True, text=True, timeout=300)
        assert build.returncode == 0, f"{backend} harness does not compile:\n{build.stderr[-6000:]}"
        binaries[backend] = binary
    return binaries


def run_harness(binary: Path, problems: list[tuple[str, np.ndarray, np.ndarray, list[int]]]) -> list[np.ndarray]:
    """Run each (dtype, logit bits, table, rows) through the harness; returns output bits."""
    payload = bytearray()
    for dtype, bits, table, rows in problems:
        batch, vocab = bits.shape
        grid, threadgroup = gpu.launch_geometry(batch, vocab)
        payload += struct.pack("<11i", DTYPES[dtype][3], batch, vocab, *table.shape, *grid, *threadgroup)
        payload += np.ascontiguousarray(bits).tobytes() + np.ascontiguousarray(table, dtype="<u4").tobytes()
        payload += np.asarray(rows, dtype="<u4").tobytes()
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    run = subprocess.run([str(binary)], input=bytes(payload), capture_output=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-6000:]
    outputs, offset = [], 0
    for _, bits, _, _ in problems:
        size = bits.size * bits.itemsize
        outputs.append(np.frombuffer(run.stdout, dtype=bits.dtype, count=bits.size, offset=offset).reshape(bits.shape))
        offset += size
    assert offset == len(run.stdout)
    return outputs


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_kernel_source_in_harness_matches_reference(harness_binaries, backend):
    problems, expected, names = [], [], []
    for dtype in DTYPES:
        for name, bits, table, rows in all_cases(dtype):
            problems.append((dtype, bits, table, rows))
            expected.append(reference(bits, table, rows, DTYPES[dtype][2]))
            names.append(f"{dtype}/{name}")
    # One full-size problem: Qwen3's table against its padded model width.
    rng = np.random.default_rng(21)
    table = make_table(rng, "random", 3, -(-151_669 // 32))
    bits = make_logit_bits(rng, "bfloat16", 2, 151_936)
    problems.append(("bfloat16", bits, table, [2, 0]))
    expected.append(reference(bits, table, [2, 0], 0xFF80))
    names.append("bfloat16/qwen3-size")
    for name, got, want in zip(names, run_harness(harness_binaries[backend], problems), expected):
        np.testing.assert_array_equal(got, want, err_msg=f"{backend} {name}")


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_kernel_treats_an_out_of_range_row_as_all_disallowed(harness_binaries, backend):
    # apply_token_bitmask rejects such ids before launch; the kernel must still never read past
    # the table (AddressSanitizer watches the exact-size buffers).
    rng = np.random.default_rng(22)
    table = make_table(rng, "ones", 2, 4)
    bits = make_logit_bits(rng, "float32", 3, 100)
    (got,) = run_harness(harness_binaries[backend], [("float32", bits, table, [1, 2, 1_000_000])])
    assert (got[1:] == 0xFF800000).all()
    np.testing.assert_array_equal(got[0, :100], bits[0, :100])


def nvcc_translation_unit(source: str) -> str:
    """The CUDA kernels as MLX's cuda_kernel writes them, after a prelude with the real headers."""
    prelude = textwrap.dedent(
        """
        // Stand-in for MLX's default header (mlx/backend/cuda/device/utils.cuh is not installed):
        // the same CUDA headers and the Shape/Strides types the generated signature uses.
        #include <cooperative_groups.h>
        #include <cuda_bf16.h>
        #include <cuda_fp16.h>
        #include <cuda/std/array>
        #include <cuda/std/limits>

        namespace mlx::core::cu {
        using Shape = cuda::std::array<int32_t, 10>;
        using Strides = cuda::std::array<int64_t, 10>;
        }  // namespace mlx::core::cu

        #define inf cuda::std::numeric_limits<float>::infinity()
        """
    )
    return prelude + "\n".join(cuda_kernel_text(source, dtype)[1] for dtype in DTYPES)


def test_cuda_source_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.access("/usr/local/bin/nvcc", os.X_OK) else None)
    if nvcc is None:
        pytest.skip("nvcc not found: cannot compile the CUDA kernel source")
    unit = tmp_path / "token_bitmask_kernels.cu"
    unit.write_text(nvcc_translation_unit(gpu.kernel_source("cuda")))
    build = subprocess.run([nvcc, "-std=c++17", "-c", str(unit), "-o", str(tmp_path / "kernels.o")],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-6000:]
    # The object holds one kernel per logits dtype (its symbols and device code carry the names MLX
    # gives them), so no dtype's kernel was compiled away.
    built = (tmp_path / "kernels.o").read_bytes()
    for dtype in DTYPES:
        name, _, _ = cuda_kernel_text(gpu.kernel_source("cuda"), dtype)
        assert name.encode() in built, f"{name} is not in the compiled object"


# ---------------------------------------------------------------------------------------------
# Packaging: the sources ship inside the package and load from an installed (non-editable) copy


def test_kernel_sources_load_from_an_installed_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(REPO / "pyproject.toml", src)
    shutil.copytree(REPO / "grammar_mlx", src / "grammar_mlx", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "README.md").write_text("placeholder for the package build\n")
    lib = tmp_path / "site"
    # build_py lays out exactly the files a wheel installs (packages, package-dir, package-data).
    build = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                            "--build-lib", str(lib)], cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    for name in gpu.SOURCE_FILES.values():
        assert (lib / "grammar_mlx" / "kernels" / name).is_file(), f"{name} is not in the built package"
    assert (lib / "grammar_mlx" / "py.typed").is_file(), "py.typed is not in the built package"
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from grammar_mlx.kernels import gpu
        assert Path(gpu.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), gpu.__file__
        for backend, name in gpu.SOURCE_FILES.items():
            assert gpu.kernel_source(backend) == (Path(sys.argv[2]) / name).read_text(encoding="utf-8"), backend
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(lib)
    # Run away from the checkout, with only the built copy importable: grammar_mlx and its kernel
    # sources come from it.
    run = subprocess.run([sys.executable, "-c", script, str(lib), str(REPO / "grammar_mlx" / "kernels")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-4000:]
