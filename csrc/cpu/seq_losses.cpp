// CPU kernels of the sequence-level policy losses, GSPO and GMPO (ppo_fast.reference
// policy_loss_gspo / policy_loss_geo_mean): rows in parallel, each row reduced in token
// order (its sums before its ratio, then its tokens), then a fixed-order reduction over
// the rows, so that the result does not depend on the number of threads.  The inputs are
// read in the compute type (float32, float64 when any is float64); each gradient is
// returned in its input's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <optional>
#include <vector>

#include "checks.h"
#include "contract.h"
#include "cpu/float_io.h"
#include "seq_loss_math.h"

namespace ppo_fast {
namespace {

enum class SeqMode { kGspo, kGeoMean };

// Per-row partial sums of the forward.
enum SeqPartial : int { kSeqPgSum = 0, kSeqCount = 1, kSeqClipHigh = 2, kSeqClipLow = 3, kSeqKlSum = 4, kSeqPartials = 5 };

struct SeqInputs {
  at::Tensor logp, old, adv, weights, valid;  // contiguous, in the compute dtype (weights may be undefined)
  at::ScalarType dtype;
  int64_t rows, length;
};

SeqInputs seq_inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
                     const at::Tensor& mask, const std::optional<at::Tensor>& weights) {
  check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  const at::Tensor w = weights.has_value() ? *weights : at::Tensor();
  const at::ScalarType dtype = compute_dtype({&logprobs, &old_logprobs, &advantages, &w});
  auto as = [&](const at::Tensor& t) { return t.defined() ? t.to(dtype).contiguous() : t; };
  return {as(logprobs), as(old_logprobs), as(advantages), as(w), mask.contiguous(), dtype, logprobs.size(0), logprobs.size(1)};
}

// One row's forward: its partial sums and its state (seq_loss_math.h).
template <SeqMode mode, typename T>
void seq_row_forward(const T* lp, const T* od, const T* ad, const T* w, const bool* on, int64_t n, T eps_low, T eps_high,
                     double* acc, T* state) {
  if constexpr (mode == SeqMode::kGspo) {
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
      const GspoTerm<T> t = gspo_term(s, lp[i], ad[i], T(1) - eps_low, T(1) + eps_high);
      const T weighted = t.pg * (w ? w[i] : T(1));
      pg_sum += on[i] ? weighted : T(0);
      clipped += on[i] ? t.is_clipped : T(0);
    }
    acc[kSeqPgSum] = pg_sum;
    acc[kSeqCount] = count;
    acc[kSeqClipHigh] = clipped;
    acc[kSeqClipLow] = 0;
    acc[kSeqKlSum] = -log_ratio_sum;
  } else {
    T kept_sum = 0, adv_sum = 0, log_w_sum = 0, count = 0, clip_high = 0, clip_low = 0, kl_sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const GeoTerm<T> t = geo_term(lp[i], od[i], ad[i], eps_low, eps_high);
      kept_sum += on[i] ? t.kept : T(0);
      adv_sum += on[i] ? ad[i] : T(0);
      if (w) log_w_sum += on[i] ? std::log(w[i] + T(1e-10)) : T(0);
      count += on[i] ? T(1) : T(0);
      clip_high += on[i] && ad[i] > T(0) ? t.is_clipped : T(0);
      clip_low += on[i] && ad[i] < T(0) ? t.is_clipped : T(0);
      kl_sum += on[i] ? od[i] - lp[i] : T(0);
    }
    const T row_loss = geo_row(kept_sum, adv_sum, log_w_sum, count, state);
    acc[kSeqPgSum] = row_loss * count;  // every valid token carries the row's loss
    acc[kSeqCount] = count;
    acc[kSeqClipHigh] = clip_high;
    acc[kSeqClipLow] = clip_low;
    acc[kSeqKlSum] = kl_sum;
  }
}

