"""Reference policy losses: the clipped surrogate (vanilla) and every registered mode (verl 0.9.1)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ...spec import POLICY_LOSS_MODES
from ._common import DEVICES, clamp, masked_inputs
from .aggregate import aggregate, aggregate_packed, masked_mean

# Every policy-loss mode's op (vanilla is clipped_policy_loss).
SUPPORTED = {mode.op: DEVICES for mode in POLICY_LOSS_MODES.values()}


def clipped_policy_loss(
    logprobs, old_logprobs, advantages, mask, weights, *, clip_eps_low: float, clip_eps_high: float, dual_clip, agg: str
):
    """PPO clipped surrogate (to minimise) and its stats ``(loss, clipfrac, clipfrac_lower, approx_kl)``."""
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    ratio = torch.exp(clamp(logp - old, -20.0, 20.0))
    unclipped = -adv * ratio
    clipped = -adv * clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
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


# --------------------------------------------------------------------------- policy-loss modes
# The registry's modes (ppo_fast.spec.POLICY_LOSS_MODES; vanilla is clipped_policy_loss above),
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


class _PaddedRows:
    """The rows of ``[B, T]`` tensors, for the sequence-level modes (``_PackedRows``: packed segments)."""

    mean = staticmethod(_row_mean)
    aggregate = staticmethod(aggregate)

    @staticmethod
    def spread(per_row, like):
        return per_row.unsqueeze(-1).expand_as(like)


class _PackedRows:
    def __init__(self, segments):
        self.segments = segments

    def mean(self, x, mask):
        return self.segments.sum(torch.where(mask, x, 0.0)) / self.segments.sum(mask.to(x.dtype)).clamp_min(1)

    def spread(self, per_row, like):
        return self.segments.spread(per_row)

    def aggregate(self, per_token, mask, agg):
        return aggregate_packed(self.segments, per_token, mask, agg)


def policy_loss_gspo(
    logprobs, old_logprobs, advantages, mask, weights, *, clip_eps_low: float, clip_eps_high: float, agg: str, rows=None
):
    """GSPO: per token ``s = sg(exp(mean_t log r)) * pi / sg(pi)`` (log clamped at 10),
    then the clipped surrogate of ``s``.  No gradient reaches old_logprobs.  ``rows``: the packed
    layout's segments (``_PackedRows``), else the rows of ``[B, T]`` inputs."""
    rows = rows or _PaddedRows
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    seq_log_ratio = rows.spread(rows.mean(log_ratio, mask).detach(), logp)
    ratio = torch.exp(clamp(logp - logp.detach() + seq_log_ratio, high=10.0))
    unclipped = -adv * ratio
    clipped = -adv * clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = _weighted(torch.maximum(unclipped, clipped), weights)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return rows.aggregate(pg, mask, agg), clipfrac.detach(), _no_stat(logp), approx_kl


def policy_loss_geo_mean(
    logprobs, old_logprobs, advantages, mask, weights, *, clip_eps_low: float, clip_eps_high: float, agg: str, rows=None
):
    """GMPO: per row ``-mean_t(A) * exp(mean_t sign(A) * min(sign(A) log r, sign(A) clip(log r,
    -clip_eps_low, clip_eps_high)))``, times the geometric mean of the row's ``weights``;
    each valid token carries its row's loss into ``agg``.  ``rows`` as in ``policy_loss_gspo``."""
    rows = rows or _PaddedRows
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    sign = torch.sign(adv)
    clamped = clamp(log_ratio, -clip_eps_low, clip_eps_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    row_loss = -rows.mean(adv, mask) * torch.exp(rows.mean(kept, mask))
    if weights is not None:  # verl's geometric mean of the token weights, with its 1e-10
        row_loss = row_loss * torch.exp(rows.mean(torch.log(weights + 1e-10), mask))
    pg = rows.spread(row_loss, logp)
    clipped = log_ratio != clamped
    clipfrac = masked_mean((clipped & (adv > 0)).float(), mask)
    clipfrac_lower = masked_mean((clipped & (adv < 0)).float(), mask)
    return rows.aggregate(pg, mask, agg), clipfrac.detach(), clipfrac_lower.detach(), approx_kl


def sequence_level_packed(op: str, segments, *args, **kwargs):
    """A sequence-level mode (GSPO, GMPO) on packed ``[N]`` tokens, each segment a row."""
    fn = {"policy_loss_gspo": policy_loss_gspo, "policy_loss_geo_mean": policy_loss_geo_mean}[op]
    return fn(*args, rows=_PackedRows(segments), **kwargs)


def policy_loss_sapo(logprobs, old_logprobs, advantages, mask, weights, *, tau_pos: float, tau_neg: float, agg: str):
    """SAPO: ``-A * sigmoid(tau * (r - 1)) * 4 / tau`` with tau_pos where A > 0, else tau_neg."""
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(clamp(log_ratio, -20.0, 20.0))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))  # in the compute dtype
    pg = _weighted(-adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), weights)
    return aggregate(pg, mask, agg), _no_stat(logp), _no_stat(logp), approx_kl


