"""The PPO trainer and the ppo-fast CLI, on tiny models for a few steps on CPU."""

from __future__ import annotations

import dataclasses
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
    TrainerConfig,
    checkpoint,
    default_task,
)
from ppo_fast.trainer.command_line import build_parser, config_from_args
from ppo_fast.trainer.config import read_config_file
from ppo_fast.trainer.estimate import EstimateOptions, estimate
from ppo_fast.trainer.metric_glossary import undocumented
from ppo_fast.trainer.metrics import ACCURACY, METRICS_FILE, read_metrics
from ppo_fast.trainer.models import activation_checkpointing_on
from ppo_fast.trainer.report import plot_title, score_name
from ppo_fast.trainer.rollout import Batch, forward, generate, response_mask_until_eos
from ppo_fast.trainer.scoring import RewardModelScorer
from ppo_fast.trainer.startup import lr_lambda
from ppo_fast.trainer.update import Experience, ppo_losses, ppo_update

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


def rows(cfg: TrainerConfig) -> list[dict]:
    return read_metrics(Path(cfg.output_dir) / METRICS_FILE)


# ---------------------------------------------------------------------- end to end


def test_smoke_run_writes_metrics_checkpoint_plot_options_log_and_best(tmp_path, tiny_config):
    cfg = tiny_config(steps=3, save_every=2, eval_every=2, keep_best=True)
    said = []
    trainer = PPOTrainer(cfg, log=said.append)
    # The plot names the model and what the evaluation measures.
    title = plot_title(trainer)
    assert title.startswith("built-in addition task: a GPT-2 of 2 layers, width 64 (102k parameters)")
    assert "64x2" not in title and score_name(trainer.scorer) == ACCURACY
    summary = trainer.train()
    assert summary["stop_reason"] == "done" and summary["steps_done"] == 3
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    metrics = rows(cfg)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert [("eval/score" in r) for r in metrics] == [False, True, False]  # the final evaluation is in the summary
    for row in metrics:
        assert TRL_KEYS <= row.keys(), TRL_KEYS - row.keys()
        assert not undocumented(row), f"metrics without a glossary entry (their module's METRICS): {undocumented(row)}"
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
    assert not [m for m in said if "--model-name-or-path" in m]  # that note is for a custom reward only (below)
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
    PPOTrainer(tiny_config("cached"), log=messages.append)
    assert any("reusing the warm-up model" in m for m in messages)
    messages.clear()
    PPOTrainer(tiny_config("cached", sft_steps=11), log=messages.append)
    assert any("made with other settings" in m for m in messages)
    del model


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/"))}


def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_config):
    straight = tiny_config("straight", steps=4)
    PPOTrainer(straight).train()
    # Same warm-up model (and so the same reference) for both runs.
    shutil.copytree(tmp_path / "straight" / "warmup", tmp_path / "resumed" / "warmup")
    PPOTrainer(tiny_config("resumed", steps=2)).train()
    resumed = tiny_config("resumed", steps=4, resume=True)
    summary = PPOTrainer(resumed).train()
    assert summary["steps_done"] == 4
    expected, got = rows(straight), rows(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for want, have in zip(expected[2:], got[2:]):
        want, have = _comparable(want), _comparable(have)
        assert want.keys() == have.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key


def test_shared_critic_trains_a_value_head_only(tiny_config):
    cfg, said = tiny_config(critic="shared", steps=1), []
    # A constant reward of 1 gives value targets away from the zero-initialised head.
    trainer = PPOTrainer(cfg, reward_fn=lambda prompts, responses: [1.0] * len(responses), log=said.append)
    # Your own reward on the built-in model (a forgotten --model-name-or-path) is said in one line, and plotted
    # as what it is.
    assert score_name(trainer.scorer) == "mean reward"
    assert [m for m in said if m.startswith("note: no --model-name-or-path")] == [
        "note: no --model-name-or-path: the built-in addition task's small GPT-2 is the policy, trained with your "
        "--reward-fn; pass --model-name-or-path to train your own model"
    ]
    assert trainer.critic.shared and [n for n, _ in trainer.critic.named_parameters()] == [
        "head.summary.weight",
        "head.summary.bias",
    ]
    head_before = trainer.critic.head.summary.weight.detach().clone()
    trainer.train()
    assert not torch.equal(head_before, trainer.critic.head.summary.weight)
    assert "loss/value_avg" in rows(cfg)[0]


def test_gradient_checkpointing_run(tiny_config):
    cfg = tiny_config(gradient_checkpointing=True, steps=1, gradient_accumulation_steps=2)
    trainer = PPOTrainer(cfg, reward_fn=lambda prompts, responses: [float(len(r)) for r in responses])
    assert activation_checkpointing_on(trainer.policy) and activation_checkpointing_on(trainer.critic.backbone)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.train()
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.policy.parameters()))


