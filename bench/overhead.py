"""``python -m bench overhead``: what a public op call costs beyond its kernel, on tiny inputs.

    python -m bench overhead                      # every op
    python -m bench overhead --out bench/results  # writes overhead-cpu.json

For each public op, on inputs so small that the kernel itself costs almost nothing, the
public call (``pf.<op>``: argument checks, value checks, dispatch) is timed against the
backend function it resolves to, called with the same, already normalised arguments.  The
difference is the per-call overhead (target: at most ``TARGET_US``).  Float masks are timed beside
bool ones (their 0/1 check reads the values).  Time is the process's CPU time with one
torch thread, fastest call of each, in alternation (on a shared machine wall time mostly
measures the other jobs); the CPU and the load are recorded beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch

import ppo_fast as pf
from ppo_fast.backends import resolve, resolved_backend_name

from .common import ROUNDS, best_ms, machine, write_json

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results")
TARGET_US = 50.0


def _tiny_inputs() -> dict:
    """B=2, T=8, V=16, H=8: per-call overhead, not arithmetic, dominates."""
    g = torch.Generator().manual_seed(0)
    B, T, V, H = 2, 8, 16, 8
    lp, old, adv = (torch.randn(B, T, generator=g) for _ in range(3))
    values, returns, scores = (
        torch.randn(B, T, generator=g),
        torch.randn(B, T, generator=g),
        torch.randn(B, generator=g),
    )
    mask = torch.ones(B, T, dtype=torch.bool)
    float_mask = mask.float()
    logits, labels = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    labels[0, -2:] = -100  # padding, as in training
    hidden, weight = torch.randn(B * T, H, generator=g), torch.randn(V, H, generator=g)
    group_ids = torch.tensor([0, 0])

    return dict(
        lp=lp,
        old=old,
        adv=adv,
        values=values,
        returns=returns,
        scores=scores,
        mask=mask,
        float_mask=float_mask,
        logits=logits,
        labels=labels,
        hidden=hidden,
        weight=weight,
        group_ids=group_ids,
    )


def _backend(op):
    return resolve(op, "cpu")


def _cases():
    """(name, op, public call, backend call) on tiny inputs."""
    inputs = _tiny_inputs()
    yield from _logprob_cases(**inputs)
    yield from _rl_cases(**inputs)


def _logprob_cases(lp, old, logits, labels, hidden, weight, **_):
    backend = _backend
    yield (
        "token_logprobs",
        "token_logprobs",
        lambda: pf.token_logprobs(logits, labels),
        lambda: backend("token_logprobs")(logits, labels, 1.0, False, -100, False),
    )
    yield (
        "linear_token_logprobs",
        "linear_token_logprobs",
        lambda: pf.linear_token_logprobs(hidden, weight, labels.view(-1)),
        lambda: backend("linear_token_logprobs")(
            hidden,
            weight,
            labels.view(-1),
            bias=None,
            temperature=1.0,
            logit_scale=1.0,
            logit_softcap=None,
            return_entropy=False,
            ignore_index=-100,
        ),
    )
    yield (
        "kl_estimate",
        "kl_estimate",
        lambda: pf.kl_estimate(lp, old, kl_estimator="k3"),
        lambda: backend("kl_estimate")(lp, old, "k3"),
    )


def _rl_cases(lp, old, adv, values, returns, scores, *, mask, float_mask, group_ids, **_):
    backend = _backend
    yield (
        "kl_penalized_rewards",
        "kl_penalized_rewards",
        lambda: pf.kl_penalized_rewards(scores, lp, old, mask, kl_coef=0.05),
        lambda: backend("kl_penalized_rewards")(scores, lp, old, mask, 0.05, "k1"),
    )
    yield (
        "gae (bool mask)",
        "gae",
        lambda: pf.gae(values, returns, mask, gamma=1.0, lam=0.95),
        lambda: backend("gae")(values, returns, mask, 1.0, 0.95),
    )
    yield (
        "gae (float mask)",
        "gae",
        lambda: pf.gae(values, returns, float_mask, gamma=1.0, lam=0.95),
        lambda: backend("gae")(values, returns, mask, 1.0, 0.95),
    )
    yield (
        "policy_loss vanilla",
        "clipped_policy_loss",
        lambda: pf.policy_loss(lp, old, adv, mask),
        lambda: backend("clipped_policy_loss")(
            lp, old, adv, mask, None, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=None, agg="token-mean"
        ),
    )
    yield (
        "value_loss",
        "value_loss",
        lambda: pf.value_loss(values, old, returns, mask),
        lambda: backend("value_loss")(values, old, returns, mask, 0.2, "token-mean"),
    )
    yield (
        "group_advantages grpo",
        "group_sum",
        lambda: pf.group_advantages(scores, group_ids, mask, method="grpo"),
        None,
    )
    yield ("masked_whiten", None, lambda: pf.masked_whiten(adv, mask), None)
    yield (
        "rollout_correction_weights",
        None,
        lambda: pf.rollout_correction_weights(lp, old, mask, mode="token_tis"),
        None,
    )


def measure(min_run_time: float) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for name, op, public, direct in _cases():
        times = {"public": [], "backend": []}
        for _ in range(ROUNDS):  # alternation: public, backend, public, ...
            with torch.no_grad():
                times["public"].append(best_ms(public, min_run_time, clock=time.process_time))
                if direct is not None:
                    times["backend"].append(best_ms(direct, min_run_time, clock=time.process_time))
        public_us = min(times["public"]) * 1e3
        backend_us = min(times["backend"]) * 1e3 if times["backend"] else None
        overhead = None if backend_us is None else public_us - backend_us
        rows.append(
            {
                "op": name,
                "backend": resolved_backend_name(op, "cpu") if op else "reference",
                "public_us": round(public_us, 1),
                "backend_call_us": None if backend_us is None else round(backend_us, 1),
                "overhead_us": None if overhead is None else round(overhead, 1),
                "within_target": None if overhead is None else overhead <= TARGET_US,
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing (a smoke run)")
    parser.add_argument(
        "--out", default=None, help="folder for overhead-cpu.json (bench/results holds the committed one)"
    )
    args = parser.parse_args(argv)
    rows = measure(0.02 if args.quick else 0.3)
    print(f"{'op':30} {'backend':10} {'public us':>10} {'backend us':>11} {'overhead us':>12}")
    for r in rows:
        backend_us = "-" if r["backend_call_us"] is None else f"{r['backend_call_us']:.1f}"
        overhead = "-" if r["overhead_us"] is None else f"{r['overhead_us']:.1f}"
        print(f"{r['op']:30} {r['backend']:10} {r['public_us']:10.1f} {backend_us:>11} {overhead:>12}")
    if args.out:
        write_json(
            os.path.join(args.out, "overhead-cpu.json"),
            {
                "what": "per-call CPU time of the public op vs its backend function on tiny inputs (B=2, T=8, V=16, H=8), "
                f"process time, one torch thread, fastest call; target overhead <= {TARGET_US:.0f} us",
                "date": datetime.date.today().isoformat(),
                "machine": machine(torch.device("cpu")),
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
