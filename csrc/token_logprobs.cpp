// token_logprobs: its schemas and CPU kernels.  log_softmax(logits / temperature) at the
// labels (and the entropy) in one pass over each row with an online max / sum-exp, rows in
// parallel, no [N, V] intermediate.  The backward recomputes the softmax from the saved
// per-row (max, log_sum) of logits / temperature (`stats`).  With top_k / top_p / min_p a row's
// kept set {z >= threshold} is found by selections over a scratch copy of its z (see "Truncated
// rows" below), the softmax renormalised over it, the threshold saved as a third stats column
// for the backward, which masks the same set.  Also defines the row functions of
// common/log_softmax_rows.h. A label outside [0, V) that is not ignore_index is never read or written: its row gets
// log-prob NaN, entropy NaN and a zero gradient (the contract's rule where labels are
// not checked on the host, e.g. under torch.compile or in a direct op call).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/fast_exp.h"
#include "common/float_io.h"
#include "common/log_softmax_rows.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // `entropy` is empty unless return_entropy; `stats` [..., 2] is the per-row max of
  // z = logits / temperature and log(sum(exp(z - max))), kept for the backward; with a truncation
  // (top_k > 0, top_p < 1 or min_p > 0: ppo_fast/_sampling.py) [..., 3], the third the kept set's
  // threshold on z.  A label outside [0, V) that is not
  // ignore_index gives its row NaN log-prob and entropy and no gradient.
  m.def(
      "token_logprobs(Tensor logits, Tensor labels, float temperature, bool return_entropy, int ignore_index, "
      "int top_k=0, float top_p=1.0, float min_p=0.0) -> (Tensor logprobs, Tensor entropy, Tensor stats)");
  m.def(
      "token_logprobs_backward(Tensor? grad_logprobs, Tensor? grad_entropy, Tensor logits, Tensor labels, "
      "Tensor stats, Tensor entropy, float temperature, int ignore_index) -> Tensor");
}

