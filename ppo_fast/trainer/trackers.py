"""Experiment trackers (``--report-to``): where each step's metrics row goes besides ``metrics.jsonl``.

Each tracker is used as its users know it: its own environment variables choose the project,
the mode and the server (``WANDB_PROJECT``, ``WANDB_MODE=offline``, ``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_NAME``, ``TRACKIO_PROJECT``); without them, the project is ``ppo-fast`` and
MLflow writes an SQLite store in the run folder (``mlflow.db``; MLflow 3 no longer takes a file store).  A resumed run continues the same tracker run
where the tracker can (the run's id, ``run_folder.run_id``).  A new tracker is one class here
and one entry in ``ppo_fast.spec.TRACKERS``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from ppo_fast.spec import TRACKERS

from .config import ConfigError
from .run_folder import MLFLOW_DB, TENSORBOARD_DIR, run_id

PROJECT = "ppo-fast"


def chosen(report_to: str) -> list[str]:
    """The trackers ``--report-to`` names: ``auto`` is TensorBoard where it is installed, ``none`` none."""
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    if names == ["auto"]:
        return ["tensorboard"] if importlib.util.find_spec(TRACKERS["tensorboard"]) else []
    return [] if names == ["none"] else names


def missing(report_to: str) -> str | None:
    """Why a tracker ``--report-to`` names cannot be used (its package is not installed), or None."""
    for name in chosen(report_to):
        if importlib.util.find_spec(TRACKERS[name]) is None:
            return f"--report-to {name}: {TRACKERS[name]} is not installed (pip install {TRACKERS[name]})"
    return None


def start(report_to: str, output_dir: Path, config: dict, resumed: bool) -> list:
    """The trackers of ``report_to``, started for the run in ``output_dir`` with its options ``config``."""
    problem = missing(report_to)
    if problem:
        raise ConfigError(problem)
    return [_CLASSES[name](output_dir, config, resumed) for name in chosen(report_to)]


class TensorBoard:
    def __init__(self, output_dir: Path, config: dict, resumed: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / TENSORBOARD_DIR))

    def log(self, row: dict, step: int) -> None:
        for name, value in row.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, output_dir: Path, config: dict, resumed: bool):
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=output_dir.name,
            id=run_id(output_dir),
            resume="allow",
            dir=str(output_dir),
            config=config,
        )

    def log(self, row: dict, step: int) -> None:
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, output_dir: Path, config: dict, resumed: bool):
        self.mlflow = importlib.import_module("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            self.mlflow.set_tracking_uri(f"sqlite:///{(output_dir / MLFLOW_DB).resolve()}")
        self.mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
        found = self.mlflow.search_runs(
            filter_string=f"tags.ppo_fast_run = '{run_id(output_dir)}'", output_format="list"
        )
        if resumed and found:
            self.mlflow.start_run(run_id=found[0].info.run_id)
        else:
            self.mlflow.start_run(run_name=output_dir.name, tags={"ppo_fast_run": run_id(output_dir)})
            # MLflow keeps a parameter's first value: a resumed run's changed options are in its run_config.yaml.
            self.mlflow.log_params({name: str(value)[:500] for name, value in config.items()})

    def log(self, row: dict, step: int) -> None:
        self.mlflow.log_metrics(row, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Trackio:
    def __init__(self, output_dir: Path, config: dict, resumed: bool):
        self.trackio = importlib.import_module("trackio")
        project = os.environ.get("TRACKIO_PROJECT", PROJECT)
        self.trackio.init(project=project, name=output_dir.name, config=config, resume="allow")

    def log(self, row: dict, step: int) -> None:
        self.trackio.log(row, step=step)

    def close(self) -> None:
        self.trackio.finish()


_CLASSES = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow, "trackio": Trackio}
assert _CLASSES.keys() == TRACKERS.keys(), "a tracker in ppo_fast.spec.TRACKERS without its class here"
