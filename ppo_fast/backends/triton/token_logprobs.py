"""Fused log-softmax + gather: the chosen token's log-prob (and the entropy) per row.

One program per row of logits (a 1-D grid, so millions of rows fit), the
vocabulary streamed in ``BLOCK_V`` blocks with an online max / sum-exp kept per
thread (per 16-byte group of logits) and combined once per row: the logits are
read once in the forward and once in the backward, and nothing of size ``[N, V]``
is allocated except the gradient (not even that with ``inplace``).  Temperature
is folded in: ``z = logits / temperature``.  The hot loops are kept within the
sm_90 instruction budgets of ``bench.static`` (tests/backends/test_triton_compiles_for_gpu.py).

Rows are addressed as ``[B, T, V]`` with arbitrary strides on every dim (a
``[N, V]`` input is ``B = N, T = 1``), so slices such as ``logits[:, :-1]``, a
transposed or an expanded (stride-0) tensor are read in place; a unit vocabulary
stride is specialised by Triton, so the usual layout pays nothing for it.  The
labels and the per-row gradients are read through their own strides too.  All
address arithmetic is int64.

Rows whose label is ``ignore_index`` or out of ``[0, V)`` read no logits at all:
an ignored row gives log-prob 0 and entropy 0, an out-of-range label (possible
where the host does not check it: CUDA, ``torch.compile``) log-prob NaN and
entropy NaN; both give a zero gradient row, whatever the logits or the incoming
gradients hold there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..._sampling import NO_TRUNCATION, Truncation
from ._dtypes import cast_for_store, compute_dtype, result_dtype, scalar, split_scalar
from ._eager import call, custom_op, with_autograd
from ._launch import (
    DEVICES,
    check_same_device,
    device_guard,
    is_non_overlapping_and_dense,
    lead_view,
    not_differentiable,
)
from ._truncation import _truncation_threshold_kernel, thresholds  # noqa: F401  (the kernel: for bench.static)

SUPPORTED = {"token_logprobs": DEVICES}

# Vocabulary block per loop iteration; a larger V loops over blocks.  With 8 warps a
# thread holds 16 logits per block (two or four 16-byte loads); the backward of 16-bit
# logits takes blocks twice as wide on 4 warps, 64 logits a thread, so that the loop's
# fixed cost (addresses, counter, branch: 14 instructions an iteration) is 0.2 per logit.
MAX_BLOCK_V = 4096
# Bytes per vector load: a group of 16 / itemsize logits is one thread's contiguous load.
_VECTOR_BYTES = 16
# A floor for log p (natural or base 2) where p == 0 (-inf logits): 0 * floor stays 0 where
# 0 * -inf would be NaN, and exp(floor) is 0 in float64 too, so no p > 0 is clamped.
LOG_FLOOR = tl.constexpr(-2000.0)


def _launch_config(vocab: int, block_v: int | None, itemsize: int, backward: bool = False) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a vocabulary: wide blocks, more warps as they grow.

    float64 blocks are at most 1024 wide (4 warps, 8 doubles per thread): wider ones spill
    in the entropy backward under triton 3.6 or 3.8 (``bench.static``)."""
    wide_backward = backward and itemsize == 2
    widest = MAX_BLOCK_V // 4 if itemsize == 8 else 2 * MAX_BLOCK_V if wide_backward else MAX_BLOCK_V
    block = block_v or min(triton.next_power_of_2(vocab), widest)
    num_warps = 4 if block <= 1024 or wide_backward else 8
    return block, num_warps


