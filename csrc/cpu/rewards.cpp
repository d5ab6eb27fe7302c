// CPU kernels of the per-token KL estimate, the KL-penalised rewards and GAE: rows in
// parallel, a sequential scan inside each row, arithmetic in the reference's dtype
// (float32, float64 for float64 inputs).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "cpu/float_io.h"

namespace ppo_fast {
namespace {

// The order of ppo_fast.reference.KL_ESTIMATORS.
enum KlEstimator : int64_t { kK1 = 0, kK2 = 1, kK3 = 2, kAbs = 3 };

// Clamp that keeps NaN (as torch.clamp does).
template <typename T>
T clamp_nan(T x, T low, T high) {
  return x < low ? low : (x > high ? high : x);
}

template <typename T>
T kl_value(T logp, T ref, int64_t estimator) {
  const T log_ratio = logp - ref;
  switch (estimator) {
    case kK1:
      return log_ratio;
    case kK2:
      return T(0.5) * (log_ratio * log_ratio);
    case kAbs:
      return std::abs(log_ratio);
    default: {  // k3; the inner clamp only keeps exp finite for +-inf inputs
      const T d = clamp_nan(-log_ratio, T(-20), T(20));
      return clamp_nan(std::exp(d) - d - T(1), T(-10), T(10));
    }
  }
}

// kl[i] for n contiguous elements starting at offset.
template <typename acc_t>
void kl_chunk(const at::Tensor& logp, const at::Tensor& ref, int64_t offset, int64_t n, int64_t estimator, acc_t* kl,
              std::vector<acc_t>& scratch) {
  scratch.resize(2 * n);
  load_as(logp, offset, n, scratch.data());
  load_as(ref, offset, n, scratch.data() + n);
  for (int64_t i = 0; i < n; ++i) kl[i] = kl_value(scratch[i], scratch[n + i], estimator);
}

at::Tensor kl_estimate_cpu(const at::Tensor& logprobs, const at::Tensor& ref_logprobs, int64_t estimator) {
  const at::Tensor logp = logprobs.contiguous(), ref = ref_logprobs.contiguous();
  const at::ScalarType dtype = compute_dtype({&logp, &ref});
  at::Tensor kl = at::empty(logp.sizes(), logp.options().dtype(dtype));
  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    acc_t* out = kl.mutable_data_ptr<acc_t>();
    at::parallel_for(0, logp.numel(), int64_t{1} << 15, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scratch;
      kl_chunk(logp, ref, begin, end - begin, estimator, out + begin, scratch);
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
  const bool* valid_data = valid.const_data_ptr<bool>();

  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* score_data = score.const_data_ptr<acc_t>();
    acc_t* kl_data = kl.mutable_data_ptr<acc_t>();
    acc_t* reward_data = rewards.mutable_data_ptr<acc_t>();
    const acc_t neg_coef = static_cast<acc_t>(-kl_coef);
    at::parallel_for(0, rows, row_grain(length), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> scratch;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t offset = b * length;
        kl_chunk(logp, ref, offset, length, estimator, kl_data + offset, scratch);
        int64_t last_valid = -1;
        for (int64_t t = 0; t < length; ++t) {
          const bool ok = valid_data[offset + t];
          if (ok) last_valid = t;
          kl_data[offset + t] = ok ? kl_data[offset + t] : acc_t(0);
          reward_data[offset + t] = neg_coef * kl_data[offset + t];
        }
        if (last_valid >= 0) reward_data[offset + last_valid] += score_data[b];
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
