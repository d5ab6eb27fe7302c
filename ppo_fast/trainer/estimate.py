"""Advantages: GAE with the critic, or the critic-free group estimators GRPO and RLOO."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ppo_fast as pf

# GRPO's guard against a zero standard deviation (a group whose rewards are all equal), as in TRL.
GRPO_STD_EPS = 1e-4


@dataclass
class Estimate:
    advantages: torch.Tensor  # [B, T], 0 at masked tokens
    returns: torch.Tensor | None  # [B, T] value targets (gae only)
    rewards: torch.Tensor  # [B, T] KL-penalised per-token rewards
    kl: torch.Tensor  # [B, T] per-token KL estimate


def group_advantages(sequence_rewards: torch.Tensor, group_size: int, estimator: str) -> torch.Tensor:
    """One advantage per response from the other responses to the same prompt.

    Responses to one prompt are consecutive, ``group_size`` at a time.
    ``grpo``: ``(r_i - mean(group)) / (std(group) + 1e-4)`` (unbiased std, as DeepSeekMath/TRL);
    ``rloo``: ``r_i - mean(others)`` = ``G / (G - 1) * (r_i - mean(group))``.
    """
    grouped = sequence_rewards.float().view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        advantages = (grouped - mean) / (grouped.std(dim=1, keepdim=True) + GRPO_STD_EPS)
    elif estimator == "rloo":
        advantages = grouped - (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    else:
        raise ValueError(f"group estimator must be grpo or rloo, got {estimator!r}")
    return advantages.reshape(-1)


def estimate(
    scores, logprobs, ref_logprobs, values, mask, *, estimator: str, kl_coef: float, kl_estimator: str,
    gamma: float, lam: float, whiten: bool, group_size: int, whitener=pf.masked_whiten,
) -> Estimate:
    """Per-token KL-penalised rewards, then advantages (and value targets for GAE).

    For the group estimators a response's reward is its score minus ``kl_coef`` times
    its summed KL (the KL penalty sits in the reward, as in TRL's RLOO), and that one
    advantage applies to every token of the response.  ``whitener(x, mask)`` whitens (with
    statistics over all ranks in a distributed run).
    """
    rewards, kl = pf.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=kl_coef, estimator=kl_estimator)
    if estimator == "gae":
        advantages, returns = pf.gae(rewards, values, mask, gamma=gamma, lam=lam)
        if whiten:
            advantages = whitener(advantages, mask)
        return Estimate(advantages, returns, rewards, kl)
    per_response = group_advantages(rewards.sum(dim=-1), group_size, estimator)
    advantages = torch.where(mask, per_response.unsqueeze(-1), 0.0)
    if whiten and estimator == "rloo":
        advantages = whitener(advantages, mask)
    return Estimate(advantages, None, rewards, kl)
