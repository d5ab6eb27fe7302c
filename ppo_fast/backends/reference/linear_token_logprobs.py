"""Reference linear_token_logprobs: the LM head's logits chunk by chunk, each checkpointed."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..._sampling import NO_TRUNCATION, Truncation
from ._common import CHUNK_ELEMENTS, DEVICES, in_common_dtype
from .token_logprobs import _logprobs_rows

SUPPORTED = {"linear_token_logprobs": DEVICES}


# The head's matrix products take this many rows at a time, the last block padded with zero
# rows: BLAS picks its algorithm (and so a row's summation order) by the number of rows, so one
# fixed shape makes a row's logits independent of the rest of the batch, bit for bit.
MATMUL_ROWS = 128


def _rowwise_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` computed in blocks of exactly ``MATMUL_ROWS`` rows of ``a``."""
    rows = a.shape[0]
    if rows == 0:  # no row: the empty product, so that the empty result is in the autograd graph
        return a @ b
    padded = -(-rows // MATMUL_ROWS) * MATMUL_ROWS
    if padded != rows:
        a = torch.cat([a, a.new_zeros(padded - rows, a.shape[1])])
    blocks = [a[i : i + MATMUL_ROWS] @ b for i in range(0, padded, MATMUL_ROWS)]
    return torch.cat(blocks)[:rows]


def linear_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    logit_scale: float,
    logit_softcap: float | None,
):
    """The LM head's transformed logits ``softcap(logit_scale * (hidden @ weight.T + bias))``
    (before the temperature), in the inputs' common compute dtype (float32 for
    float16/bfloat16 inputs: the product accumulates and stays in float32)."""
    hidden, weight, bias = in_common_dtype(hidden, weight, bias)
    raw = _rowwise_matmul(hidden, weight.T)
    raw = raw if bias is None else raw + bias
    z = raw * logit_scale
    return z if logit_softcap is None else logit_softcap * torch.tanh(z / logit_softcap)


def _linear_logprobs_chunk(
    hidden,
    weight,
    bias,
    labels,
    *,
    temperature,
    logit_scale,
    logit_softcap,
    return_entropy,
    ignore_index,
    truncation=NO_TRUNCATION,
):
    """One row chunk: ``token_logprobs`` of its logits.  Rows that are ignored or out of
    range get a zero hidden state first, so that whatever they hold (NaN, inf) reaches
    neither ``weight``'s gradient nor any result."""
    used = (labels != ignore_index) & (labels >= 0) & (labels < weight.shape[0])
    hidden = torch.where(used.unsqueeze(-1), hidden, 0.0)
    logits = linear_logits(hidden, weight, bias, logit_scale, logit_softcap)
    logp, entropy = _logprobs_rows(logits, labels, temperature, return_entropy, ignore_index, truncation)
    return (logp, entropy) if return_entropy else (logp,)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    truncation: Truncation = NO_TRUNCATION,
):
    """``token_logprobs(softcap(logit_scale * (hidden @ weight.T + bias)) , labels)`` at
    ``temperature``, for ``hidden [N, H]``, ``weight [V, H]``, ``labels [N]``: ``(logp, entropy or None)``.

    Chunked over rows so that at most ``CHUNK_ELEMENTS`` logits live at once; under
    autograd each chunk is checkpointed (its logits are recomputed in the backward),
    so the ``[N, V]`` logits and their gradient never exist whole.
    """
    # One compute-dtype copy of the head for all chunks (autograd casts its gradient back).
    weight_c, bias_c = in_common_dtype(weight, bias)
    options = dict(
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        return_entropy=return_entropy,
        ignore_index=ignore_index,
        truncation=truncation,
    )
    checkpointed = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    outs = []
    for i in range(0, hidden.shape[0], rows):
        chunk = (hidden[i : i + rows], weight_c, bias_c, labels[i : i + rows])
        if checkpointed:
            outs.append(
                torch.utils.checkpoint.checkpoint(_linear_logprobs_chunk, *chunk, **options, use_reentrant=False)
            )
        else:
            outs.append(_linear_logprobs_chunk(*chunk, **options))
    if not outs:  # no row: the chunk of none, so that the empty results are in the autograd graph
        outs.append(_linear_logprobs_chunk(hidden, weight_c, bias_c, labels, **options))
    logp = torch.cat([o[0] for o in outs])
    return logp, (torch.cat([o[1] for o in outs]) if return_entropy else None)
