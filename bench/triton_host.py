"""``python -m bench triton_host``: the Triton backend's host cost per call, measured on CPU.

    TRITON_INTERPRET=1 python -m bench triton_host [--quick] [--out bench/results]

The Triton ops' host time shows only on CUDA, but everything before a kernel launch is Python
that runs the same on CPU under the interpreter.  Here every launch ``kernel[grid](...)`` is
stubbed (it counts and returns: no kernel, and none of Triton's own launcher, which a GPU adds per
launch), the value checks take their CUDA branch (``host_checks_free`` False), and each public op's
Triton path is timed on the overhead suite's tiny inputs, forward and forward + backward, beside
the native op with its real CPU kernels and torch's floor.  ``kl_estimate`` is also timed layer by
layer: the backend function (in eager mode its plain ``autograd.Function`` entry, ``_eager``), the
custom op it takes under torch.compile and modes (``torch.library.custom_op`` with
``register_autograd``; its backward op called as the entry's is), a minimal plain
``torch.autograd.Function`` over the same launchers, and the launchers alone.  Process CPU time,
interleaved rounds, median and IQR, one torch thread.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

import ppo_fast as pf
from ppo_fast import _validation

from .common import command_line, machine, write_json
from .overhead import B, H, T, V, tiny_inputs

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results")

# public op -> (input it differentiates, call); the overhead suite's shapes.
CASES: dict[str, tuple[str | None, Callable[[dict], torch.Tensor]]] = {
    "token_logprobs": ("logits", lambda x: pf.token_logprobs(x["logits"], x["labels"])),
    "linear_token_logprobs": (
        "hidden",
        lambda x: pf.linear_token_logprobs(x["hidden"], x["weight"], x["labels"].view(-1)),
    ),
    "linear_policy_loss": (
        "hidden",
        lambda x: pf.linear_policy_loss(
            x["hidden"].view(B, T, H), x["weight"], x["labels"], x["old"], x["adv"], x["mask"]
        )[0],
    ),
    "kl_estimate": ("lp", lambda x: pf.kl_estimate(x["lp"], x["old"], kl_estimator="k3")),
    "kl_penalized_rewards": (
        "lp",
        lambda x: pf.kl_penalized_rewards(x["scores"], x["lp"], x["old"], x["mask"], kl_coef=0.05)[0],
    ),
    "gae": ("values", lambda x: pf.gae(x["rewards"], x["values"], x["mask"])[0]),
    "group_advantages": (None, lambda x: pf.group_advantages(x["scores"], x["group_ids"], x["mask"], method="grpo")),
}


class StubbedLaunches:
    """While open, ``kernel[grid](...)`` launches nothing and counts (``launches``); the checks take
    their CUDA branch.  Needs TRITON_INTERPRET=1 (the Triton backend serves CPU tensors only then)."""

    def __init__(self):
        self.launches = 0
        self._stack = contextlib.ExitStack()

    def _count(self, *args, **kwargs):
        self.launches += 1

    def __enter__(self):
        import triton.runtime.jit as jit

        self._stack.enter_context(
            mock.patch.object(jit.KernelInterface, "__getitem__", lambda kernel, grid: self._count)
        )
        self._stack.enter_context(mock.patch.object(_validation, "host_checks_free", lambda *tensors: False))
        return self

    def __exit__(self, *exc):
        self._stack.close()


def _runner(call: Callable, leaf: torch.Tensor | None) -> Callable[[], None]:
    if leaf is None:

        def forward():
            with torch.no_grad():
                call()

        return forward

    def forward_backward():
        leaf.grad = None
        out = call()
        (out if out.dim() == 0 else out.sum()).backward()

    return forward_backward


def timed(fns: dict, rounds: int, number: int, within: dict | None = None) -> dict[str, tuple[float, float, float]]:
    """Median and quartiles of the process CPU time per call (us), over ``rounds`` interleaved blocks;
    ``within[name]()``: a context each block of that function runs in."""
    within = within or {}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        with within.get(name, contextlib.nullcontext)():
            for _ in range(min(number, 50)):
                fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            with within.get(name, contextlib.nullcontext)():
                start = time.process_time()
                for _ in range(number):
                    fn()
                samples[name].append((time.process_time() - start) / number * 1e6)
    out = {}
    for name, values in samples.items():
        q25, _, q75 = statistics.quantiles(values, n=4)
        out[name] = (statistics.median(values), q25, q75)
    return out


def _layers(x: dict) -> dict[str, Callable[[], None]]:
    """kl_estimate's layers, forward + backward (the backend and launchers of ppo_fast.backends.triton)."""
    from ppo_fast.backends.triton import kl_penalized_rewards as triton_kl

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logprobs, ref_logprobs, estimator):
            ctx.save_for_backward(logprobs, ref_logprobs)
            ctx.estimator = estimator
            return triton_kl.kl_estimate_forward(logprobs, ref_logprobs, estimator)

        @staticmethod
        def backward(ctx, grad):
            logprobs, ref_logprobs = ctx.saved_tensors
            return *triton_kl.kl_estimate_backward(grad, logprobs, ref_logprobs, ctx.estimator), None

    lp, ref, grad = x["lp"], x["old"], torch.ones_like(x["lp"])
    return {
        "kl_estimate layer: backend fn (eager entry), fwd+bwd": _runner(
            lambda: triton_kl.kl_estimate(lp, ref, "k3"), lp
        ),
        "kl_estimate layer: its custom_op + register_autograd, fwd+bwd": _runner(
            lambda: triton_kl._kl_estimate_op(lp, ref, "k3"), lp
        ),
        "kl_estimate layer: minimal autograd.Function, same launchers, fwd+bwd": _runner(
            lambda: Plain.apply(lp, ref, "k3"), lp
        ),
        "kl_estimate layer: launchers alone, forward": lambda: triton_kl.kl_estimate_forward(lp.detach(), ref, "k3"),
        "kl_estimate layer: launchers alone, backward": lambda: triton_kl.kl_estimate_backward(
            grad, lp.detach(), ref, "k3"
        ),
        "torch floor: (lp - ref).sum(), fwd+bwd": _runner(lambda: (lp - ref).sum(), lp),
    }


