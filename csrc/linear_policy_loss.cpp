// linear_policy_loss (the policy loss fused into the LM head): its schema and CPU kernel.  One
// pass over chunks of the used tokens (label in [0, V), not ignore_index): a chunk's logits
// softcap(logit_scale * (h @ W.T + b)) by one BLAS product in a scratch buffer of the compute
// type (float32; float64 for float64 inputs), the vectorised log-softmax rows
// (common/log_softmax_rows.h) give each token's log-prob and entropy, the loss epilogue
// (common/loss_math.h, common/seq_loss_math.h) each token's d loss / d logp, the rows turn into
// d_logits in place and two more products add the chunk's d_hidden and d_weight (three
// products in all, nothing recomputed).  The aggregation's normalisers come from the mask
// before the pass; a sequence-level mode (GSPO) takes chunks of whole sequences, since its
// tokens' gradients need their row's mean log-ratio (a row: a [B, T] row, or with cu_seqlens a packed
// sequence of the one row [1, N]).  The per-token loss math is in double.
// The loss and stats are then reduced in a fixed order (rows in parallel into per-row partial
// sums, then the rows in order), so no result depends on the thread count.  The gradients are
// returned with the loss: the autograd (ppo_fast/backends/native/linear_policy_loss.py) only
// scales them by the incoming gradient.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "common/contract.h"
#include "common/kl_estimators.h"
#include "common/log_softmax_rows.h"
#include "common/loss_math.h"
#include "common/seq_loss_math.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // hidden [B, T, H], weight [V, H], labels [B, T] (ignore_index where mask is False); `params`
  // are the mode's parameters in its order (vanilla: clip_eps_low, clip_eps_high[, dual_clip]).
  // `stats` [6] float64: pg_loss, entropy mean, kl_loss, clipfrac, clipfrac_lower, approx_kl.
  // The gradients (those output_mask asks for, else empty) are d loss / d hidden, weight, bias.
  // cu_seqlens: the packed layout (hidden [1, N, H]), [S + 1] int64 on the CPU: its rows are the
  // sequences [cu_seqlens[s], cu_seqlens[s + 1]) of the one row, and seq-mean-token-sum-norm's T the longest.
  m.def(
      "linear_policy_loss(Tensor hidden, Tensor weight, Tensor labels, Tensor old_logprobs, Tensor advantages, "
      "Tensor mask, Tensor? weights, Tensor? bias, Tensor? ref_logprobs, float temperature, float logit_scale, "
      "float? logit_softcap, int ignore_index, float kl_coef, str kl_estimator, float entropy_coef, str loss_mode, "
      "float[] params, str agg, bool[3] output_mask, Tensor? cu_seqlens=None) "
      "-> (Tensor loss, Tensor stats, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

namespace {

constexpr const char* kOp = "linear_policy_loss";
constexpr int64_t kScratchLogits = int64_t(1) << 23;  // as linear_token_logprobs.cpp: 32 MiB of float32
constexpr int64_t kMinRows = 64;
constexpr int64_t kBlock = 1024;  // soft-cap backward: logits saved at a time
enum StatIndex : int { kPg = 0, kEntropy = 1, kKlLoss = 2, kClip = 3, kClipLow = 4, kApproxKl = 5, kStats = 6 };

PolicyMode parse_mode(c10::string_view name) {
  if (name == "vanilla") return PolicyMode::kVanilla;
  if (name == "gspo") return PolicyMode::kGspo;
  TORCH_CHECK(false, kOp, ": loss_mode must be 'vanilla' or 'gspo' on the native CPU backend, got '", name, "'");
}

// reference.kl_estimate of one token and g * its derivative w.r.t. logp, in double.
double kl_value(KlEstimator estimator, double logp, double ref) {
  return with_kl_estimator(estimator, [&](auto e) { return ppo_fast::kl_value<decltype(e)::value>(logp, ref); });
}

double kl_grad(KlEstimator estimator, double logp, double ref, double g) {
  return with_kl_estimator(estimator, [&](auto e) { return ppo_fast::kl_grad<decltype(e)::value>(logp, ref, g); });
}

struct Problem {
  int64_t rows, length, width, vocab;  // rows: the sequences (packed: cu_seqlens' S)
  PolicyMode mode;
  Agg agg;
  KlEstimator estimator;
  double temperature, logit_scale, kl_coef, entropy_coef;
  std::optional<double> softcap;
  double ratio_low, ratio_high;  // 1 - clip_eps_low, 1 + clip_eps_high
  std::optional<double> dual_clip;
  bool has_ref, has_weights;
  std::vector<int64_t> starts;  // [rows + 1]: row b is the flat tokens [starts[b], starts[b + 1])
  int64_t norm_length = 0;      // T of seq-mean-token-sum-norm

  int64_t start(int64_t b) const { return starts[b]; }
  // The row of flat token r (the last row starting at or before it: empty rows hold no token).
  int64_t row_of(int64_t r) const {
    return static_cast<int64_t>(std::upper_bound(starts.begin(), starts.end(), r) - starts.begin()) - 1;
  }
};

// The rows' bounds: [B, T] rows of T tokens, or the packed sequences of cu_seqlens (checked here).
void set_rows(Problem& p, int64_t batch, const std::optional<at::Tensor>& cu_seqlens) {
  if (!cu_seqlens.has_value()) {
    p.starts.resize(batch + 1);
    for (int64_t b = 0; b <= batch; ++b) p.starts[b] = b * p.length;
    p.rows = batch;
    p.norm_length = p.length;
    return;
  }
  const at::Tensor& cu = *cu_seqlens;
  TORCH_CHECK(cu.device().is_cpu() && cu.scalar_type() == at::kLong && cu.dim() == 1 && cu.numel() >= 1, kOp,
              ": cu_seqlens must be a 1-D int64 CPU tensor [S + 1], got ", cu.scalar_type(), " ", cu.sizes(), " on ",
              cu.device());
  TORCH_CHECK(batch == 1, kOp, ": with cu_seqlens, hidden must be [1, N, H] (the packed tokens), got ", batch, " rows");
  const at::Tensor ends = cu.contiguous();
  const int64_t* e = ends.const_data_ptr<int64_t>();
  p.starts.assign(e, e + ends.numel());
  p.rows = ends.numel() - 1;
  p.norm_length = 0;
  TORCH_CHECK(p.starts.front() == 0 && p.starts.back() == p.length, kOp, ": cu_seqlens must start at 0 and end at ",
              p.length, ", got ", p.starts.front(), " and ", p.starts.back());
  for (int64_t b = 0; b < p.rows; ++b) {
    TORCH_CHECK(p.starts[b + 1] >= p.starts[b], kOp, ": cu_seqlens must be non-decreasing");
    p.norm_length = std::max(p.norm_length, p.starts[b + 1] - p.starts[b]);
  }
}

// The [B, T] loss inputs in double, contiguous (weights and ref 1 / 0 when absent).
struct LossInputs {
  at::Tensor old, adv, weights, ref, mask;
};

void check_args(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& old,
                const at::Tensor& adv, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& ref) {
  check_float(kOp, "hidden", hidden);
  check_dim(kOp, "hidden", hidden, 3);
  check_float(kOp, "weight", weight);
  check_dim(kOp, "weight", weight, 2);
  TORCH_CHECK(weight.size(1) == hidden.size(2) && weight.size(0) > 0, kOp,
              ": weight must be [V, H] with V > 0 and H = hidden.size(2) = ", hidden.size(2), ", got shape ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), kOp, ": weight must have hidden's dtype");
  TORCH_CHECK(labels.scalar_type() == at::kLong, kOp, ": labels must be int64, got ", labels.scalar_type());
  check_shape(kOp, "labels", labels, {hidden.size(0), hidden.size(1)});
  check_same_shape(kOp, "old_logprobs", old, "labels", labels);
  check_policy_inputs(kOp, old, old, adv, mask, weights);
  check_same_device(kOp, {{"hidden", &hidden}, {"weight", &weight}, {"labels", &labels}, {"old_logprobs", &old}});
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == hidden.scalar_type(), kOp, ": bias must have hidden's dtype");
    check_shape(kOp, "bias", *bias, {weight.size(0)});
    check_same_device(kOp, {{"hidden", &hidden}, {"bias", &*bias}});
  }
  if (ref.has_value()) {
    check_float(kOp, "ref_logprobs", *ref);
    check_same_shape(kOp, "ref_logprobs", *ref, "labels", labels);
    check_same_device(kOp, {{"hidden", &hidden}, {"ref_logprobs", &*ref}});
  }
}

// The used tokens of the flattened [B * T] labels (label in [0, V) and not ignore_index).
at::Tensor used_tokens(const at::Tensor& labels, int64_t vocab, int64_t ignore_index) {
  return at::nonzero((labels >= 0) & (labels < vocab) & (labels != ignore_index)).view(-1);
}

// d loss / d (row b's sum of per-token losses) for every row, and 1 / (valid tokens).
std::vector<double> row_scales(const Problem& p, const bool* on, double* token_scale) {
  std::vector<double> counts(p.rows, 0.0);
  double total = 0.0, nonempty = 0.0;
  for (int64_t b = 0; b < p.rows; ++b) {
    for (int64_t i = p.start(b); i < p.start(b + 1); ++i) counts[b] += on[i] ? 1.0 : 0.0;
    total += counts[b];
    nonempty += counts[b] > 0.0 ? 1.0 : 0.0;
  }
  for (int64_t b = 0; b < p.rows; ++b) counts[b] = row_scale(p.agg, counts[b], total, nonempty, p.norm_length);
  *token_scale = 1.0 / std::max(total, 1.0);
  return counts;
}

// GSPO's mean log-ratio of row b over its valid tokens (logp 0 at a valid token the head ignores).
double row_mean_log_ratio(const Problem& p, const double* logp, const LossInputs& in, int64_t b) {
  const bool* on = in.mask.const_data_ptr<bool>();
  const double* od = in.old.const_data_ptr<double>();
  double sum = 0.0, count = 0.0;
  for (int64_t i = p.start(b); i < p.start(b + 1); ++i) {
    sum += on[i] ? logp[i] - od[i] : 0.0;
    count += on[i] ? 1.0 : 0.0;
  }
  return sum / std::max(count, 1.0);
}

// d loss / d logp of token i of row b (the policy loss and the KL term).
double token_grad(const Problem& p, const LossInputs& in, int64_t i, double logp, double seq_log_ratio,
                  double row_scale_b) {
  const double od = in.old.const_data_ptr<double>()[i], ad = in.adv.const_data_ptr<double>()[i];
  const double g = row_scale_b * in.weights.const_data_ptr<double>()[i];
  double grad;
  if (p.mode == PolicyMode::kVanilla) {
    const PolicyBounds<double> bounds{p.ratio_low, p.ratio_high, p.dual_clip.value_or(0.0), p.dual_clip ? 1.0 : 0.0};
    grad = policy_grad(policy_term(logp, od, ad, bounds), bounds, g).logp;
  } else {
    grad = gspo_grad(gspo_term(seq_log_ratio, logp, ad, p.ratio_low, p.ratio_high), p.ratio_low, p.ratio_high, g).logp;
  }
  if (p.has_ref && p.kl_coef != 0.0)
    grad += kl_grad(p.estimator, logp, in.ref.const_data_ptr<double>()[i], p.kl_coef * row_scale_b);
  return grad;
}

struct Grads {
  at::Tensor hidden, weight, bias;  // in the compute type; undefined where not wanted
};

// One chunk of used tokens [c0, c0 + n): logits, log-probs and entropy, then (with gradients
// wanted) d_logits in place and the three products' share.  Rows [b0, b1) hold the chunk's tokens
// (GSPO's chunks are whole rows).
template <typename scalar_t>
void run_chunk(const Problem& p, const at::Tensor& hidden2d, const at::Tensor& weight_c, const at::Tensor& bias_c,
               const at::Tensor& rows, at::Tensor& logits, const int64_t* labels, const LossInputs& in,
               const std::vector<double>& scales, double token_scale, double* logp, double* entropy, Grads& grads) {
  const int64_t n = rows.numel(), vocab = p.vocab;
  const int64_t* row_index = rows.const_data_ptr<int64_t>();
  const at::Tensor h = hidden2d.index_select(0, rows).to(logits.scalar_type());
  if (bias_c.defined()) {
    at::addmm_out(logits, bias_c, h, weight_c.t());
  } else {
    at::mm_out(logits, h, weight_c.t());
  }
  if (p.softcap) {
    logits.mul_(p.logit_scale / *p.softcap).tanh_().mul_(*p.softcap);
  } else if (p.logit_scale != 1.0) {
    logits.mul_(p.logit_scale);
  }
  scalar_t* base = logits.mutable_data_ptr<scalar_t>();
  const scalar_t inv_temp = static_cast<scalar_t>(1.0 / p.temperature);
  std::vector<scalar_t> row_stats(2 * n);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = row_index[i];
      const scalar_t* row = base + i * vocab;
      const RowStats<scalar_t> s = log_softmax_row_stats(row, vocab, inv_temp, true);
      row_stats[2 * i] = s.max;
      row_stats[2 * i + 1] = s.log_sum;
      logp[r] = log_softmax_label_logprob(row[labels[r]], inv_temp, s);
      entropy[r] = s.entropy;
    }
  });
  if (!(grads.hidden.defined() || grads.weight.defined() || grads.bias.defined())) return;
  // GSPO: the mean log-ratio of each row the chunk covers (all of its tokens are in the chunk).
  std::vector<double> seq;
  const int64_t b_first = n ? p.row_of(row_index[0]) : 0, b_last = n ? p.row_of(row_index[n - 1]) : -1;
  if (p.mode == PolicyMode::kGspo) {
    seq.assign(b_last - b_first + 1, 0.0);
    for (int64_t b = b_first; b <= b_last; ++b) seq[b - b_first] = row_mean_log_ratio(p, logp, in, b);
  }
  const scalar_t scale = static_cast<scalar_t>(p.logit_scale), cap = static_cast<scalar_t>(p.softcap.value_or(1.0));
  const double h_entropy = -p.entropy_coef * token_scale;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = row_index[i], b = p.row_of(r);
      const double s = p.mode == PolicyMode::kGspo ? seq[b - b_first] : 0.0;
      const scalar_t g = static_cast<scalar_t>(token_grad(p, in, r, logp[r], s, scales[b])) * inv_temp;
      const scalar_t h_ent = static_cast<scalar_t>(h_entropy) * inv_temp;
      const scalar_t ent = static_cast<scalar_t>(entropy[r]);
      scalar_t* row = base + i * vocab;
      if (!p.softcap) {
        log_softmax_row_grad(row, row, vocab, labels[r], inv_temp, &row_stats[2 * i], g * scale, h_ent * scale, ent);
        continue;
      }
      alignas(64) scalar_t saved[kBlock];
      for (int64_t b0 = 0; b0 < vocab; b0 += kBlock) {
        const int64_t m = std::min(kBlock, vocab - b0);
        scalar_t* block = row + b0;
        std::copy(block, block + m, saved);
        log_softmax_row_grad(block, block, m, labels[r] - b0, inv_temp, &row_stats[2 * i], g, h_ent, ent);
        through_softcap(block, saved, m, scale, cap);
      }
    }
  });
  if (grads.hidden.defined()) grads.hidden.index_copy_(0, rows, at::mm(logits, weight_c));
  if (grads.weight.defined()) grads.weight.addmm_(logits.t(), h);
  if (grads.bias.defined()) grads.bias.add_(logits.sum(0));
}

