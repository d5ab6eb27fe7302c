// The launch interface shared by the CUDA token-level losses (csrc/cuda/policy_loss.cu,
// csrc/cuda/value_loss.cu), on raw pointers so that the .cu files need no torch headers:
// the dtype codes, the output and gradient pointers, and how the tokens are cut into warps.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ppo_fast {
namespace cuda {

// The dtype of every input of one launch (the glue converts inputs of mixed dtypes to
// the compute dtype first); the kernels are instantiated per dtype.
enum FloatDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Results: loss and row_scale [rows] in the compute dtype (float32, or float64 for
// float64 inputs, as the reference computes); the stats as the reference returns them
// (policy: clipfrac and clipfrac_lower float32, approx_kl the compute dtype; value:
// clipfrac float32).
struct LossOutputs {
  void* loss;
  void* stats[3];  // policy: clipfrac, clipfrac_lower, approx_kl; value: clipfrac
  void* row_scale;
};

// Gradients of the backward in the inputs' dtype, one per input in the order of the op's
// schema (policy: logprobs, old_logprobs, advantages, weights; value: values, old_values,
// returns); nullptr for a gradient nobody asked for, which is not computed.
struct GradOutputs {
  void* data[4];
};

constexpr int kWarp = 32;
constexpr int64_t kTargetItems = 4096;  // ~31 warps per H200 SM: enough loads in flight, few partials

// How the tokens are cut into warp work items: `chunk` tokens of one row each
// (chunks_per_row per row, items in all; the glue refuses items >= 2^31).  In the packed layout
// (`cu`: cu_seqlens as int64 on the device) the rows are its segments, whose lengths only the
// device knows: each row is cut into chunks_per_row pieces of whole warp steps (`chunk` is one
// step), the piece length computed on the device from the row's length.
struct ChunkPlan {
  int64_t chunk, chunks_per_row, items;
  const int64_t* cu = nullptr;
};

// The forward's scratch, in doubles: each item's partial sums, then each row's sums (the finalize's
// first step), then one word that counts the finalize's finished blocks (the partials kernel zeroes it).
inline int64_t forward_scratch_doubles(const ChunkPlan& plan, int64_t rows, int64_t parts) {
  return (plan.items + rows) * parts + 1;
}

// The chunk length is chosen so that about kTargetItems items cover the batch: a short
// row is one item, a long one several.
inline ChunkPlan chunk_plan(int64_t rows, int64_t length, int64_t element_size) {
  const int64_t step = kWarp * (16 / element_size);  // tokens of one warp step (kTokens)
  const int64_t total = rows * length;
  if (total == 0) return {step, 0, 0};
  const int64_t row_steps = (length + step - 1) / step;
  const int64_t wanted_steps = (total + kTargetItems * step - 1) / (kTargetItems * step);
  const int64_t chunk = std::min(wanted_steps, row_steps) * step;
  const int64_t chunks_per_row = (length + chunk - 1) / chunk;
  return {chunk, chunks_per_row, rows * chunks_per_row};
}

// The packed layout's plan, from the rows' and tokens' counts alone (no host read of cu_seqlens):
// about kTargetItems items, at least kMinPieces per row so that a long row in a long tail is not
// one warp's work, and no more pieces than the tokens have warp steps.
constexpr int64_t kMinPieces = 8;
inline ChunkPlan varlen_chunk_plan(const int64_t* cu, int64_t rows, int64_t tokens, int64_t element_size) {
  const int64_t step = kWarp * (16 / element_size);
  if (rows == 0) return {step, 0, 0, cu};
  const int64_t steps = std::max<int64_t>(1, (tokens + step - 1) / step);
  const int64_t wanted = std::max(kMinPieces, (kTargetItems + rows - 1) / rows);
  const int64_t pieces = std::min(wanted, steps);
  return {step, pieces, rows * pieces, cu};
}

}  // namespace cuda
}  // namespace ppo_fast
