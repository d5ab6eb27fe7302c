"""On-policy guarantees of the trainer: the old, new and reference log-probs are taken under the
distribution the rollouts were sampled from, and the ratio is exactly 1 before the first update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ppo_fast as pf
from ppo_fast.trainer import PPOTrainer, TrainerConfig, default_task, rollout
from ppo_fast.trainer.config import ConfigError
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.rollout import forward, generate


def run(tmp_path, name, **overrides) -> list[dict]:
    values = dict(
        output_dir=str(tmp_path / name),
        steps=2,
        batch_size=8,
        num_ppo_epochs=2,
        sft_steps=5,
        eval_size=8,
        sample_every=0,
        save_every=0,
        learning_rate=1e-3,
    )
    values.update(overrides)
    cfg = TrainerConfig(**values)
    PPOTrainer(cfg, log=lambda _: None).train()
    return read_metrics(Path(cfg.output_dir) / METRICS_FILE)


@pytest.mark.parametrize(
    "layout",
    [
        dict(num_mini_batches=1, gradient_accumulation_steps=1),
        dict(num_mini_batches=2, gradient_accumulation_steps=1),
        dict(num_mini_batches=2, gradient_accumulation_steps=2),
        dict(num_mini_batches=1, gradient_accumulation_steps=4, group_size=2, advantage_method="grpo"),
    ],
    ids=["1x1", "2x1", "2x2", "1x4-grpo"],
)
def test_ratio_is_exactly_one_before_the_first_update(tmp_path, layout, capsys):
    metrics = run(tmp_path, "run", **layout)
    assert [row["policy/ratio_dev_at_start"] for row in metrics] == [0.0, 0.0]
    assert "ratio is not 1" not in capsys.readouterr().err


def test_ratio_is_exactly_one_with_every_micro_batch_packed(tmp_path, monkeypatch):
    from ppo_fast.trainer import packing

    if why := packing.problem(default_task.build_model(default_task.build_tokenizer(), 0), torch.device("cpu")):
        pytest.skip(why)  # this transformers does not mask packed sequences: the trainer does not pack
    packed = []
    real = packing.pack
    monkeypatch.setattr(packing, "PACK_BELOW", 1.0)  # the built-in task's rows pack whatever their padding
    monkeypatch.setattr(packing, "pack", lambda *args: packed.append(1) or real(*args))
    metrics = run(tmp_path, "run", num_mini_batches=2, gradient_accumulation_steps=2)
    assert packed and [row["policy/ratio_dev_at_start"] for row in metrics] == [0.0, 0.0]


def test_ratio_is_exactly_one_on_the_logits_path_with_truncation(tmp_path, monkeypatch):
    calls = []

    def no_fused_head(model, device):
        calls.append(type(model).__name__)
        return None, "the test scores from the logits"

    monkeypatch.setattr(rollout, "_fused_head", no_fused_head)
    metrics = run(tmp_path, "run", num_mini_batches=2, top_k=5, top_p=0.9, backend="reference")
    assert calls and [row["policy/ratio_dev_at_start"] for row in metrics] == [0.0, 0.0]


def test_ratio_is_exactly_one_through_the_fused_head_with_truncation(tmp_path):
    metrics = run(tmp_path, "run", num_mini_batches=2, gradient_accumulation_steps=2, top_p=0.8, backend="reference")
    assert [row["policy/ratio_dev_at_start"] for row in metrics] == [0.0, 0.0]


def test_dropout_on_is_reported_once(tmp_path, capsys, monkeypatch):
    from ppo_fast.trainer import update

    monkeypatch.setattr(update, "_warned_ratio", False)
    build = default_task.build_model

    def with_dropout(*args, **kwargs):
        model = build(*args, **kwargs)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.3
        return model

    monkeypatch.setattr(default_task, "build_model", with_dropout)
    metrics = run(tmp_path, "run", disable_dropout=False, sft_steps=0)
    assert all(row["policy/ratio_dev_at_start"] > 0 for row in metrics)
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


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(logprobs_support="both"), "logprobs_support"),
        (dict(min_p=0.1, top_p=0.9), "rollout-engine vllm"),
    ],
)
def test_bad_sampling_options_are_named(overrides, words):
    with pytest.raises(ConfigError, match=words):
        TrainerConfig(**overrides).validate()


def test_full_support_scores_without_truncation():
    assert TrainerConfig(top_k=5, logprobs_support="full").logprob_truncation() == {}
    assert TrainerConfig(top_k=5, top_p=0.9).logprob_truncation() == {"top_k": 5, "top_p": 0.9, "min_p": 0.0}
