// CUDA kernels of the PPO losses.  Forward: one block per row sums the row's tokens
// (per-thread partials, then a fixed shared-memory tree), then a single block reduces the
// row partials in a fixed order: no atomics, so the same inputs give bitwise the same
// loss.  Backward: one elementwise pass using the per-row scale saved by the forward,
// writing the gradient of each input that asked for one.  Masked tokens are never read.
// T is the compute type: float, or double when an input is float64.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/losses_cuda.h"

namespace ppo_fast {
namespace cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kFinalizeThreads = 512;
constexpr int kElementwiseThreads = 256;

template <typename T>
__device__ __forceinline__ T load(FloatPtr p, int64_t i) {
  switch (p.dtype) {
    case kFloat16:
      return static_cast<T>(__half2float(static_cast<const __half*>(p.data)[i]));
    case kBFloat16:
      return static_cast<T>(__bfloat162float(static_cast<const __nv_bfloat16*>(p.data)[i]));
    case kFloat64:
      return static_cast<T>(static_cast<const double*>(p.data)[i]);
    default:
      return static_cast<T>(static_cast<const float*>(p.data)[i]);
  }
}

template <typename T>
__device__ __forceinline__ void store(void* data, int dtype, int64_t i, T value) {
  switch (dtype) {
    case kFloat16:
      static_cast<__half*>(data)[i] = __float2half_rn(static_cast<float>(value));
      break;
    case kBFloat16:
      static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(static_cast<float>(value));
      break;
    case kFloat64:
      static_cast<double*>(data)[i] = static_cast<double>(value);
      break;
    default:
      static_cast<float*>(data)[i] = static_cast<float>(value);
  }
}

// Sums values[k] over the block's threads; every thread gets the totals.  Fixed order.
template <int kParts, int kThreads>
__device__ void block_sum(double (&values)[kParts]) {
  __shared__ double shared[kParts][kThreads];
  for (int k = 0; k < kParts; ++k) shared[k][threadIdx.x] = values[k];
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half)
      for (int k = 0; k < kParts; ++k) shared[k][threadIdx.x] += shared[k][threadIdx.x + half];
    __syncthreads();
  }
  for (int k = 0; k < kParts; ++k) values[k] = shared[k][0];
  __syncthreads();  // shared may be reused by the next call
}

// A token's terms (accumulate) and gradients (grads, given the upstream gradient
// grad_loss * row_scale of its row); only valid tokens are read.
template <typename T>
struct PolicyToken {
  PolicyInputs in;
  static constexpr int kParts = kPolicyPartials;
  static constexpr int kGrads = 4;  // logprobs, old_logprobs, advantages, weights
  __device__ void accumulate(int64_t i, T (&acc)[kParts]) const {
    const T logp = load<T>(in.logprobs, i), old = load<T>(in.old_logprobs, i);
    const PolicyTerm<T> term = policy_term(logp, old, load<T>(in.advantages, i), policy_bounds<T>(in.params));
    acc[kPgSum] += in.weights.data ? term.pg * load<T>(in.weights, i) : term.pg;
    acc[kCount] += T(1);
    acc[kClipped] += term.is_clipped;
    acc[kCapped] += term.is_capped;
    acc[kKlSum] += old - logp;
  }
  __device__ void grads(int64_t i, T upstream, T (&g)[kGrads]) const {
    const PolicyBounds<T> bounds = policy_bounds<T>(in.params);
    const PolicyTerm<T> term =
        policy_term(load<T>(in.logprobs, i), load<T>(in.old_logprobs, i), load<T>(in.advantages, i), bounds);
    const T w = in.weights.data ? load<T>(in.weights, i) : T(1);
    const PolicyGrad<T> grad = policy_grad(term, bounds, upstream * w);
    g[0] = grad.logp;
    g[1] = -grad.logp;
    g[2] = grad.adv;
    g[3] = upstream * term.pg;
  }
};

template <typename T>
struct ValueToken {
  ValueInputs in;
  static constexpr int kParts = kValuePartials;
  static constexpr int kGrads = 3;  // values, old_values, returns
  __device__ void accumulate(int64_t i, T (&acc)[kParts]) const {
    const ValueTerm<T> term =
        value_term(load<T>(in.values, i), load<T>(in.old_values, i), load<T>(in.returns, i), static_cast<T>(in.clip));
    acc[kValueLossSum] += term.loss;
    acc[kValueCount] += T(1);
    acc[kValueClipped] += term.is_clipped;
  }
  __device__ void grads(int64_t i, T upstream, T (&g)[kGrads]) const {
    const T v = load<T>(in.values, i);
    const ValueGrad<T> grad =
        value_grad(value_term(v, load<T>(in.old_values, i), load<T>(in.returns, i), static_cast<T>(in.clip)), v, upstream);
    g[0] = grad.v;
    g[1] = grad.old;
    g[2] = grad.ret;
  }
};

// partials[row, :] = sums over the row's valid tokens.
template <typename T, typename Token>
__global__ void row_partials_kernel(Token token, const bool* mask, int64_t length, double* partials) {
  const int64_t row = blockIdx.x;
  T acc[Token::kParts] = {};
  for (int64_t t = threadIdx.x; t < length; t += kRowThreads) {
    const int64_t i = row * length + t;
    if (mask[i]) token.accumulate(i, acc);
  }
  double sums[Token::kParts];
  for (int k = 0; k < Token::kParts; ++k) sums[k] = acc[k];
  block_sum<Token::kParts, kRowThreads>(sums);
  if (threadIdx.x == 0)
    for (int k = 0; k < Token::kParts; ++k) partials[row * Token::kParts + k] = sums[k];
}

