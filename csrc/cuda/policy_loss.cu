// CUDA kernels of the policy losses.  clipped_policy_loss: the token-level machinery of
// csrc/cuda/token_loss.cuh with PolicyToken's per-token math.  The sequence-level modes
// (GSPO, GMPO), following csrc/policy_loss.cpp: one block per row reduces the row's sums in
// a fixed order (each thread a fixed stride, then a fixed tree), one block reduces over the
// rows, so results are deterministic; the backward is elementwise.  No host sync: grad_loss
// stays on the device.  The packed layout (SeqInputs::cu): a block per segment, its bounds read
// on the device; the backward finds each token's segment by a binary search of cu_seqlens.
#include "common/loss_math.h"
#include "common/seq_loss_math.h"
#include "cuda/policy_loss.h"
#include "cuda/token_loss.cuh"

namespace ppo_fast {
namespace cuda {
namespace {

// A token's terms (accumulate, masked by select) and gradients (grads, given the upstream
// gradient grad_loss * row_scale of its row).  x[k] is input k of the token.
template <typename D>
struct PolicyToken {
  using T = typename D::T;
  static constexpr int kInputs = 4;  // logprobs, old_logprobs, advantages, weights (1 when absent)
  static constexpr int kParts = kPolicyPartials;
  static constexpr int kGrads = 4;  // the same order
  const typename D::Bits* in[kInputs];
  PolicyParams params;

  struct Math {
    PolicyBounds<T> bounds;
    __device__ void accumulate(const T (&x)[kInputs], bool valid, T (&acc)[kParts]) const {
      const PolicyTerm<T> term = policy_term(x[0], x[1], x[2], bounds);
      acc[kPgSum] += valid ? term.pg * x[3] : T(0);
      acc[kCount] += valid ? T(1) : T(0);
      acc[kClipfrac] += valid ? term.is_clipped : T(0);
      acc[kClipfracLower] += valid ? term.is_capped : T(0);
      acc[kKlSum] += valid ? x[1] - x[0] : T(0);
    }
    __device__ void grads(const T (&x)[kInputs], T upstream, T (&g)[kGrads]) const {
      const PolicyTerm<T> term = policy_term(x[0], x[1], x[2], bounds);
      const PolicyGrad<T> grad = policy_grad(term, bounds, upstream * x[3]);
      g[0] = grad.logp;
      g[1] = -grad.logp;
      g[2] = grad.adv;
      g[3] = upstream * term.pg;
    }
  };
  __device__ Math math() const { return {policy_bounds<T>(params)}; }

