"""``python -m bench linear_head_goal``: the fused LM head's CPU goal shape alone, fwd+bwd at N=8192,
H=256, V=32768 float32 (1.07 GB of float32 logits), a short run for a busy machine: the native fused
head, eager (matmul + log_softmax + gather) and TRL's real fused head, interleaved, each called
``--calls`` times after a call that measures its peak extra memory (bench.timing's peak-RSS
probe; inputs excluded, the gradients of hidden and weight included).  The full case with every
backend and baseline is ``python -m bench ops --ops linear_token_logprobs``; this is its goal row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

from . import cases
from .common import load_average, machine, versions, write_json
from .runner import _runner, _with_backend
from .timing import CPU_MEMORY_METHOD, peak_extra_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench linear_head_goal", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--out", default="bench_out/linear_head_goal.json")
    args = parser.parse_args(argv)
    n, hidden, vocab = 8192, 256, 32768
    case = cases.linear_logprob_case(n, hidden, vocab, torch.float32)
    inputs = case.make_inputs(torch.device("cpu"))
    impls = {"native": _with_backend("native", case.call_op), "eager": case.baselines["eager"]}
    if "trl-fused-head" in case.baselines:
        impls["trl-fused-head"] = case.baselines["trl-fused-head"]
    inputs["hidden"].requires_grad_(True)
    runs = {name: _runner(case, fn, "fwd+bwd", inputs) for name, fn in impls.items()}
    rows = {name: {"impl": name, "times_s": []} for name in impls}
    outputs = {}
    # One untimed call of each first: MKL keeps a workspace from its first
    # product on, which would otherwise be charged to whichever implementation runs first.
    for run in runs.values():
        run()
    for name, run in runs.items():  # the memory call, whose output is also compared

        def first_call(name=name, run=run):
            outputs[name] = cases.primary_output(run()).detach().clone()

        rows[name]["peak_extra_bytes"] = peak_extra_bytes(first_call, "cpu")
        print(name, "peak extra MiB", rows[name]["peak_extra_bytes"] / 2**20, flush=True)
    for name in impls:
        rows[name]["max_abs_diff_vs_eager"] = float((outputs[name] - outputs["eager"]).abs().max())
    for _ in range(args.calls):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            rows[name]["times_s"].append(time.perf_counter() - start)
            print(name, f"{rows[name]['times_s'][-1]:.2f} s", flush=True)
    eager_best = min(rows["eager"]["times_s"])
    for row in rows.values():
        row["best_s"] = min(row["times_s"])
        row["vs_eager_time"] = row["best_s"] / eager_best
    results = {
        "case": case.shape,
        "mode": "fwd+bwd (gradients of hidden and weight)",
        "logits_bytes_fp32": 4 * n * vocab,
        "gradient_bytes": 4 * (n + vocab) * hidden,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(torch.device("cpu")) | {"load_average_1m": load_average()[0]},
        "versions": versions(),
        "memory_method": CPU_MEMORY_METHOD,
        "results": list(rows.values()),
    }
    print(json.dumps(results, indent=1))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
