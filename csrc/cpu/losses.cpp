// CPU kernels of the PPO losses: one pass over the tokens of each row (rows in
// parallel) into per-row partial sums, then a fixed-order reduction over the rows, so
// the result does not depend on the number of threads.  The backward gives the gradient
// of every input that asks for one (output_mask), each in its input's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <vector>

#include "checks.h"
#include "contract.h"
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
// dtype, else into scratch, which store_chunk then converts into t.  An undefined or
// empty t (a gradient nobody asked for) is written to scratch and never stored.
template <typename acc_t>
acc_t* chunk_out(const at::Tensor& t, int64_t offset, acc_t* scratch) {
  if (!t.defined() || t.numel() == 0) return scratch;
  return t.scalar_type() == c10::CppTypeToScalarType<acc_t>::value ? t.mutable_data_ptr<acc_t>() + offset : scratch;
}

template <typename acc_t>
void store_chunk(const at::Tensor& t, int64_t offset, int64_t n, const acc_t* out, const acc_t* scratch) {
  if (out == scratch && t.defined() && t.numel() != 0) store_as(t, offset, n, out);
}

at::Tensor scalar(double value, const at::Tensor& like, at::ScalarType dtype) {
  return scalar_result(value, like.options(), dtype);
}

// The gradient of `input` when asked for (in its dtype, contiguous), else an empty tensor.
at::Tensor grad_like(const at::Tensor& input, bool wanted) {
  return wanted ? at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous))
                : at::empty({0}, input.options());
}

// The hot loops over a chunk of n tokens, in the compute type (float, or double for
// float64 inputs).  Masked tokens are selected away (not skipped: after the math, so
// that NaN/inf there never reaches a result), and the bool mask is read as bytes (GCC
// does not vectorize selects on bool loads), so that they vectorize.  The forward writes
// each chunk's masked per-token terms to a buffer (a loop that vectorizes as the
// gradient loops do), then sums each term with lane_sum.

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
    const acc_t weighted = term.pg * w[i];  // weighted before the select: an inf weight at a masked token is dropped
    terms[kPgSum][i] = on[i] != 0 ? weighted : acc_t(0);
    terms[kCount][i] = on[i] != 0 ? acc_t(1) : acc_t(0);
    terms[kClipped][i] = on[i] != 0 ? term.is_clipped : acc_t(0);
    terms[kCapped][i] = on[i] != 0 ? term.is_capped : acc_t(0);
    terms[kKlSum][i] = on[i] != 0 ? od[i] - lp[i] : acc_t(0);
  }
  for (int64_t k = 0; k < kPolicyPartials; ++k) acc[k] += lane_sum(terms[k], n);
}

// d loss / d logprobs only (the usual case).  `upstream` is grad_loss * row_scale.
template <typename acc_t>
PPO_INLINE void policy_grads_logp_impl(const acc_t* lp, const acc_t* od, const acc_t* ad, const acc_t* w, const uint8_t* on,
                                       int64_t n, const PolicyParams& params, acc_t upstream, acc_t* __restrict g_lp) {
  const PolicyBounds<acc_t> bounds = policy_bounds<acc_t>(params);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const PolicyTerm<acc_t> term = policy_term(lp[i], od[i], ad[i], bounds);
    const acc_t grad = policy_grad(term, bounds, upstream * w[i]).logp;
    g_lp[i] = on[i] != 0 ? grad : acc_t(0);
  }
}

// The gradients w.r.t. logprobs, old_logprobs, advantages and weights.
template <typename acc_t>
PPO_INLINE void policy_grads_all_impl(const acc_t* lp, const acc_t* od, const acc_t* ad, const acc_t* w, const uint8_t* on,
                                      int64_t n, const PolicyParams& params, acc_t upstream, acc_t* __restrict g_lp, acc_t* __restrict g_od,
                                      acc_t* __restrict g_ad, acc_t* __restrict g_w) {
  const PolicyBounds<acc_t> bounds = policy_bounds<acc_t>(params);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const PolicyTerm<acc_t> term = policy_term(lp[i], od[i], ad[i], bounds);
    const PolicyGrad<acc_t> grad = policy_grad(term, bounds, upstream * w[i]);
    const acc_t grad_w = upstream * term.pg;
    g_lp[i] = on[i] != 0 ? grad.logp : acc_t(0);
    g_od[i] = on[i] != 0 ? -grad.logp : acc_t(0);
    g_ad[i] = on[i] != 0 ? grad.adv : acc_t(0);
    g_w[i] = on[i] != 0 ? grad_w : acc_t(0);
  }
}

