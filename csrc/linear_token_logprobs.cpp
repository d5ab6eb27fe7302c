// linear_token_logprobs (a fused LM head): its schemas and CPU kernels.  Log-probs (and entropy) of the
// labels under softcap(logit_scale * (hidden @ weight.T + bias)) / temperature, over chunks
// of rows.  A chunk's logits are formed by one BLAS product in a scratch buffer of the
// compute type (float32; float64 for float64 inputs) of at most kScratchLogits elements,
// then reduced by the vectorised log-softmax rows of csrc/token_logprobs.cpp; the [N, V]
// logits never exist.  The backward recomputes each chunk's logits, turns them into
// d_logits in place and takes three products: d_hidden = d_logits @ W,
// d_weight += d_logits.T @ h, d_bias += column sums.  Only rows whose label is in
// [0, V) other than ignore_index are gathered into the chunks: an ignored row (label == ignore_index) gives 0 and
// an out-of-range one NaN (the contract), and neither is read, so whatever their hidden
// states hold reaches no result and no gradient.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "common/log_softmax_rows.h"

namespace ppo_fast {

TORCH_LIBRARY_FRAGMENT(ppo_fast, m) {
  // Log-probs of labels [N] under softcap(logit_scale * (hidden [N, H] @ weight.T [H, V]
  // + bias)) / temperature, without the [N, V] logits (float? logit_softcap: None for no
  // cap); `entropy` and `stats` as token_logprobs returns them, the truncations too (applied to
  // the softcapped logits / temperature, their threshold on those).
  m.def(
      "linear_token_logprobs(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, float temperature, "
      "float logit_scale, float? logit_softcap, bool return_entropy, int ignore_index, int top_k=0, float top_p=1.0, "
      "float min_p=0.0) -> (Tensor logprobs, Tensor entropy, Tensor stats)");
  m.def(
      "linear_token_logprobs_backward(Tensor? grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor labels, Tensor? bias, Tensor stats, Tensor entropy, float temperature, float logit_scale, "
      "float? logit_softcap, int ignore_index, bool[3] output_mask) "
      "-> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)");
}

namespace {

// Logits per chunk: 32 MiB of float32 (3% of the logits of 8192 tokens x 32k vocabulary),
// but never fewer than kMinRows rows: each product re-packs the whole head, so chunks of a few
// rows cost several times one product (python -m bench linear_head_goal measures it).
constexpr int64_t kScratchLogits = int64_t(1) << 23;
constexpr int64_t kMinRows = 64;
constexpr int64_t kBlock = 1024;  // softcap backward: logits saved at a time (as token_logprobs.cpp's chunks)

struct HeadArgs {
  double temperature, logit_scale;
  std::optional<double> logit_softcap;
  int64_t ignore_index;
};

void check_inputs(const char* op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                  const std::optional<at::Tensor>& bias, const HeadArgs& args) {
  check_float(op, "hidden", hidden);
  check_dim(op, "hidden", hidden, 2);
  check_float(op, "weight", weight);
  check_dim(op, "weight", weight, 2);
  TORCH_CHECK(weight.size(1) == hidden.size(1), op,
              ": weight must be [V, H] with H = hidden.size(1) = ", hidden.size(1), ", got shape ", weight.sizes());
  TORCH_CHECK(weight.size(0) > 0, op, ": weight must have a non-empty vocabulary dim, got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type(), op, ": weight must have hidden's dtype ",
              hidden.scalar_type(), ", got ", weight.scalar_type());
  TORCH_CHECK(at::isIntegralType(labels.scalar_type(), /*includeBool=*/false), op,
              ": labels must be an integer tensor, got ", labels.scalar_type());
  check_shape(op, "labels", labels, {hidden.size(0)});
  check_same_device(op, {{"hidden", &hidden}, {"weight", &weight}, {"labels", &labels}});
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == hidden.scalar_type(), op, ": bias must have hidden's dtype ",
                hidden.scalar_type(), ", got ", bias->scalar_type());
    check_shape(op, "bias", *bias, {weight.size(0)});
    check_same_device(op, {{"hidden", &hidden}, {"bias", &*bias}});
  }
  TORCH_CHECK(args.temperature > 0.0 && std::isfinite(args.temperature), op,
              ": temperature must be finite and > 0, got ", args.temperature);
  TORCH_CHECK(args.logit_scale > 0.0 && std::isfinite(args.logit_scale), op,
              ": logit_scale must be finite and > 0, got ", args.logit_scale);
  TORCH_CHECK(!args.logit_softcap || (*args.logit_softcap > 0.0 && std::isfinite(*args.logit_softcap)), op,
              ": logit_softcap must be None or finite and > 0, got ", args.logit_softcap.value_or(0.0));
}

