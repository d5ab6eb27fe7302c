// Per-token PPO loss math and the aggregation rule, shared by the CPU kernels
// (csrc/cpu/losses.cpp) and the CUDA kernels (csrc/cuda/losses.cu) so that both
// follow ppo_fast.reference exactly.  No torch headers: the .cu includes it too.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#if !defined(__CUDACC__)
#include "fast_exp.h"
#endif

#if defined(__CUDACC__)
#define PPO_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Forced: in the -fPIC build GCC otherwise calls these through the PLT, and the CPU
// loops calling them do not vectorize.
#define PPO_HD inline __attribute__((always_inline))
#else
#define PPO_HD inline
#endif

namespace ppo_fast {

// Aggregation modes, in the order of ppo_fast.reference.AGG_MODES.
enum Agg : int64_t {
  kTokenMean = 0,
  kTokenSum = 1,
  kSeqMeanTokenSum = 2,
  kSeqMeanTokenMean = 3,
  kSeqMeanTokenSumNorm = 4,
};

// Per-row partial sums written by the forward's first pass, in this order.
enum PolicyPartial : int { kPgSum = 0, kCount = 1, kClipped = 2, kCapped = 3, kKlSum = 4, kPolicyPartials = 5 };
enum ValuePartial : int { kValueLossSum = 0, kValueCount = 1, kValueClipped = 2, kValuePartials = 3 };

// exp and |x| in the compute type T (float, or double for float64 inputs).  On the CPU
// exp is a polynomial that vectorizes; on the GPU expf (the fast-math intrinsic).
#if defined(__CUDACC__)
PPO_HD float exp_of(float x) { return expf(x); }
PPO_HD double exp_of(double x) { return exp(x); }
#else
PPO_HD float exp_of(float x) { return fast_exp(x); }
PPO_HD double exp_of(double x) { return fast_exp(x); }
#endif
PPO_HD float abs_of(float x) { return fabsf(x); }
PPO_HD double abs_of(double x) { return fabs(x); }

// Clip bounds in double as reference.clipped_policy_loss computes them; each kernel
// rounds them to its compute type.
struct PolicyParams {
  double ratio_low;   // 1 - clip_low
  double ratio_high;  // 1 + clip_high
  double dual_clip;   // +inf without dual clip: the cap -A * inf never undercuts pg
};

// From the op's arguments (host side).
inline PolicyParams policy_params(double clip_low, double clip_high, std::optional<double> dual_clip) {
  return {1.0 - clip_low, 1.0 + clip_high, dual_clip.value_or(std::numeric_limits<double>::infinity())};
}

// The bounds in the compute type, read once per chunk rather than per token.
template <typename T>
struct PolicyBounds {
  T low, high, dual;
};

template <typename T>
PPO_HD PolicyBounds<T> policy_bounds(const PolicyParams& p) {
  return {static_cast<T>(p.ratio_low), static_cast<T>(p.ratio_high), static_cast<T>(p.dual_clip)};
}

template <typename T>
struct PolicyTerm {
  T pg;       // the unweighted per-token loss
  T grad;     // d pg / d logprob
  T clipped;  // 1 where the clipped term is strictly larger, else 0
  T capped;   // 1 where the dual clip caps pg, else 0
};

// max(-A * ratio, -A * clip(ratio)) with the dual clip; ternaries (not fmin/fmax)
// so that NaN propagates as in torch.
template <typename T>
PPO_HD PolicyTerm<T> policy_term(T logp, T old, T adv, PolicyBounds<T> bounds) {
  const T low = bounds.low, high = bounds.high;
  const T diff = logp - old;
  const T clamped = diff < T(-20) ? T(-20) : (diff > T(20) ? T(20) : diff);
  const T ratio = exp_of(clamped);
  const T ratio_clipped = ratio < low ? low : (ratio > high ? high : ratio);
  const T unclipped = -adv * ratio;
  const T clipped = -adv * ratio_clipped;
  // Selects on float compares only (no branches, no bools), so that the CPU loops vectorize.
  const T is_clipped = clipped > unclipped ? T(1) : T(0);
  const T pg = clipped > unclipped ? clipped : unclipped;
  const T cap = -adv * bounds.dual;
  const T is_capped = adv < T(0) ? (cap < pg ? T(1) : T(0)) : T(0);
  // The clamp of the log-ratio passes no gradient outside [-20, 20].
  T grad = abs_of(diff) > T(20) ? T(0) : -adv * ratio;
  grad = is_clipped != T(0) ? T(0) : grad;
  grad = is_capped != T(0) ? T(0) : grad;
  return {is_capped != T(0) ? cap : pg, grad, is_clipped, is_capped};
}

template <typename T>
struct ValueTerm {
  T loss;     // 0.5 * max((V - R)^2, (clip(V) - R)^2)
  T grad;     // d loss / d V
  T clipped;  // 1 where the clipped term is strictly larger, else 0
};

template <typename T>
PPO_HD ValueTerm<T> value_term(T v, T old, T ret, double clip) {
  const T high = old + static_cast<T>(clip);
  const T low = old - static_cast<T>(clip);
  T v_clipped = v < high ? v : high;
  v_clipped = v_clipped > low ? v_clipped : low;
  const T unclipped = (v - ret) * (v - ret);
  const T clipped = (v_clipped - ret) * (v_clipped - ret);
  // The clipped term only wins when V lies outside the clip range, where clip(V) is constant.
  return {T(0.5) * (clipped > unclipped ? clipped : unclipped), clipped > unclipped ? T(0) : v - ret,
          clipped > unclipped ? T(1) : T(0)};
}

// d loss / d (sum of row b's masked per-token losses): the loss of every agg mode is
// sum_b row_scale_b * row_sum_b (reference.aggregate; empty selections give 0).
PPO_HD double row_scale(int64_t agg, double row_count, double total_count, double nonempty_rows, int64_t length) {
  const double rows = nonempty_rows > 1.0 ? nonempty_rows : 1.0;
  switch (agg) {
    case kTokenSum:
      return 1.0;
    case kTokenMean:
      return 1.0 / (total_count > 1.0 ? total_count : 1.0);
    case kSeqMeanTokenMean:
      return row_count > 0.0 ? 1.0 / (row_count > 1.0 ? row_count : 1.0) / rows : 0.0;
    case kSeqMeanTokenSum:
      return row_count > 0.0 ? 1.0 / rows : 0.0;
    default:  // kSeqMeanTokenSumNorm
      return row_count > 0.0 ? 1.0 / rows / static_cast<double>(length) : 0.0;
  }
}

// A masked fraction or mean: 0 when nothing is valid (reference.masked_mean).
PPO_HD double safe_mean(double total, double count) { return total / (count > 1.0 ? count : 1.0); }

}  // namespace ppo_fast