namespace {

constexpr int64_t kChunk = 1024;  // logits converted to the compute type at a time (stays in L1)

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Where row r of the [N, V] or [B, T, V] logits starts (unit last stride, any leading strides).
struct RowLayout {
  int64_t inner_rows;  // T for [B, T, V]; N for [N, V]
  int64_t outer_stride;
  int64_t inner_stride;
  int64_t offset(int64_t row) const { return (row / inner_rows) * outer_stride + (row % inner_rows) * inner_stride; }
};

RowLayout row_layout(const at::Tensor& logits) {
  if (logits.dim() == 3) return {std::max<int64_t>(logits.size(1), 1), logits.stride(0), logits.stride(1)};
  return {std::max<int64_t>(logits.size(0), 1), 0, logits.stride(0)};
}

// A logit in the compute type.  bfloat16 is the high half of a float32: a shift, which
// vectorizes in the clones below (c10's conversion does not); float16 through c10.
PPO_INLINE float to_acc(float x) { return x; }
PPO_INLINE double to_acc(double x) { return x; }
PPO_INLINE float to_acc(c10::Half x) { return static_cast<float>(x); }
PPO_INLINE float to_acc(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// The hot loops over a chunk of logits (any float dtype) or of scaled logits z (float32,
// or float64 for float64 logits).

// z[i] = row[i] / temperature in the compute type, and the largest z (one pass).
template <typename scalar_t, typename acc_t>
PPO_INLINE acc_t scale_max_impl(const scalar_t* row, int64_t n, acc_t inv_temp, acc_t* z) {
  acc_t result = -std::numeric_limits<acc_t>::infinity();
#pragma omp simd reduction(max : result)
  for (int64_t i = 0; i < n; ++i) {
    const acc_t v = to_acc(row[i]) * inv_temp;
    z[i] = v;
    result = v > result ? v : result;  // NaN never wins; it poisons the sums
  }
  return result;
}

// sum exp(z - m) and, for the entropy, sum exp(z - m) (z - m).
template <typename acc_t>
PPO_INLINE void chunk_sum_exp_impl(const acc_t* z, int64_t n, acc_t m, bool want_entropy, acc_t* sum, acc_t* weighted) {
  acc_t chunk_sum = 0, chunk_weighted = 0;
  if (want_entropy) {
#pragma omp simd reduction(+ : chunk_sum, chunk_weighted)
    for (int64_t i = 0; i < n; ++i) {
      const acc_t shifted = z[i] - m;
      const acc_t e = fast_exp(shifted);
      chunk_sum += e;
      chunk_weighted += e == 0 ? acc_t(0) : e * shifted;  // p log p is 0 where p is 0
    }
  } else {
#pragma omp simd reduction(+ : chunk_sum)
    for (int64_t i = 0; i < n; ++i) chunk_sum += fast_exp(z[i] - m);
  }
  *sum = chunk_sum;
  *weighted = chunk_weighted;
}

// out = -g p - h p (log p + entropy) with log p = (z - max) - log_sum, z = row / temperature: the
// gradient w.r.t. z of g * logp[label] + h * entropy, except the g * onehot term the
// caller adds.  z is rounded and stored first, as the forward's scale_max stores it: in
// one loop the compiler would fuse row * inv_temp - max into an FMA, whose rounding
// differs from the forward's by up to ulp(z), which the gradient multiplies by 1 / T.
template <typename scalar_t, typename acc_t>
PPO_INLINE void chunk_grad_impl(const scalar_t* row, int64_t n, acc_t inv_temp, acc_t max, acc_t log_sum, acc_t g,
                                acc_t h, acc_t entropy, acc_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_acc(row[i]) * inv_temp;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const acc_t log_p = (out[i] - max) - log_sum;  // not z - lse: lse rounds at max's magnitude
    const acc_t p = fast_exp(log_p);
    const acc_t entropy_term = p == 0 ? acc_t(0) : h * p * (log_p + entropy);
    out[i] = -g * p - entropy_term;
  }
}

// The per-CPU clones (float32 compute), one per logits dtype; float64 runs the baseline.
#define PPO_LOGPROB_CHUNKS(scalar_t)                                                                                \
  PPO_CPU_CLONES float scale_max_chunk(const scalar_t* row, int64_t n, float inv_temp, float* z) {                  \
    return scale_max_impl(row, n, inv_temp, z);                                                                     \
  }                                                                                                                 \
  PPO_CPU_CLONES void chunk_grad(const scalar_t* row, int64_t n, float inv_temp, float max, float log_sum, float g, \
                                 float h, float entropy, float* out) {                                              \
    chunk_grad_impl(row, n, inv_temp, max, log_sum, g, h, entropy, out);                                            \
  }
PPO_LOGPROB_CHUNKS(float)
PPO_LOGPROB_CHUNKS(c10::BFloat16)
PPO_LOGPROB_CHUNKS(c10::Half)
#undef PPO_LOGPROB_CHUNKS
double scale_max_chunk(const double* row, int64_t n, double inv_temp, double* z) {
  return scale_max_impl(row, n, inv_temp, z);
}
void chunk_grad(const double* row, int64_t n, double inv_temp, double max, double log_sum, double g, double h,
                double entropy, double* out) {
  chunk_grad_impl(row, n, inv_temp, max, log_sum, g, h, entropy, out);
}
PPO_CPU_CLONES void chunk_sum_exp(const float* z, int64_t n, float m, bool want_entropy, float* sum, float* weighted) {
  chunk_sum_exp_impl(z, n, m, want_entropy, sum, weighted);
}
void chunk_sum_exp(const double* z, int64_t n, double m, bool want_entropy, double* sum, double* weighted) {
  chunk_sum_exp_impl(z, n, m, want_entropy, sum, weighted);
}

// One pass: per chunk, its max updates the running max m (rescaling the running sums),
// then sum_exp += exp(z - m) and weighted += exp(z - m) (z - m), so that
// lse = m + log(sum_exp) and entropy = log(sum_exp) - weighted / sum_exp.
template <typename scalar_t, typename acc_t = acc_type<scalar_t>>
RowStats<acc_t> row_stats(const scalar_t* row, int64_t vocab, acc_t inv_temp, bool want_entropy) {
  constexpr acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  alignas(64) acc_t z[kChunk];
  acc_t m = neg_inf, sum_exp = 0, weighted = 0;
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const acc_t chunk_top = scale_max_chunk(row + c0, n, inv_temp, z);
    if (chunk_top > m) {
      if (m != neg_inf) {
        const acc_t shift = m - chunk_top;
        const acc_t factor = std::exp(shift);
        weighted = (weighted + sum_exp * shift) * factor;
        sum_exp *= factor;
      }
      m = chunk_top;
    }
    if (m == neg_inf) continue;  // every logit so far is -inf: nothing to add yet
    acc_t chunk_sum, chunk_weighted;
    chunk_sum_exp(z, n, m, want_entropy, &chunk_sum, &chunk_weighted);
    sum_exp += chunk_sum;
    weighted += chunk_weighted;
  }
  const acc_t log_sum = std::log(sum_exp);
  return {m + log_sum, log_sum - weighted / sum_exp, m, log_sum};
}

// ---------------------------------------------------------------------------------------------
// Truncated rows (ppo_fast/_sampling.py): the kept set is {z >= threshold}, the threshold found
// by selections over a scratch copy of the row's z: min_p gives it directly, top_k is a k-th
// largest (std::nth_element over the tokens above a lower bound), top_p the edge of a mass
// histogram refined in its crossing bin.  No sort of the row.

// Whether any z is NaN.
template <typename acc_t>
PPO_INLINE bool has_nan_impl(const acc_t* z, int64_t n) {
  int nan = 0;
#pragma omp simd reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) nan |= z[i] != z[i];
  return nan != 0;
}

// The largest z (-inf for none).
template <typename acc_t>
PPO_INLINE acc_t max_impl(const acc_t* z, int64_t n) {
  acc_t result = -std::numeric_limits<acc_t>::infinity();
#pragma omp simd reduction(max : result)
  for (int64_t i = 0; i < n; ++i) result = z[i] > result ? z[i] : result;
  return result;
}

