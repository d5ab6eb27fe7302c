"""Plain-PyTorch reference implementations: readable, differentiable, the oracle.

Every function here takes inputs already validated and normalised by
``ppo_fast.ops`` (masks are bool, shapes agree) and computes and returns in
``contract.result_dtype`` of all its floating inputs (float32, float64 if any is
float64).  The fast backends implement exactly these signatures and the rules in
``ppo_fast.contract``: values at masked positions are replaced by 0 before any
arithmetic (so NaN/inf there reaches neither a result nor a gradient), and an
out-of-range label gives a NaN log-prob and no gradient.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint

from .contract import OPS, result_dtype

SUPPORTED = {op: {"cpu", "cuda"} for op in OPS}

# Rows per chunk in token_logprobs: at most this many float32 logits live at once,
# so a bf16 [N, V] input never gets a float32 [N, V] copy.
_CHUNK_ELEMENTS = 1 << 24


def _common(*inputs: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The inputs in their common compute dtype (one dtype for all, so mixed float32 and
    float64 inputs are all computed in float64)."""
    dtype = result_dtype(*inputs)
    return [None if x is None else x.to(dtype) for x in inputs]


def _masked(mask: torch.Tensor, *inputs: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The inputs in their common compute dtype with 0 at masked positions: whatever a
    masked position holds (NaN, inf) reaches no result and no gradient."""
    return [None if x is None else torch.where(mask, x, 0.0) for x in _common(*inputs)]


def availability() -> tuple[bool, str]:
    return True, "plain PyTorch, every op on every device"


# --------------------------------------------------------------------------- log-probs


def _logprobs_rows(logits: torch.Tensor, labels: torch.Tensor, temperature: float, return_entropy: bool, ignore_index: int):
    """log-prob (and entropy) of rows ``logits [n, V]`` at ``labels [n]``, computed in float32.

    Ignored rows give 0; a label outside ``[0, V)`` gives NaN (the contract).  Both rows
    are zeroed before the softmax, so that they pass no gradient whatever they hold.
    """
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < logits.shape[-1])
    used = in_range & ~ignored
    (z,) = _common(logits)
    z = torch.where(used.unsqueeze(-1), z / temperature, 0.0)
    logp_all = torch.log_softmax(z, dim=-1)
    chosen = logp_all.gather(-1, torch.where(used, labels, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(used, chosen, torch.where(ignored, 0.0, torch.nan))
    if not return_entropy:
        return logp, None
    p = logp_all.exp()
    # p·log p is 0 where p == 0 (a -inf logit); the where keeps its gradient finite too.
    safe_logp = torch.where(p > 0, logp_all, 0.0)
    entropy = -(p * safe_logp).sum(-1)
    return logp, torch.where(used, entropy, torch.where(ignored, 0.0, torch.nan))


def token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, return_entropy: bool, ignore_index: int, inplace_backward: bool = False
):
    """``log_softmax(logits / temperature)`` at ``labels`` (and the entropy), float32.

    ``inplace_backward`` is a memory hint for the fast backends; the reference never
    overwrites its input.

    ``logits`` is ``[N, V]`` or ``[B, T, V]`` with a contiguous last dim; ``labels``
    has the leading shape.  Processed in row chunks so that a bf16 input never has a
    float32 copy of all of it (without autograd; with autograd the chunks' softmax is
    kept for backward, as eager PyTorch does).
    """
    if logits.dim() == 3:
        if not logits.shape[0]:  # no row: the rows of none, so that the empty results are in the autograd graph
            logp, ent = token_logprobs(logits.reshape(0, logits.shape[-1]), labels.reshape(0), temperature, return_entropy, ignore_index)
            return logp.view(labels.shape), (ent.view(labels.shape) if return_entropy else None)
        parts = [token_logprobs(logits[b], labels[b], temperature, return_entropy, ignore_index) for b in range(logits.shape[0])]
        logp = torch.stack([p[0] for p in parts])
        ent = torch.stack([p[1] for p in parts]) if return_entropy else None
        return logp, ent
    n, vocab = logits.shape
    rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    outs = [_logprobs_rows(logits[i : i + rows], labels[i : i + rows], temperature, return_entropy, ignore_index) for i in range(0, n, rows)]
    if not outs:  # no row: the rows of none, so that the empty results are in the autograd graph
        outs.append(_logprobs_rows(logits, labels, temperature, return_entropy, ignore_index))
    logp = torch.cat([o[0] for o in outs])
    ent = torch.cat([o[1] for o in outs]) if return_entropy else None
    return logp, ent


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logit_scale: float, logit_softcap: float | None):
    """The LM head's transformed logits ``softcap(logit_scale * (hidden @ weight.T + bias))``
    (before the temperature), in the inputs' common compute dtype (float32 for
    float16/bfloat16 inputs: the product accumulates and stays in float32)."""
    hidden, weight, bias = _common(hidden, weight, bias)
    raw = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    z = raw * logit_scale
    return z if logit_softcap is None else logit_softcap * torch.tanh(z / logit_softcap)


def _linear_logprobs_chunk(hidden, weight, bias, labels, temperature, logit_scale, logit_softcap, return_entropy, ignore_index):
    """One row chunk: ``token_logprobs`` of its logits.  Rows that are ignored or out of
    range get a zero hidden state first, so that whatever they hold (NaN, inf) reaches
    neither ``weight``'s gradient nor any result."""
    used = (labels != ignore_index) & (labels >= 0) & (labels < weight.shape[0])
    hidden = torch.where(used.unsqueeze(-1), hidden, 0.0)
    logits = linear_logits(hidden, weight, bias, logit_scale, logit_softcap)
    logp, entropy = _logprobs_rows(logits, labels, temperature, return_entropy, ignore_index)
    return (logp, entropy) if return_entropy else (logp,)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
):
    """``token_logprobs(softcap(logit_scale * (hidden @ weight.T + bias)) , labels)`` at
    ``temperature``, for ``hidden [N, H]``, ``weight [V, H]``, ``labels [N]``: ``(logp, entropy or None)``.

    Chunked over rows so that at most ``_CHUNK_ELEMENTS`` logits live at once; under
    autograd each chunk is checkpointed (its logits are recomputed in the backward),
    so the ``[N, V]`` logits and their gradient never exist whole.
    """
    # One compute-dtype copy of the head for all chunks (autograd casts its gradient back).
    weight_c, bias_c = _common(weight, bias)
    args = (temperature, logit_scale, logit_softcap, return_entropy, ignore_index)
    checkpointed = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    rows = max(1, _CHUNK_ELEMENTS // weight.shape[0])
    outs = []
    for i in range(0, hidden.shape[0], rows):
        chunk = (hidden[i : i + rows], weight_c, bias_c, labels[i : i + rows], *args)
        if checkpointed:
            outs.append(torch.utils.checkpoint.checkpoint(_linear_logprobs_chunk, *chunk, use_reentrant=False))
        else:
            outs.append(_linear_logprobs_chunk(*chunk))
    if not outs:  # no row: the chunk of none, so that the empty results are in the autograd graph
        outs.append(_linear_logprobs_chunk(hidden, weight_c, bias_c, labels, *args))
    logp = torch.cat([o[0] for o in outs])
    return logp, (torch.cat([o[1] for o in outs]) if return_entropy else None)


# --------------------------------------------------------------------------- KL and rewards


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs."""
    logprobs, ref_logprobs = _common(logprobs, ref_logprobs)
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "abs":
        return log_ratio.abs()
    # k3 (Schulman's low-variance estimator).  The inner clamp only keeps exp finite
    # for +-inf inputs; the outer clamp to [-10, 10] is the estimator's definition.
    d = (-log_ratio).clamp(-20.0, 20.0)
    return k3_of(d).clamp(-10.0, 10.0)


# exp(d) - d - 1 cancels where |d| is small (in float32 it is 0 at |d| = 1e-4, where the
# truth is 5e-9): there its Taylor series, d^2/2 + ... + d^8/8!, whose truncation is below
# the dtype's rounding for |d| < K3_SERIES_BELOW[dtype] (the kernels use the same split).
K3_SERIES_BELOW = {torch.float32: 0.5, torch.float64: 1e-2}
K3_SERIES = tuple(1.0 / math.factorial(n) for n in range(2, 9))  # d^2 / 2!, ..., d^8 / 8!


def k3_of(d: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 to the dtype's precision for every d (float32 or float64)."""
    series = torch.full_like(d, K3_SERIES[-1])
    for c in reversed(K3_SERIES[:-1]):
        series = series * d + c
    small = d.abs() < K3_SERIES_BELOW[d.dtype]
    return torch.where(small, series * (d * d), d.exp() - d - 1.0)


def last_valid_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: index of the last True in ``mask [B, T]`` (T >= 1) and whether the row has any."""
    positions = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    last = (mask * positions).argmax(dim=-1)
    return last, mask.any(dim=-1)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, estimator: str):
    """``r_t = -kl_coef * kl_t`` at valid tokens, plus the score at each row's last valid token."""
    scores, logprobs, ref_logprobs = _common(scores, logprobs, ref_logprobs)
    logprobs, ref_logprobs = _masked(mask, logprobs, ref_logprobs)
    kl = torch.where(mask, kl_estimate(logprobs, ref_logprobs, estimator), 0.0)
    rewards = -kl_coef * kl
    if mask.shape[-1] == 0:  # no token to carry a score
        return rewards, kl
    last, has_valid = last_valid_index(mask)
    bonus = torch.where(has_valid, scores.to(rewards.dtype), 0.0)
    rewards = rewards.scatter_add(-1, last.unsqueeze(-1), bonus.unsqueeze(-1))
    return rewards, kl


# --------------------------------------------------------------------------- GAE


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation, one reverse step per token over the batch.

    The valid tokens of a row form its episode: a masked token is skipped (the next
    valid value and the running advantage pass through it) and the value after the
    last valid token is 0.  Outputs are 0 at masked positions.
    """
    rewards, values = _masked(mask, rewards, values)
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    running = rewards.new_zeros(batch)
    # (a clone of the empty rewards when T = 0: no token to write, still in the autograd graph)
    advantages = torch.zeros_like(rewards) if length else rewards.clone()
    for t in range(length - 1, -1, -1):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(valid, step, running)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = torch.where(valid, step, 0.0)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def group_sum(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of ``values [B, C]`` replaced by the sum of the rows of its group
    (``group_index [B]`` int64 in ``[0, B)``): the group advantages' one reduction.  Linear
    and symmetric, so its gradient is itself applied to the output's gradient."""
    (values,) = _common(values)
    return values.new_zeros(values.shape).index_add(0, group_index, values)[group_index]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0 where nothing is valid."""
    (x,) = _masked(mask, x)
    m = mask.to(x.dtype)
    total = x.sum() if dim is None else x.sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp_min(1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid entries (Bessel-corrected variance).

    With ``shift_mean=False`` the mean is added back after scaling, as TRL and verl do.
    Masked entries are 0 (all of them when nothing is valid).
    """
    (x,) = _masked(mask, x)
    m = mask.to(x.dtype)
    count = m.sum()
    mean = x.sum() / count.clamp_min(1.0)
    var = torch.where(mask, (x - mean).square(), 0.0).sum() / (count - 1.0).clamp_min(1.0)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0)


