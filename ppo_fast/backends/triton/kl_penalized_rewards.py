"""Per-token KL estimates and the KL-penalised reward, with their gradients.

The estimators and their clamps are those of the reference backend's ``kl_estimate``;
``KL_ESTIMATOR`` is the index of the name in ``ppo_fast.spec.KL_ESTIMATORS``.

Every input is read through its strides (sliced, transposed and expanded inputs
in place); outputs are new contiguous tensors; addresses are int64.  The
KL-penalised reward kernels never read a masked position's log-probs or
gradients, so NaN/inf there cannot reach a result or a gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...spec import KL_ESTIMATORS
from ._dtypes import cast_for_store, compute_dtype, result_dtype, scalar, split_scalar
from ._eager import call, custom_op, with_autograd
from ._launch import DEVICES, as_rows, check_same_device, check_shape, device_guard, not_differentiable

SUPPORTED = {"kl_estimate": DEVICES, "kl_penalized_rewards": DEVICES}

_ELEMENTWISE_BLOCK = 1024
MAX_BLOCK_T = 1024

# Indices into KL_ESTIMATORS, as kernel constants (compiled kernels only see constexpr globals).
_K1 = tl.constexpr(KL_ESTIMATORS.index("k1"))
_K2 = tl.constexpr(KL_ESTIMATORS.index("k2"))
_K3 = tl.constexpr(KL_ESTIMATORS.index("k3"))
_ABS = tl.constexpr(KL_ESTIMATORS.index("abs"))


def kl_estimator_code(kl_estimator: str) -> int:
    return KL_ESTIMATORS.index(kl_estimator)


@triton.jit
def _clamp(x, low, high):
    # NaN stays NaN, as in torch.clamp.
    return tl.minimum(tl.maximum(x, low, propagate_nan=tl.PropagateNan.ALL), high, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _k3_series_below(d):
    # reference.K3_SERIES_BELOW: where the Taylor series replaces exp(d) - d - 1.
    return tl.abs(d) < 1.0


@triton.jit
def _k3_series_over_d2(d):
    """(exp(d) - d - 1) / d^2 of float64 d, the nested Taylor series of reference.k3_of (to d^18 / 18!)."""
    s = tl.full(d.shape, 1.0, tl.float64)
    for n in tl.static_range(18, 2, -1):
        s = 1.0 + s * d * tl.full([], 1.0 / n, tl.float64)  # a multiply: a float64 divide is a long routine
    return 0.5 * s


@triton.jit
def _k3_of(d):
    """exp(d) - d - 1 of float64 d without cancellation at small |d| (reference.k3_of)."""
    return tl.where(_k3_series_below(d), _k3_series_over_d2(d) * (d * d), tl.exp(d) - d - 1.0)


@triton.jit
def _kl_from_log_ratio(log_ratio, KL_ESTIMATOR: tl.constexpr):
    if KL_ESTIMATOR == _K1:
        kl = log_ratio
    elif KL_ESTIMATOR == _K2:
        kl = 0.5 * log_ratio * log_ratio
    elif KL_ESTIMATOR == _K3:
        # in float64 and rounded once, as the reference (k3 monotone in d)
        d = _clamp((-log_ratio).to(tl.float64), -20.0, 20.0)
        kl = _clamp(_k3_of(d), -10.0, 10.0).to(log_ratio.dtype)
    elif KL_ESTIMATOR == _ABS:
        kl = tl.abs(log_ratio)
    else:  # an estimator of spec.KL_ESTIMATORS without its branch here fails to compile, never computes another
        tl.static_assert(False, "kl_penalized_rewards: a KL estimator without a Triton branch")
    return kl


@triton.jit
def _kl_grad(log_ratio, g, KL_ESTIMATOR: tl.constexpr):
    """g * d kl / d log_ratio, multiplied out in the order of the reference's autograd (so that
    overflow gives the same inf or NaN), with torch's conventions: clamp passes gradient on
    its closed range, sign(0) = 0."""
    if KL_ESTIMATOR == _K1:
        grad = g
    elif KL_ESTIMATOR == _K2:
        grad = (g * 0.5) * (2.0 * log_ratio)
    elif KL_ESTIMATOR == _K3:
        d = _clamp((-log_ratio).to(tl.float64), -20.0, 20.0)  # in float64, as the forward
        inner = _k3_of(d)
        passes = (tl.abs(log_ratio) <= 20.0) & (inner <= 10.0) & (inner >= -10.0)
        g_inner = tl.where(passes, g.to(tl.float64), 0.0)
        # exp(d) - 1 = d (1 + d * series) where the series is used
        g_d = tl.where(
            _k3_series_below(d), g_inner * (d * (1.0 + d * _k3_series_over_d2(d))), g_inner * tl.exp(d) - g_inner
        )
        grad = tl.where(passes, (-g_d).to(g.dtype), 0.0)
    elif KL_ESTIMATOR == _ABS:
        grad = g * tl.where(log_ratio > 0, 1.0, tl.where(log_ratio < 0, -1.0, 0.0))
    else:
        tl.static_assert(False, "kl_penalized_rewards: a KL estimator without a Triton branch")
    return grad


@triton.jit
def _elementwise_offsets(pid, numel, cols, BLOCK: tl.constexpr, STRIDED: tl.constexpr):
    """This block's flat int64 indices, whether each is inside, and (when STRIDED) its row and column."""
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if STRIDED:
        row, col = offs // cols, offs % cols
    else:
        row, col = offs, offs
    return offs, offs < numel, row, col


