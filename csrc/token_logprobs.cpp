// token_logprobs: its schemas and CPU kernels.  log_softmax(logits / temperature) at the
// labels (and the entropy) in one pass over each row with an online max / sum-exp, rows in
// parallel, no [N, V] intermediate.  The backward recomputes the softmax from the saved
// per-row (max, log_sum) of logits / temperature (`stats`).  Also defines the row functions of
// common/log_softmax_rows.h. A label outside [0, V) that is not ignore_index is never read or written: its row gets
// log-prob NaN, entropy NaN and a zero gradient (the contract's rule where labels are
// not checked on the host, e.g. under torch.compile or in a direct op call).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#include "common/checks.h"
#include "common/fast_exp.h"
#include "common/float_io.h"
#include "common/log_softmax_rows.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // `entropy` is empty unless return_entropy; `stats` [..., 2] is the per-row max of
  // z = logits / temperature and log(sum(exp(z - max))), kept for the backward.  A label outside [0, V) that is not
  // ignore_index gives its row NaN log-prob and entropy and no gradient.
  m.def(
      "token_logprobs(Tensor logits, Tensor labels, float temperature, bool return_entropy, int ignore_index) "
      "-> (Tensor logprobs, Tensor entropy, Tensor stats)");
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

// Whether row r's label is neither ignore_index nor a vocabulary index.
inline bool out_of_range(int64_t target, int64_t vocab) { return target < 0 || target >= vocab; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> token_logprobs_cpu(const at::Tensor& logits_in, const at::Tensor& labels,
                                                                  double temperature, bool return_entropy,
                                                                  int64_t ignore_index) {
  const at::Tensor logits = checked_logits("token_logprobs", logits_in, labels);
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature),
              "token_logprobs: temperature must be finite and > 0, got ", temperature);
  const int64_t vocab = logits.size(-1);
  const at::Tensor label = labels.to(at::kLong).contiguous();
  const int64_t rows = label.numel();
  const auto options = logits.options().dtype(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor logp = at::empty(label.sizes(), options);
  at::Tensor entropy = at::empty(return_entropy ? label.sizes() : at::IntArrayRef{0}, options);
  at::Tensor stats = at::empty(stats_shape(label), options);
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
      for (int64_t r = begin; r < end; ++r) {
        const int64_t target = label_data[r];
        if (target == ignore_index) {  // no log-prob, no entropy, no gradient
          logp_data[r] = 0;
          stats_data[2 * r] = stats_data[2 * r + 1] = 0;
          if (return_entropy) entropy_data[r] = 0;
          continue;
        }
        if (out_of_range(target, vocab)) {  // never read: NaN log-prob and entropy, zero gradient
          logp_data[r] = std::numeric_limits<acc_t>::quiet_NaN();
          stats_data[2 * r] = stats_data[2 * r + 1] = std::numeric_limits<acc_t>::quiet_NaN();
          if (return_entropy) entropy_data[r] = std::numeric_limits<acc_t>::quiet_NaN();
          continue;
        }
        const scalar_t* row = base + layout.offset(r);
        const RowStats<acc_t> row_stat = row_stats(row, vocab, inv_temp, return_entropy);
        stats_data[2 * r] = row_stat.max;
        stats_data[2 * r + 1] = row_stat.log_sum;
        logp_data[r] = log_prob_of(static_cast<acc_t>(row[target]), inv_temp, row_stat);
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
  check_shape(op, "stats", stats_in, stats_shape(labels));
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
        row_grad(base + layout.offset(r), grad_row, vocab, target, inv_temp, stats_data[2 * r], stats_data[2 * r + 1],
                 g, h, has_entropy_grad ? entropy_data[r] : acc_t(0));
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

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("token_logprobs", &token_logprobs_cpu);
  m.impl("token_logprobs_backward", &token_logprobs_backward_cpu);
}

}  // namespace ppo_fast