// The smallest z.
template <typename acc_t>
PPO_INLINE acc_t min_impl(const acc_t* z, int64_t n) {
  acc_t result = std::numeric_limits<acc_t>::infinity();
#pragma omp simd reduction(min : result)
  for (int64_t i = 0; i < n; ++i) result = z[i] < result ? z[i] : result;
  return result;
}

// The smallest z with z - m >= cutoff (min-p's kept tokens; m itself is one).
template <typename acc_t>
PPO_INLINE acc_t min_above_impl(const acc_t* z, int64_t n, acc_t m, acc_t cutoff) {
  acc_t result = std::numeric_limits<acc_t>::infinity();
#pragma omp simd reduction(min : result)
  for (int64_t i = 0; i < n; ++i) {
    const acc_t v = z[i] - m >= cutoff ? z[i] : std::numeric_limits<acc_t>::infinity();
    result = v < result ? v : result;
  }
  return result;
}

// w[i] = exp(v[i] - m): the unnormalised probabilities top-p weighs.
template <typename acc_t>
PPO_INLINE void weights_impl(const acc_t* v, int64_t n, acc_t m, acc_t* w) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) w[i] = fast_exp(v[i] - m);
}

// bin[i] = min((m - v[i]) * scale, last) truncated: the histogram bins of top-p, in value order.
template <typename acc_t>
PPO_INLINE void bins_impl(const acc_t* v, int64_t n, acc_t m, acc_t scale, acc_t last, int32_t* bin) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const acc_t b = (m - v[i]) * scale;
    bin[i] = static_cast<int32_t>(b < last ? b : last);
  }
}

// chunk_sum_exp over the kept z >= tau only.
template <typename acc_t>
PPO_INLINE void kept_sum_exp_impl(const acc_t* z, int64_t n, acc_t m, acc_t tau, bool want_entropy, acc_t* sum,
                                  acc_t* weighted) {
  acc_t chunk_sum = 0, chunk_weighted = 0;
  if (want_entropy) {
#pragma omp simd reduction(+ : chunk_sum, chunk_weighted)
    for (int64_t i = 0; i < n; ++i) {
      const acc_t shifted = z[i] - m;
      const acc_t e = z[i] >= tau ? fast_exp(shifted) : acc_t(0);
      chunk_sum += e;
      chunk_weighted += e == 0 ? acc_t(0) : e * shifted;
    }
  } else {
#pragma omp simd reduction(+ : chunk_sum)
    for (int64_t i = 0; i < n; ++i) chunk_sum += z[i] >= tau ? fast_exp(z[i] - m) : acc_t(0);
  }
  *sum = chunk_sum;
  *weighted = chunk_weighted;
}

// kept_sum_exp_impl given e = exp(z - m) in w.
template <typename acc_t>
PPO_INLINE void kept_sum_weights_impl(const acc_t* z, const acc_t* w, int64_t n, acc_t m, acc_t tau, bool want_entropy,
                                      acc_t* sum, acc_t* weighted) {
  acc_t chunk_sum = 0, chunk_weighted = 0;
  if (want_entropy) {
#pragma omp simd reduction(+ : chunk_sum, chunk_weighted)
    for (int64_t i = 0; i < n; ++i) {
      const acc_t e = z[i] >= tau ? w[i] : acc_t(0);
      chunk_sum += e;
      chunk_weighted += e == 0 ? acc_t(0) : e * (z[i] - m);
    }
  } else {
#pragma omp simd reduction(+ : chunk_sum)
    for (int64_t i = 0; i < n; ++i) chunk_sum += z[i] >= tau ? w[i] : acc_t(0);
  }
  *sum = chunk_sum;
  *weighted = chunk_weighted;
}

// chunk_grad_impl with p = 0 on the dropped tokens z < tau.
template <typename scalar_t, typename acc_t>
PPO_INLINE void chunk_grad_kept_impl(const scalar_t* row, int64_t n, acc_t inv_temp, acc_t max, acc_t log_sum,
                                     acc_t tau, acc_t g, acc_t h, acc_t entropy, acc_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to_acc(row[i]) * inv_temp;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const acc_t log_p = (out[i] - max) - log_sum;
    const acc_t p = out[i] >= tau ? fast_exp(log_p) : acc_t(0);
    const acc_t entropy_term = p == 0 ? acc_t(0) : h * p * (log_p + entropy);
    out[i] = -g * p - entropy_term;
  }
}

