// The policy losses: their schemas and CPU kernels.  clipped_policy_loss (token-level):
// one pass over the tokens of each row (rows in parallel) into per-row partial sums, then a
// fixed-order reduction over the rows.  The sequence-level modes, GSPO and GMPO
// (ppo_fast.reference policy_loss_gspo / policy_loss_geo_mean): rows in parallel, each row
// reduced in token order (its sums before its ratio, then its tokens), then the same
// reduction over the rows.  So no result depends on the number of threads.  The inputs are
// read in the compute type (float32, float64 when any is float64); each gradient is
// returned in its input's dtype, for every input that asks for one (output_mask).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "common/contract.h"
#include "common/fast_exp.h"
#include "common/float_io.h"
#include "common/loss_math.h"
#include "common/loss_rows.h"
#include "common/seq_loss_glue.h"
#include "common/seq_loss_math.h"
#include "common/varlen.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // `row_scale` [B] is d loss / d row sum, kept for the backward.
  m.def(
      "clipped_policy_loss(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, Tensor? weights, "
      "float clip_eps_low, float clip_eps_high, float? dual_clip, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale)");
  m.def(
      "clipped_policy_loss_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor advantages, "
      "Tensor mask, Tensor? weights, Tensor row_scale, float clip_eps_low, float clip_eps_high, float? dual_clip, "
      "bool[4] output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
  // The sequence-level policy-loss modes (ppo_fast.policy_loss_modes: a per-row reduction
  // before the ratio), with clipped_policy_loss's inputs and stats.  `row_state` [B, 2] keeps
  // per-row values for the backward (common/seq_loss_math.h); GSPO gives old_logprobs no gradient.
  m.def(
      "policy_loss_gspo(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, Tensor? weights, "
      "float clip_eps_low, float clip_eps_high, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale, Tensor row_state)");
  m.def(
      "policy_loss_gspo_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor "
      "mask, "
      "Tensor? weights, Tensor row_scale, Tensor row_state, float clip_eps_low, float clip_eps_high, bool[4] "
      "output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
  m.def(
      "policy_loss_geo_mean(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, Tensor? weights, "
      "float clip_eps_low, float clip_eps_high, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale, Tensor row_state)");
  m.def(
      "policy_loss_geo_mean_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor "
      "mask, "
      "Tensor? weights, Tensor row_scale, Tensor row_state, float clip_eps_low, float clip_eps_high, bool[4] "
      "output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
}

namespace {

// ----------------------------------------------------------------------------- clipped_policy_loss

// The hot loops over a chunk of n tokens, in the compute type (float, or double for
// float64 inputs).  Masked tokens are selected away (not skipped: after the math, so
// that NaN/inf there never reaches a result), and the bool mask is read as bytes (GCC
// does not vectorize selects on bool loads), so that they vectorize.  The forward writes
// each chunk's masked per-token terms to a buffer (a loop that vectorizes as the
// gradient loops do), then sums each term with lane_sum.

// n <= kLossChunk.
template <typename acc_t>
PPO_INLINE void policy_sums_impl(const acc_t* lp, const acc_t* od, const acc_t* ad, const acc_t* w, const uint8_t* on,
                                 int64_t n, const PolicyParams& params, double* acc) {
  const PolicyBounds<acc_t> bounds = policy_bounds<acc_t>(params);
  acc_t terms[kPolicyPartials][kLossChunk];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const PolicyTerm<acc_t> term = policy_term(lp[i], od[i], ad[i], bounds);
    const acc_t weighted = term.pg * w[i];  // weighted before the select: an inf weight at a masked token is dropped
    terms[kPgSum][i] = on[i] != 0 ? weighted : acc_t(0);
    terms[kCount][i] = on[i] != 0 ? acc_t(1) : acc_t(0);
    terms[kClipfrac][i] = on[i] != 0 ? term.is_clipped : acc_t(0);
    terms[kClipfracLower][i] = on[i] != 0 ? term.is_capped : acc_t(0);
    terms[kKlSum][i] = on[i] != 0 ? od[i] - lp[i] : acc_t(0);
  }
  for (int64_t k = 0; k < kPolicyPartials; ++k) acc[k] += lane_sum(terms[k], n);
}

// d loss / d logprobs only (the usual case).  `upstream` is grad_loss * row_scale.
template <typename acc_t>
PPO_INLINE void policy_grads_logp_impl(const acc_t* lp, const acc_t* od, const acc_t* ad, const acc_t* w,
                                       const uint8_t* on, int64_t n, const PolicyParams& params, acc_t upstream,
                                       acc_t* __restrict g_lp) {
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
PPO_INLINE void policy_grads_all_impl(const acc_t* lp, const acc_t* od, const acc_t* ad, const acc_t* w,
                                      const uint8_t* on, int64_t n, const PolicyParams& params, acc_t upstream,
                                      acc_t* __restrict g_lp, acc_t* __restrict g_od, acc_t* __restrict g_ad,
                                      acc_t* __restrict g_w) {
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

// float32: one clone per CPU kind; float64 (gradcheck) once.  The gradients never alias
// the inputs (__restrict: GCC then uses 8-lane vectors in the AVX2 clone).
PPO_CPU_CLONES void policy_sums(const float* lp, const float* od, const float* ad, const float* w, const uint8_t* on,
                                int64_t n, const PolicyParams& params, double* acc) {
  policy_sums_impl(lp, od, ad, w, on, n, params, acc);
}
void policy_sums(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on, int64_t n,
                 const PolicyParams& params, double* acc) {
  policy_sums_impl(lp, od, ad, w, on, n, params, acc);
}
PPO_CPU_CLONES void policy_grads_logp(const float* lp, const float* od, const float* ad, const float* w,
                                      const uint8_t* on, int64_t n, const PolicyParams& params, float upstream,
                                      float* __restrict g_lp) {
  policy_grads_logp_impl(lp, od, ad, w, on, n, params, upstream, g_lp);
}
void policy_grads_logp(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on,
                       int64_t n, const PolicyParams& params, double upstream, double* __restrict g_lp) {
  policy_grads_logp_impl(lp, od, ad, w, on, n, params, upstream, g_lp);
}
PPO_CPU_CLONES void policy_grads_all(const float* lp, const float* od, const float* ad, const float* w,
                                     const uint8_t* on, int64_t n, const PolicyParams& params, float upstream,
                                     float* __restrict g_lp, float* __restrict g_od, float* __restrict g_ad,
                                     float* __restrict g_w) {
  policy_grads_all_impl(lp, od, ad, w, on, n, params, upstream, g_lp, g_od, g_ad, g_w);
}
void policy_grads_all(const double* lp, const double* od, const double* ad, const double* w, const uint8_t* on,
                      int64_t n, const PolicyParams& params, double upstream, double* __restrict g_lp,
                      double* __restrict g_od, double* __restrict g_ad, double* __restrict g_w) {
  policy_grads_all_impl(lp, od, ad, w, on, n, params, upstream, g_lp, g_od, g_ad, g_w);
}

struct PolicyBuffers {
  at::Tensor logp, old, adv, weights, valid;
  at::ScalarType dtype;  // compute and result dtype
  int64_t rows, length;
};

// Checked, contiguous inputs.
PolicyBuffers policy_buffers(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                             const at::Tensor& advantages, const at::Tensor& mask,
                             const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  PolicyBuffers b{logprobs.contiguous(),   old_logprobs.contiguous(),
                  advantages.contiguous(), weights.has_value() ? weights->contiguous() : at::Tensor(),
                  mask.contiguous(),       at::kFloat,
                  logprobs.size(0),        logprobs.size(1)};
  b.dtype = compute_dtype({&b.logp, &b.old, &b.adv, &b.weights});
  return b;
}

// The chunk's inputs in the compute type; weights 1 when there are none.
template <typename acc_t>
struct PolicyChunk {
  acc_t scratch[4][kLossChunk];
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
    const std::optional<at::Tensor>& weights, double clip_eps_low, double clip_eps_high,
    std::optional<double> dual_clip, c10::string_view agg_name) {
  const Agg agg = parse_agg("clipped_policy_loss", agg_name);
  const PolicyBuffers in = policy_buffers("clipped_policy_loss", logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = in.rows, length = in.length;
  const PolicyParams params = policy_params(clip_eps_low, clip_eps_high, dual_clip);
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
  return {scalar(loss, logprobs, in.dtype), mean_of(kClipfrac, at::kFloat), mean_of(kClipfracLower, at::kFloat),
          mean_of(kKlSum, in.dtype), row_scale_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> clipped_policy_loss_backward_cpu(
    const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
    const at::Tensor& row_scale_in, double clip_eps_low, double clip_eps_high, std::optional<double> dual_clip,
    std::array<bool, 4> output_mask) {
  constexpr const char* op = "clipped_policy_loss_backward";
  const PolicyBuffers in = policy_buffers(op, logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = in.rows, length = in.length;
  const at::Tensor scales = checked_row_scale(op, row_scale_in, logprobs, in.dtype);
  const double upstream = checked_upstream(op, grad_loss, logprobs);
  const bool need_logp = output_mask[0], need_old = output_mask[1], need_adv = output_mask[2],
             need_w_asked = output_mask[3];
  const bool need_w = need_w_asked && in.weights.defined();
  const PolicyParams params = policy_params(clip_eps_low, clip_eps_high, dual_clip);
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
      acc_t scratch[4][kLossChunk];
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
      policy_grads_all(c.lp, c.od, c.ad, c.w, valid + offset, n, params, row_upstream, outs[0], outs[1], outs[2],
                       outs[3]);
      store_chunk(grad_logp, offset, n, outs[0], scratch[0]);
      store_chunk(grad_old, offset, n, outs[1], scratch[1]);
      store_chunk(grad_adv, offset, n, outs[2], scratch[2]);
      store_chunk(grad_w, offset, n, outs[3], scratch[3]);
    });
  });
  return {grad_logp, grad_old, grad_adv, grad_w};
}

// ----------------------------------------------------------------------------- policy_loss_gspo, policy_loss_geo_mean

struct SeqInputs {
  at::Tensor logp, old, adv, weights, valid;  // contiguous, in the compute dtype (weights may be undefined)
  at::ScalarType dtype;
  int64_t rows, length;
};

SeqInputs seq_inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                     const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  const at::Tensor w = weights.has_value() ? *weights : at::Tensor();
  const at::ScalarType dtype = compute_dtype({&logprobs, &old_logprobs, &advantages, &w});
  auto as = [&](const at::Tensor& t) { return t.defined() ? t.to(dtype).contiguous() : t; };
  return {as(logprobs), as(old_logprobs), as(advantages),  as(w), mask.contiguous(),
          dtype,        logprobs.size(0), logprobs.size(1)};
}

// One row's forward: its partial sums and its state (seq_loss_math.h).
template <PolicyMode mode, typename T>
void seq_row_forward(const T* lp, const T* od, const T* ad, const T* w, const bool* on, int64_t n, double eps_low,
                     double eps_high, double* acc, T* state) {
  const T low = static_cast<T>(eps_low), high = static_cast<T>(eps_high);
  const PolicyBounds<T> bounds = clip_bounds<T>(eps_low, eps_high);
  if constexpr (mode == PolicyMode::kGspo) {
    T log_ratio_sum = 0, count = 0;
    for (int64_t i = 0; i < n; ++i) {
      log_ratio_sum += on[i] ? lp[i] - od[i] : T(0);
      count += on[i] ? T(1) : T(0);
    }
    const T s = log_ratio_sum / (count > T(1) ? count : T(1));
    state[0] = s;
    state[1] = 0;
    T pg_sum = 0, clipped = 0;
    for (int64_t i = 0; i < n; ++i) {
      const GspoTerm<T> t = gspo_term(s, lp[i], ad[i], bounds.ratio_low, bounds.ratio_high);
      const T weighted = t.pg * (w ? w[i] : T(1));
      pg_sum += on[i] ? weighted : T(0);
      clipped += on[i] ? t.is_clipped : T(0);
    }
    acc[kPgSum] = pg_sum;
    acc[kCount] = count;
    acc[kClipfrac] = clipped;
    acc[kClipfracLower] = 0;
    acc[kKlSum] = -log_ratio_sum;
  } else {
    T kept_sum = 0, adv_sum = 0, log_w_sum = 0, count = 0, clip_high = 0, clip_low = 0, kl_sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const GeoTerm<T> t = geo_term(lp[i], od[i], ad[i], low, high);
      kept_sum += on[i] ? t.kept : T(0);
      adv_sum += on[i] ? ad[i] : T(0);
      if (w) log_w_sum += on[i] ? std::log(w[i] + T(1e-10)) : T(0);
      count += on[i] ? T(1) : T(0);
      clip_high += on[i] && ad[i] > T(0) ? t.is_clipped : T(0);
      clip_low += on[i] && ad[i] < T(0) ? t.is_clipped : T(0);
      kl_sum += on[i] ? od[i] - lp[i] : T(0);
    }
    const T row_loss = geo_row(kept_sum, adv_sum, log_w_sum, count, state);
    acc[kPgSum] = row_loss * count;  // every valid token carries the row's loss
    acc[kCount] = count;
    acc[kClipfrac] = clip_high;
    acc[kClipfracLower] = clip_low;
    acc[kKlSum] = kl_sum;
  }
}

// The forward over `layout`'s rows of the flat inputs (the padded [B, T] rows, or cu_seqlens' segments).
template <PolicyMode mode>
SeqForward seq_loss_rows(const SeqInputs& in, const Rows& layout, Agg agg, double eps_low, double eps_high,
                         const at::Tensor& logprobs) {
  const int64_t rows = layout.rows, length = layout.width;
  std::vector<double> partials(rows * kPolicyPartials, 0.0);
  at::Tensor row_scale_out = at::empty({rows}, in.logp.options());
  at::Tensor row_state = at::empty({rows, kRowState}, in.logp.options());

  const double loss = with_compute_type(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T *lp = in.logp.const_data_ptr<T>(), *od = in.old.const_data_ptr<T>(), *ad = in.adv.const_data_ptr<T>();
    const T* w = in.weights.defined() ? in.weights.const_data_ptr<T>() : nullptr;
    const bool* on = in.valid.const_data_ptr<bool>();
    T* state = row_state.mutable_data_ptr<T>();
    at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t o = layout.offset(b);
        seq_row_forward<mode>(lp + o, od + o, ad + o, w ? w + o : nullptr, on + o, layout.size(b), eps_low, eps_high,
                              &partials[b * kPolicyPartials], state + b * kRowState);
      }
    });
    // The aggregation (reference.aggregate) in row order.
    double total_count = 0.0, nonempty = 0.0;
    for (int64_t b = 0; b < rows; ++b) {
      total_count += partials[b * kPolicyPartials + kCount];
      nonempty += partials[b * kPolicyPartials + kCount] > 0.0 ? 1.0 : 0.0;
    }
    T* scale_out = row_scale_out.mutable_data_ptr<T>();
    double total = 0.0;
    for (int64_t b = 0; b < rows; ++b) {
      const double count = partials[b * kPolicyPartials + kCount];
      const double scale = row_scale(agg, count, total_count, nonempty, length);
      total += scale * partials[b * kPolicyPartials + kPgSum];
      // GMPO's backward differentiates the row loss, which each of the row's tokens carries.
      scale_out[b] = static_cast<T>(mode == PolicyMode::kGeoMean ? scale * count : scale);
    }
    return total;
  });

  double sums[kPolicyPartials] = {};
  for (int64_t b = 0; b < rows; ++b)
    for (int k = 0; k < kPolicyPartials; ++k) sums[k] += partials[b * kPolicyPartials + k];
  auto scalar = [&](double v, at::ScalarType dtype) { return scalar_result(v, logprobs.options(), dtype); };
  return {scalar(loss, in.dtype),
          scalar(safe_mean(sums[kClipfrac], sums[kCount]), at::kFloat),
          scalar(safe_mean(sums[kClipfracLower], sums[kCount]), at::kFloat),
          scalar(safe_mean(sums[kKlSum], sums[kCount]), in.dtype),
          row_scale_out,
          row_state};
}