// The chunks: [start, end) ranges of the used tokens, at most chunk_rows each, whole rows for GSPO
// (at least one row each).
std::vector<std::pair<int64_t, int64_t>> chunks(const Problem& p, const at::Tensor& used, int64_t chunk_rows) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t n = used.numel();
  if (p.mode == PolicyMode::kVanilla) {
    for (int64_t c0 = 0; c0 < n; c0 += chunk_rows) out.push_back({c0, std::min(n, c0 + chunk_rows)});
    return out;
  }
  const int64_t* u = used.const_data_ptr<int64_t>();
  int64_t start = 0;
  while (start < n) {
    int64_t end = start;
    while (end < n) {  // add the next row whole, if it fits (the first row always)
      const int64_t row = p.row_of(u[end]);
      int64_t row_end = end;
      while (row_end < n && u[row_end] < p.start(row + 1)) ++row_end;
      if (end > start && row_end - start > chunk_rows) break;
      end = row_end;
    }
    out.push_back({start, end});
    start = end;
  }
  return out;
}

// The loss and stats from the per-token log-probs and entropies (rows in parallel, then in order).
std::array<double, kStats + 1> reduce(const Problem& p, const LossInputs& in, const double* logp, const double* entropy,
                                      const std::vector<double>& scales, double token_scale) {
  constexpr int kParts = 7;  // pg, entropy, kl loss, clip, clip low, approx kl, count
  std::vector<double> parts(p.rows * kParts, 0.0);
  const bool* on = in.mask.const_data_ptr<bool>();
  const double *od = in.old.const_data_ptr<double>(), *ad = in.adv.const_data_ptr<double>();
  const double *w = in.weights.const_data_ptr<double>(), *rf = in.ref.const_data_ptr<double>();
  const PolicyBounds<double> bounds{p.ratio_low, p.ratio_high, p.dual_clip.value_or(0.0), p.dual_clip ? 1.0 : 0.0};
  at::parallel_for(0, p.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      double* acc = &parts[b * kParts];
      const double s = p.mode == PolicyMode::kGspo ? row_mean_log_ratio(p, logp, in, b) : 0.0;
      for (int64_t i = p.start(b); i < p.start(b + 1); ++i) {
        if (!on[i]) continue;
        if (p.mode == PolicyMode::kVanilla) {
          const PolicyTerm<double> t = policy_term(logp[i], od[i], ad[i], bounds);
          acc[kPg] += t.pg * w[i];
          acc[kClip] += t.is_clipped;
          acc[kClipLow] += t.is_capped;
        } else {
          const GspoTerm<double> t = gspo_term(s, logp[i], ad[i], p.ratio_low, p.ratio_high);
          acc[kPg] += t.pg * w[i];
          acc[kClip] += t.is_clipped;
        }
        acc[kEntropy] += entropy[i];
        if (p.has_ref) acc[kKlLoss] += kl_value(p.estimator, logp[i], rf[i]);
        acc[kApproxKl] += od[i] - logp[i];
        acc[kStats] += 1.0;
      }
    }
  });
  std::array<double, kStats + 1> out{};
  for (int64_t b = 0; b < p.rows; ++b) {
    const double* acc = &parts[b * kParts];
    out[kPg] += scales[b] * acc[kPg];
    out[kKlLoss] += scales[b] * acc[kKlLoss];
    for (int k : {kEntropy, kClip, kClipLow, kApproxKl}) out[k] += acc[k] * token_scale;
  }
  out[kStats] = out[kPg] - p.entropy_coef * out[kEntropy] + (p.has_ref ? p.kl_coef * out[kKlLoss] : 0.0);
  return out;
}

