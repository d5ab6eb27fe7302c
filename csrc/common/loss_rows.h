// The row machinery of the CPU token-level losses (csrc/policy_loss.cpp, csrc/value_loss.cpp):
// chunks of a row's tokens in parallel rows, lane sums that vectorize, and the fixed-order
// reduction over the rows' partial sums, so that a result does not depend on the thread count.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "common/checks.h"
#include "common/fast_exp.h"
#include "common/float_io.h"
#include "common/loss_math.h"
#include "common/varlen.h"

namespace ppo_fast {

constexpr int64_t kLossChunk = 256;  // tokens converted to the compute type at a time

inline double column_total(const double* partials, int64_t rows, int64_t width, int64_t column) {
  double total = 0.0;
  for (int64_t b = 0; b < rows; ++b) total += partials[b * width + column];
  return total;
}

// The aggregated loss sum_b row_scale_b * row_sum_b; writes row_scale.
template <typename acc_t>
double aggregate_rows(const double* partials, int64_t rows, int64_t width, int64_t sum_column, int64_t count_column,
                      int64_t agg, int64_t length, acc_t* row_scale_out) {
  double total_count = 0.0, nonempty_rows = 0.0;
  for (int64_t b = 0; b < rows; ++b) {
    const double count = partials[b * width + count_column];
    total_count += count;
    nonempty_rows += count > 0.0 ? 1.0 : 0.0;
  }
  double loss = 0.0;
  for (int64_t b = 0; b < rows; ++b) {
    const double scale = row_scale(agg, partials[b * width + count_column], total_count, nonempty_rows, length);
    row_scale_out[b] = static_cast<acc_t>(scale);
    loss += scale * partials[b * width + sum_column];
  }
  return loss;
}

inline at::Tensor scalar(double value, const at::Tensor& like, at::ScalarType dtype) {
  return scalar_result(value, like.options(), dtype);
}

// The sum of x[0, n) in kLanes independent partial sums (x[i] adds to lane i % kLanes),
// so that it vectorizes: GCC does not reorder float adds, and left the `omp simd
// reduction` form of these sums scalar in the baseline clone.  The lanes are added in a
// fixed order, so a row's sums do not depend on the thread count.
constexpr int64_t kLanes = 8;

template <typename acc_t>
PPO_INLINE double lane_sum(const acc_t* x, int64_t n) {
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t lane = 0; lane < kLanes; ++lane) lanes[lane] += x[i + lane];
  for (int64_t lane = 0; i < n; ++i, ++lane) lanes[lane] += x[i];
  double total = 0.0;
  for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
  return total;
}

// Calls body(b, t0, n) for every chunk of n <= kLossChunk tokens of every row b, rows in parallel.
template <typename Body>
void for_each_row_chunk(int64_t rows, int64_t length, const Body& body) {
  at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t0 = 0; t0 < length; t0 += kLossChunk) body(b, t0, std::min(kLossChunk, length - t0));
  });
}

// The same over `layout`'s rows (the padded rows, or cu_seqlens' segments): body(b, t0, n) with the
// chunk starting at token layout.offset(b) + t0 of the flat inputs.
template <typename Body>
void for_each_row_chunk(const Rows& layout, const Body& body) {
  at::parallel_for(0, layout.rows, row_grain(layout.width), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t0 = 0; t0 < layout.size(b); t0 += kLossChunk)
        body(b, t0, std::min(kLossChunk, layout.size(b) - t0));
  });
}

// grad_loss as a double, read on the host: a CPU tensor, so no device sync.
inline double checked_upstream(const char* op, const at::Tensor& grad_loss, const at::Tensor& like) {
  check_grad_loss(op, grad_loss);
  check_same_device(op, {{"grad_loss", &grad_loss}, {"inputs", &like}});
  if (grad_loss.is_neg()) return grad_loss.item<double>();  // a lazily negated view: its data is not its value
  double value = 0;  // read in place: .item() is two dispatched ops, a tenth of a small backward's host time
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_loss.scalar_type(), "checked_upstream",
                                  [&] { value = static_cast<double>(*grad_loss.const_data_ptr<scalar_t>()); });
  return value;
}

}  // namespace ppo_fast
