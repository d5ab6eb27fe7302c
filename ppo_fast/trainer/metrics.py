"""What a run leaves behind: per-step JSONL metrics, optional TensorBoard, a PNG of the curves, phase timings."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"
PLOT_KEYS = ("objective/scores", "objective/kl", "policy/entropy_avg", "loss/policy_avg", "loss/value_avg",
             "policy/clipfrac_avg", "objective/kl_coef", "eval/score")


class PhaseTimer:
    """Wall time per phase of the current step and summed over the run."""

    def __init__(self):
        self.step: dict[str, float] = {}
        self.total: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.step[name] = self.step.get(name, 0.0) + elapsed
            self.total[name] += elapsed

    def pop_step(self) -> dict[str, float]:
        times, self.step = self.step, {}
        return times

    def breakdown(self) -> str:
        overall = sum(self.total.values()) or 1.0
        parts = [f"{name} {secs:.1f}s ({100 * secs / overall:.0f}%)" for name, secs in self.total.items()]
        return "time per phase: " + ", ".join(parts)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (and TensorBoard scalars when installed)."""

    def __init__(self, output_dir: Path, resume_step: int | None, log=print):
        self.path = output_dir / METRICS_FILE
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            # Rows written after the checkpoint we resume from are redone by this run.
            kept = [row for row in read_metrics(self.path) if row["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self.file = self.path.open("a")
        self.tensorboard = _tensorboard_writer(output_dir / "tensorboard", log)

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(name, value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _tensorboard_writer(log_dir: Path, log):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log("tensorboard is not installed: metrics go to metrics.jsonl only")
        return None
    return SummaryWriter(str(log_dir))


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(output_dir: Path) -> Path | None:
    """Draw the main curves of ``metrics.jsonl`` into ``curves.png``; None if there is nothing to draw."""
    rows = read_metrics(output_dir / METRICS_FILE)
    keys = [k for k in PLOT_KEYS if any(k in row for row in rows)]
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 2
    lines = (len(keys) + columns - 1) // columns
    fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 2.6 * lines), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(row["step"], row[key]) for row in rows if key in row]
        ax.plot(*zip(*points), marker="." if len(points) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    path = output_dir / PLOT_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
