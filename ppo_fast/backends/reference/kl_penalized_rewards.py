"""Reference KL estimators and KL-penalized rewards."""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint

from ._common import DEVICES, in_common_dtype, masked_inputs

SUPPORTED = {"kl_estimate": DEVICES, "kl_penalized_rewards": DEVICES}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs."""
    logprobs, ref_logprobs = in_common_dtype(logprobs, ref_logprobs)
    log_ratio = logprobs - ref_logprobs
    if kl_estimator == "k1":
        return log_ratio
    if kl_estimator == "k2":
        return 0.5 * log_ratio.square()
    if kl_estimator == "abs":
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


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, kl_estimator: str):
    """``r_t = -kl_coef * kl_t`` at valid tokens, plus the score at each row's last valid token."""
    scores, logprobs, ref_logprobs = in_common_dtype(scores, logprobs, ref_logprobs)
    logprobs, ref_logprobs = masked_inputs(mask, logprobs, ref_logprobs)
    kl = torch.where(mask, kl_estimate(logprobs, ref_logprobs, kl_estimator), 0.0)
    rewards = -kl_coef * kl
    if mask.shape[-1] == 0:  # no token to carry a score
        return rewards, kl
    last, has_valid = last_valid_index(mask)
    bonus = torch.where(has_valid, scores.to(rewards.dtype), 0.0)
    rewards = rewards.scatter_add(-1, last.unsqueeze(-1), bonus.unsqueeze(-1))
    return rewards, kl
