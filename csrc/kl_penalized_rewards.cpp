// kl_estimate and kl_penalized_rewards: their schemas and CPU kernels, and their backwards:
// elementwise in parallel chunks, arithmetic in the reference's dtype (float32, float64 for
// float64 inputs), each gradient in its input's dtype.  The loops run over chunks of tokens
// in the compute type and vectorize (fast_exp, selects instead of branches, the mask read
// as bytes).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "common/fast_exp.h"
#include "common/float_io.h"
#include "common/loss_math.h"  // clamp_of, clamp_grad: torch.clamp and its gradient

// No a * b + c fused into an FMA in this file: the gradients multiply out in the order of
// the reference's autograd (k3's g exp(d) - g) so that they overflow to the same inf or
// NaN, which an FMA would not.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

#include "common/kl_estimators.h"  // after the pragma: its per-token formulas are compiled under it

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // The backward of kl_penalized_rewards takes the upstream gradients as optional (an
  // unused output has none) and the inputs' dtypes.
  m.def("kl_estimate(Tensor logprobs, Tensor ref_logprobs, str kl_estimator) -> Tensor");
  m.def(
      "kl_estimate_backward(Tensor grad_kl, Tensor logprobs, Tensor ref_logprobs, str kl_estimator, bool[2] "
      "output_mask) "
      "-> (Tensor grad_logprobs, Tensor grad_ref_logprobs)");
  m.def(
      "kl_penalized_rewards(Tensor scores, Tensor logprobs, Tensor ref_logprobs, Tensor mask, float kl_coef, "
      "str kl_estimator) -> (Tensor rewards, Tensor kl)");
  m.def(
      "kl_penalized_rewards_backward(Tensor? grad_rewards, Tensor? grad_kl, Tensor logprobs, Tensor ref_logprobs, "
      "Tensor mask, float kl_coef, str kl_estimator, ScalarType scores_dtype, bool[3] output_mask) "
      "-> (Tensor grad_scores, Tensor grad_logprobs, Tensor grad_ref_logprobs)");
}

namespace {

constexpr int64_t kChunk = 256;  // tokens converted to the compute type at a time

// kl[i] = kl_value(lp[i], rf[i]); when penalized, also 0 at masked tokens (on[i] == 0,
// selected away so that the loop stays branch-free) and reward[i] = neg_coef * kl[i].
template <KlEstimator estimator, bool penalized, typename acc_t>
PPO_INLINE void kl_loop(const acc_t* lp, const acc_t* rf, const uint8_t* on, int64_t n, acc_t neg_coef, acc_t* kl,
                        acc_t* reward) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    acc_t value = kl_value<estimator>(lp[i], rf[i]);
    if constexpr (penalized) {
      value = on[i] != 0 ? value : acc_t(0);
      reward[i] = neg_coef * value;
    }
    kl[i] = value;
  }
}

// out[i] = the gradient w.r.t. logp of the KL given upstream g_kl[i] (plus
// neg_coef * g_reward[i] when penalized), 0 at masked tokens when penalized.
template <KlEstimator estimator, bool penalized, typename acc_t>
PPO_INLINE void kl_grad_loop(const acc_t* lp, const acc_t* rf, const acc_t* g_kl, const acc_t* g_reward,
                             const uint8_t* on, int64_t n, acc_t neg_coef, acc_t* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (penalized) {
      const acc_t grad = kl_grad<estimator>(lp[i], rf[i], g_kl[i] + g_reward[i] * neg_coef);
      out[i] = on[i] != 0 ? grad : acc_t(0);
    } else {
      out[i] = kl_grad<estimator>(lp[i], rf[i], g_kl[i]);
    }
  }
}

// One loop per estimator, so that the per-token code has no switch.
template <bool penalized, typename acc_t>
PPO_INLINE void kl_chunk_impl(const acc_t* lp, const acc_t* rf, const uint8_t* on, int64_t n, int64_t estimator,
                              acc_t neg_coef, acc_t* kl, acc_t* reward) {
  with_kl_estimator(KlEstimator(estimator),
                    [&](auto e) { kl_loop<decltype(e)::value, penalized>(lp, rf, on, n, neg_coef, kl, reward); });
}