@pytest.mark.parametrize("estimator", [name for name, m in pf.advantage_methods().items() if not m.needs_critic])
def test_critic_free_estimators_run_without_a_critic(tiny_config, estimator):
    """Every registered critic-free estimator, two steps, with the KL in the loss (their default)."""
    cfg = tiny_config(advantage_method=estimator, group_size=4, batch_size=4, sft_steps=2, eval_size=4)
    trainer = PPOTrainer(cfg)
    assert trainer.critic is None
    trainer.train()
    for row in rows(cfg):
        assert "loss/value_avg" not in row and "val/explained_variance" not in row
        assert "loss/kl_avg" in row and row["objective/non_score_reward"] == 0.0
        assert all(math.isfinite(v) for v in row.values())
    assert not (Path(cfg.output_dir) / "checkpoints" / "step-000002" / "critic.pt").exists()


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
    stats = ppo_update(
        policy,
        None,
        optimizer,
        scheduler,
        Experience(batch=batch, old_logprobs=old, advantages=advantages, old_values=None, returns=None),
        cfg,
        step=1,
    )
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
    options = dict(kl_coef=1.0, kl_estimator="k1", gamma=1.0, lam=1.0, whiten=False, group_size=group_size)
    options = EstimateOptions(advantage_method=estimator, kl_in_reward=kl_in_reward, **options)
    return estimate(torch.tensor(scores), logprobs, torch.zeros_like(logprobs), None, mask, options).advantages[:, 0]


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


def test_kl_loss_term_adds_kl_coef_times_the_aggregated_kl(tiny_config):
    cfg = tiny_config(advantage_method="grpo", group_size=2, batch_size=2, kl_coef=0.5)
    trainer = PPOTrainer(cfg)
    sampling = dict(max_new_tokens=3, temperature=1.0, top_p=1.0, greedy=False)
    batch = generate(trainer.policy, trainer.tokenizer, ["1+2=", "3+4="] * 2, **sampling)
    mask = batch.response_mask
    old, _, _ = forward(trainer.policy, None, batch, temperature=1.0, entropy=False, values=False)
    old = old.detach()
    ref = old - 0.3 * torch.rand_like(old)
    exp = Experience(batch=batch, old_logprobs=old, advantages=torch.zeros_like(old), old_values=None, returns=None)
    base, _, _ = ppo_losses(trainer.policy, None, exp, cfg)
    with_kl, stats, _ = ppo_losses(
        trainer.policy,
        None,
        Experience(
            batch=batch,
            old_logprobs=old,
            advantages=torch.zeros_like(old),
            old_values=None,
            returns=None,
            ref_logprobs=ref,
            kl_coef=0.5,
        ),
        cfg,
    )
    kl = pf.masked_mean(pf.kl_estimate(old, ref, "k3"), mask)  # k3: auto in the loss; token-mean: the default agg
    torch.testing.assert_close(stats["loss/kl_avg"], kl)
    torch.testing.assert_close(with_kl - base, 0.5 * kl)


# ---------------------------------------------------------------------- configuration


