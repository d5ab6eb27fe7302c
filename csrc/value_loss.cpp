// value_loss: its schemas and CPU kernels.  One pass over the tokens of each row (rows in
// parallel) into per-row partial sums, then a fixed-order reduction over the rows, so the
// result does not depend on the number of threads.  The backward gives the gradient of
// every input that asks for one (output_mask), each in its input's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "common/checks.h"
#include "common/contract.h"
#include "common/fast_exp.h"
#include "common/float_io.h"
#include "common/loss_math.h"
#include "common/loss_rows.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // `row_scale` [B] is d loss / d row sum, kept for the backward.
  m.def(
      "value_loss(Tensor values, Tensor old_values, Tensor returns, Tensor mask, float clip, str agg) "
      "-> (Tensor loss, Tensor clipfrac, Tensor row_scale)");
  m.def(
      "value_loss_backward(Tensor grad_loss, Tensor values, Tensor old_values, Tensor returns, Tensor mask, "
      "Tensor row_scale, float clip, bool[3] output_mask) "
      "-> (Tensor grad_values, Tensor grad_old_values, Tensor grad_returns)");
}

namespace {

// The hot loops over a chunk of n tokens, in the compute type (float, or double for
// float64 inputs).  Masked tokens are selected away (not skipped: after the math, so
// that NaN/inf there never reaches a result), and the bool mask is read as bytes (GCC
// does not vectorize selects on bool loads), so that they vectorize.  The forward writes
// each chunk's masked per-token terms to a buffer (a loop that vectorizes as the
// gradient loops do), then sums each term with lane_sum.

// n <= kLossChunk.
template <typename acc_t>
PPO_INLINE void value_sums_impl(const acc_t* vs, const acc_t* od, const acc_t* rs, const uint8_t* on, int64_t n,
                                double clip, double* acc) {
  const acc_t clip_t = static_cast<acc_t>(clip);
  acc_t terms[kValuePartials][kLossChunk];
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
                                     double clip, acc_t upstream, acc_t* __restrict g_v, acc_t* __restrict g_od,
                                     acc_t* __restrict g_rs) {
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
PPO_CPU_CLONES void value_sums(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n,
                               double clip, double* acc) {
  value_sums_impl(vs, od, rs, on, n, clip, acc);
}
void value_sums(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip,
                double* acc) {
  value_sums_impl(vs, od, rs, on, n, clip, acc);
}
PPO_CPU_CLONES void value_grads_v(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n,
                                  double clip, float upstream, float* __restrict g_v) {
  value_grads_v_impl(vs, od, rs, on, n, clip, upstream, g_v);
}
void value_grads_v(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip,
                   double upstream, double* __restrict g_v) {
  value_grads_v_impl(vs, od, rs, on, n, clip, upstream, g_v);
}
PPO_CPU_CLONES void value_grads_all(const float* vs, const float* od, const float* rs, const uint8_t* on, int64_t n,
                                    double clip, float upstream, float* __restrict g_v, float* __restrict g_od,
                                    float* __restrict g_rs) {
  value_grads_all_impl(vs, od, rs, on, n, clip, upstream, g_v, g_od, g_rs);
}
void value_grads_all(const double* vs, const double* od, const double* rs, const uint8_t* on, int64_t n, double clip,
                     double upstream, double* __restrict g_v, double* __restrict g_od, double* __restrict g_rs) {
  value_grads_all_impl(vs, od, rs, on, n, clip, upstream, g_v, g_od, g_rs);
}

struct ValueBuffers {
  at::Tensor v, old, ret, valid;
  at::ScalarType dtype;
  int64_t rows, length;
};

ValueBuffers value_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                           const at::Tensor& returns, const at::Tensor& mask) {
  check_value_inputs(op, values, old_values, returns, mask);
  ValueBuffers b{values.contiguous(), old_values.contiguous(), returns.contiguous(), mask.contiguous(),
                 at::kFloat,          values.size(0),          values.size(1)};
  b.dtype = compute_dtype({&b.v, &b.old, &b.ret});
  return b;
}

using ValueForward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The forward over `layout`'s rows of the flat inputs (the padded rows, or cu_seqlens' segments).
ValueForward value_loss_rows(const ValueBuffers& in, const Rows& layout, Agg agg, double clip,
                             const at::Tensor& values) {
  const int64_t rows = layout.rows, length = layout.width;
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  std::vector<double> partials(rows * kValuePartials, 0.0);
  at::Tensor row_scale_out = at::empty({rows}, values.options().dtype(in.dtype));

  const double loss = with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    for_each_row_chunk(layout, [&](int64_t b, int64_t t0, int64_t n) {
      acc_t scratch[3][kLossChunk];
      const int64_t offset = layout.offset(b) + t0;
      value_sums(chunk_in(in.v, offset, n, scratch[0]), chunk_in(in.old, offset, n, scratch[1]),
                 chunk_in(in.ret, offset, n, scratch[2]), valid + offset, n, clip, &partials[b * kValuePartials]);
    });
    return aggregate_rows(partials.data(), rows, kValuePartials, kValueLossSum, kValueCount, agg, length,
                          row_scale_out.mutable_data_ptr<acc_t>());
  });

  const double* p = partials.data();
  const double clipfrac = safe_mean(column_total(p, rows, kValuePartials, kValueClipped),
                                    column_total(p, rows, kValuePartials, kValueCount));
  return {scalar(loss, values, in.dtype), scalar(clipfrac, values, at::kFloat), row_scale_out};
}