#define PPO_KEPT_CHUNKS(acc_t, CLONES)                                                                                 \
  CLONES bool has_nan(const acc_t* z, int64_t n) { return has_nan_impl(z, n); }                                        \
  CLONES acc_t max_of(const acc_t* z, int64_t n) { return max_impl(z, n); }                                            \
  CLONES acc_t min_of(const acc_t* z, int64_t n) { return min_impl(z, n); }                                            \
  CLONES acc_t min_above(const acc_t* z, int64_t n, acc_t m, acc_t cutoff) { return min_above_impl(z, n, m, cutoff); } \
  CLONES void weights_of(const acc_t* v, int64_t n, acc_t m, acc_t* w) { weights_impl(v, n, m, w); }                   \
  CLONES void bins_of(const acc_t* v, int64_t n, acc_t m, acc_t scale, acc_t last, int32_t* bin) {                     \
    bins_impl(v, n, m, scale, last, bin);                                                                              \
  }                                                                                                                    \
  CLONES void kept_sum_exp(const acc_t* z, int64_t n, acc_t m, acc_t tau, bool want_entropy, acc_t* sum,               \
                           acc_t* weighted) {                                                                          \
    kept_sum_exp_impl(z, n, m, tau, want_entropy, sum, weighted);                                                      \
  }                                                                                                                    \
  CLONES void kept_sum_weights(const acc_t* z, const acc_t* w, int64_t n, acc_t m, acc_t tau, bool want_entropy,       \
                               acc_t* sum, acc_t* weighted) {                                                          \
    kept_sum_weights_impl(z, w, n, m, tau, want_entropy, sum, weighted);                                               \
  }
PPO_KEPT_CHUNKS(float, PPO_CPU_CLONES)
PPO_KEPT_CHUNKS(double, )
#undef PPO_KEPT_CHUNKS
#define PPO_KEPT_GRAD(scalar_t, acc_t, CLONES)                                                                     \
  CLONES void chunk_grad_kept(const scalar_t* row, int64_t n, acc_t inv_temp, acc_t max, acc_t log_sum, acc_t tau, \
                              acc_t g, acc_t h, acc_t entropy, acc_t* out) {                                       \
    chunk_grad_kept_impl(row, n, inv_temp, max, log_sum, tau, g, h, entropy, out);                                 \
  }
PPO_KEPT_GRAD(float, float, PPO_CPU_CLONES)
PPO_KEPT_GRAD(c10::BFloat16, float, PPO_CPU_CLONES)
PPO_KEPT_GRAD(c10::Half, float, PPO_CPU_CLONES)
PPO_KEPT_GRAD(double, double, )
#undef PPO_KEPT_GRAD

// min-p keeps u where exp(z_u - max) >= min_p, exp taken in float64 of the difference rounded in
// the compute type (as the reference computes it): that is z_u - max >= the cutoff returned, the
// least non-positive d with exp(d) >= min_p, found by bisection over d's bit patterns.
template <typename acc_t>
acc_t min_p_cutoff(double min_p) {
  using bits_t = std::conditional_t<sizeof(acc_t) == 4, uint32_t, uint64_t>;
  const auto negated = [](bits_t magnitude) {
    acc_t x;
    std::memcpy(&x, &magnitude, sizeof(x));
    return -x;
  };
  const acc_t inf = std::numeric_limits<acc_t>::infinity();
  bits_t good = 0, bad;  // exp(-0) = 1 >= min_p; exp(-inf) = 0 < min_p
  std::memcpy(&bad, &inf, sizeof(bad));
  while (bad - good > 1) {
    const bits_t mid = good + (bad - good) / 2;
    (std::exp(static_cast<double>(negated(mid))) >= min_p ? good : bad) = mid;
  }
  return negated(good);
}

// The kept tokens' edge for top-p among `n` candidate values v (all finite, w their weights
// exp(v - max)): the least v whose strictly larger candidates' mass is below top_p times theirs.
// pairs (value, weight), sorted in place by descending value, the mass `above` them lying above.
template <typename acc_t>
acc_t top_p_edge_sorted(std::vector<std::pair<acc_t, acc_t>>& pairs, double above, double limit) {
  std::sort(pairs.begin(), pairs.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  acc_t edge = pairs.front().first;  // its larger mass is `above` < limit: always kept
  for (size_t i = 0; i < pairs.size() && above < limit;) {
    edge = pairs[i].first;
    for (; i < pairs.size() && pairs[i].first == edge; ++i) above += pairs[i].second;  // a tie joins whole
  }
  return edge;
}

// top-p over the candidates v[0, n): a histogram of their mass over kBins bins of max - v (bins
// are ordered as the values, ties share one), then the exact rule in the bin where the mass from
// the top crosses top_p * total.  Masses are summed in float64.
template <typename acc_t>
acc_t top_p_edge(const acc_t* v, acc_t* w, int64_t n, acc_t m, double top_p) {
  constexpr int64_t kBins = 2048, kSortAll = 1024;
  weights_of(v, n, m, w);
  const acc_t low = min_of(v, n);
  const acc_t range = m - low, scale = static_cast<acc_t>(kBins) / range;
  std::vector<std::pair<acc_t, acc_t>> pairs;
  if (n <= kSortAll || !(range > 0) || !std::isfinite(scale) || !std::isfinite(range)) {
    pairs.reserve(n);
    double total = 0;
    for (int64_t i = 0; i < n; ++i) {
      pairs.emplace_back(v[i], w[i]);
      total += w[i];
    }
    return top_p_edge_sorted(pairs, 0.0, top_p * total);
  }
  thread_local std::vector<int32_t> bin_scratch;
  bin_scratch.resize(n);
  int32_t* bins = bin_scratch.data();  // not through the thread-local in the loops
  bins_of(v, n, m, scale, static_cast<acc_t>(kBins - 1), bins);
  std::array<double, kBins> mass{};
  for (int64_t i = 0; i < n; ++i) mass[bins[i]] += w[i];
  double total = 0;
  for (const double b : mass) total += b;
  const double limit = top_p * total;
  double above = 0;
  int32_t crossing = 0;
  while (crossing < kBins - 1 && above + mass[crossing] < limit) above += mass[crossing++];
  int64_t in_crossing = 0;  // the crossing bin's indices, over bins itself (each read before it is written)
  for (int64_t i = 0; i < n; ++i) {
    const bool hit = bins[i] == crossing;
    bins[in_crossing] = static_cast<int32_t>(i);
    in_crossing += hit;
  }
  if (in_crossing == 0) return low;  // unreachable: the crossing bin holds mass
  pairs.reserve(in_crossing);
  for (int64_t j = 0; j < in_crossing; ++j) pairs.emplace_back(v[bins[j]], w[bins[j]]);
  return top_p_edge_sorted(pairs, above, limit);
}

// Tokens z[i] >= lower (finite) copied to out; their count.
template <typename acc_t>
int64_t copy_at_least(const acc_t* z, int64_t n, acc_t lower, acc_t* out) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[count] = z[i];
    count += z[i] >= lower;
  }
  return count;
}

