// The autograd of token_logprobs (csrc/token_logprobs.cpp): log-probs and entropy are
// differentiable in the logits; stats (each row's max and log-sum-exp, the truncation's
// threshold) is not.  An unused output brings no gradient term (grads are not materialized).
#include <torch/library.h>

#include "common/autograd.h"

namespace ppo_fast {
namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using Triple = std::tuple<Tensor, Tensor, Tensor>;
using Forward = Triple(const Tensor&, const Tensor&, double, bool, int64_t, int64_t, double, double);
using Backward = Tensor(const OptTensor&, const OptTensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        double, int64_t);
constexpr char kBackward[] = "ppo_fast::token_logprobs_backward";

OptTensor optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

struct TokenLogprobs : LeanFunction<TokenLogprobs> {
  static variable_list forward(LeanContext* ctx, const Tensor& logits, const Tensor& labels, double temperature,
                               bool return_entropy, int64_t ignore_index, int64_t top_k, double top_p, double min_p) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<Forward>("ppo_fast::token_logprobs");
    auto [logprobs, entropy, stats] =
        op.call(logits, labels, temperature, return_entropy, ignore_index, top_k, top_p, min_p);
    ctx->save_for_backward({logits, labels, stats, entropy});
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["return_entropy"] = return_entropy;
    ctx->mark_non_differentiable({stats});
    ctx->set_materialize_grads(false);
    return {logprobs, entropy, stats};
  }

  static variable_list backward(LeanContext* ctx, variable_list grads) {
    static const auto op = typed_op<Backward>(kBackward);
    const auto& data = ctx->saved_data;
    const Tensor grad_entropy = data.at("return_entropy").toBool() ? grads[1] : Tensor();
    variable_list out(8);
    if (!grads[0].defined() && !grad_entropy.defined()) {
      return out;
    }
    const variable_list saved = ctx->get_saved_variables();
    out[0] = op.call(optional(grads[0]), optional(grad_entropy), saved[0], saved[1], saved[2], saved[3],
                     data.at("temperature").toDouble(), data.at("ignore_index").toInt());
    return out;
  }

  static Triple kernel(const Tensor& logits, const Tensor& labels, double temperature, bool return_entropy,
                       int64_t ignore_index, int64_t top_k, double top_p, double min_p) {
    auto out = apply(logits, labels, temperature, return_entropy, ignore_index, top_k, top_p, min_p);
    return {out[0], out[1], out[2]};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, Autograd, m) {
  m.impl("token_logprobs", &TokenLogprobs::kernel);
  m.impl("token_logprobs_backward", &NoSecondOrder<kBackward, Backward>::kernel);
}

}  // namespace ppo_fast
