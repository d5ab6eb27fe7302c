"""Fused log-softmax + gather: the chosen token's log-prob (and the entropy) per row.

One program per row of logits (a 1-D grid, so millions of rows fit), the
vocabulary streamed in ``BLOCK_V`` blocks with an online max / sum-exp: the
logits are read once in the forward and once in the backward, and nothing of
size ``[N, V]`` is allocated except the gradient (not even that with
``inplace``).  Temperature is folded in: ``z = logits / temperature``.

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

from ._dtypes import cast_for_store, compute_dtype, result_dtype, scalar, split_scalar
from ._launch import check_same_device, device_guard, lead_view

# Widest vocabulary block; a larger V loops over blocks.
MAX_BLOCK_V = 4096


def _launch_config(vocab: int, block_v: int | None) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a vocabulary: wide blocks, more warps as they grow."""
    block = block_v or min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    num_warps = 4 if block <= 1024 else 8
    return block, num_warps


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
def _token_logprobs_fwd_kernel(
    logits_ptr,
    labels_ptr,
    logp_ptr,
    entropy_ptr,
    stats_ptr,
    rows_per_outer,
    outer_stride,
    inner_stride,
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
):
    row = tl.program_id(0).to(tl.int64)
    # int64 row: every product below (row index * stride) is int64, whatever the strides' type.
    outer = row // rows_per_outer
    inner = row % rows_per_outer
    row_ptr = logits_ptr + outer * outer_stride + inner * inner_stride
    label, valid, in_vocab = _row_label(labels_ptr, outer, inner, labels_outer_stride, labels_inner_stride, vocab, ignore_index)
    # Ignored and out-of-range rows read no logits: their loop is empty.
    row_vocab = tl.where(valid & in_vocab, vocab, 0)
    inv_t = scalar(inv_temperature, inv_temperature_lo, ACC)
    cols = tl.arange(0, BLOCK_V).to(tl.int64)

    run_max = tl.full([], float("-inf"), ACC)
    # sum exp(z - run_max) and, for the entropy, sum exp(z - run_max) * (z - run_max).
    sum_exp = tl.zeros([], ACC)
    weighted = tl.zeros([], ACC)
    for start in range(0, row_vocab, BLOCK_V):
        idx = start + cols
        z = tl.load(row_ptr + idx * vocab_stride, mask=idx < vocab, other=float("-inf")).to(ACC) * inv_t
        new_max = tl.maximum(run_max, tl.max(z, 0))
        # While every z so far is -inf, shift by 0 so that -inf - -inf never appears.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        e = tl.exp(z - shift)
        rescale = tl.exp(run_max - shift)
        if RETURN_ENTROPY:
            # -inf logits have e == 0 and contribute nothing (0 * -inf would be NaN).
            block_weighted = tl.sum(e * tl.where(e > 0, z - shift, 0.0), 0)
            # Re-base the old terms to the new shift (nothing to re-base while run_max is -inf).
            rebase = (tl.where(sum_exp > 0, run_max, shift) - shift) * sum_exp
            weighted = rescale * (weighted + rebase) + block_weighted
        sum_exp = sum_exp * rescale + tl.sum(e, 0)
        run_max = new_max

    shift = tl.where(run_max == float("-inf"), 0.0, run_max)
    log_sum = tl.log(sum_exp)
    # Row 0's address for a row whose label is not a column (never a read outside the row).
    chosen = tl.load(row_ptr + tl.where(in_vocab, label, 0) * vocab_stride, mask=valid & in_vocab, other=0.0).to(ACC) * inv_t
    # (z - shift) - log_sum, not z - logsumexp: the logsumexp rounds at the logits' magnitude.
    logp = tl.where(in_vocab, (chosen - shift) - log_sum, float("nan"))
    tl.store(logp_ptr + row, tl.where(valid, logp, 0.0))
    tl.store(stats_ptr + 2 * row, shift)
    tl.store(stats_ptr + (2 * row + 1), log_sum)
    if RETURN_ENTROPY:
        # H = logsumexp - E[z] = log(sum_exp) - E[z - shift]
        entropy = tl.where(in_vocab, log_sum - weighted / sum_exp, float("nan"))
        tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))


