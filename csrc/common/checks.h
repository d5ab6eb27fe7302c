// Argument checks shared by every op (CPU and CUDA glue): the ops are public
// (torch.ops.ppo_fast.*, also reached from C++ and under torch.compile, where the Python
// validation of ppo_fast.ops does not run), so each checks ranks, shapes, dtypes and
// devices itself before touching data.  A failed check raises RuntimeError naming the op
// and the argument.  Metadata only: no check reads tensor values (no host sync).
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <optional>
#include <utility>

namespace ppo_fast {

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// A floating tensor (float32, float64, float16 or bfloat16).
inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name, " must be float32, float64, float16 or bfloat16, got ",
              t.scalar_type());
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
}

inline void check_same_shape(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                             const at::Tensor& ref) {
  TORCH_CHECK(t.sizes() == ref.sizes(), op, ": ", name, " must have the shape of ", ref_name, " ", ref.sizes(),
              ", got ", t.sizes());
}

inline void check_shape(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

// A bool mask of ref's shape.
inline void check_mask(const char* op, const at::Tensor& mask, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be a bool tensor, got ", mask.scalar_type());
  check_same_shape(op, "mask", mask, ref_name, ref);
}

// Every tensor on the device of the first one.
inline void check_same_device(const char* op,
                              std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  const auto& [first_name, first] = *tensors.begin();
  for (const auto& [name, t] : tensors)
    TORCH_CHECK(t->device() == first->device(), op, ": ", name, " is on ", t->device(), " but ", first_name, " is on ",
                first->device(), "; all inputs must be on one device");
}

// The upstream gradient of a scalar loss: one floating element.
inline void check_grad_loss(const char* op, const at::Tensor& grad_loss) {
  check_float(op, "grad_loss", grad_loss);
  TORCH_CHECK(grad_loss.numel() == 1, op, ": grad_loss must have one element, got shape ", grad_loss.sizes());
}

// The policy loss's [B, T] inputs (forward and backward, CPU and CUDA).
inline void check_policy_inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                                const at::Tensor& advantages, const at::Tensor& mask,
                                const std::optional<at::Tensor>& weights) {
  check_float(op, "logprobs", logprobs);
  check_dim(op, "logprobs", logprobs, 2);
  check_float(op, "old_logprobs", old_logprobs);
  check_same_shape(op, "old_logprobs", old_logprobs, "logprobs", logprobs);
  check_float(op, "advantages", advantages);
  check_same_shape(op, "advantages", advantages, "logprobs", logprobs);
  check_mask(op, mask, "logprobs", logprobs);
  check_same_device(
      op, {{"logprobs", &logprobs}, {"old_logprobs", &old_logprobs}, {"advantages", &advantages}, {"mask", &mask}});
  if (weights.has_value()) {
    check_float(op, "weights", *weights);
    check_same_shape(op, "weights", *weights, "logprobs", logprobs);
    check_same_device(op, {{"logprobs", &logprobs}, {"weights", &*weights}});
  }
}

// The value loss's [B, T] inputs (forward and backward, CPU and CUDA).
inline void check_value_inputs(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                               const at::Tensor& returns, const at::Tensor& mask) {
  check_float(op, "values", values);
  check_dim(op, "values", values, 2);
  check_float(op, "old_values", old_values);
  check_same_shape(op, "old_values", old_values, "values", values);
  check_float(op, "returns", returns);
  check_same_shape(op, "returns", returns, "values", values);
  check_mask(op, mask, "values", values);
  check_same_device(op, {{"values", &values}, {"old_values", &old_values}, {"returns", &returns}, {"mask", &mask}});
}

// row_scale [B] as a loss forward returned it, on like's device, in the compute dtype.
inline at::Tensor checked_row_scale(const char* op, const at::Tensor& row_scale, const at::Tensor& like,
                                    at::ScalarType dtype) {
  check_float(op, "row_scale", row_scale);
  check_shape(op, "row_scale", row_scale, {like.size(0)});
  check_same_device(op, {{"row_scale", &row_scale}, {"inputs", &like}});
  if (row_scale.scalar_type() == dtype && row_scale.is_contiguous()) return row_scale;  // as the forward made it
  return row_scale.to(dtype).contiguous();
}

}  // namespace ppo_fast
