// Torch glue of the CUDA value-loss kernels (csrc/cuda/value_loss.cu): the checks of the
// CPU kernels, the inputs in one dtype per launch, the current stream, launch error checks.
// Nothing here reads tensor values on the host (no device sync): grad_loss and row_scale
// stay on the device.
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
#include "cuda/token_loss_glue.h"
#include "cuda/value_loss.h"

namespace ppo_fast {
namespace {

struct ValueBuffers {
  at::Tensor v, old, ret, mask;
  at::ScalarType dtype;         // compute dtype
  at::ScalarType kernel_dtype;  // of every buffer
};

ValueBuffers value_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                           const at::Tensor& returns, const at::Tensor& mask) {
  check_value_inputs(op, values, old_values, returns, mask);  // the caller requires CUDA after its last check
  ValueBuffers b{values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(), at::kFloat,
                 at::kFloat};
  b.dtype = compute_dtype({&b.v, &b.old, &b.ret});
  b.kernel_dtype = kernel_dtype({&b.v, &b.old, &b.ret}, b.dtype);
  return b;
}

cuda::ValueInputs value_inputs(const ValueBuffers& b, double clip) {
  return {b.v.const_data_ptr(),
          b.old.const_data_ptr(),
          b.ret.const_data_ptr(),
          b.mask.const_data_ptr<bool>(),
          b.v.size(0),
          b.v.size(1),
          dtype_code(b.kernel_dtype),
          clip};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cuda(const at::Tensor& values, const at::Tensor& old_values,
                                                               const at::Tensor& returns, const at::Tensor& mask,
                                                               double clip, c10::string_view agg_name) {
  constexpr const char* op = "value_loss";
  const Agg agg = parse_agg(op, agg_name);
  const ValueBuffers b = value_buffers(op, values, old_values, returns, mask);
  check_cuda(op, values);
  const c10::cuda::CUDAGuard guard(values.device());
  const cuda::ChunkPlan plan = checked_plan(op, b.v);
  at::Tensor partials = at::empty({cuda::forward_scratch_doubles(plan, values.size(0), kValuePartials)},
                                  values.options().dtype(at::kDouble));
  Results r = allocate_results(values, b.dtype, {at::kFloat});
  cuda::value_loss_forward(value_inputs(b, clip), agg, partials.mutable_data_ptr<double>(), r.pointers(),
                           c10::cuda::getCurrentCUDAStream());
  check_launch(op);
  return {r.loss, r.stats[0], r.row_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_backward_cuda(
    const at::Tensor& grad_loss, const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
    const at::Tensor& mask, const at::Tensor& row_scale, double clip, std::array<bool, 3> output_mask) {
  constexpr const char* op = "value_loss_backward";
  const ValueBuffers b = value_buffers(op, values, old_values, returns, mask);
  const at::Tensor upstream = checked_upstream(op, grad_loss, values, b.dtype);
  const at::Tensor scale = checked_row_scale(op, row_scale, values, b.dtype);
  check_cuda(op, values);
  const c10::cuda::CUDAGuard guard(values.device());
  checked_plan(op, b.v);
  const bool need_v = output_mask[0], need_old = output_mask[1], need_ret = output_mask[2];
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

// ----------------------------------------------------------------------------- the packed layout
// value_loss_varlen: [N] inputs checked as one [1, N] row, one row per cu_seqlens segment (row_scale [S]).

ValueBuffers value_varlen_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                                  const at::Tensor& returns, const at::Tensor& mask) {
  check_dim(op, "values", values, 1);
  const auto row = [](const at::Tensor& t) { return t.dim() == 1 ? t.unsqueeze(0) : t; };
  return value_buffers(op, row(values), row(old_values), row(returns), row(mask));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_varlen_cuda(const at::Tensor& values,
                                                                      const at::Tensor& old_values,
                                                                      const at::Tensor& returns, const at::Tensor& mask,
                                                                      const at::Tensor& cu_seqlens, double clip,
                                                                      c10::string_view agg_name) {
  constexpr const char* op = "value_loss_varlen";
  const Agg agg = parse_agg(op, agg_name);
  const ValueBuffers b = value_varlen_buffers(op, values, old_values, returns, mask);
  const at::Tensor cu = device_cu_seqlens(op, cu_seqlens, values);  // checked before the device, as on the CPU
  check_cuda(op, values);
  const c10::cuda::CUDAGuard guard(values.device());
  const int64_t rows = cu.numel() - 1;
  const cuda::ChunkPlan plan = checked_varlen_plan(op, cu, b.v);
  at::Tensor partials =
      at::empty({cuda::forward_scratch_doubles(plan, rows, kValuePartials)}, values.options().dtype(at::kDouble));
  Results r = allocate_results(values, b.dtype, {at::kFloat});
  r.row_scale = at::empty({rows}, values.options().dtype(b.dtype));
  cuda::ValueInputs in = value_inputs(b, clip);
  in.rows = rows, in.length = values.size(0);
  cuda::value_loss_varlen_forward(in, cu.const_data_ptr<int64_t>(), agg, partials.mutable_data_ptr<double>(),
                                  r.pointers(), c10::cuda::getCurrentCUDAStream());
  check_launch(op);
  return {r.loss, r.stats[0], r.row_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_varlen_backward_cuda(
    const at::Tensor& grad_loss, const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
    const at::Tensor& mask, const at::Tensor& row_scale, const at::Tensor& cu_seqlens, double clip,
    std::array<bool, 3> output_mask) {
  constexpr const char* op = "value_loss_varlen_backward";
  const ValueBuffers b = value_varlen_buffers(op, values, old_values, returns, mask);
  const at::Tensor upstream = checked_upstream(op, grad_loss, values, b.dtype);
  const at::Tensor cu = device_cu_seqlens(op, cu_seqlens, values);
  const int64_t rows = cu.numel() - 1;
  check_float(op, "row_scale", row_scale);
  check_shape(op, "row_scale", row_scale, {rows});
  check_same_device(op, {{"values", &values}, {"row_scale", &row_scale}});
  check_cuda(op, values);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor scale = row_scale.to(b.dtype).contiguous();
  checked_varlen_plan(op, cu, b.v);
  const bool need_v = output_mask[0], need_old = output_mask[1], need_ret = output_mask[2];
  const Grad grad_v(b.v, values.scalar_type(), need_v), grad_old(b.old, old_values.scalar_type(), need_old);
  const Grad grad_ret(b.ret, returns.scalar_type(), need_ret);
  if (need_v || need_old || need_ret) {
    const cuda::GradOutputs grads{{grad_v.pointer(), grad_old.pointer(), grad_ret.pointer(), nullptr}};
    cuda::ValueInputs in = value_inputs(b, clip);
    in.rows = rows, in.length = values.size(0);
    cuda::value_loss_varlen_backward(in, cu.const_data_ptr<int64_t>(), upstream.const_data_ptr(),
                                     scale.const_data_ptr(), grads, c10::cuda::getCurrentCUDAStream());
    check_launch(op);
  }
  // The buffers are [1, N] rows: the gradients are [N], as the inputs.
  const auto flat = [](const Grad& g) { return g.to_input_dtype().reshape({-1}); };
  return {flat(grad_v), flat(grad_old), flat(grad_ret)};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CUDA, m) {
  m.impl("value_loss", &value_loss_cuda);
  m.impl("value_loss_backward", &value_loss_backward_cuda);
  m.impl("value_loss_varlen", &value_loss_varlen_cuda);
  m.impl("value_loss_varlen_backward", &value_loss_varlen_backward_cuda);
}

}  // namespace ppo_fast