# --------------------------------------------------------------------------- losses


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss over ``mask`` the way verl's ``agg_loss`` does.

    Empty selections give 0 rather than NaN (a batch of padding has no loss).
    """
    m = mask.to(per_token.dtype)
    masked = torch.where(mask, per_token, 0.0)
    if agg == "token-sum":
        return masked.sum()
    if agg == "token-mean":
        return masked.sum() / m.sum().clamp_min(1.0)
    row_tokens = m.sum(-1)
    row_has_tokens = (row_tokens > 0).to(per_token.dtype)
    row_sum = masked.sum(-1)
    if agg == "seq-mean-token-mean":
        row_loss = row_sum / row_tokens.clamp_min(1.0)
    else:  # seq-mean-token-sum and its -norm variant
        row_loss = row_sum
    loss = (row_loss * row_has_tokens).sum() / row_has_tokens.sum().clamp_min(1.0)
    if agg == "seq-mean-token-sum-norm":
        loss = loss / max(per_token.shape[-1], 1)
    return loss


def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, dual_clip, agg: str):
    """PPO clipped surrogate (to minimise) and its stats ``(loss, clipfrac, clipfrac_lower, approx_kl)``."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    if dual_clip is not None:
        cap = -adv * dual_clip
        capped = (adv < 0) & (cap < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
        clipfrac_lower = masked_mean(capped.float(), mask)
    else:
        clipfrac_lower = torch.zeros((), device=logp.device)
    if weights is not None:
        pg = pg * weights
    loss = aggregate(pg, mask, agg)
    approx_kl = masked_mean(old - logp, mask)
    return loss, clipfrac.detach(), clipfrac_lower.detach(), approx_kl.detach()


def value_loss(values, old_values, returns, mask, clip: float, agg: str):
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V) - R)^2)`` and its clip fraction.

    ``clip = inf`` turns clipping off (the public op's ``clip=None``).
    """
    v, old, ret = _masked(mask, values, old_values, returns)
    v_clipped = torch.maximum(torch.minimum(v, old + clip), old - clip)
    unclipped = (v - ret).square()
    clipped = (v_clipped - ret).square()
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return aggregate(per_token, mask, agg), clipfrac.detach()


# --------------------------------------------------------------------------- policy-loss modes
# The registry's modes (ppo_fast.policy_loss_modes; vanilla is clipped_policy_loss above),
# verl 0.9.1's definitions.  Each returns (loss, *the entry's stats); stats carry no gradient.


def _log_ratio_and_kl(mask, logp, old):
    """``log r = logp - old`` and the stat ``approx_kl`` = masked mean of ``old - logp``."""
    log_ratio = logp - old
    return log_ratio, masked_mean(-log_ratio, mask).detach()


def _no_stat(like: torch.Tensor) -> torch.Tensor:
    """A stat verl reports as a constant 0 for this mode (kept so that the stats match)."""
    return torch.zeros((), device=like.device)


def _weighted(pg, weights):
    return pg if weights is None else pg * weights


def _row_mean(x, mask):
    """Per-row mean over the valid tokens (0 for a row without any)."""
    return torch.where(mask, x, 0.0).sum(-1) / mask.sum(-1).clamp_min(1)


def policy_loss_gspo(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, agg: str):
    """GSPO: per token ``s = sg(exp(mean_t log r)) * pi / sg(pi)`` (log clamped at 10),
    then the clipped surrogate of ``s``.  No gradient reaches old_logprobs."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    seq_log_ratio = _row_mean(log_ratio, mask).detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(logp - logp.detach() + seq_log_ratio, max=10.0))
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = _weighted(torch.maximum(unclipped, clipped), weights)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return aggregate(pg, mask, agg), clipfrac.detach(), _no_stat(logp), approx_kl


def policy_loss_geo_mean(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, agg: str):
    """GMPO: per row ``-mean_t(A) * exp(mean_t sign(A) * min(sign(A) log r, sign(A) clip(log r,
    -clip_eps_low, clip_eps_high)))``, times the geometric mean of the row's ``weights``;
    each valid token carries its row's loss into ``agg``."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -clip_eps_low, clip_eps_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    row_loss = -_row_mean(adv, mask) * torch.exp(_row_mean(kept, mask))
    if weights is not None:  # verl's geometric mean of the token weights, with its 1e-10
        row_loss = row_loss * torch.exp(_row_mean(torch.log(weights + 1e-10), mask))
    pg = row_loss.unsqueeze(-1).expand_as(logp)
    clipped = log_ratio != clamped
    clipfrac = masked_mean((clipped & (adv > 0)).float(), mask)
    clipfrac_lower = masked_mean((clipped & (adv < 0)).float(), mask)
    return aggregate(pg, mask, agg), clipfrac.detach(), clipfrac_lower.detach(), approx_kl


def policy_loss_sapo(logprobs, old_logprobs, advantages, mask, weights, tau_pos: float, tau_neg: float, agg: str):
    """SAPO: ``-A * sigmoid(tau * (r - 1)) * 4 / tau`` with tau_pos where A > 0, else tau_neg."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))  # in the compute dtype
    pg = _weighted(-adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), weights)
    return aggregate(pg, mask, agg), _no_stat(logp), _no_stat(logp), approx_kl