struct FinalizeArgs {
  int64_t rows, length, agg;
  int sum_column, count_column;
  int n_stats;
  int stat_columns[3];  // stats[s] = total of stat_columns[s] / valid tokens
  LossOutputs out;
};

// One block: totals over the rows, then loss = sum_b row_scale_b * row_sum_b.
template <typename T, int kParts>
__global__ void finalize_kernel(const double* partials, FinalizeArgs args) {
  double totals[kParts] = {};
  double nonempty[1] = {0.0};
  for (int64_t b = threadIdx.x; b < args.rows; b += kFinalizeThreads) {
    for (int k = 0; k < kParts; ++k) totals[k] += partials[b * kParts + k];
    nonempty[0] += partials[b * kParts + args.count_column] > 0.0 ? 1.0 : 0.0;
  }
  block_sum<kParts, kFinalizeThreads>(totals);
  block_sum<1, kFinalizeThreads>(nonempty);
  const double total_count = totals[args.count_column];
  T* row_scale_out = static_cast<T*>(args.out.row_scale);
  double loss[1] = {0.0};
  for (int64_t b = threadIdx.x; b < args.rows; b += kFinalizeThreads) {
    const double scale = row_scale(args.agg, partials[b * kParts + args.count_column], total_count, nonempty[0], args.length);
    row_scale_out[b] = static_cast<T>(scale);
    loss[0] += scale * partials[b * kParts + args.sum_column];
  }
  block_sum<1, kFinalizeThreads>(loss);
  if (threadIdx.x == 0) {
    *static_cast<T*>(args.out.loss) = static_cast<T>(loss[0]);
    for (int s = 0; s < args.n_stats; ++s)
      store(args.out.stats[s], args.out.stat_dtypes[s], 0, safe_mean(totals[args.stat_columns[s]], total_count));
  }
}

// Every requested gradient of every token; 0 at masked tokens (whose inputs are not read).
template <typename T, typename Token>
__global__ void backward_kernel(Token token, const bool* mask, int64_t rows, int64_t length, const T* grad_loss,
                                const T* row_scale, GradOutputs out) {
  const T upstream = *grad_loss;
  const int64_t total = rows * length;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    T g[Token::kGrads];
    if (mask[i]) {
      token.grads(i, upstream * row_scale[i / length], g);
    } else {
      for (int k = 0; k < Token::kGrads; ++k) g[k] = T(0);
    }
    for (int k = 0; k < Token::kGrads; ++k)
      if (out.data[k]) store(out.data[k], out.dtypes[k], i, g[k]);
  }
}

template <typename T, typename Token>
void forward(const Token& token, const bool* mask, int64_t rows, const FinalizeArgs& args, double* partials,
             cudaStream_t stream) {
  if (rows > 0)
    row_partials_kernel<T><<<static_cast<unsigned>(rows), kRowThreads, 0, stream>>>(token, mask, args.length, partials);
  finalize_kernel<T, Token::kParts><<<1, kFinalizeThreads, 0, stream>>>(partials, args);
}

template <typename T, typename Token>
void backward(const Token& token, const bool* mask, int64_t rows, int64_t length, const void* grad_loss,
              const void* row_scale, const GradOutputs& grads, cudaStream_t stream) {
  const int64_t total = rows * length;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kElementwiseThreads - 1) / kElementwiseThreads, 65535);
  backward_kernel<T><<<static_cast<unsigned>(blocks), kElementwiseThreads, 0, stream>>>(
      token, mask, rows, length, static_cast<const T*>(grad_loss), static_cast<const T*>(row_scale), grads);
}

}  // namespace

void policy_loss_forward(const PolicyInputs& in, int64_t agg, bool use_double, double* partials, const LossOutputs& out,
                         cudaStream_t stream) {
  const FinalizeArgs args{in.rows, in.length, agg, kPgSum, kCount, 3, {kClipped, kCapped, kKlSum}, out};
  if (use_double)
    forward<double>(PolicyToken<double>{in}, in.mask, in.rows, args, partials, stream);
  else
    forward<float>(PolicyToken<float>{in}, in.mask, in.rows, args, partials, stream);
}

void policy_loss_backward(const PolicyInputs& in, bool use_double, const void* grad_loss, const void* row_scale,
                          const GradOutputs& grads, cudaStream_t stream) {
  if (use_double)
    backward<double>(PolicyToken<double>{in}, in.mask, in.rows, in.length, grad_loss, row_scale, grads, stream);
  else
    backward<float>(PolicyToken<float>{in}, in.mask, in.rows, in.length, grad_loss, row_scale, grads, stream);
}

void value_loss_forward(const ValueInputs& in, int64_t agg, bool use_double, double* partials, const LossOutputs& out,
                        cudaStream_t stream) {
  const FinalizeArgs args{in.rows, in.length, agg, kValueLossSum, kValueCount, 1, {kValueClipped, 0, 0}, out};
  if (use_double)
    forward<double>(ValueToken<double>{in}, in.mask, in.rows, args, partials, stream);
  else
    forward<float>(ValueToken<float>{in}, in.mask, in.rows, args, partials, stream);
}

void value_loss_backward(const ValueInputs& in, bool use_double, const void* grad_loss, const void* row_scale,
                         const GradOutputs& grads, cudaStream_t stream) {
  if (use_double)
    backward<double>(ValueToken<double>{in}, in.mask, in.rows, in.length, grad_loss, row_scale, grads, stream);
  else
    backward<float>(ValueToken<float>{in}, in.mask, in.rows, in.length, grad_loss, row_scale, grads, stream);
}

}  // namespace cuda
}  // namespace ppo_fast
