"""Native linear_policy_loss (csrc/linear_policy_loss.cpp): the fake kernel and the autograd, whose
backward only scales the gradients the forward returned by the incoming gradient.  The C++ op holds
the vanilla and GSPO epilogues; the other modes whose per-token gradient is local to a sequence run
the same one pass with the native log-softmax rows (``backends._one_pass.one_pass_on_rows``:
the products by BLAS, the rows and their gradient by csrc/token_logprobs.cpp, the mode's per-token
gradient from its reference function on the chunk's ``[rows, T]`` log-probs)."""

from __future__ import annotations

import functools
import math

import torch

from ..._dtypes import result_dtype
from ...spec import AGG_MODES, KL_ESTIMATORS, POLICY_LOSS_MODES
from .._one_pass import Head, PerToken, RowKernels, Terms, autograd, rows_ops, stored_dtype
from ._common import check_choice, check_dim, check_float, check_same_device, check_shape, register

# The modes csrc/linear_policy_loss.cpp computes (its loss epilogue), on CPU tensors.
MODES = ("vanilla", "gspo")
_STATS = 6  # pg_loss, entropy, kl_loss, clipfrac, clipfrac_lower, approx_kl (float64)


def _check_tensors(op, hidden, weight, labels, old, adv, *, mask, weights, bias, ref):
    """The checks of csrc/linear_policy_loss.cpp's check_args on the tensors, in its order."""
    check_float(op, "hidden", hidden)
    check_dim(op, "hidden", hidden, 3)
    check_float(op, "weight", weight)
    check_dim(op, "weight", weight, 2)
    torch._check(
        weight.shape[1] == hidden.shape[2] and weight.shape[0] > 0,
        lambda: (
            f"{op}: weight must be [V, H] with V > 0 and H = hidden.size(2) = {hidden.shape[2]}, got shape "
            f"{list(weight.shape)}"
        ),
    )
    torch._check(weight.dtype == hidden.dtype, lambda: f"{op}: weight must have hidden's dtype")
    torch._check(labels.dtype == torch.int64, lambda: f"{op}: labels must be int64, got {labels.dtype}")
    check_shape(op, "labels", labels, hidden.shape[:2])
    for name, x in (("old_logprobs", old), ("advantages", adv), ("weights", weights), ("ref_logprobs", ref)):
        if x is not None:
            check_float(op, name, x)
            check_shape(op, name, x, hidden.shape[:2], "labels")
    torch._check(mask.dtype == torch.bool, lambda: f"{op}: mask must be a bool tensor, got {mask.dtype}")
    check_shape(op, "mask", mask, hidden.shape[:2], "labels")
    if bias is not None:
        torch._check(bias.dtype == hidden.dtype, lambda: f"{op}: bias must have hidden's dtype")
        check_shape(op, "bias", bias, (weight.shape[0],))
    present = dict(weight=weight, labels=labels, old_logprobs=old, advantages=adv, mask=mask)
    present.update({k: v for k, v in dict(weights=weights, bias=bias, ref_logprobs=ref).items() if v is not None})
    check_same_device(op, hidden=hidden, **present)


def _fake(
    hidden,
    weight,
    labels,
    old,
    adv,
    mask,
    weights,
    bias,
    ref,
    temperature,
    logit_scale,
    logit_softcap,
    ignore_index,
    kl_coef,
    kl_estimator,
    entropy_coef,
    loss_mode,
    params,
    agg,
    output_mask,
    cu_seqlens=None,
):
    op = "linear_policy_loss"
    _check_tensors(op, hidden, weight, labels, old, adv, mask=mask, weights=weights, bias=bias, ref=ref)
    check_choice(op, "agg", agg, AGG_MODES)
    check_choice(op, "kl_estimator", kl_estimator, KL_ESTIMATORS)
    torch._check(
        loss_mode in MODES,
        lambda: f"{op}: loss_mode must be 'vanilla' or 'gspo' on the native CPU backend, got '{loss_mode}'",
    )
    torch._check(
        len(params) == 2 or (loss_mode == "vanilla" and len(params) == 3),
        lambda: f"{op}: loss_mode '{loss_mode}' takes clip_eps_low, clip_eps_high, got {len(params)} parameters",
    )
    if cu_seqlens is not None:  # the packed sequences of one row (their values: the kernel's checks)
        torch._check(
            cu_seqlens.dtype == torch.int64 and cu_seqlens.dim() == 1,  # its device: the kernel's check
            lambda: (
                f"{op}: cu_seqlens must be a 1-D int64 CPU tensor [S + 1], got {cu_seqlens.dtype} "
                f"{list(cu_seqlens.shape)} on {cu_seqlens.device}"
            ),
        )
        torch._check(
            hidden.shape[0] == 1,
            lambda: f"{op}: with cu_seqlens, hidden must be [1, N, H] (the packed tokens), got {hidden.shape[0]} rows",
        )
    for name, value in (("temperature", temperature), ("logit_scale", logit_scale)):
        torch._check(0 < value < math.inf, lambda name=name: f"{op}: {name} must be finite and > 0")
    torch._check(
        logit_softcap is None or 0 < logit_softcap < math.inf,
        lambda: f"{op}: logit_softcap must be None or finite and > 0",
    )
    double = torch.float64

    def grad(x, wanted):
        kept = stored_dtype(x.dtype)
        return torch.empty_like(x, dtype=kept, memory_format=torch.contiguous_format) if wanted else x.new_empty((0,))

    grad_bias = grad(bias, output_mask[2]) if bias is not None else hidden.new_empty((0,))
    return (
        hidden.new_empty((), dtype=double),
        hidden.new_empty((_STATS,), dtype=double),
        grad(hidden, output_mask[0]),
        grad(weight, output_mask[1]),
        grad_bias,
    )


