// The KL estimators (ppo_fast.spec.KL_ESTIMATORS) on the C++ side, in one place: their list,
// from which the enum, the parser and the dispatch are made, and the per-token value and
// gradient of each.  A new estimator is one line of PPO_KL_ESTIMATORS and one branch in each
// of kl_value and kl_grad; one without its branches fails to compile (static_assert), never
// computes another.  CPU only (no CUDA kernel takes a KL).  FMA contraction is the includer's
// choice: kl_penalized_rewards.cpp turns it off before including this, so that the gradients
// overflow as the reference's autograd does.
#pragma once

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "fast_exp.h"
#include "loss_math.h"  // clamp_of, clamp_grad, k3_of, k3_grad

namespace ppo_fast {

// X(enumerator, name): the estimators, in spec.KL_ESTIMATORS' order.
#define PPO_KL_ESTIMATORS(X) X(kK1, "k1") X(kK2, "k2") X(kK3, "k3") X(kAbs, "abs")

#define PPO_KL_ENUMERATOR(e, name) e,
enum KlEstimator : int64_t { PPO_KL_ESTIMATORS(PPO_KL_ENUMERATOR) };
#undef PPO_KL_ENUMERATOR

// `op` names the calling op in the error.
inline KlEstimator parse_kl_estimator(const char* op, std::string_view kl_estimator) {
#define PPO_KL_PARSE(e, name) \
  if (kl_estimator == name) return e;
  PPO_KL_ESTIMATORS(PPO_KL_PARSE)
#undef PPO_KL_PARSE
  std::string names;
#define PPO_KL_NAME(e, name) names += std::string(names.empty() ? "'" : ", '") + name + "'";
  PPO_KL_ESTIMATORS(PPO_KL_NAME)
#undef PPO_KL_NAME
  TORCH_CHECK(false, op, ": kl_estimator must be one of ", names, ", got '", kl_estimator, "'");
}

// f(std::integral_constant<KlEstimator, e>{}) for the runtime e: one instantiation per
// estimator, so that per-token loops carry no switch.  The cases come from the list: none is
// missing and there is no default to fall into.
template <typename F>
inline decltype(auto) with_kl_estimator(KlEstimator estimator, F&& f) {
  switch (estimator) {
#define PPO_KL_CASE(e, name) \
  case e:                    \
    return f(std::integral_constant<KlEstimator, e>{});
    PPO_KL_ESTIMATORS(PPO_KL_CASE)
#undef PPO_KL_CASE
  }
  TORCH_CHECK(false, "kl_estimator: no estimator has the value ", int64_t(estimator));
}

template <KlEstimator>
inline constexpr bool kNoKlBranch = false;

// exp(d) for k3 of T inputs: float32 ones are rounded from double once, so an exp that
// vectorizes is exact enough; float64 ones (gradcheck) take std::exp.
template <typename T>
PPO_INLINE double k3_exp(double d) {
  if constexpr (std::is_same_v<T, float>) return exp_within_20(d);
  return std::exp(d);
}

// reference.kl_estimate of one token, in T (k3 in double and rounded once: k3_of; its inner
// clamp only keeps exp finite for +-inf inputs).
template <KlEstimator estimator, typename T>
PPO_INLINE T kl_value(T logp, T ref) {
  const T log_ratio = logp - ref;
  if constexpr (estimator == kK1) {
    return log_ratio;
  } else if constexpr (estimator == kK2) {
    return T(0.5) * (log_ratio * log_ratio);
  } else if constexpr (estimator == kAbs) {
    return std::abs(log_ratio);
  } else if constexpr (estimator == kK3) {
    const double d = clamp_of(double(-log_ratio), -20.0, 20.0);
    return T(clamp_of(k3_of(d, k3_exp<T>(d)), -10.0, 10.0));
  } else {
    static_assert(kNoKlBranch<estimator>, "a KL estimator without its kl_value branch");
  }
}

// g * d kl / d log_ratio (d / d logp; d / d ref is its negation), in the order the
// reference's autograd takes it: abs passes g * sign(x) with sign(0) = sign(NaN) = 0,
// clamps pass gradient on their closed range.
template <KlEstimator estimator, typename T>
PPO_INLINE T kl_grad(T logp, T ref, T g) {
  const T log_ratio = logp - ref;
  if constexpr (estimator == kK1) {
    return g;
  } else if constexpr (estimator == kK2) {
    return (g * T(0.5)) * (T(2) * log_ratio);
  } else if constexpr (estimator == kAbs) {
    const T positive = log_ratio > T(0) ? T(1) : T(0);
    return g * (log_ratio < T(0) ? T(-1) : positive);
  } else if constexpr (estimator == kK3) {
    const double neg = -log_ratio;
    const double d = clamp_of(neg, -20.0, 20.0);
    const double exp_d = k3_exp<T>(d);
    const double g_inner = clamp_grad(k3_of(d, exp_d), -10.0, 10.0, double(g));
    return T(-clamp_grad(neg, -20.0, 20.0, k3_grad(d, exp_d, g_inner)));
  } else {
    static_assert(kNoKlBranch<estimator>, "a KL estimator without its kl_grad branch");
  }
}

}  // namespace ppo_fast
