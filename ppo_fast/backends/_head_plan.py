"""The GEMM-first fused head's plan (``backends/triton/_gemm_head.py``), torch-free: how many rows each
chunk holds and in what dtype ``d_weight`` is accumulated, and the FLOPs, HBM bytes and launches of every
phase of a call, so that the kernels and the roofline model (``python -m bench head_model``) read one
source.

A chunk is a number of rows, never a number of bytes: its logits ``[rows, V]`` (float32, the
products' output) live at once, and every phase's traffic is a fixed cost per chunk plus a cost per
row, so the totals grow linearly in the rows ``N`` (``tests/test_head_plan.py``).

The memory budget (``MEMORY_BUDGET``, a fraction of the call's logits' bytes ``N V itemsize``; the
callers' ``budget`` argument) bounds what a call holds beyond its inputs, outputs and gradients
(``extra_memory``): one chunk of float32 logits, the chunk's padded hidden states and float32
``d_hidden`` rows, and ``d_weight``'s accumulator where it is wider than the gradient.

- ``linear_token_logprobs`` has a fixed ``LOGPROBS_ROWS`` a chunk, every product padded to them: a
  row's results must not depend on its batch, and BLAS picks its algorithm (and a row's summation
  order) by the product's rows, so those rows cannot follow ``N``.  384: the most that keeps 5% at
  16384 rows (``4 * 384 / (2 * 16384)``: 4.7%); the products reading ``weight`` once a chunk stay
  compute-bound (``2 * rows`` FLOPs an element, from about 230 rows on an H100).
- ``linear_token_logprobs`` untruncated takes the 2-D plan (``block_plan``): blocks of ``rows`` rows by
  vocabulary slices of ``cols`` columns, both fixed by ``h``, ``v``, the dtype and the budget (never by
  ``N``), each row's statistics folded slice by slice.  Its backward reads ``weight`` twice and reads and
  writes ``d_weight`` once a block rather than once a 384-row chunk: 512 rows (bf16) make that product
  compute-bound on an H100, where 384 are not; the slices keep a block's float32 logits within the budget
  at ``GOAL_ROWS``.  Costs: the last block's padding (up to ``rows - 1`` rows), ``hidden`` read once a
  slice, 16 bytes a row of running state a slice.  ``bench head_model`` predicts it beside the row plan.
- ``linear_policy_loss`` aggregates over its batch (no row result to keep invariant): its chunk is the
  largest multiple of ``ROW_STEP`` rows in ``[MIN_ROWS, MAX_ROWS]`` that the budget holds.  A chunk's
  ``d_weight`` product reads and writes the whole accumulator; a bf16 one (4 bytes a weight for
  ``2 * rows`` FLOPs) is memory-bound below ``2 * RIDGE_FLOPS_PER_BYTE`` rows (460).  Below that the
  loss pairs its chunks (``HeadPlan.pair``) where the pairs fit the budget and the roofline at the
  ridge predicts them faster: the first chunk's ``d_logits`` kept in a bf16 ``[rows, V]`` buffer, the
  second's written into the first halves of its float32 rows and the first's copied into the second
  halves, so those rows hold the pair's ``[2 rows, V]`` d_logits (rows interleaved) and one product of
  ``2 rows`` adds them to ``d_weight`` (an odd last chunk its own product).  At 16384 x 4096 x 151936:
  256-row chunks paired (4.9%) rather than 384 unpaired.
- ``linear_policy_loss`` in the padded layout chunks by whole sequences, which past ``ROW_STEP`` tokens
  (``token_slices``) would make a chunk's rows (and memory) follow ``T`` instead of the plan: a
  token-level mode's padded call with longer sequences is run as the packed layout of the same tokens,
  whose chunks are token slices of the plan's rows (the sequence-level modes keep whole sequences).
- ``d_weight``'s accumulator: float32 where the budget holds its ``V H (4 - itemsize)`` extra bytes
  beside the chunk, with chunks of at least ``F32_ACC_MIN_ROWS`` (a chunk's ``d_weight`` product reads
  and writes the float32 accumulator, 8 bytes a weight for ``2 * rows`` FLOPs, and is memory-bound
  below about 1000 rows); otherwise, for bf16 inputs, the gradient itself, each chunk's
  float32 product added to it and rounded once (cuBLAS's ``beta = 1``), which adds at most one bf16
  rounding of the running sum a chunk (``tests/backends/test_triton_kernels.py`` bounds it against
  float64).  float16 keeps float32 (its chunks carry a power of two each); float32 and float64 inputs
  accumulate in their own dtype.
"""

