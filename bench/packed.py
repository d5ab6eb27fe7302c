"""The packed layout (``cu_seqlens``) against the padded one at equal valid tokens, on CPU or CUDA.

A long-tailed mix of sequence lengths (lognormal, sigma 1, around ``--median``, at most 64x it; and
the trust issue's extreme, 2,048 one-token sequences beside one of 16,384), every valid token
real.  Per op, forward and backward (the gradient of every float input): ``packed``, the op on the
packed ``[N]`` tensors; ``detour``, ``op.padded`` (pad to ``[S, longest]``, the padded op, gather
back: what a packed call cost before the packed kernels); ``padded``, the op on tensors already
padded to ``[S, longest]`` (what a caller with padded data pays).  ``linear_policy_loss`` (the fused
head) differentiates the hidden states of a small head (every padded row goes through its products).  Median and quartiles (ms) and
the peak extra memory of one call (``bench.timing``).  The ops run on ``auto``: native on CPU; on
CUDA (``--device cuda``) the Triton kernels for ``gae`` and ``kl_penalized_rewards``, the native
CUDA kernels for the losses.  On CUDA each layout has two timers: eager wall time per call, and
device time (CUDA graph replay, L2 flushed; the detour reads the lengths on the host, so it has
none, said in the row); and ``packed_max_seqlen`` adds the packed call given ``max_seqlen``.
"""

from __future__ import annotations

import argparse

import torch

from ppo_fast.spec import AGG_MODES

from .common import result_header, write_json
from .timing import memory_method, peak_extra_bytes, time_device, time_eager

LAYOUTS = ("packed", "detour", "padded")
CUDA_LAYOUTS = ("packed", "packed_max_seqlen", "detour", "padded")


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
        yield f"policy_loss-{agg}", _first(pf.policy_loss), ("logprobs", "old", "adv"), {"agg": agg}
    for mode in ("gspo", "geo_mean"):  # the segmented sequence-level kernels
        kwargs = {"agg": "seq-mean-token-mean", "loss_mode": mode}
        yield f"policy_loss-{mode}", _first(pf.policy_loss), ("logprobs", "old", "adv"), kwargs
    value = {"agg": "seq-mean-token-sum-norm"}
    yield "value_loss-seq-mean-token-sum-norm", _first(pf.value_loss), ("values", "old", "rewards"), value
    head = _linear(pf.linear_policy_loss)  # the fused head: the one pass (GSPO's and GMPO's: whole sequences a chunk)
    fused = [("token-mean", "vanilla"), ("seq-mean-token-mean", "vanilla")]
    for agg, mode in fused + [("seq-mean-token-mean", "gspo"), ("seq-mean-token-mean", "geo_mean")]:
        kwargs = {"agg": agg, "loss_mode": mode, "kl_coef": 0.05, "entropy_coef": 0.01}
        yield f"linear_policy_loss-{mode}-{agg}", head, ("hidden", "labels", "old", "adv", "ref"), kwargs


def _first(op):
    """A loss op's call returning its loss alone (its stats are not differentiated)."""

    def call(logprobs, old, adv, mask, **kw):
        return op(logprobs, old, adv, mask, **kw)[0]

    call.padded = lambda logprobs, old, adv, mask, **kw: op.padded(logprobs, old, adv, mask, **kw)[0]
    return call


# The fused head's size here: small, so that the padded layout's rows (every one of them goes through the
# head's products) stay measurable on a CPU; the packed/padded ratio is the rows', whatever the head.
HEAD_VOCAB, HEAD_WIDTH = 256, 64
HEAD_MAX_POSITIONS = 1 << 18  # a padded layout larger: minutes a call on a CPU, its rows not run


