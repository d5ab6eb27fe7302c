"""The PPO trainer and the ppo-fast CLI, on tiny models for a few steps on CPU."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppo_fast as pf
from ppo_fast.cli import main
from ppo_fast.trainer import (
    ConfigError,
    NonFiniteError,
    PPOTrainer,
    RewardError,
    TrainerConfig,
    checkpoint,
    default_task,
)
from ppo_fast.trainer.config import read_config_file
from ppo_fast.trainer.estimate import EstimateOptions, estimate
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.models import activation_checkpointing_on
from ppo_fast.trainer.rollout import Batch, forward, generate, response_mask_until_eos
from ppo_fast.trainer.scoring import RewardModelScorer
from ppo_fast.trainer.setup import lr_lambda
from ppo_fast.trainer.update import Experience, ppo_update

TRL_KEYS = {
    "objective/scores",
    "objective/kl",
    "objective/entropy",
    "policy/clipfrac_avg",
    "policy/approxkl_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "val/explained_variance",
    "lr",
    "time/rollout",
    "time/score",
    "time/estimate",
    "time/optimize",
    "throughput/tokens_per_s",
}


def tiny(tmp_path, name="run", **overrides) -> TrainerConfig:
    values = dict(
        output_dir=str(tmp_path / name),
        steps=2,
        batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=1,
        sft_steps=10,
        eval_size=16,
        sample_every=0,
        save_every=0,
        learning_rate=1e-3,
    )
    values.update(overrides)
    return TrainerConfig(**values)


def quiet(_message: str) -> None:
    pass


def rows(cfg: TrainerConfig) -> list[dict]:
    return read_metrics(Path(cfg.output_dir) / METRICS_FILE)


# ---------------------------------------------------------------------- end to end


def test_smoke_run_writes_metrics_checkpoint_plot_options_log_and_best(tmp_path):
    cfg = tiny(tmp_path, steps=3, save_every=2, eval_every=2, keep_best=True)
    said = []
    summary = PPOTrainer(cfg, log=said.append).train()
    assert summary["stop_reason"] == "done" and summary["steps_done"] == 3
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    metrics = rows(cfg)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert [("eval/score" in r) for r in metrics] == [False, True, False]  # the final evaluation is in the summary
    for row in metrics:
        assert TRL_KEYS <= row.keys(), TRL_KEYS - row.keys()
        assert all(math.isfinite(v) for v in row.values())
    out = Path(cfg.output_dir)
    assert (out / "curves.png").stat().st_size > 0
    assert json.loads((out / "summary.json").read_text())["steps_done"] == 3
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step-000002", "step-000003"]
    final = out / "checkpoints" / "step-000003"
    model = AutoModelForCausalLM.from_pretrained(final / "policy")
    tokenizer = AutoTokenizer.from_pretrained(final / "policy")
    assert tokenizer.decode(tokenizer("12+34=").input_ids) == "12+34="
    state = checkpoint.load_state(final)
    assert state.step == 3 and state.config["steps"] == 3
    critic_state = torch.load(final / "critic.pt")
    assert "head.summary.weight" in critic_state and any(k.startswith("backbone.") for k in critic_state)
    # The run folder remembers the run: its options (read back by --config), what it said, its best policy.
    assert TrainerConfig.from_dict(read_config_file(out / "run_config.yaml")) == cfg
    log = (out / "train.log").read_text().splitlines()
    assert log[0].startswith("--- ") and log[1:] == said
    scores = {2: metrics[1]["eval/score"], 3: summary["eval_after"]}
    best_step = 2 if scores[2] >= scores[3] else 3  # a tie keeps the earlier
    assert summary["best"] == {"step": best_step, "eval_score": scores[best_step], "path": "best"}
    assert AutoModelForCausalLM.from_pretrained(out / "best").config.n_layer == model.config.n_layer
    if best_step == 3:  # the last policy: the final checkpoint's weights
        for name, value in AutoModelForCausalLM.from_pretrained(out / "best").state_dict().items():
            torch.testing.assert_close(value, model.state_dict()[name], rtol=0, atol=0)
    # The warm-up is cached: a new run in a folder holding the cache reuses it, unless its settings changed
    # (the finished run's own folder is refused without --resume: tests/test_run_folder.py).
    shutil.copytree(out / "warmup", tmp_path / "cached" / "warmup")
    messages = []
    PPOTrainer(tiny(tmp_path, "cached"), log=messages.append)
    assert any("reusing the warm-up model" in m for m in messages)
    messages.clear()
    PPOTrainer(tiny(tmp_path, "cached", sft_steps=11), log=messages.append)
    assert any("made with other settings" in m for m in messages)
    del model


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def test_resume_matches_an_uninterrupted_run(tmp_path):
    straight = tiny(tmp_path, "straight", steps=4)
    PPOTrainer(straight, log=quiet).train()
    interrupted = tiny(tmp_path, "resumed", steps=2)
    # Same warm-up model (and so the same reference) for both runs.
    shutil.copytree(tmp_path / "straight" / "warmup", tmp_path / "resumed" / "warmup")
    PPOTrainer(interrupted, log=quiet).train()
    resumed = tiny(tmp_path, "resumed", steps=4, resume=True)
    summary = PPOTrainer(resumed, log=quiet).train()
    assert summary["steps_done"] == 4
    expected, got = rows(straight), rows(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for want, have in zip(expected[2:], got[2:]):
        want, have = _comparable(want), _comparable(have)
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_shared_critic_trains_a_value_head_only(tmp_path):
    cfg = tiny(tmp_path, critic="shared", steps=1)
    # A constant reward of 1 gives value targets away from the zero-initialised head.
    trainer = PPOTrainer(cfg, reward_fn=lambda prompts, responses: [1.0] * len(responses), log=quiet)
    assert trainer.critic.shared and [n for n, _ in trainer.critic.named_parameters()] == [
        "head.summary.weight",
        "head.summary.bias",
    ]
    head_before = trainer.critic.head.summary.weight.detach().clone()
    trainer.train()
    assert not torch.equal(head_before, trainer.critic.head.summary.weight)
    assert "loss/value_avg" in rows(cfg)[0]


def test_gradient_checkpointing_run(tmp_path):
    cfg = tiny(tmp_path, gradient_checkpointing=True, steps=1, gradient_accumulation_steps=2)
    trainer = PPOTrainer(cfg, reward_fn=lambda prompts, responses: [float(len(r)) for r in responses], log=quiet)
    assert activation_checkpointing_on(trainer.policy) and activation_checkpointing_on(trainer.critic.backbone)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.policy.parameters()))


@pytest.mark.parametrize("estimator", [name for name, m in pf.advantage_methods().items() if not m.needs_critic])
def test_critic_free_estimators_run_without_a_critic(tmp_path, estimator):
    """Every registered critic-free estimator, two steps, with the KL in the loss (their default)."""
    cfg = tiny(tmp_path, advantage_method=estimator, group_size=4, batch_size=4, steps=2, sft_steps=2, eval_size=4)
    trainer = PPOTrainer(cfg, log=quiet)
    assert trainer.critic is None
    trainer.train()
    for row in rows(cfg):
        assert "loss/value_avg" not in row and "val/explained_variance" not in row
        assert "loss/kl_avg" in row and row["objective/non_score_reward"] == 0.0
        assert all(math.isfinite(v) for v in row.values())
    assert not (Path(cfg.output_dir) / "checkpoints" / "step-000002" / "critic.pt").exists()


def test_custom_model_path_reward_fn_spec_and_prompts_file(tmp_path):
    PPOTrainer(tiny(tmp_path, "base"), log=quiet)  # writes the warm-up model to base/warmup
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(10, 30)))
    code = main(
        [
            "train",
            "--model-name-or-path",
            str(tmp_path / "base" / "warmup"),
            "--prompts-file",
            str(prompts),
            "--reward-fn",
            "ppo_fast.trainer.default_task:addition_reward",
            "--output-dir",
            str(tmp_path / "custom"),
            *"--steps 1 --batch-size 4 --num-mini-batches 1 --num-ppo-epochs 1 --sample-every 0".split(),
        ]
    )
    assert code == 0
    assert rows(tiny(tmp_path, "custom"))[0]["step"] == 1


# ---------------------------------------------------------------------- the PPO update itself


def test_one_update_raises_positive_and_lowers_negative_advantage_tokens(tmp_path):
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed=1).eval()
    cfg = TrainerConfig(num_ppo_epochs=1, num_mini_batches=1, learning_rate=1e-3, max_grad_norm=0.0, clip_eps_low=0.2)
    prompts = [default_task.prompt(a, 90 - a) for a in range(11, 23)]
    batch = generate(policy, tokenizer, prompts, max_new_tokens=3, temperature=1.0, top_p=1.0, greedy=False)
    mask = batch.response_mask
    with torch.no_grad():
        old, _, _ = forward(policy, None, batch, temperature=1.0)
    sign = torch.tensor([1.0, -1.0]).repeat(len(prompts) // 2)
    advantages = torch.where(mask, sign.unsqueeze(-1), 0.0)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, 1))
    stats = ppo_update(policy, None, optimizer, scheduler, Experience(batch, old, advantages, None, None), cfg, step=1)
    assert stats["policy/approxkl_avg"] == 0.0  # the first minibatch sees the rollout policy itself
    with torch.no_grad():
        new, _, _ = forward(policy, None, batch, temperature=1.0)
    # Rows share parameters, so one row may move against its sign; the totals may not.
    change = ((new - old) * mask).sum(-1)
    assert change[sign > 0].sum() > 0, change
    assert change[sign < 0].sum() < 0, change
    assert (change * sign).gt(0).float().mean() >= 0.75, change


def test_response_mask_covers_tokens_up_to_the_first_eos():
    eos = 1
    ids = torch.tensor([[5, 6, 1, 0], [5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(response_mask_until_eos(ids, eos), expected)


def test_generate_pads_after_eos_and_positions_skip_left_padding():
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed=2).eval()
    batch = generate(policy, tokenizer, ["1+2=", "12+34="], max_new_tokens=5, temperature=1.0, top_p=0.9, greedy=False)
    assert batch.prompt_width == 6
    assert torch.equal(batch.attention_mask[0, :2], torch.tensor([False, False]))
    assert batch.position_ids[0, 2] == 0 and batch.position_ids[1, 0] == 0
    after = ~batch.response_mask
    assert (batch.response_ids[after] == tokenizer.pad_token_id).all()


def test_lr_schedules():
    base = dict(steps=1, warmup_steps=2)
    const = lr_lambda(TrainerConfig(**base, lr_scheduler_type="constant"), 10)
    linear = lr_lambda(TrainerConfig(**base, lr_scheduler_type="linear"), 10)
    cosine = lr_lambda(TrainerConfig(**base, lr_scheduler_type="cosine"), 10)
    assert [const(i) for i in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert linear(6) == pytest.approx(0.5) and linear(10) == 0.0
    assert cosine(6) == pytest.approx(0.5) and cosine(2) == pytest.approx(1.0)


# ---------------------------------------------------------------------- group estimators by hand


def _estimate(scores, kl_per_response, estimator, kl_in_reward, group_size):
    """The trainer's estimate() on one-token responses whose k1 KL is ``kl_per_response``."""
    logprobs = torch.tensor(kl_per_response).unsqueeze(-1)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    return estimate(
        torch.tensor(scores),
        logprobs,
        torch.zeros_like(logprobs),
        None,
        mask,
        EstimateOptions(
            advantage_method=estimator,
            kl_coef=1.0,
            kl_estimator="k1",
            kl_in_reward=kl_in_reward,
            gamma=1.0,
            lam=1.0,
            whiten=False,
            group_size=group_size,
        ),
    ).advantages[:, 0]