@triton.jit
def _strided(row, col, offs, stride0, stride1, STRIDED: tl.constexpr):
    if STRIDED:
        return row * stride0 + col * stride1
    return offs


@triton.jit
def _kl_estimate_kernel(
    logp_ptr,
    ref_ptr,
    kl_ptr,
    numel,
    cols,
    logp_stride0,
    logp_stride1,
    ref_stride0,
    ref_stride1,
    KL_ESTIMATOR: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    STRIDED: tl.constexpr,
):
    offs, inside, row, col = _elementwise_offsets(tl.program_id(0), numel, cols, BLOCK, STRIDED)
    logp = tl.load(logp_ptr + _strided(row, col, offs, logp_stride0, logp_stride1, STRIDED), mask=inside).to(ACC)
    ref = tl.load(ref_ptr + _strided(row, col, offs, ref_stride0, ref_stride1, STRIDED), mask=inside).to(ACC)
    tl.store(kl_ptr + offs, _kl_from_log_ratio(logp - ref, KL_ESTIMATOR), mask=inside)


@triton.jit
def _kl_backward_kernel(
    logp_ptr,
    ref_ptr,
    grad_kl_ptr,
    grad_logp_ptr,
    grad_ref_ptr,
    numel,
    cols,
    logp_stride0,
    logp_stride1,
    ref_stride0,
    ref_stride1,
    grad_kl_stride0,
    grad_kl_stride1,
    KL_ESTIMATOR: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
    STRIDED: tl.constexpr,
):
    offs, inside, row, col = _elementwise_offsets(tl.program_id(0), numel, cols, BLOCK, STRIDED)
    logp = tl.load(logp_ptr + _strided(row, col, offs, logp_stride0, logp_stride1, STRIDED), mask=inside).to(ACC)
    ref = tl.load(ref_ptr + _strided(row, col, offs, ref_stride0, ref_stride1, STRIDED), mask=inside).to(ACC)
    grad_kl = tl.load(
        grad_kl_ptr + _strided(row, col, offs, grad_kl_stride0, grad_kl_stride1, STRIDED), mask=inside
    ).to(ACC)
    grad = _kl_grad(logp - ref, grad_kl, KL_ESTIMATOR)
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
    kl_coef_lo,
    KL_ESTIMATOR: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    neg_coef = -scalar(kl_coef, kl_coef_lo, ACC)
    offs = tl.arange(0, BLOCK_T).to(tl.int64)
    last = tl.full([], -1, tl.int64)
    # Chunks from the end of the row: the first chunk with a valid token holds the
    # row's last valid token, so the score lands in the same single pass.
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = length - (chunk + 1) * BLOCK_T + offs  # int64: t * stride cannot wrap
        inside = t >= 0
        valid = tl.load(mask_ptr + row * mask_stride0 + t * mask_stride1, mask=inside, other=0) != 0
        logp = tl.load(logp_ptr + row * logp_stride0 + t * logp_stride1, mask=valid, other=0.0).to(ACC)
        ref = tl.load(ref_ptr + row * ref_stride0 + t * ref_stride1, mask=valid, other=0.0).to(ACC)
        kl = tl.where(valid, _kl_from_log_ratio(logp - ref, KL_ESTIMATOR), 0.0)
        last = tl.where(last < 0, tl.max(tl.where(valid, t, -1), 0), last)
        # A row without a valid token never reads its score.
        score = tl.load(scores_ptr + row * scores_stride, mask=last >= 0, other=0.0).to(ACC)
        rewards = neg_coef * kl + tl.where(t == last, score, 0.0)
        out_offs = row * length + t
        tl.store(kl_ptr + out_offs, kl, mask=inside)
        tl.store(rewards_ptr + out_offs, rewards, mask=inside)
    tl.store(last_ptr + row, last.to(tl.int32))


