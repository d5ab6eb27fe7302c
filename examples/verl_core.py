"""verl's own PPO functions computed by ppo_fast (``ppo_fast.integrations.verl``).

    pip install --no-deps verl==0.9.1   # its PPO core (verl.trainer.ppo.core_algos), as the README says
    pip install omegaconf ray tensordict codetiming pylatexenc orjson
    python examples/verl_core.py

``patch()`` replaces verl's advantage estimators, KL penalty and policy and value losses by
ppo_fast's ops, in place: verl's trainer calls them as before.  Here the functions are called
directly on random rollouts, patched and not, and agree.
"""

from __future__ import annotations

import torch
from verl.trainer.ppo import core_algos

import ppo_fast.integrations
import ppo_fast.integrations.verl as pf_verl


def rollouts(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rows, length = 8, 16
    mask = (torch.arange(length) < torch.randint(4, length + 1, (rows, 1), generator=gen)).float()
    logp = torch.randn(rows, length, generator=gen) * 0.1 - 1.0
    return dict(
        rewards=torch.randn(rows, length, generator=gen) * mask,
        values=torch.randn(rows, length, generator=gen),
        mask=mask,
        old=logp,
        new=logp + torch.randn(rows, length, generator=gen) * 0.05,
    )


def actor_config():
    """verl's actor settings of the policy loss (clip ratios, the dual clip, the aggregation)."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )


def ppo_step(x: dict) -> tuple:
    """verl's GAE, then its vanilla clipped policy loss on the advantages."""
    advantages, returns = core_algos.compute_gae_advantage_return(x["rewards"], x["values"], x["mask"], 1.0, 0.95)
    policy_loss = core_algos.get_policy_loss_fn("vanilla")
    loss, metrics = policy_loss(x["old"], x["new"], advantages, x["mask"], "token-mean", actor_config())
    return advantages, returns, loss


def main():
    x = rollouts()
    theirs = ppo_step(x)
    with pf_verl.patch():  # verl's functions are ppo_fast's inside the block
        ours = ppo_step(x)
    valid = x["mask"].bool()  # verl leaves carried values at masked positions, ppo_fast zeros
    for name, a, b in zip(("advantages", "returns", "policy loss"), ours, theirs):
        a, b = (a[valid], b[valid]) if a.dim() else (a, b)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        print(f"{name}: ppo_fast equals verl (max |difference| {float((a - b).abs().max()):.2e})")
    served = ppo_fast.integrations.counts("verl")
    print(f"calls served by ppo_fast: {served}")
    return served


if __name__ == "__main__":
    assert sum(main().values()) > 0
