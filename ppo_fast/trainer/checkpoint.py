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

This module owns the run folder's checkpoints for the trainer: what one holds (``save_run``),
how a new run claims its folder (``claim_output_dir``, see ``run_folder``) and how a run is
resumed (``find_resumable``, ``restore``).  Every option applies from the resumed step on (the
learning rate, weight decay and schedule are set on the restored optimizer, a changed
``--kl-coef`` replaces the current coefficient), except those in ``REFUSED``, which would
silently make another run: they are refused with one line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from . import distributed, lora, run_folder
from .config import CRITIC_METHODS, RENAMED, WARM_UP, ConfigError, TrainerConfig, flag, resume_policy
from .config import IGNORED as IGNORED_ON_RESUME
from .run_folder import CHECKPOINTS, TMP_PREFIX

STATE_FILE = "trainer_state.pt"
CRITIC_FILE = "critic.pt"
POLICY_DIR = "policy"
MERGED_DIR = "policy_merged"  # --lora-save-merged: the final policy with its adapters merged
SHARDED_DIR = "sharded"
KEEP_LAST = 2  # the default of --keep-checkpoints

# What --resume does with a changed option is declared at its field (config.py's ``resume=``).
REFUSED = {name: why.removeprefix("refused: ") for name, why in resume_policy("refused:").items()}
REFUSED_BUILTIN = tuple(resume_policy(WARM_UP))
IGNORED = tuple(resume_policy(IGNORED_ON_RESUME))


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
    best: dict | None = None  # --keep-best: {"step", "eval/score"} of output_dir/best
    policy_version: int | None = None  # the policy's optimizer steps (None: a checkpoint from before versions)
    rollouts_in_flight: int = 0  # --max-staleness > 0: batches generated or being generated, not saved
    partial_in_flight: int = 0  # --partial-rollouts: groups partly generated (or waiting for a batch), not saved


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


# Free space below which a failed write is taken for a full disk.
FULL_DISK_BYTES = 64 << 20


@contextlib.contextmanager
def full_disk_as_oserror(folder: Path):
    """A writer's failure on a full filesystem as ``OSError(ENOSPC)``, whatever the writer raised:
    ``torch.save`` raises ``RuntimeError`` ("unexpected pos", "iostream error"), safetensors its own
    error; an ``OSError`` passes as it is, and so does any failure while there is room."""
    try:
        yield
    except Exception as err:
        if isinstance(err, OSError) or shutil.disk_usage(folder).free >= FULL_DISK_BYTES:
            raise
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder)) from err


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
        with full_disk_as_oserror(tmp):
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
    policy = _read_policy(checkpoint / POLICY_DIR, adapters=state.config.get("lora_r") is not None)
    critic = None
    if state.config.get("advantage_method") in CRITIC_METHODS:
        try:
            critic = torch.load(checkpoint / CRITIC_FILE, map_location="cpu", weights_only=True)
        except Exception as err:
            raise DamagedCheckpoint(CRITIC_FILE, _one_line(err)) from None
    return Loaded(checkpoint, state, policy, critic)


def _read_policy(policy_dir: Path, adapters: bool) -> dict:
    """The policy's weights: a ``save_pretrained`` folder's, or (LoRA) the adapter folder's."""
    described = lora.ADAPTER_CONFIG if adapters else "config.json"
    try:
        json.loads((policy_dir / described).read_text())
    except Exception as err:
        raise DamagedCheckpoint(f"{POLICY_DIR}/{described}", _one_line(err)) from None
    weights = sorted(p.name for p in policy_dir.glob("*.safetensors")) or ["model.safetensors"]
    try:
        if adapters:
            return lora.read_adapter(policy_dir)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(policy_dir).state_dict()
    except Exception as err:
        raise DamagedCheckpoint(f"{POLICY_DIR}/{', '.join(weights)}", _one_line(err)) from None


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


# ---------------------------------------------------------------------- --resume: the options


