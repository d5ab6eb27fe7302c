"""Reference clipped value loss."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import DEVICES, masked_inputs
from .aggregate import aggregate, masked_mean

SUPPORTED = {"value_loss": DEVICES}


def value_loss(values, old_values, returns, mask, clip: float, agg: str):
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V) - R)^2)`` and its clip fraction.

    ``clip = inf`` turns clipping off (the public op's ``clip=None``).
    """
    per_token, clipfrac = value_loss_terms(values, old_values, returns, mask, clip)
    return aggregate(per_token, mask, agg), clipfrac


def value_loss_terms(values, old_values, returns, mask, clip: float):
    """The per-token value loss (any layout) and the clip fraction."""
    v, old, ret = masked_inputs(mask, values, old_values, returns)
    v_clipped = torch.maximum(torch.minimum(v, old + clip), old - clip)
    unclipped = (v - ret).square()
    clipped = (v_clipped - ret).square()
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return per_token, clipfrac.detach()
