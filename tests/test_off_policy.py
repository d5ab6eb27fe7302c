"""The off-policy-correct loss (--off-policy-loss, ppo_fast/trainer/off_policy.py): the HF engine's behaviour
log-probs mu are the trainer's under the sampling distribution, each mode's loss inputs, and the
engine/trainer metrics against values worked out by hand."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import ppo_fast as pf
from ppo_fast.trainer import PPOTrainer, TrainerConfig, default_task, off_policy, rollout
from ppo_fast.trainer.rollout import forward
from ppo_fast.trainer.rollout_hf import HFEngine
from ppo_fast.trainer.update import loss_path

PROMPTS = [default_task.prompt(a, b) for a, b in ((12, 34), (56, 78), (99, 10), (11, 11))] * 4


@pytest.mark.parametrize(
    "truncation",
    [dict(), dict(top_k=3), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=4, top_p=0.8)],
    ids=["none", "top_k", "top_p", "min_p", "top_k+top_p"],
)
def test_hf_engine_logprobs_are_the_trainers_under_the_sampling_distribution(truncation):
    """mu of the sampled tokens at temperature 0.7 equals the trainer's sampling-aware old log-probs on the
    same weights.  Both are float32 log-softmaxes of float32 logits of the same model; they differ by the
    KV cache's incremental attention against the full forward (another summation order): a few ulp of the
    logits (|z| < 10 here, ulp ~1e-6), at most doubled by the log-softmax and divided by T = 0.7, so
    1e-4 holds with room, while leaving out the temperature or a truncation moves them by > 1e-2."""
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed=5).eval()
    engine = HFEngine(policy, autocast=contextlib.nullcontext, synced_gpus=False)
    sampling = dict(top_k=0, top_p=1.0, min_p=0.0) | truncation
    torch.manual_seed(0)
    batch, mu = engine.generate(
        tokenizer, PROMPTS, max_new_tokens=6, temperature=0.7, greedy=False, device="cpu", **sampling
    )
    mask = batch.response_mask
    assert mu.dtype == torch.float32 and mu.shape == mask.shape and bool((mu[~mask] == 0).all())
    with torch.no_grad():
        old, _, _ = forward(policy, None, batch, temperature=0.7, truncation=sampling)
        plain, _, _ = forward(policy, None, batch, temperature=1.0)
    assert bool(torch.isfinite(mu[mask]).all())
    assert (old - mu)[mask].abs().max().item() <= 1e-4
    assert (plain - mu)[mask].abs().max().item() > 1e-2  # the test tells the sampling distribution apart
    if truncation:
        with torch.no_grad():
            untruncated, _, _ = forward(policy, None, batch, temperature=0.7)
        assert (mu - untruncated)[mask].max().item() > 1e-2  # renormalised over the kept tokens


def test_hf_engine_gives_no_logprobs_for_greedy_decoding():
    tokenizer = default_task.build_tokenizer()
    engine = HFEngine(
        default_task.build_model(tokenizer, seed=5).eval(), autocast=contextlib.nullcontext, synced_gpus=False
    )
    _, mu = engine.generate(
        tokenizer, PROMPTS[:2], max_new_tokens=3, temperature=1.0, top_p=1.0, greedy=True, device="cpu"
    )
    assert mu is None


def test_mismatch_metrics_by_hand():
    """pi_old and mu of five valid tokens with log-ratios 0, 1, -1, 0, 3 (and one masked token)."""
    old = torch.tensor([[0.0, -1.0, -2.0], [-0.5, -7.0, 0.0]])
    mu = torch.tensor([[0.0, -2.0, -1.0], [-0.5, -1.0, -3.0]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    e = math.e
    weights = pf.rollout_correction_weights(old, mu, mask, mode="token_tis", threshold=2.0)
    row = off_policy.mismatch_metrics(old, mu, mask, weights, "token_tis")
    assert row["rollout/is_ratio_min"] == pytest.approx(1 / e, rel=1e-6)
    assert row["rollout/is_ratio_max"] == pytest.approx(e**3, rel=1e-6)
    assert row["rollout/is_ratio_mean"] == pytest.approx((1 + e + 1 / e + 1 + e**3) / 5, rel=1e-6)
    # k3 = r - 1 - log r per token: 0, e - 2, 1/e, 0, and e^3 - 4 clamped at 10 (pf.kl_estimate's bound)
    assert row["rollout/kl"] == pytest.approx((e - 2 + 1 / e + 10) / 5, rel=1e-5)
    assert row["rollout/logprob_diff_mean"] == pytest.approx(5 / 5, rel=1e-6)
    assert row["rollout/logprob_diff_max"] == pytest.approx(3.0)
    # token_tis at 2 truncates the ratios e and e^3: two of five tokens; the weights 1, 2, 1/e, 1, 2
    assert row["rollout/is_corrected_frac"] == pytest.approx(2 / 5)
    assert row["rollout/correction_weight_mean"] == pytest.approx((1 + 2 + 1 / e + 1 + 2) / 5, rel=1e-6)
    # per sequence: the rows' ratios are e^0 and e^3 (the masked token left out): under 25, none is truncated
    weights = pf.rollout_correction_weights(old, mu, mask, mode="seq_tis", threshold=25.0)
    assert off_policy.mismatch_metrics(old, mu, mask, weights, "seq_tis")["rollout/is_corrected_frac"] == 0.0
    # token_mis at 2 masks the same two tokens the truncation would change
    weights = pf.rollout_correction_weights(old, mu, mask, mode="token_mis", threshold=2.0)
    masked = off_policy.mismatch_metrics(old, mu, mask, weights, "token_mis")["rollout/is_corrected_frac"]
    assert masked == pytest.approx(2 / 5)
    assert "rollout/is_corrected_frac" not in off_policy.mismatch_metrics(old, mu, mask)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # log pi - log mu per token: [0, 1, 0.5 | 0.5, 3 (masked), -2]; the rows' sums 1.5 and -1.5; threshold 2
        ("token_tis", [[1, 2 / math.e, 1], [1, 0, 1]]),  # min(r, 2) / r: only e is over 2
        ("token_mis", [[1, 0, 1], [1, 0, 1]]),  # 1 inside [0, 2], 0 outside
        ("seq_tis", [[2 / math.exp(1.5)] * 3, [1, 0, 1]]),  # the rows' ratios e^1.5 > 2 and e^-1.5
        ("seq_mis", [[0, 0, 0], [1, 0, 1]]),
    ],
)
def test_bypass_weights_reweigh_the_ratio_to_the_correction_by_hand(mode, expected):
    """In bypass mode the loss's ratio pi/mu is the whole importance ratio; the weight w / r makes a token's
    weight the correction's w (TIS: at most the threshold; MIS: 0 outside the band), not w * r."""
    logp = torch.tensor([[0.0, 1.0, 0.5], [0.5, 3.0, -2.0]], requires_grad=True)
    mu = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, True], [True, False, True]])
    cfg = TrainerConfig(off_policy_loss="bypass", rollout_correction=mode, rollout_correction_threshold=2.0)
    weights = off_policy.bypass_weights(logp, mu, mask, cfg)
    assert not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=0)