Problem problem(const at::Tensor& hidden, const at::Tensor& weight, double temperature, double logit_scale,
                std::optional<double> logit_softcap, double kl_coef, c10::string_view kl_estimator, double entropy_coef,
                c10::string_view loss_mode, at::ArrayRef<double> params, c10::string_view agg, bool has_ref,
                bool has_weights, const std::optional<at::Tensor>& cu_seqlens) {
  Problem p{hidden.size(0),
            hidden.size(1),
            hidden.size(2),
            weight.size(0),
            parse_mode(loss_mode),
            parse_agg(kOp, agg),
            parse_kl_estimator(kOp, kl_estimator),
            temperature,
            logit_scale,
            kl_coef,
            entropy_coef,
            logit_softcap,
            0.0,
            0.0,
            std::nullopt,
            has_ref,
            has_weights,
            {},
            0};
  set_rows(p, hidden.size(0), cu_seqlens);
  TORCH_CHECK(params.size() == 2 || (p.mode == PolicyMode::kVanilla && params.size() == 3), kOp, ": loss_mode '",
              loss_mode, "' takes clip_eps_low, clip_eps_high", p.mode == PolicyMode::kVanilla ? "[, dual_clip]" : "",
              ", got ", params.size(), " parameters");
  p.ratio_low = 1.0 - params[0];
  p.ratio_high = 1.0 + params[1];
  if (params.size() == 3) p.dual_clip = params[2];
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), kOp, ": temperature must be finite and > 0");
  TORCH_CHECK(logit_scale > 0.0 && std::isfinite(logit_scale), kOp, ": logit_scale must be finite and > 0");
  TORCH_CHECK(!logit_softcap || (*logit_softcap > 0.0 && std::isfinite(*logit_softcap)), kOp,
              ": logit_softcap must be None or finite and > 0");
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_policy_loss_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& old_logprobs,
    const at::Tensor& advantages, const at::Tensor& mask, const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& ref_logprobs, double temperature,
    double logit_scale, std::optional<double> logit_softcap, int64_t ignore_index, double kl_coef,
    c10::string_view kl_estimator, double entropy_coef, c10::string_view loss_mode, at::ArrayRef<double> params,
    c10::string_view agg, std::array<bool, 3> output_mask, const std::optional<at::Tensor>& cu_seqlens) {
  check_args(hidden, weight, labels, old_logprobs, advantages, mask, weights, bias, ref_logprobs);
  const Problem p =
      problem(hidden, weight, temperature, logit_scale, logit_softcap, kl_coef, kl_estimator, entropy_coef, loss_mode,
              params, agg, ref_logprobs.has_value(), weights.has_value(), cu_seqlens);
  const at::ScalarType acc = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto as_double = [](const at::Tensor& t) { return t.to(at::kDouble).contiguous(); };
  const LossInputs in{as_double(old_logprobs), as_double(advantages),
                      weights ? as_double(*weights) : at::ones_like(old_logprobs, at::kDouble),
                      ref_logprobs ? as_double(*ref_logprobs) : at::zeros_like(old_logprobs, at::kDouble),
                      mask.contiguous()};
  const int64_t tokens = hidden.size(0) * p.length;
  const at::Tensor flat_labels = labels.reshape({tokens}).contiguous();
  const at::Tensor used = used_tokens(flat_labels, p.vocab, ignore_index);
  // Log-probs and entropies of every token in double: 0 where the head ignores it, NaN for an out-of-range label.
  at::Tensor logp = at::where(flat_labels == ignore_index, 0.0, std::numeric_limits<double>::quiet_NaN());
  logp = logp.to(at::kDouble).contiguous();
  at::Tensor entropy = logp.clone();
  double token_scale = 1.0;
  const std::vector<double> scales = row_scales(p, in.mask.const_data_ptr<bool>(), &token_scale);
  const auto options = hidden.options().dtype(acc);
  const at::Tensor weight_c = weight.to(acc), bias_c = bias ? bias->to(acc) : at::Tensor();
  Grads grads{output_mask[0] ? at::zeros({tokens, p.width}, options) : at::Tensor(),
              output_mask[1] ? at::zeros({p.vocab, p.width}, options) : at::Tensor(),
              output_mask[2] && bias ? at::zeros({p.vocab}, options) : at::Tensor()};
  const int64_t chunk_rows = std::max(kMinRows, kScratchLogits / p.vocab);
  const auto ranges = chunks(p, used, chunk_rows);
  int64_t widest = 0;
  for (const auto& [c0, c1] : ranges) widest = std::max(widest, c1 - c0);
  if (widest > 0) {
    at::Tensor scratch = at::empty({widest, p.vocab}, options);
    const at::Tensor hidden2d = hidden.reshape({tokens, p.width});
    AT_DISPATCH_FLOATING_TYPES(acc, "linear_policy_loss_cpu", [&] {
      for (const auto& [c0, c1] : ranges) {
        at::Tensor logits = scratch.narrow(0, 0, c1 - c0);
        run_chunk<scalar_t>(p, hidden2d, weight_c, bias_c, used.narrow(0, c0, c1 - c0), logits,
                            flat_labels.const_data_ptr<int64_t>(), in, scales, token_scale,
                            logp.mutable_data_ptr<double>(), entropy.mutable_data_ptr<double>(), grads);
      }
    });
  }
  const auto totals =
      reduce(p, in, logp.const_data_ptr<double>(), entropy.const_data_ptr<double>(), scales, token_scale);
  at::Tensor stats = at::empty({kStats}, hidden.options().dtype(at::kDouble));
  std::copy(totals.begin(), totals.begin() + kStats, stats.mutable_data_ptr<double>());
  // In the input's dtype, but float32 for float16 (_one_pass.stored_dtype): the backward scales it.
  const auto finish = [](const at::Tensor& grad, const at::Tensor& like) {
    const at::ScalarType kept = like.scalar_type() == at::kHalf ? at::kFloat : like.scalar_type();
    return grad.defined() ? grad.to(kept).view(like.sizes()) : at::empty({0}, like.options());
  };
  return {at::scalar_tensor(totals[kStats], hidden.options().dtype(at::kDouble)), stats, finish(grads.hidden, hidden),
          finish(grads.weight, weight), bias ? finish(grads.bias, *bias) : at::empty({0}, hidden.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) { m.impl("linear_policy_loss", &linear_policy_loss_cpu); }

}  // namespace ppo_fast
