"""The GEMM-first fused LM head: every matrix product on cuBLAS (``torch.mm`` / ``addmm``; BLAS on the
CPU), the row-local work in one Triton kernel per chunk of rows, in place on the chunk's logits.

Per chunk of ``rows`` rows (``backends._head_plan.plan``: a number of rows, never of bytes, chosen with
``d_weight``'s accumulator from a memory budget, ``_head_plan.MEMORY_BUDGET`` of the logits' bytes by
default):

- ``x = hidden[rows] @ weight.T`` in float32 (float64 for float64 inputs): cuBLAS's ``out_dtype``
  on CUDA, so the bf16/fp16 products are summed and kept in float32, as the reference's logits;
- ``_head_stats_kernel`` (one program a row) reads ``x`` once: the bias, the soft-cap, the
  temperature, the truncation threshold, an online max / log-sum-exp, the entropy and the chosen
  token, into ``logp``, ``entropy`` and ``stats [rows, 2]`` (the row's max ``u`` and log-sum);
- where the gradient of the row outputs is known (the one-pass loss in its forward, or the
  backward, which first recomputes ``x``), ``_head_grad_kernel`` reads ``x`` again and writes
  ``d_logits`` (the gradient w.r.t. the raw logits, times ``scale / T`` and a power of two, see
  below) over it, in the products' dtype: for 16-bit inputs into the first half of each float32
  row (row stride ``2 V``), so no second buffer exists (but a pair's first chunk's, below);
- ``d_hidden[rows] = d_logits @ weight`` and ``d_weight += d_logits.T @ hidden[rows]`` (cuBLAS, both
  summed in float32: ``d_weight`` over the chunks either in a float32 accumulator ``[V, H]`` rounded to
  the inputs' dtype once at the end, or, for bf16 where the budget does not hold that accumulator, in
  the bf16 gradient itself, each chunk's float32 product added to it and rounded once: one bf16
  rounding of the running sum a chunk, bounded against float64 in the tests); where the loss's plan
  pairs its chunks (``HeadPlan.pair``, bf16), one ``d_weight`` product of two chunks' rows
  (``Gradients``).

float16's ``d_logits``: an unscaled token-mean gradient (1e-7 a token) times ``p`` falls below
float16's normal range, where it keeps few bits.  The kernel multiplies each chunk's ``d_logits`` by
``2**k``, the power of two that brings the chunk's largest ``|incoming gradient| * scale / T`` to
``[1, 2)`` (a device scalar: no host sync), and the products' float32 results are divided by it.
bf16 has float32's range and needs none; float32/float64 are written as they are.

``linear_token_logprobs`` untruncated takes the 2-D plan (``_head_plan.block_plan``): blocks of a fixed
number of rows by vocabulary slices of a fixed width; per slice the product above on the block's
padded rows and ``weight[slice]``, and the stats kernel folding the slice into each row's running
(max, sum of exp, entropy term, chosen logit) in ``state [rows, 4]``, the last slice writing the
results; the backward per slice: the logits recomputed, ``d_logits``, ``d_weight[slice]`` and
``d_bias[slice]`` added to, the block's ``d_hidden`` summed in float32 and rounded once.  Truncated
calls keep the row plan: their thresholds need each row whole.

Rows whose label is ignored or out of range read nothing in the kernels, give no gradient and
their hidden state reaches no product (zeroed first), as in the tile design.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._sampling import Truncation
from .. import _head_plan
from .._head_plan import CHUNK_ROWS, BlockPlan, HeadPlan, col_slices, row_chunks  # noqa: F401  (CHUNK_ROWS: bench.static's chunk)
from ._dtypes import cast_for_store, scalar, split_scalar
from ._truncation import thresholds

# Vocabulary tile of the row kernels (a row is streamed through registers in tiles of this size).
ROW_BLOCK_V = 1024
# Rows of d_weight widened to float32 at once when the CPU adds a chunk into a 16-bit d_weight.
_CPU_SLAB = 4096
# linear_token_logprobs' plan where untruncated: the 2-D plan (True) or the row plan (False, as truncated
# calls), and the 2-D plan's (rows, cols) where set rather than _head_plan.block_plan's (tests make it small).
TWO_D = True
BLOCK: tuple[int, int] | None = None


@triton.jit
def _tanh(x):
    """tanh to a few ulps of its own value (no libdevice under the interpreter): in float32, below
    |x| = 0.55 its odd Taylor series to x^15 (truncation under half an ulp; ``(1 - e) / (1 + e)``
    would cancel there, its error a few ulps of 1 rather than of tanh x), beyond it (and in
    float64) through exp; exact at +-inf, NaN stays NaN."""
    x2 = x * x
    p = x2 * (-929569.0 / 638512875.0) + 21844.0 / 6081075.0  # Horner, from the x^15 term down
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    series = x + x * x2 * p
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    if x.dtype == tl.float64:  # the series is float32's; float64's cancellation stays below the tests' floor
        return t
    return tl.where(tl.abs(x) < 0.55, series, t)


@triton.jit
def _row_label(labels_ptr, row, labels_stride, vocab, ignore_index):
    """The row's label (int64), whether it is not ignored, and whether it is a row to compute."""
    label = tl.load(labels_ptr + row * labels_stride).to(tl.int64)
    valid = label != ignore_index
    return label, valid, valid & (label >= 0) & (label < vocab)


