// Launchers of the CUDA loss kernels (csrc/cuda/losses.cu), on raw pointers so that the
// .cu needs no torch headers.  The torch glue is csrc/cuda/losses_cuda.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "loss_math.h"

namespace ppo_fast {
namespace cuda {

// The dtype of every input of one launch (the glue converts inputs of mixed dtypes to
// the compute dtype first); the kernels are instantiated per dtype.
enum FloatDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// Inputs: contiguous, all of `dtype`.
struct PolicyInputs {
  const void *logprobs, *old_logprobs, *advantages;
  const void* weights;  // nullptr when absent
  const bool* mask;
  int64_t rows, length;
  int dtype;  // FloatDtype
  PolicyParams params;
};

struct ValueInputs {
  const void *values, *old_values, *returns;
  const bool* mask;
  int64_t rows, length;
  int dtype;  // FloatDtype
  double clip;
};

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

// How the tokens are cut into warp work items: `chunk` tokens of one row each
// (chunks_per_row per row, items in all; the glue refuses items >= 2^31).  The forward's
// scratch `partials` holds items * kPolicyPartials (or kValuePartials) doubles.
struct ChunkPlan {
  int64_t chunk, chunks_per_row, items;
};
ChunkPlan chunk_plan(int64_t rows, int64_t length, int64_t element_size);

// grad_loss (one element) and row_scale are in the compute dtype, on the device.
void policy_loss_forward(const PolicyInputs& in, int64_t agg, double* partials, const LossOutputs& out,
                         cudaStream_t stream);
void policy_loss_backward(const PolicyInputs& in, const void* grad_loss, const void* row_scale, const GradOutputs& grads,
                          cudaStream_t stream);
void value_loss_forward(const ValueInputs& in, int64_t agg, double* partials, const LossOutputs& out, cudaStream_t stream);
void value_loss_backward(const ValueInputs& in, const void* grad_loss, const void* row_scale, const GradOutputs& grads,
                         cudaStream_t stream);

}  // namespace cuda
}  // namespace ppo_fast
