"""Reference linear_policy_loss: the policy loss through the LM head over chunks of whole
sequences, a plain differentiable composition (the oracle of the fused backends: it differentiates
twice and compiles with fullgraph).  It shares only the chunk's terms
(``_loss_terms``) with the fast backends' one-pass loop (``backends/_one_pass.py``)."""

from __future__ import annotations

from ..._sampling import NO_TRUNCATION
from ...spec import POLICY_LOSS_MODES
from . import _loss_terms as shared
from ._common import CHUNK_ELEMENTS, DEVICES, in_common_dtype
from .linear_token_logprobs import _linear_logprobs_chunk

SUPPORTED = {mode.linear_op: DEVICES for mode in POLICY_LOSS_MODES.values() if mode.fused_head}


def _one_pass(hidden, weight, labels, x, *, bias, objective, head, terms, truncation):
    """Every chunk's graph is kept (the fast backends hold one chunk of logits at a time and take the
    gradients in their forward).  Packed (``x.scale``): ``hidden [1, N, H]``, chunks of tokens."""
    rows, length, width = hidden.shape
    weight_c, bias_c = in_common_dtype(weight, bias)
    scales = shared.loss_scales(x.mask, objective.agg, x.bounds)
    totals = None
    for rs in shared.chunk_index(
        rows, length, max(1, CHUNK_ELEMENTS // weight.shape[0]), x.scale is not None, x.bounds
    ):
        shape = labels[rs].shape
        flat = hidden[rs].reshape(labels[rs].numel(), width)
        logp, entropy = _linear_logprobs_chunk(
            flat, weight_c, bias_c, labels[rs].reshape(-1), **head._asdict(), return_entropy=True, truncation=truncation
        )
        out = shared.chunk_terms(logp.view(shape), entropy.view(shape), x.rows(rs), objective, terms, scales)
        totals = list(out) if totals is None else [t + o for t, o in zip(totals, out)]
    loss, *stats = totals
    return loss, *(s.detach() for s in stats)


def _linear_policy_loss_op(mode):
    def run(hidden, weight, labels, x, *, bias, head, terms, params, agg, truncation=NO_TRUNCATION):
        """``(loss, pg_loss, entropy_mean, kl_loss, *mode stats)`` of ``pf.linear_policy_loss``
        for ``hidden [B, T, H]``, ``labels [B, T]`` (ignore_index where mask is False), over each row's
        kept tokens under ``truncation``."""
        objective = shared.Objective(mode, tuple(params), agg)
        return _one_pass(
            hidden, weight, labels, x, bias=bias, objective=objective, head=head, terms=terms, truncation=truncation
        )

    run.__name__ = run.__qualname__ = mode.linear_op
    return run


for _mode in POLICY_LOSS_MODES.values():
    if _mode.fused_head:
        globals()[_mode.linear_op] = _linear_policy_loss_op(_mode)
