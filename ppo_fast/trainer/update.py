"""The optimisation phase: several PPO epochs over shuffled minibatches of one batch of rollouts."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch

import ppo_fast as pf

from .rollout import Batch, forward
from .scoring import check_finite


@dataclass
class Experience:
    """What the update needs from one batch of rollouts (all ``[B, T]`` over response tokens)."""

    batch: Batch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    old_values: torch.Tensor | None
    returns: torch.Tensor | None
    weights: torch.Tensor | None = None  # per-token policy-loss weights (rollout correction)

    def rows(self, index: torch.Tensor) -> Experience:
        def pick(x):
            return None if x is None else x[index]

        return Experience(self.batch.rows(index), self.old_logprobs[index], self.advantages[index],
                          pick(self.old_values), pick(self.returns), pick(self.weights))


def ppo_losses(policy, critic, exp: Experience, cfg):
    """``(total loss, stats)`` for one micro-batch: clipped policy loss + vf_coef * value loss - ent_coef * entropy."""
    mask = exp.batch.response_mask
    logprobs, entropy, values = forward(
        policy, critic, exp.batch, temperature=cfg.temperature, entropy=True, values=exp.old_values is not None
    )
    pg_loss, pg_stats = pf.clipped_policy_loss(logprobs, exp.old_logprobs, exp.advantages, mask,
                                               clip_eps=cfg.cliprange, agg=cfg.loss_agg, weights=exp.weights)
    mean_entropy = pf.masked_mean(entropy, mask)
    loss = pg_loss - cfg.ent_coef * mean_entropy
    stats = {
        "loss/policy_avg": pg_loss.detach(),
        "policy/clipfrac_avg": pg_stats["clipfrac"],
        "policy/approxkl_avg": pg_stats["approx_kl"],
        "policy/entropy_avg": mean_entropy.detach(),
    }
    if values is not None:
        v_loss, v_stats = pf.value_loss(values, exp.old_values, exp.returns, mask, clip=cfg.cliprange_value, agg=cfg.loss_agg)
        loss = loss + cfg.vf_coef * v_loss
        stats["loss/value_avg"] = v_loss.detach()
        stats["val/clipfrac_avg"] = v_stats["clipfrac"]
    return loss, stats


def ppo_update(policy, critic, optimizer, scheduler, exp: Experience, cfg, step: int, autocast=contextlib.nullcontext) -> dict:
    """Run ``num_ppo_epochs`` over ``num_mini_batches`` shuffled minibatches; return the mean stats.

    Each minibatch is one optimizer step, accumulated over ``gradient_accumulation_steps``
    micro-batches.  A non-finite loss raises before it reaches the weights; the
    caller then keeps the last good checkpoint instead of saving these weights.
    """
    rows = exp.old_logprobs.shape[0]
    minibatch = rows // cfg.num_mini_batches
    micro = minibatch // cfg.gradient_accumulation_steps
    params = [p for group in optimizer.param_groups for p in group["params"]]
    totals: dict[str, list[torch.Tensor]] = defaultdict(list)
    policy.train()
    if critic is not None:
        critic.train()
    for _ in range(cfg.num_ppo_epochs):
        order = torch.randperm(rows, device=exp.old_logprobs.device)
        for mb_start in range(0, rows, minibatch):
            optimizer.zero_grad(set_to_none=True)
            for start in range(mb_start, mb_start + minibatch, micro):
                with autocast():
                    loss, stats = ppo_losses(policy, critic, exp.rows(order[start : start + micro]), cfg)
                check_finite("loss", loss.detach(), step)
                (loss / cfg.gradient_accumulation_steps).backward()
                for name, value in stats.items():
                    totals[name].append(value)
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
    policy.eval()
    if critic is not None:
        critic.eval()
    return {name: torch.stack(values).mean().item() for name, values in totals.items()}