def test_grpo_advantages_match_a_hand_computation():
    # Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735; group 2 has equal rewards.
    a = 0.5 / (0.5773503 + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(_estimate([1.0, 0, 0, 1, 2, 2, 2, 2], [0.0] * 8, "grpo", False, 4), expected)


def test_the_advantage_methods_parameters_reach_the_estimator_through_one_option():
    cfg = TrainerConfig(advantage_method="grpo", group_size=2, advantage_params="epsilon=0.5").validate()
    options = EstimateOptions.of(cfg, kl_coef=0.0)
    assert options.params == {"epsilon": 0.5}
    logprobs = torch.zeros(4, 1)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    advantages = estimate(torch.tensor([1.0, 0, 3, 3]), logprobs, logprobs, None, mask, options).advantages[:, 0]
    a = 0.5 / (0.5**0.5 + 0.5)  # group 1: mean 0.5, unbiased std sqrt(0.5); group 2 equal
    torch.testing.assert_close(advantages, torch.tensor([a, -a, 0.0, 0.0]))
    for method, params, said in (
        ("grpo", "norm_by_std=false", "takes no norm_by_std: give --grpo-norm-by-std"),
        ("rloo", "zero_singletons=maybe", "zero_singletons must be true or false"),
        ("gpg", "epsilon=1", "--advantage-method gpg takes f_norm; got 'epsilon'"),
        ("grpo", "epsilon=nan", "epsilon must be a finite number"),
    ):
        with pytest.raises(ConfigError, match=f"advantage_params \\(--advantage-params\\) {said}"):
            TrainerConfig(advantage_method=method, group_size=2, advantage_params=params).validate()
    with pytest.raises(ConfigError, match="takes no clip_eps_low: give --clip-eps-low"):
        TrainerConfig(loss_mode_params="clip_eps_low=0.1").validate()


def test_rloo_advantages_match_a_hand_computation():
    # Each reward minus the mean of the other responses to the same prompt (groups of 3).
    expected = torch.tensor([3 - 0.5, 0 - 2.0, 1 - 1.5, 2 - 3.0, 5 - 1.5, 1 - 3.5])
    torch.testing.assert_close(_estimate([3.0, 0, 1, 2, 5, 1], [0.0] * 6, "rloo", False, 3), expected)


def test_kl_in_the_loss_leaves_equal_score_groups_at_exactly_zero():
    """The issue's example: scores [1, 1, 1, 1] with summed KL [.3, .5, .2, .4].  With the KL in
    the reward GRPO's group normalisation turns KL noise into advantages of about +-1; with
    the KL in the loss (the default for critic-free estimators) the group has nothing to learn."""
    kl = [0.3, 0.5, 0.2, 0.4]
    in_reward = _estimate([1.0] * 4, kl, "grpo", True, 4)
    torch.testing.assert_close(in_reward, torch.tensor([0.3873, -1.1619, 1.1619, -0.3873]), atol=1e-4, rtol=0)
    for estimator in ("grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline"):
        assert torch.equal(_estimate([1.0] * 4, kl, estimator, False, 4), torch.zeros(4)), estimator
    assert not TrainerConfig(advantage_method="grpo", group_size=2).validate().kl_in_reward
    assert TrainerConfig(advantage_method="gae").validate().kl_in_reward


def test_kl_loss_term_adds_kl_coef_times_the_aggregated_kl(tmp_path):
    cfg = tiny(tmp_path, advantage_method="grpo", group_size=2, batch_size=2, kl_coef=0.5)
    trainer = PPOTrainer(cfg, log=quiet)
    batch = generate(
        trainer.policy,
        trainer.tokenizer,
        ["1+2=", "3+4="] * 2,
        max_new_tokens=3,
        temperature=1.0,
        top_p=1.0,
        greedy=False,
    )
    mask = batch.response_mask
    old, _, _ = forward(trainer.policy, None, batch, temperature=1.0, entropy=False, values=False)
    old = old.detach()
    ref = old - 0.3 * torch.rand_like(old)
    exp = Experience(batch, old, torch.zeros_like(old), None, None)
    from ppo_fast.trainer.update import ppo_losses

    base, _, _ = ppo_losses(trainer.policy, None, exp, cfg)
    with_kl, stats, _ = ppo_losses(
        trainer.policy, None, Experience(batch, old, torch.zeros_like(old), None, None, ref, 0.5), cfg
    )
    kl = pf.masked_mean(pf.kl_estimate(old, ref, "k3"), mask)  # k3: auto in the loss; token-mean: the default agg
    torch.testing.assert_close(stats["loss/kl_avg"], kl)
    torch.testing.assert_close(with_kl - base, 0.5 * kl)


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "field, value",
    [
        ("kl_coef", -0.1),
        ("clip_eps_low", 1.5),
        ("gamma", 1.2),
        ("steps", 0),
        ("top_p", 0.0),
        ("temperature", 0.0),
        ("advantage_method", "ppo2"),
        ("critic", "tied"),
        ("num_mini_batches", 3),
        ("agg", "mean"),
    ],
)
def test_bad_config_values_fail_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"invalid config: {field} "):
        TrainerConfig(**{field: value}).validate()


