"""Each row's sampling threshold: the raw value ``tau`` with kept tokens ``{x >= tau}`` (``ppo_fast._sampling``).

One program per row, the vocabulary streamed in ``BLOCK_V`` blocks, nothing stored but ``tau [rows]``.
With ``z = x * scale`` (``scale > 0``: the temperature, and for the fused head the logit scale) and
``d = (x - max) * scale * log2(e)``:

- ``min_p``: the smallest ``x`` with ``z - max z >= min_p_cutoff(min_p)`` (one pass), the rule of the
  other backends: ``exp(z - max z) >= min_p`` with the difference rounded in the compute dtype and the
  exp in float64;
- ``top_k``: the k-th largest ``x`` counted with its ties, by a 16-way search on the order-preserving
  integer image of the float bits (the "key"), each pass counting the tokens ``>=`` each of 16 candidates
  (the counts kept on chip);
- ``top_p``: the largest ``x`` (at least the threshold so far) whose kept mass ``sum 2**d over x' >= x``
  reaches ``top_p`` times the mass of what min_p/top_k kept, by the same search summing ``2**d``.

The search finds the largest key whose predicate holds, which is always the key of a row value: the
threshold is a logit of the row, every token tied with it is kept, and the max always is.  A pass narrows
the keys 16-fold: at most 8 passes for a float32 key, 4 for 16-bit inputs, which search the keys of their
own type (the low bits of the float32 key are constant); float64 keys are bisected.
A row with a NaN or +inf scaled logit (x / T overflows; or only -inf ones), and a row whose label is ignored or out of range,
gets ``tau = -inf``: ``x < tau`` holds for no ``x``, NaN included, so such a row is not truncated.

``MIDPOINT`` moves ``tau`` halfway down to the next lower value of the row: the same kept set, with a
margin for kernels that recompute the logits with another rounding (the fused head's tiles).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..._sampling import Truncation
from ._dtypes import scalar, split_scalar

# Vocabulary block of the threshold passes (a thread holds BLOCK_V / (32 * num_warps) logits).
THRESHOLD_BLOCK_V = 2048


def log_ways(acc_dtype: torch.dtype) -> int:
    """log2 of the candidates per pass of the top-k / top-p searches: 16 (4 bits of a float32 key a pass);
    2 for float64 keys, whose candidates lo + j * step would overflow int64 past the first."""
    return 1 if acc_dtype == torch.float64 else 4


@triton.jit
def _key(v, ACC: tl.constexpr, KEY_SHIFT: tl.constexpr):
    """The order-preserving int64 image of a float ``v`` (compute type), its KEY_SHIFT low bits dropped."""
    if ACC == tl.float64:
        bits = v.to(tl.int64, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    else:
        bits = v.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return key >> KEY_SHIFT


@triton.jit
def _value(key, ACC: tl.constexpr, KEY_SHIFT: tl.constexpr):
    """The float whose ``_key`` is ``key`` (the dropped low bits restored as a value of the input type has them)."""
    low = (1 << KEY_SHIFT) - 1
    full = (key << KEY_SHIFT) | tl.where(key < 0, low, 0)
    if ACC == tl.float64:
        value = tl.where(full < 0, full ^ 0x7FFFFFFFFFFFFFFF, full).to(tl.float64, bitcast=True)
    else:
        value = tl.where(full < 0, full ^ 0x7FFFFFFF, full).to(tl.int32).to(tl.float32, bitcast=True)
    return value


@triton.jit
def _load(row_ptr, start, cols, vocab_stride, row_vocab, ACC: tl.constexpr):
    """One block of the row in the compute type, and which of its lanes are in the row."""
    in_row = cols < row_vocab - start
    x = tl.load(row_ptr + (start + cols) * vocab_stride, mask=in_row, other=0.0).to(ACC)
    return x, in_row


@triton.jit
def _mass_at_least(
    row_ptr, cols, vocab_stride, row_vocab, t, row_max, scale2, ACC: tl.constexpr, BLOCK_V: tl.constexpr
):
    """``sum 2**((x - max) * scale2)`` over the logits ``x >= t`` of the row."""
    mass = tl.zeros([BLOCK_V], ACC)
    for start in range(0, row_vocab, BLOCK_V):
        x, in_row = _load(row_ptr, start, cols, vocab_stride, row_vocab, ACC)
        mass += tl.where(in_row & (x >= t), tl.math.exp2((x - row_max) * scale2), 0.0)
    return tl.sum(mass, 0)


@triton.jit
def _at_least_each(
    row_ptr, vocab_stride, row_vocab, t, row_max, scale2, MASS: tl.constexpr, ACC: tl.constexpr, WAYS: tl.constexpr
):
    """For each of the ``WAYS`` thresholds ``t``, in one pass over the row: how many of its logits are
    ``>= t`` or (``MASS``) their ``sum 2**((x - max) * scale2)``; the ``WAYS`` sums stay on chip."""
    BLOCK: tl.constexpr = 256
    cols = tl.arange(0, BLOCK).to(tl.int64)
    total = tl.zeros([WAYS], ACC if MASS else tl.int32)
    for start in range(0, row_vocab, BLOCK):
        x, in_row = _load(row_ptr, start, cols, vocab_stride, row_vocab, ACC)
        above = in_row[:, None] & (x[:, None] >= t[None, :])
        if MASS:
            w = tl.math.exp2((x - row_max) * scale2)
            total += tl.sum(tl.where(above, w[:, None], 0.0), 0)
        else:
            total += tl.sum(above.to(tl.int32), 0)
    return total


@triton.jit
def _largest_key(
    lo,
    hi,
    row_ptr,
    vocab_stride,
    row_vocab,
    goal,
    row_max,
    scale2,
    MASS: tl.constexpr,
    ACC: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    LOG_WAYS: tl.constexpr,
):
    """The largest key in ``[lo, hi]`` whose value keeps a count (or mass) ``>= goal`` (else ``lo``): a
    ``2**LOG_WAYS``-ary search, each pass one read of the row for that many candidates, so a 32-bit key
    takes ceil(32 / LOG_WAYS) passes, not the 32 of a bisection.  The step is formed from the shifted
    ends (no ``hi - lo``, which overflows int64 across float64's keys; those search 2-way)."""
    WAYS: tl.constexpr = 1 << LOG_WAYS
    ways = tl.arange(0, WAYS).to(tl.int64)
    while lo < hi:
        step = (hi >> LOG_WAYS) - (lo >> LOG_WAYS) + 1
        candidate = tl.minimum(lo + ways * step, hi)  # candidate[0] = lo
        held = (
            _at_least_each(
                row_ptr, vocab_stride, row_vocab, _value(candidate, ACC, KEY_SHIFT), row_max, scale2, MASS, ACC, WAYS
            )
            >= goal
        )
        best = tl.max(tl.where(held, candidate, lo), 0)
        hi = tl.min(tl.where(held | (candidate <= best), hi + 1, candidate), 0) - 1
        lo = best
    return lo


@triton.jit
def _truncation_threshold_kernel(
    logits_ptr,
    labels_ptr,
    tau_ptr,
    rows_per_outer,
    outer_stride,
    inner_stride,
    vocab_stride,
    labels_outer_stride,
    labels_inner_stride,
    vocab,
    ignore_index,
    scale,
    scale_lo,
    top_k,
    top_p,
    top_p_lo,
    min_p_cutoff,
    min_p_cutoff_lo,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    MIDPOINT: tl.constexpr,
    ACC: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOG_WAYS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_per_outer
    inner = row % rows_per_outer
    row_ptr = logits_ptr + outer * outer_stride + inner * inner_stride
    label = tl.load(labels_ptr + outer * labels_outer_stride + inner * labels_inner_stride).to(tl.int64)
    row_vocab = tl.where((label != ignore_index) & (label >= 0) & (label < vocab), vocab, 0)
    log2e = 1.0 / tl.log(tl.full([], 2.0, ACC))
    z_scale = scalar(scale, scale_lo, ACC)
    scale2 = z_scale * log2e
    cols = tl.arange(0, BLOCK_V).to(tl.int64)

    # The row's max and min, and whether it holds a NaN.
    run_max = tl.full([BLOCK_V], float("-inf"), ACC)
    run_min = tl.full([BLOCK_V], float("inf"), ACC)
    nans = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, row_vocab, BLOCK_V):
        x, in_row = _load(row_ptr, start, cols, vocab_stride, row_vocab, ACC)
        run_max = tl.maximum(run_max, tl.where(in_row, x, float("-inf")))
        run_min = tl.minimum(run_min, tl.where(in_row, x, float("inf")))
        nans += (x != x).to(tl.int32)
    row_max = tl.max(run_max, 0)
    tau = tl.min(run_min, 0)
    # A NaN, or a scaled max x / T that overflows, makes the row NaN: nothing to truncate.
    truncated = (tl.sum(nans, 0) == 0) & (tl.abs(row_max * z_scale) < float("inf"))
    row_vocab = tl.where(truncated, row_vocab, 0)  # rows not truncated read nothing more

    if HAS_MIN_P:
        cutoff = scalar(min_p_cutoff, min_p_cutoff_lo, ACC)
        z_max = row_max * z_scale
        run_min = tl.full([BLOCK_V], float("inf"), ACC)
        for start in range(0, row_vocab, BLOCK_V):
            x, in_row = _load(row_ptr, start, cols, vocab_stride, row_vocab, ACC)
            run_min = tl.minimum(run_min, tl.where(in_row & (x * z_scale - z_max >= cutoff), x, float("inf")))
        tau = tl.min(run_min, 0)
    if HAS_TOP_K:
        # The largest key in [key(tau), key(max)] with at least top_k logits >= its value (else key(tau)).
        lo, hi = _key(tau, ACC, KEY_SHIFT), _key(row_max, ACC, KEY_SHIFT)
        lo = _largest_key(
            lo, hi, row_ptr, vocab_stride, row_vocab, top_k, row_max, scale2, False, ACC, KEY_SHIFT, LOG_WAYS
        )
        tau = _value(lo, ACC, KEY_SHIFT)
    if HAS_TOP_P:
        # The largest key whose logits >= its value hold top_p of the mass min_p/top_k kept.
        target = scalar(top_p, top_p_lo, ACC) * _mass_at_least(
            row_ptr, cols, vocab_stride, row_vocab, tau, row_max, scale2, ACC, BLOCK_V
        )
        lo, hi = _key(tau, ACC, KEY_SHIFT), _key(row_max, ACC, KEY_SHIFT)
        lo = _largest_key(
            lo, hi, row_ptr, vocab_stride, row_vocab, target, row_max, scale2, True, ACC, KEY_SHIFT, LOG_WAYS
        )
        tau = _value(lo, ACC, KEY_SHIFT)
    if MIDPOINT:
        below = tl.full([BLOCK_V], float("-inf"), ACC)
        for start in range(0, row_vocab, BLOCK_V):
            x, in_row = _load(row_ptr, start, cols, vocab_stride, row_vocab, ACC)
            below = tl.maximum(below, tl.where(in_row & (x < tau), x, float("-inf")))
        next_lower = tl.max(below, 0)
        middle = next_lower * 0.5 + tau * 0.5
        tau = tl.where(next_lower == float("-inf"), float("-inf"), tl.where(middle > next_lower, middle, tau))
    tl.store(tau_ptr + row, tl.where(truncated & (row_vocab > 0), tau, float("-inf")))


def passes(truncation: Truncation, dtype: torch.dtype, midpoint: bool = False) -> int:
    """The most reads of a row the threshold kernel makes for ``truncation`` on ``dtype`` logits: the
    max/min pass, min-p's, ceil(key bits / 4) per search (16 candidates a pass), top-p's kept mass, the
    midpoint's.  A bisection would take one pass per key bit."""
    searches = (truncation.top_k > 0) + (truncation.top_p < 1)
    key_bits = (64 if dtype == torch.float64 else 32) - key_shift(dtype)
    per_search = math.ceil(key_bits / log_ways(dtype))
    return 1 + (truncation.min_p > 0) + searches * per_search + (truncation.top_p < 1) + midpoint


def key_shift(dtype: torch.dtype) -> int:
    """The low bits of a float32 key that are 0 for every value of ``dtype``: 16 for bfloat16, 13 for float16."""
    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


def thresholds(
    logits: torch.Tensor,
    labels: torch.Tensor,
    layout: tuple[int, int, int, int],
    labels_strides: tuple[int, int],
    scale: float,
    ignore_index: int,
    *,
    truncation: Truncation,
    acc_dtype: torch.dtype,
    midpoint: bool = False,
    input_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``tau [rows]`` (``acc_dtype``) for rows addressed as ``(rows_per_outer, outer_stride, inner_stride,
    vocab_stride)`` of ``logits`` (elements), labels by ``labels_strides``; ``scale`` maps a logit to ``z``.
    ``input_dtype``: the dtype the values were rounded to (their keys' low bits), default ``logits.dtype``."""
    rows_per_outer, outer_stride, inner_stride, vocab_stride = layout
    rows = labels.numel()
    tau = torch.empty(rows, dtype=acc_dtype, device=logits.device)
    if rows == 0:
        return tau
    acc = tl.float64 if acc_dtype == torch.float64 else tl.float32
    _truncation_threshold_kernel[(rows,)](
        logits,
        labels,
        tau,
        rows_per_outer,
        outer_stride,
        inner_stride,
        vocab_stride,
        *labels_strides,
        logits.shape[-1],
        ignore_index,
        *split_scalar(scale),
        max(truncation.top_k, 1),
        *split_scalar(truncation.top_p),
        *split_scalar(min_p_cutoff(truncation.min_p, acc_dtype) if truncation.min_p > 0 else 0.0),
        HAS_TOP_K=truncation.top_k > 0,
        HAS_TOP_P=truncation.top_p < 1,
        HAS_MIN_P=truncation.min_p > 0,
        MIDPOINT=midpoint,
        ACC=acc,
        KEY_SHIFT=key_shift(input_dtype or logits.dtype),
        BLOCK_V=min(THRESHOLD_BLOCK_V, triton.next_power_of_2(logits.shape[-1])),
        LOG_WAYS=log_ways(acc_dtype),
        num_warps=8,
    )
    return tau


@functools.lru_cache(maxsize=64)  # a bisection on the host: once per (min_p, dtype), not per call
def min_p_cutoff(min_p: float, dtype: torch.dtype) -> float:
    """The least non-positive ``d`` of ``dtype`` (float32 or float64) with ``exp(float64(d)) >= min_p``:
    min-p keeps ``z - max z >= it``, as the native kernels' ``min_p_cutoff`` (bisection over the bits)."""
    np_float, np_bits = (np.float64, np.uint64) if dtype == torch.float64 else (np.float32, np.uint32)
    value = lambda bits: -float(np.array(bits, np_bits).view(np_float))  # noqa: E731
    good, bad = 0, int(np.array(np.inf, np_float).view(np_bits))  # exp(-0) = 1 >= min_p; exp(-inf) = 0 < min_p
    while bad - good > 1:
        mid = good + (bad - good) // 2
        if math.exp(value(mid)) >= min_p:
            good = mid
        else:
            bad = mid
    return value(good)
