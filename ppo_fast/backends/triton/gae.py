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
from ._launch import DEVICES, check_same_device, check_shape, device_guard, not_differentiable

SUPPORTED = {"gae": DEVICES}

MAX_BLOCK_T = 1024


@triton.jit
def _compose_affine(coef_a, offset_a, coef_b, offset_b):
    # a: the maps already applied (later tokens), b: the next one.
    return coef_a * coef_b, coef_b * offset_a + offset_b


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
    is_chunk_start = offs == BLOCK_T - 1  # reversed order: the last scan slot is the earliest token
    carry_advantage = tl.zeros([], ACC)
    carry_next_value = tl.zeros([], ACC)  # the value after the last valid token is 0
    rewards_row = rewards_ptr + row * rewards_stride0
    values_row = values_ptr + row * values_stride0
    mask_row = mask_ptr + row * mask_stride0
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = length - 1 - chunk * BLOCK_T - offs
        inside = t >= 0
        following_inside = inside & (t + 1 < length)
        valid = tl.load(mask_row + t * mask_stride1, mask=inside, other=0) != 0
        following_valid = tl.load(mask_row + (t + 1) * mask_stride1, mask=following_inside, other=0) != 0
        following_value = tl.load(values_row + (t + 1) * values_stride1, mask=following_valid, other=0.0).to(ACC)
        value = tl.load(values_row + t * values_stride1, mask=valid, other=0.0).to(ACC)
        reward = tl.load(rewards_row + t * rewards_stride1, mask=valid, other=0.0).to(ACC)

        nv_coef, nv_offset = tl.associative_scan(
            (tl.where(following_valid, 0.0, 1.0), tl.where(following_valid, following_value, 0.0)), 0, _compose_affine
        )
        next_value = nv_coef * carry_next_value + nv_offset
        delta = reward + gamma * next_value - value
        adv_coef, adv_offset = tl.associative_scan(
            (tl.where(valid, gamma_lam, 1.0), tl.where(valid, delta, 0.0)), 0, _compose_affine
        )
        advantage = adv_coef * carry_advantage + adv_offset

        out_offs = row * length + t
        tl.store(advantages_ptr + out_offs, tl.where(valid, advantage, 0.0), mask=inside)
        tl.store(returns_ptr + out_offs, tl.where(valid, advantage + value, 0.0), mask=inside)
        # Slots past the row's start are identity maps, so the last slot holds the chunk-start state.
        carry_advantage = tl.sum(tl.where(is_chunk_start, advantage, 0.0), 0)
        carry_next_value = tl.sum(tl.where(is_chunk_start, next_value, 0.0), 0)


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
            num_warps=4 if block <= 512 else 8,
        )
    return advantages, returns


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
    is_chunk_end = offs == BLOCK_T - 1
    carry = tl.zeros([], ACC)  # S at the last token before the chunk
    carry_previous = tl.zeros([], ACC)  # S at the last valid token before the one before the chunk
    mask_row = mask_ptr + row * mask_stride0
    grad_adv_row = grad_adv_ptr + row * grad_adv_stride0
    grad_ret_row = grad_ret_ptr + row * grad_ret_stride0
    out_row = row * length
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = chunk * BLOCK_T + offs
        inside = t < length
        preceding_inside = inside & (t >= 1)
        valid = tl.load(mask_row + t * mask_stride1, mask=inside, other=0) != 0
        preceding_valid = tl.load(mask_row + (t - 1) * mask_stride1, mask=preceding_inside, other=0) != 0
        grad = tl.zeros([BLOCK_T], ACC)
        preceding_grad = tl.zeros([BLOCK_T], ACC)
        grad_ret = tl.zeros([BLOCK_T], ACC)
        if HAS_GRAD_ADV:
            grad += tl.load(grad_adv_row + t * grad_adv_stride1, mask=valid, other=0.0).to(ACC)
            preceding_grad += tl.load(grad_adv_row + (t - 1) * grad_adv_stride1, mask=preceding_valid, other=0.0).to(
                ACC
            )
        if HAS_GRAD_RET:
            grad_ret = tl.load(grad_ret_row + t * grad_ret_stride1, mask=valid, other=0.0).to(ACC)
            grad += grad_ret
            preceding_grad += tl.load(grad_ret_row + (t - 1) * grad_ret_stride1, mask=preceding_valid, other=0.0).to(
                ACC
            )

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

        tl.store(
            grad_rewards_ptr + out_row + t,
            cast_for_store(tl.where(valid, delta_grad, 0.0), grad_rewards_ptr),
            mask=inside,
        )
        grad_values = tl.where(valid, gamma * previous_delta_grad - delta_grad + grad_ret, 0.0)
        tl.store(grad_values_ptr + out_row + t, cast_for_store(grad_values, grad_values_ptr), mask=inside)
        # Slots past the row's end are identity maps, so the last slot holds the chunk-end state.
        carry = tl.sum(tl.where(is_chunk_end, delta_grad, 0.0), 0)
        carry_previous = tl.sum(tl.where(is_chunk_end, previous_delta_grad, 0.0), 0)


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
            num_warps=4 if block <= 512 else 8,
        )
    return grad_rewards, grad_values


# --------------------------------------------------------------------------- torch custom op and autograd


@torch.library.custom_op("ppo_fast_triton::gae", mutates_args=())
def _gae_op(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return gae_forward(rewards, values, mask, gamma, lam)


@_gae_op.register_fake
def _(rewards, values, mask, gamma, lam):
    advantages = rewards.new_empty(rewards.shape, dtype=result_dtype(rewards, values))
    return advantages, torch.empty_like(advantages)


@torch.library.custom_op("ppo_fast_triton::gae_backward", mutates_args=())
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
    grad_rewards, grad_values = _gae_backward_op(
        grad_advantages, grad_returns, mask, ctx.gamma, ctx.lam, ctx.rewards_dtype, ctx.values_dtype
    )
    return grad_rewards, grad_values, None, None, None


_gae_op.register_autograd(_gae_backward, setup_context=_gae_setup)


def gae(rewards, values, mask, gamma, lam):
    return _gae_op(rewards, values, mask, gamma, lam)


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
    return out