GROUP, PARAMS = dict(advantage_method="grpo", group_size=2), r"advantage_params \(--advantage-params\) "


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(kl_coef=-0.1), "invalid config: kl_coef "),
        (dict(clip_eps_low=1.5), "invalid config: clip_eps_low "),
        (dict(gamma=1.2), "invalid config: gamma "),
        (dict(steps=0), "invalid config: steps "),
        (dict(top_p=0.0), "invalid config: top_p "),
        (dict(temperature=0.0), "invalid config: temperature "),
        (dict(advantage_method="ppo2"), "invalid config: advantage_method "),
        (dict(critic="tied"), "invalid config: critic "),
        (dict(num_mini_batches=3), "invalid config: num_mini_batches "),
        (dict(agg="mean"), "invalid config: agg "),
        (dict(advantage_method="grpo"), r"group_size \(--group-size\) must be >= 2 for advantage_method=grpo"),
        # one option for the advantage method's own parameters, one for the loss mode's
        (dict(GROUP, advantage_params="norm_by_std=false"), PARAMS + "takes no norm_by_std: give --norm-by-std"),
        (
            dict(GROUP, advantage_method="rloo", advantage_params="zero_singletons=maybe"),
            PARAMS + "zero_singletons must be true or false",
        ),
        (
            dict(GROUP, advantage_method="gpg", advantage_params="epsilon=1"),
            PARAMS + "--advantage-method gpg takes f_norm; got 'epsilon'",
        ),
        (dict(GROUP, advantage_params="epsilon=nan"), PARAMS + "epsilon must be a finite number"),
        (dict(loss_mode_params="clip_eps_low=0.1"), "takes no clip_eps_low: give --clip-eps-low"),
        (dict(loss_mode="ppo"), "invalid config: loss_mode "),
        (dict(clip_eps_high=0.0), "invalid config: clip_eps_high "),
        (dict(dual_clip=1.0), "invalid config: dual_clip "),
        (dict(loss_mode_params="tau_pos"), "invalid config: loss_mode_params "),
        (dict(loss_mode_params="tau_pos=x"), "invalid config: loss_mode_params "),
        # sampling and the support the log-probs are taken on
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(logprobs_support="both"), "logprobs_support"),
        (dict(min_p=0.1, top_p=0.9), "rollout-engine vllm"),
        (dict(max_tokens_per_micro_batch=512, gradient_accumulation_steps=2), "replaces --gradient-accumulation-steps"),
        # LoRA, refused before anything loads
        (dict(lora_r=0), r"lora_r \(--lora-r\) must be >= 1"),
        (dict(lora_alpha=8.0), r"--lora-alpha\) needs --lora-r"),
        (dict(lora_r=8, lora_target_modules="c_attn,lm_head"), r"adapts the LM head \(lm_head\)"),
        (dict(lora_r=8, lora_dropout=0.1), r"pass --no-disable-dropout"),
        (dict(lora_r=8, shard_reference=True), r"the reference is the policy with its adapters off"),
    ],
)
def test_bad_config_values_fail_naming_the_option(overrides, match):
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(**overrides).validate()


def test_config_file_with_cli_overrides(tmp_path):
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


def test_non_finite_reward_stops_and_keeps_the_last_good_checkpoint(tiny_config):
    calls = []

    def reward(prompts, responses):
        calls.append(1)
        return [float("nan") if len(calls) == 2 else 1.0] * len(responses)

    cfg = tiny_config(steps=3, save_every=1, eval_size=0)
    with pytest.raises(NonFiniteError, match="step 2: reward .* is not finite"):
        PPOTrainer(cfg, reward_fn=reward).train()
    assert checkpoint.latest(Path(cfg.output_dir)).name == "step-000001"


def test_non_finite_loss_stops_before_the_step_is_saved(tiny_config, monkeypatch):
    calls = []

    def nan_on_second_step(real_loss):
        def call(*args, **kwargs):
            loss, stats = real_loss(*args, **kwargs)
            calls.append(1)
            return (loss * float("nan"), stats) if len(calls) > 2 else (loss, stats)  # 2 minibatches per step

        return call

    for name in ("policy_objective", "linear_policy_loss"):  # the update's two paths (the second: the fused head)
        monkeypatch.setattr(pf, name, nan_on_second_step(getattr(pf, name)))
    cfg = tiny_config(steps=3, save_every=1, eval_size=0)
    with pytest.raises(NonFiniteError, match="step 2: loss is not finite"):
        PPOTrainer(cfg).train()
    assert checkpoint.latest(Path(cfg.output_dir)).name == "step-000001"


