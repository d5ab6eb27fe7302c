"""Data-parallel PPO on torch.distributed, on CPU with gloo at world size 2: one optimizer step
at world 2 (per-rank batch b) equals world 1 (batch 2b) under DDP and FSDP2; the built-in job
runs under torchrun; Ctrl-C on rank 0 stops every rank after the step with one checkpoint; a
rank that dies makes the other exit with one line instead of hanging."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dist_workers
import pytest
import torch
import torch.multiprocessing as mp

from ppo_fast.trainer import checkpoint
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = "--batch-size 8 --num-mini-batches 1 --num-ppo-epochs 1 --sample-every 0 --sft-steps 10 --eval-size 0 --dist-timeout 60".split()


@pytest.mark.full  # under torchrun: CI runs it in its multihost step (.ci/multihost.sh)
def test_one_step_at_world_2_equals_world_1_with_the_whole_batch(tmp_path):
    seed = torch.randint(1000, ()).item()
    out = tmp_path / "world2.pt"
    mp.spawn(dist_workers.equivalence, args=(2, str(tmp_path / "init"), str(out), seed), nprocs=2, join=True)
    world2 = torch.load(out, weights_only=True)
    for (mode, agg, variant), got in world2.items():
        want = dist_workers.reference_update(seed, agg, variant)
        where = f"{mode}, {agg}, {variant}"
        if variant == "lora":  # only the adapters and the value head train (and only their gradients are reduced)
            assert all(".lora_" in name or name.startswith("critic.head.") for name in got["grads"]), where
        # DDP runs the fused LM head inside its forward; FSDP2 scores from the logits (said why).
        assert want["logits_fallbacks"] == [] and (
            got["logits_fallbacks"] == []
            if mode == "ddp"
            else "sharded with FSDP2" in " ".join(got["logits_fallbacks"])
        ), where
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), where
        torch.testing.assert_close(got["advantages"], want["advantages"], msg=lambda m: f"{where}: advantages: {m}")
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            torch.testing.assert_close(
                got["grads"][name],
                want["grads"][name],
                rtol=1e-4,
                atol=1e-6,
                msg=lambda m: f"{where}: grad of {name}: {m}",
            )
            torch.testing.assert_close(
                got["weights"][name], want["weights"][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}"
            )
        assert any(g.abs().sum() > 0 for g in want["grads"].values())


@pytest.mark.full  # under torchrun: CI runs it in its multihost step (.ci/multihost.sh)
def test_ddp_ranks_split_the_held_out_evaluation(tmp_path):
    """Under DDP each rank decodes its share of the held-out prompts (19 + 18 of 37) and the
    all-reduced metrics equal one process decoding all of them."""
    out = tmp_path / "eval.pt"
    mp.spawn(
        dist_workers.eval_shards,
        args=(2, str(tmp_path / "init"), str(tmp_path / "world2"), str(out)),
        nprocs=2,
        join=True,
    )
    world2 = torch.load(out, weights_only=True)
    assert world2["counts"] == [19, 18]
    trainer = dist_workers.eval_trainer(str(tmp_path / "world1"))
    world1 = trainer.evaluate_all(trainer.policy)
    assert set(world1) == {"eval/score", "eval/exact_match"} and world1["eval/score"] > 0
    assert world2["metrics"] == pytest.approx(world1, rel=1e-12)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: Path, *args: str, world_size: int = 2) -> list[subprocess.Popen]:
    """What torchrun does, one process per rank, so that a test can signal or kill one rank."""
    port = str(_free_port())
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ppo_fast", "train", "--output-dir", str(out), *args],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _wait_for_a_step(out: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 180
    while not read_metrics(out / METRICS_FILE):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [p.communicate() for p in procs]
        time.sleep(0.2)


def _finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[str]:
    try:
        return [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.full  # under torchrun: CI runs it in its multihost step (.ci/multihost.sh)
def test_two_ranks_run_the_builtin_job_under_torchrun_with_fsdp_and_a_resume_at_world_1_reshards(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc-per-node 2 -m ppo_fast train --output-dir".split(),
        str(out),
        *"--steps 2 --parallel fsdp --shard-reference".split(),
        *TINY,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["episode"] == 2 * 8  # --batch-size is global
    assert (done.stdout + done.stderr).count("saved ") == 1  # rank 0 speaks for the run
    saved = checkpoint.latest(out)
    state = checkpoint.load_state(saved)
    assert saved.name == "step-000002" and state.world_size == 2 and len(state.rng_per_rank) == 2
    assert not torch.equal(state.rng_per_rank[0]["torch"], state.rng_per_rank[1]["torch"])  # each rank samples its own
    assert sorted(p.name for p in (saved / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    from transformers import AutoModelForCausalLM

    from ppo_fast.trainer import PPOTrainer, TrainerConfig

    users_copy = AutoModelForCausalLM.from_pretrained(
        saved / "policy"
    )  # rank 0's save_pretrained of the gathered weights
    assert users_copy.config.architectures == ["GPT2LMHeadModel"]
    cfg = TrainerConfig(
        output_dir=str(out),
        resume=True,
        steps=3,
        batch_size=8,
        num_mini_batches=1,
        num_ppo_epochs=1,
        sample_every=0,
        sft_steps=10,
        eval_size=0,
        parallel="fsdp",
        shard_reference=True,
    )
    trainer = PPOTrainer(cfg, log=lambda _: None)  # one process: the shards are gathered into whole tensors
    for name, weight in users_copy.state_dict().items():
        torch.testing.assert_close(trainer.policy.state_dict()[name], weight, msg=lambda m: f"{name}: {m}")
    assert trainer.optimizer.state_dict()["state"]  # AdamW's moments came back too
    assert trainer.train()["steps_done"] == 3


@pytest.mark.full  # under torchrun: CI runs it in its multihost step (.ci/multihost.sh)
def test_ctrl_c_on_rank_0_stops_every_rank_after_the_step_and_a_resume_at_world_1_continues(tmp_path):
    out = tmp_path / "run"
    procs = _launch(out, "--steps", "500", "--save-every", "0", *TINY)
    _wait_for_a_step(out, procs)
    procs[0].send_signal(signal.SIGINT)
    logs = _finish(procs)
    assert [p.returncode for p in procs] == [130, 130], logs
    assert "Ctrl-C: stopping after this step" in logs[0] and "Traceback" not in logs[0] + logs[1]
    done = read_metrics(out / METRICS_FILE)[-1]["step"]
    assert [p.name for p in checkpoint.candidates(out)] == [f"step-{done:06d}"]
    from ppo_fast.trainer import PPOTrainer, TrainerConfig

    messages = []
    cfg = TrainerConfig(
        output_dir=str(out),
        resume=True,
        steps=done + 1,
        batch_size=8,
        num_mini_batches=1,
        num_ppo_epochs=1,
        sample_every=0,
        sft_steps=10,
        eval_size=0,
        dist_timeout=60,
    )
    assert PPOTrainer(cfg, log=messages.append).train()["steps_done"] == done + 1
    assert any("saved by 2 process(es), this run has 1: the random streams are seeded anew" in m for m in messages)


@pytest.mark.full  # under torchrun: CI runs it in its multihost step (.ci/multihost.sh)
def test_a_dead_rank_makes_the_other_exit_with_one_line(tmp_path):
    out = tmp_path / "run"
    procs = _launch(out, "--steps", "500", "--save-every", "0", *TINY)
    _wait_for_a_step(out, procs)
    procs[1].kill()
    start = time.monotonic()
    logs = _finish(procs[:1])
    assert procs[0].returncode == 1, logs[0]
    errors = [line for line in logs[0].splitlines() if line.startswith("ppo-fast: error: ")]
    assert len(errors) == 1 and "rank 0: another rank stopped answering" in errors[0], logs[0]
    assert "Traceback" not in logs[0]
    assert time.monotonic() - start < 60  # well before --dist-timeout: gloo sees the closed connection


def test_a_failed_collective_inside_ddp_or_fsdp_is_a_lost_rank():
    """DDP's and FSDP's own collectives (in forward, backward, all-gathers) fail with the
    backend's raw error when a peer dies; the run's guard turns only those into RankLost."""
    from ppo_fast.trainer.distributed import Parallel, RankLost

    guard = Parallel(rank=1, world_size=2).guard
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:52099: Connection reset by peer."
    with pytest.raises(
        RankLost, match=r"^rank 1: another rank stopped answering: rank 0 is lost \(\[/pytorch/third_party/gloo"
    ):
        with guard():
            raise RuntimeError(gloo)
    with pytest.raises(RankLost, match="another rank stopped answering"):
        with guard():
            raise torch.distributed.DistBackendError("NCCL communicator was aborted")
    with pytest.raises(
        RankLost, match=r"^rank 1: another rank stopped answering: rank 0 is lost \(Application timeout"
    ):
        with guard():  # a cut link: gloo's timeout inside DDP's backward
            raise RuntimeError("Application timeout caused pair closure")
    with pytest.raises(
        RuntimeError, match="^mat1 and mat2 shapes cannot be multiplied$"
    ):  # the model's own error stays
        with guard():
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    with pytest.raises(RuntimeError, match="^gloo"):  # one process: nothing to lose
        with Parallel().guard():
            raise RuntimeError("gloo")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_gpu_under_torchrun_runs_the_same_command(tmp_path):
    """The GPU check's run of the same command on one GPU (one process: no process group)."""
    out = tmp_path / "run"
    command = [
        sys.executable,
        *"-m torch.distributed.run --standalone --nproc-per-node 1 -m ppo_fast train --output-dir".split(),
        str(out),
        *"--steps 2 --device cuda".split(),
        *TINY,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [1, 2]
    assert checkpoint.load_state(checkpoint.latest(out)).world_size == 1
