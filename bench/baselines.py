"""What a user would run instead of ppo_fast: the eager PyTorch code of the common RLHF stacks.

Written here in the style of verl, TRL and DeepSpeed-Chat (not copied from them), and kept
independent of ``ppo_fast.backends.reference`` on purpose: a change to our oracle must not move the
baseline it is compared against.  ``tests/test_bench.py`` checks each one against the
reference on small inputs, so a baseline timing is always the timing of a correct answer.

Optional third-party kernels (Liger-Kernel, flash-attn) are imported lazily;
:func:`optional_logprob_kernels` says which are installed and why the others are not.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from ppo_fast.backends.reference import aggregate, masked_mean

IGNORE_INDEX = -100
# Tokens per sequence for the TRL-style loop: TRL walks the batch one sequence at a time.
TRL_SEQUENCE_TOKENS = 1024


# --------------------------------------------------------------------------- log-probs


def eager_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """verl's naive path / DeepSpeed-Chat: a float32 log-softmax of all of it, then a gather."""
    valid = labels != IGNORE_INDEX
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return logp * valid


def trl_chunked_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """TRL's ``selective_log_softmax`` approach: one sequence at a time to bound peak memory.

    float32 rows: gather the chosen logit, subtract the row's logsumexp (no [n, V] log-softmax);
    low-precision rows: a float32 log-softmax per sequence (logsumexp in bf16 is too inexact).
    The temperature is applied per sequence in float32 (dividing bf16 logits would round them).
    """
    valid = labels != IGNORE_INDEX
    safe_labels = labels.clamp_min(0)
    pieces = []
    for start in range(0, logits.shape[0], TRL_SEQUENCE_TOKENS):
        seq_logits = logits[start : start + TRL_SEQUENCE_TOKENS]
        seq_labels = safe_labels[start : start + TRL_SEQUENCE_TOKENS].unsqueeze(-1)
        if seq_logits.dtype in (torch.float32, torch.float64):
            scaled = seq_logits / temperature
            pieces.append((scaled.gather(-1, seq_labels).squeeze(-1) - torch.logsumexp(scaled, dim=-1)).float())
        else:
            seq_logp = torch.log_softmax(seq_logits.float() / temperature, dim=-1)
            pieces.append(seq_logp.gather(-1, seq_labels).squeeze(-1))
    return torch.cat(pieces) * valid


def _liger_logprobs() -> Callable:
    module = importlib.import_module("liger_kernel.transformers")
    cross_entropy = module.LigerCrossEntropyLoss(reduction="none", ignore_index=IGNORE_INDEX)

    def liger_logprobs(logits, labels, temperature):
        # Liger has no temperature argument: scaling the logits is the extra pass a user pays.
        return -cross_entropy(logits / temperature, labels)

    return liger_logprobs


def _flash_attn_logprobs() -> Callable:
    module = importlib.import_module("flash_attn.ops.triton.cross_entropy")

    def flash_attn_logprobs(logits, labels, temperature):
        losses, _ = module.cross_entropy_loss(logits, labels, logit_scale=1.0 / temperature, ignore_index=IGNORE_INDEX)
        return -losses

    return flash_attn_logprobs


_OPTIONAL_KERNELS = {"liger-ce": _liger_logprobs, "flash-attn-ce": _flash_attn_logprobs}


def optional_logprob_kernels(
    device_type: str, kernels: dict | None = None
) -> tuple[dict[str, Callable], dict[str, str]]:
    """Installed third-party Triton cross-entropy kernels for ``device_type`` (of ``kernels``,
    by default the logits ones), and notes on the rest."""
    found, notes = {}, {}
    for name, load in (_OPTIONAL_KERNELS if kernels is None else kernels).items():
        if device_type != "cuda":
            notes[name] = "skipped: a CUDA-only Triton kernel"
            continue
        try:
            found[name] = load()
        except Exception as err:  # absent or broken install: say so in the report
            notes[name] = f"skipped: not importable ({type(err).__name__}: {err})"
    return found, notes


# --------------------------------------------------------------------------- fused LM head


def eager_linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float
) -> torch.Tensor:
    """What a trainer does without a fused head: the whole [N, V] logits, then ``eager_logprobs``."""
    return eager_logprobs(hidden @ weight.T, labels, temperature)


