// Per-token PPO loss math, its gradients and the aggregation rule, shared by the CPU
// kernels (csrc/policy_loss.cpp, csrc/value_loss.cpp) and the CUDA kernels
// (csrc/cuda/policy_loss.cu, csrc/cuda/value_loss.cu) so that both
// follow ppo_fast.reference exactly.  No torch headers: the .cu includes it too.
//
// Non-finite values follow torch: max_of / min_of propagate NaN as torch.maximum /
// torch.minimum do, clamp_of keeps NaN as torch.clamp does.  The gradients replay the
// reference's autograd graph step by step with torch's conventions: torch.clamp passes
// gradient on its closed range (and none for NaN), torch.maximum / torch.minimum split
// the gradient in half between equal inputs.  Masked tokens never reach this code:
// the kernels select them away.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "contract.h"

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

// Per-row partial sums of every policy loss's forward (token- and sequence-level), in
// this order: the loss sum, the valid tokens, the tokens behind clipfrac and
// clipfrac_lower, the sum of old - new log-probs (approx_kl).
enum PolicyPartial : int { kPgSum = 0, kCount = 1, kClipfrac = 2, kClipfracLower = 3, kKlSum = 4, kPolicyPartials = 5 };
enum ValuePartial : int { kValueLossSum = 0, kValueCount = 1, kValueClipped = 2, kValuePartials = 3 };

// exp in the compute type T (float, or double for float64 inputs).  On the CPU a
// polynomial that vectorizes; on the GPU expf (the fast-math intrinsic).
#if defined(__CUDACC__)
PPO_HD float exp_of(float x) { return expf(x); }
PPO_HD double exp_of(double x) { return exp(x); }
#else
PPO_HD float exp_of(float x) { return fast_exp(x); }
PPO_HD double exp_of(double x) { return fast_exp(x); }
#endif

// k3 = exp(d) - d - 1 and its derivative exp(d) - 1, in double for every input dtype (so
// that a float32 k3 is rounded once: monotone in d), as reference.k3_of: where |d| < 1
// its Taylor series to d^18 / 18! in nested form, 1/2 (1 + d/3 (1 + d/4 (... (1 + d/18)))),
// whose truncation is below double's rounding there; else the plain form, which no longer
// cancels (a few ulps at |d| = 1).  Both forms are computed and one selected (branch-free).
constexpr double kK3SeriesBelow = 1.0;
constexpr int kK3SeriesTerms = 18;

PPO_HD double k3_series_over_d2(double d) {  // (exp(d) - d - 1) / d^2
  double s = 1.0;
  for (int n = kK3SeriesTerms; n > 2; --n) s = 1.0 + s * d * (1.0 / n);  // no divide: times 1/n rounded
  return 0.5 * s;
}

PPO_HD double k3_of(double d, double exp_d) {
  return std::abs(d) < kK3SeriesBelow ? k3_series_over_d2(d) * (d * d) : exp_d - d - 1.0;
}

// g * d k3 / d d, multiplied out as the reference's autograd does (so that overflow gives
// the same inf or NaN): g (exp(d) - 1) with exp(d) - 1 = d (1 + d series) where the series
// is used, else g exp(d) - g.
PPO_HD double k3_grad(double d, double exp_d, double g) {
  const double expm1 = d * (1.0 + d * k3_series_over_d2(d));
  return std::abs(d) < kK3SeriesBelow ? g * expm1 : g * exp_d - g;
}

// torch.maximum / torch.minimum / torch.clamp on values: NaN in either input gives NaN.
// Written as one select into a temporary, then a second select on an input compare (not
// nested ternaries, nor selects between compares): GCC if-converts and vectorizes chains
// of these in the CPU loops, which it does not for the nested forms.
template <typename T>
PPO_HD T max_of(T a, T b) {
  const T larger = a > b ? a : b;  // b where either is NaN
  return a != a ? a : larger;
}
template <typename T>
PPO_HD T min_of(T a, T b) {
  const T smaller = a < b ? a : b;
  return a != a ? a : smaller;
}
template <typename T>
PPO_HD T clamp_of(T x, T low, T high) {
  const T above = x < low ? low : x;  // NaN stays NaN
  return above > high ? high : above;
}