// n <= kChunk.
template <typename acc_t>
PPO_INLINE void value_sums_impl(const acc_t* vs, const acc_t* od, const acc_t* rs, const uint8_t* on, int64_t n, double clip,
                                double* acc) {
  const acc_t clip_t = static_cast<acc_t>(clip);
  acc_t terms[kValuePartials][kChunk];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const ValueTerm<acc_t> term = value_term(vs[i], od[i], rs[i], clip_t);
    terms[kValueLossSum][i] = on[i] != 0 ? term.loss : acc_t(0);
    terms[kValueCount][i] = on[i] != 0 ? acc_t(1) : acc_t(0);
    terms[kValueClipped][i] = on[i] != 0 ? term.is_clipped : acc_t(0);
  }
  for (int64_t k = 0; k < kValuePartials; ++k) acc[k] += lane_sum(terms[k], n);
}

// d loss / d values only (the usual case).
template <typename acc_t>
PPO_INLINE void value_grads_v_impl(const acc_t* vs, const acc_t* od, const acc_t* rs, const uint8_t* on, int64_t n,
                                   double clip, acc_t upstream, acc_t* __restrict g_v) {
  const acc_t clip_t = static_cast<acc_t>(clip);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const acc_t grad = value_grad(value_term(vs[i], od[i], rs[i], clip_t), vs[i], upstream).v;
    g_v[i] = on[i] != 0 ? grad : acc_t(0);
  }
}

// The gradients w.r.t. values, old_values and returns.
template <typename acc_t>
PPO_INLINE void value_grads_all_impl(const acc_t* vs, const acc_t* od, const acc_t* rs, const uint8_t* on, int64_t n,
                                     double clip, acc_t upstream, acc_t* __restrict g_v, acc_t* __restrict g_od, acc_t* __restrict g_rs) {
  const acc_t clip_t = static_cast<acc_t>(clip);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const ValueGrad<acc_t> grad = value_grad(value_term(vs[i], od[i], rs[i], clip_t), vs[i], upstream);
    g_v[i] = on[i] != 0 ? grad.v : acc_t(0);
    g_od[i] = on[i] != 0 ? grad.old : acc_t(0);
    g_rs[i] = on[i] != 0 ? grad.ret : acc_t(0);
  }
}

// float32: one clone per CPU kind; float64 (gradcheck) once.  The gradients never alias
// the inputs (__restrict: GCC then uses 8-lane vectors in the AVX2 clone).
PPO_CPU_CLONES void policy_sums(const float* lp, const float* od, const float* ad, const float* w, const uint8_t* on, int64_t n,
                                const PolicyParams& params, double* acc) {
  policy_sums_impl(lp, od, ad, w, on, n, params, acc);
}
void policy_sums(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on, int64_t n,
                 const PolicyParams& params, double* acc) {
  policy_sums_impl(lp, od, ad, w, on, n, params, acc);
}
PPO_CPU_CLONES void policy_grads_logp(const float* lp, const float* od, const float* ad, const float* w, const uint8_t* on,
                                      int64_t n, const PolicyParams& params, float upstream, float* __restrict g_lp) {
  policy_grads_logp_impl(lp, od, ad, w, on, n, params, upstream, g_lp);
}
void policy_grads_logp(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on, int64_t n,
                       const PolicyParams& params, double upstream, double* __restrict g_lp) {
  policy_grads_logp_impl(lp, od, ad, w, on, n, params, upstream, g_lp);
}
PPO_CPU_CLONES void policy_grads_all(const float* lp, const float* od, const float* ad, const float* w, const uint8_t* on,
                                     int64_t n, const PolicyParams& params, float upstream, float* __restrict g_lp, float* __restrict g_od,
                                     float* __restrict g_ad, float* __restrict g_w) {
  policy_grads_all_impl(lp, od, ad, w, on, n, params, upstream, g_lp, g_od, g_ad, g_w);
}
void policy_grads_all(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on, int64_t n,
                      const PolicyParams& params, double upstream, double* __restrict g_lp, double* __restrict g_od,
                      double* __restrict g_ad, double* __restrict g_w) {
  policy_grads_all_impl(lp, od, ad, w, on, n, params, upstream, g_lp, g_od, g_ad, g_w);
}
PPO_CPU_CLONES void value_sums(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n, double clip,
                               double* acc) {
  value_sums_impl(vs, od, rs, on, n, clip, acc);
}
void value_sums(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip, double* acc) {
  value_sums_impl(vs, od, rs, on, n, clip, acc);
}
PPO_CPU_CLONES void value_grads_v(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n, double clip,
                                  float upstream, float* __restrict g_v) {
  value_grads_v_impl(vs, od, rs, on, n, clip, upstream, g_v);
}
void value_grads_v(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip,
                   double upstream, double* __restrict g_v) {
  value_grads_v_impl(vs, od, rs, on, n, clip, upstream, g_v);
}
PPO_CPU_CLONES void value_grads_all(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n,
                                    double clip, float upstream, float* __restrict g_v, float* __restrict g_od, float* __restrict g_rs) {
  value_grads_all_impl(vs, od, rs, on, n, clip, upstream, g_v, g_od, g_rs);
}
void value_grads_all(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip,
                     double upstream, double* __restrict g_v, double* __restrict g_od, double* __restrict g_rs) {
  value_grads_all_impl(vs, od, rs, on, n, clip, upstream, g_v, g_od, g_rs);
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
  int64_t rows, length;
};

