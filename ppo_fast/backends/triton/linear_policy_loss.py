"""Triton linear_policy_loss: the policy loss through the LM head in one pass over chunks of whole
sequences, GEMM-first (``_gemm_head``): per chunk the logits by one cuBLAS product (float32), the rows'
log-probs and entropy by the head's row kernel, the loss's per-token terms and gradient (every mode: one
launch of ``_policy_terms``' kernel, the sequence-level modes' on packed tokens too, whose chunks are
whole packed sequences: ``PerToken.bounds``, on the host; float64 inputs: the mode's reference function
under autograd on those ``[rows, T]`` vectors, ``_one_pass._per_token_grads``), ``d_logits``
written in place over the logits by the head's gradient kernel, then ``d_hidden``'s rows and
``d_weight``'s accumulator by two products (the chunk's rows and the accumulator's dtype from the
memory budget, ``_head_plan.plan``): 6 N H V FLOPs in all, one chunk of logits alive, and the backward
a scale of the stored gradients.  Every mode whose per-token gradient is local to a sequence.  With
``linear_token_logprobs.DESIGN = "tiles"`` the older loop (``_one_pass.one_pass_on_rows`` on
token_logprobs' row kernels) runs instead; "epilogue" (a forward without the gradient) keeps this one."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...spec import POLICY_LOSS_MODES
from .._head_plan import pair_fits, row_chunks, sequence_chunks
from .._one_pass import (
    Objective,
    PerToken,
    RowKernels,
    Terms,
    _per_token_grads,
    loss_scales,
    one_pass_on_rows,
    rows_ops,
    segment_chunks,
    stored_dtype,
)
from . import _gemm_head as gemm
from . import _policy_terms as policy_terms
from . import linear_token_logprobs as head_module
from ._launch import DEVICES, device_guard
from .token_logprobs import token_logprobs_backward, token_logprobs_forward, truncation_thresholds


def _forward(logits, labels, temperature, ignore_index, truncation):
    """The rows' log-probs and entropy; ``saved = (stats, tau or None)``."""
    with device_guard(logits):
        tau = None
        if truncation.active:
            tau = truncation_thresholds(logits, labels, temperature, ignore_index, truncation)
        logp, entropy, stats = token_logprobs_forward(logits, labels, temperature, True, ignore_index, tau=tau)
        return logp, entropy, (stats, tau)


def _backward(grad_logp, grad_entropy, logits, labels, saved, entropy, *, temperature, ignore_index):
    stats, tau = saved
    with device_guard(logits):
        return token_logprobs_backward(
            grad_logp,
            grad_entropy,
            logits,
            labels,
            stats,
            entropy,
            temperature=temperature,
            ignore_index=ignore_index,
            out=logits,
            tau=tau,
        )


_ROWS = RowKernels(_forward, _backward)


def _gemm_chunk(chunk: gemm.Chunk, bias, c: gemm.Constants, head, tau):
    """The chunk's ``(logp, entropy, stats)`` ([rows] float32), a row whose max logit overflows NaN."""
    logp, entropy, stats = gemm.chunk_stats(chunk, bias, c, head.ignore_index, tau, True)
    post = head_module._post(head.temperature, head.logit_scale, head.logit_softcap, logp.dtype)
    return head_module._overflow_is_nan(logp, entropy, stats, post)


def _token_chunks(batch: int, length: int, rows: int, packed: bool, bounds=None) -> list[tuple[slice, tuple]]:
    """``[(flat rows, [B, T] index), ...]``: whole sequences a chunk (``_head_plan.sequence_chunks``), or
    ``rows`` tokens of the packed row (its tokens' terms are local to them), or with ``bounds`` (a
    sequence-level mode's packed sequences) whole packed sequences (``_one_pass.segment_chunks``)."""
    if bounds is not None:
        return [(slice(t0, t1), (slice(None), slice(t0, t1))) for t0, t1 in segment_chunks(bounds.tolist(), rows)]
    if packed:
        return [(slice(t0, t1), (slice(None), slice(t0, t1))) for t0, t1 in row_chunks(length, rows) or [(0, 0)]]
    return [(slice(b0 * length, b1 * length), slice(b0, b1)) for b0, b1 in sequence_chunks(max(batch, 1), length, rows)]


