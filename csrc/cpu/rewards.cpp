// CPU kernels of the per-token KL estimate, the KL-penalised rewards and GAE: rows in
// parallel, arithmetic in the reference's dtype (float32, float64 for float64 inputs).
// The KL loops run over chunks of tokens in the compute type and vectorize (fast_exp,
// selects instead of branches, the mask read as bytes); GAE is a sequential scan per row.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/float_io.h"
#include "fast_exp.h"

namespace ppo_fast {
namespace {

constexpr int64_t kChunk = 256;  // tokens converted to the compute type at a time

// The order of ppo_fast.reference.KL_ESTIMATORS.
enum KlEstimator : int64_t { kK1 = 0, kK2 = 1, kK3 = 2, kAbs = 3 };

// Clamp that keeps NaN (as torch.clamp does).
template <typename T>
PPO_INLINE T clamp_nan(T x, T low, T high) {
  return x < low ? low : (x > high ? high : x);
}

template <KlEstimator estimator, typename T>
PPO_INLINE T kl_value(T logp, T ref) {
  const T log_ratio = logp - ref;
  if constexpr (estimator == kK1) return log_ratio;
  if constexpr (estimator == kK2) return T(0.5) * (log_ratio * log_ratio);
  if constexpr (estimator == kAbs) return std::abs(log_ratio);
  // k3; the inner clamp only keeps exp finite for +-inf inputs
  const T d = clamp_nan(-log_ratio, T(-20), T(20));
  return clamp_nan(fast_exp(d) - d - T(1), T(-10), T(10));
}

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

// One loop per estimator, so that the per-token code has no switch.
template <bool penalized, typename acc_t>
PPO_INLINE void kl_chunk_impl(const acc_t* lp, const acc_t* rf, const uint8_t* on, int64_t n, int64_t estimator,
                              acc_t neg_coef, acc_t* kl, acc_t* reward) {
  switch (estimator) {
    case kK1:
      return kl_loop<kK1, penalized>(lp, rf, on, n, neg_coef, kl, reward);
    case kK2:
      return kl_loop<kK2, penalized>(lp, rf, on, n, neg_coef, kl, reward);
    case kAbs:
      return kl_loop<kAbs, penalized>(lp, rf, on, n, neg_coef, kl, reward);
    default:
      return kl_loop<kK3, penalized>(lp, rf, on, n, neg_coef, kl, reward);
  }
}

// float32: one clone per CPU kind; float64 (gradcheck) once.
PPO_CPU_CLONES void kl_chunk(const float* lp, const float* rf, int64_t n, int64_t estimator, float* kl) {
  kl_chunk_impl<false, float>(lp, rf, nullptr, n, estimator, 0.0f, kl, nullptr);
}
void kl_chunk(const double* lp, const double* rf, int64_t n, int64_t estimator, double* kl) {
  kl_chunk_impl<false, double>(lp, rf, nullptr, n, estimator, 0.0, kl, nullptr);
}
PPO_CPU_CLONES void penalized_kl_chunk(const float* lp, const float* rf, const uint8_t* on, int64_t n, int64_t estimator,
                                       float neg_coef, float* kl, float* reward) {
  kl_chunk_impl<true>(lp, rf, on, n, estimator, neg_coef, kl, reward);
}
void penalized_kl_chunk(const double* lp, const double* rf, const uint8_t* on, int64_t n, int64_t estimator,
                        double neg_coef, double* kl, double* reward) {
  kl_chunk_impl<true>(lp, rf, on, n, estimator, neg_coef, kl, reward);
}

at::Tensor kl_estimate_cpu(const at::Tensor& logprobs, const at::Tensor& ref_logprobs, int64_t estimator) {
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

std::tuple<at::Tensor, at::Tensor> kl_penalized_rewards_cpu(const at::Tensor& scores, const at::Tensor& logprobs,
                                                            const at::Tensor& ref_logprobs, const at::Tensor& mask,
                                                            double kl_coef, int64_t estimator) {
  TORCH_CHECK(logprobs.dim() == 2 && mask.scalar_type() == at::kBool, "kl_penalized_rewards: expects [B, T] inputs and a bool mask");
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
        // The score goes to the row's last valid token (none: no score).
        int64_t last_valid = length - 1;
        while (last_valid >= 0 && valid_data[row + last_valid] == 0) --last_valid;
        if (last_valid >= 0) reward_data[row + last_valid] += score_data[b];
      }
    });
  });
  return {rewards, kl};
}

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards_in, const at::Tensor& values_in,
                                           const at::Tensor& mask, double gamma, double lam) {
  TORCH_CHECK(rewards_in.dim() == 2 && mask.scalar_type() == at::kBool, "gae: expects [B, T] inputs and a bool mask");
  const int64_t rows = rewards_in.size(0), length = rewards_in.size(1);
  const at::Tensor rewards = rewards_in.contiguous(), values = values_in.contiguous(), valid = mask.contiguous();
  const at::ScalarType dtype = compute_dtype({&rewards, &values});
  at::Tensor advantages = at::empty({rows, length}, rewards.options().dtype(dtype));
  at::Tensor returns = at::empty_like(advantages);
  const bool* valid_data = valid.const_data_ptr<bool>();

  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    acc_t* adv_data = advantages.mutable_data_ptr<acc_t>();
    acc_t* ret_data = returns.mutable_data_ptr<acc_t>();
    const acc_t gamma_t = static_cast<acc_t>(gamma);
    const acc_t gamma_lam = static_cast<acc_t>(gamma * lam);
    at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> r(length), v(length);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t offset = b * length;
        load_as(rewards, offset, length, r.data());
        load_as(values, offset, length, v.data());
        // A masked token is skipped: the next valid value and the running advantage pass through it.
        acc_t next_value = 0, running = 0;
        for (int64_t t = length - 1; t >= 0; --t) {
          if (!valid_data[offset + t]) {
            adv_data[offset + t] = 0;
            ret_data[offset + t] = 0;
            continue;
          }
          const acc_t delta = r[t] + gamma_t * next_value - v[t];
          running = delta + gamma_lam * running;
          next_value = v[t];
          adv_data[offset + t] = running;
          ret_data[offset + t] = running + v[t];
        }
      }
    });
  });
  return {advantages, returns};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("kl_estimate", &kl_estimate_cpu);
  m.impl("kl_penalized_rewards", &kl_penalized_rewards_cpu);
  m.impl("gae", &gae_cpu);
}

}  // namespace ppo_fast
