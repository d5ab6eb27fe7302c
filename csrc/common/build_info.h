// What setup.py compiled in: TORCH_CUDA_ARCH_LIST as one token (setup.py's arch_token,
// "80_90_100_PTX"), as a string; "" in a build without CUDA kernels.
#pragma once

#define PPO_FAST_STRINGIFY2(x) #x
#define PPO_FAST_STRINGIFY(x) PPO_FAST_STRINGIFY2(x)

#ifdef PPO_FAST_CUDA_ARCHS
#define PPO_FAST_CUDA_ARCHS_STRING PPO_FAST_STRINGIFY(PPO_FAST_CUDA_ARCHS)
#else
#define PPO_FAST_CUDA_ARCHS_STRING ""
#endif