// The threshold of the kept set {z >= threshold} of a row of finite max m without NaN (-inf
// logits are never kept: their probability is 0 either way).  values, weights: vocab each.
// *row_weights: whether weights[0, vocab) ends up holding every token's exp(z - m).
template <typename acc_t>
acc_t kept_threshold(const acc_t* z, int64_t vocab, acc_t m, const Truncation& t, acc_t* values, acc_t* weights,
                     bool* row_weights) {
  *row_weights = false;
  acc_t lower = std::numeric_limits<acc_t>::lowest();
  if (t.min_p > 0) lower = min_above(z, vocab, m, min_p_cutoff<acc_t>(t.min_p));
  const int64_t k = t.top_k;
  if (k > 0 && k <= vocab / 2) {  // k blocks' maxima: at least k tokens are >= the least of them
    const int64_t block = vocab / k;
    acc_t least = std::numeric_limits<acc_t>::infinity();
    for (int64_t b = 0; b < k; ++b)
      least = std::min(least, max_of(z + b * block, b + 1 < k ? block : vocab - b * block));
    lower = std::max(lower, least);
  }
  if (k == 0 && t.top_p < 1 && min_of(z, vocab) >= lower) {  // every token a candidate: no copy
    *row_weights = true;
    return top_p_edge(z, weights, vocab, m, t.top_p);
  }
  int64_t count = copy_at_least(z, vocab, lower, values);
  acc_t threshold = lower;
  if (k > 0 && count > k) {  // the k-th largest; fewer candidates than k: all kept
    std::nth_element(values, values + (k - 1), values + count, std::greater<acc_t>());
    threshold = values[k - 1];
    count = copy_at_least(values, count, threshold, values);
  }
  if (t.top_p < 1) threshold = top_p_edge(values, weights, count, m, t.top_p);
  return threshold;
}

// row_stats over the kept tokens, the row's z kept in scratch[0, vocab).
template <typename scalar_t, typename acc_t>
RowStats<acc_t> row_stats_kept(const scalar_t* row, int64_t vocab, acc_t inv_temp, bool want_entropy,
                               const Truncation& truncation, acc_t* scratch, acc_t* threshold) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  acc_t* z = scratch;
  acc_t m = -inf;
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    m = std::max(m, scale_max_chunk(row + c0, std::min(kChunk, vocab - c0), inv_temp, z + c0));
  }
  if (!(m > -inf && m < inf) || has_nan(z, vocab)) {  // not truncated
    *threshold = -inf;
    return row_stats(row, vocab, inv_temp, want_entropy);
  }
  acc_t* weights = scratch + 2 * vocab;
  bool row_weights;
  const acc_t tau = kept_threshold(z, vocab, m, truncation, scratch + vocab, weights, &row_weights);
  *threshold = tau;
  acc_t sum_exp = 0, weighted = 0;
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    acc_t chunk_sum, chunk_weighted;
    if (row_weights) {  // the same exp(z - m), already taken
      kept_sum_weights(z + c0, weights + c0, n, m, tau, want_entropy, &chunk_sum, &chunk_weighted);
    } else {
      kept_sum_exp(z + c0, n, m, tau, want_entropy, &chunk_sum, &chunk_weighted);
    }
    sum_exp += chunk_sum;
    weighted += chunk_weighted;
  }
  const acc_t log_sum = std::log(sum_exp);
  return {m + log_sum, log_sum - weighted / sum_exp, m, log_sum};
}

