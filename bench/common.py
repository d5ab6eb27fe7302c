"""Helpers every suite shares: the machine and versions a result records, JSON writing, the best-call timer."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import torch

# Timing rounds when implementations are timed in alternation (each keeps its best round).
ROUNDS = 3


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages: other jobs on a shared machine slow every timing."""
    return os.getloadavg()


def git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict:
    """ppo_fast, torch, python, triton, CUDA (where torch has it) and the git commit."""
    import ppo_fast as pf

    found = {"ppo_fast": pf.__version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = "not installed"
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    commit = git_commit()
    if commit:
        found["git"] = commit
    return found


def machine(device: torch.device) -> dict:
    """CPU model, cores, torch threads, platform, the load averages (a shared machine slows every
    timing); the GPU and its memory on CUDA."""
    found = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "load_average": load_average(),
    }
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
        found["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / (1 << 30), 1)
    return found


def result_header(suite: str, argv, device: torch.device) -> dict:
    """What every result file starts with: the command, the date, the machine (and its load), the versions."""
    return {
        "command": command_line(suite, argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "versions": versions(),
    }


def write_json(path: str, data: dict, indent: int = 1) -> None:
    """A result file (its folder made), and a line on stderr saying where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
    print(f"wrote {path}", file=sys.stderr)


def command_line(suite: str, argv) -> str:
    """The command a result came from: ``python -m bench <suite> <args>``."""
    import shlex

    args = argv if argv is not None else sys.argv[1:]
    return "python -m bench" + (f" {suite}" if suite else "") + "".join(" " + shlex.quote(a) for a in args)


def best_ms(
    fn: Callable[[], object], min_run_time: float, min_calls: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The fastest of repeated calls (at least ``min_calls``, for at least ``min_run_time`` s of
    ``clock``: wall time, or ``time.process_time`` for this process's CPU time), in ms."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < min_calls or spent < min_run_time:
        start = clock()
        fn()
        elapsed = clock() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best * 1e3
