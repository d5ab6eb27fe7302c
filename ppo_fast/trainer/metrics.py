"""What a run leaves behind: per-step JSONL metrics, optional TensorBoard, a PNG of the curves, phase timings."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

import ppo_fast as pf

from .estimate import Estimate
from .rollout import Rollouts
from .run_folder import METRICS_FILE, PLOT_FILE

# The step row's metrics computed here (name: meaning), for the glossary (docs/metrics.md,
# metric_glossary.py).  TRL PPOTrainer's names where it has one.
METRICS = {
    "step": "completed iterations",
    "episode": "responses generated so far, every rank (TRL's episode)",
    "lr": "the learning rate after the step's optimizer steps",
    "objective/scores": "mean reward of the step's responses (the combined reward, before any KL penalty)",
    "objective/kl": "mean over responses of the summed per-token KL to the reference (--kl-estimator), every rank",
    "objective/kl_coef": "the KL coefficient the step's rewards and loss used (the adaptive controller's value)",
    "objective/entropy": "mean over responses of the summed -log pi_old of the sampled tokens (TRL's: per response, "
    "so it grows with the length; policy/entropy_avg is per token)",
    "objective/non_score_reward": "mean summed -kl_coef * KL per response when the KL is in the reward, else 0",
    "objective/rlhf_reward": "objective/scores + objective/non_score_reward",
    "objective/response_length": "mean response length in tokens, its EOS included",
    "val/explained_variance": "1 - Var(returns - values) / Var(returns) over the response tokens: 0 while the critic "
    "predicts nothing of the returns, 1 when it predicts them; with one reward at the last token and short "
    "responses the returns barely vary within a response, and it can stay near 0 while the policy learns",
    "val/mean": "mean critic value over the response tokens, at the rollout",
    "time/<phase>": "wall seconds of the step's phase: rollout, score, estimate, optimize, weight_sync",
    "time/step": "wall seconds of the step",
    "throughput/tokens_per_s": "response tokens of this rank per wall second of the step",
}


@dataclass(kw_only=True)
class StepRecord:
    """What one PPO iteration did, as its metrics row reports it (this rank's share)."""

    step: int
    rows: int  # this rank's responses
    seconds: float
    lr: float
    rollouts: Rollouts
    est: Estimate
    update_stats: dict  # ppo_update's means
    sequence_kl: float  # the mean summed KL over every rank's responses
    kl_coef: float  # the coefficient this step's rewards and loss used
    phase_seconds: dict


def _masked_variance(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return pf.masked_mean((x - pf.masked_mean(x, mask)).square(), mask)


def step_row(record: StepRecord, kl_in_reward: bool, world_size: int) -> dict:
    """The step's metrics row (this rank's values; the caller reduces them over the ranks)."""
    r, est = record.rollouts, record.est
    mask = r.mask
    non_score = (-record.kl_coef * est.kl).sum(-1).mean().item() if kl_in_reward else 0.0
    row = {
        "step": record.step,
        "episode": record.step * record.rows * world_size,
        "lr": record.lr,
        "objective/scores": r.scores.mean().item(),
        "objective/kl": record.sequence_kl,
        "objective/kl_coef": record.kl_coef,
        "objective/entropy": (-r.old_logprobs * mask).sum(-1).mean().item(),
        "objective/non_score_reward": non_score,
        "objective/rlhf_reward": r.scores.mean().item() + non_score,
        "objective/response_length": mask.sum(-1).float().mean().item(),
        **record.update_stats,
    }
    row.update(r.off_policy_metrics or {})  # the engine/trainer mismatch (off_policy.mismatch_metrics)
    if r.values is not None:
        unexplained = _masked_variance(est.returns - r.values, mask)
        row["val/explained_variance"] = (1.0 - unexplained / _masked_variance(est.returns, mask).clamp_min(1e-8)).item()
        row["val/mean"] = pf.masked_mean(r.values, mask).item()
    row.update({f"time/{name}": secs for name, secs in record.phase_seconds.items()})
    row["time/step"] = record.seconds
    row["throughput/tokens_per_s"] = int(mask.sum()) / record.seconds
    return row


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
        """``time per phase: rollout 7.7s (16%), ...``; empty when no phase ran."""
        if not self.total:
            return ""
        overall = sum(self.total.values()) or 1.0
        parts = [f"{name} {secs:.1f}s ({100 * secs / overall:.0f}%)" for name, secs in self.total.items()]
        return "time per phase: " + ", ".join(parts)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl``, and each number of it to the
    ``--report-to`` trackers (``trackers.py``), at the row's step."""

    def __init__(self, output_dir: Path, resume_step: int | None, trackers: list):
        self.path = output_dir / METRICS_FILE
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            # Rows written after the checkpoint we resume from are redone by this run.
            kept = [row for row in read_metrics(self.path) if row["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(row) + "\n" for row in kept))
        self.file = self.path.open("a")
        self.trackers = trackers

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(numbers, row["step"])

    def close(self) -> None:
        self.file.close()
        for tracker in self.trackers:
            tracker.close()


def read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``; a torn last line (a full disk, a kill mid-write) is dropped."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise
    return rows


# Panels of curves.png, most telling first: (metric, title).  A metric that is absent or
# constant over the run (a fixed KL coefficient, say) gets no panel, and at most
# MAX_PANELS are drawn (the held-out evaluation included).
PANELS = (
    ("objective/scores", "training reward (sampled responses)"),
    ("objective/kl", "KL to the reference (summed over a response)"),
    ("policy/entropy_avg", "policy entropy (per token)"),
    ("loss/policy_avg", "policy loss"),
    ("loss/value_avg", "value loss"),
    ("policy/clipfrac_avg", "policy clip fraction"),
    ("val/explained_variance", "value explained variance"),
    ("objective/kl_coef", "KL coefficient"),
    ("objective/response_length", "response length (tokens)"),
)
# The held-out metrics and their labels; eval/score is the run's reward of greedy responses, named by
# plot_curves' score_name (the built-in task's reward is 1 for a right sum: its mean is the accuracy).
EVAL_KEYS = (("eval/score", "mean reward"), ("eval/exact_match", "exact match"))
ACCURACY = "accuracy (sums exactly right)"
MAX_PANELS = 8


def smooth(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's debiasing (the first points are not pulled to 0)."""
    out, last, norm = [], 0.0, 0.0
    for value in values:
        last = weight * last + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def smoothing_weight(n: int) -> float:
    """0 (no smoothing) for a few points, up to 0.9 for a long run."""
    return 0.0 if n < 10 else min(0.9, 1.0 - 5.0 / n)


def _informative(values: list[float]) -> bool:
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    return len(finite) > 0 and max(finite) - min(finite) > 1e-9 * max(1.0, abs(finite[0]))


def plot_panels(
    rows: list[dict],
    before: dict | None = None,
    after: dict | None = None,
    after_step: int | None = None,
    score_name: str = EVAL_KEYS[0][1],
) -> tuple[dict, list]:
    """What ``curves.png`` shows: ``(evals, panels)``.

    ``evals``: ``{metric: (name, [(step, value), ...])}`` for the held-out evaluation, the
    score before PPO at step 0, the periodic ones, the final one at ``after_step``.
    ``panels``: ``[(metric, title, [(step, value), ...]), ...]``, the informative training
    curves (not absent, not constant), most telling first, at most ``MAX_PANELS`` in all.
    """
    before, after = before or {}, after or {}
    evals = {}
    for key, name in EVAL_KEYS:
        name = score_name if key == "eval/score" else name
        points = [(0, before[key])] if key in before else []
        points += [(row["step"], row[key]) for row in rows if key in row]
        if key in after and after_step is not None:
            points.append((after_step, after[key]))
        if points:
            evals[key] = (name, sorted(dict(points).items()))
    panels = []
    for key, name in PANELS:
        points = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), (int, float))]
        if points and _informative([v for _, v in points]):
            panels.append((key, name, points))
    return evals, panels[: MAX_PANELS - (1 if evals else 0)]


def plot_curves(
    output_dir: Path,
    *,
    before: dict | None = None,
    after: dict | None = None,
    after_step: int | None = None,
    title: str = "",
    score_name: str = EVAL_KEYS[0][1],
) -> Path | None:
    """Draw ``curves.png`` (see :func:`plot_panels`): the held-out evaluation with its
    before and final points, and the informative training curves, raw (faint) and
    smoothed, under a title with the run's settings; ``score_name`` says what ``eval/score``
    measures.  None if there is nothing to draw."""
    evals, panels = plot_panels(read_metrics(output_dir / METRICS_FILE), before, after, after_step, score_name)
    if not panels and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = len(panels) + (1 if evals else 0)
    columns = 2 if count > 1 else 1
    lines = (count + columns - 1) // columns
    heading_lines = (title.count("\n") + 1 if title else 0) + 1
    head = 0.17 * heading_lines + 0.1  # inches for the title
    fig, axes = plt.subplots(lines, columns, figsize=(6 * columns, 2.9 * lines + head), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[count:]:
        ax.axis("off")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if evals:
        ax = flat.pop(0)
        summary = []
        for (_key, (name, points)), color in zip(evals.items(), ("tab:green", "tab:purple")):
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o", color=color, label=name)
            for step, value, align in ((steps[0], values[0], "left"), (steps[-1], values[-1], "right"))[: len(points)]:
                ax.annotate(
                    f"{value:.3f}",
                    (step, value),
                    textcoords="offset points",
                    xytext=(0, 7),
                    ha=align,
                    fontsize=8,
                    color=color,
                    fontweight="bold",
                )
            summary.append(f"{name.split(' (')[0]} {values[0]:.3f} -> {values[-1]:.3f}")
        ax.set_title(f"held-out prompts, greedy decoding: {', '.join(summary)}", fontsize=10)
        ax.set_ylabel(" / ".join(name for name, _ in evals.values()), fontsize=8)
        ax.margins(y=0.15)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
    weights = set()
    for ax, (key, name, points), color in zip(flat, panels, colors * 3):
        steps, values = zip(*points)
        weight = smoothing_weight(len(values))
        if weight:
            weights.add(weight)
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, smooth(list(values), weight), color=color, linewidth=1.8)
        else:
            ax.plot(steps, values, color=color, marker=".")
        ax.set_title(f"{name}  [{key}]", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_xlabel("step")
    heading = title
    if weights:
        heading += (
            "\n" if heading else ""
        ) + f"faint: per step; solid: moving average (EMA, weight {max(weights):.2f})"
    if heading:
        fig.suptitle(heading, fontsize=9, y=0.995, va="top")
    fig.tight_layout()  # leaves room for the suptitle
    path = output_dir / PLOT_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
