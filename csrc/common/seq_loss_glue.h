// The torch glue the CPU and the CUDA sequence-level policy losses (GSPO, GMPO: csrc/policy_loss.cpp,
// csrc/cuda/policy_loss.cpp) share around their kernels: the packed layout's [N] inputs as one [1, N]
// row, a backward's checks of row_scale and row_state, which gradients it computes and their dtypes,
// and the four kernels each registers per mode (SeqLoss).
// Host code on ATen alone (no torch/extension.h); the .cu files do not include it.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

#include "common/checks.h"
#include "common/contract.h"
#include "common/float_io.h"
#include "common/seq_loss_math.h"

namespace ppo_fast {

// The packed layout's 1-D [N] inputs viewed as one [1, N] row, so that they are checked and laid out
// as the padded [B, T] inputs are: `make(op, logprobs, old_logprobs, advantages, mask, weights)` gets
// the rows (a caller's rows are then cu_seqlens' segments of it).
template <typename Make>
auto on_one_row(const char* op, const at::Tensor& logprobs, const at::Tensor& old_logprobs,
                const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                Make&& make) {
  check_dim(op, "logprobs", logprobs, 1);
  const auto row = [](const at::Tensor& t) { return t.dim() == 1 ? t.unsqueeze(0) : t; };
  const std::optional<at::Tensor> w = weights.has_value() ? std::optional<at::Tensor>(row(*weights)) : std::nullopt;
  return make(op, row(logprobs), row(old_logprobs), row(advantages), row(mask), w);
}

// A backward's inputs as given (not the kernels' buffers): the gradients take their shapes and dtypes.
struct SeqLike {
  const at::Tensor &logprobs, &old_logprobs, &advantages;
  const std::optional<at::Tensor>& weights;
};

// The checks of a backward's grad_loss, row_scale [rows] and row_state [rows, kRowState] (the forward's).
inline void check_seq_backward(const char* op, const at::Tensor& grad_loss, const SeqLike& like,
                               const at::Tensor& row_scale, const at::Tensor& row_state, int64_t rows) {
  check_grad_loss(op, grad_loss);
  check_float(op, "row_scale", row_scale);
  check_shape(op, "row_scale", row_scale, {rows});
  check_float(op, "row_state", row_state);
  check_shape(op, "row_state", row_state, {rows, kRowState});
  check_same_device(
      op,
      {{"logprobs", &like.logprobs}, {"grad_loss", &grad_loss}, {"row_scale", &row_scale}, {"row_state", &row_state}});
}

// The gradients a backward computes, from its output_mask: GSPO passes none to old_logprobs (its
// sequence ratio is detached); none to weights that were not given.
struct SeqWants {
  bool logp, old, adv, weights;
};

inline SeqWants seq_wants(PolicyMode mode, std::array<bool, 4> output_mask, bool has_weights) {
  return {output_mask[0], output_mask[1] && mode == PolicyMode::kGeoMean, output_mask[2],
          output_mask[3] && has_weights};
}

using SeqGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The gradients as a backward returns them, each in its input's dtype (an empty tensor where not
// wanted), from the kernel's in the compute dtype: g_lp is d / d logprobs, and d / d old_logprobs is
// its negation (both through logp - old); g_ad and g_w are read only where wanted.
inline SeqGrads seq_grads(const SeqLike& like, const SeqWants& want, const at::Tensor& g_lp, const at::Tensor& g_ad,
                          const at::Tensor& g_w) {
  const auto in_dtype = [](const at::Tensor& g, bool wanted, const at::Tensor& input) {
    return wanted ? g.to(input.scalar_type()) : grad_like(input, false);
  };
  return {in_dtype(g_lp, want.logp, like.logprobs),
          want.old ? (-g_lp).to(like.old_logprobs.scalar_type()) : grad_like(like.old_logprobs, false),
          in_dtype(g_ad, want.adv, like.advantages),
          like.weights.has_value() ? in_dtype(g_w, want.weights, *like.weights) : grad_like(like.logprobs, false)};
}

using SeqForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The kernels a backend registers for `mode` (the ops' schema signatures: padded and packed, forward
// and backward), the same steps on both backends: the op's name, its checked inputs (`Kernels::inputs`,
// the packed ones as one row), the rows (`padded`, or `packed`: cu_seqlens' segments, checked before
// the device), the device (`device`), then the backend's `forward` or `backward` over the rows.
template <typename Kernels, PolicyMode mode>
struct SeqLoss {
  static SeqForward padded(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
                           const at::Tensor& mask, const std::optional<at::Tensor>& weights, double eps_low,
                           double eps_high, c10::string_view agg) {
    const char* op = seq_loss_op_name(mode);
    const Agg parsed = parse_agg(op, agg);
    const auto in = Kernels::inputs(op, logprobs, old_logprobs, advantages, mask, weights);
    Kernels::device(op, logprobs);
    return Kernels::template forward<mode>(op, in, Kernels::padded(in), logprobs, eps_low, eps_high, parsed);
  }

  static SeqForward packed(const at::Tensor& logprobs, const at::Tensor& old_logprobs, const at::Tensor& advantages,
                           const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                           const at::Tensor& cu_seqlens, double eps_low, double eps_high, c10::string_view agg) {
    const char* op = seq_loss_varlen_op_name(mode);
    const Agg parsed = parse_agg(op, agg);
    const auto in = on_one_row(op, logprobs, old_logprobs, advantages, mask, weights, Kernels::inputs);
    const auto rows = Kernels::packed(op, cu_seqlens, logprobs);
    Kernels::device(op, logprobs);
    return Kernels::template forward<mode>(op, in, rows, logprobs, eps_low, eps_high, parsed);
  }

  static SeqGrads padded_backward(const at::Tensor& grad_loss, const at::Tensor& logprobs,
                                  const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
                                  const std::optional<at::Tensor>& weights, const at::Tensor& row_scale,
                                  const at::Tensor& row_state, double eps_low, double eps_high,
                                  std::array<bool, 4> output_mask) {
    const char* op = seq_loss_backward_op_name(mode);
    const auto in = Kernels::inputs(op, logprobs, old_logprobs, advantages, mask, weights);
    return Kernels::template backward<mode>(op, grad_loss, in, Kernels::padded(in),
                                            {logprobs, old_logprobs, advantages, weights}, row_scale, row_state,
                                            eps_low, eps_high, output_mask);
  }

  static SeqGrads packed_backward(const at::Tensor& grad_loss, const at::Tensor& logprobs,
                                  const at::Tensor& old_logprobs, const at::Tensor& advantages, const at::Tensor& mask,
                                  const std::optional<at::Tensor>& weights, const at::Tensor& row_scale,
                                  const at::Tensor& row_state, const at::Tensor& cu_seqlens, double eps_low,
                                  double eps_high, std::array<bool, 4> output_mask) {
    const char* op = seq_loss_varlen_backward_op_name(mode);
    const auto in = on_one_row(op, logprobs, old_logprobs, advantages, mask, weights, Kernels::inputs);
    return Kernels::template backward<mode>(op, grad_loss, in, Kernels::packed(op, cu_seqlens, logprobs),
                                            {logprobs, old_logprobs, advantages, weights}, row_scale, row_state,
                                            eps_low, eps_high, output_mask);
  }
};

}  // namespace ppo_fast