def test_group_estimators_need_several_samples():
    with pytest.raises(ValueError, match=r"group_size \(--group-size\) must be >= 2 for advantage_method=grpo"):
        TrainerConfig(advantage_method="grpo").validate()


def test_cli_rejects_bad_values_at_start(tmp_path, capsys):
    assert main(["train", "--kl-coef", "-1", "--output-dir", str(tmp_path / "x")]) == 1
    assert "kl_coef (--kl-coef) must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        main(["train", "--steps", "three"])


def test_config_file_with_cli_overrides(tmp_path):
    from ppo_fast.trainer.config import build_parser, config_from_args

    path = tmp_path / "c.yaml"
    path.write_text("kl_coef: 0.2\nsteps: 7\nwhiten_advantages: false\n")
    _, train = build_parser()
    cfg = config_from_args(train.parse_args(["--config", str(path), "--steps", "9"]))
    assert (cfg.kl_coef, cfg.steps, cfg.whiten_advantages) == (0.2, 9, False)
    path.write_text('{"kl_coeff": 0.2}')
    with pytest.raises(ValueError, match="unknown option.*kl_coeff"):
        TrainerConfig.from_file(path)
    path.write_text('{"steps": "many"}')
    with pytest.raises(ValueError, match="steps must be an integer"):
        TrainerConfig.from_file(path)


