// Torch glue of the CUDA sequence-level policy losses (kernels in csrc/cuda/seq_losses.cu):
// the checks of the CPU kernels, the inputs in the compute dtype, the current stream.
// Nothing here reads tensor values on the host (no device sync).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>

#include "checks.h"
#include "contract.h"
#include "cpu/float_io.h"  // compute_dtype, with_compute_type
#include "cuda/seq_losses_cuda.h"
#include "seq_loss_math.h"

namespace ppo_fast {
namespace {

struct Buffers {
  at::Tensor logp, old, adv, weights, mask;  // contiguous, in the compute dtype (weights may be undefined)
  at::ScalarType dtype;
};

Buffers buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
                const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  TORCH_CHECK(logprobs.is_cuda(), op, ": expects CUDA tensors, got one on ", logprobs.device());
  TORCH_CHECK(logprobs.size(0) <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 rows, got ", logprobs.size(0));
  const at::Tensor w = weights.has_value() ? *weights : at::Tensor();
  const at::ScalarType dtype = compute_dtype({&logprobs, &old_logprobs, &advantages, &w});
  auto as = [&](const at::Tensor& t) { return t.defined() ? t.to(dtype).contiguous() : t; };
  return {as(logprobs), as(old_logprobs), as(advantages), as(w), mask.contiguous(), dtype};
}

template <typename T>
cuda::SeqInputs<T> inputs(const Buffers& b, double eps_low, double eps_high) {
  return {b.logp.const_data_ptr<T>(), b.old.const_data_ptr<T>(), b.adv.const_data_ptr<T>(),
          b.weights.defined() ? b.weights.const_data_ptr<T>() : nullptr, b.mask.const_data_ptr<bool>(), b.logp.size(0),
          b.logp.size(1), eps_low, eps_high};
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

template <cuda::SeqLoss mode>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> seq_loss_cuda(
    const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& mask, const std::optional<at::Tensor>& weights, double eps_low, double eps_high, c10::string_view agg_name) {
  const Agg agg = parse_agg(op, agg_name);
  const Buffers b = buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t rows = logprobs.size(0);
  const auto options = logprobs.options().dtype(b.dtype);
  at::Tensor loss = at::empty({}, options), approx_kl = at::empty({}, options);
  at::Tensor clipfrac = at::empty({}, options.dtype(at::kFloat)), clipfrac_lower = at::empty({}, options.dtype(at::kFloat));
  at::Tensor row_scale = at::empty({rows}, options), row_state = at::empty({rows, kRowState}, options);
  at::Tensor partials = at::empty({rows, 5}, options.dtype(at::kDouble));
  with_compute_type(b.dtype, [&](auto tag) {
    using T = decltype(tag);
    const cuda::SeqOutputs<T> out{loss.mutable_data_ptr<T>(), approx_kl.mutable_data_ptr<T>(), row_scale.mutable_data_ptr<T>(),
                                  row_state.mutable_data_ptr<T>(), clipfrac.mutable_data_ptr<float>(),
                                  clipfrac_lower.mutable_data_ptr<float>(), partials.mutable_data_ptr<double>()};
    cuda::seq_loss_forward<T>(mode, inputs<T>(b, eps_low, eps_high), agg, out, c10::cuda::getCurrentCUDAStream());
  });
  check_launch(op);
  return {loss, clipfrac, clipfrac_lower, approx_kl, row_scale, row_state};
}

template <cuda::SeqLoss mode>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> seq_loss_backward_cuda(
    const char* op, const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights, const at::Tensor& row_scale_in,
    const at::Tensor& row_state_in, double eps_low, double eps_high, std::array<bool, 4> output_mask) {
  const Buffers b = buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = logprobs.size(0);
  check_grad_loss(op, grad_loss);
  check_float(op, "row_scale", row_scale_in);
  check_shape(op, "row_scale", row_scale_in, {rows});
  check_float(op, "row_state", row_state_in);
  check_shape(op, "row_state", row_state_in, {rows, kRowState});
  check_same_device(op, {{"logprobs", &logprobs}, {"grad_loss", &grad_loss}, {"row_scale", &row_scale_in}, {"row_state", &row_state_in}});
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const at::Tensor upstream = grad_loss.reshape({}).to(b.dtype).contiguous();
  const at::Tensor scales = row_scale_in.to(b.dtype).contiguous(), states = row_state_in.to(b.dtype).contiguous();
  // GSPO passes no gradient to old_logprobs (its sequence ratio is detached).
  const bool need_logp = output_mask[0], need_old = output_mask[1] && mode == cuda::SeqLoss::kGeoMean;
  const bool need_adv = output_mask[2], need_w = output_mask[3] && b.weights.defined();
  const auto options = logprobs.options().dtype(b.dtype);
  at::Tensor g_lp = need_logp || need_old ? at::empty(logprobs.sizes(), options) : at::Tensor();
  at::Tensor g_ad = need_adv ? at::empty(logprobs.sizes(), options) : at::Tensor();
  at::Tensor g_w = need_w ? at::empty(logprobs.sizes(), options) : at::Tensor();
  if (g_lp.defined() || g_ad.defined() || g_w.defined()) {
    with_compute_type(b.dtype, [&](auto tag) {
      using T = decltype(tag);
      auto ptr = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<T>() : nullptr; };
      cuda::seq_loss_backward<T>(mode, inputs<T>(b, eps_low, eps_high), upstream.const_data_ptr<T>(), scales.const_data_ptr<T>(),
                                 states.const_data_ptr<T>(), {ptr(g_lp), ptr(g_ad), ptr(g_w)}, c10::cuda::getCurrentCUDAStream());
    });
    check_launch(op);
  }
  auto in_dtype = [](const at::Tensor& g, bool wanted, const at::Tensor& input) {
    return wanted ? g.to(input.scalar_type()) : at::empty({0}, input.options());
  };
  return {in_dtype(g_lp, need_logp, logprobs), need_old ? (-g_lp).to(old_logprobs.scalar_type()) : at::empty({0}, old_logprobs.options()),
          in_dtype(g_ad, need_adv, advantages), weights.has_value() ? in_dtype(g_w, need_w, *weights) : at::empty({0}, logprobs.options())};
}

auto gspo_cuda(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
               const std::optional<at::Tensor>& weights, double clip_eps_low, double clip_eps_high, c10::string_view agg) {
  return seq_loss_cuda<cuda::SeqLoss::kGspo>("policy_loss_gspo", logprobs, old_logprobs, advantages, mask, weights, clip_eps_low,
                                             clip_eps_high, agg);
}
auto geo_mean_cuda(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
                   const std::optional<at::Tensor>& weights, double clip_eps_low, double clip_eps_high, c10::string_view agg) {
  return seq_loss_cuda<cuda::SeqLoss::kGeoMean>("policy_loss_geo_mean", logprobs, old_logprobs, advantages, mask, weights,
                                                clip_eps_low, clip_eps_high, agg);
}
auto gspo_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                        const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                        const at::Tensor& row_scale, const at::Tensor& row_state, double clip_eps_low, double clip_eps_high,
                        std::array<bool, 4> output_mask) {
  return seq_loss_backward_cuda<cuda::SeqLoss::kGspo>("policy_loss_gspo_backward", grad_loss, logprobs, old_logprobs, advantages,
                                                      mask, weights, row_scale, row_state, clip_eps_low, clip_eps_high, output_mask);
}
auto geo_mean_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                            const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                            const at::Tensor& row_scale, const at::Tensor& row_state, double clip_eps_low, double clip_eps_high,
                            std::array<bool, 4> output_mask) {
  return seq_loss_backward_cuda<cuda::SeqLoss::kGeoMean>("policy_loss_geo_mean_backward", grad_loss, logprobs, old_logprobs,
                                                         advantages, mask, weights, row_scale, row_state, clip_eps_low,
                                                         clip_eps_high, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CUDA, m) {
  m.impl("policy_loss_gspo", &gspo_cuda);
  m.impl("policy_loss_gspo_backward", &gspo_backward_cuda);
  m.impl("policy_loss_geo_mean", &geo_mean_cuda);
  m.impl("policy_loss_geo_mean_backward", &geo_mean_backward_cuda);
}

}  // namespace ppo_fast
