"""What a run leaves in its ``--output-dir``, and whether a new run may start there.

A folder *holds a run* when it has any of the trainer's own artifacts (:func:`artifacts`):
a checkpoint (``checkpoints/step-*``, or ``checkpoints/.tmp-step-*`` whose writing never
finished), ``metrics.jsonl``, ``summary.json``, ``curves.png``, ``best/``,
``run_config.yaml``, ``train.log``, ``tensorboard/`` or ``vllm_model/``.  A new run there (no ``--resume``) would prune the old run's checkpoints,
overwrite its metrics and leave a folder that ``--resume`` continues with mixed rows, so it
is refused in one line (:func:`refusal`) before anything is written; ``--overwrite`` removes
those artifacts first (:func:`remove_run`), and nothing else: files the user put there stay,
and so does the warm-up cache (``warmup/``), a cache rather than a run (it is reused only
when made with the same warm-up settings, and copying it into a new folder is how two runs
share the built-in task's warm-up model).  A missing or empty folder, or one with other
files only, is used as it is.  A run that completed no step (no finished checkpoint, no
metrics row, no summary or plot: it stopped at its first step) is not a run: its leftovers
(an empty metrics.jsonl, tensorboard/, vllm_model/, an unfinished checkpoint) are removed by
the next run, which says so (:func:`completed_a_step`).

Standard library only: the ``ppo-fast`` launcher (``ppo_fast_cli.py``) loads this file on
its own to refuse such a folder before torch is imported; the trainer checks it again
(rank 0 deciding for every rank under ``torchrun``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

# The names the trainer writes (ppo_fast.trainer.checkpoint, .metrics and .trainer use these).
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
VLLM_MODEL_DIR = "vllm_model"
CONFIG_FILE = "run_config.yaml"  # the run's resolved options, reloadable with --config
LOG_FILE = "train.log"  # what the run said on the console
BEST_DIR = "best"  # --keep-best: the policy at its best held-out score
WARMUP_DIR = "warmup"  # a cache: neither makes a run nor is removed by --overwrite
BASE_FILE = "base_model.json"  # the base model a run started from: --resume refuses another
WANDB_DIR, MLFLOW_DB = "wandb", "mlflow.db"  # --report-to wandb, mlflow (without their own places)


def artifacts(output_dir: str | Path) -> list[Path]:
    """The run artifacts in ``output_dir`` (empty: it holds no run; a missing folder holds none):
    the checkpoints newest first, then unfinished ones, then the other files and folders."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    checkpoints = root / CHECKPOINTS
    found = sorted(checkpoints.glob(STEP_PREFIX + "*"), reverse=True) if checkpoints.is_dir() else []
    found += sorted(checkpoints.glob(TMP_PREFIX + "*")) if checkpoints.is_dir() else []
    for name in (
        METRICS_FILE,
        SUMMARY_FILE,
        PLOT_FILE,
        BEST_DIR,
        CONFIG_FILE,
        BASE_FILE,
        LOG_FILE,
        WANDB_DIR,
        MLFLOW_DB,
        TENSORBOARD_DIR,
        VLLM_MODEL_DIR,
    ):
        path = root / name
        if path.exists() or path.is_symlink():
            found.append(path)
    return found


def describe(found: list[Path], output_dir: str | Path) -> str:
    """``checkpoints/step-000020 and 1 older, metrics.jsonl, tensorboard/`` (the artifacts, short)."""
    root = Path(output_dir)
    finished = [p for p in found if p.parent.name == CHECKPOINTS and p.name.startswith(STEP_PREFIX)]
    unfinished = [p for p in found if p.parent.name == CHECKPOINTS and p.name.startswith(TMP_PREFIX)]
    others = [p for p in found if p not in finished and p not in unfinished]
    parts = []
    for group, more in ((finished, "older"), (unfinished, "more unfinished")):
        if group:
            parts.append(
                group[0].relative_to(root).as_posix() + (f" and {len(group) - 1} {more}" if len(group) > 1 else "")
            )
    parts += [p.name + ("/" if p.is_dir() else "") for p in others]
    return ", ".join(parts)


def completed_a_step(output_dir: str | Path) -> bool:
    """Whether the run in ``output_dir`` completed a step: a finished checkpoint, a metrics row, a
    summary or a plot (an unreadable metrics file counts as a row: nothing is removed unseen)."""
    root = Path(output_dir)
    checkpoints = root / CHECKPOINTS
    if checkpoints.is_dir() and any(checkpoints.glob(STEP_PREFIX + "*")):
        return True
    if any((root / name).exists() for name in (SUMMARY_FILE, PLOT_FILE)):
        return True
    metrics = root / METRICS_FILE
    if not (metrics.exists() or metrics.is_symlink()):
        return False
    try:
        with open(metrics, "rb") as f:
            return any(line.strip() for line in f)
    except OSError:
        return True