@triton.jit
def _kl_rewards_bwd_kernel(
    logp_ptr,
    ref_ptr,
    mask_ptr,
    last_ptr,
    grad_rewards_ptr,
    grad_kl_ptr,
    grad_scores_ptr,
    grad_logp_ptr,
    grad_ref_ptr,
    length,
    logp_stride0,
    logp_stride1,
    ref_stride0,
    ref_stride1,
    mask_stride0,
    mask_stride1,
    grad_rewards_stride0,
    grad_rewards_stride1,
    grad_kl_stride0,
    grad_kl_stride1,
    kl_coef,
    kl_coef_lo,
    HAS_GRAD_REWARDS: tl.constexpr,
    HAS_GRAD_KL: tl.constexpr,
    KL_ESTIMATOR: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # rewards = -kl_coef * kl + score at the row's last valid token, kl = 0 at masked tokens:
    # the gradient of kl_t is grad_kl_t - kl_coef * grad_rewards_t at a valid token, and
    # nothing (not even a NaN gradient or log-prob there) passes at a masked one.
    row = tl.program_id(0).to(tl.int64)
    neg_coef = -scalar(kl_coef, kl_coef_lo, ACC)
    offs = tl.arange(0, BLOCK_T).to(tl.int64)
    for chunk in range(0, tl.cdiv(length, BLOCK_T)):
        t = chunk * BLOCK_T + offs
        inside = t < length
        valid = tl.load(mask_ptr + row * mask_stride0 + t * mask_stride1, mask=inside, other=0) != 0
        grad_kl = tl.zeros([BLOCK_T], ACC)
        if HAS_GRAD_KL:
            grad_kl += tl.load(grad_kl_ptr + row * grad_kl_stride0 + t * grad_kl_stride1, mask=valid, other=0.0).to(ACC)
        if HAS_GRAD_REWARDS:
            grad_rewards = tl.load(
                grad_rewards_ptr + row * grad_rewards_stride0 + t * grad_rewards_stride1, mask=valid, other=0.0
            )
            grad_kl += neg_coef * grad_rewards.to(ACC)
        logp = tl.load(logp_ptr + row * logp_stride0 + t * logp_stride1, mask=valid, other=0.0).to(ACC)
        ref = tl.load(ref_ptr + row * ref_stride0 + t * ref_stride1, mask=valid, other=0.0).to(ACC)
        grad = tl.where(valid, _kl_grad(logp - ref, grad_kl, KL_ESTIMATOR), 0.0)
        out_offs = row * length + t
        tl.store(grad_logp_ptr + out_offs, cast_for_store(grad, grad_logp_ptr), mask=inside)
        tl.store(grad_ref_ptr + out_offs, cast_for_store(-grad, grad_ref_ptr), mask=inside)
    if HAS_GRAD_REWARDS:
        last = tl.load(last_ptr + row).to(tl.int64)
        has_last = (last >= 0) & (last < length)
        grad_score = tl.load(
            grad_rewards_ptr + row * grad_rewards_stride0 + tl.where(has_last, last, 0) * grad_rewards_stride1,
            mask=has_last,
            other=0.0,
        ).to(ACC)
        tl.store(grad_scores_ptr + row, cast_for_store(grad_score, grad_scores_ptr))


def _elementwise_grid(numel: int) -> tuple[int]:
    return (triton.cdiv(numel, _ELEMENTWISE_BLOCK),)


def _warps(kl_estimator: str) -> int:
    """k3's float64 math holds twice the registers per element: in a block of 1024 (elementwise, or a
    row's chunk), 4 elements a thread, not 8 (no spills)."""
    return 8 if kl_estimator == "k3" else 4


def _rows_and_strides(*tensors: torch.Tensor) -> tuple[int, list[int], bool]:
    """2-D views of same-shaped tensors: ``(cols, [stride0, stride1] of each, strided)``,
    ``strided`` False when all are contiguous (then the kernel indexes them flat)."""
    views = [as_rows(x) for x in tensors]
    strides = [s for v in views for s in v.stride()]
    return views[0].shape[1], strides, not all(x.is_contiguous() for x in tensors)


def kl_estimate_forward(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_estimator: str) -> torch.Tensor:
    """Per-token KL estimate, any shape and strides; a new contiguous float32 tensor (float64 for float64 inputs)."""
    check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    check_same_device(logprobs=logprobs, ref_logprobs=ref_logprobs)
    kl = torch.empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs), device=logprobs.device)
    if kl.numel():
        logp_rows, ref_rows = as_rows(logprobs), as_rows(ref_logprobs)
        cols, strides, strided = _rows_and_strides(logp_rows, ref_rows)
        with device_guard(kl):
            _kl_estimate_kernel[_elementwise_grid(kl.numel())](
                logp_rows,
                ref_rows,
                kl,
                kl.numel(),
                cols,
                *strides,
                KL_ESTIMATOR=kl_estimator_code(kl_estimator),
                ACC=compute_dtype(kl.dtype),
                BLOCK=_ELEMENTWISE_BLOCK,
                STRIDED=strided,
                num_warps=_warps(kl_estimator),
            )
    return kl