def linear_layer_yardstick(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head's own matrix products, nothing else: the forward ``hidden @ weight.T`` and,
    under autograd, the two products of its backward (plus a memset of the [N, V] gradient
    of the one column returned).  Not a log-prob: a time yardstick, not compared."""
    return torch.nn.functional.linear(hidden, weight)[:, 0]


def _liger_fused_head() -> Callable:
    module = importlib.import_module("liger_kernel.transformers")
    loss = module.LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="none")

    def liger_fused_head(hidden, weight, labels, temperature):
        # No temperature argument: (hidden / T) @ W.T is the scaled logits (no bias here).
        return -loss(weight, hidden / temperature, labels)

    return liger_fused_head


def _cut_cross_entropy() -> Callable:
    module = importlib.import_module("cut_cross_entropy")

    def cut_cross_entropy(hidden, weight, labels, temperature):
        return -module.linear_cross_entropy(
            hidden / temperature, weight, labels, ignore_index=IGNORE_INDEX, reduction="none"
        )

    return cut_cross_entropy


OPTIONAL_HEAD_KERNELS = {"liger-fused-head": _liger_fused_head, "cut-cross-entropy": _cut_cross_entropy}


# --------------------------------------------------------------------------- KL reward and GAE


def eager_kl_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float):
    """verl-style ``low_var_kl`` (k3) penalty, then the score added at each row's last response token.

    Assumes right-padded responses (as verl's reward managers do): the last valid
    token is at ``mask.sum(-1) - 1``.
    """
    mask = mask.float()
    kl = ref_logprobs - logprobs
    kl = torch.clamp(kl, min=-20, max=20)
    kld = (torch.exp(kl) - kl - 1).clamp(min=-10, max=10)
    token_scores = torch.zeros_like(logprobs)
    last = (mask.sum(-1).long() - 1).clamp_min(0)
    has_tokens = (mask.sum(-1) > 0).float()
    token_scores[torch.arange(scores.shape[0], device=scores.device), last] = scores * has_tokens
    rewards = (token_scores - kl_coef * kld) * mask
    return rewards, kld * mask


def loop_gae(rewards, values, mask, gamma: float, lam: float):
    """The reverse Python loop of verl/TRL, mask-aware (masked steps carry the running values over)."""
    mask = mask.float()
    next_values = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    advantages_reversed = []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        new_gae = delta + gamma * lam * last_gae
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae = new_gae * mask[:, t] + (1 - mask[:, t]) * last_gae
        advantages_reversed.append(new_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
    returns = (advantages + values) * mask
    return advantages, returns


# --------------------------------------------------------------------------- losses


def eager_policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps: float, dual_clip: float, agg: str):
    """verl's ``compute_policy_loss`` shape: ratio, two clipped surrogates, dual clip, stats."""
    negative_approx_kl = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    approx_kl = masked_mean(-negative_approx_kl, mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    pg_losses3 = -advantages * dual_clip
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return aggregate(pg_losses, mask, agg), clipfrac.detach(), clipfrac_lower.detach(), approx_kl.detach()


def eager_value_loss(values, old_values, returns, mask, clip: float, agg: str):
    """verl's ``compute_value_loss`` shape: clipped and unclipped squared errors, the larger one."""
    values_clipped = torch.clamp(values, old_values - clip, old_values + clip)
    losses1 = (values - returns) ** 2
    losses2 = (values_clipped - returns) ** 2
    loss = 0.5 * aggregate(torch.max(losses1, losses2), mask, agg)
    clipfrac = masked_mean(torch.gt(losses2, losses1).float(), mask)
    return loss, clipfrac.detach()


# --------------------------------------------------------------------------- TRL


def trl_logprob_baseline(temperature: float, dtype: torch.dtype) -> dict[str, Callable]:
    """The TRL baseline of a token_logprobs case: TRL's real ``selective_log_softmax`` where TRL
    is installed (float32/float64 logits: its bf16 path computes the log-softmax in bf16, which
    the benchmark's 1e-3 check against the reference refuses; ``python -m bench peers`` times
    it), else the re-implementation ``trl-chunked``."""
    if dtype in (torch.float32, torch.float64) and importlib.util.find_spec("trl") is not None:

        def trl(x):
            from trl.trainer.utils import selective_log_softmax  # imported on first use (a slow import)

            logits, labels = x["logits"], x["labels"]
            # As TRL is called: [sequences, tokens, V] (it loops over the sequences), here
            # sequences of TRL_SEQUENCE_TOKENS tokens, as "trl-chunked" assumes.
            n = labels.shape[0]
            per = min(n, TRL_SEQUENCE_TOKENS)
            shape = (n // per, per) if n % per == 0 else (1, n)
            valid = labels != IGNORE_INDEX
            out = selective_log_softmax(
                logits.view(*shape, logits.shape[-1]),
                labels.clamp_min(0).view(shape),
                temperature=temperature,
                row_mask=valid.view(shape),
            )
            return out.reshape(n)

        return {"trl": trl}
    return {"trl-chunked": lambda x: trl_chunked_logprobs(x["logits"], x["labels"], temperature)}


def torch_linear_ce_baseline(temperature: float) -> dict[str, Callable]:
    """PyTorch's own fused head, ``torch.nn.functional.linear_cross_entropy`` (``reduction="none"``: the
    negative log-probs, 0 at ignored rows), where the installed torch has it; the temperature divides
    the hidden states (no bias here)."""
    fn = getattr(torch.nn.functional, "linear_cross_entropy", None)
    if fn is None:
        return {}

    def torch_linear_ce(x):
        return -fn(x["hidden"] / temperature, x["weight"], x["labels"], reduction="none", ignore_index=IGNORE_INDEX)

    return {"torch-linear-ce": torch_linear_ce}


def trl_fused_head_baseline(temperature: float) -> dict[str, Callable]:
    """TRL's real fused LM head where TRL is installed: the function ``add_fused_lm_head`` calls
    (``trl.trainer.utils._ChunkedLogProbFunction`` with TRL's own chunk size), on the rows whose
    label is not ignored, as ``add_fused_lm_head`` compacts them, scattered back to all rows."""
    if importlib.util.find_spec("trl") is None:
        return {}

    def trl_fused_head(x):
        from trl.trainer import utils  # imported on first use (a slow import)

        labels = x["labels"]
        valid = labels != IGNORE_INDEX
        logp = utils._ChunkedLogProbFunction.apply(
            x["hidden"][valid],
            x["weight"],
            None,
            labels[valid],
            temperature,
            utils._CHUNKED_LOGPROB_CHUNK_SIZE,
            None,
            1.0,
            ("log_probs",),
        )[0]
        return logp.new_zeros(labels.shape).masked_scatter(valid, logp)

    return {"trl-fused-head": trl_fused_head}
