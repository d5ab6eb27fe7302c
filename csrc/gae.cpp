// gae: its schemas and CPU kernels, GAE and its backward: rows in parallel, each a
// sequential scan in the reference's dtype (float32, float64 for float64 inputs), each
// gradient in its input's dtype.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/float_io.h"
#include "common/varlen.h"

// No a * b + c fused into an FMA in this file: the scans round each product as the
// reference's separate multiply and add do.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // The backward takes the upstream gradients as optional (an unused output has none) and
  // the inputs' dtypes.
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam) -> (Tensor advantages, Tensor returns)");
  m.def(
      "gae_backward(Tensor? grad_advantages, Tensor? grad_returns, Tensor mask, float gamma, float lam, "
      "ScalarType rewards_dtype, ScalarType values_dtype, bool[2] output_mask) -> (Tensor grad_rewards, Tensor "
      "grad_values)");
}

namespace {

// The forward scan into advantages/returns (allocated by the caller), rows in parallel.
void gae_forward_rows(const at::Tensor& rewards, const at::Tensor& values, const bool* valid_data, const Rows& rows,
                      double gamma, double lam, at::Tensor& advantages, at::Tensor& returns) {
  with_compute_type(advantages.scalar_type(), [&](auto tag) {
    using acc_t = decltype(tag);
    acc_t* adv_data = advantages.mutable_data_ptr<acc_t>();
    acc_t* ret_data = returns.mutable_data_ptr<acc_t>();
    const acc_t gamma_t = static_cast<acc_t>(gamma);
    const acc_t gamma_lam = static_cast<acc_t>(gamma * lam);
    at::parallel_for(0, rows.rows, row_grain(rows.width), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> r(rows.width), v(rows.width);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t offset = rows.offset(b), length = rows.size(b);
        load_as(rewards, offset, length, r.data());
        load_as(values, offset, length, v.data());
        // A masked token is skipped (its reward and value are not read): the next valid
        // value and the running advantage pass through it.
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
}

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards_in, const at::Tensor& values_in,
                                           const at::Tensor& mask, double gamma, double lam) {
  constexpr const char* op = "gae";
  check_float(op, "rewards", rewards_in);
  check_dim(op, "rewards", rewards_in, 2);
  check_float(op, "values", values_in);
  check_same_shape(op, "values", values_in, "rewards", rewards_in);
  check_mask(op, mask, "rewards", rewards_in);
  check_same_device(op, {{"rewards", &rewards_in}, {"values", &values_in}, {"mask", &mask}});
  const int64_t rows = rewards_in.size(0), length = rewards_in.size(1);
  const at::Tensor rewards = rewards_in.contiguous(), values = values_in.contiguous(), valid = mask.contiguous();
  const at::ScalarType dtype = compute_dtype({&rewards, &values});
  at::Tensor advantages = at::empty({rows, length}, rewards.options().dtype(dtype));
  at::Tensor returns = at::empty_like(advantages);
  gae_forward_rows(rewards, values, valid.const_data_ptr<bool>(), Rows{nullptr, rows, length}, gamma, lam, advantages,
                   returns);
  return {advantages, returns};
}

// The backward scan over `rows` of the flat `mask` (contiguous); see gae_backward_cpu.
std::tuple<at::Tensor, at::Tensor> gae_backward_rows(const std::optional<at::Tensor>& grad_advantages_in,
                                                     const std::optional<at::Tensor>& grad_returns_in,
                                                     const at::Tensor& valid, const Rows& rows, double gamma,
                                                     double lam, at::ScalarType rewards_dtype,
                                                     at::ScalarType values_dtype, std::array<bool, 2> output_mask) {
  const bool need_rewards = output_mask[0], need_values = output_mask[1];
  const auto grad_of = [&](at::ScalarType dtype, bool wanted) {
    return at::empty(wanted ? valid.sizes() : at::IntArrayRef{0}, valid.options().dtype(dtype));
  };
  at::Tensor grad_rewards = grad_of(rewards_dtype, need_rewards), grad_values = grad_of(values_dtype, need_values);
  if (!need_rewards && !need_values) return {grad_rewards, grad_values};
  const at::ScalarType dtype = rewards_dtype == at::kDouble || values_dtype == at::kDouble ? at::kDouble : at::kFloat;
  const bool has_adv = grad_advantages_in.has_value(), has_ret = grad_returns_in.has_value();
  const at::Tensor grad_adv = has_adv ? grad_advantages_in->to(dtype).contiguous() : at::Tensor();
  const at::Tensor grad_ret = has_ret ? grad_returns_in->to(dtype).contiguous() : at::Tensor();
  const bool* valid_data = valid.const_data_ptr<bool>();

  with_compute_type(dtype, [&](auto tag) {
    using acc_t = decltype(tag);
    const acc_t* grad_adv_data = has_adv ? grad_adv.const_data_ptr<acc_t>() : nullptr;
    const acc_t* grad_ret_data = has_ret ? grad_ret.const_data_ptr<acc_t>() : nullptr;
    const acc_t gamma_t = static_cast<acc_t>(gamma);
    const acc_t gamma_lam = static_cast<acc_t>(gamma * lam);
    at::parallel_for(0, rows.rows, row_grain(rows.width), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> g_r(rows.width), g_v(rows.width);
      for (int64_t b = begin; b < end; ++b) {
        const int64_t offset = rows.offset(b), length = rows.size(b);
        acc_t previous = 0;  // dL/dA at the previous valid token
        for (int64_t t = 0; t < length; ++t) {
          if (!valid_data[offset + t]) {
            g_r[t] = 0;
            g_v[t] = 0;
            continue;
          }
          const acc_t g_ret = has_ret ? grad_ret_data[offset + t] : acc_t(0);
          const acc_t g_adv = has_adv ? grad_adv_data[offset + t] : acc_t(0);
          const acc_t total = g_adv + g_ret + gamma_lam * previous;
          g_r[t] = total;
          g_v[t] = g_ret - total + gamma_t * previous;
          previous = total;
        }
        if (need_rewards) store_as(grad_rewards, offset, length, g_r.data());
        if (need_values) store_as(grad_values, offset, length, g_v.data());
      }
    });
  });
  return {grad_rewards, grad_values};
}

// The reverse of GAE's reverse scan: one forward scan per row over its valid tokens.
// With A_t the advantage of valid token t and p the previous valid token,
//   dL/dA_t = grad_adv_t + grad_ret_t + gamma lam dL/dA_p,
//   dL/dr_t = dL/dA_t,  dL/dV_t = grad_ret_t - dL/dA_t + gamma dL/dA_p,
// and 0 at masked tokens.  Linear in the upstream gradients: rewards and values are not read.
std::tuple<at::Tensor, at::Tensor> gae_backward_cpu(const std::optional<at::Tensor>& grad_advantages_in,
                                                    const std::optional<at::Tensor>& grad_returns_in,
                                                    const at::Tensor& mask, double gamma, double lam,
                                                    at::ScalarType rewards_dtype, at::ScalarType values_dtype,
                                                    std::array<bool, 2> output_mask) {
  constexpr const char* op = "gae_backward";
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be a bool tensor, got ", mask.scalar_type());
  check_dim(op, "mask", mask, 2);
  TORCH_CHECK(is_float_dtype(rewards_dtype), op, ": rewards_dtype must be a floating dtype, got ", rewards_dtype);
  TORCH_CHECK(is_float_dtype(values_dtype), op, ": values_dtype must be a floating dtype, got ", values_dtype);
  for (const auto& [name, grad] :
       {std::pair{"grad_advantages", &grad_advantages_in}, std::pair{"grad_returns", &grad_returns_in}}) {
    if (!grad->has_value()) continue;
    check_float(op, name, **grad);
    check_same_shape(op, name, **grad, "mask", mask);
    check_same_device(op, {{"mask", &mask}, {name, &**grad}});
  }
  const int64_t rows = mask.size(0), length = mask.size(1);
  return gae_backward_rows(grad_advantages_in, grad_returns_in, mask.contiguous(), Rows{nullptr, rows, length}, gamma,
                           lam, rewards_dtype, values_dtype, output_mask);
}

}  // namespace

// ----------------------------------------------------------------------------- the packed layout
// gae_varlen / gae_varlen_backward: the same scans on packed [N] tokens, one per cu_seqlens
// segment, so each segment's result is the padded layout's row's, bit for bit.

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  m.def(
      "gae_varlen(Tensor rewards, Tensor values, Tensor mask, Tensor cu_seqlens, float gamma, float lam) "
      "-> (Tensor advantages, Tensor returns)");
  m.def(
      "gae_varlen_backward(Tensor? grad_advantages, Tensor? grad_returns, Tensor mask, Tensor cu_seqlens, "
      "float gamma, float lam, ScalarType rewards_dtype, ScalarType values_dtype, bool[2] output_mask) "
      "-> (Tensor grad_rewards, Tensor grad_values)");
}

