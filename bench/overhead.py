"""``python -m bench overhead``: what every public op call costs on tiny inputs, eager, as a user pays it.

    python -m bench overhead                            # every public op, CPU
    python -m bench overhead --device cuda              # on a GPU: eager and device time
    python -m bench overhead --out bench/results        # writes overhead-<device>.json

For each public op, on inputs so small (B=4, T=64, V=16, H=8) that its kernels cost almost
nothing, forward (under ``no_grad``) and forward + backward (where the op is differentiable):

* ``eager_us``: eager wall time per call (``bench.timing.time_eager``: warmed, blocks of calls,
  median and IQR over at least ``MIN_SAMPLES`` blocks; on CUDA each block ends synchronised);
* ``cpu_us``: the process's CPU time per call (the median over the same kind of blocks), which a
  shared machine's other jobs disturb less than wall time;
* on CUDA, ``device_us``: CUDA graph replay with L2 flushed (``bench.timing.time_device``), the
  kernels alone: eager minus device is what the host adds.

Forward rows of ops with a backend function also time that function, called with the same,
already normalised arguments: ``overhead_us`` is the public call's CPU time minus the backend
call's (the argument checks and dispatch; target at most ``TARGET_US``).  Float masks are timed
beside bool ones (their 0/1 check reads the values).  One torch thread; the machine and its load
are recorded beside the numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ppo_fast as pf
from ppo_fast.backends import resolve, resolved_backend_name

from .common import command_line, machine, write_json
from .timing import MIN_SAMPLES, time_device, time_eager

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results")
TARGET_US = 50.0
B, T, V, H = 4, 64, 16, 8
# Public names that are registries, not ops.
NOT_OPS = {"advantage_methods", "policy_loss_modes"}


@dataclass
class Case:
    name: str
    op: str  # the public op (ppo_fast.<op>)
    public: Callable[[dict], object]
    grad_input: str | None = None  # the input the fwd+bwd mode differentiates; None: forward only
    backend_op: str | None = None  # the backend op its forward resolves to
    backend: Callable[[Callable, dict], object] | None = None  # (resolved fn, inputs) -> its call


def tiny_inputs(device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -5:] = False  # padding, as in training
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, -2:] = -100
    return {
        "lp": randn(B, T) - 1.0,
        "old": randn(B, T) - 1.0,
        "adv": randn(B, T),
        "values": randn(B, T),
        "returns": randn(B, T),
        "rewards": randn(B, T),
        "scores": randn(B),
        "entropy": randn(B, T).abs(),
        "mask": mask.to(device),
        "float_mask": mask.float().to(device),
        "logits": randn(B, T, V),
        "labels": labels.to(device),
        "hidden": randn(B * T, H),
        "weight": randn(V, H),
        "group_ids": torch.arange(B).div(2, rounding_mode="floor").to(device),
    }


def _loss_first(out):
    return out[0] if isinstance(out, tuple) else out


def _logprob_and_kl_cases() -> list[Case]:
    return [
        Case(
            "token_logprobs",
            "token_logprobs",
            lambda x: pf.token_logprobs(x["logits"], x["labels"]),
            "logits",
            "token_logprobs",
            lambda fn, x: fn(x["logits"], x["labels"], 1.0, False, -100, False),
        ),
        Case(
            "linear_token_logprobs",
            "linear_token_logprobs",
            lambda x: pf.linear_token_logprobs(x["hidden"], x["weight"], x["labels"].view(-1)),
            "hidden",
            "linear_token_logprobs",
            lambda fn, x: fn(
                x["hidden"],
                x["weight"],
                x["labels"].view(-1),
                bias=None,
                temperature=1.0,
                logit_scale=1.0,
                logit_softcap=None,
                return_entropy=False,
                ignore_index=-100,
            ),
        ),
        Case(
            "linear_policy_loss",
            "linear_policy_loss",
            lambda x: pf.linear_policy_loss(
                x["hidden"].view(B, T, H), x["weight"], x["labels"], x["old"], x["adv"], x["mask"]
            ),
            "hidden",
        ),
        Case(
            "kl_estimate",
            "kl_estimate",
            lambda x: pf.kl_estimate(x["lp"], x["old"], kl_estimator="k3"),
            "lp",
            "kl_estimate",
            lambda fn, x: fn(x["lp"], x["old"], "k3"),
        ),
        Case(
            "kl_penalized_rewards",
            "kl_penalized_rewards",
            lambda x: pf.kl_penalized_rewards(x["scores"], x["lp"], x["old"], x["mask"], kl_coef=0.05),
            "lp",
            "kl_penalized_rewards",
            lambda fn, x: fn(x["scores"], x["lp"], x["old"], x["mask"], 0.05, "k1"),
        ),
    ]


def _rl_cases() -> list[Case]:
    clip = dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=None, agg="token-mean")
    return [
        Case(
            "gae (bool mask)",
            "gae",
            lambda x: pf.gae(x["rewards"], x["values"], x["mask"]),
            "values",
            "gae",
            lambda fn, x: fn(x["rewards"], x["values"], x["mask"], 1.0, 0.95),
        ),
        Case(
            "gae (float mask)",
            "gae",
            lambda x: pf.gae(x["rewards"], x["values"], x["float_mask"]),
            "values",
            "gae",
            lambda fn, x: fn(x["rewards"], x["values"], x["mask"], 1.0, 0.95),
        ),
        Case(
            "group_advantages grpo",
            "group_advantages",
            lambda x: pf.group_advantages(x["scores"], x["group_ids"], x["mask"], method="grpo"),
            None,
        ),
        Case(
            "clipped_policy_loss",
            "clipped_policy_loss",
            lambda x: pf.clipped_policy_loss(x["lp"], x["old"], x["adv"], x["mask"]),
            "lp",
            "clipped_policy_loss",
            lambda fn, x: fn(x["lp"], x["old"], x["adv"], x["mask"], None, **clip),
        ),
        Case(
            "policy_loss vanilla",
            "policy_loss",
            lambda x: pf.policy_loss(x["lp"], x["old"], x["adv"], x["mask"]),
            "lp",
            "clipped_policy_loss",
            lambda fn, x: fn(x["lp"], x["old"], x["adv"], x["mask"], None, **clip),
        ),
        Case(
            "policy_loss gspo",
            "policy_loss",
            lambda x: pf.policy_loss(x["lp"], x["old"], x["adv"], x["mask"], loss_mode="gspo"),
            "lp",
            "policy_loss_gspo",
        ),
        Case(
            "policy_objective",
            "policy_objective",
            lambda x: pf.policy_objective(x["lp"], x["entropy"], x["old"], x["adv"], x["mask"]),
            "lp",
        ),
        Case(
            "value_loss",
            "value_loss",
            lambda x: pf.value_loss(x["values"], x["old"], x["returns"], x["mask"]),
            "values",
            "value_loss",
            lambda fn, x: fn(x["values"], x["old"], x["returns"], x["mask"], 0.2, "token-mean"),
        ),
        Case("aggregate", "aggregate", lambda x: pf.aggregate(x["adv"], x["mask"]), "adv"),
        Case("masked_mean", "masked_mean", lambda x: pf.masked_mean(x["adv"], x["mask"]), "adv"),
        Case("masked_whiten", "masked_whiten", lambda x: pf.masked_whiten(x["adv"], x["mask"]), "adv"),
        Case(
            "rollout_correction_weights",
            "rollout_correction_weights",
            lambda x: pf.rollout_correction_weights(x["lp"], x["old"], x["mask"], mode="token_tis"),
            None,
        ),
    ]


def _floor_cases() -> list[Case]:
    """torch's own floor, no ppo_fast in it: a one-op and a two-op "loss" of the same tensor, forward
    and forward + backward (what ``.backward()`` costs in torch before any op of ours)."""
    return [
        Case("torch-floor: lp.sum()", "torch.sum", lambda x: x["lp"].sum(), grad_input="lp"),
        Case(
            "torch-floor: (lp * adv).mean()", "torch.mul+mean", lambda x: (x["lp"] * x["adv"]).mean(), grad_input="lp"
        ),
    ]


def cases() -> list[Case]:
    """Every public op (``ppo_fast.ops.__all__`` less its registries), at least once; then torch's floor."""
    return _logprob_and_kl_cases() + _rl_cases() + _floor_cases()


