"""The one-pass policy loss's argument bundles and one chunk's terms, in plain PyTorch: the reference's
``linear_policy_loss`` sums them over chunks, and the fast backends' loop (``backends/_one_pass.py``)
builds on them.  Here, under the reference, so that the oracle imports nothing of the fast paths."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..._dtypes import result_dtype
from ..._varlen import Segments, to_device
from . import policy_loss as _losses
from .aggregate import aggregate, masked_mean
from .kl_penalized_rewards import kl_estimate
from .policy_loss import _PackedRows


class Head(NamedTuple):
    """How the LM head's logits become log-probs (``pf.linear_token_logprobs``'s options)."""

    temperature: float
    logit_scale: float
    logit_softcap: float | None
    ignore_index: int


class Terms(NamedTuple):
    """The loss's terms besides the policy loss: the KL loss term and the entropy bonus."""

    kl_coef: float
    kl_estimator: str
    entropy_coef: float


class PerToken(NamedTuple):
    """The ``[B, T]`` inputs of the policy loss (``weights`` and ``ref`` may be None).  ``scale``: the
    packed layout (``B = 1``, the ``N`` packed tokens as one row), each token's factor of its
    aggregation (``pf.aggregate``'s weight of it in a ``seq-mean-*`` one, whose ``agg`` is then
    ``token-sum``; 1 in a token one); its chunks split the row, since every term is then local to a token.
    ``bounds``: a sequence-level mode's packed layout (``scale`` None, ``agg`` the call's), ``cu_seqlens``
    ``[S + 1]`` int64 on the host (whatever the tokens' device): its chunks are whole sequences
    (``segment_chunks``), a chunk's ``bounds`` its own, and its terms the mode's on those sequences
    (``_PackedRows``), the bounds copied to the device without a sync (``_varlen.to_device``)."""

    old: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor | None
    ref: torch.Tensor | None
    scale: torch.Tensor | None = None
    bounds: torch.Tensor | None = None

    def rows(self, rs) -> PerToken:
        """The chunk ``rs`` (an index of the ``[B, T]`` tensors: rows, or a packed row's tokens)."""
        per_token, bounds = [None if x is None else x[rs] for x in self[:-1]], self.bounds
        if bounds is not None:  # the packed row's tokens [t0, t1), cut at sequence ends
            t0, t1 = rs[1].start, rs[1].stop
            bounds = bounds[(bounds >= t0) & (bounds <= t1)] - t0
        return PerToken(*per_token, bounds)