def finished_steps(output_dir: str | Path) -> int | None:
    """The steps of the run in ``output_dir`` if it finished (its summary says done, and its last
    checkpoint is that step's), else None."""
    root = Path(output_dir)
    try:
        summary = json.loads((root / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    steps = summary.get("steps_done") if isinstance(summary, dict) and summary.get("stop_reason") == "done" else None
    if not isinstance(steps, int) or not (root / CHECKPOINTS / f"{STEP_PREFIX}{steps:06d}").is_dir():
        return None
    newer = [p for p in (root / CHECKPOINTS).glob(STEP_PREFIX + "*") if p.name > f"{STEP_PREFIX}{steps:06d}"]
    return None if newer else steps


def nothing_to_do(output_dir: str | Path, steps_done: int, steps: int) -> str:
    """What ``--resume`` says of a run that already did its ``--steps``."""
    return (
        f"--resume: the run in {output_dir} already did {steps_done} steps (--steps {steps}); "
        f"nothing to do. Give a larger --steps to train on, or another --output-dir for a new run."
    )


def record_base(output_dir: str | Path, model_name_or_path: str | None, fingerprint: str | None) -> None:
    """Write which base model the run in ``output_dir`` starts from, and the run's id (the trackers' run:
    a resume continues it, a new run in the folder gets another), unless a record is there already."""
    path = Path(output_dir) / BASE_FILE
    if not path.exists():
        record = {"model_name_or_path": model_name_or_path, "fingerprint": fingerprint, "run_id": uuid.uuid4().hex[:16]}
        path.write_text(json.dumps(record) + "\n")


def run_id(output_dir: str | Path) -> str | None:
    """The run's id (``record_base``); None for a record without one (the tracker then starts a run)."""
    return json.loads((Path(output_dir) / BASE_FILE).read_text()).get("run_id")


def base_problem(output_dir: str | Path, model_name_or_path: str | None, fingerprint_of) -> str | None:
    """Why ``--resume`` in ``output_dir`` may not go on from ``model_name_or_path`` (another base model
    than the run's: the KL reference would quietly become it), or None.  ``fingerprint_of``:
    ``model_folder.fingerprint``.  Nothing to compare (no record, a model given as an object): None."""
    path = Path(output_dir) / BASE_FILE
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    given = fingerprint_of(model_name_or_path) if model_name_or_path else None
    was, now = recorded.get("fingerprint"), given
    if was == now or (model_name_or_path and now is None):  # the same, or a hub id: nothing to read here
        return None
    before = recorded.get("model_name_or_path") or "the built-in task's model"
    return (
        f"--resume: the run in {output_dir} started from {before} (fingerprint {was}), and "
        f"{model_name_or_path or 'the built-in task’s model'} is another model (fingerprint {now}): its KL "
        "reference and weights would change under it; resume with the base model it started from, or start "
        "afresh (--overwrite, or another --output-dir)"
    )


def refusal(output_dir: str | Path, *, resume: bool, overwrite: bool) -> str | None:
    """Why a run with these options may not start in ``output_dir`` (the error line, without
    ``ppo-fast: error:``), or None: a new run (no ``--resume``, no ``--overwrite``) in a folder
    that holds a run.  ``--resume`` continues whatever is there; ``--overwrite`` replaces it."""
    if resume or overwrite:
        return None
    found = artifacts(output_dir)
    if not found or not completed_a_step(output_dir):
        return None
    return (
        f"--output-dir {output_dir} already holds a run ({describe(found, output_dir)}); "
        "pass --resume to continue it, or --overwrite to replace it"
    )


ELASTIC_FILE = "elastic_job.json"  # which torchrun job started the run in output_dir


def agent_identity() -> str:
    """This process's torchrun agent (its parent): host, pid and start time, unique to one torchrun
    invocation on that host and the same across its restarts."""
    import socket

    agent = os.getppid()
    try:
        started = Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{socket.gethostname()}/{agent}/{started}"


def elastic_restart(output_dir: str | Path) -> bool:
    """A ``torchrun --max-restarts`` restart of the job that started the run in ``output_dir``: the
    launchers leave the folder to the trainer, which continues the run only if every rank's agent
    started it (``distributed.restart_of_this_job``).  Not only the restart count: when one node's
    workers fail, the other nodes' agents restart theirs as a membership change, count unchanged."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return True
    try:
        record = json.loads((Path(output_dir) / ELASTIC_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("run_id") == os.environ["TORCHELASTIC_RUN_ID"]
        and agent_identity() in record.get("agents", [])
    )


def remove_run(output_dir: str | Path) -> list[Path]:
    """``--overwrite``: delete the run artifacts of ``output_dir`` (and ``checkpoints/`` if that
    leaves it empty), nothing else; returns what was removed."""
    found = artifacts(output_dir)
    for path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    checkpoints = Path(output_dir) / CHECKPOINTS
    if found and checkpoints.is_dir() and not any(checkpoints.iterdir()):
        checkpoints.rmdir()
    return found
