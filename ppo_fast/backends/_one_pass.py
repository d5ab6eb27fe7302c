"""The fast backends' one-pass policy loss (``pf.linear_policy_loss``): their loop over chunks of whole
sequences on their own log-softmax rows, with its custom op (the argument bundles and one chunk's
terms are the reference's, ``backends/reference/_loss_terms.py``).  Each backend's ``linear_policy_loss_<mode>`` takes
``(hidden, weight, labels, per_token, *, bias, head, terms, params, agg)``."""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import torch

from .._dtypes import result_dtype
from .._sampling import Truncation
from ..spec import POLICY_LOSS_MODES
from .reference._common import CHUNK_ELEMENTS, in_common_dtype
from .reference._loss_terms import (  # noqa: F401  (segment_chunks: the Triton loop's)
    Head,
    Objective,
    PerToken,
    Terms,
    chunk_index,
    chunk_terms,
    loss_scales,
    segment_chunks,
)

# --------------------------------------------------------------------------- the fast backends' loop


class RowKernels(NamedTuple):
    """A backend's log-softmax rows for :func:`one_pass_on_rows`: ``forward(logits [n, V], labels [n],
    temperature, ignore_index, truncation) -> (logp, entropy, saved)`` (float32, or float64 for float64
    logits; over each row's kept tokens under the sampler's ``truncation``)
    and ``backward(grad_logp, grad_entropy or None, logits, labels, saved, entropy, *, temperature,
    ignore_index) -> d_logits`` (it may write into ``logits``, which are not read again)."""

    forward: object
    backward: object


def _per_token_grads(logp, entropy, x: PerToken, objective: Objective, terms: Terms, scales):
    """One chunk's terms and the gradients of its loss w.r.t. its log-probs and entropies ([rows, T]
    vectors: the mode's per-token gradient by autograd, local to the chunk's sequences).  A custom
    op's implementation runs with the autograd (and, compiled, the functorch) dispatch keys
    excluded: they are restored around these few vector operations."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded - excluded):
        with torch.enable_grad():
            lp = logp.detach().requires_grad_(True)
            en = entropy.detach().requires_grad_(terms.entropy_coef != 0.0)
            out = chunk_terms(lp, en, x, objective, terms, scales)
            leaves = [lp, en] if en.requires_grad else [lp]
            grads = torch.autograd.grad(out[0], leaves) if out[0].requires_grad else [torch.zeros_like(lp)]
    return [o.detach() for o in out], grads[0], (grads[1] if len(grads) > 1 else None)


class _Chunk(NamedTuple):
    """One chunk's rows of the head: their labels, which of them a label uses, their hidden states
    (zero where unused: whatever they hold reaches nothing) and logits (after scale and softcap),
    and the softcap's tanh (kept for the chain rule)."""

    labels: torch.Tensor
    used: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    capped: torch.Tensor | None


def _chunk_logits(hidden_c, weight_c, bias_c, labels, head: Head) -> _Chunk:
    labels = labels.reshape(-1)
    used = ((labels != head.ignore_index) & (labels >= 0) & (labels < weight_c.shape[0])).unsqueeze(-1)
    h = torch.where(used, hidden_c.reshape(labels.numel(), hidden_c.shape[-1]), 0.0)  # rows by the labels: H may be 0
    logits = h @ weight_c.T
    if bias_c is not None:
        logits += bias_c
    if head.logit_scale != 1.0:
        logits *= head.logit_scale
    capped = None
    if head.logit_softcap is not None:
        capped = logits.div_(head.logit_softcap).tanh()  # kept for the chain rule: the logits' buffer is reused
        logits = torch.mul(capped, head.logit_softcap, out=logits)
    return _Chunk(labels, used, h, logits, capped)


def _logits_gradient(rows: RowKernels, chunk: _Chunk, grads, saved, entropy, head: Head):
    """d loss / d (the chunk's raw logits), written into the logits' buffer where the backend can."""
    grad_logp, grad_entropy = grads
    grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1)
    d_logits = rows.backward(
        grad_logp.reshape(-1),
        grad_entropy,
        chunk.logits,
        chunk.labels,
        saved,
        entropy,
        temperature=head.temperature,
        ignore_index=head.ignore_index,
    )
    if chunk.capped is not None:  # d tanh = 1 - tanh^2, formed in the buffer of tanh (not read again)
        d_logits *= chunk.capped.square_().neg_().add_(1.0)
    if head.logit_scale != 1.0:
        d_logits *= head.logit_scale
    return d_logits


