// Float to a K/V dtype (float32 or bfloat16) and back, for the CPU kernels that must write
// torch's bits: bfloat16 as raw bits with torch's rounding (to nearest even; NaN kept a quiet
// NaN), written out so that the loops around them vectorize.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace blendkv_cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
inline T round_to(float x);
template <>
inline float round_to<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  u = nan ? 0x7fc00000u : u + 0x7fffu + ((u >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}

}  // namespace blendkv_cpu
