"""Per-token KL estimates and the KL-penalised reward, with the KL's gradient.

The estimators and their clamps are those of ``ppo_fast.reference.kl_estimate``;
``ESTIMATOR`` is the index of the name in ``reference.KL_ESTIMATORS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import KL_ESTIMATORS
from ._dtypes import cast_for_store, compute_dtype, result_dtype

_ELEMENTWISE_BLOCK = 1024
MAX_BLOCK_T = 1024

# Indices into KL_ESTIMATORS, as kernel constants (compiled kernels only see constexpr globals).
_K1, _K2, _K3, _ABS = (tl.constexpr(KL_ESTIMATORS.index(name)) for name in ("k1", "k2", "k3", "abs"))


def estimator_code(estimator: str) -> int:
    return KL_ESTIMATORS.index(estimator)


@triton.jit
def _clamp(x, low, high):
    # NaN stays NaN, as in torch.clamp.
    return tl.minimum(tl.maximum(x, low, propagate_nan=tl.PropagateNan.ALL), high, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _kl_from_log_ratio(log_ratio, ESTIMATOR: tl.constexpr):
    if ESTIMATOR == _K1:
        kl = log_ratio
    elif ESTIMATOR == _K2:
        kl = 0.5 * log_ratio * log_ratio
    elif ESTIMATOR == _K3:
        d = _clamp(-log_ratio, -20.0, 20.0)
        kl = _clamp(tl.exp(d) - d - 1.0, -10.0, 10.0)
    else:
        kl = tl.abs(log_ratio)
    return kl


@triton.jit
def _kl_grad_from_log_ratio(log_ratio, ESTIMATOR: tl.constexpr):
    """d kl / d log_ratio, with torch's conventions: clamp passes gradient on its closed range, sign(0) = 0."""
    if ESTIMATOR == _K1:
        grad = tl.full(log_ratio.shape, 1.0, log_ratio.dtype)
    elif ESTIMATOR == _K2:
        grad = log_ratio
    elif ESTIMATOR == _K3:
        d = _clamp(-log_ratio, -20.0, 20.0)
        inner = tl.exp(d) - d - 1.0
        passes = (tl.abs(log_ratio) <= 20.0) & (inner <= 10.0) & (inner >= -10.0)
        grad = tl.where(passes, 1.0 - tl.exp(d), 0.0)
    else:
        grad = tl.where(log_ratio > 0, 1.0, tl.where(log_ratio < 0, -1.0, 0.0))
    return grad