@triton.jit
def _u_tile(x_ptr, bias_ptr, cols, load_ok, pre, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, ACC: tl.constexpr):
    """A tile of ``u``: the raw logits plus the bias, through the soft-cap's tanh (``z = u * post``)."""
    x = tl.load(x_ptr + cols, mask=load_ok, other=0.0).to(ACC)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=load_ok, other=0.0).to(ACC)
    if TANH:
        x = _tanh(x * pre)
    return x


@triton.jit
def _head_stats_kernel(
    x_ptr,
    x_stride,
    bias_ptr,
    labels_ptr,
    labels_stride,
    tau_ptr,
    logp_ptr,
    entropy_ptr,
    stats_ptr,
    state_ptr,
    vocab,
    col0,
    width,
    ignore_index,
    pre,
    pre_lo,
    post,
    post_lo,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    TRUNCATED: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row of the chunk: its log-prob, entropy and ``(max u, log sum exp(z - max z))``; every
    ``z - max z`` is ``(u - max u) * post``, as in the tile design.  ``x`` holds the row's columns
    ``[col0, col0 + width)`` (the bias pointer their first); the 2-D plan calls it once a vocabulary
    slice, in order: but for the ``FIRST`` slice it resumes the row's running (max, sum of exp, entropy
    term, chosen logit) from ``state [rows, 4]``, and but for the ``LAST`` it stores them there and
    writes no result (the same online merge as the loop over tiles: the order is fixed)."""
    row = tl.program_id(0).to(tl.int64)
    label, valid, row_ok = _row_label(labels_ptr, row, labels_stride, vocab, ignore_index)
    pre_s = scalar(pre, pre_lo, ACC)
    post_s = scalar(post, post_lo, ACC)
    tau = tl.full([], float("-inf"), ACC)
    if TRUNCATED:
        tau = tl.load(tau_ptr + row).to(ACC)
    run_max = tl.full([], float("-inf"), ACC)
    sum_exp = tl.zeros([], ACC)
    weighted = tl.zeros([], ACC)
    chosen = tl.zeros([], ACC)
    if not FIRST:
        run_max = tl.load(state_ptr + 4 * row).to(ACC)
        sum_exp = tl.load(state_ptr + (4 * row + 1)).to(ACC)
        weighted = tl.load(state_ptr + (4 * row + 2)).to(ACC)
        chosen = tl.load(state_ptr + (4 * row + 3)).to(ACC)
    cols0 = tl.arange(0, BLOCK_V).to(tl.int64)
    stop = tl.where(row_ok, width, 0)  # a row not to compute reads nothing
    for start in range(0, stop, BLOCK_V):
        cols = start + cols0
        col_ok = cols < width
        u = _u_tile(x_ptr + row * x_stride, bias_ptr, cols, col_ok, pre_s, HAS_BIAS, TANH, ACC)
        u = tl.where(col_ok, u, float("-inf"))
        if TRUNCATED:
            u = tl.where(u < tau, float("-inf"), u)
        chosen += tl.sum(tl.where(col_ok & (cols + col0 == label), u, 0.0), 0)  # not the next slice's
        new_max = tl.maximum(run_max, tl.max(u, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # never -inf - -inf
        d = (u - shift) * post_s
        e = tl.exp(d)
        rescale = tl.exp((run_max - shift) * post_s)
        if RETURN_ENTROPY:
            tile_weighted = tl.sum(e * tl.where(e > 0, d, 0.0), 0)
            rebase = ((tl.where(sum_exp > 0, run_max, shift) - shift) * post_s) * sum_exp
            weighted = rescale * (weighted + rebase) + tile_weighted
        sum_exp = sum_exp * rescale + tl.sum(e, 0)
        run_max = new_max
    if LAST:
        shift = tl.where(run_max == float("-inf"), 0.0, run_max)
        sum_exp = tl.where(row_ok, sum_exp, 1.0)
        log_sum = tl.log(sum_exp)
        logp = tl.where(row_ok, (chosen - shift) * post_s - log_sum, float("nan"))
        tl.store(logp_ptr + row, tl.where(valid, logp, 0.0))
        tl.store(stats_ptr + 2 * row, tl.where(row_ok, shift, 0.0))
        tl.store(stats_ptr + (2 * row + 1), tl.where(row_ok, log_sum, 0.0))
        if RETURN_ENTROPY:
            entropy = tl.where(row_ok, log_sum - weighted / sum_exp, float("nan"))
            tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))
    else:
        tl.store(state_ptr + 4 * row, run_max)
        tl.store(state_ptr + (4 * row + 1), sum_exp)
        tl.store(state_ptr + (4 * row + 2), weighted)
        tl.store(state_ptr + (4 * row + 3), chosen)


@triton.jit
def _head_grad_kernel(
    x_ptr,
    x_stride,
    dz_ptr,
    dz_stride,
    bias_ptr,
    labels_ptr,
    labels_stride,
    tau_ptr,
    stats_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_logp_stride,
    grad_entropy_ptr,
    grad_entropy_stride,
    power_ptr,
    vocab,
    col0,
    width,
    ignore_index,
    pre,
    pre_lo,
    post,
    post_lo,
    factor,
    factor_lo,
    HAS_BIAS: tl.constexpr,
    TANH: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TRUNCATED: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    HAS_POWER: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One row's ``d_logits`` (w.r.t. the raw logits, times ``factor = scale / T`` and the chunk's power
    of two), written over the row's logits tile by tile (each tile is read before it is written, and
    a tile's output bytes lie within the bytes of this and the earlier tiles).  Rows not to compute
    read nothing and get zeros.  ``x`` holds the columns ``[col0, col0 + width)`` (a vocabulary slice
    of the 2-D plan; the row's statistics are the whole row's)."""
    row = tl.program_id(0).to(tl.int64)
    label, valid, row_ok = _row_label(labels_ptr, row, labels_stride, vocab, ignore_index)
    pre_s = scalar(pre, pre_lo, ACC)
    post_s = scalar(post, post_lo, ACC)
    coef = scalar(factor, factor_lo, ACC)
    if HAS_POWER:
        coef = coef * tl.load(power_ptr).to(ACC)
    tau = tl.full([], float("-inf"), ACC)
    if TRUNCATED:
        tau = tl.load(tau_ptr + row, mask=row_ok, other=float("-inf")).to(ACC)
    shift = tl.load(stats_ptr + 2 * row, mask=row_ok, other=0.0).to(ACC)
    log_sum = tl.load(stats_ptr + (2 * row + 1), mask=row_ok, other=0.0).to(ACC)
    g_logp = tl.zeros([], ACC)
    g_entropy = tl.zeros([], ACC)
    entropy = tl.zeros([], ACC)
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row * grad_logp_stride, mask=row_ok, other=0.0).to(ACC)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(grad_entropy_ptr + row * grad_entropy_stride, mask=row_ok, other=0.0).to(ACC)
        entropy = tl.load(entropy_ptr + row, mask=row_ok, other=0.0).to(ACC)
    cols0 = tl.arange(0, BLOCK_V).to(tl.int64)
    stop = tl.where(row_ok, width, 0)  # a row not to compute reads nothing
    for start in range(0, width, BLOCK_V):
        cols = start + cols0
        col_ok = cols < width
        # cols < stop, not col_ok & row_ok: triton 3.9's interpreter refuses the mask a tensor & scalar makes
        u = _u_tile(x_ptr + row * x_stride, bias_ptr, cols, cols < stop, pre_s, HAS_BIAS, TANH, ACC)
        one_hot = cols + col0 == label
        if TRUNCATED:  # dropped tokens: p = 0, and a dropped label's log-prob is -inf, a constant
            one_hot = one_hot & ~(u < tau)
        log_p = (tl.where(u < tau, float("-inf"), u) - shift) * post_s - log_sum
        log_p = tl.where(row_ok, log_p, float("-inf"))
        p = tl.exp(log_p)
        dz = tl.zeros([BLOCK_V], ACC)
        if HAS_GRAD_LOGP:
            dz += g_logp * (tl.where(one_hot, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:  # dH/dz_j = -p_j (log p_j + H), 0 where p_j == 0
            dz -= g_entropy * p * (tl.where(p > 0, log_p, 0.0) + entropy)
        if SOFTCAP:
            dz = dz * (1.0 - u * u)
        dz = tl.where(row_ok, dz * coef, 0.0)
        tl.store(dz_ptr + row * dz_stride + cols, cast_for_store(dz, dz_ptr), mask=col_ok)


class Constants(NamedTuple):
    """The kernels' scalars: ``u = tanh(raw * pre)`` with a soft-cap, ``z - max z = (u - max u) * post``,
    and ``factor = d z / d raw`` over the soft-cap's ``1 - u**2`` (``scale / T``)."""

    pre: float
    post: float
    factor: float
    softcap: bool


def constants(temperature: float, logit_scale: float, logit_softcap: float | None) -> Constants:
    if logit_softcap is None:
        return Constants(1.0, logit_scale / temperature, logit_scale / temperature, False)
    return Constants(logit_scale / logit_softcap, logit_softcap / temperature, logit_scale / temperature, True)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` summed and returned in ``acc``: cuBLAS's ``out_dtype`` for 16-bit inputs on CUDA, widened
    first elsewhere (exact); float32 inputs follow torch's TF32 switch, as ``hidden @ weight.T`` does."""
    if a.dtype == acc:
        return a @ b.to(acc)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=acc)
    return a.to(acc) @ b.to(acc)


def head_plan(kind: str, hidden: torch.Tensor, weight: torch.Tensor, budget: float | None = None) -> HeadPlan:
    """``_head_plan.plan`` for a call on ``hidden [N, H]`` and ``weight [V, H]``: ``d_weight`` may be
    accumulated in the gradient itself for bf16 only (float16's chunks carry a power of two each)."""
    return _head_plan.plan(
        kind,
        hidden.shape[0],
        hidden.shape[1],
        weight.shape[0],
        itemsize=hidden.element_size(),
        budget=budget,
        narrow=hidden.dtype == torch.bfloat16,
    )


def _addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` summed in float32 (float64): ``out`` the accumulator itself, or a 16-bit gradient to
    which each call's float32 sum is added and rounded once (cuBLAS's ``beta = 1`` on CUDA; on the CPU
    by slabs of ``out``'s rows widened to float32, the same rounding)."""
    if out.dtype in (torch.float16, torch.bfloat16):
        if out.is_cuda:
            out.addmm_(a, b)
            return
        wide = b.float()
        for start in range(0, out.shape[0], _CPU_SLAB):
            part = slice(start, start + _CPU_SLAB)
            out[part] = out[part].float().addmm_(a[part].float(), wide)
        return
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


class Chunk(NamedTuple):
    """One chunk's rows: their labels, which rows a label uses (``[c, 1]``), their hidden states (zero
    where unused: whatever they hold reaches nothing) and float32 logits (u itself when ``formed``:
    bias and soft-cap applied on the host, for the truncation's thresholds), as the first ``c`` rows
    of ``hidden_full`` / ``logits_full``, whose rows beyond hold zeros: every product has the plan's
    fixed number of rows, so BLAS (cuBLAS) picks one algorithm for every chunk and call, and a row's
    logits do not depend on the rest of the batch, bit for bit."""

    labels: torch.Tensor
    used: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    formed: bool
    hidden_full: torch.Tensor
    logits_full: torch.Tensor


def padded_rows(hidden_c, labels_c, vocab: int, *, ignore_index: int, rows: int):
    """``(used [c, 1], hidden [max(rows, c), H])``: which rows a label uses, and the rows' hidden states
    (zero where unused) padded with zero rows to the plan's fixed product rows."""
    n = hidden_c.shape[0]
    used = ((labels_c != ignore_index) & (labels_c >= 0) & (labels_c < vocab)).unsqueeze(-1)
    h_full = hidden_c.new_zeros((max(rows, n), hidden_c.shape[1]))
    h_full[:n] = torch.where(used, hidden_c, 0.0)
    return used, h_full


def slice_logits(labels_c, used, h_full, weight_slice) -> Chunk:
    """A block's logits on one vocabulary slice (``weight_slice`` its rows of ``weight``), one product of
    the block's padded rows: a block of the 2-D plan (never truncated, so never formed)."""
    n = labels_c.shape[0]
    x_full = _mm(h_full, weight_slice.T, _acc_dtype(h_full.dtype))
    return Chunk(labels_c, used, h_full[:n], x_full[:n], False, h_full, x_full)


def chunk_logits(hidden_c, weight, bias, labels_c, c: Constants, *, ignore_index: int, form: bool, rows: int) -> Chunk:
    """The chunk's logits by one product of ``max(rows, c)`` rows; ``form``: also its ``u`` on the host
    (bias, tanh), once, so that the thresholds and both kernels read the same values."""
    n = hidden_c.shape[0]
    used, h_full = padded_rows(hidden_c, labels_c, weight.shape[0], ignore_index=ignore_index, rows=rows)
    x_full = _mm(h_full, weight.T, _acc_dtype(hidden_c.dtype))
    x = x_full[:n]
    if form:
        if bias is not None:
            x += bias
        if c.softcap:
            x.mul_(c.pre).tanh_()
    return Chunk(labels_c, used, h_full[:n], x, form, h_full, x_full)


def _flags(chunk: Chunk, bias, c: Constants) -> dict:
    return dict(HAS_BIAS=bias is not None and not chunk.formed, TANH=c.softcap and not chunk.formed)


def chunk_thresholds(chunk: Chunk, c: Constants, ignore_index: int, truncation: Truncation) -> torch.Tensor:
    """Each row's threshold on ``u`` (``tau``, ``-inf``: not truncated), from the chunk's formed logits."""
    x = chunk.logits
    return thresholds(
        x,
        chunk.labels,
        (1, x.stride(0), 0, 1),
        (chunk.labels.stride(0), 0),
        c.post,
        ignore_index,
        truncation=truncation,
        acc_dtype=x.dtype,
        midpoint=True,
        input_dtype=x.dtype,
    )


def chunk_stats(chunk: Chunk, bias, c: Constants, ignore_index: int, tau, return_entropy: bool, *, fold=None):
    """``(logp, entropy or None, stats)`` of the chunk's rows by ``_head_stats_kernel``.  ``fold``: a
    vocabulary slice of the 2-D plan, ``(state [rows, 4], vocab, col0, first, last)``: the slice's
    columns folded into the rows' running state (``bias`` the slice's), the results written by the last."""
    x = chunk.logits
    rows, width = x.shape
    state, vocab, col0, first, last = fold or (x, width, 0, True, True)
    logp = torch.empty(rows, dtype=x.dtype, device=x.device)
    entropy = torch.empty_like(logp) if return_entropy else None
    stats = logp.new_empty((rows, 2))
    if rows:
        _head_stats_kernel[(rows,)](
            x,
            x.stride(0),
            x if bias is None else bias,
            chunk.labels,
            chunk.labels.stride(0),
            x if tau is None else tau,
            logp,
            logp if entropy is None else entropy,
            stats,
            state,
            vocab,
            col0,
            width,
            ignore_index,
            *split_scalar(c.pre),
            *split_scalar(c.post),
            **_flags(chunk, bias, c),
            TRUNCATED=tau is not None,
            RETURN_ENTROPY=return_entropy,
            FIRST=first,
            LAST=last,
            ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
            BLOCK_V=ROW_BLOCK_V,
        )
    return logp, entropy, stats


def power_of_two(dtype: torch.dtype, used, grads, factor: float, vocab: int):
    """float16: ``(2**k, 2**-k)`` with ``2**k`` bringing the largest ``|gradient| * factor`` of the ``used``
    rows (the entropy's times ``log V``, its term's bound) to ``[1, 2)``; ``(None, None)`` for other dtypes."""
    if dtype != torch.float16:
        return None, None
    top = torch.zeros((), dtype=torch.float32, device=used.device)
    for g, bound in zip(grads, (1.0, max(1.0, math.log(vocab)))):
        if g is not None:
            top = torch.maximum(top, torch.where(used, g.abs(), 0.0).amax().float() * bound)
    top = top * factor
    k = torch.where(torch.isfinite(top) & (top > 0), -torch.floor(torch.log2(top)), 0.0).clamp(-120.0, 120.0)
    return torch.exp2(k), torch.exp2(-k)


def chunk_gradient(chunk: Chunk, bias, c: Constants, ignore_index: int, saved, grads, *, part=None, out=None):
    """The chunk's ``d_logits`` in the products' dtype (the inputs'), written over its logits (or into
    ``out``, a separate ``[padded rows, V]`` buffer of that dtype), with the power of two it carries:
    ``(d_logits [rows, V] with zero padding rows, power, inverse) (None, None but for float16)``.
    ``saved = (stats, entropy, tau)`` of the rows; ``grads = (grad_logp, grad_entropy)``, either None.
    ``part``: a vocabulary slice of the 2-D plan, ``(vocab, col0, (power, inverse))`` (the block's power
    of two, ``bias`` the slice's)."""
    stats, entropy, tau = saved
    grad_logp, grad_entropy = grads
    x = chunk.logits
    rows, width = x.shape
    dtype = chunk.hidden.dtype
    full = chunk.logits_full
    if out is not None:
        if out.shape != (full.shape[0], width) or out.dtype != dtype:
            raise ValueError(
                f"out must be {dtype} of shape {(full.shape[0], width)}, got {out.dtype} {tuple(out.shape)}"
            )
        dz_full = out
    else:  # a 16-bit row in its float32 row's first half
        dz_full = full if dtype == full.dtype else full.view(dtype)[:, :width]
    dz = dz_full[:rows]
    if part is None:
        vocab, col0 = width, 0
        power, inverse = power_of_two(dtype, chunk.used.squeeze(-1), grads, c.factor, vocab)
    else:
        vocab, col0, (power, inverse) = part
    if rows:
        _head_grad_kernel[(rows,)](
            x,
            x.stride(0),
            dz,
            dz.stride(0),
            x if bias is None else bias,
            chunk.labels,
            chunk.labels.stride(0),
            x if tau is None else tau,
            stats,
            x if entropy is None else entropy,
            x if grad_logp is None else grad_logp,
            0 if grad_logp is None else grad_logp.stride(0),
            x if grad_entropy is None else grad_entropy,
            0 if grad_entropy is None else grad_entropy.stride(0),
            x if power is None else power,
            vocab,
            col0,
            width,
            ignore_index,
            *split_scalar(c.pre),
            *split_scalar(c.post),
            *split_scalar(c.factor),
            **_flags(chunk, bias, c),
            SOFTCAP=c.softcap,
            TRUNCATED=tau is not None,
            HAS_GRAD_LOGP=grad_logp is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None,
            HAS_POWER=power is not None,
            ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
            BLOCK_V=ROW_BLOCK_V,
        )
    if dz_full.shape[0] > rows:  # the padding rows: zero (their logits are NaN for a non-finite weight)
        dz_full[rows:] = 0.0
    return dz_full, power, inverse


class Gradients:
    """``d_hidden``, ``d_weight`` and ``d_bias`` summed over the chunks: ``d_hidden``'s rows written once
    per chunk, ``d_bias`` in a float32 (float64) accumulator rounded once at the end, ``d_weight`` in one
    too or, with ``narrow`` (the plan's accumulator as narrow as the bf16 gradient), in the gradient.
    A float16 chunk's products carry its power of two: the accumulators are kept in the units of the
    latest chunk's (rescaled by the ratio of two powers of two, exact) and divided by it at the end.

    ``pair`` (narrow only, ``HeadPlan.pair``): the chunks in pairs, one ``d_weight`` product of twice a
    chunk's rows a pair.  The first's d_logits go to their own buffer (``buffer``), its ``d_hidden`` and
    ``d_bias`` at once, its padded hidden rows into the odd rows of the pair's ``[2 m, H]``; the second's
    are written in place, into the first halves of its float32 rows, the first's copied into the second
    halves, so that the rows seen as bf16 ``[2 m, V]`` are the pair's d_logits (rows interleaved: second,
    first, second, ...) against the interleaved hidden rows.  A first chunk left without a second (an
    odd count, or a second whose padded rows differ) adds its own product."""

    def __init__(self, hidden, weight, bias, needs, dtypes, *, narrow: bool = False, pair: bool = False):
        n, width = hidden.shape
        acc = _acc_dtype(hidden.dtype)
        if narrow and dtypes[1] != torch.bfloat16:
            raise ValueError(f"a narrow d_weight accumulator is for bf16 gradients only, got {dtypes[1]}")
        if pair and not narrow:
            raise ValueError("pair: paired chunks are for a narrow (bf16) d_weight accumulator only")
        self.dtypes = dtypes
        self.d_hidden = hidden.new_empty((n, width), dtype=dtypes[0]) if needs[0] else None
        w_acc = dtypes[1] if narrow else acc
        self.d_weight = torch.zeros(weight.shape, dtype=w_acc, device=weight.device) if needs[1] else None
        self.d_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if needs[2] else None
        self.weight = weight
        self.power = None
        self.pair = pair and self.d_weight is not None
        self.first = None  # a pair's first chunk, its d_weight product deferred: (d_logits, [2 m, H] hidden rows)
        self.buffered = False  # the next chunk added is a pair's first (``buffer`` gave its d_logits' buffer)

    def buffer(self, chunk: Chunk):
        """Where the chunk's d_logits go (``chunk_gradient``'s ``out``): a buffer of their own for a pair's
        first chunk, None (in place) otherwise.  The next ``add`` is this chunk's."""
        self.buffered = self.pair and self.first is None
        if not self.buffered:
            return None
        return torch.empty(chunk.logits_full.shape, dtype=chunk.hidden.dtype, device=chunk.logits.device)

    def add(self, rows: slice, chunk: Chunk, dz: torch.Tensor, power, inverse) -> None:
        """``dz``: the chunk's d_logits with its padding rows (zeros), as ``chunk_gradient`` returns them."""
        self.rescale(power, inverse)
        paired = self.pair and (self.buffered or self.first is not None)
        d_rows = self.add_slice(slice(None), chunk, dz, None, d_weight=not paired)
        if self.buffered:
            h_full = chunk.hidden_full
            pair_rows = h_full.new_empty((2 * h_full.shape[0], h_full.shape[1]))
            pair_rows[1::2] = h_full
            self.first, self.buffered = (dz, pair_rows), False
        elif paired:
            self._add_pair(chunk, dz)
        self.rows_done(rows, chunk.used, d_rows, inverse)

    def _add_pair(self, chunk: Chunk, dz: torch.Tensor) -> None:
        """The pair's ``d_weight`` product: the second chunk's ``dz`` (in place, the first halves of its
        float32 rows) and the first's buffered d_logits in the second halves, one product of ``2 m`` rows."""
        (first, pair_rows), self.first = self.first, None
        full = chunk.logits_full
        if first.shape != dz.shape:  # whole sequences of another length: each its own product
            _addmm_(self.d_weight, first.T, pair_rows[1::2])
            _addmm_(self.d_weight, dz.T, chunk.hidden_full)
            return
        halves = full.view(dz.dtype)  # [m, 2 V]: the row's dz, then the first chunk's row's
        halves[:, dz.shape[1] :] = first
        pair_rows[0::2] = chunk.hidden_full
        _addmm_(self.d_weight, halves.view(2 * dz.shape[0], dz.shape[1]).T, pair_rows)

    def rescale(self, power, inverse) -> None:
        """A new chunk (block) of rows whose d_logits carry ``power``: the accumulators to its units."""
        if power is not None and self.power is not None:
            for acc in (self.d_weight, self.d_bias):
                if acc is not None:
                    acc.mul_(power * self.power)  # power / previous power, exact
        self.power = inverse

    def add_slice(self, cols: slice, chunk: Chunk, dz: torch.Tensor, d_rows, *, d_weight: bool = True):
        """The products of ``dz`` (the chunk's d_logits on the vocabulary columns ``cols``, with its padding
        rows): ``d_weight[cols]`` (unless ``d_weight`` is False: a pair's) and ``d_bias[cols]`` added to,
        and the rows' ``d_hidden`` summed in ``d_rows`` (float32 ``[rows, H]``, None before the first
        slice), which is returned."""
        if self.d_hidden is not None:
            if d_rows is None:
                d_rows = _mm(dz, self.weight[cols], _acc_dtype(dz.dtype))
            else:
                _addmm_(d_rows, dz, self.weight[cols])
        if self.d_weight is not None and d_weight:
            _addmm_(self.d_weight[cols], dz.T, chunk.hidden_full)
        if self.d_bias is not None:
            self.d_bias[cols] += dz.sum(0, dtype=self.d_bias.dtype)
        return d_rows

    def rows_done(self, rows: slice, used: torch.Tensor, d_rows, inverse) -> None:
        """The chunk's ``d_hidden`` rows from their float32 sum ``d_rows`` (``used [c, 1]``: the rows a label
        uses), written once."""
        if self.d_hidden is not None:
            d = d_rows[: used.shape[0]]
            if inverse is not None:
                d.mul_(inverse)
            # a non-finite weight row times a zero gradient is NaN: a row with no gradient is 0
            self.d_hidden[rows] = d.masked_fill_(~used, 0.0)

    def finish(self) -> tuple:
        if self.first is not None:  # an odd count's last chunk: its own product
            (first, pair_rows), self.first = self.first, None
            _addmm_(self.d_weight, first.T, pair_rows[1::2])
        out = [self.d_hidden]
        for acc, dtype in ((self.d_weight, self.dtypes[1]), (self.d_bias, self.dtypes[2])):
            if acc is not None and self.power is not None:
                acc.mul_(self.power)
            out.append(None if acc is None else acc.to(dtype))
        return tuple(out)


def block_plan(hidden: torch.Tensor, weight: torch.Tensor, budget: float | None = None) -> BlockPlan:
    """``_head_plan.block_plan`` for ``hidden [N, H]`` and ``weight [V, H]`` (``N`` plays no part), its
    ``(rows, cols)`` replaced by ``BLOCK`` where set."""
    chosen = _head_plan.block_plan(
        hidden.shape[1],
        weight.shape[0],
        itemsize=hidden.element_size(),
        budget=budget,
        narrow=hidden.dtype == torch.bfloat16,
    )
    return chosen if BLOCK is None else BlockPlan(*BLOCK, chosen.acc)


def _plan(plan, hidden, weight, truncated: bool):
    """The call's plan: the 2-D ``block_plan`` by default, the row plan where truncated (top-k, top-p and
    min-p need each row whole), or the caller's (a ``HeadPlan`` or, untruncated, a ``BlockPlan``)."""
    if plan is None:
        return head_plan("logprobs", hidden, weight) if truncated or not TWO_D else block_plan(hidden, weight)
    if isinstance(plan, BlockPlan) and truncated:
        raise ValueError("plan: a truncated call (top_k, top_p, min_p) needs whole rows, a HeadPlan, not a BlockPlan")
    return plan


def forward(hidden, weight, labels, bias, c: Constants, *, ignore_index, return_entropy, truncation, plan=None):
    """``(logp [N], entropy [N] or None, stats [N, 2], tau [N] or None)`` of the head, chunk by chunk
    (``plan``: ``_plan``'s by default)."""
    n = hidden.shape[0]
    acc = _acc_dtype(hidden.dtype)
    logp = torch.empty(n, dtype=acc, device=hidden.device)
    entropy = torch.empty_like(logp) if return_entropy else None
    stats = logp.new_empty((n, 2))
    tau = logp.new_empty(n) if truncation.active else None
    plan = _plan(plan, hidden, weight, truncation.active)
    if isinstance(plan, BlockPlan):
        _forward_blocks(
            hidden, weight, labels, bias, c, ignore_index=ignore_index, plan=plan, out=(logp, entropy, stats)
        )
        return logp, entropy, stats, tau
    rows = plan.rows
    for start, stop in row_chunks(n, rows):
        chunk = chunk_logits(
            hidden[start:stop],
            weight,
            bias,
            labels[start:stop],
            c,
            ignore_index=ignore_index,
            form=tau is not None,
            rows=rows,
        )
        tau_c = None
        if tau is not None:
            tau_c = tau[start:stop] = chunk_thresholds(chunk, c, ignore_index, truncation)
        lp, en, st = chunk_stats(chunk, bias, c, ignore_index, tau_c, return_entropy)
        logp[start:stop], stats[start:stop] = lp, st
        if entropy is not None:
            entropy[start:stop] = en
        del chunk  # freed before the next chunk's product: one chunk's logits at a time
    return logp, entropy, stats, tau


def _forward_blocks(hidden, weight, labels, bias, c: Constants, *, ignore_index, plan: BlockPlan, out) -> None:
    """The 2-D plan's forward into ``out = (logp, entropy or None, stats)``: per block of ``plan.rows`` rows
    (padded), per vocabulary slice in order, the slice's logits and their fold into the rows' state."""
    logp, entropy, stats = out
    vocab = weight.shape[0]
    slices = col_slices(vocab, plan.cols)
    for start, stop in row_chunks(hidden.shape[0], plan.rows):
        used, h_full = padded_rows(
            hidden[start:stop], labels[start:stop], vocab, ignore_index=ignore_index, rows=plan.rows
        )
        state = logp.new_empty((stop - start, 4))
        for j, (v0, v1) in enumerate(slices):
            chunk = slice_logits(labels[start:stop], used, h_full, weight[v0:v1])
            fold = (state, vocab, v0, j == 0, j == len(slices) - 1)
            b = None if bias is None else bias[v0:v1]
            lp, en, st = chunk_stats(chunk, b, c, ignore_index, None, entropy is not None, fold=fold)
            del chunk  # one slice's logits at a time: freed before the next product
        logp[start:stop], stats[start:stop] = lp, st
        if entropy is not None:
            entropy[start:stop] = en


def backward(grads, hidden, weight, labels, bias, c: Constants, *, saved, ignore_index, needs, plan=None):
    """``(d_hidden, d_weight, d_bias)`` (None where not needed) of the head from its incoming
    ``grads = (grad_logp, grad_entropy)`` and the forward's ``saved = (stats, entropy, tau)``: each
    chunk's logits recomputed, its ``d_logits`` and its two products (``plan``: ``_plan``'s by default,
    the forward's)."""
    stats, entropy, tau = saved
    plan = _plan(plan, hidden, weight, tau is not None)
    narrow = plan.acc < 4  # the bf16 gradient itself (float32 and float64 accumulate in their own dtype)
    out = Gradients(hidden, weight, bias, needs, (hidden.dtype, weight.dtype, weight.dtype), narrow=narrow)
    if isinstance(plan, BlockPlan):
        _backward_blocks(grads, hidden, labels, bias, c, saved=saved, ignore_index=ignore_index, plan=plan, out=out)
        return out.finish()
    rows = plan.rows
    for start, stop in row_chunks(hidden.shape[0], rows):
        rs = slice(start, stop)
        chunk = chunk_logits(
            hidden[rs], weight, bias, labels[rs], c, ignore_index=ignore_index, form=tau is not None, rows=rows
        )
        part = lambda x, rs=rs: None if x is None else x[rs]  # noqa: E731
        dz, power, inverse = chunk_gradient(
            chunk, bias, c, ignore_index, (stats[rs], part(entropy), part(tau)), (part(grads[0]), part(grads[1]))
        )
        out.add(rs, chunk, dz, power, inverse)
        del chunk, dz  # freed before the next chunk's product: one chunk's logits at a time
    return out.finish()


def _backward_blocks(grads, hidden, labels, bias, c: Constants, *, saved, ignore_index, plan: BlockPlan, out) -> None:
    """The 2-D plan's backward into ``out`` (``Gradients``): per block, its power of two (float16), then per
    vocabulary slice the logits recomputed, ``d_logits`` over them, ``d_weight[slice]`` and ``d_bias[slice]``
    added to and the block's ``d_hidden`` summed in float32, its rows written once after the last slice."""
    stats, entropy, _ = saved
    weight, vocab = out.weight, out.weight.shape[0]
    for start, stop in row_chunks(hidden.shape[0], plan.rows):
        rs = slice(start, stop)
        part = lambda x, rs=rs: None if x is None else x[rs]  # noqa: E731
        g = (part(grads[0]), part(grads[1]))
        used, h_full = padded_rows(hidden[rs], labels[rs], vocab, ignore_index=ignore_index, rows=plan.rows)
        power, inverse = power_of_two(hidden.dtype, used.squeeze(-1), g, c.factor, vocab)
        out.rescale(power, inverse)
        d_rows = None
        for v0, v1 in col_slices(vocab, plan.cols):
            chunk = slice_logits(labels[rs], used, h_full, weight[v0:v1])
            b = None if bias is None else bias[v0:v1]
            dz = chunk_gradient(
                chunk, b, c, ignore_index, (stats[rs], part(entropy), None), g, part=(vocab, v0, (power, inverse))
            )[0]
            d_rows = out.add_slice(slice(v0, v1), chunk, dz, d_rows)
            del chunk, dz  # one slice's logits at a time: freed before the next product
        out.rows_done(rs, used, d_rows, inverse)