  // clipfrac, clipfrac_lower in float32, approx_kl in the compute type (as the reference).
  static __device__ void store_stats(const double* totals, const LossOutputs& out) {
    const double count = totals[kCount];
    *static_cast<float*>(out.stats[0]) = static_cast<float>(safe_mean(totals[kClipfrac], count));
    *static_cast<float*>(out.stats[1]) = static_cast<float>(safe_mean(totals[kClipfracLower], count));
    *static_cast<T*>(out.stats[2]) = static_cast<T>(safe_mean(totals[kKlSum], count));
  }
  static constexpr int kSumColumn = kPgSum, kCountColumn = kCount;
};

template <typename D>
PolicyToken<D> policy_token(const PolicyInputs& in) {
  using Bits = typename D::Bits;
  return {{static_cast<const Bits*>(in.logprobs), static_cast<const Bits*>(in.old_logprobs),
           static_cast<const Bits*>(in.advantages), static_cast<const Bits*>(in.weights)},
          in.params};
}

// ----------------------------------------------------------------------------- policy_loss_gspo, policy_loss_geo_mean

constexpr int kThreads = 256;
constexpr int kParts = kPolicyPartials;

// Sums `values[k]` of every thread of the block, in a fixed tree order, into totals[k];
// `shared` holds K * kThreads doubles.
template <int K>
__device__ void block_sum(const double (&values)[K], double* shared, double (&totals)[K]) {
  for (int k = 0; k < K; ++k) shared[k * kThreads + threadIdx.x] = values[k];
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width)
      for (int k = 0; k < K; ++k) shared[k * kThreads + threadIdx.x] += shared[k * kThreads + threadIdx.x + width];
    __syncthreads();
  }
  for (int k = 0; k < K; ++k) totals[k] = shared[k * kThreads];
  __syncthreads();
}

template <typename T, PolicyMode mode>
__global__ void rows_kernel(SeqInputs<T> in, double* partials, T* row_state) {
  __shared__ double shared[7 * kThreads];
  const int64_t row = blockIdx.x;
  int64_t start = row * in.length, size = in.length;
  if (in.cu != nullptr) token_loss::segment(in.cu, row, in.length, &start, &size);
  const T low = static_cast<T>(in.eps_low), high = static_cast<T>(in.eps_high);
  const PolicyBounds<T> bounds = clip_bounds<T>(in.eps_low, in.eps_high);
  const T* lp = in.logprobs + start;
  const T* od = in.old_logprobs + start;
  const T* ad = in.advantages + start;
  const T* w = in.weights ? in.weights + start : nullptr;
  const bool* on = in.mask + start;
  double* acc = partials + row * kParts;
  if constexpr (mode == PolicyMode::kGspo) {
    double sums[2] = {0, 0}, totals[2];
    for (int64_t i = threadIdx.x; i < size; i += kThreads) {
      sums[0] += on[i] ? static_cast<double>(lp[i] - od[i]) : 0.0;
      sums[1] += on[i] ? 1.0 : 0.0;
    }
    block_sum<2>(sums, shared, totals);
    const T count = static_cast<T>(totals[1]);
    const T s = static_cast<T>(totals[0]) / (count > T(1) ? count : T(1));
    double terms[2] = {0, 0}, term_totals[2];
    for (int64_t i = threadIdx.x; i < size; i += kThreads) {
      const GspoTerm<T> t = gspo_term(s, lp[i], ad[i], bounds.ratio_low, bounds.ratio_high);
      const T weighted = t.pg * (w ? w[i] : T(1));
      terms[0] += on[i] ? static_cast<double>(weighted) : 0.0;
      terms[1] += on[i] ? static_cast<double>(t.is_clipped) : 0.0;
    }
    block_sum<2>(terms, shared, term_totals);
    if (threadIdx.x == 0) {
      row_state[row * kRowState] = s;
      row_state[row * kRowState + 1] = T(0);
      acc[kPgSum] = term_totals[0], acc[kCount] = totals[1], acc[kClipfrac] = term_totals[1], acc[kClipfracLower] = 0.0;
      acc[kKlSum] = -totals[0];
    }
  } else {
    double sums[7] = {0, 0, 0, 0, 0, 0, 0}, totals[7];  // kept, adv, log w, count, clip high, clip low, kl
    for (int64_t i = threadIdx.x; i < size; i += kThreads) {
      const GeoTerm<T> t = geo_term(lp[i], od[i], ad[i], low, high);
      sums[0] += on[i] ? static_cast<double>(t.kept) : 0.0;
      sums[1] += on[i] ? static_cast<double>(ad[i]) : 0.0;
      if (w) sums[2] += on[i] ? static_cast<double>(log(w[i] + T(1e-10))) : 0.0;
      sums[3] += on[i] ? 1.0 : 0.0;
      sums[4] += on[i] && ad[i] > T(0) ? static_cast<double>(t.is_clipped) : 0.0;
      sums[5] += on[i] && ad[i] < T(0) ? static_cast<double>(t.is_clipped) : 0.0;
      sums[6] += on[i] ? static_cast<double>(od[i] - lp[i]) : 0.0;
    }
    block_sum<7>(sums, shared, totals);
    if (threadIdx.x == 0) {
      const T count = static_cast<T>(totals[3]);
      const T row_loss = geo_row(static_cast<T>(totals[0]), static_cast<T>(totals[1]), static_cast<T>(totals[2]), count,
                                 row_state + row * kRowState);
      acc[kPgSum] = static_cast<double>(row_loss * count), acc[kCount] = totals[3], acc[kClipfrac] = totals[4];
      acc[kClipfracLower] = totals[5], acc[kKlSum] = totals[6];
    }
  }
}

// One block: the aggregation over the rows (reference.aggregate) and the stats.
template <typename T, PolicyMode mode>
__global__ void finish_kernel(const double* partials, int64_t rows, int64_t length, const int64_t* cu, int64_t agg,
                              SeqOutputs<T> out) {
  __shared__ double shared[(kParts + 1) * kThreads];
  // seq-mean-token-sum-norm's T: the padded length, or the longest segment (no host read)
  if (cu != nullptr) length = static_cast<int64_t>(token_loss::longest_segment<kThreads>(cu, rows, length));
  double counts[2] = {0, 0}, count_totals[2];  // tokens, rows with tokens
  for (int64_t b = threadIdx.x; b < rows; b += kThreads) {
    counts[0] += partials[b * kParts + kCount];
    counts[1] += partials[b * kParts + kCount] > 0.0 ? 1.0 : 0.0;
  }
  block_sum<2>(counts, shared, count_totals);
  double sums[kParts + 1] = {0, 0, 0, 0, 0, 0}, totals[kParts + 1];  // loss, then column k of the partials at k + 1
  for (int64_t b = threadIdx.x; b < rows; b += kThreads) {
    const double count = partials[b * kParts + kCount];
    const double scale = row_scale(agg, count, count_totals[0], count_totals[1], length);
    out.row_scale[b] = static_cast<T>(mode == PolicyMode::kGeoMean ? scale * count : scale);
    sums[0] += scale * partials[b * kParts + kPgSum];
    for (int k = kCount; k < kParts; ++k) sums[k + 1] += partials[b * kParts + k];
  }
  block_sum<kParts + 1>(sums, shared, totals);
  if (threadIdx.x == 0) {
    *out.loss = static_cast<T>(totals[0]);
    const double count = totals[1 + kCount];
    *out.clipfrac = static_cast<float>(safe_mean(totals[1 + kClipfrac], count));
    *out.clipfrac_lower = static_cast<float>(safe_mean(totals[1 + kClipfracLower], count));
    *out.approx_kl = static_cast<T>(safe_mean(totals[1 + kKlSum], count));
  }
}

// The segment of token i: the last row b with cu[b] <= i (empty segments share their start with the
// next one), in [0, rows - 1] whatever cu holds.
__device__ __forceinline__ int64_t segment_of(const int64_t* cu, int64_t rows, int64_t i) {
  int64_t low = 0, high = rows - 1;
  while (low < high) {
    const int64_t mid = (low + high + 1) / 2;
    if (cu[mid] <= i)
      low = mid;
    else
      high = mid - 1;
  }
  return low;
}

template <typename T, PolicyMode mode>
__global__ void backward_kernel(SeqInputs<T> in, const T* grad_loss, const T* row_scale, const T* row_state,
                                SeqGrads<T> grads) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= (in.cu != nullptr ? in.length : in.rows * in.length)) return;
  const int64_t row = in.cu != nullptr ? segment_of(in.cu, in.rows, i) : i / in.length;
  const T low = static_cast<T>(in.eps_low), high = static_cast<T>(in.eps_high);
  const PolicyBounds<T> bounds = clip_bounds<T>(in.eps_low, in.eps_high);
  const T g_row = *grad_loss * row_scale[row];
  const T* st = row_state + row * kRowState;
  const T wi = in.weights ? in.weights[i] : T(1);
  const bool on = in.mask[i];
  T d_lp, d_ad, d_w;
  if constexpr (mode == PolicyMode::kGspo) {
    const GspoTerm<T> t = gspo_term(st[0], in.logprobs[i], in.advantages[i], bounds.ratio_low, bounds.ratio_high);
    const PolicyGrad<T> g = gspo_grad(t, bounds.ratio_low, bounds.ratio_high, g_row * wi);
    d_lp = g.logp, d_ad = g.adv, d_w = g_row * t.pg;
  } else {
    const GeoTerm<T> t = geo_term(in.logprobs[i], in.old_logprobs[i], in.advantages[i], low, high);
    d_lp = geo_kept_grad(t, low, high, g_row * st[0]);
    d_ad = g_row * st[1];
    d_w = g_row * st[0] / (wi + T(1e-10));
  }
  if (grads.logprobs) grads.logprobs[i] = on ? d_lp : T(0);
  if (grads.advantages) grads.advantages[i] = on ? d_ad : T(0);
  if (grads.weights) grads.weights[i] = on ? d_w : T(0);
}

