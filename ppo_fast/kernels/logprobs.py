"""Fused log-softmax + gather: the chosen token's log-prob (and the entropy) per row.

One program per row of logits (a 1-D grid, so millions of rows fit), the
vocabulary streamed in ``BLOCK_V`` blocks with an online max / sum-exp: the
logits are read once in the forward and once in the backward, and nothing of
size ``[N, V]`` is allocated except the gradient (not even that with
``inplace``).  Temperature is folded in: ``z = logits / temperature``.

Rows are addressed as ``[B, T, V]`` with arbitrary strides on the leading dims
(a ``[N, V]`` input is ``B = N, T = 1``), so slices such as ``logits[:, :-1]``
are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dtypes import compute_dtype, result_dtype

# Widest vocabulary block; a larger V loops over blocks.
MAX_BLOCK_V = 4096


def _launch_config(vocab: int, block_v: int | None) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a vocabulary: wide blocks, more warps as they grow."""
    block = block_v or min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    num_warps = 4 if block <= 1024 else 8
    return block, num_warps


def _row_layout(x: torch.Tensor) -> tuple[int, int, int, int]:
    """``(rows, rows_per_outer, outer_stride, inner_stride)`` of a ``[N, V]`` or ``[B, T, V]`` tensor."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


@triton.jit
def _row_pointer(base_ptr, row, rows_per_outer, outer_stride, inner_stride):
    # int64: row * stride exceeds 2**31 for large N * V.
    return base_ptr + (row // rows_per_outer) * outer_stride + (row % rows_per_outer) * inner_stride


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
    vocab,
    inv_temperature,
    ignore_index,
    RETURN_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = _row_pointer(logits_ptr, row, rows_per_outer, outer_stride, inner_stride)
    inv_t = tl.cast(inv_temperature, ACC)
    cols = tl.arange(0, BLOCK_V)

    run_max = tl.full([], float("-inf"), ACC)
    # sum exp(z - run_max) and, for the entropy, sum exp(z - run_max) * (z - run_max).
    sum_exp = tl.zeros([], ACC)
    weighted = tl.zeros([], ACC)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        z = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(ACC) * inv_t
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
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    chosen = tl.load(row_ptr + tl.where(valid, label, 0)).to(ACC) * inv_t
    # (z - shift) - log_sum, not z - logsumexp: the logsumexp rounds at the logits' magnitude.
    tl.store(logp_ptr + row, tl.where(valid, (chosen - shift) - log_sum, 0.0))
    tl.store(stats_ptr + 2 * row, shift)
    tl.store(stats_ptr + 2 * row + 1, log_sum)
    if RETURN_ENTROPY:
        # H = logsumexp - E[z] = log(sum_exp) - E[z - shift]
        entropy = log_sum - weighted / sum_exp
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
    grad_outer_stride,
    grad_inner_stride,
    vocab,
    inv_temperature,
    ignore_index,
    HAS_GRAD_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = _row_pointer(logits_ptr, row, rows_per_outer, outer_stride, inner_stride)
    grad_row_ptr = _row_pointer(grad_ptr, row, rows_per_outer, grad_outer_stride, grad_inner_stride)
    inv_t = tl.cast(inv_temperature, ACC)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    shift = tl.load(stats_ptr + 2 * row).to(ACC)
    log_sum = tl.load(stats_ptr + 2 * row + 1).to(ACC)
    g_logp = tl.load(grad_logp_ptr + row).to(ACC)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(grad_entropy_ptr + row).to(ACC)
        entropy = tl.load(entropy_ptr + row).to(ACC)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, vocab, BLOCK_V):
        idx = start + cols
        in_vocab = idx < vocab
        z = tl.load(row_ptr + idx, mask=in_vocab, other=float("-inf")).to(ACC) * inv_t
        log_p = (z - shift) - log_sum
        p = tl.exp(log_p)
        grad_z = tl.where(idx == label, g_logp, 0.0) - p * g_logp
        if HAS_GRAD_ENTROPY:
            # dH/dz_j = -p_j (log p_j + H), 0 where p_j == 0 (log p_j = -inf).
            grad_z -= p * (tl.where(p > 0, log_p, 0.0) + entropy) * g_entropy
        # Ignored rows pass no gradient, whatever their logits hold.
        grad_z = tl.where(valid, grad_z * inv_t, 0.0)
        tl.store(grad_row_ptr + idx, grad_z.to(grad_ptr.dtype.element_ty), mask=in_vocab)


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
    them apart to keep ``z - logsumexp`` exact when the logits are large.

    ``logits`` is ``[N, V]`` or ``[B, T, V]`` with ``stride(-1) == 1``; ``labels``
    has the leading shape.  ``block_v`` overrides the heuristic (tests use it to
    cross block boundaries with a small V).
    """
    rows, rows_per_outer, outer_stride, inner_stride = _row_layout(logits)
    vocab = logits.shape[-1]
    logp = torch.empty(labels.shape, dtype=result_dtype(logits), device=logits.device)
    stats = logp.new_empty(labels.shape + (2,))
    entropy = torch.empty_like(logp) if return_entropy else None
    if rows == 0:
        return logp, entropy, stats
    block, num_warps = _launch_config(vocab, block_v)
    _token_logprobs_fwd_kernel[(rows,)](
        logits,
        labels.reshape(-1),
        logp,
        entropy if return_entropy else logp,  # unused when not RETURN_ENTROPY
        stats,
        rows_per_outer,
        outer_stride,
        inner_stride,
        vocab,
        1.0 / temperature,
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
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. ``logits`` (in their dtype), the softmax recomputed from the forward's ``stats``.

    ``grad_entropy`` may be None (no entropy gradient).  The gradient is written
    into ``out`` when given (it may be ``logits`` itself: each block is read
    before it is overwritten), else into a new contiguous tensor.
    """
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out
    rows, rows_per_outer, outer_stride, inner_stride = _row_layout(logits)
    if rows == 0:
        return grad
    _, _, grad_outer_stride, grad_inner_stride = _row_layout(grad)
    has_grad_entropy = grad_entropy is not None
    block, num_warps = _launch_config(logits.shape[-1], block_v)
    _token_logprobs_bwd_kernel[(rows,)](
        logits,
        grad,
        labels.reshape(-1),
        stats,
        entropy.reshape(-1) if has_grad_entropy else stats,
        grad_logp.reshape(-1).contiguous(),
        grad_entropy.reshape(-1).contiguous() if has_grad_entropy else stats,  # unused without HAS_GRAD_ENTROPY
        rows_per_outer,
        outer_stride,
        inner_stride,
        grad_outer_stride,
        grad_inner_stride,
        logits.shape[-1],
        1.0 / temperature,
        ignore_index,
        HAS_GRAD_ENTROPY=has_grad_entropy,
        ACC=compute_dtype(stats.dtype),
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return grad