def _runner(case: Case, mode: str, inputs: dict) -> Callable[[], object]:
    if mode == "fwd":

        def forward():
            with torch.no_grad():
                return case.public(inputs)

        return forward
    leaf = inputs[case.grad_input]

    def forward_backward():
        leaf.grad = None
        out = _loss_first(case.public(inputs))
        (out if out.dim() == 0 else out.sum()).backward()

    return forward_backward


def cpu_us(fn: Callable[[], object], min_run_time: float) -> float:
    """The median process CPU time per call, in us, over at least MIN_SAMPLES blocks (warmed)."""
    for _ in range(3):
        fn()
    start = time.process_time()
    fn()
    number = max(1, int(2e-3 / max(time.process_time() - start, 1e-7)))
    blocks, spent = [], 0.0
    while len(blocks) < MIN_SAMPLES or spent < min_run_time:
        start = time.process_time()
        for _ in range(number):
            fn()
        elapsed = time.process_time() - start
        blocks.append(elapsed / number * 1e6)
        spent += elapsed
    return statistics.median(blocks)


def _row(case: Case, mode: str, inputs: dict, device: torch.device, min_run_time: float) -> dict:
    run = _runner(case, mode, inputs)
    eager = time_eager(run, min_run_time, device.type)
    row = {
        "op": case.name,
        "public": case.op,
        "mode": mode,
        # "composite": a public op of several ops (or of torch's), no one backend function.
        "backend": resolved_backend_name(case.backend_op, device.type) if case.backend_op else "composite",
        "eager_us": round(eager.median_ms * 1e3, 2),
        "eager_iqr_us": [round(eager.q25_ms * 1e3, 2), round(eager.q75_ms * 1e3, 2)],
        "samples": eager.samples,
        "cpu_us": round(cpu_us(run, min_run_time), 2),
    }
    if device.type == "cuda":
        timing, why = time_device(run, max(20, int(min_run_time * 1e3)))
        if timing is None:
            row["device_note"] = why
        else:
            row["device_us"] = round(timing.median_ms * 1e3, 2)
            row["device_iqr_us"] = [round(timing.q25_ms * 1e3, 2), round(timing.q75_ms * 1e3, 2)]
    if mode == "fwd" and case.backend is not None:
        fn = resolve(case.backend_op, device.type)

        def direct():
            with torch.no_grad():
                return case.backend(fn, inputs)

        row["backend_cpu_us"] = round(cpu_us(direct, min_run_time), 2)
        row["overhead_us"] = round(row["cpu_us"] - row["backend_cpu_us"], 2)
        row["within_target"] = row["overhead_us"] <= TARGET_US
    return row


