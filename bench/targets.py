"""The GPU targets, measured first: ``python -m bench targets --out DIR``.

Each target is one case at its target shape, measured by ``bench.runner`` (our backends
checked against the reference, then timed; the eager baseline beside them, no
``torch.compile`` baselines unless ``--compile``), saved to ``DIR/targets.json`` after
every case, so a run cut short still leaves what it measured.  Then one line per target:
``met`` / ``missed`` with the number, for the backend ``auto`` picks on the device.

    python -m bench targets --out bench_out                 # on a GPU: the target shapes
    python -m bench targets --summary bench_out/targets.json   # the summary lines again
    python -m bench targets --device cpu --quick --out DIR  # tiny shapes: a smoke run (the sample in tests/data)

Targets: log-probs [16384, 151936] bf16 at >= 85% of the copy bandwidth; the
PPO losses at >= 80% of it forward + backward at 16M tokens and within 15 us at 1M
tokens.  GAE [64, 8192] and the fused LM head (where ``pf.linear_token_logprobs`` exists)
are measured without a stated target.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from collections.abc import Callable

import torch

import ppo_fast as pf

from . import cases as case_defs
from .runner import Settings, copy_bandwidth, run_case


@dataclasses.dataclass
class Target:
    name: str  # the summary line's label
    case: Callable[[], case_defs.Case]
    mode: str  # "fwd" or "fwd+bwd"
    metric: str | None = None  # "copy_fraction" (at least goal) or "median_us" (at most goal); None: no target
    goal: float | None = None


LOGPROB_SHAPE = (16384, 151936)
GAE_SHAPE = (64, 8192)
LOSS_TOKENS = (16 << 20, 1 << 20)
# --quick: the same cases at shapes a CPU finishes in seconds.
QUICK_LOGPROB_SHAPE, QUICK_GAE_SHAPE, QUICK_LOSS_TOKENS = (64, 1024), (4, 256), (1 << 14, 1 << 12)


def _loss_case(op: str, tokens: int) -> case_defs.Case:
    factory = {"clipped_policy_loss": case_defs.policy_loss_case, "value_loss": case_defs.value_loss_case}[op]
    row = min(tokens, case_defs._LOSS_ROW)
    return factory(tokens // row, row)


def _gae_case(batch: int, length: int) -> case_defs.Case:
    case = case_defs.gae_case(batch, length)
    # The Python-loop baseline takes seconds per call at T=8192: measured in the full suite, not here.
    case.baselines, case.eager_baseline = {}, None
    case.notes = case.notes + ["python-loop baseline left to the full suite (seconds per call at this T)"]
    return case


def targets(quick: bool = False) -> list[Target]:
    n, v = QUICK_LOGPROB_SHAPE if quick else LOGPROB_SHAPE
    batch, length = QUICK_GAE_SHAPE if quick else GAE_SHAPE
    big, small = QUICK_LOSS_TOKENS if quick else LOSS_TOKENS
    out = [
        Target(
            f"token_logprobs [{n}, {v}] bf16 fwd >= 85% copy BW",
            lambda: case_defs.logprob_case(n, v, torch.bfloat16),
            "fwd",
            "copy_fraction",
            0.85,
        ),
        Target(
            f"token_logprobs [{n}, {v}] bf16 fwd+bwd >= 85% copy BW",
            lambda: case_defs.logprob_case(n, v, torch.bfloat16),
            "fwd+bwd",
            "copy_fraction",
            0.85,
        ),
        Target(f"gae [{batch}, {length}] fwd (no target stated)", lambda: _gae_case(batch, length), "fwd"),
    ]
    for op in ("clipped_policy_loss", "value_loss"):
        out.append(
            Target(
                f"{op} {big >> 20 or big}{'M' if big >> 20 else ''} tokens fwd+bwd >= 80% copy BW",
                lambda op=op: _loss_case(op, big),
                "fwd+bwd",
                "copy_fraction",
                0.80,
            )
        )
        out.append(
            Target(
                f"{op} {small >> 20 or small}{'M' if small >> 20 else ''} tokens fwd+bwd <= 15 us",
                lambda op=op: _loss_case(op, small),
                "fwd+bwd",
                "median_us",
                15.0,
            )
        )
    if hasattr(pf, "linear_token_logprobs"):
        n_head = 64 if quick else 16384
        hidden, vocab = (64, 1024) if quick else (4096, 151936)
        out.append(
            Target(
                f"linear_token_logprobs [{n_head}, {hidden}] x [{vocab}, {hidden}] bf16 fwd+bwd (no target stated)",
                lambda: case_defs.linear_logprob_case(n_head, hidden, vocab, torch.bfloat16),
                "fwd+bwd",
            )
        )
    return out


def _ms(ms: float) -> str:
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.3f} ms"


def _target_ms(row: dict) -> float:
    """The time a target is judged on: the device time where measured (CUDA), else the eager wall time."""
    return row.get("device_median_ms", row["median_ms"])


def _number(row: dict, metric: str | None) -> str:
    parts = [_ms(row["median_ms"])]
    if "device_median_ms" in row:
        parts = [f"device {_ms(row['device_median_ms'])}", f"eager {_ms(row['median_ms'])}"]
    if "gbps" in row:
        parts.append(f"{row['gbps']:.0f} GB/s")
    if "copy_fraction" in row:
        parts.append(f"{100 * row['copy_fraction']:.0f}% of copy BW")
    return ", ".join(parts)


def summary_lines(results: dict) -> list[str]:
    """One line per target: ``met`` / ``missed`` / ``measured`` / ``NOT MEASURED``, with the number."""
    lines = []
    for entry in results["targets"]:
        label = f"target {entry['name']}"
        case = entry.get("case") or {}
        rows = [r for r in case.get("results", []) if r["mode"] == entry["mode"] and r["kind"] == "ppo_fast"]
        row = next((r for r in rows if r["impl"] == entry["backend"]), None)
        if row is None or row["status"] != "ok":
            why = case.get("skipped") or (
                f"{row['status']}: {row.get('detail', '')}" if row else "not run (time budget or error)"
            )
            lines.append(f"{label}: NOT MEASURED ({why})")
            continue
        value = {"copy_fraction": row.get("copy_fraction"), "median_us": _target_ms(row) * 1e3}.get(entry["metric"])
        if entry["metric"] is None:
            verdict = "measured"
        elif value is None:
            verdict = "no verdict: no copy bandwidth measured on this device"
        elif entry["metric"] == "copy_fraction":
            verdict = "met" if value >= entry["goal"] else "missed"
        else:
            verdict = "met" if value <= entry["goal"] else "missed"
        lines.append(f"{label}: {verdict} ({entry['backend']}: {_number(row, entry['metric'])})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run, CPU included)")
    parser.add_argument(
        "--compile", action="store_true", help="also measure the torch.compile baselines (10-40 s each)"
    )
    parser.add_argument("--budget-s", type=float, default=None, help="start no target after this many seconds")
    parser.add_argument("--summary", metavar="JSON", help="print the summary lines of a saved targets.json and exit")
    args = parser.parse_args(argv)
    if args.summary:
        with open(args.summary) as f:
            print("\n".join(summary_lines(json.load(f))))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to torch")
    from ppo_fast.backends import resolved_backend_name

    device = torch.device(args.device)
    started = time.perf_counter()
    results = {
        "device": device.type,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "versions": {"ppo_fast": pf.__version__, "torch": torch.__version__},
        "copy_bandwidth_gbps": copy_bandwidth(device),
        "targets": [],
    }
    settings = Settings(
        device=device,
        compile=args.compile,
        measure_memory=device.type == "cuda",
        cpu_min_run_time=0.05,
        cuda_rep_ms=100,
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "targets.json")
    measured = {}  # one measurement per case: the fwd and fwd+bwd targets of a case share it
    for target in targets(args.quick):
        case = target.case()
        entry = {
            "name": target.name,
            "mode": target.mode,
            "metric": target.metric,
            "goal": target.goal,
            "backend": resolved_backend_name(case.op, device.type),
        }
        key = (case.op, case.shape)
        if key not in measured:
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                measured[key] = {"skipped": f"time budget of {args.budget_s:.0f} s spent"}
            else:
                print(f"{case.op} {case.shape}", file=sys.stderr, flush=True)
                measured[key] = run_case(case, settings, results["copy_bandwidth_gbps"])
        entry["case"] = measured[key]
        results["targets"].append(entry)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    print("\n".join(summary_lines(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