template <SeqMode mode>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> seq_loss_cpu(
    const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
    const at::Tensor& mask, const std::optional<at::Tensor>& weights, double eps_low, double eps_high, c10::string_view agg_name) {
  const Agg agg = parse_agg(op, agg_name);
  const SeqInputs in = seq_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = in.rows, length = in.length;
  std::vector<double> partials(rows * kSeqPartials, 0.0);
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
        const int64_t o = b * length;
        seq_row_forward<mode>(lp + o, od + o, ad + o, w ? w + o : nullptr, on + o, length, static_cast<T>(eps_low),
                              static_cast<T>(eps_high), &partials[b * kSeqPartials], state + b * kRowState);
      }
    });
    // The aggregation (reference.aggregate) in row order.
    double total_count = 0.0, nonempty = 0.0;
    for (int64_t b = 0; b < rows; ++b) {
      total_count += partials[b * kSeqPartials + kSeqCount];
      nonempty += partials[b * kSeqPartials + kSeqCount] > 0.0 ? 1.0 : 0.0;
    }
    T* scale_out = row_scale_out.mutable_data_ptr<T>();
    double total = 0.0;
    for (int64_t b = 0; b < rows; ++b) {
      const double count = partials[b * kSeqPartials + kSeqCount];
      const double scale = row_scale(agg, count, total_count, nonempty, length);
      total += scale * partials[b * kSeqPartials + kSeqPgSum];
      // GMPO's backward differentiates the row loss, which each of the row's tokens carries.
      scale_out[b] = static_cast<T>(mode == SeqMode::kGeoMean ? scale * count : scale);
    }
    return total;
  });

  double sums[kSeqPartials] = {};
  for (int64_t b = 0; b < rows; ++b)
    for (int k = 0; k < kSeqPartials; ++k) sums[k] += partials[b * kSeqPartials + k];
  auto scalar = [&](double v, at::ScalarType dtype) { return scalar_result(v, logprobs.options(), dtype); };
  return {scalar(loss, in.dtype), scalar(safe_mean(sums[kSeqClipHigh], sums[kSeqCount]), at::kFloat),
          scalar(safe_mean(sums[kSeqClipLow], sums[kSeqCount]), at::kFloat), scalar(safe_mean(sums[kSeqKlSum], sums[kSeqCount]), in.dtype),
          row_scale_out, row_state};
}

at::Tensor grad_like(const at::Tensor& input, bool wanted, at::ScalarType compute) {
  return wanted ? at::empty(input.sizes(), input.options().dtype(compute)) : at::empty({0}, input.options());
}