def kl_estimate_backward(
    grad_kl: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_kl * kl)`` w.r.t. ``logprobs`` and ``ref_logprobs``, in their dtypes (any strides in)."""
    check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    check_shape("grad_kl", grad_kl, logprobs.shape)
    check_same_device(logprobs=logprobs, ref_logprobs=ref_logprobs, grad_kl=grad_kl)
    grad_logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype, device=logprobs.device)
    grad_ref = torch.empty(ref_logprobs.shape, dtype=ref_logprobs.dtype, device=ref_logprobs.device)
    if grad_logprobs.numel():
        views = [as_rows(x) for x in (logprobs, ref_logprobs, grad_kl)]
        cols, strides, strided = _rows_and_strides(*views)
        with device_guard(grad_logprobs):
            _kl_backward_kernel[_elementwise_grid(grad_logprobs.numel())](
                *views,
                grad_logprobs,
                grad_ref,
                grad_logprobs.numel(),
                cols,
                *strides,
                KL_ESTIMATOR=kl_estimator_code(kl_estimator),
                ACC=compute_dtype(result_dtype(logprobs, ref_logprobs)),
                BLOCK=_ELEMENTWISE_BLOCK,
                STRIDED=strided,
                num_warps=_warps(kl_estimator),
            )
    return grad_logprobs, grad_ref


def _check_rewards_inputs(scores, logprobs, ref_logprobs, mask) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    check_shape("mask", mask, logprobs.shape)
    check_shape("scores", scores, logprobs.shape[:1])
    check_same_device(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask, scores=scores)


def _block_t(length: int, block_t: int | None) -> int:
    return block_t or min(triton.next_power_of_2(length), MAX_BLOCK_T)


def kl_penalized_rewards_forward(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kl_estimator: str,
    *,
    block_t: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards, kl, last)``: rewards and kl ``[B, T]`` float32 (float64 for float64 log-probs); ``last [B]`` int32 is each
    row's last valid index, -1 for a row without one.  Any strides (expanded included), ``mask`` bool or 0/1 of any
    dtype; ``block_t`` overrides the chunk size."""
    _check_rewards_inputs(scores, logprobs, ref_logprobs, mask)
    batch, length = logprobs.shape
    rewards = torch.empty((batch, length), dtype=result_dtype(logprobs, ref_logprobs), device=logprobs.device)
    kl = torch.empty_like(rewards)
    last = torch.empty(batch, dtype=torch.int32, device=logprobs.device)
    if batch == 0:
        return rewards, kl, last
    if length == 0:
        return rewards, kl, last.fill_(-1)
    with device_guard(rewards):
        _kl_rewards_kernel[(batch,)](
            scores,
            logprobs,
            ref_logprobs,
            mask,
            rewards,
            kl,
            last,
            length,
            scores.stride(0),
            *logprobs.stride(),
            *ref_logprobs.stride(),
            *mask.stride(),
            *split_scalar(kl_coef),
            KL_ESTIMATOR=kl_estimator_code(kl_estimator),
            ACC=compute_dtype(rewards.dtype),
            BLOCK_T=_block_t(length, block_t),
            num_warps=_warps(kl_estimator),
        )
    return rewards, kl, last


