// What an mx.fast.metal_kernel body sees, defined for the host so g++ compiles the exact text
// of grammar_mlx/kernels/*.metal inside the signature MLX generates (see tests/kernels/test_dispatch.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "half_types.h"

// Address spaces mean nothing on the host; [[kernel]], [[buffer(i)]] and the thread-position
// attributes are unknown attributes to g++ (compiled with -Wno-attributes).
#define device
#define constant
#define threadgroup
#define thread

typedef unsigned int uint;
struct uint3 {
  uint x, y, z;
};

namespace metal {
using std::numeric_limits;
}

// MLX's Metal spelling of the dtypes (get_type_string).
using bfloat16_t = HarnessBf16;
using float16_t = HarnessF16;
