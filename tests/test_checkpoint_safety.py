"""Checkpoints and --resume under faults: a poisoned pickle cannot run code, a damaged checkpoint
falls back to the previous one (naming the bad file), a torn metrics line is tolerated, writes are
fsynced and leave no temporary folder, every changed option is applied or refused in one line, a
full disk or an unwritable output directory is one line, and SIGTERM stops after the step."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ppo_fast.cli import main
from ppo_fast.trainer import PPOTrainer, TrainerConfig, checkpoint
from ppo_fast.trainer.checkpoint import REFUSED_BUILTIN
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics
from ppo_fast.trainer.startup import lr_lambda

ROOT = Path(__file__).resolve().parents[1]


def resumed(run: Path, messages: list | None = None, **overrides) -> PPOTrainer:
    """``run`` resumed to step 3 with its own options, a checkpoint after each step (all kept)."""
    changed = dict(output_dir=str(run), steps=3, resume=True, save_every=1, keep_checkpoints=0, **overrides)
    cfg = dataclasses.replace(TrainerConfig.from_file(run / "run_config.yaml"), **changed)
    return PPOTrainer(cfg, log=messages.append if messages is not None else None)


# ---------------------------------------------------------------------- unsafe or damaged files


class _Poison:
    """Unpickling this creates ``path``: what an attacker's code would do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_poisoned_trainer_state_cannot_run_code(run, tmp_path):
    marker = tmp_path / "pwned"
    state_file = run / "checkpoints" / "step-000002" / checkpoint.STATE_FILE
    torch.save({"step": 2, "optimizer": {}, "config": {}, "payload": _Poison(marker)}, state_file)
    # The poison is real: a full unpickle runs it.
    torch.load(state_file, weights_only=False)
    assert marker.exists()
    marker.unlink()
    messages = []
    trainer = resumed(run, messages)
    assert not marker.exists()
    assert trainer.step == 1
    assert any(
        "skipping the damaged checkpoint" in m and "step-000002" in m and checkpoint.STATE_FILE in m for m in messages
    )


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path: Path) -> None:
    path.write_bytes(b"\x00{not json" + os.urandom(16))


@pytest.mark.parametrize(
    "name, damage",
    [
        ("policy/model.safetensors", _truncate),
        ("policy/config.json", _garble),
        (checkpoint.CRITIC_FILE, _truncate),
        (checkpoint.STATE_FILE, _truncate),
        (checkpoint.CRITIC_FILE, Path.unlink),
    ],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(run, name, damage):
    damage(run / "checkpoints" / "step-000002" / name)
    messages = []
    trainer = resumed(run, messages)
    assert trainer.step == 1 and trainer.resumed_from == 1
    skipped = [m for m in messages if "skipping the damaged checkpoint" in m]
    assert len(skipped) == 1 and "step-000002" in skipped[0] and name in skipped[0], messages
    assert any("resumed from" in m and "step-000001" in m for m in messages)


def test_no_usable_checkpoint_is_one_line_naming_each_bad_file(run, tiny_flags, error_line):
    _truncate(run / "checkpoints" / "step-000002" / checkpoint.STATE_FILE)
    _garble(run / "checkpoints" / "step-000001" / "policy" / "config.json")
    assert main(["train", "--output-dir", str(run), "--resume", "--steps", "3", *tiny_flags]) == 1
    line = error_line()
    assert "no usable checkpoint" in line
    assert f"step-000002/{checkpoint.STATE_FILE}" in line and "step-000001/policy/config.json" in line


def test_a_torn_last_metrics_line_is_tolerated_on_resume(run):
    metrics = run / METRICS_FILE
    with metrics.open("a") as f:
        f.write('{"step": 3, "objective/sco')  # the disk filled up mid-line
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2]
    assert resumed(run).train()["steps_done"] == 3
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]
    assert len(checkpoint.candidates(run)) == 3  # --keep-checkpoints 0: all
    metrics.write_text('{"step": 1}\n{"ste\n{"step": 2}\n')  # damage inside the file is not hidden
    with pytest.raises(ValueError):
        read_metrics(metrics)


# ---------------------------------------------------------------------- writing


def test_checkpoints_are_fsynced_and_stale_temporary_folders_removed(run, monkeypatch):
    stale = run / "checkpoints" / ".tmp-step-000007"
    (stale / "policy").mkdir(parents=True)
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    trainer = resumed(run)
    assert not stale.exists()  # removed when the run starts
    trainer.step = 3
    saved = trainer.save_checkpoint()
    tmp = saved.parent / ".tmp-step-000003"  # written there, then renamed
    written = {p.relative_to(saved) for p in saved.rglob("*")}
    assert written and written <= {p.relative_to(tmp) for p in synced if tmp in p.parents}
    assert saved.parent in synced  # the rename is on disk too
    assert not list((run / "checkpoints").glob(".tmp-step-*"))