def test_keyboard_interrupt_saves_a_checkpoint_and_resume_finishes(tiny_config):
    calls = []

    def reward(prompts, responses):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return default_task.addition_reward(prompts, responses)

    cfg = tiny_config(steps=3, eval_size=0)
    summary = PPOTrainer(cfg, reward_fn=reward).train()
    assert summary["stop_reason"] == "interrupted" and summary["steps_done"] == 1
    assert checkpoint.latest(Path(cfg.output_dir)).name == "step-000001"
    messages = []
    resumed = PPOTrainer(tiny_config(steps=3, eval_size=0, resume=True, kl_coef=0.1), log=messages.append)
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


def _ctrl_c_run(tmp_path, monkeypatch, tiny_flags, presses: int, *extra: str) -> int:
    (tmp_path / f"ctrl_c_{presses}.py").write_text(_CTRL_C_REWARD.format(presses=presses))
    monkeypatch.chdir(tmp_path)
    argv = [
        "train",
        "--reward-fn",
        f"ctrl_c_{presses}.py:reward",
        "--output-dir",
        str(tmp_path / "run"),
        "--steps",
        "2",
    ]
    return main([*argv, *tiny_flags, "--eval-every", "0", *extra])


def test_ctrl_c_saves_exits_130_without_the_final_evaluation_and_resume_says_where(
    tmp_path, monkeypatch, capsys, tiny_flags
):
    assert _ctrl_c_run(tmp_path, monkeypatch, tiny_flags, 1) == 130
    out = capsys.readouterr().out
    assert "Ctrl-C: stopping after this step" in out and "no final held-out evaluation" in out
    assert out.count("held-out greedy") == 1  # before PPO only
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stop_reason"] == "interrupted" and summary["steps_done"] == 1
    assert summary["eval_after"] is None and summary["eval_before"] is not None
    assert checkpoint.latest(tmp_path / "run").name == "step-000001"

    assert _ctrl_c_run(tmp_path, monkeypatch, tiny_flags, 0, "--resume") == 0
    out = capsys.readouterr().out
    assert "before PPO" not in out
    resumed_at = next(line for line in out.splitlines() if line.startswith("resumed at step 1: held-out greedy score"))
    at_resume = resumed_at.rsplit(" ", 1)[1]
    final = next(line for line in out.splitlines() if line.startswith("held-out greedy score ") and "->" in line)
    assert final.startswith(f"held-out greedy score {at_resume} -> ") and final.endswith(", from step 1)")
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert resumed["eval_before"] == summary["eval_before"] and resumed["eval_after"] is not None


def test_a_second_ctrl_c_stops_at_once(tmp_path, monkeypatch, capsys, tiny_flags):
    assert _ctrl_c_run(tmp_path, monkeypatch, tiny_flags, 2) == 130
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
def test_a_step_without_learning_signal_is_warned_once(tiny_config, method, samples, reward, warned):
    messages = []
    cfg = tiny_config(eval_size=0, advantage_method=method, group_size=samples, batch_size=4)
    PPOTrainer(cfg, reward_fn=reward, log=messages.append).train()
    warnings = [m for m in messages if m.startswith("warning: step 1:")]
    assert len(warnings) == (1 if warned else 0), messages
    assert not [m for m in messages if m.startswith("warning: step 2")]
    if warned:
        assert ("same reward" if method == "grpo" else "every response got the reward 0") in warnings[0]


def test_reward_model_scores_one_number_per_response(tmp_path):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    tokenizer = default_task.build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=16, num_labels=1)
    config.pad_token_id = tokenizer.pad_token_id
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


# ---------------------------------------------------------------------- trackers and callbacks


