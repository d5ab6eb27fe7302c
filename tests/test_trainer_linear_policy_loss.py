"""The update through pf.linear_policy_loss (the policy scored through the fused LM head): the same
total loss, stats and gradients of every policy and critic parameter as the two-pass path
(linear_token_logprobs, then policy_loss, the KL loss term and the entropy bonus)."""

from __future__ import annotations

import pytest
import torch

import ppo_fast as pf
from ppo_fast.trainer import PPOTrainer
from ppo_fast.trainer import update as update_module
from ppo_fast.trainer.linear_policy_loss import has_fast_backend
from ppo_fast.trainer.rollout import forward, generate, scores_through_fused_head
from ppo_fast.trainer.update import Experience, ppo_losses


def trainer_and_experience(tiny_config, **overrides):
    cfg = tiny_config(steps=1, batch_size=4, group_size=2, sft_steps=2, eval_size=4, entropy_coef=0.01, **overrides)
    trainer = PPOTrainer(cfg)
    torch.manual_seed(0)
    sampling = dict(max_new_tokens=4, temperature=1.0, top_p=1.0, greedy=False)
    batch = generate(trainer.policy, trainer.tokenizer, ["1+2=", "3+4=", "5+6=", "7+8="], **sampling)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        old, _, values = forward(
            trainer.policy, trainer.critic, batch, temperature=cfg.temperature, values=trainer.critic is not None
        )
    old = old - 0.2 * torch.rand(old.shape, generator=gen)
    advantages = torch.randn(old.shape, generator=gen)
    ref = old - 0.3 * torch.rand(old.shape, generator=gen)
    weights = torch.rand(old.shape, generator=gen) + 0.5
    returns = None if values is None else values + torch.randn(old.shape, generator=gen)
    exp = Experience(batch, old, advantages, values, returns, ref, 0.2, weights)
    return trainer, cfg, exp


def loss_stats_grads(trainer, cfg, exp):
    params = [p for m in (trainer.policy, trainer.critic) if m is not None for p in m.parameters() if p.requires_grad]
    loss, stats, _ = ppo_losses(trainer.policy, trainer.critic, exp, cfg, need_logprobs=False)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), stats, grads


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_mode": "vanilla", "advantage_method": "grpo", "kl_coef": 0.2},
        {"loss_mode": "gspo", "advantage_method": "grpo", "agg": "seq-mean-token-mean", "kl_coef": 0.2},
        {"loss_mode": "vanilla", "advantage_method": "gae", "agg": "token-sum", "dual_clip": 3.0},
        {"loss_mode": "dro", "advantage_method": "grpo", "loss_mode_params": "dro_beta=0.1", "kl_coef": 0.2},
    ],
    ids=["vanilla-kl-loss", "gspo", "vanilla-with-critic", "dro"],
)
def test_fused_update_equals_the_two_pass_path(tiny_config, monkeypatch, overrides):
    trainer, cfg, exp = trainer_and_experience(tiny_config, **overrides)
    assert scores_through_fused_head(trainer.policy, exp.old_logprobs.device)
    assert has_fast_backend(cfg.loss_mode, "cpu"), "the native CPU backend serves every one-pass mode"
    calls = []
    real = update_module.linear_policy_objective
    monkeypatch.setattr(update_module, "linear_policy_objective", lambda *a: calls.append(1) or real(*a))
    fused_loss, fused_stats, fused_grads = loss_stats_grads(trainer, cfg, exp)
    assert calls, "the update did not go through linear_policy_objective"
    monkeypatch.setattr(update_module, "linear_policy_objective", lambda *a: None)  # the two-pass path
    loss, stats, grads = loss_stats_grads(trainer, cfg, exp)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    assert list(fused_stats) == list(stats)
    for name in stats:
        torch.testing.assert_close(fused_stats[name], stats[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sum(g is not None for g in fused_grads) == sum(g is not None for g in grads) > 0
    for got, want in zip(fused_grads, grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_modes_without_a_fast_one_pass_op_keep_the_two_pass_path():
    modes = pf.policy_loss_modes()
    for name, mode in modes.items():  # the native CPU backend serves every one-pass mode
        assert has_fast_backend(name, "cpu") == mode.fused_head, name
    assert not has_fast_backend("clip_cov", "cpu")  # a selection across the batch