def segment_chunks(bounds: list[int], rows: int) -> list[tuple[int, int]]:
    """``[(t0, t1), ...]``: the packed tokens' chunks of whole sequences (``bounds``: ``cu_seqlens`` as
    a list), as many as fit ``rows`` tokens; a sequence longer than ``rows`` is a chunk of its own (the
    padded layout's rule: its logits are alive at once, as a padded row of that length would be)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    chunks, start, last = [], 0, 0  # the open chunk [start, last)
    for end in bounds[1:]:
        if end - start > rows:  # the sequence [last, end) does not fit: close the chunk before it
            if last > start:
                chunks.append((start, last))
                start = last
            if end - start > rows:  # longer than a chunk on its own
                chunks.append((start, end))
                start = end
        last = end
    if last > start or not chunks:
        chunks.append((start, last))
    return chunks


def chunk_index(batch: int, length: int, rows: int, packed: bool, bounds=None) -> list[tuple[slice, slice]]:
    """The one pass's chunks of ``[B, T]`` tokens, as ``(rows, tokens)`` indices: whole sequences, as many
    as fit ``rows`` tokens (at least one); ``packed`` (one row of packed tokens): ``rows`` tokens each, or
    with ``bounds`` (``PerToken.bounds``) whole packed sequences (``segment_chunks``)."""
    if bounds is not None:
        return [(slice(None), slice(t0, t1)) for t0, t1 in segment_chunks(bounds.tolist(), rows)]
    if packed:
        return [(slice(None), slice(t0, t0 + rows)) for t0 in range(0, max(length, 1), rows)]
    step = max(1, rows // max(1, length))
    return [(slice(b0, b0 + step), slice(None)) for b0 in range(0, max(batch, 1), step)]


class Objective(NamedTuple):
    """The policy-loss mode, its parameters (bound, in order) and the aggregation."""

    mode: object  # spec.PolicyLossMode
    params: tuple
    agg: str


def loss_scales(mask: torch.Tensor, agg: str, bounds: torch.Tensor | None = None):
    """``(per_row, per_token)``: what one chunk's ``agg`` loss and masked means are multiplied by
    so that the chunks' sum is the batch's: the chunk's share of the batch's normaliser (valid
    tokens for ``token-mean`` and the masked means, responses with a token for ``seq-mean-*``,
    1 for ``token-sum``), known from the mask before the pass.  Functions of the chunk's mask (and
    with ``bounds``, ``PerToken.bounds``, its own: the responses are the packed sequences, and
    ``seq-mean-token-sum-norm``'s ``1 / T``, the longest's, is in ``per_row``), in float64 (each term
    casts it to its own dtype)."""
    total_tokens = mask.sum(dtype=torch.float64).clamp_min(1)
    total_rows = responses(mask, bounds).clamp_min(1)
    longest = 1
    if bounds is not None and agg == "seq-mean-token-sum-norm":
        longest = max(int((bounds[1:] - bounds[:-1]).max()), 1)

    def per_row(chunk_mask, chunk_bounds=None):
        if agg == "token-sum":
            return torch.ones((), dtype=torch.float64, device=mask.device)
        if agg == "token-mean":
            return chunk_mask.sum(dtype=torch.float64) / total_tokens
        return responses(chunk_mask, chunk_bounds) / total_rows / longest

    return per_row, lambda chunk_mask: chunk_mask.sum(dtype=torch.float64) / total_tokens


def responses(mask: torch.Tensor, bounds: torch.Tensor | None) -> torch.Tensor:
    """The rows with a valid token (float64), or with ``bounds`` the packed sequences of the ``[1, N]`` mask."""
    if bounds is None:
        return mask.any(-1).sum(dtype=torch.float64)
    valid = torch.nn.functional.pad(mask[0].cumsum(0), (1, 0)).index_select(0, to_device(bounds, mask.device))
    return ((valid[1:] - valid[:-1]) > 0).sum(dtype=torch.float64)


def _chunk_segments(bounds: torch.Tensor, tokens: int, device) -> Segments:
    """A chunk's packed sequences (``PerToken.bounds``, its own, on the host) on ``device`` (a norm's T is
    in the row share, so its ``max_seqlen`` is not read)."""
    return Segments.of(bounds, tokens, device)


def chunk_terms(logp, entropy, x: PerToken, objective: Objective, terms: Terms, scales) -> tuple:
    """One chunk's share of ``(loss, pg_loss, entropy mean, kl_loss, *mode stats)``."""
    mode_fn = getattr(_losses, objective.mode.op)
    row_scale, token_scale = scales[0](x.mask, x.bounds), scales[1](x.mask)
    named = objective.mode.named(objective.params)
    weights = x.weights
    agg, rows = objective.agg, None
    if x.bounds is not None:  # packed, sequence-level: the chunk's whole sequences (a norm's 1 / T in row_scale)
        rows = _PackedRows(_chunk_segments(x.bounds, x.mask.shape[-1], x.mask.device))
        agg = "seq-mean-token-sum" if agg == "seq-mean-token-sum-norm" else agg
        flat = (None if t is None else t[0] for t in (logp, x.old, x.adv, x.mask, weights))
        pg, *stats = mode_fn(*flat, agg=agg, rows=rows, **named)
    else:
        if x.scale is not None:  # packed: each token's factor of the aggregation, a weight of its loss
            scale = x.scale.to(result_dtype(logp, x.old, x.adv, weights))
            weights = scale if weights is None else weights * scale
        pg, *stats = mode_fn(logp, x.old, x.adv, x.mask, weights, agg=agg, **named)
    pg = pg * row_scale.to(pg.dtype)
    entropy_mean = masked_mean(entropy, x.mask) * token_scale.to(entropy.dtype)
    loss = pg - terms.entropy_coef * entropy_mean
    if x.ref is not None:
        kl = kl_estimate(logp, x.ref, terms.kl_estimator)
        if rows is not None:
            kl = rows.aggregate(kl[0], x.mask[0], agg)
        else:
            kl = aggregate(kl if x.scale is None else kl * x.scale.to(kl.dtype), x.mask, agg)
        kl = kl * row_scale.to(pg.dtype)
        loss = loss + terms.kl_coef * kl
    else:
        kl = torch.zeros((), dtype=pg.dtype, device=pg.device)
    return loss, pg.detach(), entropy_mean.detach(), kl.detach(), *(s * token_scale.to(s.dtype) for s in stats)
