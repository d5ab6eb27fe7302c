"""Native policy losses: clipped_policy_loss (vanilla) and the sequence-level modes (GSPO, GMPO)."""

from __future__ import annotations

import torch

from ..._dtypes import result_dtype
from ...spec import AGG_MODES
from ._common import (
    LOSS_DEVICES,
    check_choice,
    check_cu_seqlens,
    check_dim,
    check_float,
    check_mask,
    check_same_device,
    check_shape,
    direct,
    grad_or_empty,
    register,
)
from .value_loss import _check_loss_backward_inputs

SUPPORTED = {
    "clipped_policy_loss": LOSS_DEVICES,
    "policy_loss_gspo": LOSS_DEVICES,
    "policy_loss_geo_mean": LOSS_DEVICES,
}


def _check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights):
    check_float(op, "logprobs", logprobs)
    check_dim(op, "logprobs", logprobs, 2)
    for name, x in (("old_logprobs", old_logprobs), ("advantages", advantages), ("weights", weights)):
        if x is not None:
            check_float(op, name, x)
            check_shape(op, name, x, logprobs.shape, "logprobs")
            check_same_device(op, logprobs=logprobs, **{name: x})
    check_mask(op, mask, "logprobs", logprobs)
    check_same_device(op, logprobs=logprobs, mask=mask)


def _fake_clipped_policy_loss(
    logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, dual_clip, agg
):
    _check_policy_inputs("clipped_policy_loss", logprobs, old_logprobs, advantages, mask, weights)
    check_choice("clipped_policy_loss", "agg", agg, AGG_MODES)
    dtype = result_dtype(logprobs, old_logprobs, advantages, weights)
    # As in the reference, the clip fractions are float32 and approx_kl has the compute dtype.
    loss, clipfrac, clipfrac_lower, approx_kl = (
        logprobs.new_empty((), dtype=d) for d in (dtype, torch.float32, torch.float32, dtype)
    )
    return loss, clipfrac, clipfrac_lower, approx_kl, logprobs.new_empty((logprobs.shape[0],), dtype=dtype)


def _fake_clipped_policy_loss_backward(
    grad_loss,
    logprobs,
    old_logprobs,
    advantages,
    mask,
    weights,
    row_scale,
    clip_eps_low,
    clip_eps_high,
    dual_clip,
    output_mask,
):
    op = "clipped_policy_loss_backward"
    _check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights)
    _check_loss_backward_inputs(op, grad_loss, row_scale, logprobs)
    grad_weights = grad_or_empty(weights, output_mask[3]) if weights is not None else logprobs.new_empty((0,))
    return (
        grad_or_empty(logprobs, output_mask[0]),
        grad_or_empty(old_logprobs, output_mask[1]),
        grad_or_empty(advantages, output_mask[2]),
        grad_weights,
    )


register("clipped_policy_loss", _fake_clipped_policy_loss)
register("clipped_policy_loss_backward", _fake_clipped_policy_loss_backward)


def clipped_policy_loss(
    logprobs, old_logprobs, advantages, mask, weights, *, clip_eps_low: float, clip_eps_high: float, dual_clip, agg: str
):
    loss, clipfrac, clipfrac_lower, approx_kl, _row_scale = torch.ops.ppo_fast.clipped_policy_loss.default(
        logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, dual_clip, agg
    )
    return loss, clipfrac, clipfrac_lower, approx_kl  # the stats are non-differentiable outputs


direct(clipped_policy_loss, "clipped_policy_loss")


# --------------------------------------------------------------------------- sequence-level policy losses
# policy_loss_gspo and policy_loss_geo_mean (csrc/policy_loss.cpp, csrc/cuda/policy_loss.cu):
# clipped_policy_loss's inputs and stats, plus a per-row state [B, 2] for the backward.

_ROW_STATE = 2  # csrc/common/seq_loss_math.h kRowState


def _seq_loss_outputs(logprobs, dtype, rows: int) -> tuple:
    """A sequence-level mode's forward outputs (fake): loss, clipfrac, clipfrac_lower, approx_kl,
    row_scale [rows] and row_state [rows, 2]."""
    return (
        logprobs.new_empty((), dtype=dtype),
        logprobs.new_empty((), dtype=torch.float32),
        logprobs.new_empty((), dtype=torch.float32),
        logprobs.new_empty((), dtype=dtype),
        logprobs.new_empty((rows,), dtype=dtype),
        logprobs.new_empty((rows, _ROW_STATE), dtype=dtype),
    )