def test_help_and_markdown_list_every_option(capsys):
    import dataclasses

    assert main(["options", "--markdown"]) == 0
    table = capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for f in dataclasses.fields(TrainerConfig):
        flag = "--" + f.name.replace("_", "-")
        assert f"`{flag}`" in table and flag in help_text
    assert "Ratio clip below 1 (1 - clip_eps_low)" in help_text and "geo_mean (GMPO)" in help_text


# ---------------------------------------------------------------------- rewards and stops


def test_reward_fn_that_raises_is_named(tmp_path):
    def broken_reward(prompts, responses):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"broken_reward\(\) raised KeyError: .answer. \(at .*test_trainer.py:\d+\)"):
        PPOTrainer(tiny(tmp_path, eval_size=0), reward_fn=broken_reward, log=quiet).train()


@pytest.mark.parametrize("bad", [lambda p, r: [1.0] * (len(r) - 1), lambda p, r: [[1.0]] * len(r), lambda p, r: "1"])
def test_reward_fn_with_wrong_output_is_rejected(tmp_path, bad):
    with pytest.raises(RewardError, match=r"expected a list of \d+ numbers"):
        PPOTrainer(tiny(tmp_path, eval_size=0), reward_fn=bad, log=quiet).train()


def test_non_finite_reward_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    calls = []

    def reward(prompts, responses):
        calls.append(1)
        return [float("nan") if len(calls) == 2 else 1.0] * len(responses)

    cfg = tiny(tmp_path, steps=3, save_every=1, eval_size=0)
    with pytest.raises(NonFiniteError, match="step 2: reward .* is not finite"):
        PPOTrainer(cfg, reward_fn=reward, log=quiet).train()
    assert checkpoint.latest(Path(cfg.output_dir)).name == "step-000001"


