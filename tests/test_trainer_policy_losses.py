"""The trainer on every registered policy-loss mode (--loss-mode), and its options' checks."""

import math
from pathlib import Path

import pytest

import ppo_fast as pf
from ppo_fast.trainer import PPOTrainer, TrainerConfig
from ppo_fast.trainer.config import POLICY_LOSSES, ConfigError
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics

# The parameters a mode needs beyond the defaults, at their example values.
NEEDED = {n: ",".join(f"{k}={v}" for k, v in m.example_params().items()) for n, m in pf.policy_loss_modes().items()}


def test_config_choices_are_the_registry():
    assert POLICY_LOSSES == tuple(pf.policy_loss_modes())


@pytest.fixture
def tiny(tiny_config):
    """``make(mode, **overrides)``: two steps of GRPO, groups of 4, on ``--loss-mode mode``."""

    def make(mode: str, **overrides) -> TrainerConfig:
        values = dict(batch_size=4, group_size=4, sft_steps=2, eval_size=4, advantage_method="grpo", loss_mode=mode)
        return tiny_config(mode, **{**values, "loss_mode_params": NEEDED.get(mode, ""), **overrides})

    return make


@pytest.mark.parametrize("mode", POLICY_LOSSES)
def test_every_policy_loss_trains_two_steps(tiny, mode):
    cfg = tiny(mode)
    PPOTrainer(cfg).train()
    metrics = read_metrics(Path(cfg.output_dir) / METRICS_FILE)
    assert len(metrics) == 2
    for row in metrics:
        assert math.isfinite(row["loss/policy_avg"])
        for stat in pf.policy_loss_modes()[mode].stats:  # the mode's stats are logged
            name = {"approx_kl": "approxkl", "approx_kl_abs": "approxkl_abs"}.get(stat, stat)
            assert math.isfinite(row[f"policy/{name}_avg"])


def test_asymmetric_and_dual_clip_reach_the_loss(tiny, monkeypatch):
    seen = []

    def spy(real):
        def call(*args, **kwargs):
            seen.append(kwargs)
            return real(*args, **kwargs)

        return call

    # The update calls linear_policy_loss (the fused LM head), else policy_objective.
    for name in ("policy_objective", "linear_policy_loss"):
        monkeypatch.setattr(pf, name, spy(getattr(pf, name)))
    options = dict(loss_mode="vanilla", clip_eps_low=0.1, clip_eps_high=0.28, dual_clip=3.0, agg="seq-mean-token-mean")
    PPOTrainer(tiny("vanilla", steps=1, **options)).train()
    assert seen and all({name: call[name] for name in options} == options for call in seen)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"loss_mode": "gpg", "clip_eps_high": 0.3},
            r"clip_eps_high \(--clip-eps-high\) does not apply to --loss-mode gpg",
        ),
        ({"loss_mode": "gspo", "dual_clip": 3.0}, r"dual_clip \(--dual-clip\) does not apply to --loss-mode gspo"),
        ({"loss_mode": "dro", "loss_mode_params": ""}, r"--loss-mode dro: .*needs dro_beta"),
        ({"loss_mode": "sapo", "loss_mode_params": "tau=1"}, r"--loss-mode sapo: .*got unexpected tau"),
        ({"loss_mode": "sapo", "loss_mode_params": "tau_pos=-1"}, r"tau_pos must be > 0"),
    ],
)
def test_bad_policy_loss_options_fail_before_loading(tiny, overrides, match):
    with pytest.raises(ConfigError, match=match):
        PPOTrainer(tiny(overrides.pop("loss_mode"), **overrides))
