// The autograd of kl_estimate and kl_penalized_rewards (csrc/kl_penalized_rewards.cpp).
// kl_penalized_rewards' kl is often only a statistic: an unused output brings no gradient term
// (grads are not materialized; the backward op takes each upstream gradient as optional).
#include <torch/library.h>

#include <string>

#include "common/autograd.h"

namespace ppo_fast {
namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;

OptTensor optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// ----------------------------------------------------------------------------- kl_estimate

using KlForward = Tensor(const Tensor&, const Tensor&, c10::string_view);
using KlBackward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, c10::string_view,
                                              std::array<bool, 2>);
constexpr char kKlBackward[] = "ppo_fast::kl_estimate_backward";

struct KlEstimate : LeanFunction<KlEstimate> {
  static Tensor forward(LeanContext* ctx, const Tensor& logprobs, const Tensor& ref_logprobs,
                        c10::string_view kl_estimator) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<KlForward>("ppo_fast::kl_estimate");
    ctx->save_for_backward({logprobs, ref_logprobs});
    ctx->saved_data["kl_estimator"] = std::string(kl_estimator);
    return op.call(logprobs, ref_logprobs, kl_estimator);
  }

  static variable_list backward(LeanContext* ctx, variable_list grads) {
    static const auto op = typed_op<KlBackward>(kKlBackward);
    const variable_list saved = ctx->get_saved_variables();
    const std::array<bool, 2> want{needs_grad(ctx, 0), needs_grad(ctx, 1)};
    auto [logprobs, ref_logprobs] =
        op.call(grads[0], saved[0], saved[1], ctx->saved_data.at("kl_estimator").toStringRef(), want);
    return {wanted(logprobs, want[0]), wanted(ref_logprobs, want[1]), Tensor()};
  }

  static Tensor kernel(const Tensor& logprobs, const Tensor& ref_logprobs, c10::string_view kl_estimator) {
    if (!records_autograd(logprobs, ref_logprobs)) {
      static const auto op = typed_op<KlForward>("ppo_fast::kl_estimate");
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.call(logprobs, ref_logprobs, kl_estimator);
    }
    return apply(logprobs, ref_logprobs, kl_estimator);
  }
};

// ----------------------------------------------------------------------------- kl_penalized_rewards

using Pair = std::tuple<Tensor, Tensor>;
using Triple = std::tuple<Tensor, Tensor, Tensor>;
using PenalizedForward = Pair(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, c10::string_view);
using PenalizedBackward = Triple(const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                                 double, c10::string_view, at::ScalarType, std::array<bool, 3>);
constexpr char kPenalizedBackward[] = "ppo_fast::kl_penalized_rewards_backward";

struct KlPenalizedRewards : LeanFunction<KlPenalizedRewards> {
  static variable_list forward(LeanContext* ctx, const Tensor& scores, const Tensor& logprobs,
                               const Tensor& ref_logprobs, const Tensor& mask, double kl_coef,
                               c10::string_view kl_estimator) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<PenalizedForward>("ppo_fast::kl_penalized_rewards");
    auto [rewards, kl] = op.call(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator);
    ctx->save_for_backward({logprobs, ref_logprobs, mask});
    ctx->saved_data["kl_coef"] = kl_coef;
    ctx->saved_data["kl_estimator"] = std::string(kl_estimator);
    ctx->saved_data["scores_dtype"] = static_cast<int64_t>(scores.scalar_type());
    ctx->set_materialize_grads(false);
    return {rewards, kl};
  }

  static variable_list backward(LeanContext* ctx, variable_list grads) {
    static const auto op = typed_op<PenalizedBackward>(kPenalizedBackward);
    const variable_list saved = ctx->get_saved_variables();
    const auto& data = ctx->saved_data;
    const std::array<bool, 3> want{needs_grad(ctx, 0), needs_grad(ctx, 1), needs_grad(ctx, 2)};
    auto [scores, logprobs, ref_logprobs] = op.call(
        optional(grads[0]), optional(grads[1]), saved[0], saved[1], saved[2], data.at("kl_coef").toDouble(),
        data.at("kl_estimator").toStringRef(), static_cast<at::ScalarType>(data.at("scores_dtype").toInt()), want);
    return {wanted(scores, want[0]),
            wanted(logprobs, want[1]),
            wanted(ref_logprobs, want[2]),
            Tensor(),
            Tensor(),
            Tensor()};
  }

  static Pair kernel(const Tensor& scores, const Tensor& logprobs, const Tensor& ref_logprobs, const Tensor& mask,
                     double kl_coef, c10::string_view kl_estimator) {
    if (!records_autograd(scores, logprobs, ref_logprobs, mask)) {
      static const auto op = typed_op<PenalizedForward>("ppo_fast::kl_penalized_rewards");
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.call(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator);
    }
    auto out = apply(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator);
    return {out[0], out[1]};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, Autograd, m) {
  m.impl("kl_estimate", &KlEstimate::kernel);
  m.impl("kl_estimate_backward", &NoSecondOrder<kKlBackward, KlBackward>::kernel);
  m.impl("kl_penalized_rewards", &KlPenalizedRewards::kernel);
  m.impl("kl_penalized_rewards_backward", &NoSecondOrder<kPenalizedBackward, PenalizedBackward>::kernel);
}

}  // namespace ppo_fast