template <typename T, PolicyMode mode>
void forward(const SeqInputs<T>& in, int64_t agg, const SeqOutputs<T>& out, cudaStream_t stream) {
  if (in.rows > 0)
    rows_kernel<T, mode><<<static_cast<unsigned>(in.rows), kThreads, 0, stream>>>(in, out.partials, out.row_state);
  finish_kernel<T, mode><<<1, kThreads, 0, stream>>>(out.partials, in.rows, in.length, in.cu, agg, out);
}

template <typename T, PolicyMode mode>
void backward(const SeqInputs<T>& in, const T* grad_loss, const T* row_scale, const T* row_state,
              const SeqGrads<T>& grads, cudaStream_t stream) {
  const int64_t n = in.cu != nullptr ? in.length : in.rows * in.length;
  if (n == 0 || in.rows == 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  backward_kernel<T, mode>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(in, grad_loss, row_scale, row_state, grads);
}

}  // namespace

void policy_loss_forward(const PolicyInputs& in, int64_t agg, double* partials, const LossOutputs& out,
                         cudaStream_t stream) {
  token_loss::with_dtype(in.dtype, [&](auto d) {
    using D = decltype(d);
    token_loss::forward<D>(policy_token<D>(in), in.mask, in.rows, in.length, agg, partials, out, stream);
  });
}