def test_the_modes_loss_path():
    """Bypass with a correction takes the two passes (the weights read each micro-batch's log-probs)."""
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed=0)
    device = torch.device("cpu")
    for cfg in (TrainerConfig(), TrainerConfig(off_policy_loss="bypass")):
        assert "bypass" not in loss_path(policy, None, cfg, device).why
    path = loss_path(policy, None, TrainerConfig(off_policy_loss="bypass", rollout_correction="token_tis"), device)
    assert not path.fused and "--off-policy-loss bypass" in path.why


def _trainer_with_shifted_engine(tiny_config, shift: float, **overrides):
    """A built-in trainer whose engine's log-probs are the true ones minus ``shift`` on odd positions (a
    behaviour policy that is not the trainer's), and the policy forwards ``_rollout`` runs."""
    trainer = PPOTrainer(tiny_config(sft_steps=2, temperature=0.7, **overrides), log=lambda m: None)
    generate = trainer.run.engine.generate

    def shifted(*args, **kwargs):
        batch, mu = generate(*args, **kwargs)
        odd = torch.arange(mu.shape[1]) % 2 == 1
        return batch, torch.where(odd & batch.response_mask, mu - shift, mu)

    trainer.run.engine.generate = shifted
    return trainer


@pytest.fixture
def policy_forwards(monkeypatch):
    """The models ``rollout.forward`` ran, in order."""
    seen = []
    real = rollout.forward

    def counting(model, *args, **kwargs):
        seen.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(rollout, "forward", counting)
    return seen


def test_bypass_uses_mu_as_old_and_skips_the_recompute(tiny_config, policy_forwards):
    trainer = _trainer_with_shifted_engine(tiny_config, 0.25, off_policy_loss="bypass", rollout_correction="token_mis")
    with pf.use_backend(trainer.run.cfg.backend):
        r = trainer._rollout(trainer.run.source.next(), trainer.run.cfg.batch_size)
    assert trainer.policy not in policy_forwards and trainer.reference in policy_forwards
    assert r.old_logprobs is r.engine_logprobs and r.loss_weights is None and not r.off_policy_metrics
    row = trainer.train_step()
    assert math.isfinite(row["loss/policy_avg"]) and "rollout/is_ratio_mean" not in row


def test_decoupled_uses_the_recomputed_pi_prox_and_weighs_by_pi_prox_over_mu(tiny_config, policy_forwards):
    trainer = _trainer_with_shifted_engine(tiny_config, 0.25, rollout_correction="token_tis")
    with pf.use_backend(trainer.run.cfg.backend):
        r = trainer._rollout(trainer.run.source.next(), trainer.run.cfg.batch_size)
    assert trainer.policy in policy_forwards
    mask = r.mask
    with torch.no_grad():
        prox, _, _ = forward(
            trainer.policy, None, r.batch, temperature=0.7, truncation=trainer.run.cfg.logprob_truncation()
        )
    torch.testing.assert_close(r.old_logprobs[mask], prox[mask], rtol=0, atol=1e-5)
    # the engine's mu is the true one less 0.25 at odd positions: there pi_prox / mu is e^0.25, else ~1
    odd = (torch.arange(mask.shape[1]) % 2 == 1) & mask
    assert (r.old_logprobs - r.engine_logprobs)[odd].sub(0.25).abs().max().item() < 1e-4
    expected = torch.where(mask, torch.exp(r.old_logprobs - r.engine_logprobs).clamp(max=2.0), 0.0)
    torch.testing.assert_close(r.loss_weights, expected, rtol=1e-6, atol=1e-7)
    assert r.loss_weights[odd].min().item() == pytest.approx(math.exp(0.25), rel=1e-4)
    assert r.off_policy_metrics["rollout/is_ratio_max"] == pytest.approx(math.exp(0.25), rel=1e-4)
