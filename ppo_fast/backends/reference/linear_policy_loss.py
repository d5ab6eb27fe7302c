"""Reference linear_policy_loss: the policy loss through the LM head over chunks of whole
sequences, a plain differentiable composition (the oracle of the fused backends: it differentiates
twice and compiles with fullgraph); and the fast backends' one-pass loop, which takes each chunk's
gradients in the forward with one chunk of logits alive."""

from __future__ import annotations

import inspect
import math

import torch

from ..._dtypes import result_dtype
from ...spec import POLICY_LOSS_MODES
from .._first_order import first_order_only
from . import policy_loss as _losses
from ._common import CHUNK_ELEMENTS, DEVICES, in_common_dtype
from .aggregate import aggregate, masked_mean
from .kl_penalized_rewards import kl_estimate
from .linear_token_logprobs import _linear_logprobs_chunk

SUPPORTED = {mode.linear_op: DEVICES for mode in POLICY_LOSS_MODES.values() if mode.fused_head}


def loss_scales(mask: torch.Tensor, agg: str):
    """``(per_row, per_token)``: what one chunk's ``agg`` loss and masked means are multiplied by
    so that the chunks' sum is the batch's: the chunk's share of the batch's normaliser (valid
    tokens for ``token-mean`` and the masked means, responses with a token for ``seq-mean-*``,
    1 for ``token-sum``), known from the mask before the pass.  Functions of the chunk's mask,
    in float64 (each term casts it to its own dtype)."""
    total_tokens = mask.sum(dtype=torch.float64).clamp_min(1)
    total_rows = mask.any(-1).sum(dtype=torch.float64).clamp_min(1)

    def per_row(chunk_mask):
        if agg == "token-sum":
            return torch.ones((), dtype=torch.float64, device=mask.device)
        if agg == "token-mean":
            return chunk_mask.sum(dtype=torch.float64) / total_tokens
        return chunk_mask.any(-1).sum(dtype=torch.float64) / total_rows

    return per_row, lambda chunk_mask: chunk_mask.sum(dtype=torch.float64) / total_tokens


def _chunk_terms(logp, entropy, old, adv, mask, weights, ref, mode_fn, params, agg, terms, scales):
    """One chunk's share of ``(loss, pg_loss, entropy mean, kl_loss, *mode stats)``."""
    kl_coef, kl_estimator, entropy_coef = terms
    row_scale, token_scale = scales[0](mask), scales[1](mask)
    pg, *stats = mode_fn(logp, old, adv, mask, weights, *params, agg)
    pg = pg * row_scale.to(pg.dtype)
    entropy_mean = masked_mean(entropy, mask) * token_scale.to(entropy.dtype)
    loss = pg - entropy_coef * entropy_mean
    if ref is not None:
        kl_loss = aggregate(kl_estimate(logp, ref, kl_estimator), mask, agg) * row_scale.to(pg.dtype)
        loss = loss + kl_coef * kl_loss
    else:
        kl_loss = torch.zeros((), dtype=pg.dtype, device=pg.device)
    return loss, pg.detach(), entropy_mean.detach(), kl_loss.detach(), *(s * token_scale.to(s.dtype) for s in stats)