def test_non_finite_loss_stops_before_the_step_is_saved(tmp_path, monkeypatch):
    import ppo_fast as pf

    calls = []

    def nan_on_second_step(real_loss):
        def call(*args, **kwargs):
            loss, stats = real_loss(*args, **kwargs)
            calls.append(1)
            return (loss * float("nan"), stats) if len(calls) > 2 else (loss, stats)  # 2 minibatches per step

        return call

    for name in ("policy_objective", "linear_policy_loss"):  # the update's two paths (the second: the fused head)
        monkeypatch.setattr(pf, name, nan_on_second_step(getattr(pf, name)))
    cfg = tiny(tmp_path, steps=3, save_every=1, eval_size=0)
    with pytest.raises(NonFiniteError, match="step 2: loss is not finite"):
        PPOTrainer(cfg, log=quiet).train()
    assert checkpoint.latest(Path(cfg.output_dir)).name == "step-000001"


def test_keyboard_interrupt_saves_a_checkpoint_and_resume_finishes(tmp_path):
    calls = []

    def reward(prompts, responses):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return default_task.addition_reward(prompts, responses)

    cfg = tiny(tmp_path, steps=3, eval_size=0)
    summary = PPOTrainer(cfg, reward_fn=reward, log=quiet).train()
    assert summary["stop_reason"] == "interrupted" and summary["steps_done"] == 1
    assert checkpoint.latest(Path(cfg.output_dir)).name == "step-000001"
    messages = []
    resumed = PPOTrainer(tiny(tmp_path, steps=3, eval_size=0, resume=True, kl_coef=0.1), log=messages.append)
    assert resumed.step == 1
    assert "resuming with changed options: kl_coef 0.05 -> 0.1" in messages
    assert resumed.train()["steps_done"] == 3
    assert [r["step"] for r in rows(cfg)] == [1, 2, 3]


