"""bench/gpu_check.sh without a GPU, and the targets' summary on a recorded result.

The script's preflight runs anywhere; its first GPU-only step (the build for the GPU's own
architecture) must not start without a GPU: the script stops at once, says why, exit 3.
``tests/data/targets_cpu_quick.json`` was recorded by
``python -m bench targets --device cpu --quick`` on a loaded 2-core CPU: its timings
exercise the renderer and are not measurements to quote.
"""

import copy
import json
import os
import pathlib
import subprocess
import sys
import time

from bench import targets

ROOT = pathlib.Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "targets_cpu_quick.json"


def test_gpu_check_stops_before_the_build_without_a_gpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    result = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    took = time.perf_counter() - start
    assert result.returncode == 3, result.stdout + result.stderr
    assert "no CUDA GPU visible" in result.stdout
    summary = (tmp_path / "summary.txt").read_text()
    assert "ppo_fast GPU check" in summary and "no CUDA GPU visible" in summary
    assert {p.name for p in tmp_path.iterdir()} == {"summary.txt", "constraints.txt", "preflight.log", "preflight.json"}
    assert json.loads((tmp_path / "preflight.json").read_text())["missing_for_tests"] == []
    assert took < 120, f"the dry run took {took:.0f} s"


def test_a_term_mid_stage_stops_it_and_still_writes_the_summary(tmp_path):
    """The rehearsal (no GPU) up to the build, whose command hangs here; a TERM, as the device
    call's limit sends, ends the stage in flight and the script with the summary written.  The
    preflight's package check (it imports TRL: 6 s) writes an empty report here: it is the test above's."""
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        '[ "$1" = setup.py ] && exec sleep 300\n'
        'case "$1 $2" in "- "*/preflight.json) cat >/dev/null; echo "{}" >"$2"; exit 0 ;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(python), CUDA_VISIBLE_DEVICES="", REHEARSAL="1", TOTAL_S="480")
    script = subprocess.Popen(
        ["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, stdout=subprocess.PIPE, text=True
    )
    for line in script.stdout:
        if line.startswith("plan (480s): "):
            assert "build by 124s" in line and line.rstrip(", \n").endswith("bench by 480s")
            break
    time.sleep(1)
    script.terminate()
    rest = script.stdout.read()
    assert script.wait(timeout=60) == 1
    summary = (out / "summary.txt").read_text()
    assert "interrupted by TERM after" in summary and "during build" in summary and "summary after" in rest
    assert "== build (limit " in (out / "build.log").read_text()


def _row(entry):
    return next(r for r in entry["case"]["results"] if r["impl"] == entry["backend"] and r["mode"] == entry["mode"])


def test_summary_has_one_line_per_target_with_its_number():
    results = json.loads(SAMPLE.read_text())
    lines = targets.summary_lines(results)
    assert len(lines) == len(results["targets"]) == len(targets.targets(quick=True))
    for line, entry in zip(lines, results["targets"]):
        row = _row(entry)
        assert line.startswith(f"target {entry['name']}: ")
        assert f"{entry['backend']}: " in line
        if entry["metric"] == "median_us":
            verdict = "met" if row["median_ms"] * 1e3 <= entry["goal"] else "missed"
            ms = row["median_ms"]
            assert f": {verdict} (" in line and (f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.3f} ms") in line
        elif entry["metric"] == "copy_fraction":  # a CPU has no copy-bandwidth yardstick
            assert ": no verdict: no copy bandwidth" in line
        else:
            assert ": measured (" in line


def test_copy_fraction_verdicts_and_unmeasured_targets():
    results = json.loads(SAMPLE.read_text())
    entry = next(e for e in results["targets"] if e["metric"] == "copy_fraction")
    for fraction, verdict in ((0.9, "met"), (0.5, "missed")):
        changed = copy.deepcopy(results)
        target = next(e for e in changed["targets"] if e["name"] == entry["name"])
        _row(target).update(copy_fraction=fraction, gbps=4000.0)
        (line,) = [line for line in targets.summary_lines(changed) if entry["name"] in line]
        assert f": {verdict} (" in line and f"{100 * fraction:.0f}% of copy BW" in line
    cut_short = copy.deepcopy(results)
    cut_short["targets"][-1]["case"] = {"skipped": "time budget of 112 s spent"}
    assert targets.summary_lines(cut_short)[-1].endswith("NOT MEASURED (time budget of 112 s spent)")
