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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dtypes import compute_dtype, result_dtype

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
    lam,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gamma = tl.cast(gamma, ACC)
    gamma_lam = gamma * tl.cast(lam, ACC)
    offs = tl.arange(0, BLOCK_T)
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
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float, block_t: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[B, T]`` float32 (float64 for float64 inputs); inputs ``[B, T]`` with any strides, ``mask`` bool.

    ``block_t`` overrides the chunk size (tests use a small one to cross chunks).
    """
    batch, length = rewards.shape
    advantages = torch.empty((batch, length), dtype=result_dtype(rewards, values), device=rewards.device)
    returns = torch.empty_like(advantages)
    if batch == 0 or length == 0:
        return advantages, returns
    block = block_t or min(triton.next_power_of_2(length), MAX_BLOCK_T)
    _gae_kernel[(batch,)](
        rewards, values, mask, advantages, returns, length,
        *rewards.stride(), *values.stride(), *mask.stride(), gamma, lam,
        ACC=compute_dtype(advantages.dtype), BLOCK_T=block, num_warps=4 if block <= 512 else 8,
    )
    return advantages, returns