template <bool penalized, typename acc_t>
PPO_INLINE void kl_grad_chunk_impl(const acc_t* lp, const acc_t* rf, const acc_t* g_kl, const acc_t* g_reward,
                                   const uint8_t* on, int64_t n, int64_t estimator, acc_t neg_coef, acc_t* out) {
  with_kl_estimator(KlEstimator(estimator), [&](auto e) {
    kl_grad_loop<decltype(e)::value, penalized>(lp, rf, g_kl, g_reward, on, n, neg_coef, out);
  });
}

// float32: one clone per CPU kind; float64 (gradcheck) once.
PPO_CPU_CLONES void kl_chunk(const float* lp, const float* rf, int64_t n, int64_t estimator, float* kl) {
  kl_chunk_impl<false, float>(lp, rf, nullptr, n, estimator, 0.0f, kl, nullptr);
}
void kl_chunk(const double* lp, const double* rf, int64_t n, int64_t estimator, double* kl) {
  kl_chunk_impl<false, double>(lp, rf, nullptr, n, estimator, 0.0, kl, nullptr);
}
PPO_CPU_CLONES void penalized_kl_chunk(const float* lp, const float* rf, const uint8_t* on, int64_t n,
                                       int64_t estimator, float neg_coef, float* kl, float* reward) {
  kl_chunk_impl<true>(lp, rf, on, n, estimator, neg_coef, kl, reward);
}
void penalized_kl_chunk(const double* lp, const double* rf, const uint8_t* on, int64_t n, int64_t estimator,
                        double neg_coef, double* kl, double* reward) {
  kl_chunk_impl<true>(lp, rf, on, n, estimator, neg_coef, kl, reward);
}
PPO_CPU_CLONES void kl_grad_chunk(const float* lp, const float* rf, const float* g_kl, int64_t n, int64_t estimator,
                                  float* out) {
  kl_grad_chunk_impl<false, float>(lp, rf, g_kl, nullptr, nullptr, n, estimator, 0.0f, out);
}
void kl_grad_chunk(const double* lp, const double* rf, const double* g_kl, int64_t n, int64_t estimator, double* out) {
  kl_grad_chunk_impl<false, double>(lp, rf, g_kl, nullptr, nullptr, n, estimator, 0.0, out);
}
PPO_CPU_CLONES void penalized_kl_grad_chunk(const float* lp, const float* rf, const float* g_kl, const float* g_reward,
                                            const uint8_t* on, int64_t n, int64_t estimator, float neg_coef,
                                            float* out) {
  kl_grad_chunk_impl<true>(lp, rf, g_kl, g_reward, on, n, estimator, neg_coef, out);
}
void penalized_kl_grad_chunk(const double* lp, const double* rf, const double* g_kl, const double* g_reward,
                             const uint8_t* on, int64_t n, int64_t estimator, double neg_coef, double* out) {
  kl_grad_chunk_impl<true>(lp, rf, g_kl, g_reward, on, n, estimator, neg_coef, out);
}

// dst = -src into t (t's dtype) at offset, through scratch when t is not in the compute type.
template <typename acc_t>
void store_negated(const at::Tensor& t, int64_t offset, int64_t n, const acc_t* src, acc_t* scratch) {
  acc_t* out = chunk_out(t, offset, scratch);
  for (int64_t i = 0; i < n; ++i) out[i] = -src[i];
  store_chunk(t, offset, n, out, scratch);
}

// ----------------------------------------------------------------------------- kl_estimate

void check_kl_inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& ref_logprobs) {
  check_float(op, "logprobs", logprobs);
  check_float(op, "ref_logprobs", ref_logprobs);
  check_same_shape(op, "ref_logprobs", ref_logprobs, "logprobs", logprobs);
  check_same_device(op, {{"logprobs", &logprobs}, {"ref_logprobs", &ref_logprobs}});
}