def kl_penalized_rewards_backward(
    grad_rewards: torch.Tensor | None,
    grad_kl: torch.Tensor | None,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    last: torch.Tensor,
    *,
    kl_coef: float,
    kl_estimator: str,
    scores_dtype: torch.dtype,
    block_t: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(grad_scores, grad_logprobs, grad_ref_logprobs)`` from the gradients of ``kl_penalized_rewards_forward``'s
    rewards and kl (either may be None: unused), each in its input's dtype (``scores_dtype`` for the scores).

    ``grad_scores`` is None without ``grad_rewards`` (the scores reach only the rewards).  Masked positions get
    exactly 0, whatever their log-probs or incoming gradients hold.  ``last`` is the forward's."""
    batch, length = logprobs.shape
    check_shape("ref_logprobs", ref_logprobs, logprobs.shape)
    check_shape("mask", mask, logprobs.shape)
    check_shape("last", last, (batch,))
    check_shape("grad_rewards", grad_rewards, logprobs.shape)
    check_shape("grad_kl", grad_kl, logprobs.shape)
    check_same_device(
        logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask, last=last, grad_rewards=grad_rewards, grad_kl=grad_kl
    )
    grad_logprobs = torch.empty((batch, length), dtype=logprobs.dtype, device=logprobs.device)
    grad_ref = torch.empty((batch, length), dtype=ref_logprobs.dtype, device=logprobs.device)
    has_rewards, has_kl = grad_rewards is not None, grad_kl is not None
    grad_scores = torch.empty(batch, dtype=scores_dtype, device=logprobs.device) if has_rewards else None
    if batch == 0:
        return grad_scores, grad_logprobs, grad_ref
    if length == 0 or not (has_rewards or has_kl):
        return (None if grad_scores is None else grad_scores.zero_()), grad_logprobs.zero_(), grad_ref.zero_()
    some_grad = grad_rewards if has_rewards else grad_kl
    with device_guard(grad_logprobs):
        _kl_rewards_bwd_kernel[(batch,)](
            logprobs,
            ref_logprobs,
            mask,
            last,
            some_grad if grad_rewards is None else grad_rewards,  # unused without HAS_GRAD_REWARDS
            some_grad if grad_kl is None else grad_kl,  # unused without HAS_GRAD_KL
            grad_logprobs if grad_scores is None else grad_scores,  # unused without HAS_GRAD_REWARDS
            grad_logprobs,
            grad_ref,
            length,
            *logprobs.stride(),
            *ref_logprobs.stride(),
            *mask.stride(),
            *(grad_rewards.stride() if has_rewards else (0, 0)),
            *(grad_kl.stride() if has_kl else (0, 0)),
            *split_scalar(kl_coef),
            HAS_GRAD_REWARDS=has_rewards,
            HAS_GRAD_KL=has_kl,
            KL_ESTIMATOR=kl_estimator_code(kl_estimator),
            ACC=compute_dtype(result_dtype(logprobs, ref_logprobs)),
            BLOCK_T=_block_t(length, block_t),
            num_warps=_warps(kl_estimator),
        )
    return grad_scores, grad_logprobs, grad_ref


# --------------------------------------------------------------------------- torch custom op and autograd


@custom_op("ppo_fast_triton::kl_estimate", mutates_args=())
def _kl_estimate_op(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_estimator: str) -> torch.Tensor:
    return kl_estimate_forward(logprobs, ref_logprobs, kl_estimator)


@_kl_estimate_op.register_fake
def _(logprobs, ref_logprobs, kl_estimator):
    return logprobs.new_empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs))