_CTRL_C_REWARD = """
import os, signal
from ppo_fast.trainer.default_task import addition_reward
calls = []

def reward(prompts, responses):
    if len(prompts) == 4:  # a training step (the held-out prompts come 16 at a time)
        calls.append(1)
        if len(calls) == 1:
            for _ in range({presses}):
                os.kill(os.getpid(), signal.SIGINT)
    return addition_reward(prompts, responses)
"""


def _ctrl_c_run(tmp_path, monkeypatch, presses: int, *extra: str) -> int:
    (tmp_path / f"ctrl_c_{presses}.py").write_text(_CTRL_C_REWARD.format(presses=presses))
    monkeypatch.chdir(tmp_path)
    return main(
        [
            "train",
            "--reward-fn",
            f"ctrl_c_{presses}.py:reward",
            "--output-dir",
            str(tmp_path / "run"),
            *"--steps 2 --batch-size 4 --num-mini-batches 1 --num-ppo-epochs 1 --sample-every 0 --sft-steps 10".split(),
            *"--eval-size 16 --eval-every 0".split(),
            *extra,
        ]
    )


def test_ctrl_c_saves_exits_130_without_the_final_evaluation_and_resume_says_where(tmp_path, monkeypatch, capsys):
    assert _ctrl_c_run(tmp_path, monkeypatch, 1) == 130
    out = capsys.readouterr().out
    assert "Ctrl-C: stopping after this step" in out and "no final held-out evaluation" in out
    assert out.count("held-out greedy") == 1  # before PPO only
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["steps_done"] == 1
    assert summary["eval_after"] is None and summary["eval_before"] is not None
    assert checkpoint.latest(tmp_path / "run").name == "step-000001"

    assert _ctrl_c_run(tmp_path, monkeypatch, 0, "--resume") == 0
    out = capsys.readouterr().out
    assert "before PPO" not in out
    resumed_at = next(line for line in out.splitlines() if line.startswith("resumed at step 1: held-out greedy score"))
    at_resume = resumed_at.rsplit(" ", 1)[1]
    final = next(line for line in out.splitlines() if line.startswith("held-out greedy score ") and "->" in line)
    assert final.startswith(f"held-out greedy score {at_resume} -> ") and final.endswith(", from step 1)")
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert resumed["eval_before"] == summary["eval_before"] and resumed["eval_after"] is not None