class _Pass(NamedTuple):
    """What every chunk of one ``gemm_one_pass`` call shares."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    c: gemm.Constants
    head: object
    truncation: object
    objective: Objective
    terms: Terms
    fused: policy_terms.Batch | None  # the fused per-token terms, or None: the reference's under autograd
    scales: object
    grads: gemm.Gradients
    any_grad: bool


def _pass_chunk(call: _Pass, hidden_c, labels_c, x: PerToken, index, rows: int):
    """One chunk (``index = (flat rows, [B, T] index)``) of the one pass: its logits by a product of ``rows``
    rows, the rows' log-probs and entropy, the per-token terms and their gradient, and ``d_logits`` with
    their products into ``call.grads``.  Returns the chunk's totals (None for the fused terms, which keep
    theirs).  The chunk's logits are freed on return: one chunk alive at a time."""
    rs, bs = index
    c, head = call.c, call.head
    chunk = gemm.chunk_logits(
        hidden_c,
        call.weight,
        call.bias,
        labels_c.reshape(-1),
        c,
        ignore_index=head.ignore_index,
        form=call.truncation.active,
        rows=rows,
    )
    tau = gemm.chunk_thresholds(chunk, c, head.ignore_index, call.truncation) if call.truncation.active else None
    logp, entropy, stats = _gemm_chunk(chunk, call.bias, c, head, tau)
    shape, out = labels_c.shape, None
    if call.fused is not None:
        g_logp, g_entropy = call.fused.launch(logp, entropy, rs.start, shape)
    else:
        out, g_logp, g_entropy = _per_token_grads(
            logp.view(shape), entropy.view(shape), x.rows(bs), call.objective, call.terms, call.scales
        )
    if call.any_grad:
        flat_grads = (g_logp.reshape(-1), None if g_entropy is None else g_entropy.reshape(-1))
        dz, power, inverse = gemm.chunk_gradient(
            chunk, call.bias, c, head.ignore_index, (stats, entropy, tau), flat_grads, out=call.grads.buffer(chunk)
        )
        call.grads.add(rs, chunk, dz, power, inverse)
    return out


def gemm_one_pass(rows, hidden, weight, labels, x: PerToken, *, bias, objective, head, terms, output_mask, truncation):
    """``_one_pass.one_pass_on_rows``'s contract on the GEMM-first head (``rows`` unused unless the design
    is "tiles"): ``[loss, pg_loss, entropy, kl_loss, *mode stats, d_hidden, d_weight, d_bias]``."""
    if head_module.DESIGN == "tiles":
        return one_pass_on_rows(
            rows,
            hidden,
            weight,
            labels,
            x,
            bias=bias,
            objective=objective,
            head=head,
            terms=terms,
            output_mask=output_mask,
            truncation=truncation,
        )
    batch, length, width = hidden.shape
    flat = hidden.reshape(batch * length, width)
    c = gemm.constants(head.temperature, head.logit_scale, head.logit_softcap)
    needs = (output_mask[0], output_mask[1], bias is not None and output_mask[2])
    dtypes = tuple(stored_dtype(t.dtype) for t in (hidden, weight, weight))
    memory_plan = gemm.head_plan("loss", flat, weight)  # the chunk's rows and d_weight's accumulator
    plan = _token_chunks(batch, length, memory_plan.rows, x.scale is not None, x.bounds)
    product_rows = plan[0][0].stop - plan[0][0].start  # every chunk's product has the first's rows
    # pairs where the plan's are and those rows' fit (a padded call's whole sequences may take more)
    n, v = flat.shape[0], weight.shape[0]
    pair = memory_plan.pair and pair_fits(n, width, v, product_rows, itemsize=flat.element_size())
    grads = gemm.Gradients(flat, weight, bias, needs, dtypes, narrow=memory_plan.acc < 4, pair=pair)
    totals = None
    with device_guard(hidden):
        # the terms in one launch a chunk, the normalisers its own; float64: the reference's under autograd
        fused = (
            policy_terms.Batch(x, objective, terms)
            if policy_terms.fused(objective, gemm._acc_dtype(flat.dtype), x)
            else None
        )
        scales = None if fused is not None else loss_scales(x.mask, objective.agg, x.bounds)
        call = _Pass(weight, bias, c, head, truncation, objective, terms, fused, scales, grads, any(needs))
        for rs, bs in plan:
            out = _pass_chunk(call, flat[rs], labels[bs], x, (rs, bs), product_rows)
            if out is not None:
                totals = out if totals is None else [t + o for t, o in zip(totals, out)]
        if fused is not None:
            totals = fused.results()
    d_hidden, d_weight, d_bias = grads.finish()
    empty = hidden.new_empty((0,))  # an output of a custom op aliases no other: an empty tensor each
    d_hidden = empty if d_hidden is None else d_hidden.view(hidden.shape)
    return [
        *totals,
        d_hidden,
        empty.clone() if d_weight is None else d_weight,
        empty.clone() if d_bias is None else d_bias,
    ]


