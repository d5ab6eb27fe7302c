"""``python -m bench ops`` (also plain ``python -m bench``): time ppo_fast's backends against
the eager baselines, write JSON, a table and plots.

Exit status 1 when one of our backends errors or disagrees with the reference on a case
(baselines that fail, and out-of-memory anywhere, are reported but do not fail the run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

import ppo_fast as pf

from . import cases as case_defs
from . import report
from .common import command_line, machine, versions
from .runner import Settings, copy_bandwidth, run_case
from .timing import CPU_MEMORY_METHOD, CUDA_MEMORY_METHOD, cpu_memory_supported

# Not bench/results: that folder holds the committed results, written only when asked for
# with --out bench/results.
DEFAULT_OUT = "bench_out"
ALL_OPS = case_defs.OPS + ("e2e",)


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m bench [ops]",
        description="Time ppo_fast's backends against the eager baselines; write JSON, a table and plots.",
    )
    parser.add_argument("--ops", default=",".join(ALL_OPS), help=f"comma-separated subset of {','.join(ALL_OPS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes, short timings: a smoke run")
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for <device>.json and the PNG plots")
    compile_group = parser.add_mutually_exclusive_group()
    compile_group.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="measure the torch.compile baselines (default, except with --quick)",
    )
    compile_group.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting new cases after this many seconds (the rest are listed as skipped)",
    )
    args = parser.parse_args(argv)
    ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    unknown = [op for op in ops if op not in ALL_OPS]
    if unknown or not ops:
        parser.error(f"--ops: unknown {unknown}; choose from {','.join(ALL_OPS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to torch")
    if args.compile is None:
        args.compile = not args.quick
    args.ops = ops
    return args


def _auto_choices(device_type: str) -> dict:
    from ppo_fast.backends import resolved_backend_name

    return {op: resolved_backend_name(op, device_type) for op in case_defs.OPS}


def _memory_method(device: torch.device, notes: list[str]) -> tuple[bool, str]:
    """Whether peak memory is measured, and how (or why not)."""
    if device.type != "cpu":
        return True, CUDA_MEMORY_METHOD
    if os.environ.get("TRITON_INTERPRET") == "1":
        notes.append("TRITON_INTERPRET=1: triton timings on CPU are the interpreter's (a correctness tool)")
    measure_memory, why = cpu_memory_supported()
    return measure_memory, CPU_MEMORY_METHOD if measure_memory else f"not measured: {why}"


def _header(args, argv, device: torch.device, notes: list[str], memory_method: str) -> dict:
    return {
        "device": device.type,
        "command": command_line("", argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "versions": versions(),
        "backends": pf.available_backends(),
        "auto": _auto_choices(device.type),
        "settings": {"quick": args.quick, "compile": args.compile, "budget_s": args.budget_s},
        "memory_method": memory_method,
        "copy_bandwidth_gbps": copy_bandwidth(device),
        "notes": notes,
        "cases": [],
    }


def _run_cases(args, results: dict, settings: Settings, shapes: dict, started: float, save) -> None:
    for case in case_defs.build_cases(tuple(op for op in args.ops if op != "e2e"), shapes):
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            results["cases"].append(
                {
                    "op": case.op,
                    "shape": case.shape,
                    "size": case.size,
                    "results": [],
                    "eager_baseline": case.eager_baseline,
                    "skipped": f"time budget of {args.budget_s:.0f} s spent",
                }
            )
            continue
        print(f"{case.op} {case.shape}", file=sys.stderr, flush=True)
        results["cases"].append(run_case(case, settings, results["copy_bandwidth_gbps"]))
        save()  # a run cut short by a timeout still leaves what it measured


def _failures(results: dict) -> list[str]:
    """Our backends' errors and mismatches (baselines' are reported, not failures)."""
    failed = [
        f"{case['op']} {case['shape']} {r['mode']} {r['impl']}: {r['status']}"
        for case in results["cases"]
        for r in case["results"]
        if r["kind"] == "ppo_fast" and r["status"] in ("error", "mismatch")
    ]
    if results.get("e2e", {}).get("error"):
        failed.append(f"end to end: {results['e2e']['error']}")
    return failed


def main(argv=None) -> int:
    args = _parse_args(argv)
    device = torch.device(args.device)
    started = time.perf_counter()
    notes = []
    measure_memory, memory_method = _memory_method(device, notes)
    shapes, shape_note = case_defs.shape_set(device.type, args.quick)
    if shape_note:
        notes.append(shape_note)
    stem = device.type + ("-quick" if args.quick else "")
    results = _header(args, argv, device, notes, memory_method)
    settings = Settings(
        device=device,
        compile=args.compile,
        measure_memory=measure_memory,
        cpu_min_run_time=0.05 if args.quick else 0.5,
        cuda_rep_ms=50 if args.quick else 100,
    )
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"{stem}.json")

    def save():
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)

    _run_cases(args, results, settings, shapes, started, save)
    if "e2e" in args.ops:
        from .e2e import run_e2e

        results["e2e"] = run_e2e(device, quick=args.quick)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    save()
    print(report.text_table(results))
    written = [json_path] + report.plot(results, args.out, stem)
    print(f"\nwall time {results['wall_s']:.0f} s; wrote " + ", ".join(written))
    failed = _failures(results)
    if failed:
        print("FAILED (our backends):\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