// logits [N, V] or [B, T, V] (made unit-last-stride if it is not) and integer labels of
// its leading shape, on one device.
at::Tensor checked_logits(const char* op, const at::Tensor& logits, const at::Tensor& labels) {
  check_float(op, "logits", logits);
  TORCH_CHECK(logits.dim() == 2 || logits.dim() == 3, op, ": logits must be [N, V] or [B, T, V], got shape ",
              logits.sizes());
  TORCH_CHECK(at::isIntegralType(labels.scalar_type(), /*includeBool=*/false), op,
              ": labels must be an integer tensor, got ", labels.scalar_type());
  const at::IntArrayRef leading = logits.sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK(labels.sizes() == leading, op, ": labels must have the shape of logits.shape[:-1] ", leading, ", got ",
              labels.sizes());
  check_same_device(op, {{"logits", &logits}, {"labels", &labels}});
  return logits.stride(-1) == 1 ? logits : logits.contiguous();
}

// The label's log-prob (z - max) - log_sum, z = x * inv_temp rounded as the row's scale_max
// rounds it: through memory, so that no FMA fuses x * inv_temp - max (see chunk_grad_impl).
template <typename acc_t>
acc_t log_prob_of(acc_t x, acc_t inv_temp, const RowStats<acc_t>& stats) {
  volatile acc_t z = x * inv_temp;
  return (z - stats.max) - stats.log_sum;
}

// The label's log-prob under the kept set: -inf for a dropped label (z < tau).
template <typename acc_t>
acc_t log_prob_kept(acc_t x, acc_t inv_temp, const RowStats<acc_t>& stats, acc_t tau) {
  if (tau == -std::numeric_limits<acc_t>::infinity()) return log_prob_of(x, inv_temp, stats);  // not truncated
  volatile acc_t z = x * inv_temp;
  return z >= tau ? (z - stats.max) - stats.log_sum : -std::numeric_limits<acc_t>::infinity();
}

// Whether row r's label is neither ignore_index nor a vocabulary index.
inline bool out_of_range(int64_t target, int64_t vocab) { return target < 0 || target >= vocab; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_cpu(const at::Tensor& logits_in, const at::Tensor& labels,
                                                                  double temperature, bool return_entropy,
                                                                  int64_t ignore_index, int64_t top_k, double top_p,
                                                                  double min_p) {
  const at::Tensor logits = checked_logits("token_logprobs", logits_in, labels);
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature),
              "token_logprobs: temperature must be finite and > 0, got ", temperature);
  const Truncation truncation{top_k, top_p, min_p};
  check_truncation("token_logprobs", truncation);
  const bool truncated = truncation.active();
  const int64_t width = stats_width(truncated);
  const int64_t vocab = logits.size(-1);
  const at::Tensor label = labels.to(at::kLong).contiguous();
  const int64_t rows = label.numel();
  const auto options = logits.options().dtype(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor logp = at::empty(label.sizes(), options);
  at::Tensor entropy = at::empty(return_entropy ? label.sizes() : at::IntArrayRef{0}, options);
  at::Tensor stats = at::empty(stats_shape(label, width), options);
  const RowLayout layout = row_layout(logits);
  const int64_t* label_data = label.const_data_ptr<int64_t>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "token_logprobs_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* base = logits.const_data_ptr<scalar_t>();
    const acc_t inv_temp = static_cast<acc_t>(1.0 / temperature);
    acc_t* logp_data = logp.mutable_data_ptr<acc_t>();
    acc_t* entropy_data = return_entropy ? entropy.mutable_data_ptr<acc_t>() : nullptr;
    acc_t* stats_data = stats.mutable_data_ptr<acc_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scratch(truncated ? 3 * vocab : 0);  // a truncated row's z, candidates, weights
      for (int64_t r = begin; r < end; ++r) {
        const int64_t target = label_data[r];
        acc_t* row_stats_out = stats_data + width * r;
        if (target == ignore_index) {  // no log-prob, no entropy, no gradient
          logp_data[r] = 0;
          std::fill(row_stats_out, row_stats_out + width, acc_t(0));
          if (return_entropy) entropy_data[r] = 0;
          continue;
        }
        if (out_of_range(target, vocab)) {  // never read: NaN log-prob and entropy, zero gradient
          logp_data[r] = std::numeric_limits<acc_t>::quiet_NaN();
          std::fill(row_stats_out, row_stats_out + width, std::numeric_limits<acc_t>::quiet_NaN());
          if (return_entropy) entropy_data[r] = std::numeric_limits<acc_t>::quiet_NaN();
          continue;
        }
        const scalar_t* row = base + layout.offset(r);
        const acc_t x = static_cast<acc_t>(row[target]);
        RowStats<acc_t> row_stat;
        if (truncated) {
          row_stat =
              row_stats_kept(row, vocab, inv_temp, return_entropy, truncation, scratch.data(), row_stats_out + 2);
          logp_data[r] = log_prob_kept(x, inv_temp, row_stat, row_stats_out[2]);
        } else {
          row_stat = row_stats(row, vocab, inv_temp, return_entropy);
          logp_data[r] = log_prob_of(x, inv_temp, row_stat);
        }
        row_stats_out[0] = row_stat.max;
        row_stats_out[1] = row_stat.log_sum;
        if (return_entropy) entropy_data[r] = row_stat.entropy;
      }
    });
  });
  return {logp, entropy, stats};
}

