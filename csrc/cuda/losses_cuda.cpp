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

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return cuda::kFloat32;
    case at::kHalf:
      return cuda::kFloat16;
    case at::kBFloat16:
      return cuda::kBFloat16;
    case at::kDouble:
      return cuda::kFloat64;
    default:
      TORCH_CHECK(false, "ppo_fast CUDA losses: unsupported dtype ", t);
  }
}

// The kernels read one dtype per launch: the inputs' own when they share one, else
// (a rare mix) every input converted to the compute dtype.
at::ScalarType kernel_dtype(std::initializer_list<at::Tensor*> inputs, at::ScalarType compute) {
  const at::ScalarType first = (*inputs.begin())->scalar_type();
  bool uniform = true;
  for (const at::Tensor* t : inputs) uniform = uniform && (!t->defined() || t->scalar_type() == first);
  if (uniform) return first;
  for (at::Tensor* t : inputs)
    if (t->defined()) *t = t->to(compute);
  return compute;
}

void check_cuda(const char* op, const at::Tensor& first) {
  TORCH_CHECK(first.is_cuda(), op, ": expects CUDA tensors, got one on ", first.device());
}

// The kernels' work items (warps) for these inputs; their count must fit the grid's int32 math.
cuda::ChunkPlan checked_plan(const char* op, const at::Tensor& like) {
  const cuda::ChunkPlan plan = cuda::chunk_plan(like.size(0), like.size(1), like.element_size());
  TORCH_CHECK(plan.items <= std::numeric_limits<int32_t>::max(), op, ": too many rows for the CUDA kernels, got ",
              like.size(0));
  return plan;
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

// The gradient of `input` (read by the kernel as `kernel_input`) when wanted, else an
// empty tensor; to_input_dtype converts it to the input's dtype after the kernel.
struct Grad {
  at::Tensor data;
  at::ScalarType input_dtype;
  Grad(const at::Tensor& kernel_input, at::ScalarType input_dtype, bool wanted)
      : data(wanted ? at::empty(kernel_input.sizes(), kernel_input.options().memory_format(at::MemoryFormat::Contiguous))
                    : at::empty({0}, kernel_input.options().dtype(input_dtype))),
        input_dtype(input_dtype) {}
  void* pointer() const { return data.numel() > 0 ? data.mutable_data_ptr() : nullptr; }
  at::Tensor to_input_dtype() const { return data.to(input_dtype); }
};

struct Results {
  at::Tensor loss, stats[3], row_scale;
  cuda::LossOutputs pointers() {
    cuda::LossOutputs out{loss.mutable_data_ptr(), {nullptr, nullptr, nullptr}, row_scale.mutable_data_ptr()};
    for (int s = 0; s < 3; ++s)
      if (stats[s].defined()) out.stats[s] = stats[s].mutable_data_ptr();
    return out;
  }
};

// loss and row_scale in the compute dtype, the stats in stat_dtypes (as the reference
// returns them and the kernels write them: see cuda::LossOutputs).
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
  at::ScalarType dtype;         // compute dtype
  at::ScalarType kernel_dtype;  // of every buffer
};

cuda::PolicyInputs policy_inputs(const PolicyBuffers& b, double clip_low, double clip_high, std::optional<double> dual_clip) {
  return {b.logp.const_data_ptr(), b.old.const_data_ptr(), b.adv.const_data_ptr(),
          b.weights.defined() ? b.weights.const_data_ptr() : nullptr,
          b.mask.const_data_ptr<bool>(), b.logp.size(0), b.logp.size(1), dtype_code(b.kernel_dtype),
          policy_params(clip_low, clip_high, dual_clip)};
}

