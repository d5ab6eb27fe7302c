"""Reference masked statistics and verl's loss aggregation modes."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import masked_inputs

SUPPORTED = {}  # helpers of the public ops, not backend ops


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of ``x`` over ``mask``; 0 where nothing is valid."""
    (x,) = masked_inputs(mask, x)
    m = mask.to(x.dtype)
    total = x.sum() if dim is None else x.sum(dim)
    count = m.sum() if dim is None else m.sum(dim)
    return total / count.clamp_min(1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid entries (Bessel-corrected variance).

    With ``shift_mean=False`` the mean is added back after scaling, as TRL and verl do.
    Masked entries are 0 (all of them when nothing is valid).
    """
    (x,) = masked_inputs(mask, x)
    m = mask.to(x.dtype)
    count = m.sum()
    mean = x.sum() / count.clamp_min(1.0)
    var = torch.where(mask, (x - mean).square(), 0.0).sum() / (count - 1.0).clamp_min(1.0)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss over ``mask`` the way verl's ``agg_loss`` does.

    Empty selections give 0 rather than NaN (a batch of padding has no loss).
    """
    m = mask.to(per_token.dtype)
    masked = torch.where(mask, per_token, 0.0)
    if agg == "token-sum":
        return masked.sum()
    if agg == "token-mean":
        return masked.sum() / m.sum().clamp_min(1.0)
    row_tokens = m.sum(-1)
    row_has_tokens = (row_tokens > 0).to(per_token.dtype)
    row_sum = masked.sum(-1)
    if agg == "seq-mean-token-mean":
        row_loss = row_sum / row_tokens.clamp_min(1.0)
    else:  # seq-mean-token-sum and its -norm variant
        row_loss = row_sum
    loss = (row_loss * row_has_tokens).sum() / row_has_tokens.sum().clamp_min(1.0)
    if agg == "seq-mean-token-sum-norm":
        loss = loss / max(per_token.shape[-1], 1)
    return loss


def _per_longest(x: torch.Tensor, segments) -> torch.Tensor:
    """``x`` divided by the longest length (at least 1): a host int as a scalar (a tensor made from it
    on CUDA would be a copy that syncs), a device tensor as it is."""
    longest = segments.max_seqlen
    if isinstance(longest, int):
        return x / max(longest, 1)
    return x / longest.clamp_min(1).to(x.dtype)


def segment_scale(segments, mask: torch.Tensor, agg: str, dtype: torch.dtype) -> torch.Tensor | None:
    """``[N]`` the factor of each token's loss in a ``seq-mean-*`` aggregation of packed tokens, as
    ``aggregate`` weighs its row: ``loss = sum_t scale_t * loss_t`` over the valid tokens.  None for
    the token-level modes (no factor per sequence)."""
    if not agg.startswith("seq-mean"):
        return None
    row_tokens = segments.sum(mask.to(dtype))
    row_has_tokens = (row_tokens > 0).to(dtype)
    scale = row_has_tokens / row_has_tokens.sum().clamp_min(1.0)
    if agg == "seq-mean-token-mean":
        scale = scale / row_tokens.clamp_min(1.0)
    elif agg == "seq-mean-token-sum-norm":
        scale = _per_longest(scale, segments)
    return segments.spread(scale)


def aggregate_packed(segments, per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """``aggregate`` of packed ``[N]`` tokens: the row sums are per-segment sums (each in token
    order), ``T`` of ``seq-mean-token-sum-norm`` is the longest segment's length."""
    if not agg.startswith("seq-mean"):
        return aggregate(per_token[None], mask[None], agg)
    m = mask.to(per_token.dtype)
    masked = torch.where(mask, per_token, 0.0)
    row_tokens = segments.sum(m)
    row_has_tokens = (row_tokens > 0).to(per_token.dtype)
    row_sum = segments.sum(masked)
    row_loss = row_sum / row_tokens.clamp_min(1.0) if agg == "seq-mean-token-mean" else row_sum
    loss = (row_loss * row_has_tokens).sum() / row_has_tokens.sum().clamp_min(1.0)
    if agg == "seq-mean-token-sum-norm":
        loss = _per_longest(loss, segments)
    return loss
