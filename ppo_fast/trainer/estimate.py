"""Advantages: GAE with the critic, or any critic-free advantage method of the registry (pf.advantage_methods())."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import ppo_fast as pf


@dataclass
class Estimate:
    advantages: torch.Tensor  # [B, T], 0 at masked tokens
    returns: torch.Tensor | None  # [B, T] value targets (gae only)
    rewards: torch.Tensor  # [B, T] per-token rewards (KL-penalised when the KL is in the reward)
    kl: torch.Tensor  # [B, T] per-token KL estimate


def group_ids(rows: int, group_size: int, device) -> torch.Tensor:
    """The responses to one prompt are consecutive, ``group_size`` at a time (one group per
    sampled prompt, even when a prompt is drawn twice in a batch)."""
    return torch.arange(rows // group_size, device=device).repeat_interleave(group_size)


@dataclass(frozen=True)
class EstimateOptions:
    """How a batch's advantages are estimated (the trainer's options of that name)."""

    advantage_method: str
    kl_coef: float
    kl_estimator: str
    kl_in_reward: bool
    gamma: float
    lam: float
    whiten: bool
    group_size: int
    norm_by_std: bool = True
    params: dict = field(default_factory=dict)  # the method's other parameters (--advantage-params)

    @classmethod
    def of(cls, cfg, kl_coef: float) -> EstimateOptions:
        """The options of ``cfg`` (a TrainerConfig) with the KL controller's current ``kl_coef``."""
        return cls(
            advantage_method=cfg.advantage_method,
            kl_coef=kl_coef,
            kl_estimator=cfg.kl_estimator_used,
            kl_in_reward=cfg.kl_in_reward,
            gamma=cfg.gamma,
            lam=cfg.lam,
            whiten=cfg.whiten_advantages,
            group_size=cfg.group_size,
            norm_by_std=cfg.norm_by_std,
            params=cfg.advantage_kwargs(),
        )


def estimate(
    scores,
    logprobs,
    ref_logprobs,
    values,
    mask,
    options: EstimateOptions,
    *,
    baselines: torch.Tensor | None = None,
    whitener=pf.masked_whiten,
) -> Estimate:
    """Per-token rewards, then advantages (and value targets for GAE).

    With ``options.kl_in_reward`` the reward is ``score - kl_coef * KL`` per token (the critic-free
    estimators then see the score minus the summed KL); otherwise it is the score alone and
    the KL goes into the loss (``update.ppo_losses``).  ``baselines`` are remax's greedy rewards.  ``whitener(x, mask)`` whitens
    (with statistics over all ranks in a distributed run).
    """
    o = options
    kl_coef = o.kl_coef if o.kl_in_reward else 0.0
    rewards, kl = pf.kl_penalized_rewards(
        scores, logprobs, ref_logprobs, mask, kl_coef=kl_coef, kl_estimator=o.kl_estimator
    )
    method = pf.advantage_methods()[o.advantage_method]
    if method.needs_critic:
        advantages, returns = pf.gae(rewards, values, mask, gamma=o.gamma, lam=o.lam)
        if o.whiten:
            advantages = whitener(advantages, mask)
        return Estimate(advantages, returns, rewards, kl)
    offered = {"gamma": o.gamma, "norm_by_std": o.norm_by_std, "baselines": baselines, **o.params}
    params = {name: value for name, value in offered.items() if name in method.params}
    ids = group_ids(rewards.shape[0], o.group_size, rewards.device) if method.needs_groups else None
    advantages = pf.group_advantages(rewards, ids, mask, method=o.advantage_method, **params)
    if o.whiten and not method.normalized:
        advantages = whitener(advantages, mask)
    return Estimate(advantages, None, rewards, kl)