at::ScalarType compute_dtype(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The indices of the rows whose label lies in [0, V) and is not ignore_index (the only
// rows ever read): a pad id inside [0, V) used as ignore_index marks rows to skip too.
at::Tensor used_rows(const at::Tensor& label, int64_t vocab, int64_t ignore_index) {
  return at::nonzero((label >= 0) & (label < vocab) & (label != ignore_index)).view(-1);
}

// Everything a chunk loop needs, in the compute type: the head (converted once when its
// dtype is not the compute type: float16/bfloat16 heads), the bias, the used rows.
struct Head {
  at::Tensor weight, bias, label, rows;  // bias undefined without one
  int64_t vocab, chunk_rows;
};

Head prepare(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
             const std::optional<at::Tensor>& bias, int64_t ignore_index) {
  const at::ScalarType acc = compute_dtype(hidden);
  Head head;
  head.weight = weight.to(acc);
  head.bias = bias.has_value() ? bias->to(acc) : at::Tensor();
  head.label = labels.to(at::kLong).contiguous();
  head.vocab = weight.size(0);
  head.rows = used_rows(head.label, head.vocab, ignore_index);
  head.chunk_rows = std::max(kMinRows, kScratchLogits / head.vocab);
  return head;
}

// BLAS picks its algorithm (and with it a row's summation order) by the number of rows: the
// head's products take exactly this many rows, the last block padded with zero rows, so a row's
// logits do not depend on the rest of the batch, bit for bit (as the reference's MATMUL_ROWS).
constexpr int64_t kMatmulRows = 128;

// logits = h @ W.T in blocks of exactly kMatmulRows rows.
void rowwise_matmul(const at::Tensor& h, const at::Tensor& weight, at::Tensor& logits) {
  const int64_t n = h.size(0);
  for (int64_t b0 = 0; b0 < n; b0 += kMatmulRows) {
    const int64_t m = std::min(kMatmulRows, n - b0);
    at::Tensor out = logits.narrow(0, b0, m);
    if (m == kMatmulRows) {
      at::mm_out(out, h.narrow(0, b0, m), weight.t());
      continue;
    }
    at::Tensor padded = at::zeros({kMatmulRows, h.size(1)}, h.options());
    padded.narrow(0, 0, m).copy_(h.narrow(0, b0, m));
    out.copy_(at::mm(padded, weight.t()).narrow(0, 0, m));
  }
}

// scratch[:n] = softcap(logit_scale * (hidden[rows] @ W.T + b)): the chunk's logits
// before the temperature, and the chunk's hidden states in the compute type.
at::Tensor chunk_logits(const Head& head, const at::Tensor& hidden, const at::Tensor& rows, at::Tensor& logits,
                        const HeadArgs& args) {
  const at::Tensor h = hidden.index_select(0, rows).to(logits.scalar_type());
  rowwise_matmul(h, head.weight, logits);
  if (head.bias.defined()) logits.add_(head.bias);
  if (args.logit_softcap) {
    const double cap = *args.logit_softcap;
    logits.mul_(args.logit_scale / cap).tanh_().mul_(cap);
  } else if (args.logit_scale != 1.0) {
    logits.mul_(args.logit_scale);
  }
  return h;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_token_logprobs_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& bias,
    double temperature, double logit_scale, std::optional<double> logit_softcap, bool return_entropy,
    int64_t ignore_index, int64_t top_k, double top_p, double min_p) {
  constexpr const char* op = "linear_token_logprobs";
  const HeadArgs args{temperature, logit_scale, logit_softcap, ignore_index};
  check_inputs(op, hidden, weight, labels, bias, args);
  const Truncation truncation{top_k, top_p, min_p};
  check_truncation(op, truncation);
  const bool truncated = truncation.active();
  const int64_t width = stats_width(truncated);
  const Head head = prepare(hidden, weight, labels, bias, ignore_index);
  const int64_t n_rows = hidden.size(0), vocab = head.vocab;
  const auto options = hidden.options().dtype(compute_dtype(hidden));
  // Ignored rows: 0; out-of-range rows: NaN; the used rows are overwritten below.
  const at::Tensor ignored = head.label == ignore_index;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  at::Tensor logp = at::where(ignored, 0.0, nan).to(options.dtype());
  at::Tensor entropy = return_entropy ? logp.clone() : at::empty({0}, options);
  at::Tensor stats = at::where(ignored, 0.0, nan).to(options.dtype()).unsqueeze(-1).repeat({1, width});
  const int64_t n_used = head.rows.numel();
  if (n_used == 0 || n_rows == 0) return {logp, entropy, stats};
  at::Tensor scratch = at::empty({std::min(head.chunk_rows, n_used), vocab}, options);
  const int64_t* row_index = head.rows.const_data_ptr<int64_t>();
  const int64_t* label_data = head.label.const_data_ptr<int64_t>();

  AT_DISPATCH_FLOATING_TYPES(scratch.scalar_type(), "linear_token_logprobs_cpu", [&] {
    const scalar_t inv_temp = static_cast<scalar_t>(1.0 / temperature);
    scalar_t* logp_data = logp.mutable_data_ptr<scalar_t>();
    scalar_t* entropy_data = return_entropy ? entropy.mutable_data_ptr<scalar_t>() : nullptr;
    scalar_t* stats_data = stats.mutable_data_ptr<scalar_t>();
    for (int64_t c0 = 0; c0 < n_used; c0 += head.chunk_rows) {
      const int64_t n = std::min(head.chunk_rows, n_used - c0);
      at::Tensor logits = scratch.narrow(0, 0, n);
      chunk_logits(head, hidden, head.rows.narrow(0, c0, n), logits, args);
      const scalar_t* base = logits.const_data_ptr<scalar_t>();
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        std::vector<scalar_t> kept_scratch(truncated ? 3 * vocab : 0);  // a truncated row's selection
        for (int64_t i = begin; i < end; ++i) {
          const int64_t r = row_index[c0 + i];
          const scalar_t* row = base + i * vocab;
          scalar_t* row_stats_out = stats_data + width * r;
          RowStats<scalar_t> row_stat;
          if (truncated) {
            row_stat = log_softmax_row_stats_kept(row, vocab, inv_temp, return_entropy, truncation, kept_scratch.data(),
                                                  row_stats_out + 2);
            logp_data[r] = log_softmax_label_logprob_kept(row[label_data[r]], inv_temp, row_stat, row_stats_out[2]);
          } else {
            row_stat = log_softmax_row_stats(row, vocab, inv_temp, return_entropy);
            logp_data[r] = log_softmax_label_logprob(row[label_data[r]], inv_temp, row_stat);
          }
          row_stats_out[0] = row_stat.max;
          row_stats_out[1] = row_stat.log_sum;
          if (return_entropy) entropy_data[r] = row_stat.entropy;
        }
      });
    }
  });
  return {logp, entropy, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_token_logprobs_backward_cpu(
    const std::optional<at::Tensor>& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const std::optional<at::Tensor>& bias,
    const at::Tensor& stats_in, const at::Tensor& entropy_in, double temperature, double logit_scale,
    std::optional<double> logit_softcap, int64_t ignore_index, std::array<bool, 3> output_mask) {
  constexpr const char* op = "linear_token_logprobs_backward";
  const HeadArgs args{temperature, logit_scale, logit_softcap, ignore_index};
  check_inputs(op, hidden, weight, labels, bias, args);
  const at::ScalarType acc = compute_dtype(hidden);
  TORCH_CHECK(stats_in.scalar_type() == acc, op, ": stats must have dtype ", acc,
              " (as linear_token_logprobs returns it), got ", stats_in.scalar_type());
  const int64_t stats_cols = checked_stats_width(op, stats_in, labels);
  check_same_device(op, {{"hidden", &hidden}, {"stats", &stats_in}});
  const bool has_logp_grad = grad_logprobs.has_value(), has_entropy_grad = grad_entropy.has_value();
  for (const auto& [name, grad] :
       {std::pair{"grad_logprobs", &grad_logprobs}, std::pair{"grad_entropy", &grad_entropy}}) {
    if (!grad->has_value()) continue;
    check_float(op, name, **grad);
    check_same_shape(op, name, **grad, "labels", labels);
    check_same_device(op, {{"hidden", &hidden}, {name, &**grad}});
  }
  if (has_entropy_grad) {
    TORCH_CHECK(entropy_in.scalar_type() == acc, op, ": entropy must have dtype ", acc, ", got ",
                entropy_in.scalar_type());
    check_same_shape(op, "entropy", entropy_in, "labels", labels);
    check_same_device(op, {{"hidden", &hidden}, {"entropy", &entropy_in}});
  }
  const bool want_hidden = output_mask[0], want_weight = output_mask[1], want_bias_in = output_mask[2];
  const bool want_bias = want_bias_in && bias.has_value();
  const auto options = hidden.options().dtype(acc);
  const Head head = prepare(hidden, weight, labels, bias, ignore_index);
  const int64_t vocab = head.vocab, width = hidden.size(1), n_used = head.rows.numel();
  // Accumulated in the compute type, returned in the inputs' dtypes.
  at::Tensor d_hidden = want_hidden ? at::zeros({hidden.size(0), width}, options) : at::Tensor();
  at::Tensor d_weight = want_weight ? at::zeros({vocab, width}, options) : at::Tensor();
  at::Tensor d_bias = want_bias ? at::zeros({vocab}, options) : at::Tensor();
  if (n_used > 0 && (has_logp_grad || has_entropy_grad) && (want_hidden || want_weight || want_bias)) {
    const at::Tensor stats = stats_in.contiguous();
    const at::Tensor grad_logp = has_logp_grad ? grad_logprobs->to(acc).contiguous() : at::Tensor();
    const at::Tensor grad_ent = has_entropy_grad ? grad_entropy->to(acc).contiguous() : at::Tensor();
    const at::Tensor entropy = has_entropy_grad ? entropy_in.contiguous() : at::Tensor();
    at::Tensor scratch = at::empty({std::min(head.chunk_rows, n_used), vocab}, options);
    const int64_t* row_index = head.rows.const_data_ptr<int64_t>();
    const int64_t* label_data = head.label.const_data_ptr<int64_t>();

    AT_DISPATCH_FLOATING_TYPES(acc, "linear_token_logprobs_backward_cpu", [&] {
      const scalar_t inv_temp = static_cast<scalar_t>(1.0 / temperature);
      const scalar_t scale = static_cast<scalar_t>(logit_scale);
      const scalar_t cap = static_cast<scalar_t>(logit_softcap.value_or(1.0));
      const scalar_t* stats_data = stats.const_data_ptr<scalar_t>();
      const scalar_t* grad_logp_data = has_logp_grad ? grad_logp.const_data_ptr<scalar_t>() : nullptr;
      const scalar_t* grad_ent_data = has_entropy_grad ? grad_ent.const_data_ptr<scalar_t>() : nullptr;
      const scalar_t* entropy_data = has_entropy_grad ? entropy.const_data_ptr<scalar_t>() : nullptr;
      for (int64_t c0 = 0; c0 < n_used; c0 += head.chunk_rows) {
        const int64_t n = std::min(head.chunk_rows, n_used - c0);
        const at::Tensor rows = head.rows.narrow(0, c0, n);
        at::Tensor logits = scratch.narrow(0, 0, n);
        const at::Tensor h = chunk_logits(head, hidden, rows, logits, args);
        scalar_t* base = logits.mutable_data_ptr<scalar_t>();
        // The chunk's logits become d_logits (w.r.t. the product hidden @ W.T + b) in place.
        at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t r = row_index[c0 + i];
            scalar_t* row = base + i * vocab;
            const scalar_t g = has_logp_grad ? grad_logp_data[r] * inv_temp : scalar_t(0);
            const scalar_t h_ent = has_entropy_grad ? grad_ent_data[r] * inv_temp : scalar_t(0);
            const scalar_t ent = has_entropy_grad ? entropy_data[r] : scalar_t(0);
            const scalar_t* row_stat = stats_data + stats_cols * r;
            if (!logit_softcap) {  // d_logits is linear in (g, h): the scale folds into them
              if (stats_cols == 3) {
                log_softmax_row_grad_kept(row, row, vocab, label_data[r], inv_temp, row_stat, g * scale, h_ent * scale,
                                          ent);
              } else {
                log_softmax_row_grad(row, row, vocab, label_data[r], inv_temp, row_stat, g * scale, h_ent * scale, ent);
              }
              continue;
            }
            // The chain rule through the soft-cap needs the block's logits: saved before they are overwritten.
            alignas(64) scalar_t saved[kBlock];
            for (int64_t b0 = 0; b0 < vocab; b0 += kBlock) {
              const int64_t m = std::min(kBlock, vocab - b0);
              scalar_t* block = row + b0;
              std::copy(block, block + m, saved);
              if (stats_cols == 3) {
                log_softmax_row_grad_kept(block, block, m, label_data[r] - b0, inv_temp, row_stat, g, h_ent, ent);
              } else {
                log_softmax_row_grad(block, block, m, label_data[r] - b0, inv_temp, row_stat, g, h_ent, ent);
              }
              through_softcap(block, saved, m, scale, cap);
            }
          }
        });
        if (want_hidden) d_hidden.index_copy_(0, rows, at::mm(logits, head.weight));
        if (want_weight) d_weight.addmm_(logits.t(), h);
        if (want_bias) d_bias.add_(logits.sum(0));
      }
    });
  }
  auto finish = [](bool wanted, const at::Tensor& grad, const at::Tensor& like) {
    return wanted ? grad.to(like.scalar_type()) : at::empty({0}, like.options());
  };
  return {finish(want_hidden, d_hidden, hidden), finish(want_weight, d_weight, weight),
          want_bias ? finish(true, d_bias, *bias) : at::empty({0}, hidden.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(ppo_fast, CPU, m) {
  m.impl("linear_token_logprobs", &linear_token_logprobs_cpu);
  m.impl("linear_token_logprobs_backward", &linear_token_logprobs_backward_cpu);
}

}  // namespace ppo_fast