_FUNCTIONS = rows_ops(
    "ppo_fast_triton", _ROWS, [m for m in POLICY_LOSS_MODES.values() if m.fused_head], loop=gemm_one_pass
)
SUPPORTED = {op: DEVICES for op in _FUNCTIONS}
globals().update(_FUNCTIONS)


def static_variants(batch: int = 64, length: int = 1024, rows: int = 384) -> list[dict]:
    """This op's own launches for ``bench.static`` (sm_90 code compiled without a GPU), on meta tensors:
    the fused per-token terms on one chunk of ``rows`` tokens (the head's and token_logprobs' kernels are
    those modules' variants).  vanilla: whole sequences with a k3 KL term, weights, the entropy bonus and
    the dual clip (float16 inputs); seq-mean-token-mean (its row counts) without KL; the packed row
    (float32, a scale per token, ``abs``).  Every other mode as the first (its own branch, the rest
    shared; the sequence-level ones' row pass too), and gspo on packed sequences of 96 tokens (``SEGMENTED``:
    each row's bounds read from ``cu_seqlens``)."""

    def meta(shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta")

    def launch(shape, agg, kl, dtype, packed, mode="vanilla"):
        b, t = shape
        spec = POLICY_LOSS_MODES[mode]
        params = (0.2, 0.28, 3.0 if kl else None) if mode == "vanilla" else spec.bind(spec.example_params())

        def run():
            old, adv, ref, weights = (meta(shape, dtype) for _ in range(4))
            x = PerToken(old, adv, meta(shape, torch.bool), weights, ref if kl else None)
            if packed == "sequences":  # cu_seqlens on the host: sequences of 96 tokens, whole ones a chunk
                x = x._replace(bounds=torch.arange(0, t + 1, 96))
            elif packed:
                x = x._replace(scale=meta(shape))
            objective = Objective(spec, params, agg)
            state = policy_terms.Batch(x, objective, Terms(0.1, kl or "k3", 0.01 if kl else 0.0))
            chunk = (rows // t, t) if not packed else (1, rows)
            state.launch(meta((rows,)), meta((rows,)), 0, chunk)

        return run

    launches = {
        f"vanilla terms token-mean k3 dual weights entropy fp16 [{rows // 96}, 96]": launch(
            (batch, 96), "token-mean", "k3", torch.float16, False
        ),
        f"vanilla terms seq-mean-token-mean no KL fp32 [1, {rows}]": launch(
            (batch, rows), "seq-mean-token-mean", None, torch.float32, False
        ),
        f"vanilla terms packed token-sum abs fp32 [1, {rows}]": launch(
            (1, batch * length), "token-sum", "abs", torch.float32, True
        ),
        f"gspo terms packed sequences seq-mean-token-sum-norm k3 weights entropy fp32 [{rows // 96} x 96]": launch(
            (1, batch * length), "seq-mean-token-sum-norm", "k3", torch.float32, "sequences", "gspo"
        ),
        **{
            f"{mode} terms token-mean k3 weights entropy fp16 [{rows // 96}, 96]": launch(
                (batch, 96), "token-mean", "k3", torch.float16, False, mode
            )
            for mode in policy_terms.MODES[1:]
        },
    }
    return [
        dict(
            name=f"linear_policy_loss {what}",
            budget_key=None,
            bytes_per_element=None,
            run=run,
            block=None,
        )
        for what, run in launches.items()
    ]
