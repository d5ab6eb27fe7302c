"""The update through pf.linear_policy_loss (the policy scored through the fused LM head): the same
total loss, stats and gradients of every policy and critic parameter as the two-pass path
(linear_token_logprobs, then policy_loss, the KL loss term and the entropy bonus); and the run's one
decision between them (update.loss_path)."""

from __future__ import annotations

import pytest
import torch

import ppo_fast as pf
from ppo_fast.trainer import PPOTrainer, TrainerConfig
from ppo_fast.trainer import update as update_module
from ppo_fast.trainer.models import Critic
from ppo_fast.trainer.rollout import forward, generate, scores_through_fused_head
from ppo_fast.trainer.update import Experience, LossPath, loss_path, ppo_losses

TWO_PASS = LossPath(fused=False, why="the test's two-pass path")


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
    exp = Experience(
        batch=batch,
        old_logprobs=old,
        advantages=advantages,
        old_values=values,
        returns=returns,
        ref_logprobs=ref,
        kl_coef=0.2,
        weights=weights,
    )
    return trainer, cfg, exp


def loss_stats_grads(trainer, cfg, exp, path):
    params = [p for m in (trainer.policy, trainer.critic) if m is not None for p in m.parameters() if p.requires_grad]
    loss, stats, _ = ppo_losses(trainer.policy, trainer.critic, exp, cfg, need_logprobs=False, path=path)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), stats, grads


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_mode": "vanilla", "advantage_method": "grpo", "kl_coef": 0.2},
        {"loss_mode": "gspo", "advantage_method": "grpo", "agg": "seq-mean-token-mean", "kl_coef": 0.2},
        {"loss_mode": "vanilla", "advantage_method": "gae", "agg": "token-sum", "dual_clip": 3.0},
        {"loss_mode": "dro", "advantage_method": "grpo", "loss_mode_params": "dro_beta=0.1", "kl_coef": 0.2},
        {"loss_mode": "vanilla", "advantage_method": "grpo", "top_p": 0.8, "top_k": 5, "kl_coef": 0.2},
    ],
    ids=["vanilla-kl-loss", "gspo", "vanilla-with-critic", "dro", "vanilla-top-p-top-k"],
)
def test_fused_update_equals_the_two_pass_path(tiny_config, monkeypatch, overrides):
    trainer, cfg, exp = trainer_and_experience(tiny_config, **overrides)
    assert scores_through_fused_head(trainer.policy, exp.old_logprobs.device)
    path = loss_path(trainer.policy, trainer.critic, cfg, exp.old_logprobs.device)
    assert path.fused, f"the native CPU backend serves every one-pass mode: {path}"
    assert trainer.loss_path == path
    calls = []
    real = update_module.fused_objective
    monkeypatch.setattr(update_module, "fused_objective", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fused_loss, fused_stats, fused_grads = loss_stats_grads(trainer, cfg, exp, path)
    assert calls, "the update did not go through fused_objective"
    calls.clear()
    loss, stats, grads = loss_stats_grads(trainer, cfg, exp, TWO_PASS)
    assert not calls
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    assert list(fused_stats) == list(stats)
    for name in stats:
        torch.testing.assert_close(fused_stats[name], stats[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sum(g is not None for g in fused_grads) == sum(g is not None for g in grads) > 0
    for got, want in zip(fused_grads, grads):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def _tiny_causal_lm():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=16))


def test_the_loss_path_is_decided_from_what_the_run_fixes():
    """One LossPath per run, with its reason: the mode's one-pass op, a shared critic, the backend and the
    head each keep the two-pass path; the sampler's truncation does not (the one pass takes it)."""
    policy, cpu = _tiny_causal_lm(), torch.device("cpu")
    for name, mode in pf.policy_loss_modes().items():  # the native CPU backend serves every one-pass mode
        assert loss_path(policy, None, TrainerConfig(loss_mode=name), cpu).fused == mode.fused_head, name
    assert "no one-pass form" in loss_path(policy, None, TrainerConfig(loss_mode="clip_cov"), cpu).why
    assert loss_path(policy, None, TrainerConfig(top_p=0.9, top_k=4, min_p=0.05), cpu).fused
    assert loss_path(policy, None, TrainerConfig(top_p=0.9, logprobs_support="full"), cpu).fused
    shared = Critic(8, None)
    assert "shared critic" in loss_path(policy, shared, TrainerConfig(advantage_method="gae"), cpu).why
    assert "no fast backend" in loss_path(policy, None, TrainerConfig(backend="reference"), cpu).why
    policy.config.logits_scaling = 2.0
    assert "transforms its logits" in loss_path(policy, None, TrainerConfig(), cpu).why
