"""``python -m bench head_model``: the fused LM head's roofline model, on paper (no GPU, no torch).

For each shape, the FLOPs, HBM bytes and launches of every phase of three designs, and the time an
H100 and an H200 would take, predicted as ``max(FLOPs / (peak * GEMM_EFFICIENCY), bytes / (bandwidth *
MEMORY_EFFICIENCY), launches * LAUNCH_S)`` per phase, summed:

- ``linear``: the plain linear layer ``hidden @ weight.T`` (bf16 logits) and autograd's two products;
- ``gemm``: the GEMM-first head as the kernels run it (``ppo_fast/backends/_head_plan.py``: the phases,
  and the plan, chunk rows and ``d_weight``'s accumulator, that ``plan`` chooses within the default
  memory budget, 5% of the logits' bytes): ``linear_token_logprobs`` with 8 N H V FLOPs,
  ``linear_policy_loss`` in one pass with 6 N H V (its chunks paired where the plan pairs them);
  the loss's per-token terms are the fused kernel of every mode (vanilla, sapo, cispo, gpg, dppo_tv,
  dppo_kl, dro, and the sequence-level gspo and geo_mean: one launch a chunk);
- ``gemm-generic``: the loss as ``gemm`` for float64 inputs (unpaired: float64 never pairs), whose
  per-token terms are the reference's function under autograd (``_head_plan.TERMS_LAUNCHES``: its
  kernels a chunk with a KL term, as counted on CPU);
- ``gemm-2048``: the same phases with ``WIDE``'s plan (2048-row chunks, a float32 ``d_weight``
  accumulator), what a budget of about 50% of the logits buys, for comparison;
- ``gemm-2d``: ``linear_token_logprobs`` in the 2-D plan (``_head_plan.block_plan``: fixed blocks of
  rows times fixed vocabulary slices, each row's statistics folded slice by slice; ``d_weight``'s and
  ``weight``'s traffic a block, not a 384-row chunk), beside the row plan of ``gemm``;
- ``tiles``: the tile-fused Triton kernels, whose every vocabulary tile re-reads its rows' hidden
  states from HBM, and whose backward re-reads and re-writes the float32 ``d_hidden`` once per
  vocabulary chunk of a fixed 64 MiB scratch (so that term grows as N^2);
- ``epilogue``: ``linear_token_logprobs``' forward as one grouped GEMM in Triton with the row work in its
  epilogue (no logits written: ``_head_plan.epilogue_phases``), its backward the 2-D plan's.  Its products'
  efficiency has not been measured: its rows assume cuBLAS's (its ceiling), and the last table gives the
  efficiency at which it would meet the forward's goal or beat the 2-D plan.  Its epilogue's exponentials
  (one a logit, on the special-function units, between the products of a tile) are not modelled: about
  0.6 ms at 16384 x 151936 on an H100 if nothing overlaps them.

These are predictions, not measurements.  The efficiencies are this project's one GPU run's
(``bench/results/gpu-h200-2026-12-04/``: cuBLAS's linear layer at 16384 x 4096 x 151936 bf16 ran at
696 TFLOP/s, 70% of the dense bf16 peak; token_logprobs at about copy bandwidth).
"""

from __future__ import annotations

import argparse
import math
import pathlib

from ppo_fast.backends._head_plan import (
    MEMORY_BUDGET,
    HeadPlan,
    Phase,
    block_extra_memory,
    block_phases,
    block_plan,
    epilogue_extra_memory,
    epilogue_phases,
    extra_memory,
    phases,
    plan,
)