def policy_loss_cispo(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, agg: str):
    """CISPO: ``-sg(clip(r, 1 - clip_eps_low, 1 + clip_eps_high)) * A * logp``."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0)).detach()
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = _weighted(-clipped_ratio * adv * logp, weights)
    clipfrac = masked_mean((ratio != clipped_ratio).float(), mask)
    return aggregate(pg, mask, agg), clipfrac.detach(), _no_stat(logp), approx_kl


def policy_loss_gpg(logprobs, old_logprobs, advantages, mask, weights, agg: str):
    """GPG: ``-A * logp`` (old_logprobs is not read)."""
    logp, adv, weights = _masked(mask, logprobs, advantages, weights)
    return (aggregate(_weighted(-adv * logp, weights), mask, agg),)


def policy_loss_clip_cov(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float,
                         clip_cov_ratio: float, clip_cov_lb: float, clip_cov_ub: float, agg: str):
    """Clip-Cov: the clipped surrogate (ratio unclamped), except that of the unclipped tokens
    whose ``(A - mean A) * (logp - mean logp)`` lies in ``(clip_cov_lb, clip_cov_ub)``,
    ``max(1, int(clip_cov_ratio * tokens))`` drawn at random (``torch.randperm``, the default
    CPU generator, as verl) contribute nothing."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask)).detach()
    candidates = mask & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    index = torch.nonzero(candidates)
    count = max(int(clip_cov_ratio * int(mask.sum())), 1)
    if len(index):
        index = index[torch.randperm(len(index))[:count]]
    keep = torch.ones_like(logp)
    keep[index[:, 0], index[:, 1]] = 0.0
    pg = _weighted(torch.maximum(unclipped, clipped) * keep, weights)
    clipfrac = masked_mean((keep == 0).float(), mask)
    return aggregate(pg, mask, agg), clipfrac.detach(), approx_kl