def check_options(saved: dict, cfg: TrainerConfig, builtin: bool, where: str) -> list[str]:
    """``ConfigError`` for a refused change; else the applied changes as ``name old -> new``."""
    saved = {RENAMED.get(name, name): value for name, value in saved.items()}  # a checkpoint of before a rename
    changed = {
        name: old
        for name, old in saved.items()
        if name not in IGNORED and hasattr(cfg, name) and getattr(cfg, name) != old
    }
    refused = dict(REFUSED)
    if builtin:
        refused.update(
            {name: "the built-in task's warm-up model (the KL reference) depends on it" for name in REFUSED_BUILTIN}
        )
    old_method = saved.get("advantage_method", cfg.advantage_method)
    if (old_method in CRITIC_METHODS) != cfg.uses_critic:
        refused["advantage_method"] = "with a critic" if old_method in CRITIC_METHODS else "without a critic"
    for name, old in changed.items():
        if name in refused:
            raise ConfigError(
                f"{where} was trained with {flag(name)} {_show(old)} ({refused[name]}); resume with "
                f"{flag(name)} {_show(old)}, or start a new run in another --output-dir"
            )
    return [f"{name} {old!r} -> {getattr(cfg, name)!r}" for name, old in changed.items()]


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _apply_optimizer_options(optimizer, scheduler, cfg: TrainerConfig, lr_factor) -> None:
    """Set this run's learning rate, weight decay and schedule on a restored optimizer and scheduler
    (their state dicts hold the values the run was started with)."""
    scheduler.base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    lrs = []
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.learning_rate
        group["weight_decay"] = cfg.weight_decay
        group["lr"] = cfg.learning_rate * lr_factor(scheduler.last_epoch)
        lrs.append(group["lr"])
    scheduler._last_lr = lrs


# ---------------------------------------------------------------------- the trainer's run folder


def claim_output_dir(run) -> None:
    """A new run (no ``--resume``) in a folder that holds a run: ``ConfigError`` in one line,
    nothing touched; with ``--overwrite`` the old run's artifacts are removed first (see
    ``run_folder``).  Rank 0 looks and removes, alone; every rank follows its verdict."""
    cfg, output_dir, parallel = run.cfg, run.output_dir, run.parallel
    if cfg.resume:
        return
    verdict = None
    if parallel.main:
        verdict = run_folder.refusal(output_dir, resume=False, overwrite=cfg.overwrite)
        found = run_folder.artifacts(output_dir) if verdict is None else []
        # Leftovers of a run that completed no step go without --overwrite: they hold no result.
        leftovers = bool(found) and not run_folder.completed_a_step(output_dir)
        if found and (cfg.overwrite or leftovers):
            what = run_folder.describe(found, output_dir)
            option = "--output-dir" if leftovers else "--overwrite"
            try:
                run_folder.remove_run(output_dir)
            except OSError as err:
                verdict = (
                    f"{option}: cannot remove {err.filename or output_dir} ({err.strerror or err}); "
                    f"remove the old run in {output_dir} yourself, or choose another --output-dir"
                )
            else:
                old = "the leftovers of a run that completed no step" if leftovers else "the previous run"
                run.log(f"{option}: removed {old} in {output_dir} ({what})")
    verdict = parallel.from_main(verdict)
    if verdict is not None:
        raise ConfigError(verdict)


def find_resumable(run) -> Loaded | None:
    """The newest usable checkpoint, read whole; ``ConfigError`` if this run's options
    cannot continue it (checked before any model is loaded)."""

    def check_state(path: Path, state: TrainerState) -> None:
        check_options(state.config, run.cfg, run.builtin, f"--resume: the checkpoint {path}")

    sharded = run.cfg.parallel == "fsdp"
    loaded = load_latest_usable(run.output_dir, run.log, sharded=sharded, check_state=check_state)
    if loaded is None:
        run.log(f"--resume: no checkpoint in {run.output_dir / CHECKPOINTS}, starting from scratch")
    return loaded


