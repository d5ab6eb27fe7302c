// The torch side of the CUDA token-level losses, shared by csrc/cuda/policy_loss.cpp and
// csrc/cuda/value_loss.cpp: dtype codes, one dtype per launch, the work-item limit, the
// device-side upstream gradient and the result and gradient tensors.  Nothing here reads
// tensor values on the host (no device sync).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>
#include <limits>

#include "common/checks.h"
#include "cuda/token_loss.h"

namespace ppo_fast {

inline int dtype_code(at::ScalarType t) {
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
inline at::ScalarType kernel_dtype(std::initializer_list<at::Tensor*> inputs, at::ScalarType compute) {
  const at::ScalarType first = (*inputs.begin())->scalar_type();
  bool uniform = true;
  for (const at::Tensor* t : inputs) uniform = uniform && (!t->defined() || t->scalar_type() == first);
  if (uniform) return first;
  for (at::Tensor* t : inputs)
    if (t->defined()) *t = t->to(compute);
  return compute;
}

// The kernels' work items (warps) for these inputs; their count must fit the grid's int32 math.
inline cuda::ChunkPlan checked_plan(const char* op, const at::Tensor& like) {
  const cuda::ChunkPlan plan = cuda::chunk_plan(like.size(0), like.size(1), like.element_size());
  TORCH_CHECK(plan.items <= std::numeric_limits<int32_t>::max(), op, ": too many rows for the CUDA kernels, got ",
              like.size(0));
  return plan;
}

// cu_seqlens as the packed kernels read it: int64, contiguous, on the inputs' device.  Its values are
// not read on the host (no sync): the kernels clamp every segment to the tokens (nothing outside the
// inputs is read), and the public layer checks them on the device (torch._assert_async).
inline at::Tensor device_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, const at::Tensor& like) {
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must have dtype int32 or int64, got ", cu_seqlens.scalar_type());
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op, ": cu_seqlens must be 1-D [S + 1], got shape ",
              cu_seqlens.sizes());
  check_same_device(op, {{"cu_seqlens", &cu_seqlens}, {"inputs", &like}});
  return cu_seqlens.to(at::kLong).contiguous();
}

// The packed layout's work items for `tokens` [N] inputs in cu's segments.
inline cuda::ChunkPlan checked_varlen_plan(const char* op, const at::Tensor& cu, const at::Tensor& tokens) {
  const cuda::ChunkPlan plan =
      cuda::varlen_chunk_plan(cu.const_data_ptr<int64_t>(), cu.numel() - 1, tokens.numel(), tokens.element_size());
  TORCH_CHECK(plan.items <= std::numeric_limits<int32_t>::max(), op, ": too many sequences for the CUDA kernels, got ",
              cu.numel() - 1);
  return plan;
}

// grad_loss (one element, on the inputs' device) in the compute dtype: read by the kernel.
inline at::Tensor checked_upstream(const char* op, const at::Tensor& grad_loss, const at::Tensor& like,
                                   at::ScalarType dtype) {
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
      : data(wanted
                 ? at::empty(kernel_input.sizes(), kernel_input.options().memory_format(at::MemoryFormat::Contiguous))
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
inline Results allocate_results(const at::Tensor& like, at::ScalarType dtype,
                                std::initializer_list<at::ScalarType> stat_dtypes) {
  Results r;
  r.loss = at::empty({}, like.options().dtype(dtype));
  int s = 0;
  for (at::ScalarType stat_dtype : stat_dtypes) r.stats[s++] = at::empty({}, like.options().dtype(stat_dtype));
  r.row_scale = at::empty({like.size(0)}, like.options().dtype(dtype));
  return r;
}

}  // namespace ppo_fast
