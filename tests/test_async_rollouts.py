"""Asynchronous rollouts (--max-staleness K > 0): a producer process with a test engine whose batches carry
the weights they were generated with (a version clock), driven by a stand-in trainer that updates the
clock: the staleness bound, the queue's depth, wait vs drop, the version tags, weights never seen half
updated, clean shutdown, a crash as an error with the producer's traceback; then the real trainer."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppo_fast.spec import ROLLOUT_ENGINES, RolloutEngine
from ppo_fast.trainer import ConfigError, PPOTrainer, TrainerConfig, checkpoint, weight_transfer
from ppo_fast.trainer.async_rollouts import AsyncSource, ProducerError, check_picklable
from ppo_fast.trainer.metric_glossary import undocumented
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.prompts import Prompts
from ppo_fast.trainer.scoring import FunctionScorer, Rewards

# The test engine: it reads the policy's two numbers (the version the stand-in trainer writes into both)
# at the start and at the end of a generation, CLOCK_DELAY seconds apart, and answers them as the
# prompt's and the response's token; CLOCK_CRASH_AT=N raises in its N-th generation.
_CLOCK_ENGINE = """
import os, time
import torch
from ppo_fast.spec import ROLLOUT_ENGINES, RolloutEngine
from ppo_fast.trainer.rollout import Batch

# Registered where this module is imported: the producer process imports it to unpickle the run's objects.
ROLLOUT_ENGINES.setdefault(
    "clock", RolloutEngine(name="clock", module="clock_engine", summary="a test's", logprobs=False, own_weights=True)
)


class ClockEngine:
    info = ROLLOUT_ENGINES["clock"]

    def __init__(self, setup):
        self.policy, self.calls = setup.policy, 0

    def generate(self, tokenizer, prompts, *, max_new_tokens, device, **sampling):
        self.calls += 1
        if self.calls == int(os.environ.get("CLOCK_CRASH_AT", "0")):
            raise ValueError("clock engine: injected failure")
        first = int(self.policy.a.item())
        if self.calls == int(os.environ.get("CLOCK_HOLD_AT", "0")):  # held open until the test releases it
            hold = os.environ["CLOCK_HOLD"]
            open(hold + ".in", "w").close()
            while not os.path.exists(hold):
                time.sleep(0.01)
        if os.environ.get("CLOCK_DEVICES"):  # where the producer's copy of the weights lives
            with open(os.environ["CLOCK_DEVICES"], "a") as log:
                log.write(f"{self.policy.a.device.type}\\n")
        time.sleep(float(os.environ.get("CLOCK_DELAY", "0")))
        if not bool((self.policy.c == first).all()):  # a third tensor, in a bucket of its own when broadcast
            raise ValueError(f"clock engine: c holds {self.policy.c.unique().tolist()}, a {first}")
        last = int(self.policy.b.item())
        ids = torch.tensor([[first, last]] * len(prompts))
        return Batch(ids, torch.ones_like(ids, dtype=torch.bool), 1), None

    def sync_weights(self, policy):
        return 0.0

    def close(self):
        pass


def start(setup):
    return ClockEngine(setup)


class Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [str(int(row[-1])) for row in ids]


def reward(prompts, responses):
    return [float(r) for r in responses]


class Clock(torch.nn.Module):  # the stand-in policy: its version written into two numbers, one after the other

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(()))
        self.b = torch.nn.Parameter(torch.zeros(()))
        self.c = torch.nn.Parameter(torch.zeros(300))  # 1200 bytes: over the tests' 1 KiB broadcast bucket
        self.frozen = torch.nn.Parameter(torch.zeros(()), requires_grad=False)  # never sent: an update leaves it
