"""The GEMM-first fused head's plan (``backends/triton/_gemm_head.py``), torch-free: which rows each
chunk holds, and the FLOPs, HBM bytes and launches of every phase of a call, so that the kernels and
the roofline model (``python -m bench head_model``) read one source.

A chunk is a number of rows, never a number of bytes: its logits ``[rows, V]`` (float32, the
products' output) live at once, and every phase's traffic is a fixed cost per chunk plus a cost per
row, so the totals grow linearly in the rows ``N`` (``tests/test_head_plan.py``).  Every product has
the full ``rows`` (the last chunk padded with zero rows): one algorithm for every chunk, so a row's
results do not depend on its batch; a call of fewer rows pays one chunk's products.  Why 2048 rows: the
``d_weight`` product of a chunk reads and writes its float32 accumulator ``[V, H]`` once (8 bytes a
weight) for ``2 * rows`` FLOPs a weight, so it stays compute-bound on an H100 (989 TFLOP/s over
3.35 TB/s: 295 FLOP/byte) from about 1200 rows; the forward product reads ``weight`` once per chunk for
``2 * rows`` FLOPs an element (bound from about 300 rows).
"""

from __future__ import annotations

from typing import NamedTuple

CHUNK_ROWS = 2048
# Small vector launches of the one-pass loss's per-token terms and their gradient, per chunk
# (the mode's reference function on [rows] vectors, under autograd): counted, not modelled in bytes.
PER_TOKEN_LAUNCHES = 40
# float32 bytes: the logits chunk and the d_weight / d_hidden accumulators.
_F32 = 4


class Phase(NamedTuple):
    """One phase of a call: its matrix-product FLOPs, HBM bytes (reads + writes) and kernel launches."""

    name: str
    flops: float
    bytes: float
    launches: int


def row_chunks(n_rows: int, rows: int = CHUNK_ROWS) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``rows`` rows a chunk, the last one shorter."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return [(start, min(n_rows, start + rows)) for start in range(0, n_rows, rows)]


def sequence_chunks(batch: int, length: int, rows: int = CHUNK_ROWS) -> list[tuple[int, int]]:
    """``[(b0, b1), ...]``: whole sequences of ``length`` tokens a chunk, as many as fit ``rows`` rows
    (at least one: a chunk of one sequence longer than ``rows``)."""
    return row_chunks(batch, max(1, rows // max(1, length)))


def _forward_chunk(c: int, m: int, h: int, v: int, s: int, what: str) -> list[Phase]:
    """The logits of ``c`` rows by one product of ``m`` rows (float32 out), then one row kernel on ``c``."""
    product = m * h * s + v * h * s + m * v * _F32
    return [
        Phase("logits = hidden @ weight.T (cuBLAS, fp32 out)", 2.0 * m * h * v, product, 1),
        Phase(f"row kernel: {what}", 0.0, c * v * _F32 + v * s, 1),
    ]


def _gradient_chunk(c: int, m: int, h: int, v: int, s: int, acc: int = _F32) -> list[Phase]:
    """The row kernel writing d_logits (``s`` bytes, in place) from the chunk's float32 logits (and zeros
    in the ``m - c`` padding rows), and the two products of ``m`` rows: d_hidden's rows (written once)
    and d_weight's accumulator of ``acc`` bytes a weight (read + written)."""
    d_hidden = m * v * s + v * h * s + m * h * (_F32 + s)
    d_weight = m * v * s + m * h * s + 2 * v * h * acc
    return [
        Phase("row kernel: d_logits in place", 0.0, c * v * (_F32 + s) + (m - c) * v * s, 1 + (m > c)),
        Phase("d_hidden[rows] = d_logits @ weight", 2.0 * m * h * v, d_hidden, 2),
        Phase("d_weight += d_logits.T @ hidden (accumulator)", 2.0 * m * h * v, d_weight, 1),
    ]


def phases(
    kind: str, n: int, h: int, v: int, *, itemsize: int = 2, rows: int = CHUNK_ROWS, acc: int = _F32
) -> list[Phase]:
    """The phases of one call, summed over its chunks.  ``kind``:

    - ``linear_fwd`` / ``linear_bwd``: the plain linear layer (``hidden @ weight.T`` in the inputs'
      dtype, and autograd's two products), the baseline;
    - ``logprobs_fwd`` / ``logprobs_bwd``: ``linear_token_logprobs`` (per-row stats saved, the backward
      recomputes each chunk's logits: 8 N H V FLOPs in all);
    - ``loss_fwd`` / ``loss_bwd``: ``linear_policy_loss`` in one pass (the gradient known in the forward:
      6 N H V FLOPs, the backward a scale of the stored gradients).

    ``acc``: the bytes of d_weight's accumulator a weight (4: float32, what the kernels do; 2: the
    inputs' bf16, rounded once per chunk, a design the model weighs).
    """
    s = itemsize
    plan = row_chunks(n, rows)
    out: dict[str, Phase] = {}

    def add(ps):
        for p in ps:
            q = out.get(p.name)
            out[p.name] = (
                p if q is None else Phase(p.name, q.flops + p.flops, q.bytes + p.bytes, q.launches + p.launches)
            )

    if kind == "linear_fwd":
        add([Phase("logits = hidden @ weight.T", 2.0 * n * h * v, n * h * s + v * h * s + n * v * s, 1)])
    elif kind == "linear_bwd":
        add([Phase("d_hidden = d_logits @ weight", 2.0 * n * h * v, n * v * s + v * h * s + n * h * s, 1)])
        add([Phase("d_weight = d_logits.T @ hidden", 2.0 * n * h * v, n * v * s + n * h * s + v * h * s, 1)])
    elif kind in ("logprobs_fwd", "logprobs_bwd", "loss_fwd"):
        if kind != "logprobs_fwd":
            add([Phase("zero d_weight's accumulator", 0.0, v * h * acc, 1)])
        for start, stop in plan:
            c = stop - start
            fwd = _forward_chunk(c, rows, h, v, s, "max, LSE, entropy, chosen token")
            add(fwd if kind != "logprobs_bwd" else fwd[:1])  # the backward recomputes the logits alone
            if kind == "loss_fwd":
                add([Phase("per-token loss terms and gradient", 0.0, 0.0, PER_TOKEN_LAUNCHES)])
            if kind != "logprobs_fwd":
                add(_gradient_chunk(c, rows, h, v, s, acc))
        if kind != "logprobs_fwd":
            if acc != s:
                add([Phase("d_weight to the inputs' dtype", 0.0, v * h * (acc + s), 1)])
    elif kind == "loss_bwd":
        add([Phase("scale the stored gradients", 0.0, 2.0 * (n * h + v * h) * s, 2)])
    else:
        raise ValueError(
            f"kind must be one of linear_fwd, linear_bwd, logprobs_fwd, logprobs_bwd, loss_fwd, loss_bwd; got {kind!r}"
        )
    return list(out.values())


def extra_memory(
    kind: str, n: int, h: int, v: int, *, itemsize: int = 2, rows: int = CHUNK_ROWS, acc: int = _F32
) -> float:
    """Bytes a call holds beyond its inputs, outputs and the gradients it returns: the float32 logits of
    one chunk (d_logits is written into them), and with a gradient d_weight's float32 accumulator less
    the ``itemsize`` gradient it becomes."""
    chunk = min(n, rows) * v * _F32
    if kind in ("logprobs_fwd", "linear_fwd", "linear_bwd"):
        return 0.0 if kind.startswith("linear") else float(chunk)
    return float(chunk + v * h * (acc - itemsize))
