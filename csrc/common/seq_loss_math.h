// Per-token math of the sequence-level policy losses (GSPO, GMPO: a per-row reduction
// before the ratio), shared by csrc/policy_loss.cpp and csrc/cuda/policy_loss.cu so
// that both follow ppo_fast.reference.policy_loss_gspo / policy_loss_geo_mean, with the
// torch conventions of loss_math.h (NaN propagation, clamp and max/min gradients).
#pragma once

#include "loss_math.h"

namespace ppo_fast {

// The policy-loss modes the native kernels compute (CPU and CUDA): the sequence-level losses'
// kernels take kGspo and kGeoMean, the one-pass loss (csrc/linear_policy_loss.cpp) kVanilla and kGspo.
enum class PolicyMode : int { kVanilla = 0, kGspo = 1, kGeoMean = 2 };

// Each mode's operator names (schemas in csrc/policy_loss.cpp), for the kernels' messages.
constexpr const char* seq_loss_op_name(PolicyMode mode) {
  return mode == PolicyMode::kGspo ? "policy_loss_gspo" : "policy_loss_geo_mean";
}
constexpr const char* seq_loss_backward_op_name(PolicyMode mode) {
  return mode == PolicyMode::kGspo ? "policy_loss_gspo_backward" : "policy_loss_geo_mean_backward";
}
constexpr const char* seq_loss_varlen_op_name(PolicyMode mode) {
  return mode == PolicyMode::kGspo ? "policy_loss_gspo_varlen" : "policy_loss_geo_mean_varlen";
}
constexpr const char* seq_loss_varlen_backward_op_name(PolicyMode mode) {
  return mode == PolicyMode::kGspo ? "policy_loss_gspo_varlen_backward" : "policy_loss_geo_mean_varlen_backward";
}

// Per-row values a sequence-level forward keeps for its backward ([B, kRowState]).
// GSPO: the row's mean log-ratio s.  GMPO: d row_loss / d (row sum of the kept log-ratios)
// and d row_loss / d (row sum of the advantages), both already divided by the row's count.
constexpr int kRowState = 2;

// GSPO, one token of a row whose mean log-ratio is s:  ratio = exp(min(log_ratio, 10)) with
// log_ratio = (logp - logp) + s, the reference's exp(clamp(logp - sg(logp) + sg(s), max=10)):
// logp - logp is 0, or NaN where logp is NaN or +-inf (as in the reference), so that a
// non-finite log-prob at a valid token makes its loss NaN on every backend.
template <typename T>
struct GspoTerm {
  T log_ratio, ratio, ratio_clipped, neg_adv, unclipped, clipped;
  T pg;          // the unweighted per-token loss
  T is_clipped;  // 1 where clipped > unclipped
};

template <typename T>
PPO_HD GspoTerm<T> gspo_term(T s, T logp, T adv, T ratio_low, T ratio_high) {
  GspoTerm<T> t;
  t.log_ratio = (logp - logp) + s;
  t.ratio = exp_of(t.log_ratio > T(10) ? T(10) : t.log_ratio);  // NaN stays NaN
  t.ratio_clipped = clamp_of(t.ratio, ratio_low, ratio_high);
  t.neg_adv = -adv;
  t.unclipped = t.neg_adv * t.ratio;
  t.clipped = t.neg_adv * t.ratio_clipped;
  t.pg = max_of(t.unclipped, t.clipped);
  t.is_clipped = t.clipped > t.unclipped ? T(1) : T(0);
  return t;
}

// d (g * pg) / d logprobs (through the token's own pi / sg(pi)) and / d advantages.
template <typename T>
PPO_HD PolicyGrad<T> gspo_grad(const GspoTerm<T>& t, T ratio_low, T ratio_high, T g) {
  const T g_unclipped = max_grad_to(t.unclipped, t.clipped, g);
  const T g_clipped = max_grad_to(t.clipped, t.unclipped, g);
  const T g_ratio = g_unclipped * t.neg_adv + clamp_grad(t.ratio, ratio_low, ratio_high, g_clipped * t.neg_adv);
  const T g_log = t.log_ratio <= T(10) ? g_ratio * t.ratio : T(0);  // torch.clamp(max=10): closed range, none for NaN
  return {g_log, -(g_unclipped * t.ratio + g_clipped * t.ratio_clipped)};
}

// GMPO, one token: the log-ratio kept by the sign-aware clip,
//   kept = sign(A) * min(sign(A) * lr, sign(A) * clamp(lr, -eps_low, eps_high)),  lr = logp - old,
// and whether the clamp moved lr (the clip fractions).
template <typename T>
struct GeoTerm {
  T log_ratio, clamped, sign, kept;
  T is_clipped;  // 1 where clamp(lr) != lr (NaN too, as torch.ne)
};

template <typename T>
PPO_HD GeoTerm<T> geo_term(T logp, T old, T adv, T eps_low, T eps_high) {
  GeoTerm<T> t;
  t.log_ratio = logp - old;
  t.clamped = clamp_of(t.log_ratio, -eps_low, eps_high);
  t.sign = adv > T(0) ? T(1) : (adv < T(0) ? T(-1) : adv);  // torch.sign (NaN stays NaN)
  t.kept = t.sign * min_of(t.sign * t.log_ratio, t.sign * t.clamped);
  t.is_clipped = t.log_ratio != t.clamped ? T(1) : T(0);
  return t;
}

// d (g * kept) / d lr, step by step as the reference's autograd (its selects drop a NaN
// upstream where the path is cut, as torch.minimum / torch.clamp do).
template <typename T>
PPO_HD T geo_kept_grad(const GeoTerm<T>& t, T eps_low, T eps_high, T g) {
  const T g_min = g * t.sign;
  const T a = t.sign * t.log_ratio, b = t.sign * t.clamped;
  const T g_a = min_grad_to(a, b, g_min), g_b = min_grad_to(b, a, g_min);
  return g_a * t.sign + clamp_grad(t.log_ratio, -eps_low, eps_high, g_b * t.sign);
}

// The GMPO row: row_loss = -(sum A / n) * exp(sum kept / n) * exp(sum log(w + 1e-10) / n)
// (n = max(count, 1); the weight factor only with weights).  Writes the row state.
template <typename T>
PPO_HD T geo_row(T kept_sum, T adv_sum, T log_w_sum, T count, T* state) {
  const T n = count > T(1) ? count : T(1);
  const T factor = exp_of(kept_sum / n) * exp_of(log_w_sum / n);
  const T row_loss = -(adv_sum / n) * factor;
  state[0] = row_loss / n;  // d row_loss / d kept_t (and / d log w_t)
  state[1] = -factor / n;   // d row_loss / d A_t
  return row_loss;
}

}  // namespace ppo_fast
