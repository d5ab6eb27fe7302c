// The packed (varlen) layout of the CPU kernels: rows given by cu_seqlens instead of a [B, T] shape.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "common/checks.h"

namespace ppo_fast {

// The rows of a call: row b spans [offset(b), offset(b) + size(b)) of the flat tokens.  The padded
// layout's rows all have `width` tokens; the packed layout's are cu_seqlens' segments, and `width`
// is the longest one (the padded layout's T).
struct Rows {
  const int64_t* cu = nullptr;  // packed: [rows + 1] ends, else null
  int64_t rows = 0, width = 0;
  int64_t offset(int64_t b) const { return cu ? cu[b] : b * width; }
  int64_t size(int64_t b) const { return cu ? cu[b + 1] - cu[b] : width; }
};

// cu_seqlens checked against `tokens` (int32/int64, 1-D, 0 first, non-decreasing, `tokens` last: no
// segment reads past the tensors), as a contiguous int64 tensor; the longest segment in *longest.
inline at::Tensor checked_cu_seqlens(const char* op, const at::Tensor& cu_seqlens, int64_t tokens,
                                     const at::Tensor& like, int64_t* longest) {
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must have dtype int32 or int64, got ", cu_seqlens.scalar_type());
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, op, ": cu_seqlens must be 1-D [S + 1], got shape ",
              cu_seqlens.sizes());
  check_same_device(op, {{"cu_seqlens", &cu_seqlens}, {"inputs", &like}});
  at::Tensor cu = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* ends = cu.const_data_ptr<int64_t>();
  const int64_t segments = cu.numel() - 1;
  TORCH_CHECK(ends[0] == 0, op, ": cu_seqlens must start at 0, got ", ends[0]);
  *longest = 0;
  for (int64_t b = 0; b < segments; ++b) {
    TORCH_CHECK(ends[b + 1] >= ends[b], op, ": cu_seqlens must be non-decreasing, got ", ends[b], " then ",
                ends[b + 1]);
    *longest = std::max(*longest, ends[b + 1] - ends[b]);
  }
  TORCH_CHECK(ends[segments] == tokens, op, ": cu_seqlens must end at the number of packed tokens ", tokens, ", got ",
              ends[segments]);
  return cu;
}

}  // namespace ppo_fast