// The gradient torch.clamp(x, low, high) passes back: all of g on the closed range, none
// outside it or for NaN x.
template <typename T>
PPO_HD T clamp_grad(T x, T low, T high, T g) {
  const T above = x >= low ? g : T(0);
  return x <= high ? above : T(0);
}

// The gradient g that torch.maximum(a, b) passes back to a (to b: max_grad_to(b, a, g)):
// g / 2 where a == b, 0 where a < b, else g (also where either is NaN).  min_grad_to is
// the same for torch.minimum (0 where a > b).
template <typename T>
PPO_HD T max_grad_to(T a, T b, T g) {
  const T passed = a < b ? T(0) : g;
  return a == b ? g * T(0.5) : passed;
}
template <typename T>
PPO_HD T min_grad_to(T a, T b, T g) {
  const T passed = a > b ? T(0) : g;
  return a == b ? g * T(0.5) : passed;
}

// Clip bounds in double as reference.clipped_policy_loss computes them; each kernel
// rounds them to its compute type.
struct PolicyParams {
  double ratio_low;   // 1 - clip_eps_low
  double ratio_high;  // 1 + clip_eps_high
  double dual_clip;   // 0 without dual clip
  double has_dual;    // 1 with dual clip, else 0
};

// From the op's arguments (host side).
inline PolicyParams policy_params(double clip_eps_low, double clip_eps_high, std::optional<double> dual_clip) {
  return {1.0 - clip_eps_low, 1.0 + clip_eps_high, dual_clip.value_or(0.0), dual_clip.has_value() ? 1.0 : 0.0};
}

// The bounds in the compute type, read once per chunk rather than per token.
template <typename T>
struct PolicyBounds {
  T ratio_low, ratio_high, dual, has_dual;
};

template <typename T>
PPO_HD PolicyBounds<T> policy_bounds(const PolicyParams& p) {
  return {static_cast<T>(p.ratio_low), static_cast<T>(p.ratio_high), static_cast<T>(p.dual_clip),
          static_cast<T>(p.has_dual)};
}

// The clip bounds alone (GSPO's, no dual clip): 1 - eps formed in double and rounded once, as the
// reference's Python floats (in float32, 1 - 0.999999 is 1.3% off).
template <typename T>
PPO_HD PolicyBounds<T> clip_bounds(double clip_eps_low, double clip_eps_high) {
  return {static_cast<T>(1.0 - clip_eps_low), static_cast<T>(1.0 + clip_eps_high), T(0), T(0)};
}

// One token of reference.clipped_policy_loss, before the weight:
//   ratio = exp(clamp(logp - old, -20, 20)), unclipped = -A ratio,
//   clipped = -A clamp(ratio, low, high), pg0 = maximum(unclipped, clipped),
//   pg = A < 0 ? minimum(pg0, -A dual) : pg0 with the dual clip, else pg0.
// The intermediates are kept for policy_grad (the compiler drops what a loop does not use).
template <typename T>
struct PolicyTerm {
  T diff, ratio, ratio_clipped, neg_adv, unclipped, clipped, pg0, cap, in_min;
  T pg;          // the unweighted per-token loss
  T is_clipped;  // 1 where clipped > unclipped, else 0 (the reference's clipfrac)
  T is_capped;   // 1 where the dual clip caps pg0 (A < 0 and cap < pg0), else 0
};

template <typename T>
PPO_HD PolicyTerm<T> policy_term(T logp, T old, T adv, PolicyBounds<T> bounds) {
  PolicyTerm<T> t;
  t.diff = logp - old;
  t.ratio = exp_of(clamp_of(t.diff, T(-20), T(20)));
  t.ratio_clipped = clamp_of(t.ratio, bounds.ratio_low, bounds.ratio_high);
  t.neg_adv = -adv;
  t.unclipped = t.neg_adv * t.ratio;
  t.clipped = t.neg_adv * t.ratio_clipped;
  t.pg0 = max_of(t.unclipped, t.clipped);
  t.cap = t.neg_adv * bounds.dual;
  t.in_min = adv < T(0) ? bounds.has_dual : T(0);  // 1 where the reference takes minimum(pg0, cap)
  const T capped_pg = min_of(t.pg0, t.cap);
  t.pg = t.in_min != T(0) ? capped_pg : t.pg0;
  t.is_clipped = t.clipped > t.unclipped ? T(1) : T(0);
  t.is_capped = t.in_min * (t.cap < t.pg0 ? T(1) : T(0));  // 0/1 products: no nested selects
  return t;
}

