"""Public op: log-probs (and entropy) of chosen tokens, fused with the log-softmax."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._sampling import truncation as checked_truncation
from ..backends import resolve

__all__ = ["token_logprobs"]

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# 1 / temperature scales the logits in float32: below this the scaled logits of a real
# model overflow, and no sampler uses such a temperature (vLLM treats < 1e-5 as greedy).
MIN_TEMPERATURE = 1e-5


def _rows_view(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as ``[N, V]`` or ``[B, T, V]`` with a unit last stride, without copying when possible.

    A slice such as ``logits[:, :-1]`` cannot be viewed as ``[N, V]``; it stays 3-D
    so that no backend needs an ``[N, V]`` copy of it.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() in (2, 3):
        return logits
    vocab = logits.shape[-1]
    if logits.dim() == 1:
        return logits.view(1, vocab)
    try:
        return logits.view(-1, vocab)
    except RuntimeError:
        return logits.reshape(-1, logits.shape[-2], vocab)


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    inplace_backward: bool = False,
):
    """Log-probability of ``labels`` under ``log_softmax(logits / temperature)``, or under the
    distribution a sampler with ``top_k``/``top_p``/``min_p`` drew from.

    Args:
        logits: ``[..., V]`` float32, bfloat16 or float16 (float64 for gradcheck).
        labels: ``[...]`` integer token ids in ``[0, V)`` or ``ignore_index``.  Others
            raise ``ValueError`` on CPU in eager mode; on CUDA and under torch.compile
            (where checking would cost a host sync) their rows give a NaN log-prob and
            entropy and no gradient, and no kernel reads outside the logits.
        temperature: the sampling temperature (>= 1e-5), folded into the softmax.
        top_k: the sampler's top-k (``0`` or ``-1``: off).  With any of ``top_k``, ``top_p``,
            ``min_p`` on, the softmax is renormalised over the tokens the sampler keeps, in
            vLLM's order (``ppo_fast._sampling`` states the rule, its ties and where Hugging
            Face's order differs); a label outside the kept set gives ``-inf``.  The kept
            set is fixed: the gradient flows through the kept tokens.
        top_p: the sampler's nucleus threshold in (0, 1] (``1.0``: off); see ``top_k``.
        min_p: the sampler's min-p in [0, 1] (``0.0``: off); see ``top_k``.
        return_entropy: also return the entropy of ``softmax(logits / temperature)``.
        ignore_index: label value whose positions give 0 log-prob and 0 entropy and
            pass no gradient.
        inplace_backward: let the backward write the gradient into the logits'
            buffer instead of a new ``[N, V]`` tensor (saves memory; the logits are
            destroyed by the backward).  Honoured by the Triton backend; others
            allocate as usual.  Off by default.

    Returns:
        ``logprobs [...]`` float32, or ``(logprobs, entropy)`` with ``return_entropy``.
        A row whose chosen logit is ``-inf`` gives log-prob ``-inf``; NaN anywhere in
        a row gives NaN for that row only; an ignored row's logits are never read into
        a result.  Differentiable w.r.t. ``logits``.
    """
    check.tensor("logits", logits, dtypes=_LOGIT_DTYPES, min_ndim=1)
    check.tensor("labels", labels, dtypes=check.INT_DTYPES)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    check.same_device(logits=logits, labels=labels)
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dim, got V = 0")
    temperature = check.real("temperature", temperature, low=MIN_TEMPERATURE)
    truncation = checked_truncation(top_k, top_p, min_p, logits.shape[-1])
    ignore_index = check.integer("ignore_index", ignore_index)
    check.flag("return_entropy", return_entropy)
    check.flag("inplace_backward", inplace_backward)
    vocab = logits.shape[-1]
    labels = labels.long()
    check_labels = labels.numel() and check.host_checks_free(labels)
    rows = _rows_view(logits)
    flat_labels = labels if labels.dim() == rows.dim() - 1 else labels.reshape(rows.shape[:-1])  # a view costs us
    logp, entropy = resolve("token_logprobs", logits.device.type)(
        rows, flat_labels, temperature, return_entropy, ignore_index, inplace_backward, truncation=truncation
    )
    # Every backend gives a label outside [0, V) a NaN row (contract): one pass over the
    # results finds whether the labels need their full check (so does a NaN logit's row).
    if check_labels and bool(torch.isnan(logp).any()):
        check.labels_in_range(labels, vocab, ignore_index)
    if logp.shape != labels.shape:
        logp, entropy = logp.view(labels.shape), (entropy.view(labels.shape) if return_entropy else entropy)
    return (logp, entropy) if return_entropy else logp
