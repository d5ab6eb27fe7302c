"""Public op: the clipped value loss."""

from __future__ import annotations

import math

import torch

from .. import _validation as check
from .._varlen import backend_of, one_row, varlen
from ..backends import direct_op, reference, resolve
from ..spec import AGG_MODES

__all__ = ["value_loss"]


def _packed(segments, values, old_values, returns, mask, *, clip=0.2, agg="token-mean"):
    """``value_loss`` on packed tokens: the token-level aggregations as one row; the ``seq-mean-*``
    ones per segment on the reference and the native kernels (CPU, and CUDA where built: the
    segments' bounds read on the device)."""
    check.choice("agg", agg, AGG_MODES)
    if not agg.startswith("seq-mean"):
        rows = (None if x is None else x[None] for x in (values, old_values, returns, mask))
        return one_row(value_loss(*rows, clip=clip, agg=agg))
    backend = backend_of("value_loss", values.device.type)
    if backend not in ("reference", "native"):
        return NotImplemented  # no segmented kernel there: the padded detour
    if clip is None:
        old_values, clip = values.detach(), math.inf
    else:
        clip = check.real("clip", clip, low=0.0, low_open=True)
    rows = {"values": values, "old_values": old_values, "returns": returns}
    mask = check.loss_inputs({k: None if x is None else x[None] for k, x in rows.items()}, mask[None])[0]
    if backend == "native":
        # csrc/value_loss.cpp's segmented kernel (registered with the native backend)
        loss, clipfrac, _row_scale = torch.ops.ppo_fast.value_loss_varlen(
            values, old_values, returns, mask, segments.cu_seqlens, clip, agg
        )
        clipfrac = clipfrac.detach()
        return loss, {"clipfrac": clipfrac}
    per_token, clipfrac = reference.value_loss_terms(values, old_values, returns, mask, clip)
    return reference.aggregate_packed(segments, per_token, mask, agg), {"clipfrac": clipfrac}


@varlen("values", "old_values", "returns", "mask", packed=_packed)
def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
    agg: str = "token-mean",
):
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)``.

    ``clip=None`` turns clipping off: ``0.5 * (V - R)^2``, and ``old_values`` is not read
    (it may be None).  Aggregated like :func:`clipped_policy_loss`.  Returns
    ``(loss, {"clipfrac": ...})``, the loss differentiable w.r.t. ``values``,
    ``old_values`` and ``returns``.
    """
    direct = None if clip is None else direct_op("value_loss", values, mask)
    if direct is not None:
        try:
            loss, clipfrac, _ = direct(
                values, old_values, returns, mask, check.real("clip", clip, low=0.0, low_open=True), agg
            )
        except Exception:  # refused: the checks below name what
            pass
        else:
            return loss, {"clipfrac": clipfrac}
    if clip is None:
        if old_values is not None:
            check.loss_inputs({"values": values, "old_values": old_values}, mask)
        # Clipping to +-inf around the values themselves is no clipping, on every backend.
        old_values, clip = (values.detach() if isinstance(values, torch.Tensor) else values), math.inf
    else:
        clip = check.real("clip", clip, low=0.0, low_open=True)
    mask = check.loss_inputs({"values": values, "old_values": old_values, "returns": returns}, mask)
    check.choice("agg", agg, AGG_MODES)
    loss, clipfrac = resolve("value_loss", values.device.type)(values, old_values, returns, mask, clip, agg)
    return loss, {"clipfrac": clipfrac}