def policy_loss_kl_cov(logprobs, old_logprobs, advantages, mask, weights, kl_cov_ratio: float, ppo_kl_coef: float, agg: str):
    """KL-Cov: ``-A * r`` (unclamped), plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(kl_cov_ratio * tokens))`` valid tokens of largest
    ``(A - mean A) * (logp - mean logp)``; stat: mean ``|log r|``."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio = logp - old
    pg = -adv * torch.exp(log_ratio)
    valid = mask.flatten().nonzero().squeeze(-1)
    if len(valid):
        flat_adv, flat_logp = adv.detach().flatten()[valid], logp.detach().flatten()[valid]
        cov = (flat_adv - flat_adv.mean()) * (flat_logp - flat_logp.mean())
        top = valid[torch.topk(cov, max(1, int(len(valid) * kl_cov_ratio))).indices]
        penalised = torch.zeros(logp.numel(), dtype=torch.bool, device=logp.device)
        penalised[top] = True
        pg = torch.where(penalised.view_as(logp), pg + ppo_kl_coef * log_ratio.abs(), pg)
    abs_kl = masked_mean(log_ratio.abs(), mask).detach()
    return aggregate(_weighted(pg, weights), mask, agg), abs_kl


def _dppo(logprobs, old_logprobs, advantages, mask, weights, ratio_cap, trusted):
    """DPPO's loss ``-A * sg(min(r, ratio_cap)) * logp`` on the tokens ``trusted(p, p_old, logp,
    old, A)`` keeps, and its stats."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0)).detach()
    keep = trusted(logp.detach().exp(), old.detach().exp(), logp.detach(), old.detach(), adv.detach()).to(logp.dtype)
    pg = _weighted(-adv * torch.clamp(ratio, max=ratio_cap) * logp * keep, weights)
    clipfrac = masked_mean(1.0 - keep, mask)
    clipfrac_lower = masked_mean((ratio > ratio_cap).to(logp.dtype) * keep, mask)
    return pg, clipfrac.detach(), clipfrac_lower.detach(), approx_kl


