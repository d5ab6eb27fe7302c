// Checks of the CUDA glue (csrc/cuda/*.cpp): the device of the inputs and the launch.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

namespace ppo_fast {

inline void check_cuda(const char* op, const at::Tensor& first) {
  TORCH_CHECK(first.is_cuda(), op, ": expects CUDA tensors, got one on ", first.device());
}

// After a launch: a bad configuration surfaces here, not at the next sync.
inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace ppo_fast
