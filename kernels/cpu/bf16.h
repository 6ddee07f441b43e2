// For the CPU kernels that must write torch's bits: include it LAST. From here to the end of
// the including file, fast-math is off and no product is contracted with a sum into an FMA
// (each rounds as torch's element-wise ops round it). The helpers below are defined after that
// pragma on purpose: GCC does not inline a function compiled under other options, and a call
// per element made a kernel many times slower. Float to a K/V dtype (float32 or bfloat16) and back:
// bfloat16 as raw bits with torch's rounding (to nearest even; NaN kept a quiet NaN), written
// out so that the loops around them vectorize.
#pragma once

#pragma GCC optimize("no-fast-math", "fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off) reassociate(off)
#endif

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