at::Tensor kl_estimate_cpu(const at::Tensor& logprobs, const at::Tensor& ref_logprobs,
                           c10::string_view kl_estimator_name) {
  const KlEstimator estimator = parse_kl_estimator("kl_estimate", kl_estimator_name);
  check_kl_inputs("kl_estimate", logprobs, ref_logprobs);
  const at::Tensor logp = logprobs.contiguous(), ref = ref_logprobs.contiguous();
  const at::ScalarType dtype = compute_dtype({&logp, &ref});
  at::Tensor kl = at::empty(logp.sizes(), logp.options().dtype(dtype));
  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    acc_t* out = kl.mutable_data_ptr<acc_t>();
    at::parallel_for(0, logp.numel(), int64_t{1} << 15, [&](int64_t begin, int64_t end) {
      acc_t scratch[2][kChunk];
      for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
        const int64_t n = std::min(kChunk, end - c0);
        kl_chunk(chunk_in(logp, c0, n, scratch[0]), chunk_in(ref, c0, n, scratch[1]), n, estimator, out + c0);
      }
    });
  });
  return kl;
}

std::tuple<at::Tensor, at::Tensor> kl_estimate_backward_cpu(const at::Tensor& grad_kl, const at::Tensor& logprobs,
                                                            const at::Tensor& ref_logprobs,
                                                            c10::string_view kl_estimator_name,
                                                            std::array<bool, 2> output_mask) {
  constexpr const char* op = "kl_estimate_backward";
  const KlEstimator estimator = parse_kl_estimator(op, kl_estimator_name);
  check_kl_inputs(op, logprobs, ref_logprobs);
  check_float(op, "grad_kl", grad_kl);
  check_same_shape(op, "grad_kl", grad_kl, "logprobs", logprobs);
  check_same_device(op, {{"logprobs", &logprobs}, {"grad_kl", &grad_kl}});
  const bool need_logp = output_mask[0], need_ref = output_mask[1];
  at::Tensor grad_logp = grad_like(logprobs, need_logp), grad_ref = grad_like(ref_logprobs, need_ref);
  if (!need_logp && !need_ref) return {grad_logp, grad_ref};
  const at::Tensor logp = logprobs.contiguous(), ref = ref_logprobs.contiguous();
  const at::ScalarType dtype = compute_dtype({&logp, &ref});
  const at::Tensor grad = grad_kl.contiguous();
  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    at::parallel_for(0, logp.numel(), int64_t{1} << 15, [&](int64_t begin, int64_t end) {
      acc_t scratch[5][kChunk];
      for (int64_t c0 = begin; c0 < end; c0 += kChunk) {
        const int64_t n = std::min(kChunk, end - c0);
        acc_t* out = need_logp ? chunk_out(grad_logp, c0, scratch[3]) : scratch[3];
        kl_grad_chunk(chunk_in(logp, c0, n, scratch[0]), chunk_in(ref, c0, n, scratch[1]),
                      chunk_in(grad, c0, n, scratch[2]), n, estimator, out);
        if (need_logp) store_chunk(grad_logp, c0, n, out, scratch[3]);
        if (need_ref) store_negated(grad_ref, c0, n, out, scratch[4]);
      }
    });
  });
  return {grad_logp, grad_ref};
}

// ----------------------------------------------------------------------------- kl_penalized_rewards

void check_penalized_inputs(const char* op, const at::Tensor& logprobs, const at::Tensor& ref_logprobs,
                            const at::Tensor& mask) {
  check_float(op, "logprobs", logprobs);
  check_dim(op, "logprobs", logprobs, 2);
  check_float(op, "ref_logprobs", ref_logprobs);
  check_same_shape(op, "ref_logprobs", ref_logprobs, "logprobs", logprobs);
  check_mask(op, mask, "logprobs", logprobs);
  check_same_device(op, {{"logprobs", &logprobs}, {"ref_logprobs", &ref_logprobs}, {"mask", &mask}});
}

