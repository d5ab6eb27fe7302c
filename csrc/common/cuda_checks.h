// Checks of the CUDA glue (csrc/cuda/*.cpp): the device of the inputs and the launch.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include "common/build_info.h"

namespace ppo_fast {

inline void check_cuda(const char* op, const at::Tensor& first) {
  TORCH_CHECK(first.is_cuda(), op, ": expects CUDA tensors, got one on ", first.device());
}

// After a launch: a bad configuration surfaces here, not at the next sync.  A GPU the build has
// no code for (TORCH_CUDA_ARCH_LIST without its architecture) is named, with the way out.
inline void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaErrorNoKernelImageForDevice) {
    int device = 0, major = 0, minor = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    TORCH_CHECK(false, op, ": ppo_fast._C has no code for this GPU (cuda:", device, ", compute capability ", major, ".",
                minor, "): it was built for ", PPO_FAST_CUDA_ARCHS_STRING,
                " (TORCH_CUDA_ARCH_LIST); rebuild it with TORCH_CUDA_ARCH_LIST=", major, ".", minor,
                " pip install --no-build-isolation -e . (or on a machine that sees this GPU)");
  }
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace ppo_fast
