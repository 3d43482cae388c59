// What an mx.fast.cuda_kernel body sees, defined for the host so g++ compiles the exact text
// of grammar_mlx/kernels/*.cu inside the signature MLX generates (see tests/kernels/test_dispatch.py). The launch loop
// in driver.h sets the thread-index builtins before running each simulated thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "half_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__

struct HarnessDim3 {
  unsigned x = 1, y = 1, z = 1;
};

inline HarnessDim3 threadIdx, blockIdx, blockDim, gridDim;

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

namespace cooperative_groups {}

namespace mlx::core::cu {
// MLX passes shapes by value in fixed-size arrays (MAX_NDIM entries).
using Shape = std::array<int32_t, 10>;
using Strides = std::array<int64_t, 10>;
}  // namespace mlx::core::cu

using __half = HarnessF16;
using __nv_bfloat16 = HarnessBf16;