from __future__ import annotations

from typing import NamedTuple

CHUNK_ROWS = 2048  # the largest chunk (and the model's former plan: 2048 rows, float32 accumulator)
MEMORY_BUDGET = 0.05  # the default budget: 5% of the logits' bytes (issue 49's goal)
LOGPROBS_ROWS = 384
MIN_ROWS, MAX_ROWS, ROW_STEP = 384, CHUNK_ROWS, 128
F32_ACC_MIN_ROWS = 1024
# Launches a chunk of the one-pass loss's per-token terms and their gradient (counted, not modelled in
# bytes), by the path a call takes: "fused", the Triton kernel of every one-pass mode (vanilla, sapo,
# cispo, gpg, dppo_tv, dppo_kl, dro, and the sequence-level gspo and geo_mean, padded or on packed
# sequences: triton/_policy_terms.py); "generic" (and with a KL term), float64 inputs: the reference's chunk_terms
# under autograd on the chunk's [rows] vectors, its leaf aten kernels counted on CPU (a proxy for its CUDA
# launches; an entropy bonus, k3): vanilla's 87 / 249 (gspo's 94 / 256, geo_mean's 110 / 272).
# tests/test_policy_terms.py counts both.
TERMS_LAUNCHES = {"fused": 1, "generic": 87, "generic, KL": 249}
# ... and once a call: the normalisers from the mask and the totals' results (fused: 6 + 8, counted by the
# same test; on packed sequences 10 + 8, the sequences with a valid token counted through cu_seqlens, and
# on CUDA its copy to the device besides; generic: loss_scales' 5, and the chunks' 7 totals added a chunk).
# The model's calls are padded: "fused, packed" is the packed call's count, charged by no row.
TERMS_CALL_LAUNCHES = {"fused": 14, "fused, packed": 18, "generic": 5, "generic, KL": 5}
# float32 bytes: the logits chunk and the d_weight / d_hidden accumulators.
_F32 = 4


class HeadPlan(NamedTuple):
    """A call's plan: ``rows`` a chunk (every product's rows), ``acc``, the bytes a weight of
    ``d_weight``'s accumulator (4: float32; the inputs' itemsize: the gradient itself), and ``pair``:
    the loss's chunks taken two at a time, one ``d_weight`` product of ``2 rows`` a pair."""

    rows: int
    acc: int
    pair: bool = False


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


def token_slices(length: int) -> bool:
    """Whether the one-pass loss's padded call of sequences of ``length`` tokens (a token-level mode) is
    chunked as the packed layout's token slices: sequences longer than the plan's granularity
    (``ROW_STEP``), whose whole-sequence chunks would hold rows by ``length``, not by the plan."""
    return length > ROW_STEP


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


def _paired_gradient(i: int, count: int, c: int, m: int, h: int, v: int, *, s: int, acc: int) -> list[Phase]:
    """Chunk ``i`` of ``count`` in a paired plan: its row kernel and ``d_hidden`` product; the second of a
    pair also the first's ``d_logits`` (``P``, ``[m, V]``) copied into the second halves of its float32
    rows, the pair's ``2 m`` padded hidden rows interleaved, and one ``d_weight`` product of ``2 m`` rows.
    The last of an odd count adds its own product (from its buffer): an unpaired chunk's phases."""
    own = _gradient_chunk(c, m, h, v, s, acc)
    if i % 2 == 0:
        return own if i == count - 1 else own[:2]
    copy = m * v * 2 * s + 2 * (2 * m * h * s)  # P read and written; each chunk's hidden rows read and written
    return [
        *own[:2],
        Phase("pair: the first's d_logits into the row halves, hidden rows interleaved", 0.0, copy, 3),
        _gradient_chunk(c, 2 * m, h, v, s, acc)[2],
    ]


