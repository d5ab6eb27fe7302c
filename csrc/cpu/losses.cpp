// CPU kernels of the PPO losses: one pass over the tokens of each row (rows in
// parallel) into per-row partial sums, then a fixed-order reduction over the rows, so
// the result does not depend on the number of threads.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "cpu/float_io.h"
#include "fast_exp.h"
#include "loss_math.h"

namespace ppo_fast {
namespace {

constexpr int64_t kChunk = 256;  // tokens converted to the compute type at a time

double column_total(const double* partials, int64_t rows, int64_t width, int64_t column) {
  double total = 0.0;
  for (int64_t b = 0; b < rows; ++b) total += partials[b * width + column];
  return total;
}

// The aggregated loss sum_b row_scale_b * row_sum_b; writes row_scale.
template <typename acc_t>
double aggregate_rows(const double* partials, int64_t rows, int64_t width, int64_t sum_column, int64_t count_column,
                      int64_t agg, int64_t length, acc_t* row_scale_out) {
  double total_count = 0.0, nonempty_rows = 0.0;
  for (int64_t b = 0; b < rows; ++b) {
    const double count = partials[b * width + count_column];
    total_count += count;
    nonempty_rows += count > 0.0 ? 1.0 : 0.0;
  }
  double loss = 0.0;
  for (int64_t b = 0; b < rows; ++b) {
    const double scale = row_scale(agg, partials[b * width + count_column], total_count, nonempty_rows, length);
    row_scale_out[b] = static_cast<acc_t>(scale);
    loss += scale * partials[b * width + sum_column];
  }
  return loss;
}

// Where to write t's tokens [offset, ...) in the compute type: into t when t has that
// dtype, else into scratch, which store_chunk then converts into t.
template <typename acc_t>
acc_t* chunk_out(const at::Tensor& t, int64_t offset, acc_t* scratch) {
  return t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value ? t.mutable_data_ptr<acc_t>() + offset : scratch;
}

template <typename acc_t>
void store_chunk(const at::Tensor& t, int64_t offset, int64_t n, const acc_t* out, const acc_t* scratch) {
  if (out == scratch) store_as(t, offset, n, out);
}

at::Tensor scalar(double value, const at::Tensor& like, at::ScalarType dtype) {
  return at::scalar_tensor(value, like.options().dtype(dtype));
}

// The hot loops over a chunk of n tokens, in the compute type (float, or double for
// float64 inputs).  Masked tokens are selected away (not skipped), and the bool mask is
// read as bytes (GCC does not vectorize selects on bool loads), so that they vectorize.
// The forward writes each chunk's masked per-token terms to a buffer (a loop that
// vectorizes as the gradient loops do), then sums each term with lane_sum.

// The sum of x[0, n) in kLanes independent partial sums (x[i] adds to lane i % kLanes),
// so that it vectorizes: GCC does not reorder float adds, and left the `omp simd
// reduction` form of these sums scalar in the baseline clone.  The lanes are added in a
// fixed order, so a row's sums do not depend on the thread count.
constexpr int64_t kLanes = 8;

template <typename acc_t>
PPO_INLINE double lane_sum(const acc_t* x, int64_t n) {
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t lane = 0; lane < kLanes; ++lane) lanes[lane] += x[i + lane];
  for (int64_t lane = 0; i < n; ++i, ++lane) lanes[lane] += x[i];
  double total = 0.0;
  for (int64_t lane = 0; lane < kLanes; ++lane) total += lanes[lane];
  return total;
}

// n <= kChunk.
template <typename acc_t>
PPO_INLINE void policy_sums_impl(const acc_t* lp, const acc_t* od, const acc_t* ad, const acc_t* w, const uint8_t* on,
                                 int64_t n, const PolicyParams& params, double* acc) {
  const PolicyBounds<acc_t> bounds = policy_bounds<acc_t>(params);
  acc_t terms[kPolicyPartials][kChunk];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const PolicyTerm<acc_t> term = policy_term(lp[i], od[i], ad[i], bounds);
    // Weighted after the select, so that w[i] is read for every token: GCC moved a
    // selected-away product, and so the load, under a branch that blocks vectorization.
    terms[kPgSum][i] = (on[i] != 0 ? term.pg : acc_t(0)) * w[i];
    terms[kCount][i] = on[i] != 0 ? acc_t(1) : acc_t(0);
    terms[kClipped][i] = on[i] != 0 ? term.clipped : acc_t(0);
    terms[kCapped][i] = on[i] != 0 ? term.capped : acc_t(0);
    terms[kKlSum][i] = on[i] != 0 ? od[i] - lp[i] : acc_t(0);
  }
  for (int64_t k = 0; k < kPolicyPartials; ++k) acc[k] += lane_sum(terms[k], n);
}

