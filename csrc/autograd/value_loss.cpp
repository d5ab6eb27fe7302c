// The autograd of value_loss (csrc/value_loss.cpp): the loss is differentiable in values,
// old_values and returns; clipfrac and row_scale are not.
#include <torch/library.h>

#include "common/autograd.h"

namespace ppo_fast {
namespace {

using Tensor = at::Tensor;
using Outputs = std::tuple<Tensor, Tensor, Tensor>;

// The padded op (Layout empty) and the packed layout's (value_loss_varlen: Layout = Tensor, cu_seqlens after the
// mask; row_scale [S]) share one Function.
template <const char* Name, const char* BackwardName, typename... Layout>
struct ValueLoss : LeanFunction<ValueLoss<Name, BackwardName, Layout...>> {
  using Forward = Outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Layout&..., double,
                          c10::string_view);
  using Backward = Outputs(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Layout&..., double, std::array<bool, 3>);
  static constexpr size_t kLayout = sizeof...(Layout);

  static variable_list forward(LeanContext* ctx, const Tensor& values, const Tensor& old_values, const Tensor& returns,
                               const Tensor& mask, const Layout&... layout, double clip, c10::string_view agg) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<Forward>(Name);
    auto [loss, clipfrac, row_scale] = op.call(values, old_values, returns, mask, layout..., clip, agg);
    ctx->save_for_backward({values, old_values, returns, mask, row_scale, layout...});
    ctx->saved_data["clip"] = clip;
    ctx->mark_non_differentiable({clipfrac, row_scale});
    ctx->set_materialize_grads(false);  // no zero-filled gradients for the stats
    return {loss, clipfrac, row_scale};
  }

  static variable_list backward(LeanContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return variable_list(6 + kLayout);  // the loss unused: no gradient
    const std::array<bool, 3> want{needs_grad(ctx, 0), needs_grad(ctx, 1), needs_grad(ctx, 2)};
    auto [values, old_values, returns] =
        backward_op(grads[0], ctx->get_saved_variables(), ctx->saved_data.at("clip").toDouble(), want,
                    std::make_index_sequence<kLayout>());
    variable_list out{wanted(values, want[0]), wanted(old_values, want[1]), wanted(returns, want[2])};
    out.resize(6 + kLayout);  // none for the mask, the layout, clip and agg
    return out;
  }

  // The backward op on the saved tensors: the layout's (cu_seqlens) after row_scale.
  template <size_t... I>
  static Outputs backward_op(const Tensor& grad_loss, const variable_list& saved, double clip, std::array<bool, 3> want,
                             std::index_sequence<I...>) {
    static const auto op = typed_op<Backward>(BackwardName);
    return op.call(grad_loss, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5 + I]..., clip, want);
  }

  static Outputs kernel(const Tensor& values, const Tensor& old_values, const Tensor& returns, const Tensor& mask,
                        const Layout&... layout, double clip, c10::string_view agg) {
    if (!records_autograd(values, old_values, returns, mask)) {
      static const auto op = typed_op<Forward>(Name);
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.call(values, old_values, returns, mask, layout..., clip, agg);
    }
    auto out = ValueLoss::apply(values, old_values, returns, mask, layout..., clip, agg);
    return {out[0], out[1], out[2]};
  }
};

constexpr char kForward[] = "ppo_fast::value_loss";
constexpr char kBackward[] = "ppo_fast::value_loss_backward";
constexpr char kVarlen[] = "ppo_fast::value_loss_varlen";
constexpr char kVarlenBackward[] = "ppo_fast::value_loss_varlen_backward";

using Padded = ValueLoss<kForward, kBackward>;
using Packed = ValueLoss<kVarlen, kVarlenBackward, Tensor>;

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, Autograd, m) {
  m.impl("value_loss", &Padded::kernel);
  m.impl("value_loss_backward", &NoSecondOrder<kBackward, Padded::Backward>::kernel);
  m.impl("value_loss_varlen", &Packed::kernel);
  m.impl("value_loss_varlen_backward", &NoSecondOrder<kVarlenBackward, Packed::Backward>::kernel);
}

}  // namespace ppo_fast
