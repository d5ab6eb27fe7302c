"""``python -m bench cpu_vs_trl``: the native CPU ``token_logprobs`` forward against TRL's
installed ``trl.trainer.utils.selective_log_softmax`` and the eager log-softmax, in one run,
at 1 and 2 threads, [2048, 32000] float32 and bfloat16 logits, temperature 0.7.

    python -m bench cpu_vs_trl                       # prints the table
    python -m bench cpu_vs_trl --out bench/results   # also writes cpu-vs-trl-<cpu>.json

TRL is called as its users call it on 2-D logits: its CPU path loops over the rows (float32:
a ``torch.logsumexp`` per row, with PyTorch's own vectorised exp, AVX-512 where the CPU has
it; bfloat16: a ``log_softmax`` per row, in bfloat16).  The three are timed in alternation,
``ROUNDS`` rounds, each keeping its fastest call (other jobs on a shared machine only add time).
Each output is first compared with the reference backend (bfloat16 TRL's difference is
reported, not refused: its log-softmax is in bfloat16).  The JSON names the CPU, its vector
flags and the clone of the native kernels it runs (x86-64-v4, x86-64-v3 or the baseline).
Goals (``GOALS``): native >= 1.5x TRL and >= 3x eager.

It also times the exp itself, single thread: csrc/fast_exp.h's ``fast_exp`` (compiled here
with the extension's flags and clones, called through ctypes on 16k floats, L1/L2-resident)
against ``torch.exp(x, out=y)`` on the same buffers, alternating, best of many calls.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

import ppo_fast as pf

from . import baselines
from .common import ROUNDS, best_ms, command_line, cpu_flags, cpu_model, load_average, write_json

SHAPE = (2048, 32000)
TEMPERATURE = 0.7
THREADS = (1, 2)
DTYPES = (torch.float32, torch.bfloat16)
GOALS = {"trl": 1.5, "eager": 3.0}
# The clones of csrc/fast_exp.h (PPO_CPU_CLONES) and the cpuinfo flags each needs (the
# x86-64 psABI levels, as GCC's resolver checks them).
CLONE_FLAGS = {
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"),
}


def cpu_info() -> dict:
    """Model name, the vector flags that matter here, and the native kernels' clone."""
    model, flags = cpu_model(), cpu_flags()
    clone = next((name for name, need in CLONE_FLAGS.items() if all(f in flags for f in need)), "default")
    vector = sorted(f for f in flags if f in ("avx2", "fma") or f.startswith("avx512"))
    return {"model": model, "vector_flags": vector, "native_clone": clone, "cores": os.cpu_count()}


EXP_SOURCE = """
#include <cstdint>
#include "common/fast_exp.h"
extern "C" PPO_CPU_CLONES void exp_floats(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = ppo_fast::fast_exp(x[i]);
}
"""