def _load_weights(run, loaded: Loaded) -> None:
    try:
        adapters = run.adapters
        if run.cfg.parallel == "fsdp":  # resharded to this world size by torch.distributed.checkpoint
            distributed.load_sharded(
                loaded.path / SHARDED_DIR, run.policy, run.critic, run.optimizer, adapters is not None
            )
        else:
            if adapters is not None:  # the frozen base is the run's model; the checkpoint holds what trains
                lora.load_adapter(adapters, loaded.policy)
                if run.critic is not None:
                    lora.load_trainable(run.critic, loaded.critic)
            else:
                run.policy.load_state_dict(loaded.policy)
                if run.critic is not None:
                    run.critic.load_state_dict(loaded.critic)
            run.optimizer.load_state_dict(loaded.state.optimizer)
    except (RuntimeError, ValueError, KeyError) as err:  # load_state_dict: missing/unexpected keys, shapes, groups
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(
            f"--resume: the checkpoint {loaded.path} does not fit this run's model ({reason}); "
            "resume with the options the run was started with, or use another --output-dir"
        ) from err


def restore(run, loaded: Loaded, lr_factor) -> int:
    """Put the trainer where the checkpoint left it (weights, optimizer with this run's options,
    schedule, KL coefficient, random streams); return its step."""
    state, cfg, parallel = loaded.state, run.cfg, run.parallel
    changed = check_options(state.config, cfg, run.builtin, f"--resume: the checkpoint {loaded.path}")
    if changed:
        run.log("resuming with changed options: " + ", ".join(changed))
    _load_weights(run, loaded)
    run.scheduler.load_state_dict(state.scheduler)
    _apply_optimizer_options(run.optimizer, run.scheduler, cfg, lr_factor)
    # A --kl-coef given anew replaces the current (possibly adapted) coefficient.
    kl_changed = state.config.get("kl_coef", cfg.kl_coef) != cfg.kl_coef
    run.kl_control.value = cfg.kl_coef if kl_changed else state.kl_coef
    rngs = state.rng_per_rank or [state.rng]
    if len(rngs) == parallel.world_size:
        set_rng_state(rngs[parallel.rank])
    else:  # weights, optimizer, schedule and KL continue exactly; the random streams start anew
        seed_all(cfg.seed + parallel.rank + parallel.world_size * state.step)
        run.log(
            f"--resume: the checkpoint was saved by {len(rngs)} process(es), this run has "
            f"{parallel.world_size}: the random streams are seeded anew (the run continues, not bit for bit)"
        )
    run.best = state.best
    saved = state.config
    steps_per_update = saved.get("num_ppo_epochs", cfg.num_ppo_epochs) * saved.get("num_mini_batches", 1)
    run.policy_version = state.step * steps_per_update if state.policy_version is None else state.policy_version
    run.log(f"resumed from {loaded.path} (step {state.step}); policy version {run.policy_version}")
    if state.rollouts_in_flight:
        run.log(
            f"--resume: the {state.rollouts_in_flight} rollout batch(es) in flight at step {state.step} were not "
            "saved: they are generated anew from the checkpoint's weights"
        )
    if state.partial_in_flight:
        run.log(
            f"--resume: the {state.partial_in_flight} group(s) of --partial-rollouts the producer held at step "
            f"{state.step} (unfinished responses, or finished ones waiting for a batch) were not saved: dropped"
        )
    return state.step


