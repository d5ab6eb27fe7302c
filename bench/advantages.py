"""``python -m bench advantages``: ``pf.group_advantages`` per registered method against verl's own
function (``verl.trainer.ppo.core_algos.get_adv_estimator_fn``), in one run, on the same inputs.

    python -m bench advantages                      # the shapes below
    python -m bench advantages --quick              # tiny shapes: a smoke run
    python -m bench advantages --out bench/results  # writes advantages-cpu.json

Each method is timed as verl's function, ours on the ``reference`` backend and ours on
``auto`` (the native C++ group_sum where the method declares it, else the reference), in
alternation, ``ROUNDS`` rounds, each keeping its fastest call.  Time is the process's CPU time
(``time.process_time``) with one torch thread: on a shared, oversubscribed machine wall
time mostly measures the other jobs.  Every pair is first checked to agree at the valid
tokens.  CPU, float32, no gradient (verl's functions run under no_grad).  Without verl only
our two columns are timed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from types import SimpleNamespace

import torch

import ppo_fast as pf
from ppo_fast.advantage_methods import REGISTRY

from .common import ROUNDS, best_ms, command_line, machine, write_json

DEFAULT_OUT = "bench_out"


def _inputs(b: int, t: int, groups: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, t // 4), t + 1, (b, 1), generator=gen)
    mask = torch.arange(t) < lengths
    rewards = torch.where(mask, torch.randn(b, t, generator=gen) * 0.01, 0.0)
    rewards[torch.arange(b), lengths[:, 0] - 1] += torch.randint(0, 2, (b,), generator=gen).float()
    ids = torch.randperm(b, generator=gen) % groups  # groups of b / groups, rows in no order
    return rewards, mask, ids, torch.rand(b, generator=gen)


def _verl_call(core, method: str, rewards, mask, ids, baselines):
    fn = core.get_adv_estimator_fn(method)
    m, index = mask.float(), ids.numpy()
    if method == "grpo_passk":
        return lambda: fn(rewards, m, index, config={"norm_adv_by_std_in_grpo": True})[0]
    if method == "reinforce_plus_plus":
        return lambda: fn(rewards, m, config=SimpleNamespace(gamma=1.0))[0]
    if method == "remax":
        return lambda: fn(rewards, baselines, m)[0]
    return lambda: fn(rewards, m, index)[0]


def measure(shapes, min_run_time: float, min_calls: int = 3) -> list[dict]:
    try:
        from verl.trainer.ppo import core_algos as core
    except ImportError:
        core = None
    rows = []
    for b, t, groups in shapes:
        rewards, mask, ids, baselines = _inputs(b, t, groups)
        for method, entry in REGISTRY.items():
            if entry.fn is None:
                continue
            params = {"baselines": baselines} if "baselines" in entry.params else {}
            group_ids = ids if entry.needs_groups else None

            def ours(backend, method=method, params=params, group_ids=group_ids):
                def call():
                    with torch.no_grad(), pf.use_backend(backend):
                        return pf.group_advantages(rewards, group_ids, mask, method=method, **params)

                return call

            runs = {"reference": ours("reference"), "auto": ours("auto")}
            if core is not None:
                runs["verl"] = _verl_call(core, method, rewards, mask, ids, baselines)
            want = runs["reference"]()
            row = {
                "method": method,
                "shape": f"B={b} T={t} groups={groups}",
                "auto_backend": "native" if "native" in entry.backends and "native" in _available() else "reference",
            }
            for name, run in runs.items():
                got = run()
                diff = float(((got - want) * mask).abs().max())
                assert diff <= 1e-4 + 1e-4 * float(want.abs().max()), (
                    f"{method} {name}: differs from the reference by {diff}"
                )
            best = {name: [] for name in runs}
            for _ in range(ROUNDS):
                for name, run in runs.items():
                    best[name].append(best_ms(run, min_run_time, min_calls, clock=time.process_time))
            row.update({f"{name}_ms": min(times) for name, times in best.items()})
            if "verl_ms" in row:
                row["speedup_auto_vs_verl"] = row["verl_ms"] / row["auto_ms"]
                row["speedup_reference_vs_verl"] = row["verl_ms"] / row["reference_ms"]
            print(
                f"  {method:30s} {row['shape']:24s} "
                + ", ".join(f"{k} {v:.4g}" for k, v in row.items() if k.endswith("_ms")),
                file=sys.stderr,
                flush=True,
            )
            rows.append(row)
    return rows


def _available():
    return [name for name, status in pf.available_backends().items() if status.startswith("available")]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| method | shape | verl ms | ours reference ms | ours auto ms (backend) | auto vs verl |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        verl = f"{r['verl_ms']:.4g}" if "verl_ms" in r else "-"
        speed = f"{r['speedup_auto_vs_verl']:.1f}x" if "verl_ms" in r else "-"
        lines.append(
            f"| `{r['method']}` | {r['shape']} | {verl} | {r['reference_ms']:.4g} | {r['auto_ms']:.4g} ({r['auto_backend']}) | {speed} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench advantages", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--out", default=DEFAULT_OUT, help="folder for advantages-cpu.json (bench/results holds the committed one)"
    )
    args = parser.parse_args(argv)
    shapes = [(64, 32, 8)] if args.quick else [(512, 1024, 64), (4096, 256, 512)]
    torch.set_num_threads(1)
    rows = measure(shapes, 0.05 if args.quick else 0.3, 3 if args.quick else 5)
    try:
        import verl

        verl_version = verl.__version__
    except ImportError:
        verl_version = None
    results = {
        "command": command_line("advantages", argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timer": "time.process_time (CPU time of this process), best call",
        "machine": machine(torch.device("cpu")),
        "versions": {"verl": verl_version, "torch": torch.__version__, "ppo_fast": pf.__version__},
        "rows": rows,
    }
    print(markdown(rows))
    write_json(os.path.join(args.out, "advantages-cpu.json"), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
