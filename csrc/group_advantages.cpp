// group_sum: its schema and CPU kernel, the reduction behind the group advantage estimators
// (ppo_fast.advantage_estimators): out[i, c] = sum over rows j of i's group of values[j, c].
// Group slots are summed in row order, in the compute dtype, as the reference's index_add
// on CPU does, so the result is deterministic (and equal to the reference's bit for bit).
// The op is linear and symmetric, so its backward is itself (registered in Python).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "common/checks.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // Group advantages' reduction: values [B, C] float32/float64, group_index [B] int64 in
  // [0, B); row i of the result is the sum of the rows of i's group.  Its own backward.
  m.def("group_sum(Tensor values, Tensor group_index) -> Tensor");
}

namespace {

template <typename scalar_t>
void group_sum_rows(const at::Tensor& values, const at::Tensor& group_index, at::Tensor& out) {
  const int64_t rows = values.size(0), cols = values.size(1);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), is0 = group_index.stride(0);
  const scalar_t* v = values.data_ptr<scalar_t>();
  const int64_t* g = group_index.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  std::vector<scalar_t> totals(static_cast<size_t>(rows * cols), scalar_t(0));  // slot g of group g
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = g[i * is0];
    TORCH_CHECK(slot >= 0 && slot < rows, "group_sum: group_index must lie in [0, ", rows, "), got ", slot, " at row ",
                i);
    for (int64_t c = 0; c < cols; ++c) totals[slot * cols + c] += v[i * vs0 + c * vs1];
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = g[i * is0];
    for (int64_t c = 0; c < cols; ++c) o[i * cols + c] = totals[slot * cols + c];
  }
}

at::Tensor group_sum_cpu(const at::Tensor& values, const at::Tensor& group_index) {
  constexpr const char* op = "group_sum";
  TORCH_CHECK(values.scalar_type() == at::kFloat || values.scalar_type() == at::kDouble, op,
              ": values must be float32 or float64 (the compute dtype), got ", values.scalar_type());
  check_dim(op, "values", values, 2);
  TORCH_CHECK(group_index.scalar_type() == at::kLong, op, ": group_index must be int64, got ",
              group_index.scalar_type());
  check_shape(op, "group_index", group_index, {values.size(0)});
  check_same_device(op, {{"values", &values}, {"group_index", &group_index}});
  auto out = at::empty(values.sizes(), values.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), op, [&] { group_sum_rows<scalar_t>(values, group_index, out); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) { m.impl("group_sum", &group_sum_cpu); }

}  // namespace ppo_fast