// Checked, contiguous inputs.
PolicyBuffers policy_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                             const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  PolicyBuffers b{logprobs.contiguous(), old_logprobs.contiguous(), advantages.contiguous(),
                  weights.has_value() ? weights->contiguous() : at::Tensor(), mask.contiguous(), at::kFloat,
                  logprobs.size(0), logprobs.size(1)};
  b.dtype = compute_dtype({&b.logp, &b.old, &b.adv, &b.weights});
  return b;
}

// row_scale [B] as the forward returned it, in the compute dtype.
at::Tensor checked_row_scale(const char* op, const at::Tensor& row_scale, const at::Tensor& like, at::ScalarType dtype) {
  check_float(op, "row_scale", row_scale);
  check_shape(op, "row_scale", row_scale, {like.size(0)});
  check_same_device(op, {{"row_scale", &row_scale}, {"inputs", &like}});
  return row_scale.to(dtype).contiguous();
}

double checked_upstream(const char* op, const at::Tensor& grad_loss, const at::Tensor& like) {
  check_grad_loss(op, grad_loss);
  check_same_device(op, {{"grad_loss", &grad_loss}, {"inputs", &like}});
  return grad_loss.item<double>();  // a CPU tensor: no device sync
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
    c10::string_view agg_name) {
  const Agg agg = parse_agg("clipped_policy_loss", agg_name);
  const PolicyBuffers in = policy_buffers("clipped_policy_loss", logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = in.rows, length = in.length;
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_backward_cpu(
    const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& mask, const std::optional<at::Tensor>& weights, const at::Tensor& row_scale_in, double clip_low,
    double clip_high, std::optional<double> dual_clip, std::array<bool, 4> output_mask) {
  constexpr const char* op = "clipped_policy_loss_backward";
  const PolicyBuffers in = policy_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = in.rows, length = in.length;
  const at::Tensor scales = checked_row_scale(op, row_scale_in, logprobs, in.dtype);
  const double upstream = checked_upstream(op, grad_loss, logprobs);
  const auto [need_logp, need_old, need_adv, need_w_asked] = output_mask;
  const bool need_w = need_w_asked && in.weights.defined();
  const PolicyParams params = policy_params(clip_low, clip_high, dual_clip);
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  at::Tensor grad_logp = grad_like(logprobs, need_logp), grad_old = grad_like(old_logprobs, need_old);
  at::Tensor grad_adv = grad_like(advantages, need_adv);
  at::Tensor grad_w = weights.has_value() ? grad_like(*weights, need_w) : at::empty({0}, logprobs.options());
  if (!(need_logp || need_old || need_adv || need_w)) return {grad_logp, grad_old, grad_adv, grad_w};

  with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* scale_data = scales.const_data_ptr<acc_t>();
    for_each_row_chunk(rows, length, [&](int64_t b, int64_t t0, int64_t n) {
      const int64_t offset = b * length + t0;
      const PolicyChunk<acc_t> c(in, offset, n);
      const acc_t row_upstream = static_cast<acc_t>(upstream) * scale_data[b];
      acc_t scratch[4][kChunk];
      if (!need_adv && !need_w) {  // the usual case: logprobs (and perhaps old_logprobs, its negation)
        acc_t* out = need_logp ? chunk_out(grad_logp, offset, scratch[0]) : scratch[0];
        policy_grads_logp(c.lp, c.od, c.ad, c.w, valid + offset, n, params, row_upstream, out);
        if (need_logp) store_chunk(grad_logp, offset, n, out, scratch[0]);
        if (need_old) {
          acc_t* old_out = chunk_out(grad_old, offset, scratch[1]);
          for (int64_t i = 0; i < n; ++i) old_out[i] = -out[i];
          store_chunk(grad_old, offset, n, old_out, scratch[1]);
        }
        return;
      }
      acc_t* outs[4] = {chunk_out(grad_logp, offset, scratch[0]), chunk_out(grad_old, offset, scratch[1]),
                        chunk_out(grad_adv, offset, scratch[2]), chunk_out(grad_w, offset, scratch[3])};
      policy_grads_all(c.lp, c.od, c.ad, c.w, valid + offset, n, params, row_upstream, outs[0], outs[1], outs[2], outs[3]);
      store_chunk(grad_logp, offset, n, outs[0], scratch[0]);
      store_chunk(grad_old, offset, n, outs[1], scratch[1]);
      store_chunk(grad_adv, offset, n, outs[2], scratch[2]);
      store_chunk(grad_w, offset, n, outs[3], scratch[3]);
    });
  });
  return {grad_logp, grad_old, grad_adv, grad_w};
}

