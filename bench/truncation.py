"""``python -m bench truncation``: what top-k / top-p cost the log-prob ops, as ratios to the plain
call measured in the same run, interleaved round by round, on the backend ``auto`` picks (native on
CPU): ``token_logprobs`` on [2048, 32000] float32 and bfloat16 with ``top_k=50`` and ``top_p=0.9``,
forward and forward + backward, and the fused head (N=8192, H=256, V=32768 float32) with
``top_p=0.9``.  The goals: forward <= 3x, forward + backward <= 2x, the fused head <= 1.5x.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch

from ppo_fast.backends import resolved_backend_name

from . import cases
from .common import command_line, load_average, machine, versions, write_json
from .runner import _runner

GOALS = {"fwd": 3.0, "fwd+bwd": 2.0, "head": 1.5}


def _best(built: list, rounds: int) -> dict:
    """The best time of each (label, mode), the calls interleaved round by round."""
    best = {}
    for _ in range(rounds):
        for label, mode, case, inputs, leaf in built:
            if leaf is not None:
                leaf.requires_grad_(True)
            run = _runner(case, case.call_op, mode, inputs)
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            if leaf is not None:
                leaf.grad = None
                leaf.requires_grad_(False)
            best[(label, mode)] = min(best.get((label, mode), float("inf")), elapsed)
    return best


def _rows(name: str, specs: list, rounds: int, goal_key=None) -> list[dict]:
    built = []
    for label, case in specs:
        inputs = case.make_inputs(torch.device("cpu"))
        for mode in case.modes:
            built.append((label, mode, case, inputs, inputs.get(case.grad_input) if mode != "fwd" else None))
    best = _best(built, rounds)
    rows = []
    for mode in dict.fromkeys(m for _, m, *_ in built):
        plain = best[("plain", mode)]
        for label, _ in specs[1:]:
            ratio = best[(label, mode)] / plain
            goal = GOALS[goal_key or mode]
            rows.append(
                {
                    "case": name,
                    "truncation": label,
                    "mode": mode,
                    "plain_ms": plain * 1e3,
                    "truncated_ms": best[(label, mode)] * 1e3,
                    "ratio": ratio,
                    "goal": goal,
                    "met": ratio <= goal,
                }
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench truncation", description=__doc__)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the best of each is kept)")
    parser.add_argument("--head-rounds", type=int, default=3, help="rounds of the fused-head rows")
    parser.add_argument("--out", default="bench/results/truncation-cpu.json")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    load_before = load_average()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        specs = [("plain", cases.logprob_case(2048, 32000, dtype))]
        specs += [
            (f"{k}={v}", cases.logprob_case(2048, 32000, dtype, {k: v})) for k, v in (("top_k", 50), ("top_p", 0.9))
        ]
        rows += _rows(f"token_logprobs [2048, 32000] {str(dtype)[6:]}", specs, args.rounds)
    head = [("plain", cases.linear_logprob_case(8192, 256, 32768, torch.float32))]
    head += [("top_p=0.9", cases.linear_logprob_case(8192, 256, 32768, torch.float32, {"top_p": 0.9}))]
    rows += _rows("linear_token_logprobs N=8192 H=256 V=32768 float32", head, args.head_rounds, "head")
    for r in rows:
        print(
            f"{r['case']:55s} {r['truncation']:10s} {r['mode']:8s} {r['plain_ms']:9.1f} ms -> "
            f"{r['truncated_ms']:9.1f} ms  {r['ratio']:.2f}x (goal <= {r['goal']}x)"
        )
    write_json(
        args.out,
        {
            "what": "top-k/top-p log-probs against the plain call, best of interleaved rounds",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line("truncation", argv),
            "backend": resolved_backend_name("token_logprobs", "cpu"),
            "machine": {
                **machine(torch.device("cpu")),
                "load_average_before": load_before,
                "load_average_after": load_average(),
            },
            "versions": versions(),
            "rows": rows,
        },
    )
    return 0