// The backward over `layout`'s rows of the flat inputs (as seq_loss_rows): gradients in the compute
// dtype, then in each input's dtype.
template <PolicyMode mode>
SeqGrads seq_loss_backward_rows(const char* op, const at::Tensor& grad_loss, const SeqInputs& in, const Rows& layout,
                                const SeqLike& like, const at::Tensor& row_scale_in, const at::Tensor& row_state_in,
                                double eps_low, double eps_high, std::array<bool, 4> output_mask) {
  const int64_t rows = layout.rows, length = layout.width;
  check_seq_backward(op, grad_loss, like, row_scale_in, row_state_in, rows);
  const at::Tensor scales = row_scale_in.to(in.dtype).contiguous(), states = row_state_in.to(in.dtype).contiguous();
  const double upstream = grad_loss.item<double>();  // a CPU tensor: no device sync
  const SeqWants want = seq_wants(mode, output_mask, in.weights.defined());
  at::Tensor g_lp = grad_like(like.logprobs, want.logp || want.old, in.dtype),
             g_ad = grad_like(like.advantages, want.adv, in.dtype);
  at::Tensor g_w = want.weights ? grad_like(*like.weights, true, in.dtype) : at::Tensor();

  with_compute_type(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T *lp = in.logp.const_data_ptr<T>(), *od = in.old.const_data_ptr<T>(), *ad = in.adv.const_data_ptr<T>();
    const T* w = in.weights.defined() ? in.weights.const_data_ptr<T>() : nullptr;
    const bool* on = in.valid.const_data_ptr<bool>();
    const T *scale = scales.const_data_ptr<T>(), *state = states.const_data_ptr<T>();
    T* out_lp = g_lp.numel() ? g_lp.mutable_data_ptr<T>() : nullptr;
    T* out_ad = g_ad.numel() ? g_ad.mutable_data_ptr<T>() : nullptr;
    T* out_w = g_w.defined() && g_w.numel() ? g_w.mutable_data_ptr<T>() : nullptr;
    const T low = static_cast<T>(eps_low), high = static_cast<T>(eps_high);
    const PolicyBounds<T> bounds = clip_bounds<T>(eps_low, eps_high);
    at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const T g_row = static_cast<T>(upstream) * scale[b];
        const T* st = state + b * kRowState;
        for (int64_t i = layout.offset(b); i < layout.offset(b) + layout.size(b); ++i) {
          const T wi = w ? w[i] : T(1);
          T d_lp, d_ad, d_w;
          if constexpr (mode == PolicyMode::kGspo) {
            const GspoTerm<T> t = gspo_term(st[0], lp[i], ad[i], bounds.ratio_low, bounds.ratio_high);
            const PolicyGrad<T> g = gspo_grad(t, bounds.ratio_low, bounds.ratio_high, g_row * wi);
            d_lp = g.logp, d_ad = g.adv, d_w = g_row * t.pg;
          } else {
            const GeoTerm<T> t = geo_term(lp[i], od[i], ad[i], low, high);
            d_lp = geo_kept_grad(t, low, high, g_row * st[0]);
            d_ad = g_row * st[1];
            d_w = w ? g_row * st[0] / (wi + T(1e-10)) : T(0);
          }
          if (out_lp) out_lp[i] = on[i] ? d_lp : T(0);
          if (out_ad) out_ad[i] = on[i] ? d_ad : T(0);
          if (out_w) out_w[i] = on[i] ? d_w : T(0);
        }
      }
    });
  });
  return seq_grads(like, want, g_lp, g_ad, g_w);
}

