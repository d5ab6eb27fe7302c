// The autograd of gae (csrc/gae.cpp).  GAE is linear, (advantages, returns) = F(rewards, values),
// and its backward is F's transpose, so the backward's own gradient is F itself: every order is
// differentiable.  Often only the advantages are used: an unused output brings no gradient term.
#include <torch/library.h>

#include "common/autograd.h"

namespace ppo_fast {
namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using Pair = std::tuple<Tensor, Tensor>;
using GaeSignature = Pair(const Tensor&, const Tensor&, const Tensor&, double, double);
using GaeBackwardSignature = Pair(const OptTensor&, const OptTensor&, const Tensor&, double, double, at::ScalarType,
                                  at::ScalarType, std::array<bool, 2>);

OptTensor optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The padded op (Layout empty) and the packed layout's (gae_varlen: Layout = Tensor, cu_seqlens after the mask) share
// one Function; their backward ops are gae_backward (differentiable: GaeBackward) and gae_varlen_backward
// (NoSecondOrder: a second-order gradient raises, naming the reference).
template <const char* Name, const char* BackwardName, typename... Layout>
struct Gae : LeanFunction<Gae<Name, BackwardName, Layout...>> {
  using Forward = Pair(const Tensor&, const Tensor&, const Tensor&, const Layout&..., double, double);
  using Backward = Pair(const OptTensor&, const OptTensor&, const Tensor&, const Layout&..., double, double,
                        at::ScalarType, at::ScalarType, std::array<bool, 2>);
  static constexpr size_t kLayout = sizeof...(Layout);

  static variable_list forward(LeanContext* ctx, const Tensor& rewards, const Tensor& values, const Tensor& mask,
                               const Layout&... layout, double gamma, double lam) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<Forward>(Name);
    auto [advantages, returns] = op.call(rewards, values, mask, layout..., gamma, lam);
    ctx->save_for_backward({mask, layout...});
    ctx->saved_data["gamma"] = gamma;
    ctx->saved_data["lam"] = lam;
    ctx->saved_data["rewards_dtype"] = static_cast<int64_t>(rewards.scalar_type());
    ctx->saved_data["values_dtype"] = static_cast<int64_t>(values.scalar_type());
    ctx->set_materialize_grads(false);
    return {advantages, returns};
  }

  static variable_list backward(LeanContext* ctx, variable_list grads) {
    const std::array<bool, 2> want{needs_grad(ctx, 0), needs_grad(ctx, 1)};
    auto [rewards, values] =
        backward_op(grads, ctx->get_saved_variables(), ctx->saved_data, want, std::make_index_sequence<kLayout>());
    variable_list out{wanted(rewards, want[0]), wanted(values, want[1])};
    out.resize(5 + kLayout);  // none for the mask, the layout, gamma and lam
    return out;
  }

  // The backward op (through the Autograd key again: a second-order gradient differentiates this call) on the
  // saved tensors: the mask, then the layout's.
  template <typename Data, size_t... I>
  static Pair backward_op(const variable_list& grads, const variable_list& saved, const Data& data,
                          std::array<bool, 2> want, std::index_sequence<I...>) {
    static const auto op = typed_op<Backward>(BackwardName);
    return op.call(optional(grads[0]), optional(grads[1]), saved[0], saved[1 + I]..., data.at("gamma").toDouble(),
                   data.at("lam").toDouble(), static_cast<at::ScalarType>(data.at("rewards_dtype").toInt()),
                   static_cast<at::ScalarType>(data.at("values_dtype").toInt()), want);
  }

  static Pair kernel(const Tensor& rewards, const Tensor& values, const Tensor& mask, const Layout&... layout,
                     double gamma, double lam) {
    if (!records_autograd(rewards, values, mask)) {
      static const auto op = typed_op<Forward>(Name);
      at::AutoDispatchBelowADInplaceOrView guard;
      return op.call(rewards, values, mask, layout..., gamma, lam);
    }
    auto out = Gae::apply(rewards, values, mask, layout..., gamma, lam);
    return {out[0], out[1]};
  }
};

struct GaeBackward : torch::autograd::Function<GaeBackward> {
  static variable_list forward(AutogradContext* ctx, const OptTensor& grad_advantages, const OptTensor& grad_returns,
                               const Tensor& mask, double gamma, double lam, at::ScalarType rewards_dtype,
                               at::ScalarType values_dtype, std::array<bool, 2> output_mask) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static const auto op = typed_op<GaeBackwardSignature>("ppo_fast::gae_backward");
    auto [rewards, values] =
        op.call(grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype, values_dtype, output_mask);
    ctx->save_for_backward({mask});
    ctx->saved_data["gamma"] = gamma;
    ctx->saved_data["lam"] = lam;
    ctx->saved_data["wanted"] = c10::List<bool>({output_mask[0], output_mask[1]});
    // The dtype of each upstream gradient given (-1: none given, no gradient to it).
    ctx->saved_data["advantages_dtype"] =
        grad_advantages ? static_cast<int64_t>(grad_advantages->scalar_type()) : int64_t(-1);
    ctx->saved_data["returns_dtype"] = grad_returns ? static_cast<int64_t>(grad_returns->scalar_type()) : int64_t(-1);
    return {rewards, values};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<GaeSignature>("ppo_fast::gae");
    const Tensor mask = ctx->get_saved_variables()[0];
    const auto& data = ctx->saved_data;
    const c10::List<bool> output_mask = data.at("wanted").toBoolList();
    variable_list cotangents(2);
    for (size_t i = 0; i < 2; ++i) {
      const bool use = output_mask.get(i) && grads[i].defined();
      cotangents[i] = use ? grads[i] : at::zeros(mask.sizes(), mask.options().dtype(at::kFloat));
    }
    auto [advantages, returns] =
        op.call(cotangents[0], cotangents[1], mask, data.at("gamma").toDouble(), data.at("lam").toDouble());
    const int64_t advantages_dtype = data.at("advantages_dtype").toInt(),
                  returns_dtype = data.at("returns_dtype").toInt();
    return {advantages_dtype < 0 ? Tensor() : advantages.to(static_cast<at::ScalarType>(advantages_dtype)),
            returns_dtype < 0 ? Tensor() : returns.to(static_cast<at::ScalarType>(returns_dtype)),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor(),
            Tensor()};
  }

  static Pair kernel(const OptTensor& grad_advantages, const OptTensor& grad_returns, const Tensor& mask, double gamma,
                     double lam, at::ScalarType rewards_dtype, at::ScalarType values_dtype,
                     std::array<bool, 2> output_mask) {
    auto out = apply(grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype, values_dtype, output_mask);
    return {out[0], out[1]};
  }
};

constexpr char kGae[] = "ppo_fast::gae";
constexpr char kGaeBackward[] = "ppo_fast::gae_backward";
constexpr char kVarlen[] = "ppo_fast::gae_varlen";
constexpr char kVarlenBackward[] = "ppo_fast::gae_varlen_backward";

using Padded = Gae<kGae, kGaeBackward>;
using Packed = Gae<kVarlen, kVarlenBackward, Tensor>;

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, Autograd, m) {
  m.impl("gae", &Padded::kernel);
  m.impl("gae_backward", &GaeBackward::kernel);
  m.impl("gae_varlen", &Packed::kernel);
  m.impl("gae_varlen_backward", &NoSecondOrder<kVarlenBackward, Packed::Backward>::kernel);
}

}  // namespace ppo_fast
