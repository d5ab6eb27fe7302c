"""On-policy guarantees of the trainer: the old, new and reference log-probs are taken under the
distribution the rollouts were sampled from, and the ratio is exactly 1 before the first update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ppo_fast as pf
from ppo_fast.trainer import PPOTrainer, TrainerConfig, default_task, packing, rollout, update
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.rollout import forward, generate


@pytest.fixture
def ratios(tiny_config):
    """``train(**overrides)``: a run of two steps of two epochs; how far from 1 the ratio was at the
    start of each step's update."""

    def train(**overrides) -> list[float]:
        cfg = tiny_config(**{"num_ppo_epochs": 2, "sft_steps": 5, "eval_size": 8, **overrides})
        PPOTrainer(cfg).train()
        return [row["policy/ratio_dev_at_start"] for row in read_metrics(Path(cfg.output_dir) / METRICS_FILE)]

    return train


@pytest.mark.parametrize(
    "path, layout",
    [
        ("fused", dict(num_mini_batches=1, gradient_accumulation_steps=1)),
        ("fused", dict(num_mini_batches=2, gradient_accumulation_steps=1)),
        ("fused", dict(num_mini_batches=2, gradient_accumulation_steps=2)),
        ("fused", dict(num_mini_batches=1, gradient_accumulation_steps=4, group_size=2, advantage_method="grpo")),
        ("fused", dict(num_mini_batches=2, gradient_accumulation_steps=2, top_p=0.8, backend="reference")),
        ("packed", dict(num_mini_batches=2, gradient_accumulation_steps=2)),
        ("logits", dict(num_mini_batches=2, top_k=5, top_p=0.9, backend="reference")),
    ],
    ids=["1x1", "2x1", "2x2", "1x4-grpo", "2x2-top-p", "2x2-packed", "2x1-logits-top-k-top-p"],
)
def test_ratio_is_exactly_one_before_the_first_update(ratios, monkeypatch, capsys, path, layout):
    """Through the fused head (with truncation too), with every micro-batch packed, or on the logits path."""
    taken = []
    if path == "packed":
        if why := packing.problem(default_task.build_model(default_task.build_tokenizer(), 0), torch.device("cpu")):
            pytest.skip(why)  # this transformers does not mask packed sequences: the trainer does not pack
        real = packing.pack
        monkeypatch.setattr(packing, "PACK_BELOW", 1.0)  # the built-in task's rows pack whatever their padding
        monkeypatch.setattr(packing, "pack", lambda *args: taken.append(1) or real(*args))
    if path == "logits":
        no_fused_head = (None, "the test scores from the logits")
        monkeypatch.setattr(rollout, "_fused_head", lambda model, device: taken.append(1) or no_fused_head)
    assert ratios(**layout) == [0.0, 0.0]
    assert taken or path == "fused"
    assert "ratio is not 1" not in capsys.readouterr().err


def test_dropout_on_is_reported_once(ratios, capsys, monkeypatch):
    monkeypatch.setattr(update, "_warned_ratio", False)
    build = default_task.build_model

    def with_dropout(*args, **kwargs):
        model = build(*args, **kwargs)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.3
        return model

    monkeypatch.setattr(default_task, "build_model", with_dropout)
    assert all(dev > 0 for dev in ratios(disable_dropout=False, sft_steps=0))
    assert capsys.readouterr().err.count("ratio is not 1") == 1


def test_sampled_support_renormalises_and_full_does_not():
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed=3).eval()
    prompts = [default_task.prompt(a, 50 - a) for a in range(11, 17)]
    batch = generate(policy, tokenizer, prompts, max_new_tokens=3, temperature=1.0, top_p=0.7, greedy=False)
    mask = batch.response_mask
    with torch.no_grad(), pf.use_backend("reference"):
        full, _, _ = forward(policy, None, batch, temperature=1.0)
        sampled, _, _ = forward(policy, None, batch, temperature=1.0, truncation={"top_p": 0.7})
    finite = torch.isfinite(sampled) & mask
    # The sampled tokens lie in the kept set (the rollout drew them there), and renormalising
    # over a subset raises each one's log-prob by minus the log of the kept mass.
    assert bool(finite[mask].all())
    assert bool((sampled[finite] >= full[finite]).all()) and bool((sampled[finite] > full[finite]).any())


def test_full_support_scores_without_truncation():
    assert TrainerConfig(top_k=5, logprobs_support="full").logprob_truncation() == {}
    assert TrainerConfig(top_k=5, top_p=0.9).logprob_truncation() == {"top_k": 5, "top_p": 0.9, "min_p": 0.0}