def _linear(op):
    """``linear_policy_loss``'s loss on the per-token inputs, its head ``[HEAD_VOCAB, HEAD_WIDTH]`` fixed."""
    weight = torch.randn(HEAD_VOCAB, HEAD_WIDTH, generator=torch.Generator().manual_seed(2)) / HEAD_WIDTH**0.5

    def call(hidden, labels, old, adv, ref, mask, **kw):
        return op(hidden, weight.to(hidden.device), labels, old, adv, mask, ref_logprobs=ref, **kw)[0]

    call.padded = lambda hidden, labels, old, adv, ref, mask, **kw: op.padded(
        hidden, weight.to(hidden.device), labels, old, adv, mask, ref_logprobs=ref, **kw
    )[0]
    return call


def _kl(op):
    def call(logprobs, ref, mask, *, scores, **kw):
        return op(scores, logprobs, ref, mask, **kw)

    call.padded = lambda logprobs, ref, mask, *, scores, **kw: op.padded(scores, logprobs, ref, mask, **kw)
    return call


def layouts(lengths, device="cpu", head=False):
    """``(packed inputs [N], padded inputs [S, longest], cu_seqlens, mask [N], padded mask)`` on ``device``;
    ``head``: with the fused head's hidden states and labels."""
    generator = torch.Generator().manual_seed(1)
    length = torch.tensor(lengths)
    tokens, rows, width = int(length.sum()), len(lengths), int(length.max())
    names = ("rewards", "values", "logprobs", "ref", "old", "adv")
    packed = {
        name: torch.randn(tokens, generator=generator) - (1.0 if name in ("logprobs", "ref", "old") else 0.0)
        for name in names
    }
    if head:
        packed["hidden"] = torch.randn(tokens, HEAD_WIDTH, generator=generator)
        packed["labels"] = torch.randint(HEAD_VOCAB, (tokens,), generator=generator)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
    valid = torch.arange(width)[None, :] < length[:, None]
    padded = {}
    for name, x in packed.items():
        padded[name] = x.new_zeros(rows, width, *x.shape[1:])
        padded[name][valid] = x
    on = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    mask = torch.ones(tokens, dtype=torch.bool, device=device)
    return on(packed), on(padded), cu_seqlens.to(device), mask, valid.to(device)


def fwd_bwd(op, inputs, names, mask, kwargs):
    leaves = {name: inputs[name].clone().requires_grad_(inputs[name].is_floating_point()) for name in names}
    wanted = [x for x in leaves.values() if x.requires_grad]  # not the labels

    def run():
        out = op(*leaves.values(), mask, **kwargs)
        total = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
        return torch.autograd.grad(total, wanted, allow_unused=True)  # GSPO: old is detached

    return run


def _timed(call, args) -> dict:
    """The layout's cell: eager wall time (both devices), device time (CUDA), peak extra memory."""
    timing = time_eager(call, args.min_run_time, args.device)
    cell = {
        "median_ms": timing.median_ms,
        "q25_ms": timing.q25_ms,
        "q75_ms": timing.q75_ms,
        "runs": timing.runs,
        "timer": timing.timer,
        "peak_extra_mib": peak_extra_bytes(call, args.device) / 2**20,
    }
    if args.device == "cuda":
        device, why = time_device(call, max(20, int(args.min_run_time * 1e3)))
        cell["device"] = (
            {"median_ms": device.median_ms, "q25_ms": device.q25_ms, "q75_ms": device.q75_ms, "timer": device.timer}
            if device
            else {"why": why}
        )
    return cell


def _selected(args, lengths) -> list:
    """``ops()`` named by ``--ops``, the fused head's only on a padded layout of at most HEAD_MAX_POSITIONS."""
    out = []
    for name, *op in ops():
        if args.ops and not any(name.startswith(prefix) for prefix in args.ops.split(",")):
            continue
        if name.startswith("linear") and len(lengths) * max(lengths) > HEAD_MAX_POSITIONS:
            print(f"{name}: not run, the padded layout holds more than {HEAD_MAX_POSITIONS} positions")
            continue
        out.append((name, *op))
    return out