def _fake_tracker_modules(calls: list) -> dict:
    """Stand-ins for wandb, mlflow and trackio that record each call of their APIs the trackers use."""
    import importlib.machinery
    import types

    def module(name: str, **functions):
        fake = types.ModuleType(name)
        fake.__spec__ = importlib.machinery.ModuleSpec(name, None)
        for fn_name, result in functions.items():
            setattr(fake, fn_name, lambda *a, _n=f"{name}.{fn_name}", _r=result, **k: calls.append((_n, a, k)) or _r)
        return fake

    run = types.SimpleNamespace(
        log=lambda row, step: calls.append(("wandb.run.log", (row,), {"step": step})),
        finish=lambda: calls.append(("wandb.run.finish", (), {})),
    )
    return {
        "wandb": module("wandb", init=run),
        "mlflow": module(
            "mlflow",
            set_tracking_uri=None,
            set_experiment=None,
            search_runs=[],
            start_run=None,
            log_params=None,
            log_metrics=None,
            end_run=None,
        ),
        "trackio": module("trackio", init=None, log=None, finish=None),
    }


def test_report_to_wandb_mlflow_and_trackio_log_each_step_as_their_users_know_them(tiny_config, monkeypatch):
    import sys

    calls = []
    for name, fake in _fake_tracker_modules(calls).items():
        monkeypatch.setitem(sys.modules, name, fake)
    for variable in ("WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_PROJECT"):
        monkeypatch.delenv(variable, raising=False)
    cfg = tiny_config("tracked", report_to="wandb,mlflow,trackio")
    PPOTrainer(cfg).train()
    by_name = {}
    for name, args, kwargs in calls:
        by_name.setdefault(name, []).append((args, kwargs))
    ((_, init),) = by_name["wandb.init"]
    assert init["project"] == "ppo-fast" and init["resume"] == "allow" and init["config"]["kl_coef"] == cfg.kl_coef
    logged = [(args[0], kwargs["step"]) for args, kwargs in by_name["wandb.run.log"]]
    assert [step for _, step in logged] == [1, 2] and all("objective/scores" in row for row, _ in logged)
    assert all(isinstance(v, (int, float)) for row, _ in logged for v in row.values())
    assert by_name["mlflow.set_tracking_uri"][0][0][0] == f"sqlite:///{(Path(cfg.output_dir) / 'mlflow.db').resolve()}"
    assert [kwargs["step"] for _, kwargs in by_name["mlflow.log_metrics"]] == [1, 2]
    assert by_name["mlflow.log_params"][0][0][0]["seed"] == str(cfg.seed)
    assert [kwargs["step"] for _, kwargs in by_name["trackio.log"]] == [1, 2]
    assert {"wandb.run.finish", "mlflow.end_run", "trackio.finish"} <= set(by_name)


def test_a_callback_sees_each_step_evaluation_and_save_and_stops_the_run_cleanly(tiny_config):
    seen = []

    class StopAtTwo:
        def on_step_end(self, trainer, row):
            seen.append(("step", row["step"]))
            return row["step"] == 2

        def on_evaluate(self, trainer, scores):
            seen.append(("evaluate", trainer.step))

        def on_save(self, trainer, path):
            seen.append(("save", path.name))

    cfg = tiny_config("stopped", steps=4)
    summary = PPOTrainer(cfg, callbacks=[StopAtTwo()]).train()
    assert summary["stop_reason"] == "callback" and summary["steps_done"] == 2
    assert seen == [("evaluate", 0), ("step", 1), ("step", 2), ("save", "step-000002"), ("evaluate", 2)]
    assert checkpoint.latest(Path(cfg.output_dir)).name == "step-000002"
    with pytest.raises(TypeError, match=r"StopAtTwo is a class; give an instance \(StopAtTwo\(\)\)"):
        PPOTrainer(tiny_config("typo"), callbacks=[StopAtTwo])
    with pytest.raises(TypeError, match="has none of the methods on_step_end"):
        PPOTrainer(tiny_config("typo"), callbacks=[print])
    assert not Path(tiny_config("typo").output_dir).exists()
