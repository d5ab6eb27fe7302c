"""Asynchronous rollouts under torchrun (--max-staleness > 0 with two ranks, gloo on CPU): rank 0's producer
generates the whole batch and each rank trains on its share, whole groups, at one policy version, every rank
logging rank 0's row; the weights the producer gets are the gathered ones (FSDP2); a producer's crash ends
every rank with its traceback, a dead rank 0 ends the other rank and the producer, a Ctrl-C stops both ranks
(and one process resumes, its producer from the checkpoint's weights)."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import dist_workers
import pytest
import torch
import torch.multiprocessing as mp
from test_distributed import TINY, _finish, _launch, _wait_for_a_step

from ppo_fast.trainer import PPOTrainer, TrainerConfig, checkpoint
from ppo_fast.trainer.async_ranks import RankedSource, VersionMismatch, split
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.rollout import Batch
from ppo_fast.trainer.rollout_source import Generated

# After TINY: --dist-timeout back at 600 s, which no rank may wait out (each run ends within _finish's 120 s).
LAUNCH = [*TINY, "--max-staleness", "1", "--dist-timeout", "600"]


@pytest.mark.full  # under torchrun: CI runs it in its multihost step (.ci/multihost.sh)
def test_two_ranks_train_each_on_its_share_of_rank_0s_producer_at_one_version(tmp_path, monkeypatch):
    log = tmp_path / "rewards.jsonl"
    monkeypatch.setenv("PPO_FAST_REWARD_LOG", str(log))
    out = tmp_path / "world2.pt"
    args = (2, str(tmp_path / "init"), str(tmp_path / "run"), str(out))
    mp.spawn(dist_workers.async_ranks, args=args, nprocs=2, join=True)
    saved = torch.load(out, weights_only=False)
    ranks = saved["records"]
    produced = [json.loads(line) for line in log.read_text().splitlines()]
    trainers = {record["pid"] for records in ranks for record in records}
    assert len({p["pid"] for p in produced}) == 1 and produced[0]["pid"] not in trainers  # one producer, not a rank
    logged = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [len(records) for records in ranks] == [3, 3] and len(logged) == 3
    for step, (mine, theirs, row) in enumerate(zip(*ranks, logged), 1):
        assert mine["row"] == theirs["row"] == row  # every rank returns the row rank 0 logs
        assert mine["version"] == theirs["version"] == step  # one optimizer step per PPO step
        age = row["async/age"]
        assert age <= 1 and row["async/version"] == step - 1 - age
        assert row["async/staleness/0"] + row["async/staleness/1"] == 8  # the whole batch's 8 groups
        assert row["policy/ratio_dev_at_start"] == 0.0
        # --staleness-policy wait drops nothing: the producer's batch n is step n + 1's, split in rank order.
        whole = produced[step - 1]
        shares = [[(p, r) for p, r, _ in record["samples"]] for record in (mine, theirs)]
        assert shares[0] + shares[1] == list(zip(whole["prompts"], whole["responses"]))
        for share in shares:  # 4 whole groups of 2 each
            assert len(share) == 8 and all(share[i][0] == share[i + 1][0] for i in range(0, 8, 2))
        scores = [s for record in (mine, theirs) for _, _, s in record["samples"]]
        assert scores == dist_workers.response_length(whole["prompts"], whole["responses"])
    # The producer's last weights are the policy's whole weights after the last update (gathered from the shards).
    staging, before, after = saved["staging"], saved["before"], saved["after"]
    assert staging and set(staging) <= set(after)
    for name, weight in staging.items():
        assert torch.equal(weight, after[name]), name
    assert any(not torch.equal(before[name], after[name]) for name in staging), "no update: the test shows nothing"


def _crashing_reward(folder: Path) -> str:
    (folder / "crashing.py").write_text(
        "calls = 0\n\n\ndef reward(prompts, responses):\n    global calls\n    calls += 1\n"
        "    if calls == 1:\n        raise ValueError('injected reward failure')\n"
        "    return [len(r) / 8 for r in responses]\n"
    )
    return f"{folder / 'crashing.py'}:reward"


@pytest.mark.full  # a run each (about 30 s on 2 loaded cores): CI runs them in its multihost step
def test_a_producer_crash_ends_every_rank_with_its_traceback(tmp_path):
    procs = _launch(tmp_path / "run", "--steps", "50", "--reward-fn", _crashing_reward(tmp_path), *LAUNCH)
    logs = _finish(procs)
    assert [p.returncode for p in procs] == [1, 1], logs
    for rank, log in enumerate(logs):
        errors = [line for line in log.splitlines() if line.startswith("ppo-fast: error: ")]
        assert len(errors) == 1, log
        assert ("rank 1: rank 0's rollouts failed: ProducerError: " if rank else "the rollout producer") in errors[0]
        assert re.search(r"(?s)Traceback.*crashing\.py.*ValueError: injected reward failure", log), log


@pytest.mark.full
def test_a_dead_rank_0_ends_the_other_rank_and_its_producer(tmp_path):
    procs = _launch(tmp_path / "run", "--steps", "500", "--save-every", "0", *LAUNCH)
    _wait_for_a_step(tmp_path / "run", procs)
    procs[0].kill()
    logs = _finish(procs)
    assert procs[1].returncode == 1, logs[1]
    errors = [line for line in logs[1].splitlines() if line.startswith("ppo-fast: error: ")]
    assert len(errors) == 1 and "rank 1: another rank stopped answering: rank 0" in errors[0], logs[1]
    producer = int(re.search(r"producer process (\d+)", logs[0]).group(1))
    deadline = time.monotonic() + 30
    while _alive(producer) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(producer), "the producer outlived its rank"


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.full
def test_ctrl_c_on_rank_0_stops_both_ranks_after_the_step_and_one_process_resumes_with_a_producer(tmp_path):
    procs = _launch(tmp_path / "run", "--steps", "500", "--save-every", "0", *LAUNCH)
    _wait_for_a_step(tmp_path / "run", procs)
    procs[0].send_signal(signal.SIGINT)
    logs = _finish(procs)
    assert [p.returncode for p in procs] == [130, 130], logs
    assert "Traceback" not in logs[0] + logs[1] and "producer stopped" in logs[0], logs
    done = read_metrics(tmp_path / "run" / METRICS_FILE)[-1]["step"]
    assert [p.name for p in checkpoint.candidates(tmp_path / "run")] == [f"step-{done:06d}"]
    state = checkpoint.load_state(checkpoint.latest(tmp_path / "run"))
    assert state.policy_version == done and state.rollouts_in_flight >= 1  # rank 0's producer was ahead
    # One process resumes the run: its producer starts from the checkpoint's weights, and says what was lost.
    said = []
    cfg = TrainerConfig(
        output_dir=str(tmp_path / "run"),
        resume=True,
        steps=done + 1,
        batch_size=8,
        num_mini_batches=1,
        num_ppo_epochs=1,
        sample_every=0,
        sft_steps=10,
        eval_size=0,
        max_staleness=1,
    )
    assert PPOTrainer(cfg, log=said.append).train()["steps_done"] == done + 1
    assert any(f"in flight at step {done} were not saved" in line for line in said), said
    row = read_metrics(tmp_path / "run" / METRICS_FILE)[-1]
    assert (row["step"], row["async/version"], row["async/age"]) == (done + 1, done, 0)


def test_ranks_at_different_versions_are_an_error_on_every_rank():
    seen = [(3, 3), (3, 4)]  # what the gather returns on every rank: each raises the same error
    parallel = SimpleNamespace(main=False, mode="ddp", rank=1, gather_objects=lambda mine: seen)
    source = RankedSource(SimpleNamespace(parallel=parallel, step=3, policy_version=4))
    with pytest.raises(
        VersionMismatch, match=r"after the update \(rank 0: step 3, version 3, rank 1: step 3, version 4\)"
    ):
        source.publish()
    seen[0] = (3, 4)
    source.publish()  # one version: nothing to gather on rank 1 under DDP


def test_split_gives_each_rank_its_rows_in_order_with_its_own_storage():
    rows, width = 12, 5
    ids = torch.randint(100, (rows, width))
    g = Generated(
        prompts=[f"p{i // 2}" for i in range(rows)],
        answers=[str(i) for i in range(rows)],
        columns={"topic": list(range(rows))},
        batch=Batch(ids, torch.rand(rows, width) > 0.2, 2),
        engine_logprobs=torch.randn(rows, width - 2),
        responses=[f"r{i}" for i in range(rows)],
        scores=torch.randn(rows),
        reward_metrics={"reward/x": 1.0},
        version=7,
        weights_step=3,
        token_versions=torch.randint(8, (rows, width - 2)),
        token_steps=torch.randint(4, (rows, width - 2)),
    )
    shares = split(g, 3)
    assert [s.prompts for s in shares] == [g.prompts[0:4], g.prompts[4:8], g.prompts[8:12]]
    assert sum((s.columns["topic"] for s in shares), []) == g.columns["topic"]
    for name in ("input_ids", "attention_mask"):
        assert torch.equal(torch.cat([getattr(s.batch, name) for s in shares]), getattr(g.batch, name))
    for name in ("engine_logprobs", "scores", "token_versions", "token_steps"):
        assert torch.equal(torch.cat([getattr(s, name) for s in shares]), getattr(g, name)), name
    assert all((s.version, s.weights_step, s.batch.prompt_width) == (7, 3, 2) for s in shares)
    # Each share's own rows only (a view would pickle the whole batch's storage to every rank).
    assert shares[1].batch.input_ids.untyped_storage().nbytes() == 4 * width * ids.element_size()