def policy_loss_dppo_tv(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, ratio_cap: float, agg: str):
    """DPPO-Binary-TV: tokens kept where ``p - p_old <= clip_eps_high`` (A > 0) or
    ``>= -clip_eps_low`` (A <= 0)."""
    def trusted(p, p_old, logp, old, adv):
        return torch.where(adv > 0, p - p_old <= clip_eps_high, p - p_old >= -clip_eps_low)

    pg, *stats = _dppo(logprobs, old_logprobs, advantages, mask, weights, ratio_cap, trusted)
    return aggregate(pg, mask, agg), *stats


def policy_loss_dppo_kl(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, ratio_cap: float, agg: str):
    """DPPO-Binary-KL: the binary KL ``p_old log(p_old/p) + (1-p_old) log((1-p_old+1e-8)/(1-p+1e-8))``
    at most clip_eps_high (A > 0) / clip_eps_low (A <= 0), or the probability moved the safe way."""
    def trusted(p, p_old, logp, old, adv):
        binary_kl = p_old * (old - logp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        return torch.where(adv > 0, (binary_kl <= clip_eps_high) | (p <= p_old), (binary_kl <= clip_eps_low) | (p >= p_old))

    pg, *stats = _dppo(logprobs, old_logprobs, advantages, mask, weights, ratio_cap, trusted)
    return aggregate(pg, mask, agg), *stats


def policy_loss_dro(logprobs, old_logprobs, advantages, mask, weights, dro_beta: float, agg: str):
    """DRO: ``-(A * logp - dro_beta / 2 * (logp - old)^2)``."""
    logp, old, adv, weights = _masked(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    pg = _weighted(-(adv * logp - 0.5 * dro_beta * log_ratio.square()), weights)
    return aggregate(pg, mask, agg), approx_kl


# --------------------------------------------------------------------------- rollout correction

# exp() of a log-ratio outside [-20, 20] is clamped there (as verl's SAFETY_BOUND): a weight
# never overflows, whatever the engines disagree on.
_LOG_RATIO_BOUND = 20.0


def rollout_correction_weights(old_logprobs, rollout_logprobs, mask, mode: str, threshold: float, threshold_low: float, batch_normalize: bool):
    """Importance weights ``pi_train / pi_rollout`` per token (``token_*``) or per sequence
    (``seq_*``, ``exp`` of the row's summed log-ratio, on each of its tokens), truncated at
    ``threshold`` (``*_tis``) or zeroed outside ``[threshold_low, threshold]`` (``*_mis``);
    with ``batch_normalize`` divided by their mean (over tokens, or over non-empty rows for
    ``seq_*``) when that mean exceeds 1e-8.  0 at masked positions; no gradient."""
    old, rollout = _masked(mask, old_logprobs.detach(), rollout_logprobs.detach())
    log_ratio = old - rollout
    if mode.startswith("seq"):
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old)
    raw = torch.where(mask, log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp(), 0.0)
    if mode.endswith("tis"):
        weights = raw.clamp(max=threshold)
    else:
        weights = torch.where((raw >= threshold_low) & (raw <= threshold), raw, 0.0)
    if batch_normalize:
        if mode.startswith("seq"):
            rows = mask.any(-1)
            # every valid token of a row holds its weight (all >= 0); a row of no token holds 0
            row_weight = weights.amax(-1) if weights.shape[-1] else weights.new_zeros(weights.shape[:-1])
            mean = torch.where(rows, row_weight, 0.0).sum() / rows.sum().clamp_min(1)
        else:
            mean = masked_mean(weights, mask)
        weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights
