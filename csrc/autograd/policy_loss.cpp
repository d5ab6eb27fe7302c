// The autograd of the policy losses (csrc/policy_loss.cpp): the loss is differentiable, the stats,
// row_scale and row_state are not (detached, as in the reference); each backward op computes only
// the gradients autograd asks for.  GSPO's sequence ratio is detached: old_logprobs gets none.
#include <torch/library.h>

#include "common/autograd.h"

namespace ppo_fast {
namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using Grads4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;

// The inputs' positions among the tensors autograd sees (weights, last, is one only when given).
enum Input : int64_t { kLogprobs = 0, kOld = 1, kAdvantages = 2, kWeights = 4 };

std::array<bool, 4> wanted_grads(LeanContext* ctx, bool has_weights, bool old_differentiable) {
  return {needs_grad(ctx, kLogprobs), old_differentiable && needs_grad(ctx, kOld), needs_grad(ctx, kAdvantages),
          has_weights && needs_grad(ctx, kWeights)};
}

// The gradients of (logprobs, old_logprobs, advantages, mask, weights) and none for the other
// `extra` arguments.
variable_list input_grads(Grads4 grads, const std::array<bool, 4>& want, size_t extra) {
  auto& [logprobs, old, advantages, weights] = grads;
  variable_list out{wanted(std::move(logprobs), want[0]), wanted(std::move(old), want[1]),
                    wanted(std::move(advantages), want[2]), Tensor(), wanted(std::move(weights), want[3])};
  out.resize(out.size() + extra);
  return out;
}

OptTensor optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// ----------------------------------------------------------------------------- clipped_policy_loss

using ClippedForward = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                                          const Tensor&, const OptTensor&, double,
                                                                          double, std::optional<double>,
                                                                          c10::string_view);
using ClippedBackward = Grads4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const OptTensor&, const Tensor&, double, double, std::optional<double>,
                               std::array<bool, 4>);

struct ClippedPolicyLoss : LeanFunction<ClippedPolicyLoss> {
  static variable_list forward(LeanContext* ctx, const Tensor& logprobs, const Tensor& old_logprobs,
                               const Tensor& advantages, const Tensor& mask, const OptTensor& weights,
                               double clip_eps_low, double clip_eps_high, std::optional<double> dual_clip,
                               c10::string_view agg) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<ClippedForward>("ppo_fast::clipped_policy_loss");
    auto [loss, clipfrac, clipfrac_lower, approx_kl, row_scale] =
        op.call(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, dual_clip, agg);
    ctx->save_for_backward({logprobs, old_logprobs, advantages, mask, weights.value_or(Tensor()), row_scale});
    ctx->saved_data["clip_eps_low"] = clip_eps_low;
    ctx->saved_data["clip_eps_high"] = clip_eps_high;
    ctx->saved_data["dual_clip"] = dual_clip;
    ctx->mark_non_differentiable({clipfrac, clipfrac_lower, approx_kl, row_scale});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the stats
    return {loss, clipfrac, clipfrac_lower, approx_kl, row_scale};
  }

  static variable_list backward(LeanContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(9);  // the loss unused: no gradient
    static const auto op = typed_op<ClippedBackward>("ppo_fast::clipped_policy_loss_backward");
    const variable_list saved = ctx->get_saved_variables();
    const OptTensor weights = optional(saved[4]);
    const auto want = wanted_grads(ctx, weights.has_value(), true);
    const auto& data = ctx->saved_data;
    return input_grads(
        op.call(grads[0], saved[0], saved[1], saved[2], saved[3], weights, saved[5], data.at("clip_eps_low").toDouble(),
                data.at("clip_eps_high").toDouble(), data.at("dual_clip").toOptional<double>(), want),
        want, 4);
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> clipped_policy_loss_autograd(
    const Tensor& logprobs, const Tensor& old_logprobs, const Tensor& advantages, const Tensor& mask,
    const OptTensor& weights, double clip_eps_low, double clip_eps_high, std::optional<double> dual_clip,
    c10::string_view agg) {
  if (!records_autograd(logprobs, old_logprobs, advantages, mask, weights)) {
    static const auto op = typed_op<ClippedForward>("ppo_fast::clipped_policy_loss");
    at::AutoDispatchBelowADInplaceOrView guard;
    return op.call(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, dual_clip, agg);
  }
  auto out = ClippedPolicyLoss::apply(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high,
                                      dual_clip, agg);
  return {out[0], out[1], out[2], out[3], out[4]};
}

// ----------------------------------------------------------------------------- GSPO and GMPO

using SeqOutputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// The padded ops (Layout empty) and the packed layout's (csrc/policy_loss.cpp's *_varlen: Layout = Tensor, cu_seqlens
// after weights, not differentiable; row_scale and row_state [S]) share one Function.
template <const char* Name, const char* BackwardName, bool OldDifferentiable, typename... Layout>
struct SeqPolicyLoss : LeanFunction<SeqPolicyLoss<Name, BackwardName, OldDifferentiable, Layout...>> {
  using Forward = SeqOutputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                             const Layout&..., double, double, c10::string_view);
  using Backward = Grads4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                          const Tensor&, const Tensor&, const Layout&..., double, double, std::array<bool, 4>);
  static constexpr size_t kLayout = sizeof...(Layout);

  static variable_list forward(LeanContext* ctx, const Tensor& logprobs, const Tensor& old_logprobs,
                               const Tensor& advantages, const Tensor& mask, const OptTensor& weights,
                               const Layout&... layout, double clip_eps_low, double clip_eps_high,
                               c10::string_view agg) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<Forward>(Name);
    auto [loss, clipfrac, clipfrac_lower, approx_kl, row_scale, row_state] =
        op.call(logprobs, old_logprobs, advantages, mask, weights, layout..., clip_eps_low, clip_eps_high, agg);
    ctx->save_for_backward(
        {logprobs, old_logprobs, advantages, mask, weights.value_or(Tensor()), row_scale, row_state, layout...});
    ctx->saved_data["clip_eps_low"] = clip_eps_low;
    ctx->saved_data["clip_eps_high"] = clip_eps_high;
    ctx->mark_non_differentiable({clipfrac, clipfrac_lower, approx_kl, row_scale, row_state});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the stats
    return {loss, clipfrac, clipfrac_lower, approx_kl, row_scale, row_state};
  }

  static variable_list backward(LeanContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(8 + kLayout);  // the loss unused: no gradient
    const variable_list saved = ctx->get_saved_variables();
    const OptTensor weights = optional(saved[4]);
    const auto want = wanted_grads(ctx, weights.has_value(), OldDifferentiable);
    const auto& data = ctx->saved_data;
    const double low = data.at("clip_eps_low").toDouble(), high = data.at("clip_eps_high").toDouble();
    return input_grads(backward_op(grads[0], saved, weights, low, high, want, std::make_index_sequence<kLayout>()),
                       want, 3 + kLayout);
  }

  // The backward op on the saved tensors: the layout's (cu_seqlens) after row_scale and row_state.
  template <size_t... I>
  static Grads4 backward_op(const Tensor& grad_loss, const variable_list& saved, const OptTensor& weights, double low,
                            double high, std::array<bool, 4> want, std::index_sequence<I...>) {
    static const auto op = typed_op<Backward>(BackwardName);
    return op.call(grad_loss, saved[0], saved[1], saved[2], saved[3], weights, saved[5], saved[6], saved[7 + I]..., low,
                   high, want);
  }

  static SeqOutputs kernel(const Tensor& logprobs, const Tensor& old_logprobs, const Tensor& advantages,
                           const Tensor& mask, const OptTensor& weights, const Layout&... layout, double clip_eps_low,
                           double clip_eps_high, c10::string_view agg) {
    if (!records_autograd(logprobs, old_logprobs, advantages, mask, weights)) {
      static const auto op = typed_op<Forward>(Name);
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.call(logprobs, old_logprobs, advantages, mask, weights, layout..., clip_eps_low, clip_eps_high, agg);
    }
    auto out = SeqPolicyLoss::apply(logprobs, old_logprobs, advantages, mask, weights, layout..., clip_eps_low,
                                    clip_eps_high, agg);
    return {out[0], out[1], out[2], out[3], out[4], out[5]};
  }
};

