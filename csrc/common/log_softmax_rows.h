// The vectorised log-softmax of one row (defined in csrc/token_logprobs.cpp), for ops that
// form their logits in a scratch row of the compute type (float32, or float64 for float64
// inputs): linear_token_logprobs (csrc/linear_token_logprobs.cpp) computes them with a matrix
// product and reuses these instead of a second copy of the loops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ppo_fast {

// The sampler's truncations (ppo_fast/_sampling.py): top_k <= 0, top_p >= 1, min_p <= 0 are off.
struct Truncation {
  int64_t top_k;
  double top_p, min_p;
  bool active() const { return top_k > 0 || top_p < 1.0 || min_p > 0.0; }
};

// The per-row residual a log-prob forward saves for its backward: (max, log_sum), [..., 2],
// and with a truncation the kept set's threshold too, [..., 3]: the row keeps z >= threshold
// (-inf: every token; a row with a NaN or +inf logit is never truncated).
inline int64_t stats_width(bool truncated) { return truncated ? 3 : 2; }
inline std::vector<int64_t> stats_shape(const at::Tensor& labels, int64_t width = 2) {
  std::vector<int64_t> shape(labels.sizes().begin(), labels.sizes().end());
  shape.push_back(width);
  return shape;
}

// Truncation's checks, for the ops that take it (the message names the argument).
void check_truncation(const char* op, const Truncation& truncation);

// A backward's stats: [..., 2] or [..., 3] (as the forward returned them); returns the width.
int64_t checked_stats_width(const char* op, const at::Tensor& stats, const at::Tensor& labels);

template <typename acc_t>
struct RowStats {
  acc_t lse;      // logsumexp of the row * inv_temp
  acc_t entropy;  // of softmax(row * inv_temp)
  acc_t max;      // of the row * inv_temp, and log(sum(exp(z - max))): lse = max + log_sum,
  acc_t log_sum;  // kept apart so that a log-prob z - max - log_sum does not round at max's magnitude
};

// One pass with an online max over the row, in blocks that stay in L1.
RowStats<float> log_softmax_row_stats(const float* row, int64_t vocab, float inv_temp, bool want_entropy);
RowStats<double> log_softmax_row_stats(const double* row, int64_t vocab, double inv_temp, bool want_entropy);

// grad_row = d/d(row) of g * logp[target] + h * entropy with z = row * inv_temp and
// p = softmax(z), given the row's stats (max, log_sum) and entropy: g (onehot - p) - h p (log p + entropy),
// g and h already multiplied by inv_temp.  Elementwise given stats and entropy, so it also
// serves a slice of a row (target shifted by the slice's start; outside it adds nothing).
// grad_row may be row itself.
void log_softmax_row_grad(const float* row, float* grad_row, int64_t vocab, int64_t target, float inv_temp,
                          const float* stats, float g, float h, float entropy);
void log_softmax_row_grad(const double* row, double* grad_row, int64_t vocab, int64_t target, double inv_temp,
                          const double* stats, double g, double h, double entropy);

// The log-prob (x * inv_temp - max) - log_sum of the label (x = row[target]), its product
// rounded as the row functions above round it (no FMA: the backward's gradient depends on
// it at low T), log_sum apart from max (which would round it away at large logits).
float log_softmax_label_logprob(float x, float inv_temp, const RowStats<float>& stats);
double log_softmax_label_logprob(double x, double inv_temp, const RowStats<double>& stats);

// The truncated rows: the row's z = row * inv_temp (rounded as above) in a scratch row, the
// kept set's threshold found by a selection (no sort of the row), then the log-softmax over
// z >= threshold.  `scratch` holds 3 * vocab values (one per thread).  A NaN or +inf row is not
// truncated (threshold -inf, the stats of log_softmax_row_stats).
RowStats<float> log_softmax_row_stats_kept(const float* row, int64_t vocab, float inv_temp, bool want_entropy,
                                           const Truncation& truncation, float* scratch, float* threshold);
RowStats<double> log_softmax_row_stats_kept(const double* row, int64_t vocab, double inv_temp, bool want_entropy,
                                            const Truncation& truncation, double* scratch, double* threshold);
// log_softmax_row_grad over the kept tokens z >= stats[2] (dropped ones get 0; a dropped
// target adds no one-hot term); a slice of a row as above.
void log_softmax_row_grad_kept(const float* row, float* grad_row, int64_t vocab, int64_t target, float inv_temp,
                               const float* stats, float g, float h, float entropy);
void log_softmax_row_grad_kept(const double* row, double* grad_row, int64_t vocab, int64_t target, double inv_temp,
                               const double* stats, double g, double h, double entropy);
// The label's log-prob under the kept set: -inf where x * inv_temp < threshold.
float log_softmax_label_logprob_kept(float x, float inv_temp, const RowStats<float>& stats, float threshold);
double log_softmax_label_logprob_kept(double x, double inv_temp, const RowStats<double>& stats, double threshold);

// grad[j] *= d softcap(scale x) / dx = scale (1 - tanh^2), with tanh = softcapped[j] / cap.
template <typename scalar_t>
inline void through_softcap(scalar_t* grad, const scalar_t* softcapped, int64_t n, scalar_t scale, scalar_t cap) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t t = softcapped[j] / cap;
    grad[j] *= scale * (scalar_t(1) - t * t);
  }
}

}  // namespace ppo_fast