void policy_loss_backward(const PolicyInputs& in, const void* grad_loss, const void* row_scale,
                          const GradOutputs& grads, cudaStream_t stream) {
  token_loss::with_dtype(in.dtype, [&](auto d) {
    using D = decltype(d);
    token_loss::backward<D>(policy_token<D>(in), in.mask, in.rows, in.length, grad_loss, row_scale, grads, stream);
  });
}

template <typename T>
void seq_loss_forward(PolicyMode mode, const SeqInputs<T>& in, int64_t agg, const SeqOutputs<T>& out,
                      cudaStream_t stream) {
  if (mode == PolicyMode::kGspo)
    forward<T, PolicyMode::kGspo>(in, agg, out, stream);
  else
    forward<T, PolicyMode::kGeoMean>(in, agg, out, stream);
}

template <typename T>
void seq_loss_backward(PolicyMode mode, const SeqInputs<T>& in, const T* grad_loss, const T* row_scale,
                       const T* row_state, const SeqGrads<T>& grads, cudaStream_t stream) {
  if (mode == PolicyMode::kGspo)
    backward<T, PolicyMode::kGspo>(in, grad_loss, row_scale, row_state, grads, stream);
  else
    backward<T, PolicyMode::kGeoMean>(in, grad_loss, row_scale, row_state, grads, stream);
}

template void seq_loss_forward<float>(PolicyMode, const SeqInputs<float>&, int64_t, const SeqOutputs<float>&,
                                      cudaStream_t);
template void seq_loss_forward<double>(PolicyMode, const SeqInputs<double>&, int64_t, const SeqOutputs<double>&,
                                       cudaStream_t);
template void seq_loss_backward<float>(PolicyMode, const SeqInputs<float>&, const float*, const float*, const float*,
                                       const SeqGrads<float>&, cudaStream_t);
template void seq_loss_backward<double>(PolicyMode, const SeqInputs<double>&, const double*, const double*,
                                        const double*, const SeqGrads<double>&, cudaStream_t);

}  // namespace cuda
}  // namespace ppo_fast
