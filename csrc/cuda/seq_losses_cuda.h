// Launchers of the CUDA sequence-level policy losses (csrc/cuda/seq_losses.cu), on raw
// pointers so that the .cu needs no torch headers.  The torch glue is seq_losses_cuda.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ppo_fast {
namespace cuda {

enum class SeqLoss : int { kGspo = 0, kGeoMean = 1 };

// Inputs contiguous in the compute type T (float or double); weights may be nullptr.
template <typename T>
struct SeqInputs {
  const T *logprobs, *old_logprobs, *advantages, *weights;
  const bool* mask;
  int64_t rows, length;
  double eps_low, eps_high;
};

// Outputs: loss, approx_kl, row_scale [rows] and row_state [rows, 2] in T; the clip
// fractions in float32.  `partials` is scratch of rows * 5 doubles.
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
void seq_loss_forward(SeqLoss mode, const SeqInputs<T>& in, int64_t agg, const SeqOutputs<T>& out, cudaStream_t stream);
template <typename T>
void seq_loss_backward(SeqLoss mode, const SeqInputs<T>& in, const T* grad_loss, const T* row_scale, const T* row_state,
                       const SeqGrads<T>& grads, cudaStream_t stream);

}  // namespace cuda
}  // namespace ppo_fast