@triton.jit
def _token_logprobs_bwd_kernel(
    logits_ptr,
    grad_ptr,
    labels_ptr,
    stats_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    rows_per_outer,
    outer_stride,
    inner_stride,
    vocab_stride,
    grad_outer_stride,
    grad_inner_stride,
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
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // rows_per_outer
    inner = row % rows_per_outer
    row_ptr = logits_ptr + outer * outer_stride + inner * inner_stride
    grad_row_ptr = grad_ptr + outer * grad_outer_stride + inner * grad_inner_stride
    label, valid, in_vocab = _row_label(labels_ptr, outer, inner, labels_outer_stride, labels_inner_stride, vocab, ignore_index)
    # Ignored and out-of-range rows pass no gradient: nothing of theirs is read, zeros are written.
    row_ok = valid & in_vocab
    inv_t = scalar(inv_temperature, inv_temperature_lo, ACC)
    shift = tl.load(stats_ptr + 2 * row, mask=row_ok, other=0.0).to(ACC)
    log_sum = tl.load(stats_ptr + (2 * row + 1), mask=row_ok, other=0.0).to(ACC)
    g_logp = tl.zeros([], ACC)
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + outer * grad_logp_outer_stride + inner * grad_logp_inner_stride, mask=row_ok, other=0.0).to(ACC)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(
            grad_entropy_ptr + outer * grad_entropy_outer_stride + inner * grad_entropy_inner_stride, mask=row_ok, other=0.0
        ).to(ACC)
        entropy = tl.load(entropy_ptr + row, mask=row_ok, other=0.0).to(ACC)
    cols = tl.arange(0, BLOCK_V).to(tl.int64)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        in_row = idx < vocab
        z = tl.load(row_ptr + idx * vocab_stride, mask=in_row & row_ok, other=float("-inf")).to(ACC) * inv_t
        log_p = (z - shift) - log_sum
        p = tl.exp(log_p)
        grad_z = tl.where(idx == label, g_logp, 0.0) - p * g_logp
        if HAS_GRAD_ENTROPY:
            # dH/dz_j = -p_j (log p_j + H), 0 where p_j == 0 (log p_j = -inf).
            grad_z -= p * (tl.where(p > 0, log_p, 0.0) + entropy) * g_entropy
        grad_z = tl.where(row_ok, grad_z * inv_t, 0.0)
        tl.store(grad_row_ptr + idx * grad_vocab_stride, cast_for_store(grad_z, grad_ptr), mask=in_row)


def token_logprobs_forward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logp, entropy or None, stats)``; logp and entropy have ``labels``' shape.

    float32 (float64 for float64 logits, computed in float64).  ``stats``
    (``labels.shape + (2,)``) holds each row's max of ``z = logits / temperature``
    and ``log(sum(exp(z - max)))``, whose sum is the logsumexp; the backward needs
    them apart to keep ``z - logsumexp`` exact when the logits are large (rows with
    an ignored or out-of-range label have none: they read no logits).

    ``logits`` is ``[N, V]`` or ``[B, T, V]`` with any strides (never copied);
    ``labels`` (any integer dtype, any strides, expanded included) has as many
    elements as there are rows, normally the leading shape.  A label that is
    neither ``ignore_index`` nor in ``[0, V)`` gives NaN log-prob and entropy and
    is never used as an address.  ``block_v`` overrides the heuristic (tests use it
    to cross block boundaries with a small V).
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
    block, num_warps = _launch_config(vocab, block_v)
    with device_guard(logits):
        _token_logprobs_fwd_kernel[(rows,)](
            logits,
            labels_view,
            logp,
            entropy if return_entropy else logp,  # unused when not RETURN_ENTROPY
            stats,
            rows_per_outer,
            outer_stride,
            inner_stride,
            vocab_stride,
            labels_outer_stride,
            labels_inner_stride,
            vocab,
            *split_scalar(1.0 / temperature),
            ignore_index,
            RETURN_ENTROPY=return_entropy,
            ACC=compute_dtype(logp.dtype),
            BLOCK_V=block,
            num_warps=num_warps,
        )
    return logp, entropy, stats


