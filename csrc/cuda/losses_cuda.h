// Launchers of the CUDA loss kernels (csrc/cuda/losses.cu), on raw pointers so that the
// .cu needs no torch headers.  The torch glue is csrc/cuda/losses_cuda.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "loss_math.h"

namespace ppo_fast {
namespace cuda {

// Each input is read in its own dtype and converted to the compute type on load.
enum FloatDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

struct FloatPtr {
  const void* data;  // contiguous; nullptr for an absent optional input
  int dtype;         // FloatDtype
};

struct PolicyInputs {
  FloatPtr logprobs, old_logprobs, advantages, weights;
  const bool* mask;
  int64_t rows, length;
  PolicyParams params;
};

struct ValueInputs {
  FloatPtr values, old_values, returns;
  const bool* mask;
  int64_t rows, length;
  double clip;
};

// Results: loss and row_scale [rows] in the compute dtype (float32, or float64 when an
// input is float64, as the reference computes); scalar stats in their own dtypes.
struct LossOutputs {
  void* loss;
  void* stats[3];  // policy: clipfrac, clipfrac_lower, approx_kl; value: clipfrac
  int stat_dtypes[3];  // FloatDtype of each stat
  void* row_scale;
};

// Gradients of the backward, one per input in the order of the op's schema
// (policy: logprobs, old_logprobs, advantages, weights; value: values, old_values,
// returns); data is nullptr for a gradient nobody asked for, which is not computed.
struct GradOutputs {
  void* data[4];
  int dtypes[4];  // FloatDtype of each
};

// `partials` is scratch of rows * kPolicyPartials (or kValuePartials) doubles.
// grad_loss and row_scale are in the compute dtype.
void policy_loss_forward(const PolicyInputs& in, int64_t agg, bool use_double, double* partials, const LossOutputs& out,
                         cudaStream_t stream);
void policy_loss_backward(const PolicyInputs& in, bool use_double, const void* grad_loss, const void* row_scale,
                          const GradOutputs& grads, cudaStream_t stream);
void value_loss_forward(const ValueInputs& in, int64_t agg, bool use_double, double* partials, const LossOutputs& out,
                        cudaStream_t stream);
void value_loss_backward(const ValueInputs& in, bool use_double, const void* grad_loss, const void* row_scale,
                         const GradOutputs& grads, cudaStream_t stream);

}  // namespace cuda
}  // namespace ppo_fast
