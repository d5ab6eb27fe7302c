"""GAE as two reverse linear scans per row, with the carry passed between chunks.

Scanning a row from its end, each token is an affine map ``x -> coef * x + offset``:

* the next valid value ``nv_t = v_{t+1}`` if token ``t+1`` is valid, else ``nv_{t+1}``
  (coef 0 / offset ``v_{t+1}``, or coef 1 / offset 0);
* the advantage ``A_t = delta_t + gamma*lam*A_{t+1}`` at a valid token, else
  ``A_{t+1}`` (coef 1 / offset 0: a masked token passes the carry through),
  with ``delta_t = r_t + gamma*nv_t - v_t``.

Each chunk of ``BLOCK_T`` tokens is loaded in reversed order, so a forward
``tl.associative_scan`` runs backwards in time; the value of both recurrences at
the chunk's first token is the carry into the next chunk, so any T works.

Every input (rewards, values, mask, the output gradients) is read through its
strides, so sliced, transposed and expanded inputs are read in place; addresses
are int64.  Masked positions are never read (NaN/inf there is ignored) and get
exactly 0 in every output and gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dtypes import cast_for_store, compute_dtype, result_dtype, scalar, split_scalar
from ._eager import call, custom_op, with_autograd
from ._launch import DEVICES, check_same_device, check_shape, device_guard, not_differentiable

SUPPORTED = {"gae": DEVICES}

MAX_BLOCK_T = 1024


@triton.jit
def _compose_affine(coef_a, offset_a, coef_b, offset_b):
    # a: the maps already applied (later tokens), b: the next one.
    return coef_a * coef_b, coef_b * offset_a + offset_b


@triton.jit
def _gae_chunk(
    rows,
    strides,
    outs,
    t,
    inside,
    length,
    carry_advantage,
    carry_next_value,
    gamma,
    gamma_lam,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One chunk of a row's reverse scan (tokens ``t``, latest first; ``rows``: the row's rewards,
    values and mask, ``outs``: its advantages and returns), padded and packed kernels alike: the
    carries after it."""
    rewards_row, values_row, mask_row = rows
    rewards_stride, values_stride, mask_stride = strides
    following_inside = inside & (t + 1 < length)
    valid = tl.load(mask_row + t * mask_stride, mask=inside, other=0) != 0
    following_valid = tl.load(mask_row + (t + 1) * mask_stride, mask=following_inside, other=0) != 0
    following_value = tl.load(values_row + (t + 1) * values_stride, mask=following_valid, other=0.0).to(ACC)
    value = tl.load(values_row + t * values_stride, mask=valid, other=0.0).to(ACC)
    reward = tl.load(rewards_row + t * rewards_stride, mask=valid, other=0.0).to(ACC)

    nv_coef, nv_offset = tl.associative_scan(
        (tl.where(following_valid, 0.0, 1.0), tl.where(following_valid, following_value, 0.0)), 0, _compose_affine
    )
    next_value = nv_coef * carry_next_value + nv_offset
    delta = reward + gamma * next_value - value
    adv_coef, adv_offset = tl.associative_scan(
        (tl.where(valid, gamma_lam, 1.0), tl.where(valid, delta, 0.0)), 0, _compose_affine
    )
    advantage = adv_coef * carry_advantage + adv_offset

    advantages_row, returns_row = outs
    tl.store(advantages_row + t, tl.where(valid, advantage, 0.0), mask=inside)
    tl.store(returns_row + t, tl.where(valid, advantage + value, 0.0), mask=inside)
    # Slots past the row's start are identity maps, so the last slot holds the chunk-start state.
    is_chunk_start = tl.arange(0, BLOCK_T) == BLOCK_T - 1  # reversed order: the last slot is the earliest token
    return tl.sum(tl.where(is_chunk_start, advantage, 0.0), 0), tl.sum(tl.where(is_chunk_start, next_value, 0.0), 0)