def measure(device: torch.device, min_run_time: float) -> list[dict]:
    torch.set_num_threads(1)
    inputs = tiny_inputs(device)
    rows = []
    for case in cases():
        for mode in ("fwd", "fwd+bwd") if case.grad_input else ("fwd",):
            if mode == "fwd+bwd":
                inputs[case.grad_input].requires_grad_(True)
            try:
                rows.append(_row(case, mode, inputs, device, min_run_time))
            finally:
                inputs[case.grad_input or "lp"].requires_grad_(False)
                inputs[case.grad_input or "lp"].grad = None
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'op':28} {'mode':8} {'backend':10} {'eager us':>9} {'IQR':>15} {'cpu us':>8} {'device us':>10} {'overhead':>9}"
    lines = [head]
    for r in rows:
        iqr = "{:.1f}-{:.1f}".format(*r["eager_iqr_us"])
        device = f"{r['device_us']:.1f}" if "device_us" in r else "-"
        overhead = f"{r['overhead_us']:.1f}" if "overhead_us" in r else "-"
        lines.append(
            f"{r['op']:28} {r['mode']:8} {r['backend']:10} {r['eager_us']:9.1f} {iqr:>15} {r['cpu_us']:8.1f} "
            f"{device:>10} {overhead:>9}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing (a smoke run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=None, help="folder for overhead-<device>.json (bench/results holds ours)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = measure(device, 0.02 if args.quick else 0.3)
    print(table(rows))
    if args.out:
        write_json(
            os.path.join(args.out, f"overhead-{device.type}.json"),
            {
                "what": f"per-call cost of every public op on tiny inputs (B={B}, T={T}, V={V}, H={H}), forward "
                "(no_grad) and forward + backward: eager wall time (median, IQR over blocks), process CPU time, "
                "device time on CUDA (graph replay, L2 flushed); forward rows with a backend function: the public "
                f"call's CPU time minus the backend call's (target <= {TARGET_US:.0f} us); one torch thread",
                "command": command_line("overhead", argv),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": machine(device),
                "quick": args.quick,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