@triton.jit
def _kl_estimate_kernel(logp_ptr, ref_ptr, kl_ptr, numel, ESTIMATOR: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    log_ratio = tl.load(logp_ptr + offs, mask=inside).to(ACC) - tl.load(ref_ptr + offs, mask=inside).to(ACC)
    tl.store(kl_ptr + offs, _kl_from_log_ratio(log_ratio, ESTIMATOR), mask=inside)


@triton.jit
def _kl_backward_kernel(
    logp_ptr, ref_ptr, grad_kl_ptr, grad_logp_ptr, grad_ref_ptr, numel, ESTIMATOR: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    log_ratio = tl.load(logp_ptr + offs, mask=inside).to(ACC) - tl.load(ref_ptr + offs, mask=inside).to(ACC)
    grad = tl.load(grad_kl_ptr + offs, mask=inside).to(ACC) * _kl_grad_from_log_ratio(log_ratio, ESTIMATOR)
    tl.store(grad_logp_ptr + offs, cast_for_store(grad, grad_logp_ptr), mask=inside)
    tl.store(grad_ref_ptr + offs, cast_for_store(-grad, grad_ref_ptr), mask=inside)


@triton.jit
def _kl_rewards_kernel(
    scores_ptr,
    logp_ptr,
    ref_ptr,
    mask_ptr,
    rewards_ptr,
    kl_ptr,
    last_ptr,
    length,
    scores_stride,
    logp_stride0,
    logp_stride1,
    ref_stride0,
    ref_stride1,
    mask_stride0,
    mask_stride1,
    kl_coef,
    ESTIMATOR: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    neg_coef = -tl.cast(kl_coef, ACC)
    score = tl.load(scores_ptr + row * scores_stride).to(ACC)
    offs = tl.arange(0, BLOCK_T)
    last = tl.full([], -1, tl.int32)
    # Chunks from the end of the row: the first chunk with a valid token holds the
    # row's last valid token, so the score lands in the same single pass.
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = length - (chunk + 1) * BLOCK_T + offs
        inside = t >= 0
        valid = tl.load(mask_ptr + row * mask_stride0 + t * mask_stride1, mask=inside, other=0) != 0
        logp = tl.load(logp_ptr + row * logp_stride0 + t * logp_stride1, mask=valid, other=0.0).to(ACC)
        ref = tl.load(ref_ptr + row * ref_stride0 + t * ref_stride1, mask=valid, other=0.0).to(ACC)
        kl = tl.where(valid, _kl_from_log_ratio(logp - ref, ESTIMATOR), 0.0)
        last = tl.where(last < 0, tl.max(tl.where(valid, t, -1), 0), last)
        rewards = neg_coef * kl + tl.where(t == last, score, 0.0)
        out_offs = row * length + t
        tl.store(kl_ptr + out_offs, kl, mask=inside)
        tl.store(rewards_ptr + out_offs, rewards, mask=inside)
    tl.store(last_ptr + row, last)


def _elementwise_grid(numel: int) -> tuple[int]:
    return (triton.cdiv(numel, _ELEMENTWISE_BLOCK),)


def kl_estimate_forward(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate, any shape (non-contiguous inputs are copied); float32, float64 for float64 inputs."""
    kl = torch.empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs), device=logprobs.device)
    if kl.numel():
        _kl_estimate_kernel[_elementwise_grid(kl.numel())](
            logprobs.reshape(-1), ref_logprobs.reshape(-1), kl, kl.numel(),
            ESTIMATOR=estimator_code(estimator), ACC=compute_dtype(kl.dtype), BLOCK=_ELEMENTWISE_BLOCK,
        )
    return kl


def kl_backward(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, grad_kl: torch.Tensor, estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_kl * kl)`` w.r.t. ``logprobs`` and ``ref_logprobs``, in their dtypes."""
    grad_logp = torch.empty(logprobs.shape, dtype=logprobs.dtype, device=logprobs.device)
    grad_ref = torch.empty(ref_logprobs.shape, dtype=ref_logprobs.dtype, device=ref_logprobs.device)
    if grad_logp.numel():
        _kl_backward_kernel[_elementwise_grid(grad_logp.numel())](
            logprobs.reshape(-1), ref_logprobs.reshape(-1), grad_kl.reshape(-1).contiguous(), grad_logp, grad_ref,
            grad_logp.numel(), ESTIMATOR=estimator_code(estimator),
            ACC=compute_dtype(result_dtype(logprobs, ref_logprobs)), BLOCK=_ELEMENTWISE_BLOCK,
        )
    return grad_logp, grad_ref


def kl_penalized_rewards_forward(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards, kl, last)``: rewards and kl ``[B, T]`` float32 (float64 for float64 log-probs); ``last [B]`` int32 is each
    row's last valid index, -1 for a row without one.  Any strides; ``block_t`` overrides the chunk size."""
    batch, length = logprobs.shape
    rewards = torch.empty((batch, length), dtype=result_dtype(logprobs, ref_logprobs), device=logprobs.device)
    kl = torch.empty_like(rewards)
    last = torch.empty(batch, dtype=torch.int32, device=logprobs.device)
    if batch == 0:
        return rewards, kl, last
    if length == 0:
        return rewards, kl, last.fill_(-1)
    block = block_t or min(triton.next_power_of_2(length), MAX_BLOCK_T)
    _kl_rewards_kernel[(batch,)](
        scores, logprobs, ref_logprobs, mask, rewards, kl, last, length,
        scores.stride(0), *logprobs.stride(), *ref_logprobs.stride(), *mask.stride(), kl_coef,
        ESTIMATOR=estimator_code(estimator), ACC=compute_dtype(rewards.dtype), BLOCK_T=block,
    )
    return rewards, kl, last