template <typename acc_t>
PPO_INLINE void policy_grads_impl(const acc_t* lp, const acc_t* od, const acc_t* ad, const acc_t* w, const uint8_t* on,
                                  int64_t n, const PolicyParams& params, acc_t upstream, acc_t* out) {
  const PolicyBounds<acc_t> bounds = policy_bounds<acc_t>(params);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const acc_t grad = upstream * policy_term(lp[i], od[i], ad[i], bounds).grad * w[i];
    out[i] = on[i] != 0 ? grad : acc_t(0);
  }
}

// n <= kChunk.
template <typename acc_t>
PPO_INLINE void value_sums_impl(const acc_t* vs, const acc_t* od, const acc_t* rs, const uint8_t* on, int64_t n, double clip,
                                double* acc) {
  acc_t terms[kValuePartials][kChunk];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const ValueTerm<acc_t> term = value_term(vs[i], od[i], rs[i], clip);
    terms[kValueLossSum][i] = on[i] != 0 ? term.loss : acc_t(0);
    terms[kValueCount][i] = on[i] != 0 ? acc_t(1) : acc_t(0);
    terms[kValueClipped][i] = on[i] != 0 ? term.clipped : acc_t(0);
  }
  for (int64_t k = 0; k < kValuePartials; ++k) acc[k] += lane_sum(terms[k], n);
}

template <typename acc_t>
PPO_INLINE void value_grads_impl(const acc_t* vs, const acc_t* od, const acc_t* rs, const uint8_t* on, int64_t n, double clip,
                                 acc_t upstream, acc_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const acc_t grad = upstream * value_term(vs[i], od[i], rs[i], clip).grad;
    out[i] = on[i] != 0 ? grad : acc_t(0);
  }
}

// float32: one clone per CPU kind; float64 (gradcheck) once.
PPO_CPU_CLONES void policy_sums(const float* lp, const float* od, const float* ad, const float* w, const uint8_t* on, int64_t n,
                                const PolicyParams& params, double* acc) {
  policy_sums_impl(lp, od, ad, w, on, n, params, acc);
}
void policy_sums(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on, int64_t n,
                 const PolicyParams& params, double* acc) {
  policy_sums_impl(lp, od, ad, w, on, n, params, acc);
}
PPO_CPU_CLONES void policy_grads(const float* lp, const float* od, const float* ad, const float* w, const uint8_t* on,
                                 int64_t n, const PolicyParams& params, float upstream, float* out) {
  policy_grads_impl(lp, od, ad, w, on, n, params, upstream, out);
}
void policy_grads(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on, int64_t n,
                  const PolicyParams& params, double upstream, double* out) {
  policy_grads_impl(lp, od, ad, w, on, n, params, upstream, out);
}
PPO_CPU_CLONES void value_sums(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n, double clip,
                               double* acc) {
  value_sums_impl(vs, od, rs, on, n, clip, acc);
}
void value_sums(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip, double* acc) {
  value_sums_impl(vs, od, rs, on, n, clip, acc);
}
PPO_CPU_CLONES void value_grads(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n, double clip,
                                float upstream, float* out) {
  value_grads_impl(vs, od, rs, on, n, clip, upstream, out);
}
void value_grads(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip,
                 double upstream, double* out) {
  value_grads_impl(vs, od, rs, on, n, clip, upstream, out);
}