namespace {

std::tuple<at::Tensor, at::Tensor> gae_varlen_cpu(const at::Tensor& rewards_in, const at::Tensor& values_in,
                                                  const at::Tensor& mask, const at::Tensor& cu_seqlens, double gamma,
                                                  double lam) {
  constexpr const char* op = "gae_varlen";
  check_float(op, "rewards", rewards_in);
  check_dim(op, "rewards", rewards_in, 1);
  check_float(op, "values", values_in);
  check_same_shape(op, "values", values_in, "rewards", rewards_in);
  check_mask(op, mask, "rewards", rewards_in);
  check_same_device(op, {{"rewards", &rewards_in}, {"values", &values_in}, {"mask", &mask}});
  int64_t longest = 0;
  const at::Tensor cu = checked_cu_seqlens(op, cu_seqlens, rewards_in.size(0), rewards_in, &longest);
  const at::Tensor rewards = rewards_in.contiguous(), values = values_in.contiguous(), valid = mask.contiguous();
  at::Tensor advantages = at::empty(rewards.sizes(), rewards.options().dtype(compute_dtype({&rewards, &values})));
  at::Tensor returns = at::empty_like(advantages);
  gae_forward_rows(rewards, values, valid.const_data_ptr<bool>(),
                   Rows{cu.const_data_ptr<int64_t>(), cu.numel() - 1, longest}, gamma, lam, advantages, returns);
  return {advantages, returns};
}

std::tuple<at::Tensor, at::Tensor> gae_varlen_backward_cpu(const std::optional<at::Tensor>& grad_advantages,
                                                           const std::optional<at::Tensor>& grad_returns,
                                                           const at::Tensor& mask, const at::Tensor& cu_seqlens,
                                                           double gamma, double lam, at::ScalarType rewards_dtype,
                                                           at::ScalarType values_dtype,
                                                           std::array<bool, 2> output_mask) {
  constexpr const char* op = "gae_varlen_backward";
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be a bool tensor, got ", mask.scalar_type());
  check_dim(op, "mask", mask, 1);
  TORCH_CHECK(is_float_dtype(rewards_dtype), op, ": rewards_dtype must be a floating dtype, got ", rewards_dtype);
  TORCH_CHECK(is_float_dtype(values_dtype), op, ": values_dtype must be a floating dtype, got ", values_dtype);
  for (const auto& [name, grad] :
       {std::pair{"grad_advantages", &grad_advantages}, std::pair{"grad_returns", &grad_returns}}) {
    if (!grad->has_value()) continue;
    check_float(op, name, **grad);
    check_same_shape(op, name, **grad, "mask", mask);
    check_same_device(op, {{"mask", &mask}, {name, &**grad}});
  }
  int64_t longest = 0;
  const at::Tensor cu = checked_cu_seqlens(op, cu_seqlens, mask.size(0), mask, &longest);
  return gae_backward_rows(grad_advantages, grad_returns, mask.contiguous(),
                           Rows{cu.const_data_ptr<int64_t>(), cu.numel() - 1, longest}, gamma, lam, rewards_dtype,
                           values_dtype, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("gae_varlen", &gae_varlen_cpu);
  m.impl("gae_varlen_backward", &gae_varlen_backward_cpu);
}

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("gae", &gae_cpu);
  m.impl("gae_backward", &gae_backward_cpu);
}

}  // namespace ppo_fast
