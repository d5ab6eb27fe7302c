"""Native clipped value loss: fake kernels and autograd."""

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

SUPPORTED = {"value_loss": LOSS_DEVICES}


def _check_loss_backward_inputs(op, grad_loss, row_scale, like):
    check_float(op, "grad_loss", grad_loss)
    torch._check(
        grad_loss.numel() == 1, lambda: f"{op}: grad_loss must have one element, got shape {list(grad_loss.shape)}"
    )
    check_float(op, "row_scale", row_scale)
    check_shape(op, "row_scale", row_scale, like.shape[:1])
    check_same_device(op, inputs=like, grad_loss=grad_loss, row_scale=row_scale)


def _check_value_inputs(op, values, old_values, returns, mask):
    check_float(op, "values", values)
    check_dim(op, "values", values, 2)
    for name, x in (("old_values", old_values), ("returns", returns)):
        check_float(op, name, x)
        check_shape(op, name, x, values.shape, "values")
    check_mask(op, mask, "values", values)
    check_same_device(op, values=values, old_values=old_values, returns=returns, mask=mask)


def _fake_value_loss(values, old_values, returns, mask, clip, agg):
    _check_value_inputs("value_loss", values, old_values, returns, mask)
    check_choice("value_loss", "agg", agg, AGG_MODES)
    dtype = result_dtype(values, old_values, returns)
    return (
        values.new_empty((), dtype=dtype),
        values.new_empty((), dtype=torch.float32),
        values.new_empty((values.shape[0],), dtype=dtype),
    )


def _fake_value_loss_backward(grad_loss, values, old_values, returns, mask, row_scale, clip, output_mask):
    op = "value_loss_backward"
    _check_value_inputs(op, values, old_values, returns, mask)
    _check_loss_backward_inputs(op, grad_loss, row_scale, values)
    return tuple(grad_or_empty(x, wanted) for x, wanted in zip((values, old_values, returns), output_mask))


register("value_loss", _fake_value_loss)
register("value_loss_backward", _fake_value_loss_backward)


def value_loss(values, old_values, returns, mask, clip: float, agg: str):
    loss, clipfrac, _row_scale = torch.ops.ppo_fast.value_loss.default(values, old_values, returns, mask, clip, agg)
    return loss, clipfrac  # clipfrac is a non-differentiable output


direct(value_loss, "value_loss")


# --------------------------------------------------------------------------- the packed layout
# value_loss_varlen (csrc/value_loss.cpp): the same kernels on packed [N] tokens, a row per cu_seqlens
# segment; row_scale [S].


def _check_value_varlen_inputs(op, values, old_values, returns, mask, cu_seqlens):
    check_dim(op, "values", values, 1)
    _check_value_inputs(op, values[None], old_values[None], returns[None], mask[None])
    check_cu_seqlens(op, cu_seqlens)
    check_same_device(op, values=values, cu_seqlens=cu_seqlens)


def _fake_value_loss_varlen(values, old_values, returns, mask, cu_seqlens, clip, agg):
    _check_value_varlen_inputs("value_loss_varlen", values, old_values, returns, mask, cu_seqlens)
    check_choice("value_loss_varlen", "agg", agg, AGG_MODES)
    dtype = result_dtype(values, old_values, returns)
    rows = cu_seqlens.shape[0] - 1
    return (
        values.new_empty((), dtype=dtype),
        values.new_empty((), dtype=torch.float32),
        values.new_empty((rows,), dtype=dtype),
    )


def _fake_value_loss_varlen_backward(
    grad_loss, values, old_values, returns, mask, row_scale, cu_seqlens, clip, output_mask
):
    op = "value_loss_varlen_backward"
    _check_value_varlen_inputs(op, values, old_values, returns, mask, cu_seqlens)
    check_same_device(op, values=values, grad_loss=grad_loss, row_scale=row_scale)
    return tuple(grad_or_empty(x, wanted) for x, wanted in zip((values, old_values, returns), output_mask))


register("value_loss_varlen", _fake_value_loss_varlen)  # autograd: csrc/autograd/value_loss.cpp
register("value_loss_varlen_backward", _fake_value_loss_varlen_backward)