"""


@pytest.fixture
def clock(tmp_path, monkeypatch):
    """``make(K, policy, **env)``: a stand-in run record whose source is an AsyncSource over the clock engine."""
    (tmp_path / "clock_engine.py").write_text(_CLOCK_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the producer process starts with this sys.path
    entry = RolloutEngine(name="clock", module="clock_engine", summary="a test's", logprobs=False, own_weights=True)
    monkeypatch.setitem(ROLLOUT_ENGINES, "clock", entry)  # for this test only
    monkeypatch.setattr(weight_transfer, "BUCKET_BYTES", 1024)  # a and b in one bucket, c alone
    import clock_engine

    sources = []

    def make(
        max_staleness: int, policy: str = "wait", device: str = "cpu", transfer: str = "auto", **env
    ) -> SimpleNamespace:
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        cfg = TrainerConfig(
            max_staleness=max_staleness,
            staleness_policy=policy,
            rollout_engine="clock",
            weight_transfer=transfer,
            batch_size=3,
            group_size=2,
            output_dir=str(tmp_path),
        )
        run = SimpleNamespace(
            cfg=cfg,
            policy=clock_engine.Clock().to(device),
            tokenizer=clock_engine.Tokenizer(),
            train_set=Prompts(["p0", "p1", "p2", "p3"]),
            scorer=Rewards([FunctionScorer(clock_engine.reward)], [1.0]),
            response_length=1,
            device=torch.device(device),
            output_dir=tmp_path,
            step=0,
            policy_version=0,
            said=[],
        )
        run.log = run.said.append
        run.source = AsyncSource(run, weight_transfer.resolve(cfg, run.device))
        sources.append(run.source)
        run.source.start()
        return run

    yield make
    for source in sources:
        source.close()


def _wait_for(condition) -> None:
    """Until ``condition()`` (or 60 s: then the test's assertions say what happened)."""
    deadline = time.perf_counter() + 60
    while not condition() and time.perf_counter() < deadline:
        time.sleep(0.01)


def _wait_for_full_queue(run) -> None:
    """Until the producer has filled the queue."""
    _wait_for(lambda: run.source.channel.batches.qsize() >= run.cfg.max_staleness)


def _train_step(run, jump: int = 1) -> tuple:
    """The stand-in trainer's step: take a batch, then an update that moves the clock ``jump`` steps
    (two optimizer steps each) and publishes it."""
    g = run.source.next()
    row = run.source.metrics(g)
    taken_at = run.step
    run.step += jump
    run.policy_version += 2 * jump
    with torch.no_grad():
        run.policy.a.fill_(run.policy_version)
        run.policy.c.fill_(run.policy_version)
        run.policy.b.fill_(run.policy_version)
    run.source.publish()
    return taken_at, g, row


def _check_tags(g) -> None:
    """The batch was generated whole by the weights its tags name."""
    first, last = g.batch.input_ids[:, 0], g.batch.input_ids[:, 1]
    assert (first == last).all(), "a generation saw the weights change under it"
    assert (first == g.version).all() and g.version == 2 * g.weights_step
    assert g.scores.tolist() == [float(g.version)] * 6  # the producer's reward of its own responses


@pytest.mark.parametrize(
    "max_staleness, transfer", [(1, "staging"), pytest.param(3, "staging", marks=pytest.mark.full), (1, "broadcast")]
)
def test_wait_keeps_every_batch_within_the_bound_and_the_queue_within_k(clock, max_staleness, transfer):
    run = clock(max_staleness, "wait", transfer=transfer, CLOCK_DELAY=0.02)
    ages = []
    for _ in range(max_staleness + 3):
        # The producer as far ahead as the bound lets it: batches 0 .. step + K generated, K of them queued.
        _wait_for(lambda: run.source.channel.produced.value >= run.step + max_staleness + 1)
        taken_at, g, row = _train_step(run)
        _check_tags(g)
        ages.append(taken_at - g.weights_step)
        assert row["async/age"] == ages[-1] and row["async/version"] == g.version
        assert row["async/staleness/" + str(ages[-1])] == 3  # the batch's 3 groups, at their age
        assert sum(row[f"async/staleness/{a}"] for a in range(max_staleness + 1)) == 3
        assert row["async/queue_depth"] <= max_staleness and row["async/groups_dropped"] == 0
        assert 0 <= row["async/producer_idle_frac"] <= 1 and 0 <= row["async/trainer_idle_frac"] <= 1
    assert run.source.names == ["a", "b", "c"]  # never the frozen parameter
    assert sorted(run.source.staging) == ([] if transfer == "broadcast" else ["a", "b", "c"])
    assert [b.names for b in run.source.channel.plan] == ([("a", "b"), ("c",)] if transfer == "broadcast" else [])
    # Ahead as far as it may be, and no further: batch n waits for the weights of step n - K.
    assert ages == [*range(max_staleness), *[max_staleness] * 3]


def test_drop_trains_on_no_batch_over_the_bound_and_counts_what_it_dropped(clock):
    run = clock(1, "drop", CLOCK_DELAY=0.0)
    _wait_for(lambda: run.source.channel.produced.value >= 2)  # the second batch too is of step 0's weights
    # An update that took two steps' time: that second batch is 2 steps old when taken.
    taken_at, g, _ = _train_step(run, jump=2)
    assert (taken_at, g.weights_step) == (0, 0)
    rows = []
    for _ in range(3):
        taken_at, g, row = _train_step(run)
        _check_tags(g)
        assert taken_at - g.weights_step <= 1
        rows.append(row)
    assert rows[0]["async/groups_dropped"] >= 3  # the stale batch's 3 groups, at least
    assert sum(r["async/groups_dropped"] for r in rows) % 3 == 0


def test_clean_shutdown_ignores_ctrl_c_in_the_producer_and_says_what_it_dropped(clock):
    run = clock(2, "wait")
    process = run.source.process
    _wait_for_full_queue(run)
    os.kill(process.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    os.kill(process.pid, signal.SIGTERM)
    _, g, _ = _train_step(run)
    _check_tags(g)
    assert process.is_alive()  # the trainer stops it, after its step
    run.source.close()
    assert not process.is_alive() and process.exitcode == 0
    assert any("producer stopped" in line and "dropped" in line for line in run.said), run.said
    run.source.close()  # twice is harmless


def test_a_producer_crash_is_an_error_with_its_traceback(clock):
    run = clock(1, "wait", CLOCK_CRASH_AT=2)
    _train_step(run)
    with pytest.raises(
        ProducerError, match="(?s)Traceback.*clock_engine.py.*ValueError: clock engine: injected failure"
    ):
        _train_step(run)


def test_a_killed_producer_is_an_error_not_a_hang(clock):
    run = clock(1, "wait", CLOCK_DELAY=0.5)
    run.source.process.kill()
    with pytest.raises(ProducerError, match="killed by signal 9"):
        while True:  # a batch put before the kill may still come
            _train_step(run)


def test_a_broadcast_to_a_killed_producer_is_an_error_not_a_hang(clock):
    run = clock(1, "wait", transfer="broadcast")
    run.source.process.kill()
    run.source.process.join()
    with pytest.raises(ProducerError, match="killed by signal 9"):
        run.source.publish()


def test_a_broadcast_never_waits_for_a_generation_and_lands_whole_between_generations(clock, tmp_path):
    """The producer adopts weights between generations only; a broadcast is taken by its receiving thread
    meanwhile: the trainer's publication completes while a generation is held open, and that generation,
    released, still saw its weights whole (and the next one the new ones)."""
    hold = tmp_path / "hold"
    run = clock(1, "wait", transfer="broadcast", CLOCK_HOLD_AT=2, CLOCK_HOLD=hold)
    _wait_for(lambda: Path(str(hold) + ".in").exists())  # batch 1's generation, held open
    published = threading.Thread(target=_train_step, args=(run,), daemon=True)
    published.start()
    published.join(timeout=60)
    assert not published.is_alive(), "the publication waited for the producer's generation"
    hold.touch()
    taken_at, g, _ = _train_step(run)  # batch 1: generated with step 0's weights, whole
    _check_tags(g)
    assert (taken_at, g.weights_step) == (1, 0)
    taken_at, g, _ = _train_step(run)  # batch 2: step 1's weights at least, received while batch 1 was held
    _check_tags(g)
    assert g.weights_step >= 1


def test_broadcast_buckets_split_by_dtype_and_size_and_the_producers_views_match_the_senders_layout():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    state = {
        "a": torch.randn(3, 4, generator=g),  # 48 bytes
        "b": torch.randn(5, generator=g),  # 20: with a, 68 <= 80
        "c": torch.randn(2, 2, generator=g).bfloat16(),  # another dtype
        "d": torch.randn(100, generator=g),  # 400 > 80: alone
        "e": torch.randn(2, generator=g),
    }
    plan = weight_transfer.buckets(state, list(state), limit=80)
    assert [b.names for b in plan] == [("a", "b"), ("c",), ("d",), ("e",)]
    assert [b.dtype for b in plan] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    shadow = {name: torch.zeros_like(t) for name, t in state.items()}
    flats, views = weight_transfer._buffers(plan, shadow, torch.device("cpu"))
    for flat, bucket in zip(flats, plan):  # what the sender broadcasts into each
        flat.copy_(torch.cat([state[name].reshape(-1) for name in bucket.names]))
    for name, t in state.items():
        assert torch.equal(views[name], t) and views[name].shape == t.shape
    shadow["b"] = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"sends b as torch.float32, 5 elements; .* has torch.float64, 5 elements"):
        weight_transfer._buffers(plan, shadow, torch.device("cpu"))


@pytest.mark.parametrize(
    "device, transfer, trainer, visible, says",
    [
        ("auto", "auto", "cpu", None, ("staging", "cpu", None)),
        ("auto", "broadcast", "cpu", None, ("broadcast", "cpu", None)),
        ("cuda:1", "auto", "cuda:0", None, ("broadcast", "cuda:1", "1")),
        ("cuda:1", "auto", "cuda:0", "6,3", ("broadcast", "cuda:1", "3")),
        ("cuda:0", "auto", "cuda:0", None, ("staging", "cuda:0", None)),
        ("cuda:1", "auto", "cpu", None, "--rollout-device cuda:1: needs the trainer on a GPU"),
        ("cuda:2", "auto", "cuda:0", None, "--rollout-device cuda:2: this process sees 2 GPU"),
        ("cuda:1", "staging", "cuda:0", None, "--weight-transfer staging: needs the producer on the trainer's"),
        ("auto", "broadcast", "cuda:0", None, "--weight-transfer broadcast: on a GPU needs the producer on another"),
    ],
)
def test_the_producers_device_and_its_weights_transfer_are_decided_once(
    monkeypatch, device, transfer, trainer, visible, says
):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = TrainerConfig(max_staleness=1, rollout_device=device, weight_transfer=transfer)
    if isinstance(says, str):
        with pytest.raises(ConfigError, match=re.escape(says)):
            weight_transfer.resolve(cfg, torch.device(trainer))
        return
    got = weight_transfer.resolve(cfg, torch.device(trainer))
    assert (got.kind, str(got.device), got.visible) == says
    assert got.producer_device() == (torch.device("cuda", 0) if got.visible else got.device)


@pytest.mark.parametrize(
    "options, says",
    [
        ({"rollout_device": "cuda", "max_staleness": 1}, "must be auto or cuda:N, got 'cuda'"),
        ({"rollout_device": "cpu", "max_staleness": 1}, "must be auto or cuda:N, got 'cpu'"),
        ({"rollout_device": "cuda:1"}, "only applies to the producer of --max-staleness > 0 (it is 0)"),
        ({"weight_transfer": "broadcast"}, "only applies to the producer of --max-staleness > 0 (it is 0)"),
    ],
)
def test_a_rollout_device_or_transfer_that_cannot_apply_is_refused_by_name(options, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        TrainerConfig(**options).validate()


def test_a_producer_device_the_run_cannot_use_stops_the_command_before_anything_is_loaded(tmp_path, error_line):
    from ppo_fast.cli import main

    out = tmp_path / "run"
    assert (
        main(
            ["train", "--max-staleness", "1", "--rollout-device", "cuda:1", "--device", "cpu", "--output-dir", str(out)]
        )
        == 1
    )
    assert error_line() == "ppo-fast: error: --rollout-device cuda:1: needs the trainer on a GPU (it is on the CPU)"
    assert not out.exists()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_on_two_gpus_the_weights_reach_a_producer_on_the_other_by_nccl(clock, tmp_path):
    devices = tmp_path / "devices.txt"
    run = clock(1, "wait", device="cuda:0", CLOCK_DELAY=0.05, CLOCK_DEVICES=devices)
    assert run.source.transfer.kind == "staging"
    run.source.close()
    run.cfg = dataclasses.replace(run.cfg, rollout_device="cuda:1")
    run.source = AsyncSource(run, weight_transfer.resolve(run.cfg, run.device))
    assert (run.source.transfer.kind, run.source.transfer.visible) == ("broadcast", "1")
    run.source.start()
    try:
        for _ in range(4):
            taken_at, g, _ = _train_step(run)
            _check_tags(g)
            assert g.weights_step >= taken_at - 1
    finally:
        run.source.close()
    assert set(devices.read_text().split()) == {"cuda"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_weights_reach_the_producer_through_cuda_ipc_never_half_updated(clock, tmp_path):
    """The staging copy stays on the GPU (sent as CUDA IPC handles, not copied through the host), and the
    producer generates on the GPU with each update's weights whole."""
    devices = tmp_path / "devices.txt"
    run = clock(1, "wait", device="cuda", CLOCK_DELAY=0.05, CLOCK_DEVICES=devices)
    assert all(t.is_cuda for t in run.source.staging.values())
    for _ in range(4):
        taken_at, g, _ = _train_step(run)
        _check_tags(g)
        assert g.weights_step >= taken_at - 1  # --max-staleness 1
    assert set(devices.read_text().split()) == {"cuda"}


def test_a_reward_that_cannot_go_to_the_producer_is_refused_by_name():
    scorer = Rewards([FunctionScorer(lambda prompts, responses: [0.0] * len(responses))], [1.0])
    with pytest.raises(ConfigError, match="--max-staleness 1: the reward function .*<lambda> cannot be pickled"):
        check_picklable(scorer, 1)


# ---------------------------------------------------------------------- the trainer


def test_the_trainer_trains_one_step_off_policy_and_resumes_from_the_checkpoint(tiny_config):
    cfg = tiny_config(steps=3, max_staleness=1, save_every=2, eval_size=0)
    said = []
    summary = PPOTrainer(cfg, log=said.append).train()
    assert summary["steps_done"] == 3
    rows = read_metrics(Path(cfg.output_dir) / METRICS_FILE)
    assert rows[0]["async/age"] == 0
    for row in rows:
        assert row["async/age"] <= 1  # 2 optimizer steps per update: the version of the weights of step - 1 - age
        assert row["async/version"] == 2 * (row["step"] - 1 - row["async/age"])
        assert row["policy/ratio_dev_at_start"] == 0.0  # old log-probs rescored: the ratio is exactly 1
        assert row["async/staleness/0"] + row["async/staleness/1"] == cfg.batch_size
        assert not undocumented(row), undocumented(row)  # each metric in docs/metrics.md
    assert checkpoint.load_state(checkpoint.latest(Path(cfg.output_dir))).policy_version == 6
    assert any("producer stopped" in line for line in said)
    said.clear()
    resumed = PPOTrainer(tiny_config(steps=4, max_staleness=1, eval_size=0, resume=True), log=said.append)
    assert resumed.run.policy_version == 6
    resumed.train()
    assert any("were not saved: they are generated anew" in line for line in said), said
    assert read_metrics(Path(cfg.output_dir) / METRICS_FILE)[-1]["async/version"] == 6


def test_max_staleness_0_generates_in_the_loop_with_no_producer(tiny_config):
    trainer = PPOTrainer(tiny_config(steps=1, eval_size=0))
    assert not trainer.run.source.is_async and trainer.run.engine is not None
    trainer.train()
    row = read_metrics(Path(trainer.run.output_dir) / METRICS_FILE)[0]
    assert not [key for key in row if key.startswith("async/")]
    assert trainer.run.policy_version == 2


def test_vllm_sleep_and_a_producer_are_refused_together():
    with pytest.raises(
        ConfigError, match=r"--vllm-sleep\) sleeps the engine while the producer of --max-staleness > 0 generates"
    ):
        TrainerConfig(rollout_engine="vllm", vllm_sleep=True, max_staleness=1)._validate_engine()
    TrainerConfig(rollout_engine="vllm", vllm_sleep=True)._validate_engine()


def test_sigterm_to_both_processes_stops_the_run_cleanly_after_its_step(tiny_config, monkeypatch):
    """As a scheduler's SIGTERM to the process group: the trainer saves after its step and stops the producer,
    which ignored the signal, cleanly; here with the weights broadcast (a gloo group of the two processes, and
    the producer's receiving thread), the staging copy's run being the test above."""
    producers = []

    class Scheduler:
        def on_step_end(self, trainer, row):
            producers.append(trainer.run.source.process)
            os.kill(producers[0].pid, signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    said = []
    monkeypatch.setattr(weight_transfer, "BUCKET_BYTES", 64 * 1024)  # the model's tensors in many buckets
    cfg = tiny_config(steps=3, max_staleness=1, eval_size=0, weight_transfer="broadcast")
    trainer = PPOTrainer(cfg, callbacks=[Scheduler()], log=said.append)
    summary = trainer.train()
    assert any("weights by broadcast" in line for line in said), said
    assert len(trainer.run.source.channel.plan) > 3
    assert summary["stop_reason"] == "interrupted" and summary["steps_done"] == 1
    assert producers[0].exitcode == 0  # it finished when told to, not killed by the signal
    assert checkpoint.load_state(checkpoint.latest(Path(trainer.run.output_dir))).policy_version == 2