@custom_op("ppo_fast_triton::kl_estimate_backward", mutates_args=())
def _kl_estimate_backward_op(
    grad_kl: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return kl_estimate_backward(grad_kl, logprobs, ref_logprobs, kl_estimator)


@_kl_estimate_backward_op.register_fake
def _(grad_kl, logprobs, ref_logprobs, kl_estimator):
    # Contiguous, as the kernels' outputs are (empty_like would keep a transposed input's strides).
    return logprobs.new_empty(logprobs.shape), ref_logprobs.new_empty(ref_logprobs.shape)


def _kl_estimate_setup(ctx, inputs, output):
    logprobs, ref_logprobs, ctx.kl_estimator = inputs
    ctx.save_for_backward(logprobs, ref_logprobs)


def _kl_estimate_backward(ctx, grad_kl):
    logprobs, ref_logprobs = ctx.saved_tensors
    grad_logprobs, grad_ref = call(_kl_estimate_backward_op, grad_kl, logprobs, ref_logprobs, ctx.kl_estimator)
    return grad_logprobs, grad_ref, None


_kl_estimate = with_autograd(_kl_estimate_op, _kl_estimate_backward, _kl_estimate_setup)


def kl_estimate(logprobs, ref_logprobs, kl_estimator):
    return _kl_estimate(logprobs, ref_logprobs, kl_estimator)


@custom_op("ppo_fast_triton::kl_penalized_rewards", mutates_args=())
def _kl_penalized_rewards_op(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kl_estimator: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards, kl, last)``: ``last [B]`` int32 is each row's last valid index (-1 if none), for the backward."""
    return kl_penalized_rewards_forward(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator)


@_kl_penalized_rewards_op.register_fake
def _(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator):
    rewards = logprobs.new_empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs))
    return rewards, torch.empty_like(rewards), scores.new_empty(scores.shape, dtype=torch.int32)