def _group(block: int, vocab_stride: int, *tensors: tuple[torch.Tensor, int, int]) -> int:
    """``GROUP``: how many consecutive logits a thread loads at once and reduces on its own.

    One 16-byte vector (8 bf16, 4 float32) when every row of every ``(x, outer_stride,
    inner_stride)`` starts 16-byte aligned along a unit vocabulary stride; else the largest
    power of two that keeps the rows aligned (1 for an odd V).  The kernels receive the row
    strides divided by ``GROUP``, so Triton knows each row's alignment (its own hints cover
    only multiples of 16: a V that is a multiple of 8 but not of 16 would lose its bf16
    vector loads)."""
    if vocab_stride != 1:
        return 1
    group = min(block, _VECTOR_BYTES // tensors[0][0].element_size())
    for x, outer_stride, inner_stride in tensors:
        while group > 1 and (outer_stride % group or inner_stride % group or x.data_ptr() % (group * x.element_size())):
            group //= 2
    return group


def _row_layout(x: torch.Tensor) -> tuple[tuple[int, ...], int, int, int, int]:
    """``(lead_shape, rows_per_outer, outer_stride, inner_stride, vocab_stride)`` of a ``[N, V]`` or ``[B, T, V]`` tensor."""
    if x.dim() == 2:
        return (x.shape[0],), 1, x.stride(0), 0, x.stride(1)
    if x.dim() == 3:
        return (x.shape[0], x.shape[1]), x.shape[1], x.stride(0), x.stride(1), x.stride(2)
    raise ValueError(f"logits must be [N, V] or [B, T, V], got shape {tuple(x.shape)}")


@triton.jit
def _row_label(labels_ptr, outer, inner, labels_outer_stride, labels_inner_stride, vocab, ignore_index):
    """The row's label (int64) and whether it is valid (not ignore_index) and in [0, vocab)."""
    label = tl.load(labels_ptr + outer * labels_outer_stride + inner * labels_inner_stride).to(tl.int64)
    valid = label != ignore_index
    in_vocab = (label >= 0) & (label < vocab)
    return label, valid, in_vocab


@triton.jit
def _log2e_ln2(ACC: tl.constexpr):
    """``(log2(e), ln(2))`` in the compute type (a float literal would be float32)."""
    ln2 = tl.log(tl.full([], 2.0, ACC))
    return 1.0 / ln2, ln2


@triton.jit
def _block_offsets(start, GROUP: tl.constexpr, BLOCK_V: tl.constexpr):
    """``[BLOCK_V // GROUP, GROUP]`` column indices (int64): a row of it is one thread's vector load."""
    groups = tl.arange(0, BLOCK_V // GROUP).to(tl.int64)
    return start + groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]


@triton.jit
def _load_full_block(
    block_ptr, offsets, ACC: tl.constexpr, GROUP: tl.constexpr, BLOCK_V: tl.constexpr, BF16_PAIRS: tl.constexpr
):
    """A whole (unmasked) block of logits ``[BLOCK_V // GROUP, GROUP]`` in the compute type.

    With ``BF16_PAIRS`` (bfloat16, unit stride, rows 4-byte aligned) the block is read as
    32-bit words, each widened to its two float32 values by a shift and a mask: two
    instructions a pair, where the conversion of the upper half alone takes two."""
    if BF16_PAIRS:
        words = tl.load(
            block_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + _block_offsets(0, GROUP // 2, BLOCK_V // 2)
        )
        low = (words << 16).to(tl.float32, bitcast=True)
        high = (words & -65536).to(tl.float32, bitcast=True)
        x = tl.reshape(tl.join(low, high), [BLOCK_V // GROUP, GROUP])
    else:
        x = tl.load(block_ptr + offsets).to(ACC)
    return x


@triton.jit
def _rebased(weighted, sum_exp, old, rescale):
    """A group's ``sum 2**d * d`` moved to a new shift ``old`` (base-2 units) below its own:
    ``rescale * (weighted + old * sum_exp)``, 0 where nothing survives the rescale (a group
    that saw only -inf, or one far below the new max, whose ``old`` may be -inf)."""
    return tl.where(rescale > 0, rescale * (weighted + old * sum_exp), 0.0)


@triton.jit
def _online_update(x, run_max, sum_exp, weighted, scale2, RETURN_ENTROPY: tl.constexpr):
    """One block of logits ``x [G, GROUP]`` folded into each group's running statistics.

    Each group (one thread's vector load) keeps its own max of ``x``, ``sum 2**d`` and, for
    the entropy, ``sum 2**d * d``, with ``d = (x - max) * scale2`` and ``scale2 = log2(e) /
    temperature`` (> 0, so the max of ``x`` is the max of ``z = x / temperature``): nothing
    is reduced across threads inside the loop.  Per logit: a max, a subtract, a multiply, one
    ``exp2`` and an add (a clamp and an FMA more with the entropy).  ``x * scale2 - max *
    scale2`` would save the subtract but overflows for logits near the float32 limit.
    """
    new_max = tl.maximum(run_max, tl.max(x, 1))
    # While a group has seen only -inf, shift by 0 so that -inf - -inf never appears.
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    d = (x - shift[:, None]) * scale2
    e = tl.math.exp2(d)
    old = (run_max - shift) * scale2
    rescale = tl.math.exp2(old)
    if RETURN_ENTROPY:
        block_weighted = tl.sum(e * tl.maximum(d, LOG_FLOOR), 1)
        weighted = _rebased(weighted, sum_exp, old, rescale) + block_weighted
    sum_exp = sum_exp * rescale + tl.sum(e, 1)
    return new_max, sum_exp, weighted


@triton.jit
def _token_logprobs_fwd_kernel(
    logits_ptr,
    labels_ptr,
    logp_ptr,
    entropy_ptr,
    stats_ptr,
    tau_ptr,
    rows_per_outer,
    outer_step,
    inner_step,
    vocab_stride,
    labels_outer_stride,
    labels_inner_stride,
    vocab,
    inv_temperature,
    inv_temperature_lo,
    ignore_index,
    RETURN_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
    TRUNCATED: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    # int64 row: every product below (row index * stride) is int64, whatever the strides' type.
    outer = row // rows_per_outer
    inner = row % rows_per_outer
    # The row strides come divided by GROUP: the product shows Triton that rows are GROUP-aligned.
    row_ptr = logits_ptr + (outer * outer_step + inner * inner_step) * GROUP
    label, valid, in_vocab = _row_label(
        labels_ptr, outer, inner, labels_outer_stride, labels_inner_stride, vocab, ignore_index
    )
    # Ignored and out-of-range rows read no logits: their loop and tail are empty.
    row_vocab = tl.where(valid & in_vocab, vocab, 0)
    inv_t = scalar(inv_temperature, inv_temperature_lo, ACC)
    log2e, ln2 = _log2e_ln2(ACC)
    scale2 = inv_t * log2e

    run_max = tl.full([BLOCK_V // GROUP], float("-inf"), ACC)
    sum_exp = tl.zeros([BLOCK_V // GROUP], ACC)
    weighted = tl.zeros([BLOCK_V // GROUP], ACC)
    # Whole blocks unmasked (vector loads, no -inf fills), then one masked tail block; a
    # scalar block pointer advances by a block (the column offsets stay loop-invariant).
    full_end = row_vocab - row_vocab % BLOCK_V
    cols = _block_offsets(0, GROUP, BLOCK_V)
    offsets = cols * vocab_stride
    step = tl.full([], BLOCK_V, tl.int64) * vocab_stride
    block_ptr = row_ptr
    tau = tl.full([], float("-inf"), ACC)
    if TRUNCATED:  # the tokens the sampler dropped (x < tau) are -inf: out of the softmax
        tau = tl.load(tau_ptr + row).to(ACC)
    for _ in range(0, full_end, BLOCK_V):
        x = _load_full_block(block_ptr, offsets, ACC, GROUP, BLOCK_V, BF16_PAIRS)
        if TRUNCATED:
            x = tl.where(x < tau, float("-inf"), x)
        run_max, sum_exp, weighted = _online_update(x, run_max, sum_exp, weighted, scale2, RETURN_ENTROPY)
        block_ptr += step
    if full_end < row_vocab:
        x = tl.load(block_ptr + offsets, mask=cols < row_vocab - full_end, other=float("-inf")).to(ACC)
        if TRUNCATED:
            x = tl.where(x < tau, float("-inf"), x)
        run_max, sum_exp, weighted = _online_update(x, run_max, sum_exp, weighted, scale2, RETURN_ENTROPY)

    # The groups combined once: re-based to the row's max.
    row_max = tl.max(run_max, 0)
    shift_x = tl.where(row_max == float("-inf"), 0.0, row_max)
    old = (run_max - shift_x) * scale2
    rescale = tl.math.exp2(old)
    total = tl.sum(sum_exp * rescale, 0)
    log_sum = tl.log(total)
    # A row whose largest logit / T overflows (or is -inf, NaN) is NaN, as z = x / T makes it in
    # the reference: the shifted pass below would not see the overflow.
    log_sum = tl.where((row_vocab == 0) | (tl.abs(row_max * inv_t) < float("inf")), log_sum, float("nan"))
    # Row 0's address for a row whose label is not a column (never a read outside the row).
    chosen = tl.load(row_ptr + tl.where(in_vocab, label, 0) * vocab_stride, mask=valid & in_vocab, other=0.0).to(ACC)
    if TRUNCATED:
        chosen = tl.where(chosen < tau, float("-inf"), chosen)  # a dropped label: log-prob -inf
    # (x - max) / T - log_sum, as the online pass shifts: never z - logsumexp, which rounds
    # at the scaled logits' magnitude (ulp(x / T), large at a low temperature), nor
    # x / T - max / T, which an FMA would round differently from the backward.
    logp = tl.where(in_vocab, (chosen - shift_x) * inv_t - log_sum, float("nan"))
    tl.store(logp_ptr + row, tl.where(valid, logp, 0.0))
    tl.store(stats_ptr + 2 * row, shift_x)
    tl.store(stats_ptr + (2 * row + 1), log_sum)
    if RETURN_ENTROPY:
        # E[z - shift] from base-2 units: H = log_sum - E[z - shift]
        mean_shifted = tl.sum(_rebased(weighted, sum_exp, old, rescale), 0) * ln2 / total
        entropy = tl.where(in_vocab, log_sum - mean_shifted, float("nan"))
        tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))


@triton.jit
def _grad_block(x, scale2, shift_x, coef, coef_log2, HAS_GRAD_ENTROPY: tl.constexpr):
    """``dL/dx`` off the label column, ``p * coef`` or with the entropy gradient
    ``p * (coef + coef_log2 * d)``, with ``d = (x - max) * log2(e) / T`` rounded as the
    forward's online pass rounds it (a subtract, then a multiply: no FMA of x / T - max / T,
    whose rounding at a low temperature would differ from the forward's by up to ulp(x / T))
    and ``p = 2**d / total``, the 1 / total folded into ``coef`` and ``coef_log2`` by the
    caller: one ``exp2`` and a multiply per logit (a clamp and an FMA more with the entropy
    gradient)."""
    d = (x - shift_x) * scale2
    e = tl.math.exp2(d)
    if HAS_GRAD_ENTROPY:
        # coef + coef_log2 * log2 p, with log2 p = d - log2(total) folded into coef by the caller
        # (d >= log2 p, so the floor clamps no p > 0).
        g = e * (coef + coef_log2 * tl.maximum(d, LOG_FLOOR))
    else:
        g = e * coef
    return g


@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr,
    grad_ptr,
    labels_ptr,
    stats_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    tau_ptr,
    rows_per_outer,
    outer_step,
    inner_step,
    vocab_stride,
    grad_outer_step,
    grad_inner_step,
    grad_vocab_stride,
    labels_outer_stride,
    labels_inner_stride,
    grad_logp_outer_stride,
    grad_logp_inner_stride,
    grad_entropy_outer_stride,
    grad_entropy_inner_stride,
    vocab,
    inv_temperature,
    inv_temperature_lo,
    ignore_index,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
    TRUNCATED: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_per_outer
    inner = row % rows_per_outer
    # The row strides come divided by GROUP: the products show Triton that rows are GROUP-aligned.
    row_ptr = logits_ptr + (outer * outer_step + inner * inner_step) * GROUP
    grad_row_ptr = grad_ptr + (outer * grad_outer_step + inner * grad_inner_step) * GROUP
    label, valid, in_vocab = _row_label(
        labels_ptr, outer, inner, labels_outer_stride, labels_inner_stride, vocab, ignore_index
    )
    # Whole blocks unmasked, then one masked tail block, as in the forward.
    full_end = vocab - vocab % BLOCK_V
    cols = _block_offsets(0, GROUP, BLOCK_V)
    offsets = cols * vocab_stride
    grad_offsets = cols * grad_vocab_stride
    step = tl.full([], BLOCK_V, tl.int64) * vocab_stride
    grad_step = tl.full([], BLOCK_V, tl.int64) * grad_vocab_stride
    block_ptr = row_ptr
    grad_block_ptr = grad_row_ptr
    # Ignored and out-of-range rows pass no gradient: nothing of theirs is read, zeros are written.
    if valid & in_vocab:
        inv_t = scalar(inv_temperature, inv_temperature_lo, ACC)
        log2e, ln2 = _log2e_ln2(ACC)
        scale2 = inv_t * log2e  # as the forward's
        shift_x = tl.load(stats_ptr + 2 * row).to(ACC)
        log_sum = tl.load(stats_ptr + (2 * row + 1)).to(ACC)
        g_logp = tl.zeros([], ACC)
        if HAS_GRAD_LOGP:
            g_logp = tl.load(grad_logp_ptr + outer * grad_logp_outer_stride + inner * grad_logp_inner_stride).to(ACC)
        # dL/dz_j = g_logp * ([j == label] - p_j) - g_entropy * p_j * (log p_j + H); times inv_t for the logits.
        coef = -g_logp * inv_t
        coef_log = tl.zeros([], ACC)
        if HAS_GRAD_ENTROPY:
            g_entropy = tl.load(
                grad_entropy_ptr + outer * grad_entropy_outer_stride + inner * grad_entropy_inner_stride
            ).to(ACC)
            entropy = tl.load(entropy_ptr + row).to(ACC)
            coef_log = -g_entropy * inv_t
            coef += coef_log * (entropy - log_sum)
        # p = 2**d / total with total = exp(log_sum): 1 / total is one factor of the row
        inv_total = tl.math.exp2(-log_sum * log2e)
        coef_log2 = coef_log * ln2 * inv_total  # per unit of d (base-2 units)
        coef_p = coef * inv_total
        # The label column is read before the loop (an in-place backward overwrites it) and
        # written again after it with its extra g_logp term: no compare per logit.
        label_x = tl.load(row_ptr + label * vocab_stride).to(ACC)
        one_hot = g_logp * inv_t
        tau = tl.full([], float("-inf"), ACC)
        if TRUNCATED:  # the dropped tokens (x < tau) are -inf, as in the forward: p = 0, no gradient
            tau = tl.load(tau_ptr + row).to(ACC)
            one_hot = tl.where(label_x < tau, 0.0, one_hot)  # a dropped label's log-prob is -inf, a constant
            label_x = tl.where(label_x < tau, float("-inf"), label_x)
        for _ in range(0, full_end, BLOCK_V):
            x = _load_full_block(block_ptr, offsets, ACC, GROUP, BLOCK_V, BF16_PAIRS)
            if TRUNCATED:
                x = tl.where(x < tau, float("-inf"), x)
            g = _grad_block(x, scale2, shift_x, coef_p, coef_log2, HAS_GRAD_ENTROPY)
            tl.store(grad_block_ptr + grad_offsets, cast_for_store(g, grad_ptr))
            block_ptr += step
            grad_block_ptr += grad_step
        if full_end < vocab:
            in_row = cols < vocab - full_end
            x = tl.load(block_ptr + offsets, mask=in_row, other=float("-inf")).to(ACC)
            if TRUNCATED:
                x = tl.where(x < tau, float("-inf"), x)
            g = _grad_block(x, scale2, shift_x, coef_p, coef_log2, HAS_GRAD_ENTROPY)
            tl.store(grad_block_ptr + grad_offsets, cast_for_store(g, grad_ptr), mask=in_row)
        # Every thread's store to the label column is done (and visible) before it is rewritten.
        tl.debug_barrier()
        label_g = _grad_block(label_x, scale2, shift_x, coef_p, coef_log2, HAS_GRAD_ENTROPY) + one_hot
        tl.store(grad_row_ptr + label * grad_vocab_stride, cast_for_store(label_g, grad_ptr))
    else:
        zeros = tl.zeros([BLOCK_V // GROUP, GROUP], ACC)
        for _ in range(0, full_end, BLOCK_V):
            tl.store(grad_block_ptr + grad_offsets, cast_for_store(zeros, grad_ptr))
            grad_block_ptr += grad_step
        if full_end < vocab:
            tl.store(grad_block_ptr + grad_offsets, cast_for_store(zeros, grad_ptr), mask=cols < vocab - full_end)


def token_logprobs_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    *,
    block_v: int | None = None,
    tau: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logp, entropy or None, stats)``; logp and entropy have ``labels``' shape.

    float32 (float64 for float64 logits, computed in float64).  ``stats``
    (``labels.shape + (2,)``) holds each row's max logit (before the temperature)
    and ``log(sum(exp((logits - max) / temperature)))``; the backward needs them apart
    to form ``(x - max) / temperature`` exactly as the forward does (rows with
    an ignored or out-of-range label have none: they read no logits).

    ``logits`` is ``[N, V]`` or ``[B, T, V]`` with any strides (never copied);
    ``labels`` (any integer dtype, any strides, expanded included) has as many
    elements as there are rows, normally the leading shape.  A label that is
    neither ``ignore_index`` nor in ``[0, V)`` gives NaN log-prob and entropy and
    is never used as an address.  ``block_v`` overrides the heuristic (tests use it
    to cross block boundaries with a small V).  ``tau`` (``[rows]``, from
    :func:`truncation_thresholds`): the softmax over the logits ``>= tau`` of each row only.
    """
    lead_shape, rows_per_outer, outer_stride, inner_stride, vocab_stride = _row_layout(logits)
    check_same_device(logits=logits, labels=labels)
    labels_view, labels_outer_stride, labels_inner_stride = lead_view("labels", labels, lead_shape)
    vocab = logits.shape[-1]
    logp = torch.empty(labels.shape, dtype=result_dtype(logits), device=logits.device)
    stats = logp.new_empty(labels.shape + (2,))
    entropy = torch.empty_like(logp) if return_entropy else None
    rows = logp.numel()
    if rows == 0:
        return logp, entropy, stats
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocabulary dim")
    block, num_warps = _launch_config(vocab, block_v, logits.element_size())
    group = _group(block, vocab_stride, (logits, outer_stride, inner_stride))
    with device_guard(logits):
        _token_logprobs_fwd_kernel[(rows,)](
            logits,
            labels_view,
            logp,
            entropy if return_entropy else logp,  # unused when not RETURN_ENTROPY
            stats,
            logp if tau is None else tau,  # unused when not TRUNCATED
            rows_per_outer,
            outer_stride // group,
            inner_stride // group,
            vocab_stride,
            labels_outer_stride,
            labels_inner_stride,
            vocab,
            *split_scalar(1.0 / temperature),
            ignore_index,
            RETURN_ENTROPY=return_entropy,
            ACC=compute_dtype(logp.dtype),
            BLOCK_V=block,
            GROUP=group,
            BF16_PAIRS=logits.dtype == torch.bfloat16 and group >= 2,
            TRUNCATED=tau is not None,
            num_warps=num_warps,
        )
    return logp, entropy, stats


def truncation_thresholds(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, ignore_index: int, truncation: Truncation
) -> torch.Tensor:
    """Each row's threshold ``tau`` (a logit of the row, before the temperature; ``-inf``: not truncated),
    ``[rows]`` in the compute dtype: the sampler keeps the logits ``>= tau`` (``_truncation``)."""
    lead_shape, rows_per_outer, outer_stride, inner_stride, vocab_stride = _row_layout(logits)
    check_same_device(logits=logits, labels=labels)
    labels_view, labels_outer_stride, labels_inner_stride = lead_view("labels", labels, lead_shape)
    acc = torch.float64 if result_dtype(logits) == torch.float64 else torch.float32
    with device_guard(logits):
        return thresholds(
            logits,
            labels_view,
            (rows_per_outer, outer_stride, inner_stride, vocab_stride),
            (labels_outer_stride, labels_inner_stride),
            1.0 / temperature,
            ignore_index,
            truncation=truncation,
            acc_dtype=acc,
        )


def _saved_views(lead_shape, rows, stats, entropy, grad_logprobs, grad_entropy):
    """The backward's row-wise inputs as the kernel reads them: ``stats`` [rows, 2] and
    ``entropy`` [rows] contiguous (from the forward), the incoming gradients with their
    (outer, inner) strides; an unused one is replaced by ``stats`` (never read)."""
    # stats and entropy come from the forward: [rows]-sized, contiguous unless a caller made them otherwise.
    if stats.numel() != 2 * rows:
        raise ValueError(f"stats must have {2 * rows} elements (2 per row), got shape {tuple(stats.shape)}")
    stats = stats.reshape(rows, 2).contiguous()
    unused = (stats, 0, 0)
    if grad_entropy is not None:
        if entropy is None:
            raise ValueError("the entropy gradient needs the forward's entropy")
        entropy = lead_view("entropy", entropy, lead_shape)[0].reshape(-1).contiguous()
        grad_entropy = lead_view("grad_entropy", grad_entropy, lead_shape)
    else:
        entropy, grad_entropy = stats, unused
    grad_logprobs = lead_view("grad_logprobs", grad_logprobs, lead_shape) if grad_logprobs is not None else unused
    return stats, entropy, grad_logprobs, grad_entropy


def _row_thresholds(logits: torch.Tensor, tau: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """The forward's thresholds as the backward reads them: ``[rows]``, contiguous, on the logits' device."""
    if tau is None:
        return None
    check_same_device(logits=logits, tau=tau)
    if tau.numel() != rows:
        raise ValueError(f"tau must have {rows} elements (1 per row), got shape {tuple(tau.shape)}")
    return tau.reshape(rows).contiguous()


def token_logprobs_backward(
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    temperature: float,
    ignore_index: int,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    tau: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. ``logits`` (in their dtype), the softmax recomputed from the forward's ``stats``.

    ``grad_logprobs`` or ``grad_entropy`` may be None (that output unused; ``entropy`` is needed only with
    ``grad_entropy``); any strides.  Written into ``out`` when given (``logits`` itself: each block is read
    before it is overwritten, so ``out`` must not overlap itself, as the caller checks), else a new tensor."""
    lead_shape, rows_per_outer, outer_stride, inner_stride, vocab_stride = _row_layout(logits)
    devices = dict(logits=logits, labels=labels, stats=stats, entropy=entropy, out=out)
    check_same_device(**devices, grad_logprobs=grad_logprobs, grad_entropy=grad_entropy)
    if out is not None and (out.shape != logits.shape or out.dtype != logits.dtype):
        raise ValueError(f"out must have the logits' shape {tuple(logits.shape)} and dtype {logits.dtype}")
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out
    rows = math.prod(lead_shape)
    if rows == 0 or logits.shape[-1] == 0:
        return grad
    labels_view, labels_outer_stride, labels_inner_stride = lead_view("labels", labels, lead_shape)
    has_grad_logp, has_grad_entropy = grad_logprobs is not None, grad_entropy is not None
    stats, entropy, (grad_logprobs, *grad_logp_strides), (grad_entropy, *grad_entropy_strides) = _saved_views(
        lead_shape, rows, stats, entropy, grad_logprobs, grad_entropy
    )
    _, _, grad_outer_stride, grad_inner_stride, grad_vocab_stride = _row_layout(grad)
    tau = _row_thresholds(logits, tau, rows)
    block, num_warps = _launch_config(logits.shape[-1], block_v, logits.element_size(), backward=True)
    group = _group(
        block,
        vocab_stride if grad_vocab_stride == 1 else 0,
        (logits, outer_stride, inner_stride),
        (grad, grad_outer_stride, grad_inner_stride),
    )
    with device_guard(logits):
        _token_logprobs_bwd_kernel[(rows,)](
            logits,
            grad,
            labels_view,
            stats,
            entropy,
            grad_logprobs,
            grad_entropy,
            stats if tau is None else tau,  # unused when not TRUNCATED
            rows_per_outer,
            outer_stride // group,
            inner_stride // group,
            vocab_stride,
            grad_outer_stride // group,
            grad_inner_stride // group,
            grad_vocab_stride,
            labels_outer_stride,
            labels_inner_stride,
            *grad_logp_strides,
            *grad_entropy_strides,
            logits.shape[-1],
            *split_scalar(1.0 / temperature),
            ignore_index,
            HAS_GRAD_LOGP=has_grad_logp,
            HAS_GRAD_ENTROPY=has_grad_entropy,
            ACC=compute_dtype(result_dtype(logits)),
            BLOCK_V=block,
            GROUP=group,
            BF16_PAIRS=logits.dtype == torch.bfloat16 and group >= 2,
            TRUNCATED=tau is not None,
            num_warps=num_warps,
        )
    return grad


# --------------------------------------------------------------------------- torch custom op and autograd


@custom_op("ppo_fast_triton::token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    inplace_backward: bool,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, stats, tau)``; entropy is empty without ``return_entropy``; ``stats`` and, under the
    sampler's truncation, ``tau [rows]`` (each row's threshold, ``truncation_thresholds``) are for the backward,
    which reads ``inplace_backward``."""
    truncation = Truncation(top_k, top_p, min_p)
    tau = truncation_thresholds(logits, labels, temperature, ignore_index, truncation) if truncation.active else None
    logp, entropy, stats = token_logprobs_forward(logits, labels, temperature, return_entropy, ignore_index, tau=tau)
    # An output of a custom op aliases no other: an empty tensor each for what is not computed.
    entropy = entropy if return_entropy else logp.new_empty(0)
    return logp, entropy, stats, (logp.new_empty(0) if tau is None else tau)


@_token_logprobs_op.register_fake
def _(logits, labels, temperature, return_entropy, ignore_index, inplace_backward, top_k=0, top_p=1.0, min_p=0.0):
    logp = labels.new_empty(labels.shape, dtype=result_dtype(logits))
    entropy = logp.new_empty(labels.shape if return_entropy else (0,))
    tau = logp.new_empty((labels.numel(),) if Truncation(top_k, top_p, min_p).active else (0,))
    return logp, entropy, logp.new_empty(labels.shape + (2,)), tau


@custom_op("ppo_fast_triton::token_logprobs_backward", mutates_args=())
def _token_logprobs_backward_op(
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float,
    ignore_index: int,
    tau: torch.Tensor | None = None,
) -> torch.Tensor:
    return token_logprobs_backward(
        grad_logprobs,
        grad_entropy,
        logits,
        labels,
        stats,
        entropy,
        temperature=temperature,
        ignore_index=ignore_index,
        tau=tau,
    )


@_token_logprobs_backward_op.register_fake
def _(grad_logprobs, grad_entropy, logits, labels, stats, entropy, temperature, ignore_index, tau=None):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@custom_op("ppo_fast_triton::token_logprobs_backward_inplace", mutates_args=("logits",))
def _token_logprobs_backward_inplace_op(
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    logits: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float,
    ignore_index: int,
    tau: torch.Tensor | None = None,
) -> None:
    """Writes the gradient into ``logits``; only for logits whose memory is non-overlapping and dense."""
    if not is_non_overlapping_and_dense(logits):
        raise ValueError("an in-place backward needs logits whose memory is non-overlapping and dense")
    token_logprobs_backward(
        grad_logprobs,
        grad_entropy,
        logits,
        labels,
        stats,
        entropy,
        temperature=temperature,
        ignore_index=ignore_index,
        out=logits,
        tau=tau,
    )


@_token_logprobs_backward_inplace_op.register_fake
def _(grad_logprobs, grad_entropy, logits, labels, stats, entropy, temperature, ignore_index, tau=None):
    return None


def _token_logprobs_setup(ctx, inputs, output):
    logits, labels, ctx.temperature, ctx.return_entropy, ctx.ignore_index, inplace_backward, *truncation = inputs
    # In place only where every element of the logits has its own address: an expanded
    # (stride-0) or otherwise overlapping tensor would have its rows' gradients written
    # over one another.  Else the backward allocates the gradient, as without the flag.
    ctx.inplace_backward = inplace_backward and is_non_overlapping_and_dense(logits)
    ctx.truncated = Truncation(*truncation).active
    _, entropy, stats, tau = output
    ctx.save_for_backward(logits, labels, stats, entropy, tau)
    ctx.mark_non_differentiable(stats, tau)
    ctx.set_materialize_grads(False)  # an unused output needs no term in the backward


def _logits_gradient(ctx, grad_logprobs, grad_entropy, logits, labels, stats, *, entropy, tau=None):
    if not ctx.return_entropy:
        grad_entropy = None  # the placeholder output (empty) has no gradient to pass
    args = (grad_logprobs, grad_entropy, logits, labels, stats, entropy, ctx.temperature, ctx.ignore_index)
    if ctx.inplace_backward:
        call(_token_logprobs_backward_inplace_op, *args, tau)
        return logits
    return call(_token_logprobs_backward_op, *args, tau)


def _token_logprobs_backward(ctx, grad_logprobs, grad_entropy, _grad_stats, _grad_tau):
    not_differentiable(ctx, labels=1)
    logits, labels, stats, entropy, tau = ctx.saved_tensors
    grad_logits = _logits_gradient(
        ctx, grad_logprobs, grad_entropy, logits, labels, stats, entropy=entropy, tau=tau if ctx.truncated else None
    )
    return grad_logits, *(None,) * (len(ctx.needs_input_grad) - 1)


_token_logprobs = with_autograd(_token_logprobs_op, _token_logprobs_backward, _token_logprobs_setup)


def token_logprobs(
    logits, labels, temperature, return_entropy, ignore_index, inplace_backward=False, *, truncation=NO_TRUNCATION
):
    """``inplace_backward`` lets the backward write the gradient into the logits' buffer, only when
    their memory is non-overlapping and dense (else, e.g. for expanded logits, it allocates one).
    With ``truncation`` active, the softmax is over the tokens the sampler keeps (``_truncation``)."""
    logp, entropy, _, _ = _token_logprobs(
        logits, labels, temperature, return_entropy, ignore_index, inplace_backward, *truncation
    )
    return logp, (entropy if return_entropy else None)


def static_variants(rows: int = 16384, vocab: int = 151936) -> list[dict]:
    """This op's kernel launches for ``bench.static`` (sm_90 code compiled without a GPU), on meta tensors.

    One dict per variant: ``name``, ``run`` (calls a launcher), ``budget_key`` (a key of
    ``bench.static.BUDGETS`` or None), ``bytes_per_element`` (global memory read + written
    per logit), ``vector_loads_expected`` (128-bit loads required: bf16, V % 8 == 0).
    """
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

    def meta(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    def layout(dtype_name, vocab, lead=(rows,), slice_last=False, entropy_flags=(False, True), grads=None):
        dtype = dtypes[dtype_name]
        size = dtype.itemsize
        shape = f"[{', '.join(map(str, lead))}, {vocab}]" + (" sliced [:, :-1]" if slice_last else "")
        vector = dtype_name == "bf16" and vocab % 8 == 0
        budgeted = dtype_name != "fp64" and vocab * size % 16 == 0

        def logits_labels():
            logits = meta((lead[0], lead[1] + 1, vocab), dtype)[:, :-1] if slice_last else meta(lead + (vocab,), dtype)
            return logits, meta(logits.shape[:-1], torch.int64)

        def forward(entropy):
            logits, labels = logits_labels()
            return token_logprobs_forward(logits, labels, 0.7, entropy, -100)

        def backward(has_logp, has_entropy):
            logits, labels = logits_labels()
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            stats, row = meta(labels.shape + (2,), acc), meta(labels.shape, acc)
            return token_logprobs_backward(
                row if has_logp else None,
                row if has_entropy else None,
                logits,
                labels,
                stats,
                row,
                temperature=0.7,
                ignore_index=-100,
            )

        out = []
        for entropy in entropy_flags:
            key = "token_logprobs fwd+entropy" if entropy else "token_logprobs fwd"
            out.append(
                dict(
                    name=f"{key} {dtype_name} {shape}",
                    budget_key=key if budgeted else None,
                    bytes_per_element=size,
                    run=lambda e=entropy: forward(e),
                    vector_loads_expected=vector,
                )
            )
        for has_logp, has_entropy in grads if grads is not None else ((True, False), (True, True), (False, True)):
            what = "+".join(n for n, on in (("logp", has_logp), ("entropy", has_entropy)) if on)
            key = "token_logprobs bwd+entropy" if has_entropy else "token_logprobs bwd"
            out.append(
                dict(
                    name=f"token_logprobs bwd({what}) {dtype_name} {shape}",
                    budget_key=key if budgeted else None,
                    bytes_per_element=2 * size,
                    run=lambda lp=has_logp, en=has_entropy: backward(lp, en),
                    vector_loads_expected=vector,
                )
            )
        return out

    variants = [v for dtype_name in dtypes for v in layout(dtype_name, vocab)]
    variants += layout("bf16", 32008, grads=((True, False),))  # V % 8 == 0 but not % 16
    variants += layout("bf16", 50257, entropy_flags=(False,), grads=((True, False),))  # odd V: no vector loads possible
    variants += layout("bf16", vocab, lead=(8, 2048), slice_last=True, entropy_flags=(False,), grads=((True, False),))
    return variants + _truncated_static_variants(rows, vocab)


def _truncated_static_variants(rows: int, vocab: int) -> list[dict]:
    """The truncation's launches for ``bench.static``: the threshold kernel per truncation (its hot loop is
    one bisection step: a pass over the row, counted per logit) and the TRUNCATED forward and backward."""
    out, acc = [], torch.float32
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):

        def inputs(dtype=dtype):
            logits = torch.empty((rows, vocab), dtype=dtype, device="meta")
            return logits, torch.empty((rows,), dtype=torch.int64, device="meta")

        shape = f"{dtype_name} [{rows}, {vocab}]"
        for what, truncation in (("top_k=50", Truncation(top_k=50)), ("top_p=0.9", Truncation(top_p=0.9))):
            out.append(
                dict(
                    name=f"token_logprobs thresholds {what} {shape}",
                    budget_key=None,
                    bytes_per_element=dtype.itemsize,
                    run=lambda t=truncation, inputs=inputs: truncation_thresholds(*inputs(), 0.7, -100, t),
                )
            )

        def forward(inputs=inputs):
            logits, labels = inputs()
            tau = torch.empty((rows,), dtype=acc, device="meta")
            return token_logprobs_forward(logits, labels, 0.7, True, -100, tau=tau)

        def backward(inputs=inputs):
            logits, labels = inputs()
            row, stats = (
                torch.empty((rows,), dtype=acc, device="meta"),
                torch.empty((rows, 2), dtype=acc, device="meta"),
            )
            return token_logprobs_backward(
                row, row, logits, labels, stats, row, temperature=0.7, ignore_index=-100, tau=row
            )

        for name, run, size in (("fwd+entropy", forward, 1), ("bwd(logp+entropy)", backward, 2)):
            out.append(
                dict(
                    name=f"token_logprobs {name} truncated {shape}",
                    budget_key=None,
                    bytes_per_element=size * dtype.itemsize,
                    run=run,
                    vector_loads_expected=dtype == torch.bfloat16,
                )
            )
    return out