struct ValueBuffers {
  at::Tensor v, old, ret, valid;
  at::ScalarType dtype;
  int64_t rows, length;
};

ValueBuffers value_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                           const at::Tensor& mask) {
  check_value_inputs(op, values, old_values, returns, mask);
  ValueBuffers b{values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(), at::kFloat,
                 values.size(0), values.size(1)};
  b.dtype = compute_dtype({&b.v, &b.old, &b.ret});
  return b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cpu(const at::Tensor& values, const at::Tensor& old_values,
                                                              const at::Tensor& returns, const at::Tensor& mask,
                                                              double clip, c10::string_view agg_name) {
  const Agg agg = parse_agg("value_loss", agg_name);
  const ValueBuffers in = value_buffers("value_loss", values, old_values, returns, mask);
  const int64_t rows = in.rows, length = in.length;
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& values,
                                                                       const at::Tensor& old_values, const at::Tensor& returns,
                                                                       const at::Tensor& mask, const at::Tensor& row_scale_in,
                                                                       double clip, std::array<bool, 3> output_mask) {
  constexpr const char* op = "value_loss_backward";
  const ValueBuffers in = value_buffers(op, values, old_values, returns, mask);
  const int64_t rows = in.rows, length = in.length;
  const at::Tensor scales = checked_row_scale(op, row_scale_in, values, in.dtype);
  const double upstream = checked_upstream(op, grad_loss, values);
  const auto [need_v, need_old, need_ret] = output_mask;
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  at::Tensor grad_v = grad_like(values, need_v), grad_old = grad_like(old_values, need_old);
  at::Tensor grad_ret = grad_like(returns, need_ret);
  if (!(need_v || need_old || need_ret)) return {grad_v, grad_old, grad_ret};

  with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* scale_data = scales.const_data_ptr<acc_t>();
    for_each_row_chunk(rows, length, [&](int64_t b, int64_t t0, int64_t n) {
      acc_t scratch[6][kChunk];
      const int64_t offset = b * length + t0;
      const acc_t* vs = chunk_in(in.v, offset, n, scratch[0]);
      const acc_t* od = chunk_in(in.old, offset, n, scratch[1]);
      const acc_t* rs = chunk_in(in.ret, offset, n, scratch[2]);
      const acc_t row_upstream = static_cast<acc_t>(upstream) * scale_data[b];
      acc_t* outs[3] = {chunk_out(grad_v, offset, scratch[3]), chunk_out(grad_old, offset, scratch[4]),
                        chunk_out(grad_ret, offset, scratch[5])};
      if (!need_old && !need_ret)  // the usual case
        value_grads_v(vs, od, rs, valid + offset, n, clip, row_upstream, outs[0]);
      else
        value_grads_all(vs, od, rs, valid + offset, n, clip, row_upstream, outs[0], outs[1], outs[2]);
      store_chunk(grad_v, offset, n, outs[0], scratch[3]);
      store_chunk(grad_old, offset, n, outs[1], scratch[4]);
      store_chunk(grad_ret, offset, n, outs[2], scratch[5]);
    });
  });
  return {grad_v, grad_old, grad_ret};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cpu);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cpu);
  m.impl("value_loss", &value_loss_cpu);
  m.impl("value_loss_backward", &value_loss_backward_cpu);
}

}  // namespace ppo_fast
