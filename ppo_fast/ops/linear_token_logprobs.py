"""Public op: log-probs (and entropy) of chosen tokens straight from the last hidden states
and the LM head, never materialising the ``[N, V]`` logits (a fused LM head)."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._sampling import truncation as checked_truncation
from ..backends import resolve
from .token_logprobs import MIN_TEMPERATURE

__all__ = ["linear_token_logprobs"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_head(hidden, weight, labels, bias) -> tuple[int, int]:
    """The LM head's tensors: dtypes, ranks and the shape relations; returns ``(V, H)``."""
    check.tensor("hidden", hidden, dtypes=_DTYPES, min_ndim=1)
    check.tensor("weight", weight, dtypes=_DTYPES, ndim=2)
    check.tensor("labels", labels, dtypes=check.INT_DTYPES)
    if bias is not None:
        check.tensor("bias", bias, dtypes=_DTYPES, ndim=1)
    vocab, width = weight.shape
    if vocab == 0:
        raise ValueError("weight must have a non-empty vocabulary dim, got shape (0, H)")
    if hidden.shape[-1] != width:
        raise ValueError(
            f"hidden's last dim must equal weight.shape[1] = {width} (weight is [V, H]), got hidden of shape {tuple(hidden.shape)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias must have shape (V,) = ({vocab},) as weight [V, H], got {tuple(bias.shape)}")
    for name, x in (("weight", weight), ("bias", bias)):
        if x is not None and x.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {str(hidden.dtype)[6:]}, got {str(x.dtype)[6:]}")
    return vocab, width


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
):
    """Log-probability of ``labels`` under the LM head ``hidden @ weight.T + bias``.

    The same result as ``token_logprobs(z, labels, temperature=..., return_entropy=...)``
    with ``z = softcap(logit_scale * (hidden @ weight.T + bias))`` computed in float32,
    where ``softcap(x) = logit_softcap * tanh(x / logit_softcap)`` (Gemma-2's final
    soft-cap; ``None`` for none) and ``logit_scale`` multiplies the logits (Cohere's
    ``logit_scale``), but in row chunks: the ``[N, V]`` logits and their gradient never
    exist whole.

    Args:
        hidden: ``[..., H]`` last hidden states, float32, bfloat16 or float16 (float64
            for gradcheck); any strides.
        weight: ``[V, H]`` the LM head (the output embedding, tied or not), ``hidden``'s dtype.
        labels: ``[...]`` (``hidden.shape[:-1]``) token ids in ``[0, V)`` or
            ``ignore_index``; out-of-range labels as in ``token_logprobs`` (``ValueError``
            on CPU in eager mode, else a NaN row with no gradient).
        bias: optional ``[V]`` head bias, ``hidden``'s dtype.
        temperature: the sampling temperature (>= 1e-5), applied after the soft-cap.
        top_k: the sampler's top-k (``0`` or ``-1``: off), as in ``token_logprobs``.
        top_p: the sampler's nucleus threshold (``1.0``: off), as in ``token_logprobs``.
        min_p: the sampler's min-p (``0.0``: off), as in ``token_logprobs``.
        logit_scale: a positive factor on the logits, before the soft-cap.
        logit_softcap: ``None`` or a positive cap ``c``.
        return_entropy: also return the entropy of the softmax.
        ignore_index: label value whose rows give 0 log-prob and 0 entropy, pass no
            gradient and are never read (NaN/inf hidden states there reach nothing).

    Returns:
        ``logprobs [...]`` float32 (float64 for float64 inputs), or ``(logprobs,
        entropy)``.  Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``.
    """
    vocab, width = _check_head(hidden, weight, labels, bias)
    check.same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    temperature = check.real("temperature", temperature, low=MIN_TEMPERATURE)
    truncation = checked_truncation(top_k, top_p, min_p, weight.shape[0])
    logit_scale = check.real("logit_scale", logit_scale, low=0.0, low_open=True)
    if logit_softcap is not None:
        logit_softcap = check.real("logit_softcap", logit_softcap, low=0.0, low_open=True)
    ignore_index = check.integer("ignore_index", ignore_index)
    check.flag("return_entropy", return_entropy)
    labels = labels.long()
    check_labels = labels.numel() and check.host_checks_free(labels)
    logp, entropy = resolve("linear_token_logprobs", hidden.device.type)(
        hidden if hidden.dim() == 2 else hidden.reshape(labels.numel(), width),
        weight,
        labels if labels.dim() == 1 else labels.reshape(-1),
        bias=bias,
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        return_entropy=return_entropy,
        ignore_index=ignore_index,
        truncation=truncation,
    )
    # Every backend gives a label outside [0, V) a NaN row (contract): one pass over the
    # results finds whether the labels need their full check (so does a NaN logit's row).
    if check_labels and bool(torch.isnan(logp).any()):
        check.labels_in_range(labels, vocab, ignore_index)
    if logp.shape != labels.shape:
        logp, entropy = logp.view(labels.shape), (entropy.view(labels.shape) if return_entropy else entropy)
    return (logp, entropy) if return_entropy else logp