@triton.jit
def _gae_kernel(
    rewards_ptr,
    values_ptr,
    mask_ptr,
    advantages_ptr,
    returns_ptr,
    length,
    rewards_stride0,
    rewards_stride1,
    values_stride0,
    values_stride1,
    mask_stride0,
    mask_stride1,
    gamma,
    gamma_lo,
    lam,
    lam_lo,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gamma = scalar(gamma, gamma_lo, ACC)
    gamma_lam = gamma * scalar(lam, lam_lo, ACC)
    offs = tl.arange(0, BLOCK_T).to(tl.int64)  # so that t * stride is int64 whatever the strides' type
    carry_advantage = tl.zeros([], ACC)
    carry_next_value = tl.zeros([], ACC)  # the value after the last valid token is 0
    rewards_row = rewards_ptr + row * rewards_stride0
    values_row = values_ptr + row * values_stride0
    mask_row = mask_ptr + row * mask_stride0
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = length - 1 - chunk * BLOCK_T - offs
        inside = t >= 0
        carry_advantage, carry_next_value = _gae_chunk(
            (rewards_row, values_row, mask_row),
            (rewards_stride1, values_stride1, mask_stride1),
            (advantages_ptr + row * length, returns_ptr + row * length),
            t,
            inside,
            length,
            carry_advantage,
            carry_next_value,
            gamma,
            gamma_lam,
            ACC,
            BLOCK_T,
        )


def gae_forward(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, T]`` float32 (float64 for float64 inputs); inputs ``[B, T]`` with any strides
    (expanded included), ``mask`` bool or 0/1 of any dtype.

    ``block_t`` overrides the chunk size (tests use a small one to cross chunks).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, T], got shape {tuple(rewards.shape)}")
    check_shape("values", values, rewards.shape)
    check_shape("mask", mask, rewards.shape)
    check_same_device(rewards=rewards, values=values, mask=mask)
    batch, length = rewards.shape
    advantages = torch.empty((batch, length), dtype=result_dtype(rewards, values), device=rewards.device)
    returns = torch.empty_like(advantages)
    if batch == 0 or length == 0:
        return advantages, returns
    block = block_t or min(triton.next_power_of_2(length), MAX_BLOCK_T)
    with device_guard(advantages):
        _gae_kernel[(batch,)](
            rewards,
            values,
            mask,
            advantages,
            returns,
            length,
            *rewards.stride(),
            *values.stride(),
            *mask.stride(),
            *split_scalar(gamma),
            *split_scalar(lam),
            ACC=compute_dtype(advantages.dtype),
            BLOCK_T=block,
            num_warps=SCAN_WARPS,
        )
    return advantages, returns