def _one_pass(mode, hidden, weight, labels, old, adv, mask, weights, bias, ref, head, terms, params, agg):
    """The loss as a plain differentiable composition over chunks of whole sequences: every chunk's
    graph is kept, so it differentiates twice and compiles with fullgraph (the fast backends hold
    one chunk of logits at a time and take the gradients in their forward)."""
    mode_fn = getattr(_losses, mode.op)
    rows, length, width = hidden.shape
    weight_c, bias_c = in_common_dtype(weight, bias)
    scales = loss_scales(mask, agg)
    step = max(1, CHUNK_ELEMENTS // max(1, length * weight.shape[0]))  # whole sequences per chunk
    totals = None
    for b0 in range(0, max(rows, 1), step):
        rs = slice(b0, b0 + step)
        shape = labels[rs].shape
        logp, entropy = _linear_logprobs_chunk(
            hidden[rs].reshape(labels[rs].numel(), width), weight_c, bias_c, labels[rs].reshape(-1), *head[:3], True,
            head[3],
        )  # fmt: skip
        chunk = [None if x is None else x[rs] for x in (old, adv, mask, weights, ref)]
        out = _chunk_terms(logp.view(shape), entropy.view(shape), *chunk, mode_fn, params, agg, terms, scales)
        totals = list(out) if totals is None else [t + o for t, o in zip(totals, out)]
    loss, *stats = totals
    return loss, *(s.detach() for s in stats)


def _linear_policy_loss_op(mode):
    def run(
        hidden,
        weight,
        labels,
        old_logprobs,
        advantages,
        mask,
        weights,
        bias,
        ref_logprobs,
        temperature: float,
        logit_scale: float,
        logit_softcap,
        ignore_index: int,
        kl_coef: float,
        kl_estimator: str,
        entropy_coef: float,
        *params_and_agg,
    ):
        """``(loss, pg_loss, entropy_mean, kl_loss, *mode stats)`` of ``pf.linear_policy_loss``
        for ``hidden [B, T, H]``, ``labels [B, T]`` (ignore_index where mask is False)."""
        *params, agg = params_and_agg
        head = (temperature, logit_scale, logit_softcap, ignore_index)
        terms = (kl_coef, kl_estimator, entropy_coef)
        return _one_pass(
            mode, hidden, weight, labels, old_logprobs, advantages, mask, weights, bias, ref_logprobs, head, terms,
            params, agg,
        )  # fmt: skip

    run.__name__ = run.__qualname__ = mode.linear_op
    return run


for _mode in POLICY_LOSS_MODES.values():
    if _mode.fused_head:
        globals()[_mode.linear_op] = _linear_policy_loss_op(_mode)


# --------------------------------------------------------------------------- the fast backends' loop


class RowKernels:
    """A backend's log-softmax rows for :func:`one_pass_on_rows`: ``forward(logits [n, V], labels [n],
    temperature, ignore_index) -> (logp, entropy, saved)`` (float32, or float64 for float64 logits)
    and ``backward(grad_logp, grad_entropy or None, logits, labels, saved, entropy, temperature,
    ignore_index) -> d_logits`` (it may write into ``logits``, which are not read again)."""

    def __init__(self, forward, backward):
        self.forward, self.backward = forward, backward


def _per_token_grads(logp, entropy, old, adv, mask, weights, ref, mode_fn, params, agg, terms, scales):
    """One chunk's terms and the gradients of its loss w.r.t. its log-probs and entropies ([rows, T]
    vectors: the mode's per-token gradient by autograd, local to the chunk's sequences).  A custom
    op's implementation runs with the autograd (and, compiled, the functorch) dispatch keys
    excluded: they are restored around these few vector operations."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded - excluded):
        with torch.enable_grad():
            lp = logp.detach().requires_grad_(True)
            en = entropy.detach().requires_grad_(terms[2] != 0.0)
            out = _chunk_terms(lp, en, old, adv, mask, weights, ref, mode_fn, params, agg, terms, scales)
            leaves = [lp, en] if en.requires_grad else [lp]
            grads = torch.autograd.grad(out[0], leaves) if out[0].requires_grad else [torch.zeros_like(lp)]
    return [o.detach() for o in out], grads[0], (grads[1] if len(grads) > 1 else None)


def one_pass_on_rows(rows: RowKernels, mode, hidden, weight, labels, old, adv, mask, weights, bias, ref, head, terms,
                     params, agg, output_mask):  # fmt: skip
    """``pf.linear_policy_loss`` in one pass over chunks of whole sequences, on a fast backend's
    kernels: per chunk, the logits by one product (BLAS or cuBLAS, in the inputs' common compute
    dtype, as the reference), the rows' log-probs and entropy by ``rows.forward``, the loss's
    per-token gradient from the mode's reference function on those ``[rows, T]`` vectors, the
    logits' gradient by ``rows.backward`` (into the logits' buffer where the backend can), then
    ``d_hidden`` and ``d_weight`` by two products: three products, one chunk of logits alive.

    Returns ``[loss, pg_loss, entropy, kl_loss, *mode stats, d_hidden, d_weight, d_bias]`` (a
    gradient not asked for by ``output_mask`` is an empty tensor)."""
    temperature, logit_scale, logit_softcap, ignore_index = head
    mode_fn = getattr(_losses, mode.op)
    batch, length, width = hidden.shape
    vocab = weight.shape[0]
    hidden_c, weight_c, bias_c = in_common_dtype(hidden, weight, bias)
    scales = loss_scales(mask, agg)
    d_hidden = torch.zeros_like(hidden_c) if output_mask[0] else None
    d_weight = torch.zeros_like(weight_c) if output_mask[1] else None
    d_bias = torch.zeros_like(bias_c) if bias is not None and output_mask[2] else None
    wanted = any(d is not None for d in (d_hidden, d_weight, d_bias))
    step = max(1, CHUNK_ELEMENTS // max(1, length * vocab))  # whole sequences per chunk
    totals = None
    for b0 in range(0, max(batch, 1), step):
        rs = slice(b0, b0 + step)
        chunk_labels = labels[rs].reshape(-1)
        used = ((chunk_labels != ignore_index) & (chunk_labels >= 0) & (chunk_labels < vocab)).unsqueeze(-1)
        # whatever unused rows hold reaches nothing (rows counted by the labels: H may be 0)
        h = torch.where(used, hidden_c[rs].reshape(chunk_labels.numel(), width), 0.0)
        logits = h @ weight_c.T
        if bias_c is not None:
            logits += bias_c
        if logit_scale != 1.0:
            logits *= logit_scale
        capped = None
        if logit_softcap is not None:
            capped = logits.div_(logit_softcap).tanh()  # kept for the chain rule: the logits' buffer is reused
            logits = torch.mul(capped, logit_softcap, out=logits)
        logp, entropy, saved = rows.forward(logits, chunk_labels, temperature, ignore_index)
        shape = labels[rs].shape
        chunk = [None if x is None else x[rs] for x in (old, adv, mask, weights, ref)]
        out, grad_logp, grad_entropy = _per_token_grads(
            logp.view(shape), entropy.view(shape), *chunk, mode_fn, params, agg, terms, scales
        )
        totals = out if totals is None else [t + o for t, o in zip(totals, out)]
        if not wanted:
            continue
        grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1)
        d_logits = rows.backward(
            grad_logp.reshape(-1), grad_entropy, logits, chunk_labels, saved, entropy, temperature, ignore_index
        )
        if capped is not None:  # d tanh = 1 - tanh^2, formed in the buffer of tanh (not read again)
            d_logits *= capped.square_().neg_().add_(1.0)
        if logit_scale != 1.0:
            d_logits *= logit_scale
        if d_hidden is not None:
            d_hidden[rs] = torch.where(used, d_logits @ weight_c, 0.0).view(d_hidden[rs].shape)
        if d_weight is not None:
            d_weight.addmm_(d_logits.T, h)
        if d_bias is not None:
            d_bias += d_logits.sum(0)
    grads = [  # an output of a custom op aliases no other: an empty tensor each
        hidden.new_empty((0,)) if d is None else d.to(x.dtype)
        for d, x in ((d_hidden, hidden), (d_weight, weight), (d_bias, bias))
    ]
    return [*totals, *grads]


def _fake_terms(mode, hidden, old, adv, mask, weights, ref, terms, params, agg) -> list:
    """The terms' shapes and dtypes (the fake kernel): the mode's function on fake log-probs."""
    logp = old.new_empty(old.shape, dtype=result_dtype(hidden))
    out = _chunk_terms(logp, logp, old, adv, mask, weights, ref, getattr(_losses, mode.op), params, agg, terms,
                       loss_scales(mask, agg))  # fmt: skip
    return [torch.empty_like(o) for o in out]


def rows_ops(namespace: str, rows: RowKernels, modes) -> dict:
    """``{linear_op: fn}`` for ``modes`` on one custom op ``{namespace}::linear_policy_loss`` (the
    loop above on ``rows``), with its fake kernel and an autograd whose backward scales the stored
    gradients by the incoming one.  Mode parameters travel as floats (NaN: not given)."""

    def one_pass(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, old_logprobs: torch.Tensor,
           advantages: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None, bias: torch.Tensor | None,
           ref_logprobs: torch.Tensor | None, temperature: float, logit_scale: float, logit_softcap: float | None,
           ignore_index: int, kl_coef: float, kl_estimator: str, entropy_coef: float, loss_mode: str,
           params: list[float], agg: str, output_mask: list[bool]) -> list[torch.Tensor]:  # fmt: skip
        return one_pass_on_rows(
            rows, POLICY_LOSS_MODES[loss_mode], hidden, weight, labels, old_logprobs, advantages, mask, weights,
            bias, ref_logprobs, (temperature, logit_scale, logit_softcap, ignore_index),
            (kl_coef, kl_estimator, entropy_coef), _unpacked(params), agg, output_mask,
        )  # fmt: skip

    names = list(inspect.signature(one_pass).parameters)  # the schema's order
    op = torch.library.custom_op(f"{namespace}::linear_policy_loss", one_pass, mutates_args=())

    @op.register_fake
    def _(hidden, weight, labels, old, adv, mask, weights, bias, ref, temperature, logit_scale, logit_softcap,
          ignore_index, kl_coef, kl_estimator, entropy_coef, loss_mode, params, agg, output_mask):  # fmt: skip
        terms = _fake_terms(POLICY_LOSS_MODES[loss_mode], hidden, old, adv, mask, weights, ref,
                            (kl_coef, kl_estimator, entropy_coef), _unpacked(params), agg)  # fmt: skip
        grads = [
            torch.empty_like(x) if x is not None and wanted else hidden.new_empty((0,))
            for x, wanted in zip((hidden, weight, bias), output_mask)
        ]
        return [*terms, *grads]

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*output[-3:], *(inputs[names.index(n)] for n in ("hidden", "weight", "bias")))
        ctx.no_params = not inputs[names.index("params")]  # an empty list of floats: its gradient is []
        ctx.backend = namespace.removeprefix("ppo_fast_")
        ctx.mark_non_differentiable(*output[1:])

    def backward(ctx, grads_out):
        grad = grads_out[0]
        stored, differentiable = ctx.saved_tensors[:3], ctx.saved_tensors[3:]
        scaled = [g * grad.to(g.dtype) if g.numel() else None for g in stored]
        scaled = first_order_only(scaled, "linear_policy_loss", ctx.backend, differentiable)
        by_name = dict(zip(("hidden", "weight", "bias"), scaled))
        by_name["params"] = [] if ctx.no_params else None
        return tuple(by_name.get(name) for name in names)

    op.register_autograd(backward, setup_context=setup)

    def runner(mode):
        def run(hidden, weight, labels, old_logprobs, advantages, mask, weights, bias, ref_logprobs, temperature,
                logit_scale, logit_softcap, ignore_index, kl_coef, kl_estimator, entropy_coef, *params_and_agg):  # fmt: skip
            *params, agg = params_and_agg
            grad = torch.is_grad_enabled()
            output_mask = [grad and x is not None and x.requires_grad for x in (hidden, weight, bias)]
            out = op(hidden, weight, labels, old_logprobs, advantages, mask, weights, bias, ref_logprobs,
                     temperature, logit_scale, logit_softcap, ignore_index, kl_coef, kl_estimator, entropy_coef,
                     mode.name, [math.nan if p is None else float(p) for p in params], agg, output_mask)  # fmt: skip
            return tuple(out[:-3])

        run.__name__ = run.__qualname__ = mode.linear_op
        return run

    return {mode.linear_op: runner(mode) for mode in modes}


def _unpacked(params) -> list:
    return [None if math.isnan(p) else p for p in params]