// Checked, contiguous inputs (the same checks as the CPU kernels'), all of one dtype.
PolicyBuffers policy_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                             const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  check_cuda(op, logprobs);
  PolicyBuffers b{logprobs.contiguous(), old_logprobs.contiguous(), advantages.contiguous(),
                  weights.has_value() ? weights->contiguous() : at::Tensor(), mask.contiguous(), at::kFloat, at::kFloat};
  b.dtype = compute_dtype({&b.logp, &b.old, &b.adv, &b.weights});
  b.kernel_dtype = kernel_dtype({&b.logp, &b.old, &b.adv, &b.weights}, b.dtype);
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_cuda(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& weights, double clip_low, double clip_high, std::optional<double> dual_clip,
    c10::string_view agg_name) {
  constexpr const char* op = "clipped_policy_loss";
  const Agg agg = parse_agg(op, agg_name);
  const PolicyBuffers b = policy_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  const cuda::ChunkPlan plan = checked_plan(op, b.logp);
  at::Tensor partials = at::empty({plan.items, kPolicyPartials}, logprobs.options().dtype(at::kDouble));
  Results r = allocate_results(logprobs, b.dtype, {at::kFloat, at::kFloat, b.dtype});
  cuda::policy_loss_forward(policy_inputs(b, clip_low, clip_high, dual_clip), agg, partials.mutable_data_ptr<double>(),
                            r.pointers(), c10::cuda::getCurrentCUDAStream());
  check_launch(op);
  return {r.loss, r.stats[0], r.stats[1], r.stats[2], r.row_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_backward_cuda(
    const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& mask, const std::optional<at::Tensor>& weights, const at::Tensor& row_scale, double clip_low,
    double clip_high, std::optional<double> dual_clip, std::array<bool, 4> output_mask) {
  constexpr const char* op = "clipped_policy_loss_backward";
  const PolicyBuffers b = policy_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const c10::cuda::CUDAGuard guard(logprobs.device());
  checked_plan(op, b.logp);
  const at::Tensor upstream = checked_upstream(op, grad_loss, logprobs, b.dtype);
  const at::Tensor scale = checked_row_scale(op, row_scale, logprobs, b.dtype);
  const auto [need_logp, need_old, need_adv, need_w_asked] = output_mask;
  const bool need_w = need_w_asked && weights.has_value();
  const Grad grad_logp(b.logp, logprobs.scalar_type(), need_logp), grad_old(b.old, old_logprobs.scalar_type(), need_old);
  const Grad grad_adv(b.adv, advantages.scalar_type(), need_adv);
  const Grad grad_w = weights.has_value() ? Grad(b.weights, weights->scalar_type(), need_w) : Grad(b.logp, logprobs.scalar_type(), false);
  if (need_logp || need_old || need_adv || need_w) {
    const cuda::GradOutputs grads{{grad_logp.pointer(), grad_old.pointer(), grad_adv.pointer(), grad_w.pointer()}};
    cuda::policy_loss_backward(policy_inputs(b, clip_low, clip_high, dual_clip), upstream.const_data_ptr(),
                               scale.const_data_ptr(), grads, c10::cuda::getCurrentCUDAStream());
    check_launch(op);
  }
  return {grad_logp.to_input_dtype(), grad_old.to_input_dtype(), grad_adv.to_input_dtype(), grad_w.to_input_dtype()};
}

struct ValueBuffers {
  at::Tensor v, old, ret, mask;
  at::ScalarType dtype;         // compute dtype
  at::ScalarType kernel_dtype;  // of every buffer
};

ValueBuffers value_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                           const at::Tensor& returns, const at::Tensor& mask) {
  check_value_inputs(op, values, old_values, returns, mask);
  check_cuda(op, values);
  ValueBuffers b{values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(), at::kFloat, at::kFloat};
  b.dtype = compute_dtype({&b.v, &b.old, &b.ret});
  b.kernel_dtype = kernel_dtype({&b.v, &b.old, &b.ret}, b.dtype);
  return b;
}

cuda::ValueInputs value_inputs(const ValueBuffers& b, double clip) {
  return {b.v.const_data_ptr(), b.old.const_data_ptr(), b.ret.const_data_ptr(), b.mask.const_data_ptr<bool>(),
          b.v.size(0), b.v.size(1), dtype_code(b.kernel_dtype), clip};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cuda(const at::Tensor& values, const at::Tensor& old_values,
                                                               const at::Tensor& returns, const at::Tensor& mask,
                                                               double clip, c10::string_view agg_name) {
  constexpr const char* op = "value_loss";
  const Agg agg = parse_agg(op, agg_name);
  const ValueBuffers b = value_buffers(op, values, old_values, returns, mask);
  const c10::cuda::CUDAGuard guard(values.device());
  const cuda::ChunkPlan plan = checked_plan(op, b.v);
  at::Tensor partials = at::empty({plan.items, kValuePartials}, values.options().dtype(at::kDouble));
  Results r = allocate_results(values, b.dtype, {at::kFloat});
  cuda::value_loss_forward(value_inputs(b, clip), agg, partials.mutable_data_ptr<double>(), r.pointers(),
                           c10::cuda::getCurrentCUDAStream());
  check_launch(op);
  return {r.loss, r.stats[0], r.row_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& values,
                                                                        const at::Tensor& old_values, const at::Tensor& returns,
                                                                        const at::Tensor& mask, const at::Tensor& row_scale,
                                                                        double clip, std::array<bool, 3> output_mask) {
  constexpr const char* op = "value_loss_backward";
  const ValueBuffers b = value_buffers(op, values, old_values, returns, mask);
  const c10::cuda::CUDAGuard guard(values.device());
  checked_plan(op, b.v);
  const at::Tensor upstream = checked_upstream(op, grad_loss, values, b.dtype);
  const at::Tensor scale = checked_row_scale(op, row_scale, values, b.dtype);
  const auto [need_v, need_old, need_ret] = output_mask;
  const Grad grad_v(b.v, values.scalar_type(), need_v), grad_old(b.old, old_values.scalar_type(), need_old);
  const Grad grad_ret(b.ret, returns.scalar_type(), need_ret);
  if (need_v || need_old || need_ret) {
    const cuda::GradOutputs grads{{grad_v.pointer(), grad_old.pointer(), grad_ret.pointer(), nullptr}};
    cuda::value_loss_backward(value_inputs(b, clip), upstream.const_data_ptr(), scale.const_data_ptr(), grads,
                              c10::cuda::getCurrentCUDAStream());
    check_launch(op);
  }
  return {grad_v.to_input_dtype(), grad_old.to_input_dtype(), grad_ret.to_input_dtype()};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CUDA, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cuda);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cuda);
  m.impl("value_loss", &value_loss_cuda);
  m.impl("value_loss_backward", &value_loss_backward_cuda);
}

}  // namespace ppo_fast
