// Torch glue of the CUDA loss kernels: checks, allocation, the current stream, launch
// error checks.  The kernels are in csrc/cuda/losses.cu.  Nothing here reads tensor
// values on the host (no device sync): grad_loss and row_scale stay on the device.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <optional>

#include "checks.h"
#include "contract.h"
#include "cpu/float_io.h"  // compute_dtype, shared with the CPU kernels
#include "cuda/losses_cuda.h"

namespace ppo_fast {
namespace {

cuda::FloatPtr float_ptr(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return {t.const_data_ptr(), cuda::kFloat32};
    case at::kHalf:
      return {t.const_data_ptr(), cuda::kFloat16};
    case at::kBFloat16:
      return {t.const_data_ptr(), cuda::kBFloat16};
    case at::kDouble:
      return {t.const_data_ptr(), cuda::kFloat64};
    default:
      TORCH_CHECK(false, "ppo_fast CUDA losses: unsupported dtype ", t.scalar_type());
  }
}

int dtype_code(const at::Tensor& t) { return float_ptr(t).dtype; }

void check_cuda(const char* op, const at::Tensor& first) {
  TORCH_CHECK(first.is_cuda(), op, ": expects CUDA tensors, got one on ", first.device());
  // One block per row in the forward.
  TORCH_CHECK(first.size(0) <= std::numeric_limits<int32_t>::max(), op, ": at most 2^31 - 1 rows, got ", first.size(0));
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

// row_scale [B] as the forward returned it, in the compute dtype, on the inputs' device.
at::Tensor checked_row_scale(const char* op, const at::Tensor& row_scale, const at::Tensor& like, at::ScalarType dtype) {
  check_float(op, "row_scale", row_scale);
  check_shape(op, "row_scale", row_scale, {like.size(0)});
  check_same_device(op, {{"row_scale", &row_scale}, {"inputs", &like}});
  return row_scale.to(dtype).contiguous();
}

// grad_loss (one element, on the inputs' device) in the compute dtype: read by the kernel.
at::Tensor checked_upstream(const char* op, const at::Tensor& grad_loss, const at::Tensor& like, at::ScalarType dtype) {
  check_grad_loss(op, grad_loss);
  check_same_device(op, {{"grad_loss", &grad_loss}, {"inputs", &like}});
  return grad_loss.reshape({}).to(dtype).contiguous();
}

// The gradient of `input` when wanted (its dtype, contiguous), else an empty tensor.
at::Tensor grad_like(const at::Tensor& input, bool wanted) {
  return wanted ? at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous))
                : at::empty({0}, input.options());
}

cuda::GradOutputs grad_outputs(std::initializer_list<std::pair<const at::Tensor*, bool>> grads) {
  cuda::GradOutputs out{{nullptr, nullptr, nullptr, nullptr}, {0, 0, 0, 0}};
  int k = 0;
  for (const auto& [t, wanted] : grads) {
    if (wanted) {
      out.data[k] = t->mutable_data_ptr();
      out.dtypes[k] = dtype_code(*t);
    }
    ++k;
  }
  return out;
}

struct Results {
  at::Tensor loss, stats[3], row_scale;
  cuda::LossOutputs pointers() {
    cuda::LossOutputs out{loss.mutable_data_ptr(), {nullptr, nullptr, nullptr}, {0, 0, 0}, row_scale.mutable_data_ptr()};
    for (int s = 0; s < 3; ++s) {
      if (!stats[s].defined()) continue;
      out.stats[s] = stats[s].mutable_data_ptr();
      out.stat_dtypes[s] = dtype_code(stats[s]);
    }
    return out;
  }
};

// loss and row_scale in the compute dtype, the stats in stat_dtypes (as the reference returns them).
Results allocate_results(const at::Tensor& like, at::ScalarType dtype, std::initializer_list<at::ScalarType> stat_dtypes) {
  Results r;
  r.loss = at::empty({}, like.options().dtype(dtype));
  int s = 0;
  for (at::ScalarType stat_dtype : stat_dtypes) r.stats[s++] = at::empty({}, like.options().dtype(stat_dtype));
  r.row_scale = at::empty({like.size(0)}, like.options().dtype(dtype));
  return r;
}

struct PolicyBuffers {
  at::Tensor logp, old, adv, weights, mask;
  at::ScalarType dtype;  // compute dtype
};

cuda::PolicyInputs policy_inputs(const PolicyBuffers& b, double clip_low, double clip_high, std::optional<double> dual_clip) {
  return {float_ptr(b.logp), float_ptr(b.old), float_ptr(b.adv),
          b.weights.defined() ? float_ptr(b.weights) : cuda::FloatPtr{nullptr, cuda::kFloat32},
          b.mask.const_data_ptr<bool>(), b.logp.size(0), b.logp.size(1), policy_params(clip_low, clip_high, dual_clip)};
}

