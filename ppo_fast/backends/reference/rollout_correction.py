"""Reference rollout-correction weights (TIS/MIS between engine and trainer log-probs)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import masked_inputs
from .aggregate import masked_mean

SUPPORTED = {}  # helpers of the public ops, not backend ops


# --------------------------------------------------------------------------- rollout correction

# exp() of a log-ratio outside [-20, 20] is clamped there (as verl's SAFETY_BOUND): a weight
# never overflows, whatever the engines disagree on.
_LOG_RATIO_BOUND = 20.0


def rollout_correction_weights(
    old_logprobs,
    rollout_logprobs,
    mask,
    mode: str,
    *,
    threshold: float,
    threshold_low: float,
    batch_normalize: bool,
    segments=None,
):
    """Importance weights ``pi_train / pi_rollout`` per token (``token_*``) or per sequence
    (``seq_*``, ``exp`` of the row's summed log-ratio, on each of its tokens), truncated at
    ``threshold`` (``*_tis``) or zeroed outside ``[threshold_low, threshold]`` (``*_mis``);
    with ``batch_normalize`` divided by their mean (over tokens, or over non-empty rows for
    ``seq_*``) when that mean exceeds 1e-8.  0 at masked positions; no gradient.  With
    ``segments`` (``ppo_fast._varlen.Segments``) the inputs are packed ``[N]`` and each segment is a row."""
    old, rollout = masked_inputs(mask, old_logprobs.detach(), rollout_logprobs.detach())
    log_ratio = old - rollout
    if mode.startswith("seq"):
        if segments is None:
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old)
        else:
            log_ratio = segments.spread(segments.sum(log_ratio))
    raw = torch.where(mask, log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp(), 0.0)
    if mode.endswith("tis"):
        weights = raw.clamp(max=threshold)
    else:
        weights = torch.where((raw >= threshold_low) & (raw <= threshold), raw, 0.0)
    if batch_normalize:
        if mode.startswith("seq") and segments is not None:
            rows = segments.sum(mask.to(weights.dtype)) > 0
            row_weight = weights.new_zeros(segments.sequences).scatter_reduce(0, segments.ids, weights, "amax")
            mean = torch.where(rows, row_weight, 0.0).sum() / rows.sum().clamp_min(1)
        elif mode.startswith("seq"):
            rows = mask.any(-1)
            # every valid token of a row holds its weight (all >= 0); a row of no token holds 0
            row_weight = weights.amax(-1) if weights.shape[-1] else weights.new_zeros(weights.shape[:-1])
            mean = torch.where(rows, row_weight, 0.0).sum() / rows.sum().clamp_min(1)
        else:
            mean = masked_mean(weights, mask)
        weights = torch.where(mean > 1e-8, weights / mean, weights)
    return weights
