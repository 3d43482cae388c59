// Host stand-ins for the 16-bit float types the kernels are instantiated with (Metal's
// bfloat16_t / float16_t, CUDA's __nv_bfloat16 / __half). They hold the raw bits, so the harness
// compares kernel output bit for bit, and convert from float with round-to-nearest-even like the
// device types do.
#pragma once

#include <cstdint>
#include <cstring>

inline uint32_t harness_float_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  return x;
}

inline uint16_t harness_bf16_from_float(float f) {
  uint32_t x = harness_float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x40u);  // NaN stays NaN (quiet)
  }
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline uint16_t harness_f16_from_float(float f) {
  const uint32_t x = harness_float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x7fffffu;
  const int exp = static_cast<int>((x >> 23) & 0xffu);
  if (exp == 0xff) {
    return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u | (mant >> 13) : 0u));
  }
  const int e = exp - 127 + 15;
  if (e >= 0x1f) {
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (e <= 0) {
    if (e < -10) {
      return static_cast<uint16_t>(sign);
    }
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) {
      ++h;
    }
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) {
    ++h;  // a carry into the exponent is the correct rounding
  }
  return static_cast<uint16_t>(h);
}

struct HarnessBf16 {
  uint16_t bits;
  HarnessBf16() = default;
  HarnessBf16(float f) : bits(harness_bf16_from_float(f)) {}
};

struct HarnessF16 {
  uint16_t bits;
  HarnessF16() = default;
  HarnessF16(float f) : bits(harness_f16_from_float(f)) {}
};

static_assert(sizeof(HarnessBf16) == 2 && sizeof(HarnessF16) == 2, "16-bit stand-ins must be 2 bytes");
