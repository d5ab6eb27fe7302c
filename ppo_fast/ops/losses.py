"""Public ops: the PPO clipped policy loss and the clipped value loss."""

from __future__ import annotations

import math

import torch

from .. import _validation as check
from ..backends import resolve
from ..contract import AGG_MODES
from ..policy_loss_modes import POLICY_LOSS_MODES


def _loss_inputs(names_and_tensors: dict, mask, optional=("weights",)):
    """Validates ``[B, T]`` inputs of one shape and device (None only for the ``optional``
    names) and returns the mask as bool."""
    check.required(**{n: x for n, x in names_and_tensors.items() if n not in optional})
    first_name, first = next(iter(names_and_tensors.items()))
    for name, x in names_and_tensors.items():
        if x is not None:
            check.tensor(name, x, ndim=2)
    check.same_shape(first_name, first, **{n: x for n, x in list(names_and_tensors.items())[1:]})
    check.same_device(**names_and_tensors, mask=mask)
    return check.mask("mask", mask, first.shape)


def clipped_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    *,
    clip_eps_low=0.2,
    clip_eps_high=None,
    dual_clip=None,
    agg="token-mean",
    weights=None,
):
    """PPO clipped surrogate loss (the quantity to minimise: ``-L_CLIP``).

    The ``vanilla`` mode of :func:`ppo_fast.policy_loss`.  Per token:
    ``ratio = exp(clamp(logp - old, -20, 20))``,
    ``pg = max(-A * ratio, -A * clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high))``
    (``clip_eps_high`` defaults to ``clip_eps_low``);
    with ``dual_clip = c > 1``, ``pg = min(pg, -A * c)`` where ``A < 0``; optional
    per-token ``weights`` multiply ``pg``.  ``agg`` is one of ``token-mean``,
    ``token-sum``, ``seq-mean-token-sum``, ``seq-mean-token-mean``,
    ``seq-mean-token-sum-norm`` (as verl defines them; empty selections give 0).

    Returns:
        ``(loss, stats)``: a 0-dim float32 loss, differentiable w.r.t. ``logprobs``,
        ``old_logprobs``, ``advantages`` and ``weights``, and 0-dim tensors ``clipfrac``,
        ``clipfrac_lower`` and ``approx_kl``.
    """
    mask = _loss_inputs(
        {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": advantages, "weights": weights}, mask
    )
    clip_eps_low, clip_eps_high, dual_clip = POLICY_LOSS_MODES["vanilla"].bind(
        {"clip_eps_low": clip_eps_low, "clip_eps_high": clip_eps_high, "dual_clip": dual_clip}
    )
    check.choice("agg", agg, AGG_MODES)
    fn = resolve("clipped_policy_loss", logprobs.device.type)
    loss, clipfrac, clipfrac_lower, approx_kl = fn(
        logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, dual_clip, agg
    )
    return loss, {"clipfrac": clipfrac, "clipfrac_lower": clipfrac_lower, "approx_kl": approx_kl}


def value_loss(values, old_values, returns, mask, *, clip=0.2, agg="token-mean"):
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)``.

    ``clip=None`` turns clipping off: ``0.5 * (V - R)^2``, and ``old_values`` is not read
    (it may be None).  Aggregated like :func:`clipped_policy_loss`.  Returns
    ``(loss, {"clipfrac": ...})``, the loss differentiable w.r.t. ``values``,
    ``old_values`` and ``returns``.
    """
    if clip is None:
        if old_values is not None:
            _loss_inputs({"values": values, "old_values": old_values}, mask)
        # Clipping to +-inf around the values themselves is no clipping, on every backend.
        old_values, clip = (values.detach() if isinstance(values, torch.Tensor) else values), math.inf
    else:
        clip = check.real("clip", clip, low=0.0, low_open=True)
    mask = _loss_inputs({"values": values, "old_values": old_values, "returns": returns}, mask)
    check.choice("agg", agg, AGG_MODES)
    loss, clipfrac = resolve("value_loss", values.device.type)(values, old_values, returns, mask, clip, agg)
    return loss, {"clipfrac": clipfrac}
