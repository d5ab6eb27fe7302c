// Torch glue of the CUDA loss kernels: checks, allocation, the current stream, launch
// error checks.  The kernels are in csrc/cuda/losses.cu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>

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

// Contiguous [B, T] inputs on one CUDA device and a bool mask.
void check_inputs(const char* op, std::initializer_list<const at::Tensor*> tensors, const at::Tensor& mask) {
  const at::Tensor& first = **tensors.begin();
  TORCH_CHECK(first.dim() == 2, op, ": expects [B, T] inputs, got ", first.sizes());
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.sizes() == first.sizes() && mask.device() == first.device(), op,
              ": mask must be a bool tensor of the inputs' shape and device");
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->is_cuda() && t->device() == first.device(), op, ": all inputs must be on ", first.device());
    TORCH_CHECK(t->sizes() == first.sizes(), op, ": shape mismatch ", t->sizes(), " vs ", first.sizes());
  }
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
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

PolicyBuffers policy_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                             const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  if (weights.has_value())
    check_inputs(op, {&logprobs, &old_logprobs, &advantages, &*weights}, mask);
  else
    check_inputs(op, {&logprobs, &old_logprobs, &advantages}, mask);
  PolicyBuffers b{logprobs.contiguous(), old_logprobs.contiguous(), advantages.contiguous(),
                  weights.has_value() ? weights->contiguous() : at::Tensor(), mask.contiguous(), at::kFloat};
  b.dtype = compute_dtype({&b.logp, &b.old, &b.adv, &b.weights});
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_cuda(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& weights, double clip_low, double clip_high, std::optional<double> dual_clip,
    int64_t agg) {
  const PolicyBuffers b = policy_buffers("clipped_policy_loss", logprobs, old_logprobs, advantages, mask, weights);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  at::Tensor partials = at::empty({logprobs.size(0), kPolicyPartials}, logprobs.options().dtype(at::kDouble));
  Results r = allocate_results(logprobs, b.dtype, {at::kFloat, at::kFloat, b.dtype});
  cuda::policy_loss_forward(policy_inputs(b, clip_low, clip_high, dual_clip), agg, b.dtype == at::kDouble,
                            partials.mutable_data_ptr<double>(), r.pointers(), c10::cuda::getCurrentCUDAStream());
  check_launch("clipped_policy_loss");
  return {r.loss, r.stats[0], r.stats[1], r.stats[2], r.row_scale};
}

at::Tensor clipped_policy_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logprobs,
                                             const at::Tensor& old_logprobs, const at::Tensor& advantages,
                                             const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                                             const at::Tensor& row_scale, double clip_low, double clip_high,
                                             std::optional<double> dual_clip) {
  const PolicyBuffers b = policy_buffers("clipped_policy_loss_backward", logprobs, old_logprobs, advantages, mask, weights);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const at::Tensor upstream = grad_loss.to(b.dtype).contiguous();
  const at::Tensor scale = row_scale.to(b.dtype).contiguous();
  at::Tensor grad = at::empty_like(b.logp);
  cuda::policy_loss_backward(policy_inputs(b, clip_low, clip_high, dual_clip), b.dtype == at::kDouble,
                             upstream.const_data_ptr(), scale.const_data_ptr(), grad.mutable_data_ptr(), dtype_code(grad),
                             c10::cuda::getCurrentCUDAStream());
  check_launch("clipped_policy_loss_backward");
  return grad;
}

struct ValueBuffers {
  at::Tensor v, old, ret, mask;
  at::ScalarType dtype;  // compute dtype
};

ValueBuffers value_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                           const at::Tensor& returns, const at::Tensor& mask) {
  check_inputs(op, {&values, &old_values, &returns}, mask);
  ValueBuffers b{values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(), at::kFloat};
  b.dtype = compute_dtype({&b.v, &b.old, &b.ret});
  return b;
}

cuda::ValueInputs value_inputs(const ValueBuffers& b, double clip) {
  return {float_ptr(b.v), float_ptr(b.old), float_ptr(b.ret), b.mask.const_data_ptr<bool>(), b.v.size(0), b.v.size(1), clip};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cuda(const at::Tensor& values, const at::Tensor& old_values,
                                                               const at::Tensor& returns, const at::Tensor& mask,
                                                               double clip, int64_t agg) {
  const ValueBuffers b = value_buffers("value_loss", values, old_values, returns, mask);
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor partials = at::empty({values.size(0), kValuePartials}, values.options().dtype(at::kDouble));
  Results r = allocate_results(values, b.dtype, {at::kFloat});
  cuda::value_loss_forward(value_inputs(b, clip), agg, b.dtype == at::kDouble, partials.mutable_data_ptr<double>(),
                           r.pointers(), c10::cuda::getCurrentCUDAStream());
  check_launch("value_loss");
  return {r.loss, r.stats[0], r.row_scale};
}

at::Tensor value_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& values, const at::Tensor& old_values,
                                    const at::Tensor& returns, const at::Tensor& mask, const at::Tensor& row_scale,
                                    double clip) {
  const ValueBuffers b = value_buffers("value_loss_backward", values, old_values, returns, mask);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor upstream = grad_loss.to(b.dtype).contiguous();
  const at::Tensor scale = row_scale.to(b.dtype).contiguous();
  at::Tensor grad = at::empty_like(b.v);
  cuda::value_loss_backward(value_inputs(b, clip), b.dtype == at::kDouble, upstream.const_data_ptr(),
                            scale.const_data_ptr(), grad.mutable_data_ptr(), dtype_code(grad),
                            c10::cuda::getCurrentCUDAStream());
  check_launch("value_loss_backward");
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CUDA, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cuda);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cuda);
  m.impl("value_loss", &value_loss_cuda);
  m.impl("value_loss_backward", &value_loss_backward_cuda);
}

}  // namespace ppo_fast