def policy_loss_cispo(
    logprobs, old_logprobs, advantages, mask, weights, *, clip_eps_low: float, clip_eps_high: float, agg: str
):
    """CISPO: ``-sg(clip(r, 1 - clip_eps_low, 1 + clip_eps_high)) * A * logp``."""
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0)).detach()
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg = _weighted(-clipped_ratio * adv * logp, weights)
    clipfrac = masked_mean((ratio != clipped_ratio).float(), mask)
    return aggregate(pg, mask, agg), clipfrac.detach(), _no_stat(logp), approx_kl


def policy_loss_gpg(logprobs, old_logprobs, advantages, mask, weights, *, agg: str):
    """GPG: ``-A * logp`` (old_logprobs is not read)."""
    logp, adv, weights = masked_inputs(mask, logprobs, advantages, weights)
    return (aggregate(_weighted(-adv * logp, weights), mask, agg),)


def policy_loss_clip_cov(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    weights,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    agg: str,
):
    """Clip-Cov: the clipped surrogate (ratio unclamped), except that of the unclipped tokens
    whose ``(A - mean A) * (logp - mean logp)`` lies in ``(clip_cov_lb, clip_cov_ub)``,
    ``max(1, int(clip_cov_ratio * tokens))`` drawn at random (``torch.randperm``, the default
    CPU generator, as verl) contribute nothing."""
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
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


def policy_loss_kl_cov(
    logprobs, old_logprobs, advantages, mask, weights, *, kl_cov_ratio: float, ppo_kl_coef: float, agg: str
):
    """KL-Cov: ``-A * r`` (unclamped), plus ``ppo_kl_coef * |log r|`` on the
    ``max(1, int(kl_cov_ratio * tokens))`` valid tokens of largest
    ``(A - mean A) * (logp - mean logp)``; stat: mean ``|log r|``."""
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
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


def _dppo(logprobs, old_logprobs, advantages, mask, weights, *, ratio_cap, trusted):
    """DPPO's loss ``-A * sg(min(r, ratio_cap)) * logp`` on the tokens ``trusted(p, p_old, logp,
    old, A)`` keeps, and its stats."""
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0)).detach()
    keep = trusted(logp.detach().exp(), old.detach().exp(), logp.detach(), old.detach(), adv.detach()).to(logp.dtype)
    pg = _weighted(-adv * torch.clamp(ratio, max=ratio_cap) * logp * keep, weights)
    clipfrac = masked_mean(1.0 - keep, mask)
    clipfrac_lower = masked_mean((ratio > ratio_cap).to(logp.dtype) * keep, mask)
    return pg, clipfrac.detach(), clipfrac_lower.detach(), approx_kl


def policy_loss_dppo_tv(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    weights,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    ratio_cap: float,
    agg: str,
):
    """DPPO-Binary-TV: tokens kept where ``p - p_old <= clip_eps_high`` (A > 0) or
    ``>= -clip_eps_low`` (A <= 0)."""

    def trusted(p, p_old, logp, old, adv):
        return torch.where(adv > 0, p - p_old <= clip_eps_high, p - p_old >= -clip_eps_low)

    pg, *stats = _dppo(logprobs, old_logprobs, advantages, mask, weights, ratio_cap=ratio_cap, trusted=trusted)
    return aggregate(pg, mask, agg), *stats


def policy_loss_dppo_kl(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    weights,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    ratio_cap: float,
    agg: str,
):
    """DPPO-Binary-KL: the binary KL ``p_old log(p_old/p) + (1-p_old) log((1-p_old+1e-8)/(1-p+1e-8))``
    at most clip_eps_high (A > 0) / clip_eps_low (A <= 0), or the probability moved the safe way."""

    def trusted(p, p_old, logp, old, adv):
        binary_kl = p_old * (old - logp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        return torch.where(
            adv > 0, (binary_kl <= clip_eps_high) | (p <= p_old), (binary_kl <= clip_eps_low) | (p >= p_old)
        )

    pg, *stats = _dppo(logprobs, old_logprobs, advantages, mask, weights, ratio_cap=ratio_cap, trusted=trusted)
    return aggregate(pg, mask, agg), *stats


def policy_loss_dro(logprobs, old_logprobs, advantages, mask, weights, *, dro_beta: float, agg: str):
    """DRO: ``-(A * logp - dro_beta / 2 * (logp - old)^2)``."""
    logp, old, adv, weights = masked_inputs(mask, logprobs, old_logprobs, advantages, weights)
    log_ratio, approx_kl = _log_ratio_and_kl(mask, logp, old)
    pg = _weighted(-(adv * logp - 0.5 * dro_beta * log_ratio.square()), weights)
    return aggregate(pg, mask, agg), approx_kl