DEVICES = {  # dense bf16 tensor FLOP/s, HBM bytes/s (SXM parts)
    "H100": (989.4e12, 3.35e12),
    "H200": (989.4e12, 4.8e12),
}
GEMM_EFFICIENCY = 0.70
# The tile kernels' products: 260 TFLOP/s measured forward at 16384 x 4096 x 151936 on the H200
# (load-latency-bound: K-tile 32, 3 stages), 26% of the peak.
TILE_EFFICIENCY = 0.26
MEMORY_EFFICIENCY = 0.90
LAUNCH_S = 4e-6  # a launch's floor per phase (eager torch / Triton launch)
SHAPES = [(n, h, v) for n in (2048, 8192, 16384, 65536) for h in (896, 4096) for v in (128256, 151936)]
GOALS = {  # the goals: (numerator, denominator, bound)
    "loss fwd+bwd / linear fwd+bwd": (("loss_fwd", "loss_bwd"), ("linear_fwd", "linear_bwd"), 1.15),
    "logprobs fwd / linear fwd": (("logprobs_fwd",), ("linear_fwd",), 1.10),
    "logprobs fwd+bwd / linear fwd+bwd": (("logprobs_fwd", "logprobs_bwd"), ("linear_fwd", "linear_bwd"), 1.45),
}
TILE_BLOCKS = (128, 128)  # the tile forward's BLOCK_N, BLOCK_V (bf16)
TILE_SCRATCH = 64 << 20  # the tile backward's d_logits scratch (GRADIENT_SCRATCH_BYTES)
SM_COUNT = 132


