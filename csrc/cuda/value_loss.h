// Launchers of the CUDA value-loss kernels (csrc/cuda/value_loss.cu), on raw pointers so
// that the .cu needs no torch headers; the torch glue is csrc/cuda/value_loss.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/token_loss.h"

namespace ppo_fast {
namespace cuda {

// Inputs: contiguous, all of `dtype`.
struct ValueInputs {
  const void *values, *old_values, *returns;
  const bool* mask;
  int64_t rows, length;
  int dtype;  // FloatDtype
  double clip;
};

// grad_loss (one element) and row_scale are in the compute dtype, on the device.
void value_loss_forward(const ValueInputs& in, int64_t agg, double* partials, const LossOutputs& out,
                        cudaStream_t stream);
void value_loss_backward(const ValueInputs& in, const void* grad_loss, const void* row_scale, const GradOutputs& grads,
                         cudaStream_t stream);

// The packed layout: in.rows segments of in.length tokens ([N] inputs), given by cu (cu_seqlens as
// int64, on the device); row_scale [rows].
void value_loss_varlen_forward(const ValueInputs& in, const int64_t* cu, int64_t agg, double* partials,
                               const LossOutputs& out, cudaStream_t stream);
void value_loss_varlen_backward(const ValueInputs& in, const int64_t* cu, const void* grad_loss, const void* row_scale,
                                const GradOutputs& grads, cudaStream_t stream);

}  // namespace cuda
}  // namespace ppo_fast