// Index of the last valid token of a row of `length` mask bytes; -1 if none.
int64_t last_valid(const uint8_t* valid, int64_t length) {
  int64_t t = length - 1;
  while (t >= 0 && valid[t] == 0) --t;
  return t;
}

std::tuple<at::Tensor, at::Tensor> kl_penalized_rewards_cpu(const at::Tensor& scores, const at::Tensor& logprobs,
                                                            const at::Tensor& ref_logprobs, const at::Tensor& mask,
                                                            double kl_coef, c10::string_view kl_estimator_name) {
  constexpr const char* op = "kl_penalized_rewards";
  const KlEstimator estimator = parse_kl_estimator(op, kl_estimator_name);
  check_penalized_inputs(op, logprobs, ref_logprobs, mask);
  check_float(op, "scores", scores);
  check_shape(op, "scores", scores, {logprobs.size(0)});
  check_same_device(op, {{"logprobs", &logprobs}, {"scores", &scores}});
  const int64_t rows = logprobs.size(0), length = logprobs.size(1);
  const at::Tensor logp = logprobs.contiguous(), ref = ref_logprobs.contiguous(), valid = mask.contiguous();
  const at::ScalarType dtype = compute_dtype({&logp, &ref});
  const at::Tensor score = scores.to(dtype).contiguous();
  at::Tensor kl = at::empty({rows, length}, logp.options().dtype(dtype));
  at::Tensor rewards = at::empty_like(kl);
  // Bytes: GCC does not vectorize selects on bool loads.
  const uint8_t* valid_data = reinterpret_cast<const uint8_t*>(valid.const_data_ptr<bool>());

  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* score_data = score.const_data_ptr<acc_t>();
    acc_t* kl_data = kl.mutable_data_ptr<acc_t>();
    acc_t* reward_data = rewards.mutable_data_ptr<acc_t>();
    const acc_t neg_coef = static_cast<acc_t>(-kl_coef);
    at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
      acc_t scratch[2][kChunk];
      for (int64_t b = begin; b < end; ++b) {
        const int64_t row = b * length;
        for (int64_t t0 = 0; t0 < length; t0 += kChunk) {
          const int64_t n = std::min(kChunk, length - t0), offset = row + t0;
          penalized_kl_chunk(chunk_in(logp, offset, n, scratch[0]), chunk_in(ref, offset, n, scratch[1]),
                             valid_data + offset, n, estimator, neg_coef, kl_data + offset, reward_data + offset);
        }
        // The score goes to the row's last valid token (none: no score, and the score is not read).
        const int64_t last = last_valid(valid_data + row, length);
        if (last >= 0) reward_data[row + last] += score_data[b];
      }
    });
  });
  return {rewards, kl};
}

