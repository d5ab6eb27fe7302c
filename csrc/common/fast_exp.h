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
// A build with PPO_FAST_CPU_CLONE set (setup.py, for tests) compiles the loops for that one
// level only, so that a machine with AVX-512 can run the AVX2 and the baseline code too.
#if !defined(__x86_64__) || !defined(__GNUC__) || defined(__CUDACC__) || defined(PPO_FAST_CPU_CLONE_BASELINE)
#define PPO_CPU_CLONES
#elif defined(PPO_FAST_CPU_CLONE_V3)
#define PPO_CPU_CLONES __attribute__((target("arch=x86-64-v3")))
#elif defined(PPO_FAST_CPU_CLONE_V4)
#define PPO_CPU_CLONES __attribute__((target("arch=x86-64-v4")))
#else
#define PPO_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#if defined(__GNUC__)
#define PPO_INLINE inline __attribute__((always_inline))
#else
#define PPO_INLINE inline
#endif

namespace ppo_fast {

// float32: Cody-Waite reduction x = k ln2 + r, Cephes' degree-6 polynomial for exp(r)
// (about 1 ulp), 2^k built in the exponent bits.  k is rounded with the 1.5 * 2^23
// trick (SSE2 has no vector floor), and read back as an integer from that sum's low
// mantissa bits: bit operations only, so no float-to-int conversion (undefined for NaN).
// x is clamped to [-127 ln2, 89] first, so that k is in [-127, 128]; k = -127 (x below
// about -87.68, where the exact result is subnormal, < 8.6e-39) builds 2^k as +0 and
// gives 0, also for -inf; k = 128 is built as 2^127 * 2, so that exp(x) up to float's
// largest (x = 88.72) is finite and larger x (and +inf) give +inf.  NaN passes the clamp
// (its compares are false) and every step after it: NaN in, NaN out.
PPO_INLINE float fast_exp(float x) {
  constexpr float kLow = -88.02969193111305f;  // -127 ln 2
  constexpr float kHigh = 89.0f;               // above ln(FLT_MAX) = 88.72: exp overflows to +inf
  const float clamped = x < kLow ? kLow : (x > kHigh ? kHigh : x);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = clamped * 1.44269504088896341f + kRound;
  const float k = shifted - kRound;
  const float r = (clamped - k * 0.693359375f) + k * 2.12194440e-4f;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float exp_r = poly * r * r + r + 1.0f;
  // shifted's bits are kRound's plus k (|k| < 2^22 keeps the exponent), in unsigned
  // arithmetic, which wraps instead of overflowing.
  uint32_t shifted_bits, round_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  std::memcpy(&round_bits, &kRound, sizeof(round_bits));
  // k = 128: 2^127, doubled below.
  const uint32_t top = k > 127.0f ? 1u : 0u;
  const uint32_t bits = (shifted_bits - round_bits + 127u - top) << 23;  // 0 (the bits of +0) for k = -127
  float two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return exp_r * two_k * (top ? 2.0f : 1.0f);
}

// float64 (inputs in float64, for gradcheck): std::exp, exact rather than fast.
PPO_INLINE double fast_exp(double x) { return std::exp(x); }

// exp of a double in [-20, 20] (k3's clamped argument) within about 2 ulps, in a form the
// CPU loops vectorize (std::exp does not): x = k ln2 + r with fdlibm's ln2 split (k ln2_hi
// exact), exp(r) by its Taylor series to r^13 / 13! in nested form (truncation below 1e-17
// for |r| <= ln2 / 2), 2^k (|k| <= 29) built in the exponent bits.  NaN in, NaN out.
PPO_INLINE double exp_within_20(double x) {
  constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
  const double shifted = x * 1.4426950408889634 + kRound;
  const double k = shifted - kRound;
  const double r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
  double p = 1.0;
  for (int n = 13; n >= 1; --n) p = 1.0 + p * r * (1.0 / n);
  uint64_t shifted_bits, round_bits;
  std::memcpy(&shifted_bits, &shifted, sizeof(shifted_bits));
  std::memcpy(&round_bits, &kRound, sizeof(round_bits));
  const uint64_t bits = (shifted_bits - round_bits + 1023u) << 52;
  double two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return p * two_k;
}

}  // namespace ppo_fast
