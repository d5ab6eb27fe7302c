"""Reference KL estimators and KL-penalized rewards."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import DEVICES, clamp, in_common_dtype, masked_inputs

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
    # k3 (Schulman's low-variance estimator), in float64 for every dtype and rounded once, so
    # that a float32 k3 is monotone in d.  The inner clamp only keeps exp finite for +-inf
    # inputs; the outer clamp to [-10, 10] is the estimator's definition.
    d = clamp((-log_ratio).double(), -20.0, 20.0)
    return clamp(k3_of(d), -10.0, 10.0).to(log_ratio.dtype)


# exp(d) - d - 1 cancels where |d| is small (in float32 it is 0 at |d| = 1e-4, where the
# truth is 5e-9): there its Taylor series to d^18 / 18!, whose truncation is below float64's
# rounding for |d| < 1; beyond, the plain form loses a few ulps at most (the kernels use the
# same split, csrc/common/loss_math.h).
K3_SERIES_BELOW = 1.0
K3_SERIES_TERMS = 18


def k3_of(d: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 of float64 ``d`` within a few ulps for every d: below the cut its series in
    nested form, 1/2 (1 + d/3 (1 + d/4 (... (1 + d/18)))) d^2."""
    series = torch.ones_like(d)
    for n in range(K3_SERIES_TERMS, 2, -1):
        series = 1.0 + series * d * (1.0 / n)  # as the kernels: times 1/n rounded, no divide
    return torch.where(d.abs() < K3_SERIES_BELOW, 0.5 * series * (d * d), d.exp() - d - 1.0)


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