@triton.jit
def _gae_bwd_chunk(
    rows,
    strides,
    outs,
    t,
    inside,
    carry,
    carry_previous,
    gamma,
    gamma_lam,
    HAS_GRAD_ADV: tl.constexpr,
    HAS_GRAD_RET: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One chunk of the backward's forward scans (tokens ``t``, earliest first; ``rows``: the row's
    mask and incoming gradients, ``outs``: its rewards' and values' gradients), padded and packed
    kernels alike: the carries after it."""
    mask_row, grad_adv_row, grad_ret_row = rows
    mask_stride, grad_adv_stride, grad_ret_stride = strides
    preceding_inside = inside & (t >= 1)
    valid = tl.load(mask_row + t * mask_stride, mask=inside, other=0) != 0
    preceding_valid = tl.load(mask_row + (t - 1) * mask_stride, mask=preceding_inside, other=0) != 0
    grad = tl.zeros([BLOCK_T], ACC)
    preceding_grad = tl.zeros([BLOCK_T], ACC)
    grad_ret = tl.zeros([BLOCK_T], ACC)
    if HAS_GRAD_ADV:
        grad += tl.load(grad_adv_row + t * grad_adv_stride, mask=valid, other=0.0).to(ACC)
        preceding_grad += tl.load(grad_adv_row + (t - 1) * grad_adv_stride, mask=preceding_valid, other=0.0).to(ACC)
    if HAS_GRAD_RET:
        grad_ret = tl.load(grad_ret_row + t * grad_ret_stride, mask=valid, other=0.0).to(ACC)
        grad += grad_ret
        preceding_grad += tl.load(grad_ret_row + (t - 1) * grad_ret_stride, mask=preceding_valid, other=0.0).to(ACC)

    s_coef, s_offset = tl.associative_scan(
        (tl.where(valid, gamma_lam, 1.0), tl.where(valid, grad, 0.0)), 0, _compose_affine
    )
    delta_grad = s_coef * carry + s_offset
    # The same scan shifted by one token: S at the previous valid token.
    p_coef, p_offset = tl.associative_scan(
        (tl.where(preceding_valid, gamma_lam, 1.0), tl.where(preceding_valid, preceding_grad, 0.0)),
        0,
        _compose_affine,
    )
    previous_delta_grad = p_coef * carry_previous + p_offset

    grad_rewards_row, grad_values_row = outs
    tl.store(grad_rewards_row + t, cast_for_store(tl.where(valid, delta_grad, 0.0), grad_rewards_row), mask=inside)
    grad_values = tl.where(valid, gamma * previous_delta_grad - delta_grad + grad_ret, 0.0)
    tl.store(grad_values_row + t, cast_for_store(grad_values, grad_values_row), mask=inside)
    # Slots past the row's end are identity maps, so the last slot holds the chunk-end state.
    is_chunk_end = tl.arange(0, BLOCK_T) == BLOCK_T - 1
    return tl.sum(tl.where(is_chunk_end, delta_grad, 0.0), 0), tl.sum(
        tl.where(is_chunk_end, previous_delta_grad, 0.0), 0
    )


@triton.jit
def _gae_bwd_kernel(
    grad_adv_ptr,
    grad_ret_ptr,
    mask_ptr,
    grad_rewards_ptr,
    grad_values_ptr,
    length,
    mask_stride0,
    mask_stride1,
    grad_adv_stride0,
    grad_adv_stride1,
    grad_ret_stride0,
    grad_ret_stride1,
    gamma,
    gamma_lo,
    lam,
    lam_lo,
    HAS_GRAD_ADV: tl.constexpr,
    HAS_GRAD_RET: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # A_t = sum over later valid j of (gamma*lam)^k delta_j, so the gradient of delta_t is
    # S_t = g_t + gamma*lam * S_(previous valid token), a scan forward in time, with
    # g = grad_advantages + grad_returns.  Then grad r_t = S_t and, as v_t enters
    # delta_t with -1 and the previous valid token's delta with gamma,
    # grad v_t = -S_t + gamma * S_(previous valid) + grad_returns_t.
    row = tl.program_id(0).to(tl.int64)
    gamma = scalar(gamma, gamma_lo, ACC)
    gamma_lam = gamma * scalar(lam, lam_lo, ACC)
    offs = tl.arange(0, BLOCK_T).to(tl.int64)
    carry = tl.zeros([], ACC)  # S at the last token before the chunk
    carry_previous = tl.zeros([], ACC)  # S at the last valid token before the one before the chunk
    mask_row = mask_ptr + row * mask_stride0
    grad_adv_row = grad_adv_ptr + row * grad_adv_stride0
    grad_ret_row = grad_ret_ptr + row * grad_ret_stride0
    out_row = row * length
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = chunk * BLOCK_T + offs
        inside = t < length
        carry, carry_previous = _gae_bwd_chunk(
            (mask_row, grad_adv_row, grad_ret_row),
            (mask_stride1, grad_adv_stride1, grad_ret_stride1),
            (grad_rewards_ptr + out_row, grad_values_ptr + out_row),
            t,
            inside,
            carry,
            carry_previous,
            gamma,
            gamma_lam,
            HAS_GRAD_ADV,
            HAS_GRAD_RET,
            ACC,
            BLOCK_T,
        )


def gae_backward(
    grad_advantages: torch.Tensor | None,
    grad_returns: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    *,
    rewards_dtype: torch.dtype,
    values_dtype: torch.dtype,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients w.r.t. rewards and values (in their dtypes) from those of ``gae_forward``'s outputs.

    Either output gradient may be None (unused); both may have any strides (a gradient
    expanded from a sum has stride 0).  ``block_t`` overrides the chunk size.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    check_shape("grad_advantages", grad_advantages, mask.shape)
    check_shape("grad_returns", grad_returns, mask.shape)
    check_same_device(mask=mask, grad_advantages=grad_advantages, grad_returns=grad_returns)
    batch, length = mask.shape
    grad_rewards = torch.empty((batch, length), dtype=rewards_dtype, device=mask.device)
    grad_values = torch.empty((batch, length), dtype=values_dtype, device=mask.device)
    if batch == 0 or length == 0:
        return grad_rewards, grad_values
    given = [g for g in (grad_advantages, grad_returns) if g is not None]
    if not given:
        return grad_rewards.zero_(), grad_values.zero_()
    block = block_t or min(triton.next_power_of_2(length), MAX_BLOCK_T)
    with device_guard(grad_rewards):
        _gae_bwd_kernel[(batch,)](
            given[0] if grad_advantages is None else grad_advantages,  # unused without HAS_GRAD_ADV
            given[0] if grad_returns is None else grad_returns,  # unused without HAS_GRAD_RET
            mask,
            grad_rewards,
            grad_values,
            length,
            *mask.stride(),
            *(given[0] if grad_advantages is None else grad_advantages).stride(),
            *(given[0] if grad_returns is None else grad_returns).stride(),
            *split_scalar(gamma),
            *split_scalar(lam),
            HAS_GRAD_ADV=grad_advantages is not None,
            HAS_GRAD_RET=grad_returns is not None,
            ACC=compute_dtype(result_dtype(*given)),
            BLOCK_T=block,
            num_warps=SCAN_WARPS,
        )
    return grad_rewards, grad_values


# --------------------------------------------------------------------------- torch custom op and autograd


@custom_op("ppo_fast_triton::gae", mutates_args=())
def _gae_op(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return gae_forward(rewards, values, mask, gamma, lam)


@_gae_op.register_fake
def _(rewards, values, mask, gamma, lam):
    advantages = rewards.new_empty(rewards.shape, dtype=result_dtype(rewards, values))
    return advantages, torch.empty_like(advantages)


@custom_op("ppo_fast_triton::gae_backward", mutates_args=())
def _gae_backward_op(
    grad_advantages: torch.Tensor | None,
    grad_returns: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    rewards_dtype: torch.dtype,
    values_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    return gae_backward(
        grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype=rewards_dtype, values_dtype=values_dtype
    )


@_gae_backward_op.register_fake
def _(grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype, values_dtype):
    return mask.new_empty(mask.shape, dtype=rewards_dtype), mask.new_empty(mask.shape, dtype=values_dtype)


def _gae_setup(ctx, inputs, output):
    rewards, values, mask, ctx.gamma, ctx.lam = inputs
    ctx.rewards_dtype, ctx.values_dtype = rewards.dtype, values.dtype
    ctx.save_for_backward(mask)
    ctx.set_materialize_grads(False)


def _gae_backward(ctx, grad_advantages, grad_returns):
    not_differentiable(ctx, mask=2)
    (mask,) = ctx.saved_tensors
    grad_rewards, grad_values = call(
        _gae_backward_op, grad_advantages, grad_returns, mask, ctx.gamma, ctx.lam, ctx.rewards_dtype, ctx.values_dtype
    )
    return grad_rewards, grad_values, None, None, None


_gae = with_autograd(_gae_op, _gae_backward, _gae_setup)


def gae(rewards, values, mask, gamma, lam):
    return _gae(rewards, values, mask, gamma, lam)


# --------------------------------------------------------------------------- the packed layout
# gae_varlen: the same scans on packed [N] tokens, one program per cu_seqlens segment, its bounds
# read on the device (no host sync, no padded copy).  The forward's chunks are aligned as in the
# segment's padded row of `width` tokens (its end at column width - 1; the chunks wholly past the
# segment's end are identity maps, skipped): with the padded path's width and BLOCK_T its scan trees
# are the padded ones, so the results are bit for bit the padded path's.  The backward's chunks start
# at the segment's start, as the padded row's do.


@triton.jit
def _segment(cu_ptr, tokens):
    seq = tl.program_id(0).to(tl.int64)
    # Clamped to the tokens: a malformed cu_seqlens (the public layer refuses it) reads nothing outside.
    start = tl.minimum(tl.maximum(tl.load(cu_ptr + seq).to(tl.int64), 0), tokens)
    end = tl.minimum(tl.maximum(tl.load(cu_ptr + (seq + 1)).to(tl.int64), start), tokens)
    return start, end - start


@triton.jit
def _gae_varlen_kernel(
    rewards_ptr,
    values_ptr,
    mask_ptr,
    cu_ptr,
    width_ptr,
    advantages_ptr,
    returns_ptr,
    tokens,
    width,
    rewards_stride,
    values_stride,
    mask_stride,
    gamma,
    gamma_lo,
    lam,
    lam_lo,
    WIDTH_ON_DEVICE: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    start, length = _segment(cu_ptr, tokens)
    if WIDTH_ON_DEVICE:
        width = tl.load(width_ptr).to(tl.int64)
    gamma = scalar(gamma, gamma_lo, ACC)
    gamma_lam = gamma * scalar(lam, lam_lo, ACC)
    offs = tl.arange(0, BLOCK_T).to(tl.int64)
    carry_advantage = tl.zeros([], ACC)
    carry_next_value = tl.zeros([], ACC)
    rewards_row = rewards_ptr + start * rewards_stride
    values_row = values_ptr + start * values_stride
    mask_row = mask_ptr + start * mask_stride
    first = tl.maximum(width - length, 0) // BLOCK_T
    for chunk in range(first, tl.cdiv(tl.maximum(width, length), BLOCK_T)):
        t = tl.maximum(width, length) - 1 - chunk * BLOCK_T - offs
        inside = (t >= 0) & (t < length)
        carry_advantage, carry_next_value = _gae_chunk(
            (rewards_row, values_row, mask_row),
            (rewards_stride, values_stride, mask_stride),
            (advantages_ptr + start, returns_ptr + start),
            t,
            inside,
            length,
            carry_advantage,
            carry_next_value,
            gamma,
            gamma_lam,
            ACC,
            BLOCK_T,
        )


@triton.jit
def _gae_varlen_bwd_kernel(
    grad_adv_ptr,
    grad_ret_ptr,
    mask_ptr,
    cu_ptr,
    grad_rewards_ptr,
    grad_values_ptr,
    tokens,
    mask_stride,
    grad_adv_stride,
    grad_ret_stride,
    gamma,
    gamma_lo,
    lam,
    lam_lo,
    HAS_GRAD_ADV: tl.constexpr,
    HAS_GRAD_RET: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # _gae_bwd_kernel's scans (see there) over one segment.
    start, length = _segment(cu_ptr, tokens)
    gamma = scalar(gamma, gamma_lo, ACC)
    gamma_lam = gamma * scalar(lam, lam_lo, ACC)
    offs = tl.arange(0, BLOCK_T).to(tl.int64)
    carry = tl.zeros([], ACC)
    carry_previous = tl.zeros([], ACC)
    mask_row = mask_ptr + start * mask_stride
    grad_adv_row = grad_adv_ptr + start * grad_adv_stride
    grad_ret_row = grad_ret_ptr + start * grad_ret_stride
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = chunk * BLOCK_T + offs
        inside = t < length
        carry, carry_previous = _gae_bwd_chunk(
            (mask_row, grad_adv_row, grad_ret_row),
            (mask_stride, grad_adv_stride, grad_ret_stride),
            (grad_rewards_ptr + start, grad_values_ptr + start),
            t,
            inside,
            carry,
            carry_previous,
            gamma,
            gamma_lam,
            HAS_GRAD_ADV,
            HAS_GRAD_RET,
            ACC,
            BLOCK_T,
        )


# Four warps for every chunk size, padded and packed alike (the two must scan in the same order to agree bit
# for bit): eight spilled 8 bytes in the packed forward under triton 3.6, the GPU image's; four have the
# fewest sm_90 instructions per token of 4, 8 and 16 (bench static).
SCAN_WARPS = 4


def varlen_block(max_seqlen: int | None) -> int:
    """The chunk of the packed scans: the padded path's for a row of ``max_seqlen`` tokens, the
    largest without it (the longest length is on the device: no host read)."""
    return MAX_BLOCK_T if max_seqlen is None else min(triton.next_power_of_2(max(max_seqlen, 1)), MAX_BLOCK_T)


def _check_varlen(name: str, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None) -> None:
    if x.dim() != 1:
        raise ValueError(f"{name} must be packed [N], got shape {tuple(x.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32/int64 [S + 1] tensor, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be None or an int >= 0, got {max_seqlen!r}")


def _width(cu_seqlens: torch.Tensor, max_seqlen: int | None) -> tuple[torch.Tensor, int]:
    """The padded width as the kernels take it: ``(device tensor, 0)`` without ``max_seqlen``, else
    ``(cu_seqlens, max_seqlen)`` (the tensor unused)."""
    if max_seqlen is not None:
        return cu_seqlens, max_seqlen
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return (lengths.max() if len(lengths) else cu_seqlens.new_zeros(())), 0


def gae_varlen_forward(rewards, values, mask, cu_seqlens, gamma, lam, *, max_seqlen=None, block_t=None):
    """``gae_forward`` on packed ``[N]`` tokens (any strides), one scan per ``cu_seqlens`` segment.
    ``cu_seqlens`` is read on the device only; ``max_seqlen`` (the longest length) sets the chunks as
    the padded path's, else the longest length is found on the device.  ``block_t`` overrides the
    chunk size (tests cross chunks with a small one)."""
    _check_varlen("rewards", rewards, cu_seqlens, max_seqlen)
    check_shape("values", values, rewards.shape)
    check_shape("mask", mask, rewards.shape)
    check_same_device(rewards=rewards, values=values, mask=mask, cu_seqlens=cu_seqlens)
    advantages = torch.empty(rewards.shape, dtype=result_dtype(rewards, values), device=rewards.device)
    returns = torch.empty_like(advantages)
    sequences = cu_seqlens.numel() - 1
    if sequences == 0 or rewards.numel() == 0:
        return advantages, returns
    width_tensor, width = _width(cu_seqlens, max_seqlen)
    block = block_t or varlen_block(max_seqlen)
    with device_guard(advantages):
        _gae_varlen_kernel[(sequences,)](
            rewards,
            values,
            mask,
            cu_seqlens,
            width_tensor,
            advantages,
            returns,
            rewards.shape[0],
            width,
            rewards.stride(0),
            values.stride(0),
            mask.stride(0),
            *split_scalar(gamma),
            *split_scalar(lam),
            WIDTH_ON_DEVICE=max_seqlen is None,
            ACC=compute_dtype(advantages.dtype),
            BLOCK_T=block,
            num_warps=SCAN_WARPS,
        )
    return advantages, returns


def gae_varlen_backward(
    grad_advantages, grad_returns, mask, cu_seqlens, gamma, lam, *, dtypes, max_seqlen=None, block_t=None
):
    """``gae_backward`` on packed ``[N]`` tokens; ``dtypes`` those of rewards and values."""
    _check_varlen("mask", mask, cu_seqlens, max_seqlen)
    check_shape("grad_advantages", grad_advantages, mask.shape)
    check_shape("grad_returns", grad_returns, mask.shape)
    check_same_device(mask=mask, grad_advantages=grad_advantages, grad_returns=grad_returns, cu_seqlens=cu_seqlens)
    grad_rewards = torch.empty(mask.shape, dtype=dtypes[0], device=mask.device)
    grad_values = torch.empty(mask.shape, dtype=dtypes[1], device=mask.device)
    given = [g for g in (grad_advantages, grad_returns) if g is not None]
    if not given:
        return grad_rewards.zero_(), grad_values.zero_()
    sequences = cu_seqlens.numel() - 1
    if sequences == 0 or mask.numel() == 0:
        return grad_rewards, grad_values
    block = block_t or varlen_block(max_seqlen)
    adv = given[0] if grad_advantages is None else grad_advantages  # unused without HAS_GRAD_ADV
    ret = given[0] if grad_returns is None else grad_returns  # unused without HAS_GRAD_RET
    with device_guard(grad_rewards):
        _gae_varlen_bwd_kernel[(sequences,)](
            adv,
            ret,
            mask,
            cu_seqlens,
            grad_rewards,
            grad_values,
            mask.shape[0],
            mask.stride(0),
            adv.stride(0),
            ret.stride(0),
            *split_scalar(gamma),
            *split_scalar(lam),
            HAS_GRAD_ADV=grad_advantages is not None,
            HAS_GRAD_RET=grad_returns is not None,
            ACC=compute_dtype(result_dtype(*given)),
            BLOCK_T=block,
            num_warps=SCAN_WARPS,
        )
    return grad_rewards, grad_values


@custom_op("ppo_fast_triton::gae_varlen", mutates_args=())
def _gae_varlen_op(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return gae_varlen_forward(rewards, values, mask, cu_seqlens, gamma, lam, max_seqlen=max_seqlen)


@_gae_varlen_op.register_fake
def _(rewards, values, mask, cu_seqlens, max_seqlen, *, gamma, lam):
    _check_varlen("rewards", rewards, cu_seqlens, max_seqlen)
    advantages = rewards.new_empty(rewards.shape, dtype=result_dtype(rewards, values))
    return advantages, torch.empty_like(advantages)


@custom_op("ppo_fast_triton::gae_varlen_backward", mutates_args=())
def _gae_varlen_backward_op(
    grad_advantages: torch.Tensor | None,
    grad_returns: torch.Tensor | None,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None,
    *,
    gamma: float,
    lam: float,
    rewards_dtype: torch.dtype,
    values_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    dtypes = (rewards_dtype, values_dtype)
    return gae_varlen_backward(
        grad_advantages, grad_returns, mask, cu_seqlens, gamma, lam, dtypes=dtypes, max_seqlen=max_seqlen
    )


@_gae_varlen_backward_op.register_fake
def _(grad_advantages, grad_returns, mask, cu_seqlens, max_seqlen, *, gamma, lam, rewards_dtype, values_dtype):
    return mask.new_empty(mask.shape, dtype=rewards_dtype), mask.new_empty(mask.shape, dtype=values_dtype)


def _gae_varlen_setup(ctx, inputs, keyword_only_inputs, output):
    rewards, values, mask, cu_seqlens, ctx.max_seqlen = inputs
    ctx.hyper = dict(keyword_only_inputs, rewards_dtype=rewards.dtype, values_dtype=values.dtype)
    ctx.save_for_backward(mask, cu_seqlens)
    ctx.set_materialize_grads(False)


def _gae_varlen_backward(ctx, grad_advantages, grad_returns):
    not_differentiable(ctx, mask=2)
    mask, cu_seqlens = ctx.saved_tensors
    grads = call(_gae_varlen_backward_op, grad_advantages, grad_returns, mask, cu_seqlens, ctx.max_seqlen, **ctx.hyper)
    return *grads, None, None, None


_gae_varlen = with_autograd(_gae_varlen_op, _gae_varlen_backward, _gae_varlen_setup)


def gae_varlen(rewards, values, mask, cu_seqlens, gamma, lam, *, max_seqlen=None):
    """``gae`` on packed ``[N]`` tokens (the public layer's checked inputs): ``(advantages, returns)`` ``[N]``."""
    return _gae_varlen(rewards, values, mask, cu_seqlens, max_seqlen, gamma=gamma, lam=lam)


def static_variants(batch: int = 64, length: int = 8192) -> list[dict]:
    """This op's kernel launches for ``bench.static`` (sm_90 code compiled without a GPU), on meta tensors.

    One dict per variant: ``name``, ``run`` (calls a launcher), ``budget_key`` (None: no budget),
    ``bytes_per_element`` (global memory read + written per token; None: not modelled).
    """

    def seq(dtype=torch.float32):
        return torch.empty((batch, length), dtype=dtype, device="meta")

    out = [
        dict(
            name="gae fwd",
            budget_key=None,
            bytes_per_element=17,
            run=lambda: gae_forward(seq(), seq(), seq(torch.bool), 1.0, 0.95),
        )
    ]
    for has_adv, has_ret in ((True, True), (True, False), (False, True)):
        what = "+".join(n for n, on in (("advantages", has_adv), ("returns", has_ret)) if on)
        out.append(
            dict(
                name=f"gae bwd({what})",
                budget_key=None,
                bytes_per_element=None,
                run=lambda a=has_adv, r=has_ret: gae_backward(
                    seq() if a else None,
                    seq() if r else None,
                    seq(torch.bool),
                    1.0,
                    0.95,
                    rewards_dtype=torch.float32,
                    values_dtype=torch.float32,
                ),
            )
        )
    # The packed layout: the same tokens as 64 segments of `length`, max_seqlen given or found on the device.
    tokens = torch.empty((batch * length,), device="meta")
    cu_seqlens = torch.empty((batch + 1,), dtype=torch.int32, device="meta")
    for given in (True, False):
        max_seqlen = length if given else None
        out.append(
            dict(
                name=f"gae varlen fwd{'' if given else ' (max_seqlen on the device)'}",
                budget_key=None,
                bytes_per_element=17,
                run=lambda m=max_seqlen: gae_varlen_forward(
                    tokens, tokens, tokens.bool(), cu_seqlens, 1.0, 0.95, max_seqlen=m
                ),
            )
        )
    out.append(
        dict(
            name="gae varlen bwd(advantages+returns)",
            budget_key=None,
            bytes_per_element=None,
            run=lambda: gae_varlen_backward(
                tokens, tokens, tokens.bool(), cu_seqlens, 1.0, 0.95, dtypes=(torch.float32, torch.float32)
            ),
        )
    )
    return out