ValueForward value_loss_cpu(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                            const at::Tensor& mask, double clip, c10::string_view agg_name) {
  const Agg agg = parse_agg("value_loss", agg_name);
  const ValueBuffers in = value_buffers("value_loss", values, old_values, returns, mask);
  return value_loss_rows(in, Rows{nullptr, in.rows, in.length}, agg, clip, values);
}

// The packed layout's [N] inputs, checked as one [1, N] row.
ValueBuffers value_varlen_buffers(const char* op, const at::Tensor& values, const at::Tensor& old_values,
                                  const at::Tensor& returns, const at::Tensor& mask) {
  check_dim(op, "values", values, 1);
  const auto row = [](const at::Tensor& t) { return t.dim() == 1 ? t.unsqueeze(0) : t; };
  return value_buffers(op, row(values), row(old_values), row(returns), row(mask));
}

ValueForward value_loss_varlen_cpu(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                                   const at::Tensor& mask, const at::Tensor& cu_seqlens, double clip,
                                   c10::string_view agg_name) {
  constexpr const char* op = "value_loss_varlen";
  const Agg agg = parse_agg(op, agg_name);
  const ValueBuffers in = value_varlen_buffers(op, values, old_values, returns, mask);
  int64_t longest = 0;
  const at::Tensor cu = checked_cu_seqlens(op, cu_seqlens, values.size(0), values, &longest);
  return value_loss_rows(in, Rows{cu.const_data_ptr<int64_t>(), cu.numel() - 1, longest}, agg, clip, values);
}

using ValueGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The backward over `layout`'s rows; `scales` [rows] in the compute dtype.
ValueGrads value_loss_backward_rows(const ValueBuffers& in, const Rows& layout, const at::Tensor& scales,
                                    double upstream, double clip, const std::array<const at::Tensor*, 3>& like,
                                    std::array<bool, 3> output_mask) {
  const at::Tensor &values = *like[0], &old_values = *like[1], &returns = *like[2];
  const bool need_v = output_mask[0], need_old = output_mask[1], need_ret = output_mask[2];
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(in.valid.const_data_ptr<bool>());
  at::Tensor grad_v = grad_like(values, need_v), grad_old = grad_like(old_values, need_old);
  at::Tensor grad_ret = grad_like(returns, need_ret);
  if (!(need_v || need_old || need_ret)) return {grad_v, grad_old, grad_ret};

  with_compute_type(in.dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* scale_data = scales.const_data_ptr<acc_t>();
    for_each_row_chunk(layout, [&](int64_t b, int64_t t0, int64_t n) {
      acc_t scratch[6][kLossChunk];
      const int64_t offset = layout.offset(b) + t0;
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

ValueGrads value_loss_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& values, const at::Tensor& old_values,
                                   const at::Tensor& returns, const at::Tensor& mask, const at::Tensor& row_scale_in,
                                   double clip, std::array<bool, 3> output_mask) {
  constexpr const char* op = "value_loss_backward";
  const ValueBuffers in = value_buffers(op, values, old_values, returns, mask);
  const at::Tensor scales = checked_row_scale(op, row_scale_in, values, in.dtype);
  const double upstream = checked_upstream(op, grad_loss, values);
  return value_loss_backward_rows(in, Rows{nullptr, in.rows, in.length}, scales, upstream, clip,
                                  {&values, &old_values, &returns}, output_mask);
}

ValueGrads value_loss_varlen_backward_cpu(const at::Tensor& grad_loss, const at::Tensor& values,
                                          const at::Tensor& old_values, const at::Tensor& returns,
                                          const at::Tensor& mask, const at::Tensor& row_scale_in,
                                          const at::Tensor& cu_seqlens, double clip, std::array<bool, 3> output_mask) {
  constexpr const char* op = "value_loss_varlen_backward";
  const ValueBuffers in = value_varlen_buffers(op, values, old_values, returns, mask);
  int64_t longest = 0;
  const at::Tensor cu = checked_cu_seqlens(op, cu_seqlens, values.size(0), values, &longest);
  check_float(op, "row_scale", row_scale_in);
  check_shape(op, "row_scale", row_scale_in, {cu.numel() - 1});
  check_same_device(op, {{"values", &values}, {"row_scale", &row_scale_in}});
  const at::Tensor scales = row_scale_in.to(in.dtype).contiguous();
  const double upstream = checked_upstream(op, grad_loss, values);
  return value_loss_backward_rows(in, Rows{cu.const_data_ptr<int64_t>(), cu.numel() - 1, longest}, scales, upstream,
                                  clip, {&values, &old_values, &returns}, output_mask);
}

}  // namespace

// value_loss on packed [N] tokens: the same kernels, one row per cu_seqlens segment (row_scale [S]).
TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  m.def(
      "value_loss_varlen(Tensor values, Tensor old_values, Tensor returns, Tensor mask, Tensor cu_seqlens, float clip, "
      "str agg) -> (Tensor loss, Tensor clipfrac, Tensor row_scale)");
  m.def(
      "value_loss_varlen_backward(Tensor grad_loss, Tensor values, Tensor old_values, Tensor returns, Tensor mask, "
      "Tensor row_scale, Tensor cu_seqlens, float clip, bool[3] output_mask) "
      "-> (Tensor grad_values, Tensor grad_old_values, Tensor grad_returns)");
}

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("value_loss_varlen", &value_loss_varlen_cpu);
  m.impl("value_loss_varlen_backward", &value_loss_varlen_backward_cpu);
}

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("value_loss", &value_loss_cpu);
  m.impl("value_loss_backward", &value_loss_backward_cpu);
}

}  // namespace ppo_fast
