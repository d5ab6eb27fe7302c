"""A new run never touches an old one: ``ppo-fast train`` into an --output-dir that already holds
a run (a checkpoint, metrics.jsonl, ...) is refused in one line naming --resume and --overwrite,
with every file of the old run byte for byte and mtime for mtime as it was; --overwrite removes
the old run's own artifacts (and nothing else) and starts afresh; --overwrite --resume is refused;
a folder with other files only is used as it is; under torchrun rank 0 decides for every rank."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import ppo_fast_cli
from ppo_fast.cli import main
from ppo_fast.trainer import ConfigError, PPOTrainer, TrainerConfig, checkpoint, run_folder
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.run_folder import SUMMARY_FILE

ROOT = Path(__file__).resolve().parents[1]


def snapshot(root: Path) -> dict:
    """Every file and folder under ``root``: its content's hash (files), size and mtime."""
    tree = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        tree[path.relative_to(root).as_posix()] = (digest, info.st_size if path.is_file() else 0, info.st_mtime_ns)
    return tree


def refused_line(run: Path) -> str:
    items = "checkpoints/step-000002 and 1 older, metrics.jsonl, summary.json, curves.png, run_config.yaml, base_model.json, train.log"
    if (run / "tensorboard").exists():  # when tensorboard is installed
        items += ", tensorboard/"
    return (
        f"ppo-fast: error: --output-dir {run} already holds a run ({items}); "
        "pass --resume to continue it, or --overwrite to replace it"
    )


# ---------------------------------------------------------------------- refused


def test_a_second_train_into_a_run_folder_is_refused_with_the_old_run_intact(run, tiny_flags, error_line):
    before = snapshot(run)
    assert main(["train", "--output-dir", str(run), "--steps", "3", *tiny_flags]) == 1
    assert error_line() == refused_line(run)
    assert snapshot(run) == before
    # The console script (ppo_fast_cli) says the same; and --resume still continues the old run.
    assert ppo_fast_cli.main(["train", "--output-dir", str(run), "--steps", "3", *tiny_flags]) == 1
    assert error_line() == refused_line(run)
    assert snapshot(run) == before
    assert main(["train", "--output-dir", str(run), "--steps", "3", "--resume", *tiny_flags]) == 0
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == [1, 2, 3]
    assert [p.name for p in checkpoint.candidates(run)] == ["step-000003", "step-000002"]


def test_the_console_script_refuses_before_importing_torch(run):
    code = (
        "import sys, ppo_fast_cli\n"
        f"status = ppo_fast_cli.main(['train', '--output-dir', {str(run)!r}])\n"
        "print('STATUS', status, 'HEAVY', sorted(m for m in ('torch', 'transformers', 'ppo_fast') if m in sys.modules))\n"
    )
    before = snapshot(run)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "STATUS 1 HEAVY []" in out.stdout, out.stdout + out.stderr
    assert out.stderr.strip() == refused_line(run)
    assert snapshot(run) == before


def test_the_trainer_itself_refuses_a_run_folder(run):
    """From Python (and under torchrun, where every rank builds a trainer) as from the command."""
    before = snapshot(run)
    with pytest.raises(ConfigError) as err:
        PPOTrainer(TrainerConfig(output_dir=str(run), steps=3))
    assert "ppo-fast: error: " + str(err.value) == refused_line(run)
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "artifact, named",
    [
        ("checkpoints/step-000007/", "checkpoints/step-000007"),
        (METRICS_FILE, METRICS_FILE),
        (SUMMARY_FILE, SUMMARY_FILE),
        ("curves.png", "curves.png"),
    ],
)
def test_a_completed_step_makes_a_run(tmp_path, tiny_flags, error_line, artifact, named):
    out = tmp_path / "out"
    path = out / artifact.rstrip("/")
    if artifact.endswith("/"):
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}\n")
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    assert main(["train", "--output-dir", str(out), "--steps", "1", *tiny_flags]) == 1
    assert error_line() == (
        f"ppo-fast: error: --output-dir {out} already holds a run ({named}); "
        "pass --resume to continue it, or --overwrite to replace it"
    )
    assert snapshot(out) == before