def tile_phases(kind: str, n: int, h: int, v: int, s: int = 2) -> list[Phase]:
    """The tile design's phases: ``hidden`` read once per vocabulary tile; ``weight`` once per wave of
    row blocks (the blocks of a wave share its tiles in L2)."""
    bn, bv = TILE_BLOCKS
    waves = math.ceil(math.ceil(n / bn) / SM_COUNT)
    tiles_fwd = Phase(
        "tile kernel: products + row work", 2.0 * n * h * v, math.ceil(v / bv) * n * h * s + waves * v * h * s, 1
    )
    if kind == "tiles_fwd":
        return [tiles_fwd]
    cols = max(bv, TILE_SCRATCH // (s * n) // bv * bv)
    chunks = math.ceil(v / cols)
    return [
        Phase("tile kernel: recompute + d_logits", 2.0 * n * h * v, tiles_fwd.bytes + n * v * s, chunks),
        Phase(
            "d_hidden += dz @ weight[chunk] (fp32, per chunk)",
            2.0 * n * h * v,
            chunks * n * h * 8 + n * v * s + v * h * s,
            chunks,
        ),
        Phase("d_weight[chunk] = dz.T @ hidden", 2.0 * n * h * v, n * v * s + chunks * n * h * s + v * h * s, chunks),
    ]


def predicted_s(ps: list[Phase], device: str, efficiency: float = GEMM_EFFICIENCY) -> float:
    flops, bandwidth = DEVICES[device]
    return sum(
        max(p.flops / (flops * efficiency), p.bytes / (bandwidth * MEMORY_EFFICIENCY), p.launches * LAUNCH_S)
        for p in ps
    )


# The plan the budget replaced, for comparison: 2048-row chunks and a float32 d_weight accumulator.
WIDE = HeadPlan(rows=2048, acc=4)


def design_plan(design: str, kind: str, n: int, h: int, v: int) -> HeadPlan:
    """The chunk rows and accumulator of ``design`` for a call of ``kind`` (bf16)."""
    if design == "gemm-2048":
        return WIDE
    # gemm-generic: float64 inputs' terms, whose chunks never pair (a bf16 accumulator's design)
    return plan("logprobs" if kind.startswith("logprobs") else "loss", n, h, v, paired=design != "gemm-generic")


def _design_phases(design: str, kind: str, n: int, h: int, v: int) -> list[Phase]:
    if design == "tiles":
        return tile_phases(f"tiles_{kind.split('_')[1]}", n, h, v)
    if design == "linear":
        return phases(kind, n, h, v)
    if design == "gemm-2d":
        return block_phases(kind, n, h, v, **block_plan(h, v)._asdict())
    if design == "epilogue":
        return epilogue_phases(kind, n, h, v)
    terms = "generic, KL" if design == "gemm-generic" else "fused"
    return phases(kind, n, h, v, **design_plan(design, kind, n, h, v)._asdict(), terms=terms)


def model(n: int, h: int, v: int) -> dict:
    """One shape's rows: per design and pass, FLOPs, bytes, launches and the predicted ms per device."""
    rows = {}
    kinds = {
        "linear": ("linear_fwd", "linear_bwd"),
        "gemm": ("logprobs_fwd", "logprobs_bwd", "loss_fwd", "loss_bwd"),
        "gemm-2048": ("logprobs_fwd", "logprobs_bwd", "loss_fwd", "loss_bwd"),
        "gemm-generic": ("loss_fwd", "loss_bwd"),
        "gemm-2d": ("logprobs_fwd", "logprobs_bwd"),
        "tiles": ("logprobs_fwd", "logprobs_bwd"),
        "epilogue": ("logprobs_fwd", "logprobs_bwd"),
    }
    for design, names in kinds.items():
        for kind in names:
            ps = _design_phases(design, kind, n, h, v)
            rows[f"{design} {kind}"] = {
                "flops": sum(p.flops for p in ps),
                "bytes": sum(p.bytes for p in ps),
                "launches": sum(p.launches for p in ps),
                "ms": {
                    d: 1e3 * predicted_s(ps, d, TILE_EFFICIENCY if design == "tiles" else GEMM_EFFICIENCY)
                    for d in DEVICES
                },
                "phases": [p._asdict() for p in ps],
            }
    return rows


def goals(rows: dict, n: int, h: int, v: int, design: str = "gemm") -> dict:
    """The issue's goals for ``design`` (``gemm`` or ``gemm-2048``) against the linear layer; the memory
    goal of each call (log-probs: its backward, which holds the most; the loss: its forward)."""
    out = {}
    for name, (num, den, bound) in GOALS.items():
        if f"{design} {num[0]}" not in rows:  # gemm-generic: the loss alone
            continue
        for d in DEVICES:
            ratio = sum(rows[f"{design} {k}"]["ms"][d] for k in num) / sum(rows[f"linear {k}"]["ms"][d] for k in den)
            out[f"{name} ({d})"] = {"ratio": ratio, "bound": bound, "met": ratio <= bound}
    for call, kind in (("loss", "loss_fwd"), ("logprobs", "logprobs_bwd")):
        if f"{design} {kind}" not in rows:
            continue
        if design in ("gemm-2d", "epilogue"):  # the epilogue's backward is the 2-D plan's; its forward's partials
            chosen = block_plan(h, v)
            memory = block_extra_memory(kind, h, v, **chosen._asdict()) / (n * v * 2)
            memory = max(memory, epilogue_extra_memory(n, v) / (n * v * 2)) if design == "epilogue" else memory
            label = f"{chosen.rows} rows x {chosen.cols} columns"
        else:
            chosen = design_plan(design, kind, n, h, v)
            memory = extra_memory(kind, n, h, v, rows=chosen.rows, acc=chosen.acc, pair=chosen.pair) / (n * v * 2)
            label = f"{chosen.rows} rows{' paired' if chosen.pair else ''}"
        out[f"{call} extra memory / logits' bytes"] = {
            "ratio": memory,
            "bound": 0.05,
            "met": memory <= 0.05,
            "plan": f"{label}, {'float32' if chosen.acc == 4 else 'bf16'} d_weight",
        }
    return out


def needed_efficiency(rows: dict, n: int, h: int, v: int) -> dict:
    """Per device, the fraction of the tensor peak the epilogue's products need (None: out of reach, its
    bytes or launches alone take longer) to meet the forward's goal (1.10x the linear layer), to match the
    2-D plan's forward, and to meet the forward + backward goal (1.45x; the backward the 2-D plan's)."""
    product, combine = epilogue_phases("logprobs_fwd", n, h, v)
    backward = rows["epilogue logprobs_bwd"]["ms"]
    out = {}
    for d, (peak, bandwidth) in DEVICES.items():
        floor = max(product.bytes / (bandwidth * MEMORY_EFFICIENCY), product.launches * LAUNCH_S)
        linear = {k: rows[f"linear {k}"]["ms"][d] / 1e3 for k in ("linear_fwd", "linear_bwd")}
        targets = {
            "forward 1.10x": 1.10 * linear["linear_fwd"],
            "2-D plan forward": rows["gemm-2d logprobs_fwd"]["ms"][d] / 1e3,
            "fwd+bwd 1.45x": 1.45 * sum(linear.values()) - backward[d] / 1e3,
        }
        for name, target in targets.items():
            left = target - predicted_s([combine], d)
            needed = product.flops / (peak * left) if left > floor else math.inf
            out[f"{name} ({d})"] = needed if needed <= 1.0 else None
    return out


def _table(results: list[dict]) -> str:
    lines = [
        "| N | H | V | design | pass | TFLOP | HBM GB | launches | H100 ms | H200 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, row in r["rows"].items():
            design, kind = name.split(" ")
            lines.append(
                f"| {r['n']} | {r['h']} | {r['v']} | {design} | {kind} | {row['flops'] / 1e12:.2f} | "
                f"{row['bytes'] / 1e9:.1f} | {row['launches']} | {row['ms']['H100']:.1f} | {row['ms']['H200']:.1f} |"
            )
    return "\n".join(lines)


def _goal_table(results: list[dict]) -> str:
    lines = ["| N | H | V | design | goal | predicted | bound | met |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for design, gs in r["goals"].items():
            for name, g in gs.items():
                met = "yes" if g["met"] else "no"
                name = f"{name} ({g['plan']})" if "plan" in g else name
                lines.append(
                    f"| {r['n']} | {r['h']} | {r['v']} | {design} | {name} | {g['ratio']:.3f} | {g['bound']} | {met} |"
                )
    return "\n".join(lines)


def _needed_table(results: list[dict]) -> str:
    names = list(results[0]["needed"])
    lines = [
        "The epilogue's products: the fraction of the bf16 tensor peak they need (cuBLAS's linear layer: "
        f"{GEMM_EFFICIENCY}; the tile kernels measured: {TILE_EFFICIENCY}; -: out of reach)",
        "",
        "| N | H | V | " + " | ".join(names) + " |",
        "|---" * (3 + len(names)) + "|",
    ]
    for r in results:
        cells = ["-" if e is None else f"{e:.2f}" for e in r["needed"].values()]
        lines.append(f"| {r['n']} | {r['h']} | {r['v']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench head_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file (a .md path)")
    args = parser.parse_args(argv)
    results = []
    for n, h, v in SHAPES:
        rows = model(n, h, v)
        both = {d: goals(rows, n, h, v, d) for d in ("gemm", "gemm-2d", "gemm-2048", "gemm-generic", "epilogue")}
        needed = needed_efficiency(rows, n, h, v)
        results.append({"n": n, "h": h, "v": v, "rows": rows, "goals": both, "needed": needed})
    header = (
        f"Predictions (roofline model, not measurements): bf16; gemm: the plan within a memory budget of "
        f"{MEMORY_BUDGET:.0%} of the logits' bytes, gemm-2048: {WIDE.rows} rows and a float32 d_weight; GEMM efficiency "
        f"{GEMM_EFFICIENCY} (tiles {TILE_EFFICIENCY}; epilogue: cuBLAS's, its ceiling), memory efficiency {MEMORY_EFFICIENCY}, {LAUNCH_S * 1e6:.0f} us a launch; "
        + ", ".join(f"{d}: {f / 1e12:.0f} TFLOP/s, {b / 1e12:.2f} TB/s" for d, (f, b) in DEVICES.items())
    )
    text = f"{header}\n\n{_table(results)}\n\n{_goal_table(results)}\n\n{_needed_table(results)}\n"
    print(text)
    if args.out:  # markdown, not a result JSON: nothing here was measured
        pathlib.Path(args.out).write_text(text)
    return 0


SHOWN = [(16384, 4096, 151936), (16384, 896, 151936), (65536, 4096, 151936), (2048, 896, 128256)]


def docs_section() -> list[str]:
    """The performance page's section (tools/docs_pages.py): the design and the H200 predictions."""
    rows = [
        "| N | H | V | plan (loss; log-probs) | linear layer fwd+bwd | logprobs fwd | logprobs fwd+bwd | loss fwd+bwd "
        "| tiles fwd+bwd | loss / linear (goal 1.15) | logprobs fwd / linear fwd (goal 1.10) "
        "| logprobs fwd+bwd / linear (goal 1.45) | the same, 2-D plan (H200; H100) "
        "| extra memory / logits' bytes, loss; log-probs (goal 5%) | the same, 2048 rows and float32 d_weight |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, h, v in SHOWN:
        r = model(n, h, v)
        g, old, blocks = goals(r, n, h, v), goals(r, n, h, v, "gemm-2048"), goals(r, n, h, v, "gemm-2d")
        two_d = [blocks[f"logprobs fwd+bwd / linear fwd+bwd ({d})"]["ratio"] for d in ("H200", "H100")]
        ms = lambda *keys: sum(r[k]["ms"]["H200"] for k in keys)  # noqa: E731
        ratio = lambda name: g[f"{name} (H200)"]["ratio"]  # noqa: E731
        mem = lambda gs, call: gs[f"{call} extra memory / logits' bytes"]  # noqa: E731
        rows.append(
            f"| {n} | {h} | {v} | {mem(g, 'loss')['plan']}; {mem(g, 'logprobs')['plan']} "
            f"| {ms('linear linear_fwd', 'linear linear_bwd'):.1f} | {ms('gemm logprobs_fwd'):.1f} "
            f"| {ms('gemm logprobs_fwd', 'gemm logprobs_bwd'):.1f} | {ms('gemm loss_fwd', 'gemm loss_bwd'):.1f} "
            f"| {ms('tiles logprobs_fwd', 'tiles logprobs_bwd'):.1f} "
            f"| {ratio('loss fwd+bwd / linear fwd+bwd'):.2f}x | {ratio('logprobs fwd / linear fwd'):.2f}x "
            f"| {ratio('logprobs fwd+bwd / linear fwd+bwd'):.2f}x | {two_d[0]:.2f}x; {two_d[1]:.2f}x "
            f"| {mem(g, 'loss')['ratio']:.1%}; {mem(g, 'logprobs')['ratio']:.1%} "
            f"| {mem(old, 'loss')['ratio']:.0%} |"
        )
    return _PROSE_TOP + rows + _PROSE_BOTTOM + _epilogue_section()


def _epilogue_section() -> list[str]:
    """The "epilogue" design's forward: the efficiency its Triton products need, per shown shape."""
    lines = [
        'The `"epilogue"` design (`linear_token_logprobs.DESIGN`) runs the forward as one grouped GEMM in Triton',
        "with the row work in its epilogue (no logits written; 3.1% of bf16 logits' bytes of partials) and the",
        "2-D plan's backward.  Its products' efficiency has not been measured; the fraction of the bf16 tensor",
        f"peak they need (cuBLAS's linear layer: {GEMM_EFFICIENCY:.2f}; the tile kernels measured {TILE_EFFICIENCY:.2f};",
        "-: out of reach whatever the products' speed), H100 / H200:",
        "",
        "| N | H | V | forward at 1.10x the linear layer | forward faster than the 2-D plan's | fwd+bwd at 1.45x |",
        "|---|---|---|---|---|---|",
    ]
    for n, h, v in SHOWN:
        needed = needed_efficiency(model(n, h, v), n, h, v)
        cell = lambda name: " / ".join(  # noqa: E731
            "-" if needed[f"{name} ({d})"] is None else f"{needed[f'{name} ({d})']:.2f}" for d in DEVICES
        )
        lines.append(
            f"| {n} | {h} | {v} | {cell('forward 1.10x')} | {cell('2-D plan forward')} | {cell('fwd+bwd 1.45x')} |"
        )
    return [*lines, ""]


_PROSE_TOP = """\
### The GEMM-first head on a GPU: roofline predictions (not measurements)

The Triton backend's fused head is GEMM-first (`ppo_fast/backends/triton/_gemm_head.py`): per chunk of
rows one cuBLAS product writes the chunk's logits in float32, one Triton row kernel reads them once
(max, log-sum-exp, entropy, soft-cap, temperature, truncation, the chosen token); where the gradient
is known, a second row kernel writes `d_logits` over them in the inputs' dtype, and two cuBLAS
products give `d_hidden`'s rows and add into `d_weight`.  `linear_token_logprobs` recomputes each
chunk's logits in its backward (8 N H V FLOPs); `linear_policy_loss` takes its gradients in the
forward (6 N H V, the linear layer's count) and its backward is a scale.  The tile-fused kernels stay
selectable (`linear_token_logprobs.DESIGN = "tiles"`).

The plan (`ppo_fast/backends/_head_plan.py`) keeps a call's extra memory within a budget,
`_head_plan.MEMORY_BUDGET` (5% of the logits' bytes by default): `linear_token_logprobs` in fixed
chunks of 384 rows (a row's results must not depend on its batch) where truncated, otherwise in the
2-D plan (`block_plan`: fixed blocks of 512 rows by fixed vocabulary slices, each row's statistics
folded slice by slice, so `weight` and `d_weight` are read once a block), `linear_policy_loss` in the
largest chunk of 384-2048 rows the budget holds, or, where that chunk's bf16 `d_weight` product is
memory-bound on an H100 (below 460 rows), in pairs of smaller chunks with one `d_weight` product a pair
where they fit and are predicted faster; `d_weight` in a float32 accumulator where the budget
holds it with chunks of 1024 rows or more, otherwise (bf16) in the gradient itself, one bf16 rounding
of the running sum a chunk (bounded against float64 in the tests).

`python -m bench head_model` predicts each design's time per phase from its FLOPs, HBM bytes and
launches (efficiencies from the H200 run: cuBLAS at 70% of the bf16 peak, the tile kernels at 26%,
memory at 90% of HBM bandwidth).  These are predictions; no GPU has run the GEMM-first head yet.
All shapes, both GPUs, every phase and the 2048-row, float32-accumulator plan beside it:
`bench/results/head-model.md`.  H200, bf16, ms:
""".split("\n")
_PROSE_BOTTOM = """\

At 16384 x 4096 x 151936 the budget's plans (the loss's 256 rows paired, the log-probs' 384 rows, bf16
`d_weight`) meet the memory goal (4.9% for both calls, against 51% with 2048 rows and a float32
accumulator) and the log-probs' goals on an H200 (1.09x, 1.41x); the loss (every mode: vanilla, sapo,
cispo, gpg, dppo_tv, dppo_kl, dro, and the sequence-level gspo and geo_mean, padded or packed with
`cu_seqlens` on the host, their per-token terms one fused launch a chunk), in pairs of 256-row chunks,
is predicted at 1.09x (H200) and 1.14x (H100), against 1.09x / 1.20x in 384-row chunks unpaired and
1.09x / 1.13x with the 2048-row plan.
Only float64 inputs compute the terms with the reference's function under autograd, 249 small kernels a
chunk with a KL term (counted on CPU, `_head_plan.TERMS_LAUNCHES`): 1.58x / 1.70x at 43 chunks (float64
never pairs).  Why pairs: a `d_weight` product reads and writes the whole `V x H` gradient (4 bytes a
weight in bf16) for `2 x rows` FLOPs a weight, memory-bound below about 320 (H200) / 460 (H100) rows,
and 384 rows is the largest chunk whose float32 logits fit 5% at 16384 rows; a pair of 256-row chunks
(the first's bf16 `d_logits` held beside the second's float32 logits, 4.9% in all) makes one product of
512 rows, for a copy of those `d_logits` into the second's rows.  On an H200, where 384 rows are
compute-bound already, the pairs are predicted 0.6% slower (1.093x against 1.086x); at H=896 they are
predicted slower on both GPUs (products and row kernels memory-bound at either size), so the plan keeps
384 rows there.  A caller with memory to spare raises the budget: 0.3 buys 2048-row chunks (1.09x /
1.13x), 0.6 a float32 accumulator too.  At H=896 every speed goal is missed by any plan (1.36x the
log-probs forward, 1.3-1.5x the loss): each logit costs 2 x 896 FLOPs but 8 bytes of float32 traffic
forward (written by the product, read by the row kernel) and 12 more backward, so the row kernels'
memory time rivals the products'; only a fused epilogue (the row work inside the GEMM, as Cut
Cross-Entropy and Liger's CuTe kernels do) removes it.

The 2-D plan of `linear_token_logprobs` (512 rows by two slices of 76,032 columns, 3.4% extra memory)
is predicted at 1.43x (H100) / 1.40x (H200) the linear layer forward + backward at 16384 x 4096 x
151936, against 1.53x / 1.41x for 384-row chunks, and 1.11x / 1.08x forward (1.12x / 1.09x): it meets
the H100's 1.45x; the forward's 1.10x stays missed on an H100 by either plan (the row kernel's read of
the float32 logits, 3.3 ms of 33).  Rows that are not a multiple of 512 pay the last block's padding:
at N = 16000 the 2-D plan is predicted 1.47x / 1.44x against 1.53x / 1.41x (forward 1.14x / 1.10x
against 1.12x / 1.09x).  Multiples of 384 (768, 1152, 1536 rows) pad 16384 rows to 16896 and are
predicted slower (1.47-1.51x on an H100).
""".split("\n")
