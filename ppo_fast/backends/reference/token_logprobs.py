"""Reference token_logprobs: log-softmax + gather (and the entropy), in row chunks."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..._sampling import NO_TRUNCATION, Truncation
from ._common import CHUNK_ELEMENTS, DEVICES, in_common_dtype

SUPPORTED = {"token_logprobs": DEVICES}


@torch.no_grad()
def kept_tokens(z: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """Which tokens of the scaled logits ``z [n, V]`` the sampler keeps (``ppo_fast._sampling``'s
    rule), as a bool ``[n, V]``: the oracle, by sorting, with the masses in float64."""
    vocab = z.shape[-1]
    top = z.amax(-1, keepdim=True)
    untruncated = ~torch.isfinite(top) | torch.isnan(z).any(-1, keepdim=True)  # NaN or +inf: not truncated
    weight = torch.exp((z - top).double())
    kept = torch.ones_like(z, dtype=torch.bool)
    if truncation.min_p > 0:
        kept &= weight >= truncation.min_p
    ascending, order = z.sort(-1)
    at_or_below = torch.searchsorted(ascending, z.contiguous(), right=True)  # tokens with a logit <= z_u
    if truncation.top_k > 0:
        kept &= vocab - at_or_below < truncation.top_k
    if truncation.top_p < 1:
        kept_mass = torch.where(kept, weight, 0.0).gather(-1, order).cumsum(-1)
        total = kept_mass[..., -1:]
        larger = total - kept_mass.gather(-1, (at_or_below - 1).clamp(min=0))
        kept &= larger < truncation.top_p * total
    return kept | untruncated


def _logprobs_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    truncation: Truncation = NO_TRUNCATION,
):
    """log-prob (and entropy) of rows ``logits [n, V]`` at ``labels [n]``, computed in float32,
    under the softmax renormalised over the tokens ``truncation`` keeps.

    Ignored rows give 0; a label outside ``[0, V)`` gives NaN (the contract).  Both rows
    are zeroed before the softmax, so that they pass no gradient whatever they hold.  The
    dropped tokens are -inf before the softmax: the kept set is fixed, the gradient flows
    through the kept tokens' softmax.
    """
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < logits.shape[-1])
    used = in_range & ~ignored
    (z,) = in_common_dtype(logits)
    z = torch.where(used.unsqueeze(-1), z / temperature, 0.0)
    if truncation.active:
        z = torch.where(kept_tokens(z, truncation), z, -torch.inf)
    logp_all = torch.log_softmax(z, dim=-1)
    chosen = logp_all.gather(-1, torch.where(used, labels, 0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(used, chosen, torch.where(ignored, 0.0, torch.nan))
    if not return_entropy:
        return logp, None
    p = logp_all.exp()
    # p·log p is 0 where p == 0 (a -inf logit); the where keeps its gradient finite too.
    safe_logp = torch.where(p > 0, logp_all, 0.0)
    entropy = -(p * safe_logp).sum(-1)
    return logp, torch.where(used, entropy, torch.where(ignored, 0.0, torch.nan))


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    inplace_backward: bool = False,
    *,
    truncation: Truncation = NO_TRUNCATION,
):
    """``log_softmax(logits / temperature)`` at ``labels`` (and the entropy), float32, over the
    tokens ``truncation`` keeps (``ppo_fast._sampling``).

    ``inplace_backward`` is a memory hint for the fast backends; the reference never
    overwrites its input.

    ``logits`` is ``[N, V]`` or ``[B, T, V]`` with a contiguous last dim; ``labels``
    has the leading shape.  Processed in row chunks so that a bf16 input never has a
    float32 copy of all of it (without autograd; with autograd the chunks' softmax is
    kept for backward, as eager PyTorch does).
    """
    if logits.dim() == 3:
        if not logits.shape[0]:  # no row: the rows of none, so that the empty results are in the autograd graph
            logp, ent = token_logprobs(
                logits.reshape(0, logits.shape[-1]), labels.reshape(0), temperature, return_entropy, ignore_index
            )  # no row: nothing to truncate
            return logp.view(labels.shape), (ent.view(labels.shape) if return_entropy else None)
        parts = [
            token_logprobs(logits[b], labels[b], temperature, return_entropy, ignore_index, truncation=truncation)
            for b in range(logits.shape[0])
        ]
        logp = torch.stack([p[0] for p in parts])
        ent = torch.stack([p[1] for p in parts]) if return_entropy else None
        return logp, ent
    n, vocab = logits.shape
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    outs = [
        _logprobs_rows(
            logits[i : i + rows], labels[i : i + rows], temperature, return_entropy, ignore_index, truncation
        )
        for i in range(0, n, rows)
    ]
    if not outs:  # no row: the rows of none, so that the empty results are in the autograd graph
        outs.append(_logprobs_rows(logits, labels, temperature, return_entropy, ignore_index))
    logp = torch.cat([o[0] for o in outs])
    ent = torch.cat([o[1] for o in outs]) if return_entropy else None
    return logp, ent
