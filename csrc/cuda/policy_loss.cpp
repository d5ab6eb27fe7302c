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
#include "common/seq_loss_glue.h"
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

// The backward over `layout`'s rows.
template <PolicyMode mode>
SeqGrads seq_loss_backward_rows(const char* op, const at::Tensor& grad_loss, const SeqBuffers& b, const SeqRows& layout,
                                const SeqLike& like, const at::Tensor& row_scale_in, const at::Tensor& row_state_in,
                                double eps_low, double eps_high, std::array<bool, 4> output_mask) {
  const at::Tensor& logprobs = like.logprobs;
  check_seq_backward(op, grad_loss, like, row_scale_in, row_state_in, layout.rows);
  check_cuda(op, logprobs);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const at::Tensor upstream = grad_loss.reshape({}).to(b.dtype).contiguous();
  const at::Tensor scales = row_scale_in.to(b.dtype).contiguous(), states = row_state_in.to(b.dtype).contiguous();
  const SeqWants want = seq_wants(mode, output_mask, b.weights.defined());
  const auto options = logprobs.options().dtype(b.dtype);
  at::Tensor g_lp = want.logp || want.old ? at::empty(logprobs.sizes(), options) : at::Tensor();
  at::Tensor g_ad = want.adv ? at::empty(logprobs.sizes(), options) : at::Tensor();
  at::Tensor g_w = want.weights ? at::empty(logprobs.sizes(), options) : at::Tensor();
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
  return seq_grads(like, want, g_lp, g_ad, g_w);
}

// SeqLoss's kernels on CUDA: the rows are cu_seqlens' segments on the device, or the padded [B, T] rows.
struct CudaSeqKernels {
  static SeqBuffers inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                           const at::Tensor& advantages, const at::Tensor& mask,
                           const std::optional<at::Tensor>& weights) {
    return seq_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  }
  static SeqRows padded(const SeqBuffers& b) { return {at::Tensor(), b.logp.size(0), b.logp.size(1)}; }
  static SeqRows packed(const char* op, const at::Tensor& cu_seqlens, const at::Tensor& logprobs) {
    return packed_rows(op, cu_seqlens, logprobs);
  }
  static void device(const char* op, const at::Tensor& logprobs) { check_cuda(op, logprobs); }
  template <PolicyMode mode>
  static SeqForward forward(const char* op, const SeqBuffers& b, const SeqRows& layout, const at::Tensor& logprobs,
                            double eps_low, double eps_high, Agg agg) {
    return seq_loss_rows<mode>(op, b, layout, logprobs, eps_low, eps_high, agg);
  }
  template <PolicyMode mode>
  static SeqGrads backward(const char* op, const at::Tensor& grad_loss, const SeqBuffers& b, const SeqRows& layout,
                           const SeqLike& like, const at::Tensor& row_scale, const at::Tensor& row_state,
                           double eps_low, double eps_high, std::array<bool, 4> output_mask) {
    return seq_loss_backward_rows<mode>(op, grad_loss, b, layout, like, row_scale, row_state, eps_low, eps_high,
                                        output_mask);
  }
};

template <PolicyMode mode>
using CudaSeqLoss = SeqLoss<CudaSeqKernels, mode>;

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CUDA, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cuda);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cuda);
  m.impl("policy_loss_gspo", &CudaSeqLoss<PolicyMode::kGspo>::padded);
  m.impl("policy_loss_gspo_backward", &CudaSeqLoss<PolicyMode::kGspo>::padded_backward);
  m.impl("policy_loss_geo_mean", &CudaSeqLoss<PolicyMode::kGeoMean>::padded);
  m.impl("policy_loss_geo_mean_backward", &CudaSeqLoss<PolicyMode::kGeoMean>::padded_backward);
  m.impl("policy_loss_gspo_varlen", &CudaSeqLoss<PolicyMode::kGspo>::packed);
  m.impl("policy_loss_gspo_varlen_backward", &CudaSeqLoss<PolicyMode::kGspo>::packed_backward);
  m.impl("policy_loss_geo_mean_varlen", &CudaSeqLoss<PolicyMode::kGeoMean>::packed);
  m.impl("policy_loss_geo_mean_varlen_backward", &CudaSeqLoss<PolicyMode::kGeoMean>::packed_backward);
}

}  // namespace ppo_fast