@custom_op("ppo_fast_triton::kl_penalized_rewards_backward", mutates_args=())
def _kl_penalized_rewards_backward_op(
    grad_rewards: torch.Tensor | None,
    grad_kl: torch.Tensor | None,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    last: torch.Tensor,
    kl_coef: float,
    kl_estimator: str,
    scores_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_scores, grad_logprobs, grad_ref_logprobs)``; ``grad_scores`` is empty without ``grad_rewards``."""
    grad_scores, grad_logprobs, grad_ref = kl_penalized_rewards_backward(
        grad_rewards,
        grad_kl,
        logprobs,
        ref_logprobs,
        mask,
        last,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        scores_dtype=scores_dtype,
    )
    return (
        (grad_logprobs.new_empty(0, dtype=scores_dtype) if grad_scores is None else grad_scores),
        grad_logprobs,
        grad_ref,
    )


@_kl_penalized_rewards_backward_op.register_fake
def _(grad_rewards, grad_kl, logprobs, ref_logprobs, mask, last, kl_coef, kl_estimator, scores_dtype):
    grad_scores = last.new_empty(last.shape if grad_rewards is not None else (0,), dtype=scores_dtype)
    return grad_scores, logprobs.new_empty(logprobs.shape), ref_logprobs.new_empty(ref_logprobs.shape)


def _kl_penalized_rewards_setup(ctx, inputs, output):
    scores, logprobs, ref_logprobs, mask, ctx.kl_coef, ctx.kl_estimator = inputs
    ctx.scores_dtype = scores.dtype
    last = output[2]
    ctx.save_for_backward(logprobs, ref_logprobs, mask, last)
    ctx.mark_non_differentiable(last)
    ctx.set_materialize_grads(False)


def _kl_penalized_rewards_backward(ctx, grad_rewards, grad_kl, _grad_last):
    not_differentiable(ctx, mask=3)
    logprobs, ref_logprobs, mask, last = ctx.saved_tensors
    grad_scores, grad_logprobs, grad_ref = call(
        _kl_penalized_rewards_backward_op,
        grad_rewards,
        grad_kl,
        logprobs,
        ref_logprobs,
        mask,
        last,
        ctx.kl_coef,
        ctx.kl_estimator,
        ctx.scores_dtype,
    )
    # The scores reach only the rewards: no rewards gradient, no scores gradient.
    return (grad_scores if grad_rewards is not None else None), grad_logprobs, grad_ref, None, None, None


_kl_penalized_rewards = with_autograd(
    _kl_penalized_rewards_op, _kl_penalized_rewards_backward, _kl_penalized_rewards_setup
)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator):
    rewards, kl, _ = _kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator)
    return rewards, kl


def static_variants(batch: int = 64, length: int = 8192) -> list[dict]:
    """This op's kernel launches for ``bench.static`` (sm_90 code compiled without a GPU), on meta tensors:
    kl_estimate forward and backward per kl_estimator (k3 also transposed), kl_penalized_rewards forward and backward.

    One dict per variant: ``name``, ``run`` (calls a launcher), ``budget_key`` (None: no budget),
    ``bytes_per_element`` (global memory read + written per token; None: not modelled).
    """

    def meta(shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta")

    def seq(dtype=torch.float32, transposed=False):
        return meta((length, batch), dtype).t() if transposed else meta((batch, length), dtype)

    out = []
    for kl_estimator in KL_ESTIMATORS:
        for transposed in (False, True) if kl_estimator == "k3" else (False,):
            layout = " transposed" if transposed else ""
            out.append(
                dict(
                    name=f"kl_estimate fwd {kl_estimator}{layout}",
                    budget_key=None,
                    bytes_per_element=12,
                    run=lambda e=kl_estimator, t=transposed: kl_estimate_forward(
                        seq(transposed=t), seq(transposed=t), e
                    ),
                )
            )
            out.append(
                dict(
                    name=f"kl_estimate bwd {kl_estimator}{layout}",
                    budget_key=None,
                    bytes_per_element=20,
                    run=lambda e=kl_estimator, t=transposed: kl_estimate_backward(
                        seq(), seq(transposed=t), seq(transposed=t), e
                    ),
                )
            )
        out.append(
            dict(
                name=f"kl_penalized_rewards fwd {kl_estimator}",
                budget_key=None,
                bytes_per_element=17,
                run=lambda e=kl_estimator: kl_penalized_rewards_forward(
                    meta((batch,)), seq(), seq(), seq(torch.bool), 0.05, e
                ),
            )
        )
    for has_rewards, has_kl in ((True, True), (True, False), (False, True)):
        what = "+".join(n for n, on in (("rewards", has_rewards), ("kl", has_kl)) if on)
        out.append(
            dict(
                name=f"kl_penalized_rewards bwd({what}) k3",
                budget_key=None,
                bytes_per_element=None,
                run=lambda r=has_rewards, k=has_kl: kl_penalized_rewards_backward(
                    seq() if r else None,
                    seq() if k else None,
                    seq(),
                    seq(),
                    seq(torch.bool),
                    meta((batch,), torch.int32),
                    kl_coef=0.05,
                    kl_estimator="k3",
                    scores_dtype=torch.float32,
                ),
            )
        )
    return out
