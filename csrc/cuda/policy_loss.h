// Launchers of the CUDA policy-loss kernels (csrc/cuda/policy_loss.cu), on raw pointers so
// that the .cu needs no torch headers; the torch glue is csrc/cuda/policy_loss.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/loss_math.h"
#include "common/seq_loss_math.h"
#include "cuda/token_loss.h"

namespace ppo_fast {
namespace cuda {

// clipped_policy_loss.  Inputs: contiguous, all of `dtype`.
struct PolicyInputs {
  const void *logprobs, *old_logprobs, *advantages;
  const void* weights;  // nullptr when absent
  const bool* mask;
  int64_t rows, length;
  int dtype;  // FloatDtype
  PolicyParams params;
};

// grad_loss (one element) and row_scale are in the compute dtype, on the device.
void policy_loss_forward(const PolicyInputs& in, int64_t agg, double* partials, const LossOutputs& out,
                         cudaStream_t stream);
void policy_loss_backward(const PolicyInputs& in, const void* grad_loss, const void* row_scale,
                          const GradOutputs& grads, cudaStream_t stream);

// The sequence-level modes.  Inputs contiguous in the compute type T (float or double);
// weights may be nullptr.  The packed layout (cu: cu_seqlens as int64 on the device): the rows are
// its segments of the `length` [N] tokens.
template <typename T>
struct SeqInputs {
  const T *logprobs, *old_logprobs, *advantages, *weights;
  const bool* mask;
  int64_t rows, length;
  double eps_low, eps_high;
  const int64_t* cu = nullptr;
};

// Outputs: loss, approx_kl, row_scale [rows] and row_state [rows, kRowState] in T; the clip
// fractions in float32.  `partials` is scratch of rows * kPolicyPartials doubles.
template <typename T>
struct SeqOutputs {
  T *loss, *approx_kl, *row_scale, *row_state;
  float *clipfrac, *clipfrac_lower;
  double* partials;
};

// Gradients in T, nullptr where not wanted.  grad_loss is one element on the device.
template <typename T>
struct SeqGrads {
  T *logprobs, *advantages, *weights;
};

template <typename T>
void seq_loss_forward(PolicyMode mode, const SeqInputs<T>& in, int64_t agg, const SeqOutputs<T>& out,
                      cudaStream_t stream);
template <typename T>
void seq_loss_backward(PolicyMode mode, const SeqInputs<T>& in, const T* grad_loss, const T* row_scale,
                       const T* row_state, const SeqGrads<T>& grads, cudaStream_t stream);

}  // namespace cuda
}  // namespace ppo_fast
