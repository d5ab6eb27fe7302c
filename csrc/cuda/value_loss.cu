// CUDA kernels of value_loss: the token-level machinery of csrc/cuda/token_loss.cuh with
// ValueToken's per-token math.
#include "common/loss_math.h"
#include "cuda/token_loss.cuh"
#include "cuda/value_loss.h"

namespace ppo_fast {
namespace cuda {
namespace {

template <typename D>
struct ValueToken {
  using T = typename D::T;
  static constexpr int kInputs = 3;  // values, old_values, returns
  static constexpr int kParts = kValuePartials;
  static constexpr int kGrads = 3;
  const typename D::Bits* in[kInputs];
  double clip;

  struct Math {
    T clip;
    __device__ void accumulate(const T (&x)[kInputs], bool valid, T (&acc)[kParts]) const {
      const ValueTerm<T> term = value_term(x[0], x[1], x[2], clip);
      acc[kValueLossSum] += valid ? term.loss : T(0);
      acc[kValueCount] += valid ? T(1) : T(0);
      acc[kValueClipped] += valid ? term.is_clipped : T(0);
    }
    __device__ void grads(const T (&x)[kInputs], T upstream, T (&g)[kGrads]) const {
      const ValueGrad<T> grad = value_grad(value_term(x[0], x[1], x[2], clip), x[0], upstream);
      g[0] = grad.v;
      g[1] = grad.old;
      g[2] = grad.ret;
    }
  };
  __device__ Math math() const { return {static_cast<T>(clip)}; }

  static __device__ void store_stats(const double* totals, const LossOutputs& out) {
    *static_cast<float*>(out.stats[0]) = static_cast<float>(safe_mean(totals[kValueClipped], totals[kValueCount]));
  }
  static constexpr int kSumColumn = kValueLossSum, kCountColumn = kValueCount;
};

template <typename D>
ValueToken<D> value_token(const ValueInputs& in) {
  using Bits = typename D::Bits;
  return {{static_cast<const Bits*>(in.values), static_cast<const Bits*>(in.old_values),
           static_cast<const Bits*>(in.returns)},
          in.clip};
}

}  // namespace

void value_loss_forward(const ValueInputs& in, int64_t agg, double* partials, const LossOutputs& out,
                        cudaStream_t stream) {
  token_loss::with_dtype(in.dtype, [&](auto d) {
    using D = decltype(d);
    token_loss::forward<D>(value_token<D>(in), in.mask, in.rows, in.length, agg, partials, out, stream);
  });
}

void value_loss_backward(const ValueInputs& in, const void* grad_loss, const void* row_scale, const GradOutputs& grads,
                         cudaStream_t stream) {
  token_loss::with_dtype(in.dtype, [&](auto d) {
    using D = decltype(d);
    token_loss::backward<D>(value_token<D>(in), in.mask, in.rows, in.length, grad_loss, row_scale, grads, stream);
  });
}

void value_loss_varlen_forward(const ValueInputs& in, const int64_t* cu, int64_t agg, double* partials,
                               const LossOutputs& out, cudaStream_t stream) {
  token_loss::with_dtype(in.dtype, [&](auto d) {
    using D = decltype(d);
    token_loss::forward_varlen<D>(value_token<D>(in), in.mask, cu, in.rows, in.length, agg, partials, out, stream);
  });
}

void value_loss_varlen_backward(const ValueInputs& in, const int64_t* cu, const void* grad_loss, const void* row_scale,
                                const GradOutputs& grads, cudaStream_t stream) {
  token_loss::with_dtype(in.dtype, [&](auto d) {
    using D = decltype(d);
    token_loss::backward_varlen<D>(value_token<D>(in), in.mask, cu, in.rows, in.length, grad_loss, row_scale, grads,
                                   stream);
  });
}

}  // namespace cuda
}  // namespace ppo_fast
