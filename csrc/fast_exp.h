// Vector math for the CPU kernels: exp in a branch-free form that the compiler
// vectorizes inside `#pragma omp simd` loops (a call to std::exp blocks vectorization),
// and per-CPU clones of the hot loops.  No torch headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// The CPU kernels' hot loops are compiled three times on x86-64 with GCC/Clang: for
// AVX-512 (x86-64-v4: AVX512F/BW/CD/DQ/VL, 16 floats a vector), for AVX2 + FMA
// (x86-64-v3, 8 floats) and for the baseline (SSE2); the loader picks the widest the
// running CPU has (GCC's resolver checks the feature bits of each psABI level, so AMD
// and Intel CPUs alike get their widest; "arch=haswell" would go by CPU model).  The
// loops themselves are templates marked PPO_INLINE, so that each clone gets its own
// vectorized copy (in the -fPIC build GCC would otherwise call even small inline
// functions through the PLT, which blocks vectorization).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define PPO_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PPO_CPU_CLONES
#endif
#if defined(__GNUC__)
#define PPO_INLINE inline __attribute__((always_inline))
#else
#define PPO_INLINE inline
#endif

namespace ppo_fast {

// float32: Cody-Waite reduction x = k ln2 + r, Cephes' degree-6 polynomial for exp(r)
// (about 1 ulp), 2^k built in the exponent bits.  k is rounded with the 1.5 * 2^23
// trick (SSE2 has no vector floor).  x is clamped to [-127 ln2, 88] first, so that k is
// in [-127, 127] and the clamp is the only select: k = -127 (x below about -87.68, where
// the exact result is subnormal, < 8.6e-39) builds 2^k as +0 and gives 0, also for -inf;
// x > 88 saturates at exp(88).  NaN passes the clamp (its compares are false) and every
// step after it: NaN in, NaN out.
PPO_INLINE float fast_exp(float x) {
  constexpr float kLow = -88.02969193111305f;  // -127 ln 2
  const float clamped = x < kLow ? kLow : (x > 88.0f ? 88.0f : x);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float k = (clamped * 1.44269504088896341f + kRound) - kRound;
  const float r = (clamped - k * 0.693359375f) + k * 2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float exp_r = poly * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 0 (the bits of +0) for k = -127
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return exp_r * two_k;
}

// float64 (inputs in float64, for gradcheck): std::exp, exact rather than fast.
PPO_INLINE double fast_exp(double x) { return std::exp(x); }

}  // namespace ppo_fast