def token_logprobs_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. ``logits`` (in their dtype), the softmax recomputed from the forward's ``stats``.

    ``grad_logp`` or ``grad_entropy`` may be None (that output unused; ``entropy``
    is needed only with ``grad_entropy``).  All may have any strides (a gradient
    expanded from a sum has stride 0).  The gradient is written into ``out`` when
    given (it may be ``logits`` itself: each block is read before it is
    overwritten, so ``out`` must then not overlap itself: the caller checks
    that), else into a new contiguous tensor.
    """
    lead_shape, rows_per_outer, outer_stride, inner_stride, vocab_stride = _row_layout(logits)
    check_same_device(logits=logits, labels=labels, stats=stats, entropy=entropy, grad_logp=grad_logp, grad_entropy=grad_entropy, out=out)
    if out is not None and (out.shape != logits.shape or out.dtype != logits.dtype):
        raise ValueError(f"out must have the logits' shape {tuple(logits.shape)} and dtype {logits.dtype}")
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out
    rows = math.prod(lead_shape)
    if rows == 0 or logits.shape[-1] == 0:
        return grad
    labels_view, labels_outer_stride, labels_inner_stride = lead_view("labels", labels, lead_shape)
    # stats and entropy come from the forward: [rows]-sized, contiguous unless a caller made them otherwise.
    if stats.numel() != 2 * rows:
        raise ValueError(f"stats must have {2 * rows} elements (2 per row), got shape {tuple(stats.shape)}")
    stats = stats.reshape(rows, 2).contiguous()
    has_grad_logp, has_grad_entropy = grad_logp is not None, grad_entropy is not None
    if has_grad_entropy:
        if entropy is None:
            raise ValueError("the entropy gradient needs the forward's entropy")
        entropy = lead_view("entropy", entropy, lead_shape)[0].reshape(-1).contiguous()
        grad_entropy, grad_entropy_outer_stride, grad_entropy_inner_stride = lead_view("grad_entropy", grad_entropy, lead_shape)
    else:
        entropy, grad_entropy, grad_entropy_outer_stride, grad_entropy_inner_stride = stats, stats, 0, 0  # unused
    if has_grad_logp:
        grad_logp, grad_logp_outer_stride, grad_logp_inner_stride = lead_view("grad_logp", grad_logp, lead_shape)
    else:
        grad_logp, grad_logp_outer_stride, grad_logp_inner_stride = stats, 0, 0  # unused
    _, _, grad_outer_stride, grad_inner_stride, grad_vocab_stride = _row_layout(grad)
    block, num_warps = _launch_config(logits.shape[-1], block_v)
    with device_guard(logits):
        _token_logprobs_bwd_kernel[(rows,)](
            logits,
            grad,
            labels_view,
            stats,
            entropy,
            grad_logp,
            grad_entropy,
            rows_per_outer,
            outer_stride,
            inner_stride,
            vocab_stride,
            grad_outer_stride,
            grad_inner_stride,
            grad_vocab_stride,
            labels_outer_stride,
            labels_inner_stride,
            grad_logp_outer_stride,
            grad_logp_inner_stride,
            grad_entropy_outer_stride,
            grad_entropy_inner_stride,
            logits.shape[-1],
            *split_scalar(1.0 / temperature),
            ignore_index,
            HAS_GRAD_LOGP=has_grad_logp,
            HAS_GRAD_ENTROPY=has_grad_entropy,
            ACC=compute_dtype(result_dtype(logits)),
            BLOCK_V=block,
            num_warps=num_warps,
        )
    return grad