// Calls body(b, t0, n) for every chunk of n <= kChunk tokens of every row b, rows in parallel.
template <typename Body>
void for_each_row_chunk(int64_t rows, int64_t length, const Body& body) {
  at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t t0 = 0; t0 < length; t0 += kChunk) body(b, t0, std::min(kChunk, length - t0));
  });
}

struct PolicyBuffers {
  at::Tensor logp, old, adv, weights, valid;
  at::ScalarType dtype;  // compute and result dtype
};

PolicyBuffers policy_buffers(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
                             const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  TORCH_CHECK(logprobs.dim() == 2 && mask.scalar_type() == at::kBool, "clipped_policy_loss: expects [B, T] inputs and a bool mask");
  PolicyBuffers b{logprobs.contiguous(), old_logprobs.contiguous(), advantages.contiguous(),
                  weights.has_value() ? weights->contiguous() : at::Tensor(), mask.contiguous(), at::kFloat};
  b.dtype = compute_dtype({&b.logp, &b.old, &b.adv, &b.weights});
  return b;
}

// The chunk's inputs in the compute type; weights 1 when there are none.
template <typename acc_t>
struct PolicyChunk {
  acc_t scratch[4][kChunk];
  const acc_t *lp, *od, *ad, *w;

  PolicyChunk(const PolicyBuffers& in, int64_t offset, int64_t n)
      : lp(chunk_in(in.logp, offset, n, scratch[0])),
        od(chunk_in(in.old, offset, n, scratch[1])),
        ad(chunk_in(in.adv, offset, n, scratch[2])),
        w(in.weights.defined() ? chunk_in(in.weights, offset, n, scratch[3]) : ones(n)) {}

 private:
  const acc_t* ones(int64_t n) {
    std::fill(scratch[3], scratch[3] + n, acc_t(1));
    return scratch[3];
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_cpu(
    const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
    const std::optional<at::Tensor>& weights, double clip_low, double clip_high, std::optional<double> dual_clip,
    int64_t agg) {
  const PolicyBuffers in = policy_buffers(logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = logprobs.size(0), length = logprobs.size(1);
  const PolicyParams params = policy_params(clip_low, clip_high, dual_clip);
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  std::vector<double> partials(rows * kPolicyPartials, 0.0);
  at::Tensor row_scale_out = at::empty({rows}, logprobs.options().dtype(in.dtype));

  const double loss = with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    for_each_row_chunk(rows, length, [&](int64_t b, int64_t t0, int64_t n) {
      const int64_t offset = b * length + t0;
      const PolicyChunk<acc_t> c(in, offset, n);
      policy_sums(c.lp, c.od, c.ad, c.w, valid + offset, n, params, &partials[b * kPolicyPartials]);
    });
    return aggregate_rows(partials.data(), rows, kPolicyPartials, kPgSum, kCount, agg, length,
                          row_scale_out.mutable_data_ptr<acc_t>());
  });

  const double* p = partials.data();
  const double count = column_total(p, rows, kPolicyPartials, kCount);
  const auto mean_of = [&](int64_t column, at::ScalarType dtype) {
    return scalar(safe_mean(column_total(p, rows, kPolicyPartials, column), count), logprobs, dtype);
  };
  // As in the reference, the clip fractions are float32 and approx_kl has the compute dtype.
  return {scalar(loss, logprobs, in.dtype), mean_of(kClipped, at::kFloat), mean_of(kCapped, at::kFloat),
          mean_of(kKlSum, in.dtype), row_scale_out};
}

at::Tensor clipped_policy_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logprobs,
                                            const at::Tensor& old_logprobs, const at::Tensor& advantages,
                                            const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                                            const at::Tensor& row_scale_in, double clip_low, double clip_high,
                                            std::optional<double> dual_clip) {
  const PolicyBuffers in = policy_buffers(logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = logprobs.size(0), length = logprobs.size(1);
  const PolicyParams params = policy_params(clip_low, clip_high, dual_clip);
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  const at::Tensor scales = row_scale_in.to(in.dtype).contiguous();
  const double upstream = grad_loss.item<double>();
  at::Tensor grad = at::empty_like(in.logp);

  with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* scale_data = scales.const_data_ptr<acc_t>();
    for_each_row_chunk(rows, length, [&](int64_t b, int64_t t0, int64_t n) {
      const int64_t offset = b * length + t0;
      const PolicyChunk<acc_t> c(in, offset, n);
      acc_t scratch[kChunk];
      acc_t* out = chunk_out(grad, offset, scratch);
      policy_grads(c.lp, c.od, c.ad, c.w, valid + offset, n, params, static_cast<acc_t>(upstream) * scale_data[b], out);
      store_chunk(grad, offset, n, out, scratch);
    });
  });
  return grad;
}