// rewards = -kl_coef * kl + score at the last valid token, kl = 0 at masked tokens:
// d / d kl_t = grad_kl_t - kl_coef * grad_rewards_t at valid tokens (0 at masked ones),
// d / d score_b = grad_rewards at row b's last valid token (0 for a row with none).
std::tuple<at::Tensor, at::Tensor, at::Tensor> kl_penalized_rewards_backward_cpu(
    const std::optional<at::Tensor>& grad_rewards_in, const std::optional<at::Tensor>& grad_kl_in,
    const at::Tensor& logprobs, const at::Tensor& ref_logprobs, const at::Tensor& mask, double kl_coef,
    c10::string_view kl_estimator_name, at::ScalarType scores_dtype, std::array<bool, 3> output_mask) {
  constexpr const char* op = "kl_penalized_rewards_backward";
  const KlEstimator estimator = parse_kl_estimator(op, kl_estimator_name);
  check_penalized_inputs(op, logprobs, ref_logprobs, mask);
  TORCH_CHECK(is_float_dtype(scores_dtype), op, ": scores_dtype must be a floating dtype, got ", scores_dtype);
  for (const auto& [name, grad] : {std::pair{"grad_rewards", &grad_rewards_in}, std::pair{"grad_kl", &grad_kl_in}}) {
    if (!grad->has_value()) continue;
    check_float(op, name, **grad);
    check_same_shape(op, name, **grad, "logprobs", logprobs);
    check_same_device(op, {{"logprobs", &logprobs}, {name, &**grad}});
  }
  const int64_t rows = logprobs.size(0), length = logprobs.size(1);
  const bool need_scores = output_mask[0], need_logp = output_mask[1], need_ref = output_mask[2];
  at::Tensor grad_scores = at::empty({need_scores ? rows : 0}, logprobs.options().dtype(scores_dtype));
  at::Tensor grad_logp = grad_like(logprobs, need_logp), grad_ref = grad_like(ref_logprobs, need_ref);
  const bool has_reward_grad = grad_rewards_in.has_value(), has_kl_grad = grad_kl_in.has_value();
  if (!has_reward_grad && !has_kl_grad) {
    grad_scores.zero_(), grad_logp.zero_(), grad_ref.zero_();
    return {grad_scores, grad_logp, grad_ref};
  }
  const at::Tensor logp = logprobs.contiguous(), ref = ref_logprobs.contiguous(), valid = mask.contiguous();
  const at::ScalarType dtype = compute_dtype({&logp, &ref});
  const at::Tensor grad_rewards = has_reward_grad ? grad_rewards_in->to(dtype).contiguous() : at::Tensor();
  const at::Tensor grad_kl = has_kl_grad ? grad_kl_in->contiguous() : at::Tensor();
  const uint8_t* valid_data = reinterpret_cast<const uint8_t*>(valid.const_data_ptr<bool>());

  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* grad_rewards_data = has_reward_grad ? grad_rewards.const_data_ptr<acc_t>() : nullptr;
    std::vector<acc_t> score_grads(need_scores ? rows : 0);
    const acc_t neg_coef = static_cast<acc_t>(-kl_coef);
    at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
      acc_t scratch[5][kChunk];
      acc_t zeros[kChunk] = {};
      for (int64_t b = begin; b < end; ++b) {
        const int64_t row = b * length;
        if (need_scores) {
          const int64_t last = last_valid(valid_data + row, length);
          score_grads[b] = last >= 0 && has_reward_grad ? grad_rewards_data[row + last] : acc_t(0);
        }
        if (!need_logp && !need_ref) continue;
        for (int64_t t0 = 0; t0 < length; t0 += kChunk) {
          const int64_t n = std::min(kChunk, length - t0), offset = row + t0;
          const acc_t* g_kl = has_kl_grad ? chunk_in(grad_kl, offset, n, scratch[2]) : zeros;
          const acc_t* g_reward = has_reward_grad ? grad_rewards_data + offset : zeros;
          acc_t* out = need_logp ? chunk_out(grad_logp, offset, scratch[3]) : scratch[3];
          penalized_kl_grad_chunk(chunk_in(logp, offset, n, scratch[0]), chunk_in(ref, offset, n, scratch[1]), g_kl,
                                  g_reward, valid_data + offset, n, estimator, neg_coef, out);
          if (need_logp) store_chunk(grad_logp, offset, n, out, scratch[3]);
          if (need_ref) store_negated(grad_ref, offset, n, out, scratch[4]);
        }
      }
    });
    if (need_scores) store_as(grad_scores, 0, rows, score_grads.data());
  });
  return {grad_scores, grad_logp, grad_ref};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("kl_estimate", &kl_estimate_cpu);
  m.impl("kl_estimate_backward", &kl_estimate_backward_cpu);
  m.impl("kl_penalized_rewards", &kl_penalized_rewards_cpu);
  m.impl("kl_penalized_rewards_backward", &kl_penalized_rewards_backward_cpu);
}

}  // namespace ppo_fast
