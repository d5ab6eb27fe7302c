"""``python -m bench policy_losses``: every registered policy-loss mode, forward + backward,
on the backend ``auto`` picks (native kernels for the sequence-level modes, else the
reference), on the reference, and verl's own function (``get_policy_loss_fn``) when
verl is installed, in one run, on the same inputs.

    python -m bench policy_losses --device cpu                  # 64 x 1024 tokens
    python -m bench policy_losses --quick                       # tiny shapes: a smoke run
    python -m bench policy_losses --out bench/results           # writes policy-losses-<device>.json

Each timing is the fastest of repeated calls, the implementations timed in alternation over
``ROUNDS`` rounds (robust to other jobs on a shared machine, which only ever add time); every
pair is first checked to agree.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

import ppo_fast as pf
from ppo_fast.backends import resolved_backend_name

from .common import ROUNDS, best_ms, load_average, machine, write_json

# Where verl's defaults differ from ours, verl's (its config names in _verl_config); a required
# parameter takes its spec example (PolicyLossMode.example_params).
VERL_DEFAULTS = {
    "vanilla": {"dual_clip": 3.0},
    "clip_cov": {"clip_cov_ratio": 0.01, "clip_cov_lb": 0.0},
    "kl_cov": {"kl_cov_ratio": 0.01},
}


def params(mode: str) -> dict:
    return {**pf.policy_loss_modes()[mode].example_params(), **VERL_DEFAULTS.get(mode, {})}


_ACTOR = {
    "clip_eps_low": "clip_ratio_low",
    "clip_eps_high": "clip_ratio_high",
    "dual_clip": "clip_ratio_c",
    "ratio_cap": "clip_ratio_c",
    "tau_pos": "tau_pos",
    "tau_neg": "tau_neg",
}


def _verl_config(params):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    actor = {_ACTOR[k]: v for k, v in params.items() if k in _ACTOR}
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        **{"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, **actor},
        policy_loss=PolicyLossConfig(**{k: v for k, v in params.items() if k not in _ACTOR}),
    )


def _inputs(rows, length, device):
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(rows, length, generator=gen) * 2 - 0.05
    old = logp + torch.randn(rows, length, generator=gen) * 0.1
    adv = torch.randn(rows, 1, generator=gen).expand(rows, length).contiguous()  # a sequence-level advantage
    lengths = torch.randint(length // 2, length + 1, (rows, 1), generator=gen)
    mask = torch.arange(length).unsqueeze(0) < lengths
    return [x.to(device) for x in (logp, old, adv, mask)]


def _ours(mode, backend, logp, old, adv, mask, *, agg):
    def call():
        torch.manual_seed(0)  # clip_cov's draw
        with pf.use_backend(backend):
            loss, _ = pf.policy_loss(logp, old, adv, mask, loss_mode=mode, agg=agg, **params(mode))
        (grad,) = torch.autograd.grad(loss, logp)
        return loss.detach(), grad

    return call


def _verl(mode, logp, old, adv, mask, agg):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    fn, config, float_mask = get_policy_loss_fn(mode), _verl_config(params(mode)), mask.float()

    def call():
        torch.manual_seed(0)
        loss, _ = fn(old, logp, adv, float_mask, loss_agg_mode=agg, config=config)
        (grad,) = torch.autograd.grad(loss, logp)
        return loss.detach(), grad

    return call


def measure(rows, length, device, min_run_time):
    logp, old, adv, mask = _inputs(rows, length, device)
    logp.requires_grad_(True)
    try:
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as verl_modes
    except ImportError:
        verl_modes = {}
    results = []
    for mode, entry in pf.policy_loss_modes().items():
        agg = entry.default_agg
        calls = {
            "fast": _ours(mode, "auto", logp, old, adv, mask, agg=agg),
            "reference": _ours(mode, "reference", logp, old, adv, mask, agg=agg),
        }
        if mode in verl_modes:  # a mode verl does not have: its row says so ("—")
            calls["verl"] = _verl(mode, logp, old, adv, mask, agg)
        want = calls["reference"]()
        for name, call in calls.items():  # every implementation agrees before it is timed
            got = call()
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m: f"{mode} {name}: {m}")
        row = {"mode": mode, "agg": agg, "fast_backend": resolved_backend_name(entry.op, torch.device(device).type)}
        for _ in range(ROUNDS):  # in alternation, each keeping its fastest call: load from other jobs only adds time
            for name, call in calls.items():
                row[f"{name}_ms"] = min(row.get(f"{name}_ms", float("inf")), best_ms(call, min_run_time / ROUNDS))
        row["speedup_vs_reference"] = row["reference_ms"] / row["fast_ms"]
        if "verl" in calls:
            row["speedup_vs_verl"] = row["verl_ms"] / row["fast_ms"]
        results.append(row)
        print(
            f"{mode:10s} {row['fast_backend']:9s} "
            + " ".join(f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, float)),
            flush=True,
        )
    return results


def markdown(report: dict) -> str:
    lines = [
        "| mode | `auto` runs on | ours (ms) | reference (ms) | verl 0.9.1 (ms) | vs reference | vs verl |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        verl = f"{r['verl_ms']:.2f}" if "verl_ms" in r else "—"
        vs_verl = f"{r['speedup_vs_verl']:.2f}×" if "speedup_vs_verl" in r else "—"
        lines.append(
            f"| `{r['mode']}` | {r['fast_backend']} | {r['fast_ms']:.2f} | {r['reference_ms']:.2f} | {verl} | "
            f"{r['speedup_vs_reference']:.2f}× | {vs_verl} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench policy_losses", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, short timing")
    parser.add_argument("--out", default="bench_out", help="folder for policy-losses-<device>.json")
    args = parser.parse_args(argv)
    rows, length, min_run_time = (4, 32, 0.05) if args.quick else (64, 1024, 1.0)
    report = {
        "what": "policy_loss forward + backward (d loss / d logprobs), float32, each mode's default agg",
        "shape": [rows, length],
        "timer": f"fastest of repeated calls (bench.common.best_ms), {ROUNDS} rounds in alternation",
        "machine": machine(torch.device("cpu")) | {"torch": torch.__version__},
        "date": datetime.date.today().isoformat(),
        "load_average_before": load_average()[0],  # other jobs on the machine (2 cores: above 2, timings are noisy)
        "results": measure(rows, length, args.device, min_run_time),
    }
    report["load_average_after"] = load_average()[0]
    print(markdown(report))
    write_json(os.path.join(args.out, f"policy-losses-{args.device}.json"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