def exp_throughput(n: int = 1 << 14, rounds: int = 30, calls: int = 100) -> dict:
    """ns per exp, single thread: our fast_exp (the clone this CPU runs) against torch.exp."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        return {"skipped": "no C++ compiler"}
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "exp.cpp"), os.path.join(tmp, "libexp.so")
        with open(src, "w") as f:
            f.write(EXP_SOURCE)
        # The extension's flags (setup.py): -O3 -fno-trapping-math -fopenmp.
        subprocess.run(
            [
                cxx,
                "-O3",
                "-std=c++20",
                "-fno-trapping-math",
                "-fopenmp",
                "-shared",
                "-fPIC",
                "-I",
                csrc,
                src,
                "-o",
                lib,
            ],
            check=True,
            capture_output=True,
        )
        ours = ctypes.CDLL(lib).exp_floats
    ours.restype, ours.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    x, y = torch.empty(n).uniform_(-30, 0), torch.empty(n)
    fns = {"ppo_fast": lambda: ours(x.data_ptr(), y.data_ptr(), n), "torch.exp": lambda: torch.exp(x, out=y)}
    best = dict.fromkeys(fns, float("inf"))
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - start) / calls)
    finally:
        torch.set_num_threads(threads_before)
    ours(x.data_ptr(), y.data_ptr(), n)
    rel_err = float(((y.double() - x.double().exp()).abs() / x.double().exp()).max())
    ns = {name: t / n * 1e9 for name, t in best.items()}
    return {
        "n": n,
        "ns_per_exp": ns,
        "speedup_vs_torch": ns["torch.exp"] / ns["ppo_fast"],
        "max_rel_err": rel_err,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def implementations() -> dict:
    from trl.trainer.utils import selective_log_softmax

    def native(logits, labels):
        with pf.use_backend("native"):
            return pf.token_logprobs(logits, labels, temperature=TEMPERATURE)

    return {
        "native": native,
        "trl": lambda logits, labels: selective_log_softmax(logits, labels, temperature=TEMPERATURE),
        "eager": lambda logits, labels: baselines.eager_logprobs(logits, labels, TEMPERATURE),
    }


def measure(threads: int, dtype: torch.dtype, min_run_time: float, shape=SHAPE) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(shape, generator=gen) * 2).to(dtype)
    labels = torch.randint(0, shape[1], (shape[0],), generator=gen)
    with pf.use_backend("reference"):
        expected = pf.token_logprobs(logits, labels, temperature=TEMPERATURE).double()
    impls = implementations()
    row = {
        "threads": threads,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": list(shape),
        "ms": {},
        "max_abs_diff": {},
    }
    with torch.no_grad():
        for name, fn in impls.items():
            row["max_abs_diff"][name] = float((fn(logits, labels).double() - expected).abs().max())
        best = {name: float("inf") for name in impls}
        for _ in range(ROUNDS):  # alternating: a burst of load elsewhere hits all three alike
            for name, fn in impls.items():
                best[name] = min(best[name], best_ms(lambda: fn(logits, labels), min_run_time))
    row["ms"] = best
    row["speedup"] = {base: best[base] / best["native"] for base in GOALS}
    row["goals_met"] = {base: row["speedup"][base] >= goal for base, goal in GOALS.items()}
    return row


def table(results: dict) -> str:
    cpu = results["cpu"]
    lines = [
        f"CPU: {cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['vector_flags'])}; native clone {cpu['native_clone']})",
        "| threads | dtype | native ms | TRL ms | eager ms | vs TRL (goal 1.5x) | vs eager (goal 3x) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        ms, s = r["ms"], r["speedup"]
        lines.append(
            f"| {r['threads']} | {r['dtype']} | {ms['native']:.1f} | {ms['trl']:.1f} | {ms['eager']:.1f} "
            f"| {s['trl']:.2f}x | {s['eager']:.2f}x |"
        )
    exp = results.get("exp", {})
    if "ns_per_exp" in exp:
        ns = exp["ns_per_exp"]
        lines.append(
            f"exp, 1 thread, {exp['n']} floats: ppo_fast {ns['ppo_fast']:.3f} ns, torch.exp "
            f"({exp['torch_cpu_capability']}) {ns['torch.exp']:.3f} ns: {exp['speedup_vs_torch']:.2f}x; "
            f"max rel err {exp['max_rel_err']:.2g}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cpu_vs_trl", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for cpu-vs-trl-<cpu>.json (not written without it)")
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds per timing round and implementation")
    parser.add_argument("--quick", action="store_true", help="[256, 4096] logits, short timings: a smoke run")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        parser.error("TRL is not installed (pip install trl)")
    shape = (256, 4096) if args.quick else SHAPE
    min_run_time = 0.05 if args.quick else args.min_run_time
    results = {
        "command": command_line("cpu_vs_trl", argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_info(),
        "load_average_before": load_average(),  # a shared machine: other jobs slow every timing
        "versions": {
            "torch": torch.__version__,
            "trl": importlib.import_module("trl").__version__,
            "ppo_fast": pf.__version__,
        },
        "temperature": TEMPERATURE,
        "rows": [],
    }
    results["exp"] = exp_throughput()
    threads_before = torch.get_num_threads()
    try:
        for threads in THREADS:
            for dtype in DTYPES:
                results["rows"].append(measure(threads, dtype, min_run_time, shape))
                print(f"  {threads} thread(s) {dtype}: {results['rows'][-1]['ms']}", file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(threads_before)
    results["load_average_after"] = load_average()
    print(table(results))
    if args.out:
        slug = re.sub(r"[^a-z0-9]+", "-", results["cpu"]["model"].lower()).strip("-")
        write_json(os.path.join(args.out, f"cpu-vs-trl-{slug}.json"), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