template <typename T>
struct PolicyGrad {
  T logp;  // d / d logprobs; d / d old_logprobs is its negation
  T adv;   // d / d advantages
};

// The gradients of g * pg, in the order the reference's autograd takes them.
template <typename T>
PPO_HD PolicyGrad<T> policy_grad(const PolicyTerm<T>& t, PolicyBounds<T> bounds, T g) {
  // pg = where(A < 0, minimum(pg0, cap), pg0)
  const T g_pg0_min = min_grad_to(t.pg0, t.cap, g), g_cap_min = min_grad_to(t.cap, t.pg0, g);
  const T g_pg0 = t.in_min != T(0) ? g_pg0_min : g;
  const T g_cap = t.in_min != T(0) ? g_cap_min : T(0);
  // pg0 = maximum(unclipped, clipped)
  const T g_unclipped = max_grad_to(t.unclipped, t.clipped, g_pg0);
  const T g_clipped = max_grad_to(t.clipped, t.unclipped, g_pg0);
  // unclipped = -A ratio, clipped = -A ratio_clipped, cap = -A dual
  const T g_neg_adv = g_unclipped * t.ratio + g_clipped * t.ratio_clipped + g_cap * bounds.dual;
  const T g_ratio =
      g_unclipped * t.neg_adv + clamp_grad(t.ratio, bounds.ratio_low, bounds.ratio_high, g_clipped * t.neg_adv);
  // ratio = exp(clamp(diff, -20, 20)), diff = logp - old
  const T g_diff = clamp_grad(t.diff, T(-20), T(20), g_ratio * t.ratio);
  return {g_diff, -g_neg_adv};
}

// One token of reference.value_loss: 0.5 * maximum((V - R)^2, (clip(V) - R)^2) with
// clip(V) = maximum(minimum(V, old + clip), old - clip).
template <typename T>
struct ValueTerm {
  T high, low, v_min, v_clipped, diff, diff_clipped, unclipped, clipped;
  T loss;        // the per-token loss
  T is_clipped;  // 1 where the clipped term is strictly larger, else 0
};

template <typename T>
PPO_HD ValueTerm<T> value_term(T v, T old, T ret, T clip) {
  ValueTerm<T> t;
  t.high = old + clip;
  t.low = old - clip;
  t.v_min = min_of(v, t.high);
  t.v_clipped = max_of(t.v_min, t.low);
  t.diff = v - ret;
  t.diff_clipped = t.v_clipped - ret;
  t.unclipped = t.diff * t.diff;
  t.clipped = t.diff_clipped * t.diff_clipped;
  t.loss = T(0.5) * max_of(t.unclipped, t.clipped);
  t.is_clipped = t.clipped > t.unclipped ? T(1) : T(0);
  return t;
}

template <typename T>
struct ValueGrad {
  T v, old, ret;  // d / d values, old_values, returns
};

// The gradients of g * loss, in the order the reference's autograd takes them.
template <typename T>
PPO_HD ValueGrad<T> value_grad(const ValueTerm<T>& t, T v, T g) {
  const T g_max = g * T(0.5);
  // maximum(unclipped, clipped); squares: d x^2 = 2 x
  const T g_diff = max_grad_to(t.unclipped, t.clipped, g_max) * (T(2) * t.diff);
  const T g_diff_clipped = max_grad_to(t.clipped, t.unclipped, g_max) * (T(2) * t.diff_clipped);
  // v_clipped = maximum(v_min, low), v_min = minimum(v, high)
  const T g_v_min = max_grad_to(t.v_min, t.low, g_diff_clipped);
  const T g_low = max_grad_to(t.low, t.v_min, g_diff_clipped);
  const T g_v = g_diff + min_grad_to(v, t.high, g_v_min);
  const T g_high = min_grad_to(t.high, v, g_v_min);
  return {g_v, g_high + g_low, -(g_diff + g_diff_clipped)};
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