// Checked, contiguous inputs (the same checks as the CPU kernels').
PolicyBuffers policy_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                             const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  check_cuda(op, logprobs);
  PolicyBuffers b{logprobs.contiguous(), old_logprobs.contiguous(), advantages.contiguous(),
                  weights.has_value() ? weights->contiguous() : at::Tensor(), mask.contiguous(), at::kFloat};
  b.dtype = compute_dtype({&b.logp, &b.old, &b.adv, &b.weights});
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_cuda(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& weights, double clip_low, double clip_high, std::optional<double> dual_clip,
    c10::string_view agg_name) {
  const Agg agg = parse_agg("clipped_policy_loss", agg_name);
  const PolicyBuffers b = policy_buffers("clipped_policy_loss", logprobs, old_logprobs, advantages, mask, weights);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  at::Tensor partials = at::empty({logprobs.size(0), kPolicyPartials}, logprobs.options().dtype(at::kDouble));
  Results r = allocate_results(logprobs, b.dtype, {at::kFloat, at::kFloat, b.dtype});
  cuda::policy_loss_forward(policy_inputs(b, clip_low, clip_high, dual_clip), agg, b.dtype == at::kDouble,
                            partials.mutable_data_ptr<double>(), r.pointers(), c10::cuda::getCurrentCUDAStream());
  check_launch("clipped_policy_loss");
  return {r.loss, r.stats[0], r.stats[1], r.stats[2], r.row_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_backward_cuda(
    const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& mask, const std::optional<at::Tensor>& weights, const at::Tensor& row_scale, double clip_low,
    double clip_high, std::optional<double> dual_clip, std::array<bool, 4> output_mask) {
  constexpr const char* op = "clipped_policy_loss_backward";
  const PolicyBuffers b = policy_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const at::Tensor upstream = checked_upstream(op, grad_loss, logprobs, b.dtype);
  const at::Tensor scale = checked_row_scale(op, row_scale, logprobs, b.dtype);
  const auto [need_logp, need_old, need_adv, need_w_asked] = output_mask;
  const bool need_w = need_w_asked && weights.has_value();
  at::Tensor grad_logp = grad_like(logprobs, need_logp), grad_old = grad_like(old_logprobs, need_old);
  at::Tensor grad_adv = grad_like(advantages, need_adv);
  at::Tensor grad_w = weights.has_value() ? grad_like(*weights, need_w) : at::empty({0}, logprobs.options());
  if (need_logp || need_old || need_adv || need_w) {
    const cuda::GradOutputs grads =
        grad_outputs({{&grad_logp, need_logp}, {&grad_old, need_old}, {&grad_adv, need_adv}, {&grad_w, need_w}});
    cuda::policy_loss_backward(policy_inputs(b, clip_low, clip_high, dual_clip), b.dtype == at::kDouble,
                               upstream.const_data_ptr(), scale.const_data_ptr(), grads, c10::cuda::getCurrentCUDAStream());
    check_launch(op);
  }
  return {grad_logp, grad_old, grad_adv, grad_w};
}

struct ValueBuffers {
  at::Tensor v, old, ret, mask;
  at::ScalarType dtype;  // compute dtype
};

ValueBuffers value_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                           const at::Tensor& returns, const at::Tensor& mask) {
  check_value_inputs(op, values, old_values, returns, mask);
  check_cuda(op, values);
  ValueBuffers b{values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(), at::kFloat};
  b.dtype = compute_dtype({&b.v, &b.old, &b.ret});
  return b;
}

cuda::ValueInputs value_inputs(const ValueBuffers& b, double clip) {
  return {float_ptr(b.v), float_ptr(b.old), float_ptr(b.ret), b.mask.const_data_ptr<bool>(), b.v.size(0), b.v.size(1), clip};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cuda(const at::Tensor& values, const at::Tensor& old_values,
                                                               const at::Tensor& returns, const at::Tensor& mask,
                                                               double clip, c10::string_view agg_name) {
  const Agg agg = parse_agg("value_loss", agg_name);
  const ValueBuffers b = value_buffers("value_loss", values, old_values, returns, mask);
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor partials = at::empty({values.size(0), kValuePartials}, values.options().dtype(at::kDouble));
  Results r = allocate_results(values, b.dtype, {at::kFloat});
  cuda::value_loss_forward(value_inputs(b, clip), agg, b.dtype == at::kDouble, partials.mutable_data_ptr<double>(),
                           r.pointers(), c10::cuda::getCurrentCUDAStream());
  check_launch("value_loss");
  return {r.loss, r.stats[0], r.row_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& values,
                                                                        const at::Tensor& old_values, const at::Tensor& returns,
                                                                        const at::Tensor& mask, const at::Tensor& row_scale,
                                                                        double clip, std::array<bool, 3> output_mask) {
  constexpr const char* op = "value_loss_backward";
  const ValueBuffers b = value_buffers(op, values, old_values, returns, mask);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor upstream = checked_upstream(op, grad_loss, values, b.dtype);
  const at::Tensor scale = checked_row_scale(op, row_scale, values, b.dtype);
  const auto [need_v, need_old, need_ret] = output_mask;
  at::Tensor grad_v = grad_like(values, need_v), grad_old = grad_like(old_values, need_old);
  at::Tensor grad_ret = grad_like(returns, need_ret);
  if (need_v || need_old || need_ret) {
    const cuda::GradOutputs grads = grad_outputs({{&grad_v, need_v}, {&grad_old, need_old}, {&grad_ret, need_ret}});
    cuda::value_loss_backward(value_inputs(b, clip), b.dtype == at::kDouble, upstream.const_data_ptr(),
                              scale.const_data_ptr(), grads, c10::cuda::getCurrentCUDAStream());
    check_launch(op);
  }
  return {grad_v, grad_old, grad_ret};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CUDA, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cuda);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cuda);
  m.impl("value_loss", &value_loss_cuda);
  m.impl("value_loss_backward", &value_loss_backward_cuda);
}

}  // namespace ppo_fast
