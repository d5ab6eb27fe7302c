// Vector math for the CPU kernels: exp in a branch-free form that the compiler
// vectorizes inside `#pragma omp simd` loops (a call to std::exp blocks vectorization),
// and per-CPU clones of the hot loops.  No torch headers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// The CPU kernels' hot loops are compiled twice on x86-64 with GCC/Clang: for AVX2 + FMA
// (8 floats a vector) and for the baseline (SSE2); the loader picks one for the running
// CPU.  "arch=x86-64-v3" is chosen by feature bits; "arch=haswell" would be chosen by CPU
// model, so AMD and later Intel CPUs would run the baseline.  The loops themselves are templates marked PPO_INLINE, so that each clone gets
// its own vectorized copy (in the -fPIC build GCC would otherwise call even small inline
// functions through the PLT, which blocks vectorization).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define PPO_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
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
// trick (SSE2 has no vector floor).  Gives 0 below -87.3 (where the exact result is
// subnormal, < 1.2e-38) and for -inf, saturates at exp(88) for x > 88; NaN stays NaN.
PPO_INLINE float fast_exp(float x) {
  const float clamped = x < -87.5f ? -87.5f : (x > 88.0f ? 88.0f : x);
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
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // -126 <= k <= 127 after the clamp
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return x != x ? x : (x < -87.3f ? 0.0f : exp_r * two_k);
}

// float64 (inputs in float64, for gradcheck): std::exp, exact rather than fast.
PPO_INLINE double fast_exp(double x) { return std::exp(x); }

}  // namespace ppo_fast