def measure(rounds: int, number: int) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench triton_host: run with TRITON_INTERPRET=1 (the Triton backend on CPU tensors)")
    torch.set_num_threads(1)
    x = tiny_inputs(torch.device("cpu"))
    rows = []
    for op, (leaf_name, call) in CASES.items():
        for mode in ("fwd", "fwd+bwd") if leaf_name else ("fwd",):
            leaf = x[leaf_name].requires_grad_(True) if mode == "fwd+bwd" else None
            fn = _runner(lambda call=call: call(x), leaf)
            with pf.use_backend("triton"), StubbedLaunches() as stub:
                fn()
                launches = stub.launches
            within = {
                "triton": lambda: _stacked(pf.use_backend("triton"), StubbedLaunches()),
                "native": lambda: pf.use_backend("native"),
            }
            times = timed({"triton": fn, "native": fn}, rounds, number, within)
            rows.append(_row(op, mode, launches, times["triton"], times["native"]))
            if leaf is not None:
                leaf.requires_grad_(False)
                leaf.grad = None
    x["lp"].requires_grad_(True)
    with StubbedLaunches():
        for name, (median, q25, q75) in timed(_layers(x), rounds, number).items():
            rows.append({"op": name, "cpu_us": round(median, 2), "cpu_iqr_us": [round(q25, 2), round(q75, 2)]})
    return rows


@contextlib.contextmanager
def _stacked(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


def _row(op, mode, launches, triton_time, native_time) -> dict:
    return {
        "op": op,
        "mode": mode,
        "triton_launches": launches,
        "triton_stubbed_cpu_us": round(triton_time[0], 2),
        "triton_stubbed_cpu_iqr_us": [round(triton_time[1], 2), round(triton_time[2], 2)],
        "native_cpu_us": round(native_time[0], 2),
        "native_cpu_iqr_us": [round(native_time[1], 2), round(native_time[2], 2)],
    }


def table(rows: list[dict]) -> str:
    lines = [f"{'op':72} {'mode':8} {'launches':>8} {'triton (stubbed) us':>24} {'native us':>22}"]
    for r in rows:
        if "mode" in r:
            t, n = r["triton_stubbed_cpu_iqr_us"], r["native_cpu_iqr_us"]
            lines.append(
                f"{r['op']:72} {r['mode']:8} {r['triton_launches']:8d} "
                f"{r['triton_stubbed_cpu_us']:8.1f} ({t[0]:.1f}-{t[1]:.1f}) {r['native_cpu_us']:8.1f} ({n[0]:.1f}-{n[1]:.1f})"
            )
        else:
            q = r["cpu_iqr_us"]
            lines.append(f"{r['op']:72} {'':8} {'':8} {r['cpu_us']:8.1f} ({q[0]:.1f}-{q[1]:.1f})")
    return "\n".join(lines)


def markdown(data: dict) -> str:
    """The result file as the performance page's tables."""
    lines = [
        "| op | mode | launches | Triton, launches stubbed (µs) | IQR | native, real kernels (µs) | IQR |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    layers = ["", "| layer | CPU time (µs) | IQR |", "| --- | --- | --- |"]
    for r in data["rows"]:
        if "mode" in r:
            t, n = r["triton_stubbed_cpu_iqr_us"], r["native_cpu_iqr_us"]
            lines.append(
                f"| `{r['op']}` | {r['mode']} | {r['triton_launches']} | {r['triton_stubbed_cpu_us']:.1f} | "
                f"{t[0]:.1f}-{t[1]:.1f} | {r['native_cpu_us']:.1f} | {n[0]:.1f}-{n[1]:.1f} |"
            )
        else:
            q = r["cpu_iqr_us"]
            layers.append(f"| {r['op']} | {r['cpu_us']:.1f} | {q[0]:.1f}-{q[1]:.1f} |")
    return "\n".join(lines + layers)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench triton_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 20 calls (a smoke run)")
    parser.add_argument("--out", default=None, help="folder for triton-host-cpu.json (bench/results holds ours)")
    args = parser.parse_args(argv)
    rounds, number = (3, 20) if args.quick else (15, 300)
    rows = measure(rounds, number)
    print(table(rows))
    if args.out:
        write_json(
            os.path.join(args.out, "triton-host-cpu.json"),
            {
                "what": f"host CPU time per call of the Triton backend's public ops on tiny inputs (B={B}, T={T}, "
                f"V={V}, H={H}), every kernel launch stubbed (no kernel, no Triton launcher), value checks on their "
                "CUDA branch; beside the native op with its real CPU kernels; kl_estimate layer by layer; "
                f"median and IQR of {rounds} interleaved rounds x {number} calls, process time, one torch thread",
                "command": "TRITON_INTERPRET=1 " + command_line("triton_host", argv),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": machine(torch.device("cpu")),
                "quick": args.quick,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
