// The vectorised log-softmax of one row (defined in csrc/token_logprobs.cpp), for ops that
// form their logits in a scratch row of the compute type (float32, or float64 for float64
// inputs): linear_token_logprobs (csrc/linear_token_logprobs.cpp) computes them with a matrix
// product and reuses these instead of a second copy of the loops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ppo_fast {

// The per-row residual a log-prob forward saves for its backward: (max, log_sum), [..., 2].
inline std::vector<int64_t> stats_shape(const at::Tensor& labels) {
  std::vector<int64_t> shape(labels.sizes().begin(), labels.sizes().end());
  shape.push_back(2);
  return shape;
}

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

}  // namespace ppo_fast