constexpr char kGspo[] = "ppo_fast::policy_loss_gspo";
constexpr char kGspoBackward[] = "ppo_fast::policy_loss_gspo_backward";
constexpr char kGeoMean[] = "ppo_fast::policy_loss_geo_mean";
constexpr char kGeoMeanBackward[] = "ppo_fast::policy_loss_geo_mean_backward";
constexpr char kGspoVarlen[] = "ppo_fast::policy_loss_gspo_varlen";
constexpr char kGspoVarlenBackward[] = "ppo_fast::policy_loss_gspo_varlen_backward";
constexpr char kGeoMeanVarlen[] = "ppo_fast::policy_loss_geo_mean_varlen";
constexpr char kGeoMeanVarlenBackward[] = "ppo_fast::policy_loss_geo_mean_varlen_backward";

using Gspo = SeqPolicyLoss<kGspo, kGspoBackward, false>;
using GeoMean = SeqPolicyLoss<kGeoMean, kGeoMeanBackward, true>;
using GspoVarlen = SeqPolicyLoss<kGspoVarlen, kGspoVarlenBackward, false, Tensor>;
using GeoMeanVarlen = SeqPolicyLoss<kGeoMeanVarlen, kGeoMeanVarlenBackward, true, Tensor>;

constexpr char kClippedBackward[] = "ppo_fast::clipped_policy_loss_backward";

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, Autograd, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_autograd);
  m.impl("clipped_policy_loss_backward", &NoSecondOrder<kClippedBackward, ClippedBackward>::kernel);
  m.impl("policy_loss_gspo", &Gspo::kernel);
  m.impl("policy_loss_gspo_backward", &NoSecondOrder<kGspoBackward, Gspo::Backward>::kernel);
  m.impl("policy_loss_geo_mean", &GeoMean::kernel);
  m.impl("policy_loss_geo_mean_backward", &NoSecondOrder<kGeoMeanBackward, GeoMean::Backward>::kernel);
  m.impl("policy_loss_gspo_varlen", &GspoVarlen::kernel);
  m.impl("policy_loss_gspo_varlen_backward", &NoSecondOrder<kGspoVarlenBackward, GspoVarlen::Backward>::kernel);
  m.impl("policy_loss_geo_mean_varlen", &GeoMeanVarlen::kernel);
  m.impl("policy_loss_geo_mean_varlen_backward",
         &NoSecondOrder<kGeoMeanVarlenBackward, GeoMeanVarlen::Backward>::kernel);
}

}  // namespace ppo_fast