struct ValueBuffers {
  at::Tensor v, old, ret, valid;
  at::ScalarType dtype;
};

ValueBuffers value_buffers(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                           const at::Tensor& mask) {
  TORCH_CHECK(values.dim() == 2 && mask.scalar_type() == at::kBool, "value_loss: expects [B, T] inputs and a bool mask");
  ValueBuffers b{values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(), at::kFloat};
  b.dtype = compute_dtype({&b.v, &b.old, &b.ret});
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cpu(const at::Tensor& values, const at::Tensor& old_values,
                                                              const at::Tensor& returns, const at::Tensor& mask,
                                                              double clip, int64_t agg) {
  const ValueBuffers in = value_buffers(values, old_values, returns, mask);
  const int64_t rows = values.size(0), length = values.size(1);
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  std::vector<double> partials(rows * kValuePartials, 0.0);
  at::Tensor row_scale_out = at::empty({rows}, values.options().dtype(in.dtype));

  const double loss = with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    for_each_row_chunk(rows, length, [&](int64_t b, int64_t t0, int64_t n) {
      acc_t scratch[3][kChunk];
      const int64_t offset = b * length + t0;
      value_sums(chunk_in(in.v, offset, n, scratch[0]), chunk_in(in.old, offset, n, scratch[1]),
                 chunk_in(in.ret, offset, n, scratch[2]), valid + offset, n, clip, &partials[b * kValuePartials]);
    });
    return aggregate_rows(partials.data(), rows, kValuePartials, kValueLossSum, kValueCount, agg, length,
                          row_scale_out.mutable_data_ptr<acc_t>());
  });

  const double* p = partials.data();
  const double clipfrac =
      safe_mean(column_total(p, rows, kValuePartials, kValueClipped), column_total(p, rows, kValuePartials, kValueCount));
  return {scalar(loss, values, in.dtype), scalar(clipfrac, values, at::kFloat), row_scale_out};
}

at::Tensor value_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& values, const at::Tensor& old_values,
                                   const at::Tensor& returns, const at::Tensor& mask, const at::Tensor& row_scale_in,
                                   double clip) {
  const ValueBuffers in = value_buffers(values, old_values, returns, mask);
  const int64_t rows = values.size(0), length = values.size(1);
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  const at::Tensor scales = row_scale_in.to(in.dtype).contiguous();
  const double upstream = grad_loss.item<double>();
  at::Tensor grad = at::empty_like(in.v);

  with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* scale_data = scales.const_data_ptr<acc_t>();
    for_each_row_chunk(rows, length, [&](int64_t b, int64_t t0, int64_t n) {
      acc_t scratch[4][kChunk];
      const int64_t offset = b * length + t0;
      acc_t* out = chunk_out(grad, offset, scratch[3]);
      value_grads(chunk_in(in.v, offset, n, scratch[0]), chunk_in(in.old, offset, n, scratch[1]),
                  chunk_in(in.ret, offset, n, scratch[2]), valid + offset, n, clip,
                  static_cast<acc_t>(upstream) * scale_data[b], out);
      store_chunk(grad, offset, n, out, scratch[3]);
    });
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cpu);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cpu);
  m.impl("value_loss", &value_loss_cpu);
  m.impl("value_loss_backward", &value_loss_backward_cpu);
}

}  // namespace ppo_fast