def _seq_loss_ops(mode):
    op = f"policy_loss_{mode}"

    def fake(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, agg):
        _check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights)
        check_choice(op, "agg", agg, AGG_MODES)
        dtype = result_dtype(logprobs, old_logprobs, advantages, weights)
        rows = logprobs.shape[0]
        return _seq_loss_outputs(logprobs, dtype, rows)

    def fake_backward(
        grad_loss,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        weights,
        row_scale,
        row_state,
        clip_eps_low,
        clip_eps_high,
        output_mask,
    ):
        name = f"{op}_backward"
        _check_policy_inputs(name, logprobs, old_logprobs, advantages, mask, weights)
        _check_loss_backward_inputs(name, grad_loss, row_scale, logprobs)
        check_float(name, "row_state", row_state)
        check_shape(name, "row_state", row_state, (logprobs.shape[0], _ROW_STATE))
        check_same_device(name, inputs=logprobs, row_state=row_state)
        grad_weights = grad_or_empty(weights, output_mask[3]) if weights is not None else logprobs.new_empty((0,))
        # GSPO's sequence ratio is detached: old_logprobs gets no gradient.
        grad_old = grad_or_empty(old_logprobs, output_mask[1] and mode != "gspo")
        return (
            grad_or_empty(logprobs, output_mask[0]),
            grad_old,
            grad_or_empty(advantages, output_mask[2]),
            grad_weights,
        )

    register(op, fake)
    register(f"{op}_backward", fake_backward)

    def run(logprobs, old_logprobs, advantages, mask, weights, *, clip_eps_low: float, clip_eps_high: float, agg: str):
        loss, clipfrac, clipfrac_lower, approx_kl, _row_scale, _row_state = getattr(torch.ops.ppo_fast, op).default(
            logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, agg
        )
        return loss, clipfrac, clipfrac_lower, approx_kl

    run.__name__ = run.__qualname__ = op
    return direct(run, op)


policy_loss_gspo = _seq_loss_ops("gspo")
policy_loss_geo_mean = _seq_loss_ops("geo_mean")


# --------------------------------------------------------------------------- the packed layout
# policy_loss_gspo_varlen and policy_loss_geo_mean_varlen (csrc/policy_loss.cpp): the same kernels on
# packed [N] tokens, a row per cu_seqlens segment; row_scale and row_state [S].


def _check_varlen_inputs(name, tensors, cu_seqlens):
    """``tensors``: logprobs, old_logprobs, advantages, mask and weights, packed [N]."""
    check_dim(name, "logprobs", tensors[0], 1)
    _check_policy_inputs(name, *(None if x is None else x[None] for x in tensors))
    check_cu_seqlens(name, cu_seqlens)
    check_same_device(name, logprobs=tensors[0], cu_seqlens=cu_seqlens)


def _seq_loss_varlen_ops(mode):
    op = f"policy_loss_{mode}_varlen"

    def fake(logprobs, old_logprobs, advantages, mask, weights, cu_seqlens, clip_eps_low, clip_eps_high, agg):
        _check_varlen_inputs(op, (logprobs, old_logprobs, advantages, mask, weights), cu_seqlens)
        check_choice(op, "agg", agg, AGG_MODES)
        dtype = result_dtype(logprobs, old_logprobs, advantages, weights)
        rows = cu_seqlens.shape[0] - 1
        return _seq_loss_outputs(logprobs, dtype, rows)

    def fake_backward(
        grad_loss,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        weights,
        row_scale,
        row_state,
        cu_seqlens,
        clip_eps_low,
        clip_eps_high,
        output_mask,
    ):
        name = f"{op}_backward"
        _check_varlen_inputs(name, (logprobs, old_logprobs, advantages, mask, weights), cu_seqlens)
        check_same_device(name, logprobs=logprobs, grad_loss=grad_loss, row_scale=row_scale, row_state=row_state)
        grad_weights = grad_or_empty(weights, output_mask[3]) if weights is not None else logprobs.new_empty((0,))
        grad_old = grad_or_empty(old_logprobs, output_mask[1] and mode != "gspo")
        return (
            grad_or_empty(logprobs, output_mask[0]),
            grad_old,
            grad_or_empty(advantages, output_mask[2]),
            grad_weights,
        )

    register(op, fake)  # autograd: csrc/autograd/policy_loss.cpp
    register(f"{op}_backward", fake_backward)


_seq_loss_varlen_ops("gspo")
_seq_loss_varlen_ops("geo_mean")
