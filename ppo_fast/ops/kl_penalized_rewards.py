"""Public ops: per-token KL estimates and the KL-penalised per-token reward."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._varlen import varlen
from ..backends import direct_op, resolve
from ..spec import KL_ESTIMATORS

__all__ = ["kl_estimate", "kl_penalized_rewards"]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_estimator: str = "k1"):
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.

    ``k1 = logp - ref``; ``k2 = (logp - ref)^2 / 2``;
    ``k3 = exp(ref - logp) - (ref - logp) - 1`` clamped to [-10, 10] (the log-ratio is
    first clamped to [-20, 20] so that +-inf inputs stay finite); ``abs = |logp - ref|``.
    Any shape, float32 output.
    """
    direct = direct_op("kl_estimate", logprobs)
    if direct is not None:
        try:
            return direct(logprobs, ref_logprobs, kl_estimator)
        except Exception:  # refused: the checks below name what
            pass
    check.tensor("logprobs", logprobs)
    check.tensor("ref_logprobs", ref_logprobs)
    check.same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    check.same_device(logprobs=logprobs, ref_logprobs=ref_logprobs)
    check.choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    return resolve("kl_estimate", logprobs.device.type)(logprobs, ref_logprobs, kl_estimator)


def _packed(segments, scores, logprobs, ref_logprobs, mask, *, kl_coef, kl_estimator="k1"):
    """The per-token terms on the packed tokens as one row (every backend's kernel, with a 0 score),
    then each sequence's score added at its last valid token, found on the device."""
    check.tensor("scores", scores, ndim=1)
    if scores.shape[0] != segments.sequences:
        raise ValueError(
            f"scores must have shape [S] = ({segments.sequences},) with cu_seqlens, got {tuple(scores.shape)}"
        )
    check.same_device(logprobs=logprobs, scores=scores)
    mask = check.mask("mask", mask, logprobs.shape)
    rewards, kl = kl_penalized_rewards(
        scores.new_zeros(1), logprobs[None], ref_logprobs[None], mask[None], kl_coef=kl_coef, kl_estimator=kl_estimator
    )
    if segments.tokens == 0:  # no token to carry a score
        return rewards[0], kl[0]
    last = segments.last_valid(mask)
    bonus = torch.where(last >= 0, scores.to(rewards.dtype), 0.0)  # a sequence without a valid token gets none
    return rewards[0].index_add(0, last.clamp_min(0), bonus), kl[0]


@varlen("logprobs", "ref_logprobs", "mask", packed=_packed)
def kl_penalized_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
):
    """Per-token reward ``r_t = -kl_coef * kl_t + score * [t is the row's last valid token]``.

    Args:
        scores: ``[B]`` sequence-level reward (e.g. the reward model's score).
        logprobs: ``[B, T]`` log-probs of the sampled tokens under the policy.
        ref_logprobs: ``[B, T]`` their log-probs under the frozen reference.
        mask: ``[B, T]`` 1/True at valid response tokens.
        kl_coef: the KL penalty coefficient beta (>= 0).
        kl_estimator: ``k1``, ``k2``, ``k3`` or ``abs`` (see :func:`kl_estimate`).

    Returns:
        ``(rewards, kl)``, both ``[B, T]`` float32 and 0 at masked positions.  A row
        with no valid token gets no score.
    """
    direct = direct_op("kl_penalized_rewards", logprobs, mask)
    # float64 scores with other log-probs take the conversion below
    if direct is not None and (getattr(scores, "dtype", None) is not torch.float64 or logprobs.dtype is torch.float64):
        try:
            return direct(scores, logprobs, ref_logprobs, mask, check.real("kl_coef", kl_coef, low=0.0), kl_estimator)
        except Exception:  # refused: the checks below name what
            pass
    check.tensor("logprobs", logprobs, ndim=2)
    check.tensor("ref_logprobs", ref_logprobs, ndim=2)
    check.same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    check.tensor("scores", scores, ndim=1)
    if scores.shape[0] != logprobs.shape[0]:
        raise ValueError(f"scores must have shape [B] = ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    check.same_device(logprobs=logprobs, ref_logprobs=ref_logprobs, scores=scores, mask=mask)
    mask = check.mask("mask", mask, logprobs.shape)
    kl_coef = check.real("kl_coef", kl_coef, low=0.0)
    check.choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    fn = resolve("kl_penalized_rewards", logprobs.device.type)
    if scores.dtype == torch.float64 and logprobs.dtype != torch.float64:
        # float64 scores make the rewards float64 (result_dtype): the kernels take
        # their compute dtype from the log-probs, so those come in float64 too.
        logprobs, ref_logprobs = logprobs.to(torch.float64), ref_logprobs.to(torch.float64)
    return fn(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator)