// Gradients in the compute dtype, then in each input's dtype.
template <SeqMode mode>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> seq_loss_backward_cpu(
    const char* op, const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights, const at::Tensor& row_scale_in,
    const at::Tensor& row_state_in, double eps_low, double eps_high, std::array<bool, 4> output_mask) {
  const SeqInputs in = seq_inputs(op, logprobs, old_logprobs, advantages, mask, weights);
  const int64_t rows = in.rows, length = in.length;
  check_grad_loss(op, grad_loss);
  check_float(op, "row_scale", row_scale_in);
  check_shape(op, "row_scale", row_scale_in, {rows});
  check_float(op, "row_state", row_state_in);
  check_shape(op, "row_state", row_state_in, {rows, kRowState});
  check_same_device(op, {{"logprobs", &logprobs}, {"grad_loss", &grad_loss}, {"row_scale", &row_scale_in}, {"row_state", &row_state_in}});
  const at::Tensor scales = row_scale_in.to(in.dtype).contiguous(), states = row_state_in.to(in.dtype).contiguous();
  const double upstream = grad_loss.item<double>();  // a CPU tensor: no device sync
  // GSPO passes no gradient to old_logprobs (its sequence ratio is detached).
  const bool need_logp = output_mask[0], need_old = output_mask[1] && mode == SeqMode::kGeoMean;
  const bool need_adv = output_mask[2], need_w = output_mask[3] && in.weights.defined();
  at::Tensor g_lp = grad_like(logprobs, need_logp || need_old, in.dtype), g_ad = grad_like(advantages, need_adv, in.dtype);
  at::Tensor g_w = weights.has_value() ? grad_like(*weights, need_w, in.dtype) : at::empty({0}, logprobs.options());

  with_compute_type(in.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T *lp = in.logp.const_data_ptr<T>(), *od = in.old.const_data_ptr<T>(), *ad = in.adv.const_data_ptr<T>();
    const T* w = in.weights.defined() ? in.weights.const_data_ptr<T>() : nullptr;
    const bool* on = in.valid.const_data_ptr<bool>();
    const T *scale = scales.const_data_ptr<T>(), *state = states.const_data_ptr<T>();
    T* out_lp = g_lp.numel() ? g_lp.mutable_data_ptr<T>() : nullptr;
    T* out_ad = g_ad.numel() ? g_ad.mutable_data_ptr<T>() : nullptr;
    T* out_w = g_w.numel() ? g_w.mutable_data_ptr<T>() : nullptr;
    const T low = static_cast<T>(eps_low), high = static_cast<T>(eps_high);
    at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const T g_row = static_cast<T>(upstream) * scale[b];
        const T* st = state + b * kRowState;
        for (int64_t i = b * length; i < (b + 1) * length; ++i) {
          const T wi = w ? w[i] : T(1);
          T d_lp, d_ad, d_w;
          if constexpr (mode == SeqMode::kGspo) {
            const GspoTerm<T> t = gspo_term(st[0], lp[i], ad[i], T(1) - low, T(1) + high);
            const PolicyGrad<T> g = gspo_grad(t, T(1) - low, T(1) + high, g_row * wi);
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
  // d / d old_logprobs is the negation of d / d logprobs (both through logp - old).
  at::Tensor grad_old = need_old ? (-g_lp).to(old_logprobs.scalar_type()) : at::empty({0}, old_logprobs.options());
  at::Tensor grad_logp = need_logp ? g_lp.to(logprobs.scalar_type()) : at::empty({0}, logprobs.options());
  at::Tensor grad_adv = need_adv ? g_ad.to(advantages.scalar_type()) : g_ad;
  at::Tensor grad_w = need_w ? g_w.to(weights->scalar_type()) : g_w;
  return {grad_logp, grad_old, grad_adv, grad_w};
}

auto gspo_cpu(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
              const std::optional<at::Tensor>& weights, double clip_eps_low, double clip_eps_high, c10::string_view agg) {
  return seq_loss_cpu<SeqMode::kGspo>("policy_loss_gspo", logprobs, old_logprobs, advantages, mask, weights, clip_eps_low,
                                      clip_eps_high, agg);
}
auto geo_mean_cpu(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
                  const std::optional<at::Tensor>& weights, double clip_eps_low, double clip_eps_high, c10::string_view agg) {
  return seq_loss_cpu<SeqMode::kGeoMean>("policy_loss_geo_mean", logprobs, old_logprobs, advantages, mask, weights, clip_eps_low,
                                         clip_eps_high, agg);
}
auto gspo_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                       const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                       const at::Tensor& row_scale, const at::Tensor& row_state, double clip_eps_low, double clip_eps_high,
                       std::array<bool, 4> output_mask) {
  return seq_loss_backward_cpu<SeqMode::kGspo>("policy_loss_gspo_backward", grad_loss, logprobs, old_logprobs, advantages, mask,
                                               weights, row_scale, row_state, clip_eps_low, clip_eps_high, output_mask);
}
auto geo_mean_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                           const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                           const at::Tensor& row_scale, const at::Tensor& row_state, double clip_eps_low, double clip_eps_high,
                           std::array<bool, 4> output_mask) {
  return seq_loss_backward_cpu<SeqMode::kGeoMean>("policy_loss_geo_mean_backward", grad_loss, logprobs, old_logprobs, advantages,
                                                  mask, weights, row_scale, row_state, clip_eps_low, clip_eps_high, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("policy_loss_gspo", &gspo_cpu);
  m.impl("policy_loss_gspo_backward", &gspo_backward_cpu);
  m.impl("policy_loss_geo_mean", &geo_mean_cpu);
  m.impl("policy_loss_geo_mean_backward", &geo_mean_backward_cpu);
}

}  // namespace ppo_fast
