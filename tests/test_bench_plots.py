"""The benchmark plots: milliseconds on every bar, yardsticks apart, one panel per op of every file given."""

from __future__ import annotations

import json
from pathlib import Path

from bench import report

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def _result(impl: str, kind: str, mode: str, ms: float, speedup: float) -> dict:
    return {"impl": impl, "kind": kind, "mode": mode, "status": "ok", "median_ms": ms, "speedup": speedup}


def _run(op: str, yardsticks=("linear-layer",)) -> dict:
    results = [
        _result("native", "ppo_fast", "fwd", 2.0, 2.0),
        _result("eager", "baseline", "fwd", 4.0, 1.0),
        _result("linear-layer", "baseline", "fwd", 40.0, 0.1),
        _result("trl-fused-head", "baseline", "fwd", 8.0, 0.5),
    ]
    case = {"op": op, "shape": "N=8", "size": 8, "eager_baseline": "eager", "results": results}
    return {
        "device": "cpu",
        "date": "2026-11-30T00:00:00",
        "machine": {"cpu": "test CPU", "cores": 2},
        "settings": {"quick": False},
        "cases": [{**case, "yardsticks": list(yardsticks)}],
    }


def test_yardsticks_are_apart_and_the_compared_bars_keep_ours_first():
    (group,) = report.bar_groups(_run("linear_token_logprobs"), "linear_token_logprobs", "median_ms")
    assert [b["impl"] for b in group["compared"]] == ["native", "eager", "trl-fused-head"]
    assert [b["impl"] for b in group["yardsticks"]] == ["linear-layer"]
    (plain,) = report.bar_groups(_run("x", yardsticks=()), "x", "median_ms")
    assert "linear-layer" in [b["impl"] for b in plain["compared"]] and not plain["yardsticks"]


def test_every_bar_says_its_milliseconds_and_the_compared_ones_their_speed_up():
    (group,) = report.bar_groups(_run("linear_token_logprobs"), "linear_token_logprobs", "median_ms")
    native, eager, trl = (report._bar_text(b, "ms", yardstick=False) for b in group["compared"])
    assert native == " 2 ms  2.00x" and eager == " 4 ms  (eager baseline)" and trl == " 8 ms  0.50x"
    assert report._bar_text(group["yardsticks"][0], "ms", yardstick=True) == " 40 ms"


def test_one_panel_per_op_of_every_file_each_with_its_machine_and_date(tmp_path):
    runs = [_run("token_logprobs"), {**_run("linear_token_logprobs"), "date": "2026-12-01T00:00:00"}]
    panels = report._panels(runs, "median_ms")
    assert [(op, report.machine_label(run)) for run, op, _ in panels] == [
        ("token_logprobs", "cpu: test CPU, 2 cores, 2026-11-30"),
        ("linear_token_logprobs", "cpu: test CPU, 2 cores, 2026-12-01"),
    ]
    written = report.plot(runs, str(tmp_path), "both")
    assert written == [str(tmp_path / "both.png")] and Path(written[0]).stat().st_size > 10_000


def test_the_committed_plot_has_a_panel_per_op_the_fused_head_included():
    runs = [json.loads((RESULTS / name).read_text()) for name in ("cpu.json", "linear-token-logprobs-cpu.json")]
    ops = [op for _, op, _ in report._panels(runs, "median_ms")]
    assert ops == [
        "token_logprobs",
        "gae",
        "kl_penalized_rewards",
        "clipped_policy_loss",
        "value_loss",
        "linear_token_logprobs",
    ]
    head_groups = report._panels(runs, "median_ms")[-1][2]
    assert all([b["impl"] for b in g["yardsticks"]] == ["linear-layer"] for g in head_groups)
    assert (RESULTS / "cpu.png").stat().st_size > 10_000