def test_the_leftovers_of_a_run_that_completed_no_step_are_not_a_run(tmp_path):
    # What a run that failed in its first step leaves (a reward that raised, say): the next run
    # starts without --overwrite, removes them and says so; the user's files stay.
    out = tmp_path / "out"
    for folder in ("checkpoints/.tmp-step-000001", "tensorboard", "vllm_model"):
        (out / folder).mkdir(parents=True)
    (out / METRICS_FILE).write_text("\n")
    (out / "notes.txt").write_text("mine")
    assert not run_folder.completed_a_step(out)
    assert run_folder.refusal(out, resume=False, overwrite=False) is None
    said = []
    fake = SimpleNamespace(
        cfg=TrainerConfig(output_dir=str(out)),
        output_dir=out,
        log=said.append,
        parallel=SimpleNamespace(main=True, from_main=lambda verdict: verdict),
    )
    checkpoint.claim_output_dir(fake)
    assert run_folder.artifacts(out) == [] and (out / "notes.txt").read_text() == "mine"
    assert said == [
        f"--output-dir: removed the leftovers of a run that completed no step in {out} "
        "(checkpoints/.tmp-step-000001, metrics.jsonl, tensorboard/, vllm_model/)"
    ]
    (out / METRICS_FILE).write_text('{"step": 1}\n')  # one metrics row: a run
    assert run_folder.completed_a_step(out) and run_folder.refusal(out, resume=False, overwrite=False)


def test_overwrite_with_resume_is_one_line(run, tiny_flags, error_line):
    before = snapshot(run)
    assert main(["train", "--output-dir", str(run), "--overwrite", "--resume", "--steps", "3", *tiny_flags]) == 1
    assert error_line() == (
        "ppo-fast: error: invalid config: overwrite (--overwrite) cannot be combined with --resume "
        "(--resume continues the run in output_dir, --overwrite deletes it); choose one"
    )
    assert snapshot(run) == before


# ---------------------------------------------------------------------- --overwrite, and folders without a run


def test_overwrite_replaces_the_old_run_and_keeps_everything_else(run, tiny_flags, capsys):
    (run / "notes.txt").write_text("the user's")
    (run / "checkpoints" / "README").write_text("also the user's")
    old_state = (run / "checkpoints" / "step-000001" / checkpoint.STATE_FILE).read_bytes()
    kept = {
        name: entry
        for name, entry in snapshot(run).items()
        if name in ("notes.txt", "checkpoints/README") or name.startswith("warmup")
    }
    assert any(name.startswith("warmup/") for name in kept)
    assert main(["train", "--output-dir", str(run), "--overwrite", "--steps", "1", *tiny_flags]) == 0
    out = capsys.readouterr().out
    assert f"--overwrite: removed the previous run in {run} (checkpoints/step-000002 and 1 older, metrics.jsonl" in out
    assert "reusing the warm-up model" in out  # the cache is not the run
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == [1]
    assert [p.name for p in checkpoint.candidates(run)] == ["step-000001"]
    assert (run / "checkpoints" / "step-000001" / checkpoint.STATE_FILE).read_bytes() != old_state
    assert checkpoint.load_state(checkpoint.latest(run)).step == 1
    after = snapshot(run)
    assert {name: after[name] for name in kept} == kept
    # The new run is the one --resume continues (and --overwrite is not an option it compares).
    assert main(["train", "--output-dir", str(run), "--resume", "--steps", "2", *tiny_flags]) == 0
    assert "resuming with changed options" not in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == [1, 2]


def test_a_folder_with_other_files_only_is_used(tmp_path, tiny_flags):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    assert run_folder.artifacts(out) == []
    kept = snapshot(out)
    assert main(["train", "--output-dir", str(out), "--steps", "1", *tiny_flags, "--eval-size", "0"]) == 0
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [1]
    assert {name: snapshot(out)[name] for name in kept} == kept
    # Nothing to replace: --overwrite on a missing folder just starts.
    assert run_folder.remove_run(tmp_path / "missing") == []


def test_resume_into_a_folder_without_a_run_starts_from_scratch(tiny_config):
    """Unchanged: --resume with no checkpoint says so and starts at step 1."""
    messages = []
    cfg = tiny_config("new", steps=1, resume=True, eval_size=0)
    assert PPOTrainer(cfg, log=messages.append).train()["steps_done"] == 1
    assert any("--resume: no checkpoint in" in m and "starting from scratch" in m for m in messages)


# ---------------------------------------------------------------------- several processes