def _chunk_phases(kind: str, c: int, m: int, h: int, v: int, *, i: int, count: int, s, acc, terms, pair):
    """Chunk ``i`` of ``count`` (``c`` rows, products of ``m``) of a ``phases`` call of ``kind``."""
    fwd = _forward_chunk(c, m, h, v, s, "max, LSE, entropy, chosen token")
    out = fwd if kind != "logprobs_bwd" else fwd[:1]  # the backward recomputes the logits alone
    if kind == "loss_fwd":
        launches = TERMS_LAUNCHES[terms] + 7 * (terms != "fused")
        out = [*out, Phase("per-token loss terms and gradient", 0.0, 0.0, launches)]
    if kind == "loss_fwd" and pair:
        return [*out, *_paired_gradient(i, count, c, m, h, v, s=s, acc=acc)]
    return out if kind == "logprobs_fwd" else [*out, *_gradient_chunk(c, m, h, v, s, acc)]


def _add_phases(out: dict, ps) -> None:
    """Add each phase of ``ps`` into ``out`` by name (a phase of the same name repeated: its sums)."""
    for p in ps:
        q = out.get(p.name)
        out[p.name] = p if q is None else Phase(p.name, q.flops + p.flops, q.bytes + p.bytes, q.launches + p.launches)


def phases(
    kind: str,
    n: int,
    h: int,
    v: int,
    *,
    itemsize: int = 2,
    rows: int = CHUNK_ROWS,
    acc: int = _F32,
    terms: str = "fused",
    pair: bool = False,
) -> list[Phase]:
    """The phases of one call, summed over its chunks.  ``kind``:

    - ``linear_fwd`` / ``linear_bwd``: the plain linear layer (``hidden @ weight.T`` in the inputs'
      dtype, and autograd's two products), the baseline;
    - ``logprobs_fwd`` / ``logprobs_bwd``: ``linear_token_logprobs`` (per-row stats saved, the backward
      recomputes each chunk's logits: 8 N H V FLOPs in all);
    - ``loss_fwd`` / ``loss_bwd``: ``linear_policy_loss`` in one pass (the gradient known in the forward:
      6 N H V FLOPs, the backward a scale of the stored gradients).

    ``acc``: the bytes of d_weight's accumulator a weight (4: float32, what the kernels do; 2: the
    inputs' bf16, rounded once per chunk, a design the model weighs).  ``terms``: the loss's per-token
    path, a key of ``TERMS_LAUNCHES`` ("fused": every mode with inputs of at most 32 bits; "generic" or
    "generic, KL": float64 inputs).  ``pair``: the loss's chunks in pairs (``_paired_gradient``).
    """
    s = itemsize
    chunks = row_chunks(n, rows)
    if kind.startswith("loss"):  # the loss's products have its first chunk's rows
        rows = min(n, rows)
    out: dict[str, Phase] = {}

    def add(ps):
        _add_phases(out, ps)

    if kind == "linear_fwd":
        add([Phase("logits = hidden @ weight.T", 2.0 * n * h * v, n * h * s + v * h * s + n * v * s, 1)])
    elif kind == "linear_bwd":
        add([Phase("d_hidden = d_logits @ weight", 2.0 * n * h * v, n * v * s + v * h * s + n * h * s, 1)])
        add([Phase("d_weight = d_logits.T @ hidden", 2.0 * n * h * v, n * v * s + n * h * s + v * h * s, 1)])
    elif kind in ("logprobs_fwd", "logprobs_bwd", "loss_fwd"):
        if kind != "logprobs_fwd":
            add([Phase("zero d_weight's accumulator", 0.0, v * h * acc, 1)])
        if kind == "loss_fwd":
            add([Phase("per-token terms: normalisers and totals", 0.0, 0.0, TERMS_CALL_LAUNCHES[terms])])
        # chunks of the same rows (paired: at the same place in a pair) add the same phases: once, scaled
        groups: dict[tuple, list[int]] = {}
        for i, (start, stop) in enumerate(chunks):
            key = (stop - start, pair and i % 2, pair and i == len(chunks) - 1)
            groups.setdefault(key, [i, 0])[1] += 1
        for (c, *_), (i, count) in groups.items():
            one = _chunk_phases(kind, c, rows, h, v, i=i, count=len(chunks), s=s, acc=acc, terms=terms, pair=pair)
            add([Phase(p.name, p.flops * count, p.bytes * count, p.launches * count) for p in one])
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
    kind: str,
    n: int,
    h: int,
    v: int,
    *,
    itemsize: int = 2,
    rows: int = CHUNK_ROWS,
    acc: int = _F32,
    pair: bool = False,
) -> float:
    """Bytes a call holds beyond its inputs, outputs and the gradients it returns: one chunk's float32
    logits (d_logits is written into them) and padded hidden states, and with a gradient the chunk's
    float32 ``d_hidden`` rows, ``d_bias``'s float32 accumulator and ``d_weight``'s accumulator less the
    ``itemsize`` gradient it becomes; ``pair`` (the loss): also a pair's first ``d_logits`` ``[m, V]``
    and its ``[2 m, H]`` interleaved hidden rows.  A log-probs chunk is padded to ``rows``; the loss's
    first chunk sets its products' rows (``min(n, rows)``)."""
    if kind.startswith("linear"):
        return 0.0
    wide = max(_F32, itemsize)  # the logits' dtype: float32, float64 for float64 inputs
    m = min(n, rows) if kind.startswith("loss") else rows
    held = m * v * wide + m * h * itemsize
    if kind in ("logprobs_bwd", "loss_fwd"):
        held += m * h * wide + v * wide + v * h * max(0, acc - itemsize)
    if pair and kind == "loss_fwd":
        held += m * v * itemsize + 2 * m * h * itemsize
    return float(held)