// d/dz of g * logp[label] + h * entropy, with z = logits / temperature and p = softmax(z):
// g (onehot - p) - h p (log p + entropy).  g and h arrive already divided by the
// temperature (the chain rule through z).
template <typename scalar_t, typename acc_t>
void row_grad(const scalar_t* row, scalar_t* grad_row, int64_t vocab, int64_t target, acc_t inv_temp, acc_t max,
              acc_t log_sum, acc_t g, acc_t h, acc_t entropy) {
  alignas(64) acc_t out[kChunk];
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    chunk_grad(row + c0, n, inv_temp, max, log_sum, g, h, entropy, out);
    if (target >= c0 && target < c0 + n) out[target - c0] += g;
    for (int64_t i = 0; i < n; ++i) grad_row[c0 + i] = static_cast<scalar_t>(out[i]);
  }
}

// row_grad over the kept tokens z >= tau (tau = -inf: the row was not truncated, row_grad itself).
template <typename scalar_t, typename acc_t>
void row_grad_kept(const scalar_t* row, scalar_t* grad_row, int64_t vocab, int64_t target, acc_t inv_temp, acc_t max,
                   acc_t log_sum, acc_t tau, acc_t g, acc_t h, acc_t entropy) {
  if (tau == -std::numeric_limits<acc_t>::infinity()) {
    row_grad(row, grad_row, vocab, target, inv_temp, max, log_sum, g, h, entropy);
    return;
  }
  bool target_kept = false;  // read before grad_row (which may be row) is written
  if (target >= 0 && target < vocab) {
    volatile acc_t z = to_acc(row[target]) * inv_temp;
    target_kept = z >= tau;
  }
  alignas(64) acc_t out[kChunk];
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    chunk_grad_kept(row + c0, n, inv_temp, max, log_sum, tau, g, h, entropy, out);
    if (target_kept && target >= c0 && target < c0 + n) out[target - c0] += g;
    for (int64_t i = 0; i < n; ++i) grad_row[c0 + i] = static_cast<scalar_t>(out[i]);
  }
}

at::Tensor token_logprobs_backward_cpu(const std::optional<at::Tensor>& grad_logprobs,
                                       const std::optional<at::Tensor>& grad_entropy, const at::Tensor& logits_in,
                                       const at::Tensor& labels, const at::Tensor& stats_in,
                                       const at::Tensor& entropy_in, double temperature, int64_t ignore_index) {
  constexpr const char* op = "token_logprobs_backward";
  const at::Tensor logits = checked_logits(op, logits_in, labels);
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), op, ": temperature must be finite and > 0, got ",
              temperature);
  const at::ScalarType acc_dtype = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(stats_in.scalar_type() == acc_dtype, op, ": stats must have dtype ", acc_dtype,
              " (as token_logprobs returns it), got ", stats_in.scalar_type());
  const int64_t width = checked_stats_width(op, stats_in, labels);
  check_same_device(op, {{"logits", &logits}, {"stats", &stats_in}});
  const bool has_logp_grad = grad_logprobs.has_value(), has_entropy_grad = grad_entropy.has_value();
  if (has_logp_grad) {
    check_float(op, "grad_logprobs", *grad_logprobs);
    check_same_shape(op, "grad_logprobs", *grad_logprobs, "labels", labels);
    check_same_device(op, {{"logits", &logits}, {"grad_logprobs", &*grad_logprobs}});
  }
  if (has_entropy_grad) {
    check_float(op, "grad_entropy", *grad_entropy);
    check_same_shape(op, "grad_entropy", *grad_entropy, "labels", labels);
    check_same_device(op, {{"logits", &logits}, {"grad_entropy", &*grad_entropy}});
    TORCH_CHECK(entropy_in.scalar_type() == acc_dtype, op, ": entropy must have dtype ", acc_dtype, ", got ",
                entropy_in.scalar_type());
    check_same_shape(op, "entropy", entropy_in, "labels", labels);
    check_same_device(op, {{"logits", &logits}, {"entropy", &entropy_in}});
  }
  const int64_t vocab = logits.size(-1);
  const at::Tensor label = labels.to(at::kLong).contiguous();
  const int64_t rows = label.numel();
  const at::Tensor stats = stats_in.contiguous();
  const at::Tensor grad_logp = has_logp_grad ? grad_logprobs->to(acc_dtype).contiguous() : at::Tensor();
  const at::Tensor grad_ent = has_entropy_grad ? grad_entropy->to(acc_dtype).contiguous() : at::Tensor();
  const at::Tensor entropy = has_entropy_grad ? entropy_in.contiguous() : at::Tensor();
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  const RowLayout layout = row_layout(logits);
  const int64_t* label_data = label.const_data_ptr<int64_t>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "token_logprobs_backward_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* base = logits.const_data_ptr<scalar_t>();
    scalar_t* grad_base = grad.mutable_data_ptr<scalar_t>();
    const acc_t inv_temp = static_cast<acc_t>(1.0 / temperature);
    const acc_t* stats_data = stats.const_data_ptr<acc_t>();
    const acc_t* grad_logp_data = has_logp_grad ? grad_logp.const_data_ptr<acc_t>() : nullptr;
    const acc_t* grad_ent_data = has_entropy_grad ? grad_ent.const_data_ptr<acc_t>() : nullptr;
    const acc_t* entropy_data = has_entropy_grad ? entropy.const_data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* grad_row = grad_base + r * vocab;
        const int64_t target = label_data[r];
        if (target == ignore_index || out_of_range(target, vocab)) {
          std::fill(grad_row, grad_row + vocab, static_cast<scalar_t>(0));
          continue;
        }
        const acc_t g = has_logp_grad ? grad_logp_data[r] * inv_temp : acc_t(0);
        const acc_t h = has_entropy_grad ? grad_ent_data[r] * inv_temp : acc_t(0);
        const acc_t* row_stat = stats_data + width * r;
        const acc_t entropy_r = has_entropy_grad ? entropy_data[r] : acc_t(0);
        if (width == 3) {
          row_grad_kept(base + layout.offset(r), grad_row, vocab, target, inv_temp, row_stat[0], row_stat[1],
                        row_stat[2], g, h, entropy_r);
        } else {
          row_grad(base + layout.offset(r), grad_row, vocab, target, inv_temp, row_stat[0], row_stat[1], g, h,
                   entropy_r);
        }
      }
    });
  });
  return grad;
}

}  // namespace

