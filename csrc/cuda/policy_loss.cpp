// Torch glue of the CUDA policy-loss kernels (csrc/cuda/policy_loss.cu): the checks of
// the CPU kernels, the inputs in one dtype per launch, the current stream, launch error
// checks.  Nothing here reads tensor values on the host (no device sync): grad_loss and
// row_scale stay on the device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>

#include "common/checks.h"
#include "common/contract.h"
#include "common/cuda_checks.h"
#include "common/float_io.h"
#include "common/loss_math.h"
#include "common/seq_loss_math.h"
#include "cuda/policy_loss.h"
#include "cuda/token_loss_glue.h"

namespace ppo_fast {
namespace {

// ----------------------------------------------------------------------------- clipped_policy_loss

struct PolicyBuffers {
  at::Tensor logp, old, adv, weights, mask;
  at::ScalarType dtype;         // compute dtype
  at::ScalarType kernel_dtype;  // of every buffer
};

cuda::PolicyInputs policy_inputs(const PolicyBuffers& b, double clip_eps_low, double clip_eps_high,
                                 std::optional<double> dual_clip) {
  return {b.logp.const_data_ptr(),
          b.old.const_data_ptr(),
          b.adv.const_data_ptr(),
          b.weights.defined() ? b.weights.const_data_ptr() : nullptr,
          b.mask.const_data_ptr<bool>(),
          b.logp.size(0),
          b.logp.size(1),
          dtype_code(b.kernel_dtype),
          policy_params(clip_eps_low, clip_eps_high, dual_clip)};
}

// Checked, contiguous inputs (the same checks as the CPU kernels'), all of one dtype.  Every
// caller requires CUDA (check_cuda) after its last argument check, so that those checks, run on
// the host, answer as the CPU kernels do (tests/backends/test_native_bad_inputs.py reaches them
// without a GPU).
PolicyBuffers policy_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                             const at::Tensor& advantages, const at::Tensor& mask,
                             const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  PolicyBuffers b{logprobs.contiguous(),
                  old_logprobs.contiguous(),
                  advantages.contiguous(),
                  weights.has_value() ? weights->contiguous() : at::Tensor(),
                  mask.contiguous(),
                  at::kFloat,
                  at::kFloat};
  b.dtype = compute_dtype({&b.logp, &b.old, &b.adv, &b.weights});
  b.kernel_dtype = kernel_dtype({&b.logp, &b.old, &b.adv, &b.weights}, b.dtype);
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_cuda(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& weights, double clip_eps_low, double clip_eps_high,
    std::optional<double> dual_clip, c10::string_view agg_name) {
  constexpr const char* op = "clipped_policy_loss";
  const Agg agg = parse_agg(op, agg_name);
  const PolicyBuffers b = policy_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  check_cuda(op, logprobs);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const cuda::ChunkPlan plan = checked_plan(op, b.logp);
  at::Tensor partials = at::empty({cuda::forward_scratch_doubles(plan, logprobs.size(0), kPolicyPartials)},
                                  logprobs.options().dtype(at::kDouble));
  Results r = allocate_results(logprobs, b.dtype, {at::kFloat, at::kFloat, b.dtype});
  cuda::policy_loss_forward(policy_inputs(b, clip_eps_low, clip_eps_high, dual_clip), agg,
                            partials.mutable_data_ptr<double>(), r.pointers(), c10::cuda::getCurrentCUDAStream());
  check_launch(op);
  return {r.loss, r.stats[0], r.stats[1], r.stats[2], r.row_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_backward_cuda(
    const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
    const at::Tensor& row_scale, double clip_eps_low, double clip_eps_high, std::optional<double> dual_clip,
    std::array<bool, 4> output_mask) {
  constexpr const char* op = "clipped_policy_loss_backward";
  const PolicyBuffers b = policy_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const at::Tensor upstream = checked_upstream(op, grad_loss, logprobs, b.dtype);
  const at::Tensor scale = checked_row_scale(op, row_scale, logprobs, b.dtype);
  check_cuda(op, logprobs);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  checked_plan(op, b.logp);
  const bool need_logp = output_mask[0], need_old = output_mask[1], need_adv = output_mask[2],
             need_w_asked = output_mask[3];
  const bool need_w = need_w_asked && weights.has_value();
  const Grad grad_logp(b.logp, logprobs.scalar_type(), need_logp),
      grad_old(b.old, old_logprobs.scalar_type(), need_old);
  const Grad grad_adv(b.adv, advantages.scalar_type(), need_adv);
  const Grad grad_w = weights.has_value() ? Grad(b.weights, weights->scalar_type(), need_w)
                                          : Grad(b.logp, logprobs.scalar_type(), false);
  if (need_logp || need_old || need_adv || need_w) {
    const cuda::GradOutputs grads{{grad_logp.pointer(), grad_old.pointer(), grad_adv.pointer(), grad_w.pointer()}};
    cuda::policy_loss_backward(policy_inputs(b, clip_eps_low, clip_eps_high, dual_clip), upstream.const_data_ptr(),
                               scale.const_data_ptr(), grads, c10::cuda::getCurrentCUDAStream());
    check_launch(op);
  }
  return {grad_logp.to_input_dtype(), grad_old.to_input_dtype(), grad_adv.to_input_dtype(), grad_w.to_input_dtype()};
}

// ----------------------------------------------------------------------------- policy_loss_gspo, policy_loss_geo_mean

struct SeqBuffers {
  at::Tensor logp, old, adv, weights, mask;  // contiguous, in the compute dtype (weights may be undefined)
  at::ScalarType dtype;
};

SeqBuffers seq_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                       const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  TORCH_CHECK(logprobs.size(0) <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 rows, got ",
              logprobs.size(0));
  const at::Tensor w = weights.has_value() ? *weights : at::Tensor();
  const at::ScalarType dtype = compute_dtype({&logprobs, &old_logprobs, &advantages, &w});
  auto as = [&](const at::Tensor& t) { return t.defined() ? t.to(dtype).contiguous() : t; };
  return {as(logprobs), as(old_logprobs), as(advantages), as(w), mask.contiguous(), dtype};
}

template <typename T>
cuda::SeqInputs<T> seq_inputs(const SeqBuffers& b, double eps_low, double eps_high) {
  return {b.logp.const_data_ptr<T>(),
          b.old.const_data_ptr<T>(),
          b.adv.const_data_ptr<T>(),
          b.weights.defined() ? b.weights.const_data_ptr<T>() : nullptr,
          b.mask.const_data_ptr<bool>(),
          b.logp.size(0),
          b.logp.size(1),
          eps_low,
          eps_high};
}

// The rows of a launch: the padded [B, T] inputs', or (cu defined) cu_seqlens' segments of [N] tokens.
struct SeqRows {
  at::Tensor cu;  // int64 on the device, or undefined
  int64_t rows, length;
};

SeqRows padded_rows(const at::Tensor& logprobs) { return {at::Tensor(), logprobs.size(0), logprobs.size(1)}; }

SeqRows packed_rows(const char* op, const at::Tensor& cu_seqlens, const at::Tensor& logprobs) {
  SeqRows r{device_cu_seqlens(op, cu_seqlens, logprobs), 0, logprobs.size(0)};
  r.rows = r.cu.numel() - 1;
  TORCH_CHECK(r.rows <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 sequences, got ", r.rows);
  return r;
}

template <typename T>
cuda::SeqInputs<T> seq_inputs(const SeqBuffers& b, const SeqRows& layout, double eps_low, double eps_high) {
  cuda::SeqInputs<T> in = seq_inputs<T>(b, eps_low, eps_high);
  in.rows = layout.rows, in.length = layout.length;
  in.cu = layout.cu.defined() ? layout.cu.const_data_ptr<int64_t>() : nullptr;
  return in;
}

using SeqForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The forward over `layout`'s rows of the checked buffers.
template <PolicyMode mode>
SeqForward seq_loss_rows(const char* op, const SeqBuffers& b, const SeqRows& layout, const at::Tensor& logprobs,
                         double eps_low, double eps_high, Agg agg) {
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const int64_t rows = layout.rows;
  const auto options = logprobs.options().dtype(b.dtype);
  at::Tensor loss = at::empty({}, options), approx_kl = at::empty({}, options);
  at::Tensor clipfrac = at::empty({}, options.dtype(at::kFloat)),
             clipfrac_lower = at::empty({}, options.dtype(at::kFloat));
  at::Tensor row_scale = at::empty({rows}, options), row_state = at::empty({rows, kRowState}, options);
  at::Tensor partials = at::empty({rows, kPolicyPartials}, options.dtype(at::kDouble));
  with_compute_type(b.dtype, [&](auto tag) {
    using T = decltype(tag);
    const cuda::SeqOutputs<T> out{loss.mutable_data_ptr<T>(),         approx_kl.mutable_data_ptr<T>(),
                                  row_scale.mutable_data_ptr<T>(),    row_state.mutable_data_ptr<T>(),
                                  clipfrac.mutable_data_ptr<float>(), clipfrac_lower.mutable_data_ptr<float>(),
                                  partials.mutable_data_ptr<double>()};
    cuda::seq_loss_forward<T>(mode, seq_inputs<T>(b, layout, eps_low, eps_high), agg, out,
                              c10::cuda::getCurrentCUDAStream());
  });
  check_launch(op);
  return {loss, clipfrac, clipfrac_lower, approx_kl, row_scale, row_state};
}

template <PolicyMode mode>
SeqForward seq_loss_cuda(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
                         const at::Tensor& mask, const std::optional<at::Tensor>& weights, double eps_low,
                         double eps_high, c10::string_view agg_name) {
  const char* op = seq_loss_op_name(mode);
  const Agg agg = parse_agg(op, agg_name);
  const SeqBuffers b = seq_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  check_cuda(op, logprobs);
  return seq_loss_rows<mode>(op, b, padded_rows(logprobs), logprobs, eps_low, eps_high, agg);
}

// The packed layout's [N] inputs, checked as one [1, N] row (the buffers stay [1, N]).
SeqBuffers seq_varlen_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                              const at::Tensor& advantages, const at::Tensor& mask,
                              const std::optional<at::Tensor>& weights) {
  check_dim(op, "logprobs", logprobs, 1);
  const auto row = [](const at::Tensor& t) { return t.dim() == 1 ? t.unsqueeze(0) : t; };
  const std::optional<at::Tensor> w = weights.has_value() ? std::optional<at::Tensor>(row(*weights)) : std::nullopt;
  return seq_buffers(op, row(logprobs), row(old_logprobs), row(advantages), row(mask), w);
}

template <PolicyMode mode>
SeqForward seq_loss_varlen_cuda(const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                                const at::Tensor& advantages, const at::Tensor& mask,
                                const std::optional<at::Tensor>& weights, const at::Tensor& cu_seqlens, double eps_low,
                                double eps_high, c10::string_view agg_name) {
  const char* op = seq_loss_varlen_op_name(mode);
  const Agg agg = parse_agg(op, agg_name);
  const SeqBuffers b = seq_varlen_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const SeqRows layout = packed_rows(op, cu_seqlens, logprobs);  // checked before the device, as on the CPU
  check_cuda(op, logprobs);
  return seq_loss_rows<mode>(op, b, layout, logprobs, eps_low, eps_high, agg);
}

using SeqGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The inputs of a backward beside the buffers (the gradients take their shapes and dtypes).
struct SeqLike {
  const at::Tensor &logprobs, &old_logprobs, &advantages;
  const std::optional<at::Tensor>& weights;
};

// The backward over `layout`'s rows.
template <PolicyMode mode>
SeqGrads seq_loss_backward_rows(const char* op, const at::Tensor& grad_loss, const SeqBuffers& b, const SeqRows& layout,
                                const SeqLike& like, const at::Tensor& row_scale_in, const at::Tensor& row_state_in,
                                double eps_low, double eps_high, std::array<bool, 4> output_mask) {
  const at::Tensor &logprobs = like.logprobs, &old_logprobs = like.old_logprobs, &advantages = like.advantages;
  const std::optional<at::Tensor>& weights = like.weights;
  const int64_t rows = layout.rows;
  check_grad_loss(op, grad_loss);
  check_float(op, "row_scale", row_scale_in);
  check_shape(op, "row_scale", row_scale_in, {rows});
  check_float(op, "row_state", row_state_in);
  check_shape(op, "row_state", row_state_in, {rows, kRowState});
  check_same_device(
      op,
      {{"logprobs", &logprobs}, {"grad_loss", &grad_loss}, {"row_scale", &row_scale_in}, {"row_state", &row_state_in}});
  check_cuda(op, logprobs);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const at::Tensor upstream = grad_loss.reshape({}).to(b.dtype).contiguous();
  const at::Tensor scales = row_scale_in.to(b.dtype).contiguous(), states = row_state_in.to(b.dtype).contiguous();
  // GSPO passes no gradient to old_logprobs (its sequence ratio is detached).
  const bool need_logp = output_mask[0], need_old = output_mask[1] && mode == PolicyMode::kGeoMean;
  const bool need_adv = output_mask[2], need_w = output_mask[3] && b.weights.defined();
  const auto options = logprobs.options().dtype(b.dtype);
  at::Tensor g_lp = need_logp || need_old ? at::empty(logprobs.sizes(), options) : at::Tensor();
  at::Tensor g_ad = need_adv ? at::empty(logprobs.sizes(), options) : at::Tensor();
  at::Tensor g_w = need_w ? at::empty(logprobs.sizes(), options) : at::Tensor();
  if (g_lp.defined() || g_ad.defined() || g_w.defined()) {
    with_compute_type(b.dtype, [&](auto tag) {
      using T = decltype(tag);
      auto ptr = [](at::Tensor& t) { return t.defined() ? t.mutable_data_ptr<T>() : nullptr; };
      cuda::seq_loss_backward<T>(mode, seq_inputs<T>(b, layout, eps_low, eps_high), upstream.const_data_ptr<T>(),
                                 scales.const_data_ptr<T>(), states.const_data_ptr<T>(),
                                 {ptr(g_lp), ptr(g_ad), ptr(g_w)}, c10::cuda::getCurrentCUDAStream());
    });
    check_launch(op);
  }
  auto in_dtype = [](const at::Tensor& g, bool wanted, const at::Tensor& input) {
    return wanted ? g.to(input.scalar_type()) : at::empty({0}, input.options());
  };
  return {in_dtype(g_lp, need_logp, logprobs),
          need_old ? (-g_lp).to(old_logprobs.scalar_type()) : at::empty({0}, old_logprobs.options()),
          in_dtype(g_ad, need_adv, advantages),
          weights.has_value() ? in_dtype(g_w, need_w, *weights) : at::empty({0}, logprobs.options())};
}

template <PolicyMode mode>
SeqGrads seq_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                                const at::Tensor& advantages, const at::Tensor& mask,
                                const std::optional<at::Tensor>& weights, const at::Tensor& row_scale,
                                const at::Tensor& row_state, double eps_low, double eps_high,
                                std::array<bool, 4> output_mask) {
  const char* op = seq_loss_backward_op_name(mode);
  const SeqBuffers b = seq_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  return seq_loss_backward_rows<mode>(op, grad_loss, b, padded_rows(logprobs),
                                      {logprobs, old_logprobs, advantages, weights}, row_scale, row_state, eps_low,
                                      eps_high, output_mask);
}

template <PolicyMode mode>
SeqGrads seq_loss_varlen_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logprobs,
                                       const at::Tensor& old_logprobs, const at::Tensor& advantages,
                                       const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                                       const at::Tensor& row_scale, const at::Tensor& row_state,
                                       const at::Tensor& cu_seqlens, double eps_low, double eps_high,
                                       std::array<bool, 4> output_mask) {
  const char* op = seq_loss_varlen_backward_op_name(mode);
  const SeqBuffers b = seq_varlen_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  return seq_loss_backward_rows<mode>(op, grad_loss, b, packed_rows(op, cu_seqlens, logprobs),
                                      {logprobs, old_logprobs, advantages, weights}, row_scale, row_state, eps_low,
                                      eps_high, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CUDA, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cuda);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cuda);
  m.impl("policy_loss_gspo", &seq_loss_cuda<PolicyMode::kGspo>);
  m.impl("policy_loss_gspo_backward", &seq_loss_backward_cuda<PolicyMode::kGspo>);
  m.impl("policy_loss_geo_mean", &seq_loss_cuda<PolicyMode::kGeoMean>);
  m.impl("policy_loss_geo_mean_backward", &seq_loss_backward_cuda<PolicyMode::kGeoMean>);
  m.impl("policy_loss_gspo_varlen", &seq_loss_varlen_cuda<PolicyMode::kGspo>);
  m.impl("policy_loss_gspo_varlen_backward", &seq_loss_varlen_backward_cuda<PolicyMode::kGspo>);
  m.impl("policy_loss_geo_mean_varlen", &seq_loss_varlen_cuda<PolicyMode::kGeoMean>);
  m.impl("policy_loss_geo_mean_varlen_backward", &seq_loss_varlen_backward_cuda<PolicyMode::kGeoMean>);
}

}  // namespace ppo_fast