// SeqLoss's kernels on the CPU: the rows are read on the host (a packed layout's hold its checked cu_seqlens).
struct CpuSeqKernels {
  struct Layout {
    at::Tensor cu;  // the packed layout's int64 cu_seqlens, which rows.cu points into; undefined when padded
    Rows rows;
  };
  static SeqInputs inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                          const at::Tensor& advantages, const at::Tensor& mask,
                          const std::optional<at::Tensor>& weights) {
    return seq_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  }
  static Layout padded(const SeqInputs& in) { return {at::Tensor(), Rows{nullptr, in.rows, in.length}}; }
  static Layout packed(const char* op, const at::Tensor& cu_seqlens, const at::Tensor& logprobs) {
    int64_t longest = 0;
    Layout layout{checked_cu_seqlens(op, cu_seqlens, logprobs.size(0), logprobs, &longest), Rows{}};
    layout.rows = Rows{layout.cu.const_data_ptr<int64_t>(), layout.cu.numel() - 1, longest};
    return layout;
  }
  static void device(const char*, const at::Tensor&) {}
  template <PolicyMode mode>
  static SeqForward forward(const char*, const SeqInputs& in, const Layout& layout, const at::Tensor& logprobs,
                            double eps_low, double eps_high, Agg agg) {
    return seq_loss_rows<mode>(in, layout.rows, agg, eps_low, eps_high, logprobs);
  }
  template <PolicyMode mode>
  static SeqGrads backward(const char* op, const at::Tensor& grad_loss, const SeqInputs& in, const Layout& layout,
                           const SeqLike& like, const at::Tensor& row_scale, const at::Tensor& row_state,
                           double eps_low, double eps_high, std::array<bool, 4> output_mask) {
    return seq_loss_backward_rows<mode>(op, grad_loss, in, layout.rows, like, row_scale, row_state, eps_low, eps_high,
                                        output_mask);
  }
};