@functools.cache
def _input_names() -> list[str]:
    """The op's inputs, in its schema's order (csrc/linear_policy_loss.cpp)."""
    return [argument.name for argument in torch.ops.ppo_fast.linear_policy_loss.default._schema.arguments]


register("linear_policy_loss", _fake, *autograd(_input_names, "native"))


def _linear_policy_loss_op(mode):
    def run(hidden, weight, labels, x: PerToken, *, bias, head: Head, terms: Terms, params, agg, truncation=None):
        # The C++ epilogue has no truncation, and no factor on a packed row's KL terms: the rows' loop.  A
        # sequence-level mode's packed sequences (``x.bounds``, the call's agg) are its rows (``cu_seqlens``).
        if (truncation is not None and truncation.active) or (x.scale is not None and x.ref is not None):
            return _ALL_ROWS[f"linear_policy_loss_{mode}"](
                hidden,
                weight,
                labels,
                x,
                bias=bias,
                head=head,
                terms=terms,
                params=params,
                agg=agg,
                truncation=truncation,
            )
        if x.scale is not None:  # packed without a KL term: the aggregation's factors are its token weights
            x = x._replace(weights=x.scale if x.weights is None else x.weights * x.scale, scale=None)
        grad = torch.is_grad_enabled()
        output_mask = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        floats = [float(p) for p in params if p is not None]  # vanilla's dual_clip: only when on
        loss, stats, *_grads = torch.ops.ppo_fast.linear_policy_loss(
            hidden,
            weight,
            labels,
            *x[:3],
            x.weights,
            bias,
            x.ref,
            *head,
            *terms,
            mode,
            floats,
            agg,
            output_mask,
            x.bounds,
        )
        policy_dtype = result_dtype(hidden, x.old, x.adv, x.weights)
        total_dtype = result_dtype(hidden, x.old, x.adv, x.weights, x.ref)
        pg_loss, entropy, kl_loss, clipfrac, clipfrac_lower, approx_kl = stats.unbind()
        out = (
            loss.to(total_dtype),
            pg_loss.to(policy_dtype),
            entropy.to(result_dtype(hidden)),
            kl_loss.to(total_dtype),
            clipfrac.to(torch.float32),
            clipfrac_lower.to(torch.float32),  # GSPO's: a constant 0, as in verl
            approx_kl.to(policy_dtype),
        )
        return tuple(o.detach() if i else o for i, o in enumerate(out))

    run.__name__ = run.__qualname__ = f"linear_policy_loss_{mode}"
    return run


linear_policy_loss_vanilla = _linear_policy_loss_op("vanilla")
linear_policy_loss_gspo = _linear_policy_loss_op("gspo")


def _rows_forward(logits, labels, temperature, ignore_index, truncation):
    """The rows' log-probs and entropy; truncated, the stats carry each row's threshold (their third column)."""
    return torch.ops.ppo_fast.token_logprobs(logits, labels, temperature, True, ignore_index, *truncation)


def _rows_backward(grad_logp, grad_entropy, logits, labels, stats, entropy, *, temperature, ignore_index):
    return torch.ops.ppo_fast.token_logprobs_backward(
        grad_logp, grad_entropy, logits, labels, stats, entropy, temperature, ignore_index
    )


# Every fused mode on the rows' loop: the C++ modes take it under the sampler's truncation.
_ALL_ROWS = rows_ops(
    "ppo_fast_native",
    RowKernels(_rows_forward, _rows_backward),
    [m for m in POLICY_LOSS_MODES.values() if m.fused_head],
)
_ON_ROWS = {op: fn for op, fn in _ALL_ROWS.items() if op not in {f"linear_policy_loss_{mode}" for mode in MODES}}
globals().update(_ON_ROWS)
SUPPORTED = {f"linear_policy_loss_{mode}": {"cpu"} for mode in MODES} | {op: {"cpu"} for op in _ON_ROWS}