def pair_fits(n: int, h: int, v: int, rows: int, *, itemsize: int = 2, budget: float | None = None) -> bool:
    """Whether a paired loss whose products have ``rows`` rows (a padded call's whole sequences may take
    more than its plan's) holds within ``budget`` (``MEMORY_BUDGET`` by default) with a narrow accumulator."""
    budget = MEMORY_BUDGET if budget is None else budget
    held = extra_memory("loss_fwd", n, h, v, itemsize=itemsize, rows=rows, acc=itemsize, pair=True)
    return held <= budget * n * v * itemsize


def plan(
    kind: str,
    n: int,
    h: int,
    v: int,
    *,
    itemsize: int = 2,
    budget: float | None = None,
    narrow: bool = True,
    bounds: tuple[int, int, int, int] | None = None,
    paired: bool = True,
) -> HeadPlan:
    """The plan of a call of ``kind`` (``"logprobs"`` or ``"loss"``) within ``budget`` (a fraction of the
    logits' bytes ``n v itemsize``; ``MEMORY_BUDGET`` by default).  ``narrow``: whether ``d_weight`` may
    be accumulated in the inputs' 16-bit dtype (bf16: yes; float16: no).  ``bounds``: ``(MIN_ROWS,
    MAX_ROWS, ROW_STEP, LOGPROBS_ROWS)``.  Where no plan fits the budget (few rows, or a budget below one
    chunk), the smallest: ``MIN_ROWS`` rows (``LOGPROBS_ROWS`` for log-probs) and the narrowest
    accumulator allowed."""
    if kind not in ("logprobs", "loss"):
        raise ValueError(f"kind must be 'logprobs' or 'loss', got {kind!r}")
    budget = MEMORY_BUDGET if budget is None else budget
    if not (isinstance(budget, (int, float)) and budget >= 0.0 and budget == budget):
        raise ValueError(f"budget must be a fraction of the logits' bytes >= 0, got {budget!r}")
    lo, hi, step, fixed = bounds or (MIN_ROWS, MAX_ROWS, ROW_STEP, LOGPROBS_ROWS)
    limit = budget * n * v * itemsize
    wide = max(_F32, itemsize)
    accs = (wide, itemsize) if narrow and itemsize < wide else (wide,)
    phase = "logprobs_bwd" if kind == "logprobs" else "loss_fwd"

    def fits(rows: int, acc: int) -> bool:
        return extra_memory(phase, n, h, v, itemsize=itemsize, rows=rows, acc=acc) <= limit

    # log-probs: fixed rows, a row's results must not depend on its batch
    candidates = [fixed] if kind == "logprobs" else sorted({lo, hi, *range(-(-lo // step) * step, hi + 1, step)})[::-1]
    chosen = HeadPlan(fixed if kind == "logprobs" else lo, accs[-1])
    for acc in accs:
        floor = min(F32_ACC_MIN_ROWS, hi) if acc > itemsize and len(accs) > 1 else 0
        rows = next((r for r in candidates if r >= floor and fits(r, acc)), None)
        if rows is not None:
            chosen = HeadPlan(rows, acc)
            break
    if kind == "logprobs" or not paired or chosen.acc != itemsize or itemsize == wide:
        return chosen
    return _paired(chosen, n, h, v, itemsize=itemsize, budget=budget, rows=range(hi // step * step, 0, -step))


def _paired(chosen: HeadPlan, n: int, h: int, v: int, *, itemsize: int, budget: float, rows: range) -> HeadPlan:
    """``chosen`` (the loss's unpaired plan, a narrow accumulator) or, where its ``d_weight`` product is
    below the ridge (``itemsize * RIDGE_FLOPS_PER_BYTE`` rows), a paired plan: the largest of ``rows``
    (at least half the ridge's rows) whose pairs fit ``budget``, taken only where its phases are
    faster on the ridge's roofline than ``chosen``'s (at H = 896 the products and row kernels are
    memory-bound at either size, and the pair's copy and smaller chunks cost more)."""
    ridge = itemsize * RIDGE_FLOPS_PER_BYTE
    if chosen.rows >= ridge:
        return chosen
    fit = (r for r in rows if 2 * r >= ridge and pair_fits(n, h, v, r, itemsize=itemsize, budget=budget))
    found = next(fit, None)
    if found is None:
        return chosen
    pair = HeadPlan(found, chosen.acc, True)
    cost = {p: _roofline(phases("loss_fwd", n, h, v, itemsize=itemsize, **p._asdict())) for p in (chosen, pair)}
    return pair if cost[pair] < cost[chosen] else chosen


def _roofline(ps: list[Phase]) -> float:
    """The phases' time in FLOPs at the ridge: ``max(FLOPs, bytes * RIDGE_FLOPS_PER_BYTE)`` summed."""
    return sum(max(p.flops, p.bytes * RIDGE_FLOPS_PER_BYTE) for p in ps)


class BlockPlan(NamedTuple):
    """A 2-D plan of ``linear_token_logprobs``: blocks of ``rows`` rows (every product padded to them)
    times vocabulary slices of ``cols`` columns (the last one narrower), ``acc`` as ``HeadPlan``'s."""

    rows: int
    cols: int
    acc: int


def col_slices(v: int, cols: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``cols`` vocabulary columns a slice, the last one narrower."""
    return row_chunks(v, cols)


def _block_forward(c: int, m: int, h: int, w: int, s: int, first: bool) -> list[Phase]:
    """One slice of a block: its ``[m, w]`` float32 logits by one product, then the stats kernel folding
    them into the rows' running (max, sum of exp, entropy term, chosen logit), 16 bytes a row read (but
    by the first slice) and written (the last slice writes the rows' results instead: as many bytes)."""
    product = m * h * s + w * h * s + m * w * _F32
    return [
        Phase("logits[block, slice] = hidden @ weight[slice].T (cuBLAS, fp32 out)", 2.0 * m * h * w, product, 1),
        Phase("row kernel: fold the slice into the running stats", 0.0, c * w * _F32 + w * s + (2 - first) * c * 16, 1),
    ]


def _block_gradient(c: int, m: int, h: int, w: int, s: int, *, acc: int, first: bool) -> list[Phase]:
    """One slice of a block's backward: d_logits in place, ``d_hidden[block]`` summed over the slices in a
    float32 ``[m, h]`` accumulator (written by the first, read and written by the others) and
    ``d_weight[slice]``'s accumulator read and written."""
    d_hidden = m * w * s + w * h * s + m * h * _F32 * (2 - first)
    d_weight = m * w * s + m * h * s + 2 * w * h * acc
    return [
        Phase("row kernel: d_logits in place", 0.0, c * w * (_F32 + s) + (m - c) * w * s, 1 + (m > c)),
        Phase("d_hidden[block] += d_logits @ weight[slice] (fp32)", 2.0 * m * h * w, d_hidden, 1),
        Phase("d_weight[slice] += d_logits.T @ hidden[block] (accumulator)", 2.0 * m * h * w, d_weight, 1),
    ]


def block_phases(kind: str, n: int, h: int, v: int, *, itemsize: int = 2, rows: int, cols: int, acc: int = _F32):
    """The phases of ``linear_token_logprobs`` (``kind``: ``logprobs_fwd`` or ``logprobs_bwd``) in the 2-D
    plan, summed over its blocks and slices (as ``phases``)."""
    if kind not in ("logprobs_fwd", "logprobs_bwd"):
        raise ValueError(f"kind must be logprobs_fwd or logprobs_bwd, got {kind!r}")
    s, out = itemsize, {}

    def add(ps):
        _add_phases(out, ps)

    if kind == "logprobs_bwd":
        add([Phase("zero d_weight's accumulator", 0.0, v * h * acc, 1)])
    for start, stop in row_chunks(n, rows):
        c = stop - start
        for j, (v0, v1) in enumerate(col_slices(v, cols)):
            fwd = _block_forward(c, rows, h, v1 - v0, s, j == 0)
            add(fwd if kind == "logprobs_fwd" else fwd[:1])
            if kind == "logprobs_bwd":
                add(_block_gradient(c, rows, h, v1 - v0, s, acc=acc, first=j == 0))
        if kind == "logprobs_bwd":
            add([Phase("d_hidden[block] rounded to the inputs' dtype", 0.0, c * h * (_F32 + s), 1)])
    if kind == "logprobs_bwd" and acc != s:
        add([Phase("d_weight to the inputs' dtype", 0.0, v * h * (acc + s), 1)])
    return list(out.values())


def block_extra_memory(kind: str, h: int, v: int, *, itemsize: int = 2, rows: int, cols: int, acc: int = _F32):
    """Bytes the 2-D plan holds beyond inputs, outputs and gradients: one block's ``[rows, cols]`` logits,
    its padded hidden rows and running stats, and in the backward its float32 ``d_hidden`` rows, ``d_bias``'s
    and ``d_weight``'s accumulators (as ``extra_memory``)."""
    wide = max(_F32, itemsize)
    held = rows * min(cols, v) * wide + rows * h * itemsize + rows * 4 * wide
    if kind == "logprobs_bwd":
        held += rows * h * wide + v * wide + v * h * max(0, acc - itemsize)
    return float(held)


# The 2-D plan's rows: the fewest (a multiple of ROW_STEP) at which a block's d_weight product, reading and
# writing its accumulator (2 acc bytes a weight for 2 rows FLOPs), is compute-bound on an H100 (989 TFLOP/s
# at 70%, 3.35 TB/s at 90%: 230 FLOPs a byte; the H200's 160), so that no larger block pads more rows.
RIDGE_FLOPS_PER_BYTE = 230.0
GOAL_ROWS = 16384  # the rows at which the budget sizes a block (never the call's N: batch invariance)


def block_plan(h: int, v: int, *, itemsize: int = 2, budget: float | None = None, narrow: bool = True) -> BlockPlan:
    """The 2-D plan of ``linear_token_logprobs``, a function of ``h``, ``v``, the dtype and the budget only:
    ``rows`` the fewest multiple of ``ROW_STEP`` (at least ``LOGPROBS_ROWS``) whose ``d_weight`` product is
    compute-bound, ``cols`` the widest even split of the vocabulary (a multiple of 128) whose block fits
    ``budget`` of ``GOAL_ROWS`` rows' logits, or what the row plan holds there where that is more."""
    budget = MEMORY_BUDGET if budget is None else budget
    if not (isinstance(budget, (int, float)) and budget >= 0.0 and budget == budget):
        raise ValueError(f"budget must be a fraction of the logits' bytes >= 0, got {budget!r}")
    wide = max(_F32, itemsize)
    acc = itemsize if narrow and itemsize < wide else wide
    rows = max(LOGPROBS_ROWS, -(-int(acc * RIDGE_FLOPS_PER_BYTE) // ROW_STEP) * ROW_STEP)
    # never less than today's row plan holds (a float32 accumulator alone may exceed the budget)
    today = extra_memory("logprobs_bwd", GOAL_ROWS, h, v, itemsize=itemsize, rows=LOGPROBS_ROWS, acc=acc)
    limit = max(budget * GOAL_ROWS * v * itemsize, today)
    for k in range(1, -(-v // 128) + 1):
        per = -(-v // k)  # ceil(v / k), then up to a multiple of 128
        cols = -(-per // 128) * 128
        if block_extra_memory("logprobs_bwd", h, v, itemsize=itemsize, rows=rows, cols=cols, acc=acc) <= limit:
            return BlockPlan(rows, cols, acc)
    return BlockPlan(rows, 128, acc)  # pragma: no cover - 128 columns always fit the row plan's bytes


# The "epilogue" design's forward (triton/linear_token_logprobs.py, DESIGN = "epilogue"): the tile kernel as
# one grouped GEMM, a program EPILOGUE_ROWS rows by EPILOGUE_COLUMNS vocabulary columns, EPILOGUE_GROUP row
# blocks sweeping the vocabulary together; its backward the 2-D plan's.
EPILOGUE_ROWS, EPILOGUE_COLUMNS, EPILOGUE_GROUP = 128, 256, 8
_PARTIAL = 16  # bytes a row a share: running max, sum of exp, entropy term, chosen logit (float32)


def epilogue_phases(kind: str, n: int, h: int, v: int, *, itemsize: int = 2) -> list[Phase]:
    """The "epilogue" design's phases of ``linear_token_logprobs`` (``logprobs_fwd`` or ``logprobs_bwd``):
    forward, the products with the row work in their epilogue (``hidden`` read once, ``weight`` once a group
    of row blocks, no logits written; each share's partials) and one kernel combining the shares (which
    reads the partials twice: their max, then their sums); backward, the 2-D plan's."""
    if kind == "logprobs_bwd":
        return block_phases(kind, n, h, v, itemsize=itemsize, **block_plan(h, v, itemsize=itemsize)._asdict())
    if kind != "logprobs_fwd":
        raise ValueError(f"kind must be logprobs_fwd or logprobs_bwd, got {kind!r}")
    partial = n * -(-v // EPILOGUE_COLUMNS) * _PARTIAL
    groups = -(-n // (EPILOGUE_ROWS * EPILOGUE_GROUP))
    products = n * h * itemsize + groups * v * h * itemsize + partial
    return [
        Phase("tile kernel: grouped products, the row work in their epilogue", 2.0 * n * h * v, products, 1),
        Phase("combine kernel: the shares' partials into the rows' results", 0.0, 2 * partial + n * 16, 1),
    ]


def epilogue_extra_memory(n: int, v: int) -> float:
    """Bytes the "epilogue" forward holds beyond inputs and outputs: its shares' partials (``N x V / 16``
    bytes at 256 columns a share: 3.1% of bf16 logits' bytes, 1.6% of float32's)."""
    return float(n * -(-v // EPILOGUE_COLUMNS) * _PARTIAL)