template <PolicyMode mode>
using CpuSeqLoss = SeqLoss<CpuSeqKernels, mode>;

}  // namespace

// The sequence-level modes on packed [N] tokens: the same kernels, one row per cu_seqlens segment
// (row_scale and row_state [S]); the aggregation's T is the longest segment.
TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  m.def(
      "policy_loss_gspo_varlen(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, Tensor? weights, "
      "Tensor cu_seqlens, float clip_eps_low, float clip_eps_high, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale, Tensor row_state)");
  m.def(
      "policy_loss_gspo_varlen_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor advantages, "
      "Tensor mask, Tensor? weights, Tensor row_scale, Tensor row_state, Tensor cu_seqlens, float clip_eps_low, "
      "float clip_eps_high, bool[4] output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
  m.def(
      "policy_loss_geo_mean_varlen(Tensor logprobs, Tensor old_logprobs, Tensor advantages, Tensor mask, "
      "Tensor? weights, Tensor cu_seqlens, float clip_eps_low, float clip_eps_high, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor clipfrac_lower, Tensor approx_kl, Tensor row_scale, Tensor row_state)");
  m.def(
      "policy_loss_geo_mean_varlen_backward(Tensor grad_loss, Tensor logprobs, Tensor old_logprobs, Tensor "
      "advantages, Tensor mask, Tensor? weights, Tensor row_scale, Tensor row_state, Tensor cu_seqlens, float "
      "clip_eps_low, float clip_eps_high, bool[4] output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_old_logprobs, Tensor grad_advantages, Tensor grad_weights)");
}

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("policy_loss_gspo_varlen", &CpuSeqLoss<PolicyMode::kGspo>::packed);
  m.impl("policy_loss_gspo_varlen_backward", &CpuSeqLoss<PolicyMode::kGspo>::packed_backward);
  m.impl("policy_loss_geo_mean_varlen", &CpuSeqLoss<PolicyMode::kGeoMean>::packed);
  m.impl("policy_loss_geo_mean_varlen_backward", &CpuSeqLoss<PolicyMode::kGeoMean>::packed_backward);
}

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("clipped_policy_loss", &clipped_policy_loss_cpu);
  m.impl("clipped_policy_loss_backward", &clipped_policy_loss_backward_cpu);
  m.impl("policy_loss_gspo", &CpuSeqLoss<PolicyMode::kGspo>::padded);
  m.impl("policy_loss_gspo_backward", &CpuSeqLoss<PolicyMode::kGspo>::padded_backward);
  m.impl("policy_loss_geo_mean", &CpuSeqLoss<PolicyMode::kGeoMean>::padded);
  m.impl("policy_loss_geo_mean_backward", &CpuSeqLoss<PolicyMode::kGeoMean>::padded_backward);
}

}  // namespace ppo_fast
