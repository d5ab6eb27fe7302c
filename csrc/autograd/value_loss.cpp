// The autograd of value_loss (csrc/value_loss.cpp): the loss is differentiable in values,
// old_values and returns; clipfrac and row_scale are not.
#include <torch/library.h>

#include "common/autograd.h"

namespace ppo_fast {
namespace {

using Tensor = at::Tensor;
using Outputs = std::tuple<Tensor, Tensor, Tensor>;
using Forward = Outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, c10::string_view);
using Backward = Outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         double, std::array<bool, 3>);
constexpr char kBackward[] = "ppo_fast::value_loss_backward";

struct ValueLoss : torch::autograd::Function<ValueLoss> {
  static variable_list forward(AutogradContext* ctx, const Tensor& values, const Tensor& old_values,
                               const Tensor& returns, const Tensor& mask, double clip, c10::string_view agg) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<Forward>("ppo_fast::value_loss");
    auto [loss, clipfrac, row_scale] = op.call(values, old_values, returns, mask, clip, agg);
    ctx->save_for_backward({values, old_values, returns, mask, row_scale});
    ctx->saved_data["clip"] = clip;
    ctx->mark_non_differentiable({clipfrac, row_scale});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the stats
    return {loss, clipfrac, row_scale};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(6);  // the loss unused: no gradient
    static const auto op = typed_op<Backward>(kBackward);
    const variable_list saved = ctx->get_saved_variables();
    const std::array<bool, 3> want{needs_grad(ctx, 0), needs_grad(ctx, 1), needs_grad(ctx, 2)};
    auto [values, old_values, returns] = op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                                 ctx->saved_data.at("clip").toDouble(), want);
    return {
        wanted(values, want[0]), wanted(old_values, want[1]), wanted(returns, want[2]), Tensor(), Tensor(), Tensor()};
  }

  static Outputs kernel(const Tensor& values, const Tensor& old_values, const Tensor& returns, const Tensor& mask,
                        double clip, c10::string_view agg) {
    if (!records_autograd(values, old_values, returns, mask)) {
      static const auto op = typed_op<Forward>("ppo_fast::value_loss");
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.call(values, old_values, returns, mask, clip, agg);
    }
    auto out = apply(values, old_values, returns, mask, clip, agg);
    return {out[0], out[1], out[2]};
  }
};

// The packed layout (value_loss_varlen): cu_seqlens after the mask, row_scale [S].
using VarlenForward = Outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                              c10::string_view);
using VarlenBackward = Outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, double, std::array<bool, 3>);
constexpr char kVarlenBackward[] = "ppo_fast::value_loss_varlen_backward";

struct ValueLossVarlen : torch::autograd::Function<ValueLossVarlen> {
  static variable_list forward(AutogradContext* ctx, const Tensor& values, const Tensor& old_values,
                               const Tensor& returns, const Tensor& mask, const Tensor& cu_seqlens, double clip,
                               c10::string_view agg) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<VarlenForward>("ppo_fast::value_loss_varlen");
    auto [loss, clipfrac, row_scale] = op.call(values, old_values, returns, mask, cu_seqlens, clip, agg);
    ctx->save_for_backward({values, old_values, returns, mask, row_scale, cu_seqlens});
    ctx->saved_data["clip"] = clip;
    ctx->mark_non_differentiable({clipfrac, row_scale});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the stats
    return {loss, clipfrac, row_scale};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(7);  // the loss unused: no gradient
    static const auto op = typed_op<VarlenBackward>(kVarlenBackward);
    const variable_list saved = ctx->get_saved_variables();
    const std::array<bool, 3> want{needs_grad(ctx, 0), needs_grad(ctx, 1), needs_grad(ctx, 2)};
    auto [values, old_values, returns] = op.call(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5],
                                                 ctx->saved_data.at("clip").toDouble(), want);
    return {wanted(values, want[0]),
            wanted(old_values, want[1]),
            wanted(returns, want[2]),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }

  static Outputs kernel(const Tensor& values, const Tensor& old_values, const Tensor& returns, const Tensor& mask,
                        const Tensor& cu_seqlens, double clip, c10::string_view agg) {
    auto out = apply(values, old_values, returns, mask, cu_seqlens, clip, agg);
    return {out[0], out[1], out[2]};
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, Autograd, m) {
  m.impl("value_loss", &ValueLoss::kernel);
  m.impl("value_loss_backward", &NoSecondOrder<kBackward, Backward>::kernel);
  m.impl("value_loss_varlen", &ValueLossVarlen::kernel);
  m.impl("value_loss_varlen_backward", &NoSecondOrder<kVarlenBackward, VarlenBackward>::kernel);
}

}  // namespace ppo_fast