def _claim(tmp_path, *, rank: int, overwrite: bool, verdict_of_rank_0):
    """``checkpoint.claim_output_dir`` as rank ``rank`` of two, rank 0's verdict given."""
    out = tmp_path / "out"
    (out / "checkpoints" / "step-000001").mkdir(parents=True, exist_ok=True)
    (out / METRICS_FILE).write_text("{}\n")
    sent = []

    def from_main(obj):
        sent.append(obj)
        return obj if rank == 0 else verdict_of_rank_0

    fake = SimpleNamespace(
        cfg=TrainerConfig(output_dir=str(out), overwrite=overwrite),
        output_dir=out,
        log=lambda _: None,
        parallel=SimpleNamespace(main=rank == 0, from_main=from_main),
    )
    return out, sent, lambda: checkpoint.claim_output_dir(fake)


def test_only_rank_0_looks_and_deletes_and_every_rank_follows_it(tmp_path):
    # Rank 1 with --overwrite deletes nothing: it waits for rank 0's verdict (None: go on).
    out, sent, claim = _claim(tmp_path, rank=1, overwrite=True, verdict_of_rank_0=None)
    before = snapshot(out)
    claim()
    assert sent == [None] and snapshot(out) == before
    # Rank 1 follows a refusal it did not make itself.
    out, sent, claim = _claim(tmp_path, rank=1, overwrite=False, verdict_of_rank_0="rank 0's reason")
    with pytest.raises(ConfigError, match="rank 0's reason"):
        claim()
    # Rank 0 sends its refusal to the others, and with --overwrite deletes before it says go.
    out, sent, claim = _claim(tmp_path, rank=0, overwrite=False, verdict_of_rank_0=None)
    with pytest.raises(ConfigError, match="already holds a run"):
        claim()
    assert len(sent) == 1 and "already holds a run" in sent[0]
    out, sent, claim = _claim(tmp_path, rank=0, overwrite=True, verdict_of_rank_0=None)
    claim()
    assert sent == [None] and run_folder.artifacts(out) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.full  # under torchrun: CI runs it in its multihost step (.ci/multihost.sh)
def test_two_ranks_overwrite_a_run_folder_together(tmp_path, tiny_flags):
    """What torchrun starts: two processes on gloo; rank 0 removes the old run, both train."""
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000009" / "policy").mkdir(parents=True)
    (out / METRICS_FILE).write_text('{"step": 9}\n')
    (out / "notes.txt").write_text("the user's")
    command = [sys.executable, "-m", "ppo_fast", "train", "--output-dir", str(out), "--overwrite", "--steps", "1"]
    command += [*tiny_flags, *"--batch-size 8 --eval-size 0 --dist-timeout 60".split()]
    world = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **world, "RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "--overwrite: removed the previous run" in logs[0] and "--overwrite" not in logs[1]
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [1]
    assert [p.name for p in checkpoint.candidates(out)] == ["step-000001"]
    assert (out / "notes.txt").read_text() == "the user's"


def test_eval_and_generate_a_finished_run(finished_run, tmp_path, monkeypatch, capsys):
    """`ppo-fast eval` scores the last checkpoint's policy as the trainer's final evaluation did (the
    run's own held-out prompts and reward); with another reward it agrees with `ppo-fast generate`'s
    greedy responses to the same prompts scored by hand."""
    import json

    from ppo_fast.trainer import default_task

    def said() -> list[dict]:
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert main(["eval", str(finished_run), "--device", "cpu"]) == 0
    (result,) = said()
    assert result["eval/score"] == json.loads((finished_run / SUMMARY_FILE).read_text())["eval_after"]
    assert result["prompts"] == 16 and result["policy"] == str(finished_run / "checkpoints" / "step-000002" / "policy")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lengths.py").write_text("def score(prompts, responses):\n    return [len(r) / 4 for r in responses]\n")
    held_out = default_task.prompts(TrainerConfig(eval_size=16))[1]
    (tmp_path / "held_out.txt").write_text("\n".join(held_out) + "\n")
    assert main(["eval", str(finished_run / "checkpoints" / "step-000002"), "--reward-fn", "lengths.py:score"]) == 0
    (by_length,) = said()
    assert main(["generate", str(finished_run), "--prompts-file", "held_out.txt"]) == 0
    responses = said()
    assert [r["prompt"] for r in responses] == held_out
    assert by_length["eval/score"] == pytest.approx(sum(len(r["response"]) / 4 for r in responses) / len(held_out))
    assert main(["eval", str(finished_run), "--best"]) == 1
    assert "no best/ (the run was not made with --keep-best)" in capsys.readouterr().err
