"""Plots a person would keep: the trainer's curves.png and the benchmark plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from ppo_fast.trainer import metrics


def _rows(n: int) -> list[dict]:
    return [
        {
            "step": s,
            "objective/scores": 0.5 + s / (2 * n),
            "objective/kl": 0.1 * s,
            "objective/kl_coef": 0.05,
            "policy/clipfrac_avg": 0.0,
            "loss/policy_avg": (-1) ** s * 0.01,
            **({"eval/score": 0.7} if s == 5 else {}),
        }
        for s in range(1, n + 1)
    ]


def test_curves_show_the_eval_before_and_after_and_only_informative_panels():
    evals, panels = metrics.plot_panels(_rows(10), before={"eval/score": 0.6}, after={"eval/score": 0.9}, after_step=10)
    assert evals == {"eval/score": ("mean reward", [(0, 0.6), (5, 0.7), (10, 0.9)])}
    named = metrics.plot_panels(_rows(10), before={"eval/score": 0.6}, score_name=metrics.ACCURACY)[0]
    assert named["eval/score"][0] == "accuracy (sums exactly right)"
    # A fixed KL coefficient and an all-zero clip fraction are constant: no panel.
    assert [key for key, _, _ in panels] == ["objective/scores", "objective/kl", "loss/policy_avg"]
    exact = metrics.plot_panels(
        [],
        before={"eval/score": 0.1, "eval/exact_match": 0.2},
        after={"eval/score": 0.3, "eval/exact_match": 0.4},
        after_step=3,
    )[0]
    assert exact["eval/exact_match"][1] == [(0, 0.2), (3, 0.4)]


def test_curves_have_at_most_eight_panels():
    rows = [{"step": s, **{key: float(s % 3 + s) for key, _ in metrics.PANELS}} for s in range(1, 20)]
    evals, panels = metrics.plot_panels(rows, before={"eval/score": 0.1}, after={"eval/score": 0.2}, after_step=19)
    assert len(evals) + len(panels) == metrics.MAX_PANELS
    assert [key for key, _, _ in panels] == [key for key, _ in metrics.PANELS][: metrics.MAX_PANELS - 1]


def test_smoothing_follows_the_trend_without_a_start_bias():
    assert metrics.smoothing_weight(5) == 0.0 and metrics.smoothing_weight(150) == 0.9
    smoothed = metrics.smooth([1.0] * 20, 0.9)
    assert smoothed == pytest.approx([1.0] * 20)  # debiased: a constant stays constant from the first point
    noisy = [float(i % 2) for i in range(200)]
    assert max(metrics.smooth(noisy, 0.9)[50:]) - min(metrics.smooth(noisy, 0.9)[50:]) < 0.2


def test_curves_png_is_written_with_a_title(tmp_path):
    (tmp_path / metrics.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in _rows(30)))
    path = metrics.plot_curves(
        tmp_path, before={"eval/score": 0.6}, after={"eval/score": 0.9}, after_step=30, title="a run"
    )
    assert path == tmp_path / "curves.png" and path.stat().st_size > 10_000
    (tmp_path / "empty").mkdir()
    assert metrics.plot_curves(tmp_path / "empty") is None  # no metrics, no evaluation: no plot


# ---------------------------------------------------------------------- bench plots


def _results(quick: bool, sizes: tuple[int, ...]) -> dict:
    cases = []
    for size in sizes:
        for op, baseline in (("token_logprobs", "eager"), ("gae", "python-loop")):
            impls = [
                *"reference native triton auto".split(),
                baseline,
                *"trl-chunked compile(eager) liger-ce flash-attn-ce something-new".split(),
            ]
            results = [
                {
                    "impl": name,
                    "kind": "ppo_fast" if name in ("reference", "native", "triton", "auto") else "baseline",
                    "mode": mode,
                    "status": "ok",
                    "median_ms": 1.0,
                    "speedup": 0.5 + i,
                }
                for i, name in enumerate(impls)
                for mode in ("fwd", "fwd+bwd")
            ]
            cases.append(
                {
                    "op": op,
                    "shape": f"N={size}",
                    "size": size,
                    "eager_baseline": baseline,
                    "params": {"dtype": "float32"} if op == "token_logprobs" else {},
                    "results": results,
                }
            )
    return {
        "device": "cpu",
        "date": "2026-11-30T00:00:00",
        "machine": {"cpu": "test CPU", "cores": 2},
        "settings": {"quick": quick},
        "cases": cases,
    }


@pytest.mark.parametrize("quick, sizes", [(True, (4096,)), (False, (1 << 10, 1 << 12, 1 << 14))])
def test_bench_plot_is_written_for_quick_and_full_runs(tmp_path, quick, sizes):
    written = report.plot(_results(quick, sizes), str(tmp_path), "cpu")
    assert written == [str(tmp_path / "cpu.png")] and Path(written[0]).stat().st_size > 10_000


def test_every_implementation_gets_its_own_colour():
    ours_and_baselines = [name for name in report.IMPL_COLORS if name != "python-loop"]  # python-loop is gae's eager
    colours = [report.IMPL_COLORS[name] for name in ours_and_baselines]
    assert len(set(colours)) == len(colours)
    assigned: dict = {}
    extra = [report.impl_color(f"new-{i}", assigned) for i in range(len(report._SPARE_COLORS))]
    assert len(set(extra)) == len(extra) and not set(extra) & set(colours)


def test_quick_end_to_end_numbers_come_with_their_caveat():
    results = {
        "settings": {"quick": True},
        "e2e": {
            "description": "d",
            "runs": {
                "reference": {"tokens_per_s": 1000.0, "phase_s": {"rollout": 0.01}},
                "auto": {"tokens_per_s": 900.0, "phase_s": {"rollout": 0.011}},
            },
        },
    }
    note = report.e2e_note(results)
    assert "auto/reference = 0.90x" in note and "not a speed comparison" in note
    assert note in "\n".join(report.e2e_lines(results)) and note in "\n".join(
        report.e2e_markdown({**results, "auto": {}})
    )
    assert report.e2e_note({**results, "settings": {"quick": False}}) is None