def one_pass_on_rows(
    rows: RowKernels, hidden, weight, labels, x: PerToken, *, bias, objective, head, terms, output_mask, truncation
):
    """``pf.linear_policy_loss`` in one pass over chunks of whole sequences, on a fast backend's
    kernels: per chunk, the logits by one product (BLAS or cuBLAS, in the inputs' common compute
    dtype, as the reference), the rows' log-probs and entropy by ``rows.forward``, the loss's
    per-token gradient from the mode's reference function on those ``[rows, T]`` vectors, the
    logits' gradient by ``rows.backward`` (into the logits' buffer where the backend can), then
    ``d_hidden`` and ``d_weight`` by two products: three products, one chunk of logits alive.

    Returns ``[loss, pg_loss, entropy, kl_loss, *mode stats, d_hidden, d_weight, d_bias]`` (a
    gradient not asked for by ``output_mask`` is an empty tensor)."""
    batch, length, _ = hidden.shape
    hidden_c, weight_c, bias_c = in_common_dtype(hidden, weight, bias)
    scales = loss_scales(x.mask, objective.agg, x.bounds)
    d_hidden = torch.zeros_like(hidden_c) if output_mask[0] else None
    d_weight = torch.zeros_like(weight_c) if output_mask[1] else None
    d_bias = torch.zeros_like(bias_c) if bias is not None and output_mask[2] else None
    wanted = any(d is not None for d in (d_hidden, d_weight, d_bias))
    totals = None
    for rs in chunk_index(batch, length, max(1, CHUNK_ELEMENTS // weight.shape[0]), x.scale is not None, x.bounds):
        chunk = _chunk_logits(hidden_c[rs], weight_c, bias_c, labels[rs], head)
        logp, entropy, saved = rows.forward(chunk.logits, chunk.labels, head.temperature, head.ignore_index, truncation)
        shape = labels[rs].shape
        out, *grads = _per_token_grads(logp.view(shape), entropy.view(shape), x.rows(rs), objective, terms, scales)
        totals = out if totals is None else [t + o for t, o in zip(totals, out)]
        if not wanted:
            continue
        d_logits = _logits_gradient(rows, chunk, grads, saved, entropy, head)
        if d_hidden is not None:
            d_hidden[rs] = torch.where(chunk.used, d_logits @ weight_c, 0.0).view(d_hidden[rs].shape)
        if d_weight is not None:
            d_weight.addmm_(d_logits.T, chunk.hidden)
        if d_bias is not None:
            d_bias += d_logits.sum(0)
    grads = [  # an output of a custom op aliases no other: an empty tensor each
        hidden.new_empty((0,)) if d is None else d.to(stored_dtype(t.dtype))
        for d, t in ((d_hidden, hidden), (d_weight, weight), (d_bias, bias))
    ]
    return [*totals, *grads]


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the forward keeps an input's gradient in (for an incoming gradient of 1) until the
    backward scales it: the input's, but float32 for float16, whose range that unscaled gradient
    may pass where the scaled one (a loss divided over micro-batches) does not."""
    return torch.float32 if dtype == torch.float16 else dtype


def fake_terms(hidden, x: PerToken, objective: Objective, terms: Terms) -> list:
    """The terms' shapes and dtypes (the fake kernel): the mode's function on fake log-probs."""
    logp = x.old.new_empty(x.old.shape, dtype=result_dtype(hidden))
    x = x._replace(bounds=None)  # its chunks' shares are scalars as the padded layout's
    out = chunk_terms(logp, logp, x, objective, terms, loss_scales(x.mask, objective.agg))
    return [torch.empty_like(o) for o in out]


def rows_ops(namespace: str, rows: RowKernels | None, modes, loop=one_pass_on_rows) -> dict:
    """``{linear_op: fn}`` for ``modes`` on one custom op ``{namespace}::linear_policy_loss`` (``loop``,
    by default the loop above on ``rows``; a backend's own loop takes the same arguments), with its
    fake kernel and an autograd whose backward scales the stored gradients by the incoming one.  Mode
    parameters travel as floats (NaN: not given)."""

    def one_pass(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        weights: torch.Tensor | None,
        bias: torch.Tensor | None,
        ref_logprobs: torch.Tensor | None,
        scale: torch.Tensor | None,
        bounds: torch.Tensor | None,
        temperature: float,
        logit_scale: float,
        logit_softcap: float | None,
        ignore_index: int,
        kl_coef: float,
        kl_estimator: str,
        entropy_coef: float,
        loss_mode: str,
        params: list[float],
        agg: str,
        output_mask: list[bool],
        top_k: int,  # no defaults: torch 2.11 hands the autograd kernel an input without a trailing default
        top_p: float,
        min_p: float,
    ) -> list[torch.Tensor]:
        return loop(
            rows,
            hidden,
            weight,
            labels,
            PerToken(old_logprobs, advantages, mask, weights, ref_logprobs, scale, bounds),
            bias=bias,
            objective=Objective(POLICY_LOSS_MODES[loss_mode], _unpacked(params), agg),
            head=Head(temperature, logit_scale, logit_softcap, ignore_index),
            terms=Terms(kl_coef, kl_estimator, entropy_coef),
            output_mask=output_mask,
            truncation=Truncation(top_k, top_p, min_p),
        )

    names = list(inspect.signature(one_pass).parameters)  # the schema's order
    op = torch.library.custom_op(f"{namespace}::linear_policy_loss", one_pass, mutates_args=())

    _register_fake(op, names)
    backward, setup = autograd(lambda: names, namespace.removeprefix("ppo_fast_"))
    op.register_autograd(backward, setup_context=setup)

    def runner(mode):
        def run(hidden, weight, labels, x: PerToken, *, bias, head: Head, terms: Terms, params, agg, truncation=None):
            grad = torch.is_grad_enabled()
            output_mask = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
            floats = [math.nan if p is None else float(p) for p in params]
            options = (mode.name, floats, agg, output_mask, *(truncation or Truncation()))
            out = op(hidden, weight, labels, *x[:4], bias, x.ref, x.scale, x.bounds, *head, *terms, *options)
            return tuple(out[:-3])

        run.__name__ = run.__qualname__ = mode.linear_op
        return run

    return {mode.linear_op: runner(mode) for mode in modes}


def _register_fake(op, names: list[str]) -> None:
    """The op's fake kernel: the terms' shapes and dtypes, and the gradients asked for."""

    def fake(*args):
        a = dict(zip(names, args))
        x = PerToken(
            *(a[n] for n in ("old_logprobs", "advantages", "mask", "weights", "ref_logprobs", "scale", "bounds"))
        )
        objective = Objective(POLICY_LOSS_MODES[a["loss_mode"]], _unpacked(a["params"]), a["agg"])
        terms = fake_terms(a["hidden"], x, objective, Terms(a["kl_coef"], a["kl_estimator"], a["entropy_coef"]))
        grads = [
            torch.empty_like(a[n], dtype=stored_dtype(a[n].dtype))
            if a[n] is not None and wanted
            else a["hidden"].new_empty((0,))
            for n, wanted in zip(("hidden", "weight", "bias"), a["output_mask"])
        ]
        return [*terms, *grads]

    op.register_fake(fake)


def autograd(input_names, backend: str) -> tuple:
    """``(backward, setup_context)`` of a ``linear_policy_loss`` custom op (the native one and the
    rows ops share its schema) whose inputs ``input_names()`` names: the backward scales the
    gradients the forward returned by the incoming one, out of place (what autograd hands out is
    never the op's own storage, which a later backward through the graph scales anew)."""

    def setup(ctx, inputs, output):
        a = dict(zip(input_names(), inputs))
        ctx.save_for_backward(*output[-3:], a["hidden"], a["weight"], a["bias"])
        ctx.no_params = not a["params"]  # an empty list of floats: its gradient is []
        ctx.mark_non_differentiable(*output[1:])

    def backward(ctx, *grads_out):
        grad_loss = grads_out[0][0] if isinstance(grads_out[0], (list, tuple)) else grads_out[0]  # a list output
        stored, differentiable = ctx.saved_tensors[:3], ctx.saved_tensors[3:]
        scaled = [  # an empty [0] in another shape than its input's: not asked for (an empty call's is given)
            (g * grad_loss.to(g.dtype)).to(x.dtype) if x is not None and g.shape == x.shape else None
            for g, x in zip(stored, differentiable)
        ]
        scaled = first_order_only(scaled, "linear_policy_loss", backend, differentiable)
        by_name = dict(zip(("hidden", "weight", "bias"), scaled), params=[] if ctx.no_params else None)
        return tuple(by_name.get(name) for name in input_names())

    return backward, setup


def _unpacked(params) -> tuple:
    return tuple(None if math.isnan(p) else p for p in params)


# --------------------------------------------------------------------------- second order


def first_order_only(grads: list, op: str, backend: str, inputs: tuple) -> list:
    """Gradients a backend computed in its forward are constants to autograd: a second-order
    gradient through them would be a silent zero.  ``grads`` unchanged, unless autograd is building
    a graph of this backward (``create_graph``): then each one raises when differentiated, also
    towards ``inputs`` (the op's differentiable inputs, so that a gradient taken w.r.t. them
    reaches the error instead of missing it)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    anchors = [t for t in inputs if t is not None and t.requires_grad]
    error = torch._C._functions.DelayedError(
        f"{op}: second-order gradients (create_graph=True) are not supported on the {backend} backend (its "
        "gradients are computed in the forward); use pf.use_backend('reference') for them",
        len(present) + len(anchors),
    )
    marked = error(*[g.detach().requires_grad_() for g in present], *anchors)
    marked = iter(marked if isinstance(marked, tuple) else (marked,))
    return [None if g is None else next(marked) for g in grads]