def keep_if_best(run, scores: dict) -> None:
    """``--keep-best``: when ``scores["eval/score"]`` (the policy's held-out score at this step) beats
    the best so far, the policy and tokenizer replace ``output_dir/best`` (written aside, then
    renamed).  Every rank calls this (a sharded policy is gathered)."""
    score, parallel = scores.get("eval/score"), run.parallel
    if not run.cfg.keep_best or score is None:
        return
    # Rank 0 decides for every rank (their scores could differ in the last bit; the save is collective).
    score = parallel.from_main(score if run.best is None or score > run.best["eval/score"] else None)
    if score is None:
        return
    sharded = run.cfg.parallel == "fsdp"
    full_policy = distributed.full_state_dict(run.policy) if sharded else None
    if parallel.main:
        # Written aside where an unfinished checkpoint is: remove_stale and --overwrite clear what a crash leaves.
        best, tmp = run.output_dir / run_folder.BEST_DIR, run.output_dir / CHECKPOINTS / f"{TMP_PREFIX}best"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            with full_disk_as_oserror(tmp):
                _save_policy(run, tmp, full_policy)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_tree(tmp)
        shutil.rmtree(best, ignore_errors=True)
        tmp.rename(best)
    parallel.barrier()
    run.best = {"step": run.step, "eval/score": score}


def _save_policy(run, folder: Path, full_policy: dict | None) -> None:
    """The policy and its tokenizer in ``folder``: a ``save_pretrained`` folder, or (LoRA) a PEFT
    adapter folder naming its base model."""
    if run.adapters is not None:
        base = lora.base_name(run.cfg, run.policy, run.output_dir)
        lora.save_adapter(run.adapters, folder, base, full_policy)
    else:
        distributed.save_pretrained(run.policy, folder, full_policy)
    run.tokenizer.save_pretrained(folder)


def save_run(run, rng: dict | None = None, final: bool = False) -> Path:
    """Checkpoint the trainer at its step.  Every rank calls this (the sharded state and the RNG
    states are gathered); rank 0 writes the policy, tokenizer, critic and trainer state (and, for
    the ``final`` one with ``--lora-save-merged``, the merged policy)."""
    parallel, sharded = run.parallel, run.cfg.parallel == "fsdp"
    rng = rng or rng_state()
    state = TrainerState(
        step=run.step,
        optimizer={} if sharded else run.optimizer.state_dict(),
        scheduler=run.scheduler.state_dict(),
        kl_coef=run.kl_control.value,
        rng=rng,
        config=run.cfg.to_dict(),
        world_size=parallel.world_size,
        rng_per_rank=parallel.gather_objects(rng) if parallel.active else None,
        best=run.best,
        policy_version=run.policy_version,
        rollouts_in_flight=run.source.in_flight() if run.source is not None else 0,
        partial_in_flight=run.source.partial_in_flight() if run.source is not None else 0,
    )

    def write(folder: Path) -> None:
        full_policy = distributed.full_state_dict(run.policy) if sharded else None  # gathered on rank 0
        adapters = run.adapters
        if sharded:
            distributed.save_sharded(folder / SHARDED_DIR, run.policy, run.critic, run.optimizer, adapters is not None)
        if not parallel.main:
            return
        _save_policy(run, folder / POLICY_DIR, full_policy)
        if final and adapters is not None and run.cfg.lora_save_merged:
            merged = lora.merged_state_dict(run.policy, full_policy)
            adapters.get_base_model().save_pretrained(folder / MERGED_DIR, state_dict=merged)
            run.tokenizer.save_pretrained(folder / MERGED_DIR)
        if run.critic is not None and not sharded:
            critic = run.critic.state_dict() if adapters is None else lora.trainable_state(run.critic)
            torch.save(critic, folder / CRITIC_FILE)
        torch.save(vars(state), folder / STATE_FILE)

    keep = run.cfg.keep_checkpoints
    path = save(run.output_dir, run.step, write, keep=keep, main=parallel.main, barrier=parallel.barrier)
    _hold_for_a_test(run.step)
    return path


def _hold_for_a_test(step: int) -> None:
    """Test-only: ``PPO_FAST_TEST_HOLD=STEP:PATH`` holds this process once it has saved step STEP's
    checkpoint, until it is killed, once per PATH (created here), so that a multi-host test kills a
    rank mid-run without a long run (tests/test_multihost.py)."""
    held = os.environ.get("PPO_FAST_TEST_HOLD")
    if held:
        at, path = held.split(":", 1)
        if step == int(at) and not os.path.exists(path):
            Path(path).touch()
            while True:
                time.sleep(1)
