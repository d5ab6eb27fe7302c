"""Public op: rollout-correction weights, the ``weights`` the policy losses take."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._varlen import one_row, varlen
from ..backends import reference
from ..spec import ROLLOUT_CORRECTION_MODES

__all__ = ["rollout_correction_weights"]


def _packed(segments, old_logprobs, rollout_logprobs, mask, **kwargs):
    """Per token as one row; the ``seq_*`` modes' log-ratio sums per segment."""
    if not str(kwargs.get("mode", "token_tis")).startswith("seq"):
        return one_row(_weights(None, old_logprobs[None], rollout_logprobs[None], mask[None], **kwargs))
    return _weights(segments, old_logprobs, rollout_logprobs, mask, **kwargs)


def _weights(
    segments,
    old_logprobs,
    rollout_logprobs,
    mask,
    *,
    mode: str = "token_tis",
    threshold: float = 2.0,
    threshold_low: float = 0.0,
    batch_normalize: bool = False,
):
    check.required(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    check.tensor("old_logprobs", old_logprobs, ndim=2 if segments is None else 1)
    check.tensor("rollout_logprobs", rollout_logprobs, ndim=2 if segments is None else 1)
    check.same_shape("old_logprobs", old_logprobs, rollout_logprobs=rollout_logprobs)
    check.same_device(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    mask = check.mask("mask", mask, old_logprobs.shape)
    check.choice("mode", mode, ROLLOUT_CORRECTION_MODES)
    threshold = check.real("threshold", threshold, low=0.0, low_open=True)
    threshold_low = check.real("threshold_low", threshold_low, low=0.0, high=threshold)
    if mode.endswith("tis") and threshold_low != 0.0:
        raise ValueError(f"threshold_low applies to the masked modes (token_mis, seq_mis), not to mode {mode!r}")
    check.flag("batch_normalize", batch_normalize)
    return reference.rollout_correction_weights(
        old_logprobs,
        rollout_logprobs,
        mask,
        mode,
        threshold=threshold,
        threshold_low=threshold_low,
        batch_normalize=batch_normalize,
        segments=segments,
    )


@varlen("old_logprobs", "rollout_logprobs", "mask", packed=_packed)
def rollout_correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token_tis",
    threshold: float = 2.0,
    threshold_low: float = 0.0,
    batch_normalize: bool = False,
):
    """Importance-sampling weights that correct for the rollout engine's log-probs
    differing from the trainer's (truncated IS, "TIS", and masked IS, "MIS"/IcePop).

    ``w = pi_old / pi_rollout`` from ``old_logprobs - rollout_logprobs`` (both ``[B, T]``,
    the trainer's and the engine's log-probs of the sampled tokens), clamped to
    ``exp([-20, 20])``:

    * ``token_tis``: per token, ``min(w_t, threshold)``;
    * ``seq_tis``: per sequence, ``min(prod_t w_t, threshold)`` on every token of the row;
    * ``token_mis`` / ``seq_mis``: the same weights, but 0 where they lie outside
      ``[threshold_low, threshold]`` instead of truncated.

    ``batch_normalize`` divides by the weights' mean (over valid tokens, or over rows with
    a valid token for ``seq_*``) when that mean exceeds 1e-8.  These are verl 0.9.1's
    ``compute_rollout_correction_weights`` with ``rollout_is="token"/"sequence"`` and
    ``rollout_is_threshold=threshold`` (TIS) or ``"threshold_low_threshold"`` (IcePop;
    ``threshold_low=0`` keeps every weight up to ``threshold``, which verl's string form
    cannot say).

    Returns a ``[B, T]`` float32 (float64 for float64 inputs) tensor without gradient, 0
    at masked positions: pass it as ``weights=`` to :func:`policy_loss`.
    """
    return _weights(
        None,
        old_logprobs,
        rollout_logprobs,
        mask,
        mode=mode,
        threshold=threshold,
        threshold_low=threshold_low,
        batch_normalize=batch_normalize,
    )