def measure(args, lengths):
    selected = _selected(args, lengths)
    head = any(name.startswith("linear") for name, *_ in selected)
    packed, padded, cu_seqlens, mask, valid = layouts(lengths, args.device, head)
    scores = torch.randn(len(lengths), device=args.device)
    rows = []
    for name, op, names, kwargs in selected:
        kwargs = {**kwargs, **({"scores": scores} if name == "kl_penalized_rewards" else {})}
        detour = op.padded
        calls = {
            "packed": fwd_bwd(op, packed, names, mask, {**kwargs, "cu_seqlens": cu_seqlens}),
            "detour": fwd_bwd(detour, packed, names, mask, {**kwargs, "cu_seqlens": cu_seqlens}),
            "padded": fwd_bwd(op, padded, names, valid, kwargs),
        }
        if args.device == "cuda":
            given = {**kwargs, "cu_seqlens": cu_seqlens, "max_seqlen": max(lengths)}
            calls["packed_max_seqlen"] = fwd_bwd(op, packed, names, mask, given)
        row = {"op": name, **{layout: _timed(call, args) for layout, call in calls.items()}}
        row["padded_over_packed"] = row["padded"]["median_ms"] / row["packed"]["median_ms"]
        row["detour_over_packed"] = row["detour"]["median_ms"] / row["packed"]["median_ms"]
        print(
            f"{name:34s} packed {row['packed']['median_ms']:9.3f} ms  detour {row['detour']['median_ms']:9.3f} ms"
            f"  padded {row['padded']['median_ms']:9.3f} ms  padded/packed {row['padded_over_packed']:5.2f}x"
            f"  peak MiB packed {row['packed']['peak_extra_mib']:.1f} detour {row['detour']['peak_extra_mib']:.1f}"
            + (f"  device: packed {_cell(row['packed'])}" if args.device == "cuda" else "")
        )
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench packed", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small mix, short timings")
    parser.add_argument("--median", type=int, default=128, help="the lognormal mix's median length")
    parser.add_argument("--min-run-time", type=float, default=None, help="seconds per timing (default 1, quick 0.2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ops", default="", help="comma-separated prefixes of the ops to run (default: all)")
    parser.add_argument("--out", default=None, help="result JSON (default bench/results/packed-DEVICE.json)")
    args = parser.parse_args(argv)
    args.min_run_time = args.min_run_time or (0.2 if args.quick else 1.0)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    header = result_header("packed", argv, torch.device(args.device))
    result = {**header, "memory_method": memory_method(args.device), "mixes": []}
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
    write_json(args.out or f"bench/results/packed-{args.device}.json", result)
    return 0


def markdown(data: dict) -> str:
    """One table per mix: each op's median (quartiles) per layout, the ratios and the peak extra memory."""
    lines = []
    for mix in data["mixes"]:
        layouts = CUDA_LAYOUTS if mix["rows"] and "packed_max_seqlen" in mix["rows"][0] else LAYOUTS
        lines += [
            f"{mix['mix']}: {mix['sequences']} sequences, {mix['tokens']} tokens, longest {mix['longest']} "
            f"(padded: {mix['sequences'] * mix['longest']} positions)",
            "",
            f"| op (fwd+bwd) | {' | '.join(f'{k} ms' for k in layouts)} | padded / packed | detour / packed | "
            "packed peak MiB | detour peak MiB |",
            "| --- |" + " ---: |" * (len(layouts) + 4),
        ]
        for row in mix["rows"]:
            cells = [_cell(row[k]) for k in layouts]
            lines.append(
                f"| {row['op']} | {' | '.join(cells)} | {row['padded_over_packed']:.2f}x | "
                f"{row['detour_over_packed']:.2f}x | {row['packed']['peak_extra_mib']:.1f} | "
                f"{row['detour']['peak_extra_mib']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def _cell(cell: dict) -> str:
    """Eager median (quartiles) in ms, and on CUDA the device time (or why there is none)."""
    text = f"{cell['median_ms']:.2f} ({cell['q25_ms']:.2f}-{cell['q75_ms']:.2f})"
    device = cell.get("device")
    if device is not None:
        text += f", device {device['median_ms']:.3f}" if "median_ms" in device else ", no device time"
    return text
