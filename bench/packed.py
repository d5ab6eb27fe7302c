"""The packed layout (``cu_seqlens``) against the padded one at equal valid tokens, on CPU.

A long-tailed mix of sequence lengths (lognormal, sigma 1, around ``--median``, at most 64x it; and
the trust issue's extreme, 2,048 one-token sequences beside one of 16,384), every valid token
real.  Per op, forward and backward (the gradient of every float input): ``packed``, the op on the
packed ``[N]`` tensors; ``detour``, ``op.padded`` (pad to ``[S, longest]``, the padded op, gather
back: what a packed call cost before the packed kernels); ``padded``, the op on tensors already
padded to ``[S, longest]`` (what a caller with padded data pays).  Median and quartiles (ms) and
the peak extra memory of one call (``bench.timing``).  The ops run on ``auto`` (native on CPU).
"""

from __future__ import annotations

import argparse

import torch

from ppo_fast.spec import AGG_MODES

from .common import result_header, write_json
from .timing import memory_method, peak_extra_bytes, time_cpu

LAYOUTS = ("packed", "detour", "padded")


def mixes(quick: bool, median: int):
    generator = torch.Generator().manual_seed(0)
    rows = 64 if quick else 256
    lengths = (median * torch.exp(torch.randn(rows, generator=generator))).round().clamp(1, 64 * median).long()
    yield f"lognormal-{rows}x{median}", lengths.tolist()
    if not quick:
        yield "issue53-2049", [16384] + [1] * 2048


def ops():
    import ppo_fast as pf

    yield "gae", pf.gae, ("rewards", "values"), {"gamma": 0.99, "lam": 0.95}
    yield "kl_penalized_rewards", _kl(pf.kl_penalized_rewards), ("logprobs", "ref"), {"kl_coef": 0.05}
    for agg in AGG_MODES:
        yield f"policy_loss-{agg}", _policy(pf.policy_loss), ("logprobs", "old", "adv"), {"agg": agg}


def _policy(op):
    def call(logprobs, old, adv, mask, **kw):
        return op(logprobs, old, adv, mask, **kw)[0]

    call.padded = lambda logprobs, old, adv, mask, **kw: op.padded(logprobs, old, adv, mask, **kw)[0]
    return call


def _kl(op):
    def call(logprobs, ref, mask, *, scores, **kw):
        return op(scores, logprobs, ref, mask, **kw)

    call.padded = lambda logprobs, ref, mask, *, scores, **kw: op.padded(scores, logprobs, ref, mask, **kw)
    return call


def layouts(lengths):
    """``(packed inputs [N], padded inputs [S, longest], cu_seqlens, mask [N], padded mask)``."""
    generator = torch.Generator().manual_seed(1)
    length = torch.tensor(lengths)
    tokens, rows, width = int(length.sum()), len(lengths), int(length.max())
    names = ("rewards", "values", "logprobs", "ref", "old", "adv")
    packed = {
        name: torch.randn(tokens, generator=generator) - (1.0 if name in ("logprobs", "ref", "old") else 0.0)
        for name in names
    }
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
    valid = torch.arange(width)[None, :] < length[:, None]
    padded = {}
    for name, x in packed.items():
        padded[name] = x.new_zeros(rows, width)
        padded[name][valid] = x
    return packed, padded, cu_seqlens, torch.ones(tokens, dtype=torch.bool), valid


def fwd_bwd(op, inputs, names, mask, kwargs):
    leaves = {name: inputs[name].clone().requires_grad_(True) for name in names}

    def run():
        out = op(*leaves.values(), mask, **kwargs)
        total = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
        return torch.autograd.grad(total, list(leaves.values()))

    return run


def measure(args, lengths):
    packed, padded, cu_seqlens, mask, valid = layouts(lengths)
    scores = torch.randn(len(lengths))
    rows = []
    for name, op, names, kwargs in ops():
        kwargs = {**kwargs, **({"scores": scores} if name == "kl_penalized_rewards" else {})}
        detour = op.padded
        calls = {
            "packed": fwd_bwd(op, packed, names, mask, {**kwargs, "cu_seqlens": cu_seqlens}),
            "detour": fwd_bwd(detour, packed, names, mask, {**kwargs, "cu_seqlens": cu_seqlens}),
            "padded": fwd_bwd(op, padded, names, valid, kwargs),
        }
        row = {"op": name}
        for layout, call in calls.items():
            timing = time_cpu(call, args.min_run_time)
            row[layout] = {
                "median_ms": timing.median_ms,
                "q25_ms": timing.q25_ms,
                "q75_ms": timing.q75_ms,
                "runs": timing.runs,
                "peak_extra_mib": peak_extra_bytes(call, "cpu") / 2**20,
            }
        row["padded_over_packed"] = row["padded"]["median_ms"] / row["packed"]["median_ms"]
        row["detour_over_packed"] = row["detour"]["median_ms"] / row["packed"]["median_ms"]
        print(
            f"{name:34s} packed {row['packed']['median_ms']:9.3f} ms  detour {row['detour']['median_ms']:9.3f} ms"
            f"  padded {row['padded']['median_ms']:9.3f} ms  padded/packed {row['padded_over_packed']:5.2f}x"
            f"  peak MiB packed {row['packed']['peak_extra_mib']:.1f} detour {row['detour']['peak_extra_mib']:.1f}"
        )
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench packed", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small mix, short timings")
    parser.add_argument("--median", type=int, default=128, help="the lognormal mix's median length")
    parser.add_argument("--min-run-time", type=float, default=None, help="seconds per timing (default 1, quick 0.2)")
    parser.add_argument("--out", default=None, help="result JSON (default bench/results/packed-cpu.json)")
    args = parser.parse_args(argv)
    args.min_run_time = args.min_run_time or (0.2 if args.quick else 1.0)
    result = {**result_header("packed", argv, torch.device("cpu")), "memory_method": memory_method("cpu"), "mixes": []}
    for mix, lengths in mixes(args.quick, args.median):
        print(f"{mix}: {len(lengths)} sequences, {sum(lengths)} tokens, longest {max(lengths)}")
        result["mixes"].append(
            {
                "mix": mix,
                "sequences": len(lengths),
                "tokens": sum(lengths),
                "longest": max(lengths),
                "rows": measure(args, lengths),
            }
        )
    write_json(args.out or "bench/results/packed-cpu.json", result)
    return 0


def markdown(data: dict) -> str:
    """One table per mix: each op's median (quartiles) per layout, the ratios and the peak extra memory."""
    lines = []
    for mix in data["mixes"]:
        lines += [
            f"{mix['mix']}: {mix['sequences']} sequences, {mix['tokens']} tokens, longest {mix['longest']} "
            f"(padded: {mix['sequences'] * mix['longest']} positions)",
            "",
            "| op (fwd+bwd) | packed ms | detour ms | padded ms | padded / packed | detour / packed | "
            "packed peak MiB | detour peak MiB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in mix["rows"]:
            cells = [f"{row[k]['median_ms']:.2f} ({row[k]['q25_ms']:.2f}-{row[k]['q75_ms']:.2f})" for k in LAYOUTS]
            lines.append(
                f"| {row['op']} | {' | '.join(cells)} | {row['padded_over_packed']:.2f}x | "
                f"{row['detour_over_packed']:.2f}x | {row['packed']['peak_extra_mib']:.1f} | "
                f"{row['detour']['peak_extra_mib']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)
