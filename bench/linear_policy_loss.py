"""``python -m bench linear_policy_loss``: the policy loss through the LM head at the CPU goal shape,
forward + backward (gradients of hidden and weight), N=8192 tokens in whole sequences of 512, H=256,
V=32768 float32: ``pf.linear_policy_loss`` (one pass, three products) against the two-pass
composition ``pf.linear_token_logprobs`` + ``pf.policy_loss`` (four products: the fused head
recomputes its logits in the backward), with the entropy as the trainer computes it and without it,
per mode, interleaved, on the backend ``auto`` picks (native on CPU).  Each implementation's first
call measures its peak extra memory (bench.timing's peak-RSS probe; inputs excluded, the gradients
included); the loss and the gradients are compared with the composition's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch

import ppo_fast as pf
from ppo_fast.backends import resolve, resolved_backend_name

from .common import load_average, machine, versions, write_json
from .timing import CPU_MEMORY_METHOD, peak_extra_bytes

TEMPERATURE = 0.7


def make_inputs(tokens, length, hidden, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = tokens // length
    mask = torch.rand(rows, length, generator=gen) < 0.9
    return {
        "hidden": torch.randn(rows, length, hidden, generator=gen).requires_grad_(),
        "weight": (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).requires_grad_(),
        "labels": torch.randint(0, vocab, (rows, length), generator=gen),
        "old": -torch.rand(rows, length, generator=gen) * 3 - 8,
        "adv": torch.randn(rows, length, generator=gen),
        "mask": mask,
    }


def implementations(mode):
    params = pf.policy_loss_modes()[mode].example_params()  # the required ones; the others: defaults

    def fused(x):
        loss, _ = pf.linear_policy_loss(
            x["hidden"],
            x["weight"],
            x["labels"],
            x["old"],
            x["adv"],
            x["mask"],
            loss_mode=mode,
            temperature=TEMPERATURE,
            entropy_coef=0.01,
            **params,
        )
        return loss

    def two_pass(entropy):
        def run(x):
            labels = torch.where(x["mask"], x["labels"], -100)
            out = pf.linear_token_logprobs(
                x["hidden"], x["weight"], labels, temperature=TEMPERATURE, return_entropy=entropy
            )
            logp = out[0] if entropy else out
            loss, _ = pf.policy_loss(logp, x["old"], x["adv"], x["mask"], loss_mode=mode, **params)
            return loss - 0.01 * pf.masked_mean(out[1], x["mask"]) if entropy else loss

        return run

    return {"linear_policy_loss": fused, "two-pass": two_pass(True), "two-pass-no-entropy": two_pass(False)}


def forward_backward(fn, x):
    x["hidden"].grad = x["weight"].grad = None
    loss = fn(x)
    loss.backward()
    return loss.detach(), x["hidden"].grad, x["weight"].grad


def run_mode(mode, x, calls):
    impls = implementations(mode)
    rows = {name: {"impl": name, "times_s": []} for name in impls}
    for fn in impls.values():  # untimed: MKL keeps a workspace from its first product on
        forward_backward(fn, x)
    results = {}
    for name, fn in impls.items():

        def first(name=name, fn=fn):
            results[name] = [t.clone() for t in forward_backward(fn, x)]

        rows[name]["peak_extra_bytes"] = peak_extra_bytes(first, "cpu")
        print(mode, name, "peak extra MiB", rows[name]["peak_extra_bytes"] / 2**20, flush=True)
    rows["linear_policy_loss"]["max_abs_diff_vs_two_pass"] = {
        what: float((got - want).abs().max())
        for what, got, want in zip(("loss", "d_hidden", "d_weight"), results["linear_policy_loss"], results["two-pass"])
    }
    for _ in range(calls):
        for name, fn in impls.items():
            start = time.perf_counter()
            forward_backward(fn, x)
            rows[name]["times_s"].append(time.perf_counter() - start)
            print(mode, name, f"{rows[name]['times_s'][-1]:.2f} s", flush=True)
    for row in rows.values():
        row["best_s"] = min(row["times_s"])
    for name in ("two-pass", "two-pass-no-entropy"):
        rows["linear_policy_loss"][f"time_vs_{name}"] = rows["linear_policy_loss"]["best_s"] / rows[name]["best_s"]
        rows["linear_policy_loss"][f"peak_vs_{name}"] = rows["linear_policy_loss"]["peak_extra_bytes"] / max(
            rows[name]["peak_extra_bytes"], 1
        )
    return {
        "mode": mode,
        "backend": resolved_backend_name(pf.policy_loss_modes()[mode].linear_op, "cpu"),
        "results": list(rows.values()),
    }


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench linear_policy_loss", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--modes", default="vanilla,gspo")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--out", default="bench_out/linear_policy_loss-cpu.json")
    args = parser.parse_args(argv)
    x = make_inputs(args.tokens, args.length, args.hidden, args.vocab)
    resolve("linear_token_logprobs", "cpu")
    load_before = load_average()
    modes = [run_mode(mode, x, args.calls) for mode in args.modes.split(",")]
    results = {
        "case": f"N={args.tokens} (rows of {args.length}) H={args.hidden} V={args.vocab} float32",
        "what": "fwd+bwd, gradients of hidden and weight; entropy_coef 0.01 where the entropy is computed",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(torch.device("cpu"))
        | {"cpu_model": cpu_model(), "load_average_before": load_before, "load_average_after": load_average()},
        "versions": versions(),
        "memory_method": CPU_MEMORY_METHOD,
        "modes": modes,
    }
    print(json.dumps(results, indent=1))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