RowStats<float> log_softmax_row_stats(const float* row, int64_t vocab, float inv_temp, bool want_entropy) {
  return row_stats(row, vocab, inv_temp, want_entropy);
}
RowStats<double> log_softmax_row_stats(const double* row, int64_t vocab, double inv_temp, bool want_entropy) {
  return row_stats(row, vocab, inv_temp, want_entropy);
}
void log_softmax_row_grad(const float* row, float* grad_row, int64_t vocab, int64_t target, float inv_temp,
                          const float* stats, float g, float h, float entropy) {
  row_grad(row, grad_row, vocab, target, inv_temp, stats[0], stats[1], g, h, entropy);
}
void log_softmax_row_grad(const double* row, double* grad_row, int64_t vocab, int64_t target, double inv_temp,
                          const double* stats, double g, double h, double entropy) {
  row_grad(row, grad_row, vocab, target, inv_temp, stats[0], stats[1], g, h, entropy);
}
float log_softmax_label_logprob(float x, float inv_temp, const RowStats<float>& stats) {
  return log_prob_of(x, inv_temp, stats);
}
double log_softmax_label_logprob(double x, double inv_temp, const RowStats<double>& stats) {
  return log_prob_of(x, inv_temp, stats);
}

RowStats<float> log_softmax_row_stats_kept(const float* row, int64_t vocab, float inv_temp, bool want_entropy,
                                           const Truncation& truncation, float* scratch, float* threshold) {
  return row_stats_kept(row, vocab, inv_temp, want_entropy, truncation, scratch, threshold);
}
RowStats<double> log_softmax_row_stats_kept(const double* row, int64_t vocab, double inv_temp, bool want_entropy,
                                            const Truncation& truncation, double* scratch, double* threshold) {
  return row_stats_kept(row, vocab, inv_temp, want_entropy, truncation, scratch, threshold);
}
void log_softmax_row_grad_kept(const float* row, float* grad_row, int64_t vocab, int64_t target, float inv_temp,
                               const float* stats, float g, float h, float entropy) {
  row_grad_kept(row, grad_row, vocab, target, inv_temp, stats[0], stats[1], stats[2], g, h, entropy);
}
void log_softmax_row_grad_kept(const double* row, double* grad_row, int64_t vocab, int64_t target, double inv_temp,
                               const double* stats, double g, double h, double entropy) {
  row_grad_kept(row, grad_row, vocab, target, inv_temp, stats[0], stats[1], stats[2], g, h, entropy);
}
float log_softmax_label_logprob_kept(float x, float inv_temp, const RowStats<float>& stats, float threshold) {
  return log_prob_kept(x, inv_temp, stats, threshold);
}
double log_softmax_label_logprob_kept(double x, double inv_temp, const RowStats<double>& stats, double threshold) {
  return log_prob_kept(x, inv_temp, stats, threshold);
}

void check_truncation(const char* op, const Truncation& truncation) {
  TORCH_CHECK(truncation.top_k >= -1, op, ": top_k must be >= 0 (0 or -1: off), got ", truncation.top_k);
  TORCH_CHECK(truncation.top_p > 0.0 && truncation.top_p <= 1.0, op, ": top_p must lie in (0, 1], got ",
              truncation.top_p);
  TORCH_CHECK(truncation.min_p >= 0.0 && truncation.min_p <= 1.0, op, ": min_p must lie in [0, 1], got ",
              truncation.min_p);
}

int64_t checked_stats_width(const char* op, const at::Tensor& stats, const at::Tensor& labels) {
  const int64_t width = stats.dim() == labels.dim() + 1 && stats.size(-1) == 3 ? 3 : 2;
  check_shape(op, "stats", stats, stats_shape(labels, width));
  return width;
}

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("token_logprobs", &token_logprobs_cpu);
  m.impl("token_logprobs_backward", &token_logprobs_backward_cpu);
}

}  // namespace ppo_fast
