"""Reference token_logprobs: log-softmax + gather (and the entropy), in row chunks."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import CHUNK_ELEMENTS, DEVICES, in_common_dtype

SUPPORTED = {"token_logprobs": DEVICES}


def _logprobs_rows(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, return_entropy: bool, ignore_index: int
):
    """log-prob (and entropy) of rows ``logits [n, V]`` at ``labels [n]``, computed in float32.

    Ignored rows give 0; a label outside ``[0, V)`` gives NaN (the contract).  Both rows
    are zeroed before the softmax, so that they pass no gradient whatever they hold.
    """
    ignored = labels == ignore_index
    in_range = (labels >= 0) & (labels < logits.shape[-1])
    used = in_range & ~ignored
    (z,) = in_common_dtype(logits)
    z = torch.where(used.unsqueeze(-1), z / temperature, 0.0)
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
):
    """``log_softmax(logits / temperature)`` at ``labels`` (and the entropy), float32.

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
            )
            return logp.view(labels.shape), (ent.view(labels.shape) if return_entropy else None)
        parts = [
            token_logprobs(logits[b], labels[b], temperature, return_entropy, ignore_index)
            for b in range(logits.shape[0])
        ]
        logp = torch.stack([p[0] for p in parts])
        ent = torch.stack([p[1] for p in parts]) if return_entropy else None
        return logp, ent
    n, vocab = logits.shape
    rows = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    outs = [
        _logprobs_rows(logits[i : i + rows], labels[i : i + rows], temperature, return_entropy, ignore_index)
        for i in range(0, n, rows)
    ]
    if not outs:  # no row: the rows of none, so that the empty results are in the autograd graph
        outs.append(_logprobs_rows(logits, labels, temperature, return_entropy, ignore_index))
    logp = torch.cat([o[0] for o in outs])
    ent = torch.cat([o[1] for o in outs]) if return_entropy else None
    return logp, ent
