"""Checkpoints: everything needed to continue a run exactly where it stopped.

Layout of ``output_dir/checkpoints/step-000042/``: ``policy/`` (model and tokenizer via
``save_pretrained``), ``critic.pt`` (value head and, unless shared, its backbone) and
``trainer_state.pt`` (step, optimizer, scheduler, KL coefficient, RNG states, config).
With ``--parallel fsdp`` the policy, critic and optimizer are saved sharded, one file per
rank, by ``torch.distributed.checkpoint`` in ``sharded/``; ``policy/`` is then a full copy
for users (and for resuming at another world size).

A checkpoint is written to ``.tmp-step-*``, fsynced and renamed, so a crash or a full disk
never leaves a half-written ``step-*`` behind; stale temporary folders are removed.  Only
the latest ``keep`` checkpoints are kept (``--keep-checkpoints``, 2 by default; 0 keeps all).
Everything is read back with ``weights_only=True`` (a checkpoint cannot run code), and a
damaged checkpoint is skipped for the previous one with a message naming the bad file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from .config import CRITIC_METHODS, ConfigError
from .run_folder import CHECKPOINTS, TMP_PREFIX

STATE_FILE = "trainer_state.pt"
CRITIC_FILE = "critic.pt"
POLICY_DIR = "policy"
SHARDED_DIR = "sharded"
KEEP_LAST = 2  # the default of --keep-checkpoints


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]  # weights_only loading gives lists where pickle gave tuples
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainerState:
    step: int
    optimizer: dict  # empty when the optimizer is saved sharded (sharded/)
    scheduler: dict
    kl_coef: float
    rng: dict  # this process's (rank 0's)
    config: dict
    world_size: int = 1
    rng_per_rank: list | None = None  # every rank's RNG state, by rank


@dataclass
class Loaded:
    """A checkpoint read back whole: its folder, state and weights (None where saved sharded)."""

    path: Path
    state: TrainerState
    policy: dict | None
    critic: dict | None


class DamagedCheckpoint(Exception):
    def __init__(self, file: str, reason: str):
        super().__init__(f"{file}: {reason}")
        self.file = file


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` (and ``root``) to disk."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def remove_stale(output_dir: Path) -> None:
    """Delete the temporary folders of checkpoints whose writing never finished."""
    for stale in (output_dir / CHECKPOINTS).glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def save(
    output_dir: Path,
    step: int,
    write: Callable[[Path], None],
    keep: int = KEEP_LAST,
    *,
    main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Write checkpoint ``step`` atomically: ``write(tmp)`` fills a temporary folder (on every
    rank; ``barrier`` waits for all), then the main process fsyncs it, renames it to
    ``step-*`` and prunes old ones.  A failure (a full disk) removes the temporary folder."""
    root = output_dir / CHECKPOINTS
    final = root / f"step-{step:06d}"
    tmp = root / f"{TMP_PREFIX}{step:06d}"
    if main:
        remove_stale(output_dir)
        tmp.mkdir(parents=True)
    barrier()
    try:
        write(tmp)
        barrier()
        if main:
            _fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            _fsync(root)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if main and keep > 0:
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    barrier()
    return final


def candidates(output_dir: Path) -> list[Path]:
    """The finished checkpoints, newest first (a ``step-*`` folder exists only once written whole)."""
    return sorted((output_dir / CHECKPOINTS).glob("step-*"), reverse=True)


def latest(output_dir: Path) -> Path | None:
    found = candidates(output_dir)
    return found[0] if found else None


def load_state(checkpoint: Path) -> TrainerState:
    """The trainer state, loaded weights-only (it holds tensors, numbers, strings, lists, dicts)."""
    try:
        values = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as err:  # any failure to read the file: truncated, corrupt, poisoned pickle
        raise DamagedCheckpoint(STATE_FILE, _one_line(err)) from None
    names = {f.name for f in fields(TrainerState)}
    if not isinstance(values, dict) or not {"step", "optimizer", "config"} <= values.keys():
        raise DamagedCheckpoint(STATE_FILE, "not a trainer state")
    return TrainerState(**{k: v for k, v in values.items() if k in names})


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    text = text if len(text) <= 200 else text[:200] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def read(checkpoint: Path, *, sharded: bool, check_state: Callable[[Path, TrainerState], None]) -> Loaded:
    """Read a checkpoint whole (``DamagedCheckpoint`` naming the first unreadable file); with
    ``sharded`` the weights stay on disk for ``torch.distributed.checkpoint``.  ``check_state``
    sees the state before the weights are read (to refuse a run's options at once)."""
    state = load_state(checkpoint)
    check_state(checkpoint, state)
    if sharded:
        if not (checkpoint / SHARDED_DIR / ".metadata").is_file():
            raise DamagedCheckpoint(f"{SHARDED_DIR}/.metadata", "missing (saved without --parallel fsdp?)")
        return Loaded(checkpoint, state, None, None)
    policy_dir = checkpoint / POLICY_DIR
    try:
        json.loads((policy_dir / "config.json").read_text())
    except Exception as err:
        raise DamagedCheckpoint(f"{POLICY_DIR}/config.json", _one_line(err)) from None
    from transformers import AutoModelForCausalLM

    weights = sorted(p.name for p in policy_dir.glob("*.safetensors")) or ["model.safetensors"]
    try:
        policy = AutoModelForCausalLM.from_pretrained(policy_dir).state_dict()
    except Exception as err:
        raise DamagedCheckpoint(f"{POLICY_DIR}/{', '.join(weights)}", _one_line(err)) from None
    critic = None
    if state.config.get("advantage_method") in CRITIC_METHODS:
        try:
            critic = torch.load(checkpoint / CRITIC_FILE, map_location="cpu", weights_only=True)
        except Exception as err:
            raise DamagedCheckpoint(CRITIC_FILE, _one_line(err)) from None
    return Loaded(checkpoint, state, policy, critic)


def load_latest_usable(
    output_dir: Path,
    log: Callable[[str], None],
    *,
    sharded: bool = False,
    check_state: Callable[[Path, TrainerState], None] = lambda path, state: None,
) -> Loaded | None:
    """The newest checkpoint that reads back whole; a damaged one is reported (naming the bad
    file) and the previous one tried.  None when there is no checkpoint; ``ConfigError`` when
    none is usable (or from ``check_state``, see :func:`read`)."""
    problems = []
    for path in candidates(output_dir):
        try:
            loaded = read(path, sharded=sharded, check_state=check_state)
        except DamagedCheckpoint as err:
            problems.append(f"{path.name}/{err}")
            log(f"--resume: skipping the damaged checkpoint {path} ({err}); trying the previous one")
            continue
        return loaded
    if problems:
        raise ConfigError(
            f"--resume: no usable checkpoint in {output_dir / CHECKPOINTS}: {'; '.join(problems)}; "
            "start a new run in another --output-dir"
        )
    return None
