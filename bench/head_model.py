"""``python -m bench head_model``: the fused LM head's roofline model, on paper (no GPU, no torch).

For each shape, the FLOPs, HBM bytes and launches of every phase of three designs, and the time an
H100 and an H200 would take, predicted as ``max(FLOPs / (peak * GEMM_EFFICIENCY), bytes / (bandwidth *
MEMORY_EFFICIENCY), launches * LAUNCH_S)`` per phase, summed:

- ``linear``: the plain linear layer ``hidden @ weight.T`` (bf16 logits) and autograd's two products;
- ``gemm``: the GEMM-first head (``ppo_fast/backends/_head_plan.py``, the same phases the kernels run:
  ``linear_token_logprobs`` with 8 N H V FLOPs, ``linear_policy_loss`` in one pass with 6 N H V);
- ``gemm-lowmem``: the same with ``LOW_MEMORY``'s plan (512-row chunks, ``d_weight`` accumulated in bf16),
  a design weighed here, not the kernels';
- ``tiles``: the tile-fused Triton kernels, whose every vocabulary tile re-reads its rows' hidden
  states from HBM, and whose backward re-reads and re-writes the float32 ``d_hidden`` once per
  vocabulary chunk of a fixed 64 MiB scratch (so that term grows as N^2).

These are predictions, not measurements.  The efficiencies are this project's one GPU run's
(``bench/results/gpu-h200-2026-12-04/``: cuBLAS's linear layer at 16384 x 4096 x 151936 bf16 ran at
696 TFLOP/s, 70% of the dense bf16 peak; token_logprobs at about copy bandwidth).
"""

from __future__ import annotations

import argparse
import math
import pathlib

from ppo_fast.backends._head_plan import CHUNK_ROWS, Phase, extra_memory, phases

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


# A design the model weighs, not the kernels' (they accumulate d_weight in float32, 2048 rows a chunk):
# d_weight accumulated in the inputs' bf16 (rounded once per chunk, as Liger does) and 512-row chunks.
LOW_MEMORY = {"rows": 512, "acc": 2}


def _design_phases(design: str, kind: str, n: int, h: int, v: int) -> list[Phase]:
    if design == "tiles":
        return tile_phases(f"tiles_{kind.split('_')[1]}", n, h, v)
    if design == "gemm-lowmem":
        return phases(kind, n, h, v, **LOW_MEMORY)
    return phases(kind, n, h, v, rows=CHUNK_ROWS)