@pytest.fixture
def small_filesystem(tmp_path):
    """``mount(size_bytes) -> folder``: a tmpfs of that size (root only: skipped elsewhere), unmounted after."""
    mounted = []

    def mount(size: int) -> Path:
        folder = tmp_path / f"fs{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
        if done.returncode:
            pytest.skip(f"a small filesystem needs mount (root): {done.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:  # lazily: a file the failed run left open (its train.log) keeps it busy
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(run, tiny_flags, error_line, small_filesystem):
    """The run on a filesystem with room for its two checkpoints and less than a third: torch.save's
    own failure (a RuntimeError, not an OSError) is the one line the docs promise, and nothing is lost."""
    used = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
    disk = small_filesystem(used + (1 << 20)) / "run"
    shutil.copytree(run, disk)
    assert main(["train", "--output-dir", str(disk), "--resume", "--steps", "3", *tiny_flags]) == 1
    line = error_line(progress=True)
    assert "No space left on device" in line and "the last complete checkpoint" in line
    assert [p.name for p in checkpoint.candidates(disk)] == ["step-000002", "step-000001"]
    assert not list((disk / "checkpoints").glob(".tmp-step-*"))


def test_an_output_dir_that_cannot_be_written_is_one_line(error_line):
    # /sys refuses new folders even to root (chmod does not stop root).
    assert main(["train", "--output-dir", "/sys/ppo_fast_run", "--steps", "1"]) == 1
    assert "--output-dir /sys/ppo_fast_run: cannot write there" in error_line()


# ---------------------------------------------------------------------- changed options


@pytest.mark.parametrize(
    "name, value",
    [
        ("seed", 1),
        ("critic", "shared"),
        *((n, v) for n, v in zip(REFUSED_BUILTIN, (11, 64, 1e-3, 0.5, 8))),
        ("advantage_method", "grpo"),
    ],
)
def test_a_refused_option_change_is_one_line(run, tiny_flags, error_line, name, value):
    flag = "--" + name.replace("_", "-")
    extra = ["--group-size", "2"] if name == "advantage_method" else []
    assert (
        main(["train", "--output-dir", str(run), "--resume", "--steps", "3", *tiny_flags, flag, str(value), *extra])
        == 1
    )
    old = TrainerConfig.from_file(run / "run_config.yaml").to_dict()[name]
    line = error_line()
    assert f"was trained with {flag} {old}" in line and f"resume with {flag} {old}" in line, line


def test_applied_option_changes_take_effect(run):
    messages = []
    trainer = resumed(
        run,
        messages,
        learning_rate=5e-4,
        weight_decay=0.01,
        kl_coef=0.2,
        warmup_steps=10,
        lr_scheduler_type="linear",
        clip_eps_low=0.1,
    )
    assert any(
        m.startswith("resuming with changed options: ") and "learning_rate" in m and "kl_coef" in m for m in messages
    )
    updates_done = trainer.scheduler.last_epoch
    assert updates_done == 2
    factor = lr_lambda(trainer.cfg, 3 * 1 * 1)(updates_done)
    for group in trainer.optimizer.param_groups:
        assert group["lr"] == pytest.approx(5e-4 * factor) and group["weight_decay"] == 0.01
    assert trainer.kl_control.value == 0.2 and trainer.cfg.clip_eps_low == 0.1
    trainer.train()
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(5e-4 * lr_lambda(trainer.cfg, 3)(3))


def test_grpo_and_rloo_may_swap_on_resume(tiny_config):
    cfg = tiny_config(steps=1, advantage_method="grpo", group_size=2, batch_size=2, num_mini_batches=1)
    PPOTrainer(cfg).train()
    assert PPOTrainer(dataclasses.replace(cfg, advantage_method="rloo", resume=True, steps=2)).step == 1


# ---------------------------------------------------------------------- signals


def test_sigterm_stops_after_the_step_with_a_checkpoint(tmp_path, tiny_flags):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "ppo_fast",
        "train",
        "--output-dir",
        str(out),
        "--steps",
        "500",
        "--save-every",
        "0",
    ]
    command += [*tiny_flags, "--eval-size", "0"]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not read_metrics(out / METRICS_FILE):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, output
    assert "SIGTERM: stopping after this step" in output and "Traceback" not in output
    done = read_metrics(out / METRICS_FILE)[-1]["step"]
    assert [p.name for p in checkpoint.candidates(out)] == [f"step-{done:06d}"]
    assert checkpoint.load_state(checkpoint.latest(out)).step == done