def test_a_second_ctrl_c_stops_at_once(tmp_path, monkeypatch, capsys):
    assert _ctrl_c_run(tmp_path, monkeypatch, 2) == 130
    captured = capsys.readouterr()
    errors = [line.strip() for line in captured.err.splitlines() if line.strip()]
    assert errors[-1] == f"ppo-fast: stopped; the last complete checkpoint in {tmp_path / 'run'} is kept"
    assert all(line.startswith("PPO:") for line in errors[:-1]), errors  # our progress bar, no traceback
    assert captured.out.count("held-out greedy") == 1  # before PPO; nothing after the second Ctrl-C
    assert checkpoint.latest(tmp_path / "run") is None and not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    "method, samples, reward, warned",
    [
        ("grpo", 2, lambda p, r: [float(i // 2) for i in range(len(r))], True),  # equal within each group
        ("rloo", 2, lambda p, r: [float(i) for i in range(len(r))], False),
        ("gae", 1, lambda p, r: [0.0] * len(r), True),
        ("gae", 1, lambda p, r: [float(i % 2) for i in range(len(r))], False),
    ],
)
def test_a_step_without_learning_signal_is_warned_once(tmp_path, method, samples, reward, warned):
    messages = []
    cfg = tiny(tmp_path, eval_size=0, advantage_method=method, group_size=samples, batch_size=4)
    PPOTrainer(cfg, reward_fn=reward, log=messages.append).train()
    warnings = [m for m in messages if m.startswith("warning: step 1:")]
    assert len(warnings) == (1 if warned else 0), messages
    assert not [m for m in messages if m.startswith("warning: step 2")]
    if warned:
        assert ("same reward" if method == "grpo" else "every response got the reward 0") in warnings[0]


def test_the_plot_names_the_model_and_what_the_evaluation_measures_and_a_custom_reward_on_it_is_said(tmp_path):
    from ppo_fast.trainer.metrics import ACCURACY
    from ppo_fast.trainer.report import plot_title, score_name

    said = []
    trainer = PPOTrainer(tiny(tmp_path, eval_size=0), log=said.append)
    title = plot_title(trainer)
    assert title.startswith("built-in addition task: a GPT-2 of 2 layers, width 64 (102k parameters)")
    assert "64x2" not in title
    assert score_name(trainer.scorer) == ACCURACY
    other_said = []
    other = PPOTrainer(
        tiny(tmp_path, "other", eval_size=0), reward_fn=lambda p, r: [0.0] * len(r), log=other_said.append
    )
    assert score_name(other.scorer) == "mean reward"
    # Your own reward on the built-in model (a forgotten --model-name-or-path) is said in one line.
    assert not [m for m in said if "--model-name-or-path" in m]
    assert [m for m in other_said if m.startswith("note: no --model-name-or-path")] == [
        "note: no --model-name-or-path: the built-in addition task's small GPT-2 is the policy, trained with your "
        "--reward-fn; pass --model-name-or-path to train your own model"
    ]


def test_reward_model_scores_one_number_per_response(tmp_path):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    tokenizer = default_task.build_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=16,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    scorer = RewardModelScorer(str(tmp_path / "rm"), torch.device("cpu"))
    scores = scorer(["1+2=", "12+34="], ["3", "46"], torch.device("cpu"))
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    # The same text scores the same whatever the padding around it.
    alone = scorer(["12+34="], ["46"], torch.device("cpu"))
    torch.testing.assert_close(scores[1:], alone, rtol=1e-4, atol=1e-5)


def test_batch_rows_keep_the_prompt_width():
    batch = Batch(torch.arange(12).view(3, 4), torch.ones(3, 4, dtype=torch.bool), prompt_width=2)
    part = batch.rows(torch.tensor([2, 0]))
    assert part.prompt_width == 2 and torch.equal(part.response_ids, torch.tensor([[10, 11], [2, 3]]))