def model(n: int, h: int, v: int) -> dict:
    """One shape's rows: per design and pass, FLOPs, bytes, launches and the predicted ms per device."""
    rows = {}
    kinds = {
        "linear": ("linear_fwd", "linear_bwd"),
        "gemm": ("logprobs_fwd", "logprobs_bwd", "loss_fwd", "loss_bwd"),
        "gemm-lowmem": ("logprobs_fwd", "logprobs_bwd", "loss_fwd", "loss_bwd"),
        "tiles": ("logprobs_fwd", "logprobs_bwd"),
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
    """The issue's goals for ``design`` (``gemm`` or ``gemm-lowmem``) against the linear layer."""
    out = {}
    for name, (num, den, bound) in GOALS.items():
        for d in DEVICES:
            ratio = sum(rows[f"{design} {k}"]["ms"][d] for k in num) / sum(rows[f"linear {k}"]["ms"][d] for k in den)
            out[f"{name} ({d})"] = {"ratio": ratio, "bound": bound, "met": ratio <= bound}
    plan = LOW_MEMORY if design == "gemm-lowmem" else {"rows": CHUNK_ROWS}
    memory = extra_memory("loss_fwd", n, h, v, **plan) / (n * v * 2)
    out["extra memory / logits' bytes"] = {"ratio": memory, "bound": 0.05, "met": memory <= 0.05}
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
                lines.append(
                    f"| {r['n']} | {r['h']} | {r['v']} | {design} | {name} | {g['ratio']:.3f} | {g['bound']} | {met} |"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench head_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file (a .md path)")
    args = parser.parse_args(argv)
    results = []
    for n, h, v in SHAPES:
        rows = model(n, h, v)
        both = {d: goals(rows, n, h, v, d) for d in ("gemm", "gemm-lowmem")}
        results.append({"n": n, "h": h, "v": v, "rows": rows, "goals": both})
    header = (
        f"Predictions (roofline model, not measurements): bf16, chunks of {CHUNK_ROWS} rows, GEMM efficiency "
        f"{GEMM_EFFICIENCY} (tiles {TILE_EFFICIENCY}), memory efficiency {MEMORY_EFFICIENCY}, {LAUNCH_S * 1e6:.0f} us a launch; "
        + ", ".join(f"{d}: {f / 1e12:.0f} TFLOP/s, {b / 1e12:.2f} TB/s" for d, (f, b) in DEVICES.items())
    )
    text = f"{header}\n\n{_table(results)}\n\n{_goal_table(results)}\n"
    print(text)
    if args.out:  # markdown, not a result JSON: nothing here was measured
        pathlib.Path(args.out).write_text(text)
    return 0


SHOWN = [(16384, 4096, 151936), (16384, 896, 151936), (65536, 4096, 151936), (2048, 896, 128256)]


def docs_section() -> list[str]:
    """The performance page's section (tools/docs_pages.py): the design and the H200 predictions."""
    mem = "extra memory / logits' bytes"
    rows = [
        "| N | H | V | linear layer fwd+bwd | logprobs fwd | logprobs fwd+bwd | loss fwd+bwd | tiles fwd+bwd "
        "| loss / linear (goal 1.15) | logprobs fwd / linear fwd (goal 1.10) | logprobs fwd+bwd / linear (goal 1.45) "
        "| extra memory / logits' bytes (goal 5%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, h, v in SHOWN:
        r = model(n, h, v)
        g = goals(r, n, h, v)
        ms = lambda *keys: sum(r[k]["ms"]["H200"] for k in keys)  # noqa: E731
        ratio = lambda name: g[f"{name} (H200)"]["ratio"]  # noqa: E731
        rows.append(
            f"| {n} | {h} | {v} | {ms('linear linear_fwd', 'linear linear_bwd'):.1f} | {ms('gemm logprobs_fwd'):.1f} "
            f"| {ms('gemm logprobs_fwd', 'gemm logprobs_bwd'):.1f} | {ms('gemm loss_fwd', 'gemm loss_bwd'):.1f} "
            f"| {ms('tiles logprobs_fwd', 'tiles logprobs_bwd'):.1f} "
            f"| {ratio('loss fwd+bwd / linear fwd+bwd'):.2f}x | {ratio('logprobs fwd / linear fwd'):.2f}x "
            f"| {ratio('logprobs fwd+bwd / linear fwd+bwd'):.2f}x | {g[mem]['ratio']:.0%} |"
        )
    return _PROSE_TOP + rows + _PROSE_BOTTOM


_PROSE_TOP = """\
### The GEMM-first head on a GPU: roofline predictions (not measurements)

The Triton backend's fused head is GEMM-first (`ppo_fast/backends/triton/_gemm_head.py`): per chunk of
2048 rows (`ppo_fast/backends/_head_plan.py`) one cuBLAS product writes the chunk's logits in float32,
one Triton row kernel reads them once (max, log-sum-exp, entropy, soft-cap, temperature, truncation,
the chosen token); where the gradient is known, a second row kernel writes `d_logits` over them in
the inputs' dtype, and two cuBLAS products give `d_hidden`'s rows and add into `d_weight`'s float32
accumulator.  `linear_token_logprobs` recomputes each chunk's logits in its backward (8 N H V FLOPs);
`linear_policy_loss` takes its gradients in the forward (6 N H V, the linear layer's count) and its
backward is a scale.  The tile-fused kernels stay selectable (`linear_token_logprobs.DESIGN = "tiles"`).

`python -m bench head_model` predicts each design's time per phase from its FLOPs, HBM bytes and
launches (efficiencies from the H200 run: cuBLAS at 70% of the bf16 peak, the tile kernels at 26%,
memory at 90% of HBM bandwidth).  These are predictions; no GPU has run the GEMM-first head yet.
All shapes, both GPUs and every phase: `bench/results/head-model.md`.  H200, bf16, ms:
""".split("\n")
_PROSE_BOTTOM = """\

Where the goals are met by the prediction: at H=4096 the loss (1.09-1.10x on an H200, 1.12-1.14x on an
H100) and log-probs fwd+bwd (1.40-1.41x; 1.43-1.45x on an H100), the log-probs forward on an H200
(1.08x; 1.11x on an H100).  Missed: every ratio at H=896, where the float32 logits' traffic (8 bytes a
logit forward, 12 more backward) rivals the products' time; the memory goal everywhere: one chunk of
float32 logits (1.2 GB at V=151936) plus `d_weight`'s float32 accumulator (`V x H x 4` bytes, half of
it beyond the bf16 gradient) against 5% of the bf16 logits.  The model also weighs a plan the kernels
do not run (`LOW_MEMORY` in `bench/head_model.py`): 512-row chunks and `d_weight` accumulated in bf16,
rounded once per chunk.  At 16384 x 4096 x 151936 it predicts 6.2% extra memory, the loss at 1.13x
(H200) / 1.17x (H100), log-probs fwd+bwd at 1.40x / 1.43x.
""".split("\n")
