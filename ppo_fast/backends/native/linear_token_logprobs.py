"""Native linear_token_logprobs (the fused LM head): fake kernel and autograd."""

from __future__ import annotations

import math

import torch

from ..._dtypes import result_dtype
from ..._sampling import NO_TRUNCATION
from ._common import check_dim, check_float, check_same_device, check_shape, grad_or_empty, needed_grads, register
from .token_logprobs import _check_saved_row_stats, check_truncation

SUPPORTED = {"linear_token_logprobs": {"cpu"}}


def _check_head(op, hidden, weight, labels, bias, *, temperature, logit_scale, logit_softcap):
    check_float(op, "hidden", hidden)
    check_dim(op, "hidden", hidden, 2)
    check_float(op, "weight", weight)
    check_dim(op, "weight", weight, 2)
    torch._check(
        weight.shape[1] == hidden.shape[1],
        lambda: (
            f"{op}: weight must be [V, H] with H = hidden.size(1) = {hidden.shape[1]}, got shape {list(weight.shape)}"
        ),
    )
    torch._check(
        weight.shape[0] > 0,
        lambda: f"{op}: weight must have a non-empty vocabulary dim, got shape {list(weight.shape)}",
    )
    torch._check(
        weight.dtype == hidden.dtype,
        lambda: f"{op}: weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}",
    )
    torch._check(
        not labels.dtype.is_floating_point and not labels.dtype.is_complex and labels.dtype != torch.bool,
        lambda: f"{op}: labels must be an integer tensor, got {labels.dtype}",
    )
    check_shape(op, "labels", labels, hidden.shape[:1])
    check_same_device(op, hidden=hidden, weight=weight, labels=labels)
    if bias is not None:
        torch._check(
            bias.dtype == hidden.dtype, lambda: f"{op}: bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}"
        )
        check_shape(op, "bias", bias, weight.shape[:1])
        check_same_device(op, hidden=hidden, bias=bias)
    torch._check(0 < temperature < math.inf, lambda: f"{op}: temperature must be finite and > 0, got {temperature}")
    torch._check(0 < logit_scale < math.inf, lambda: f"{op}: logit_scale must be finite and > 0, got {logit_scale}")
    torch._check(
        logit_softcap is None or 0 < logit_softcap < math.inf,
        lambda: f"{op}: logit_softcap must be None or finite and > 0, got {logit_softcap}",
    )


def _fake_linear_token_logprobs(
    hidden,
    weight,
    labels,
    bias,
    temperature,
    logit_scale,
    logit_softcap,
    return_entropy,
    ignore_index,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
):
    _check_head(
        "linear_token_logprobs",
        hidden,
        weight,
        labels,
        bias,
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
    )
    width = check_truncation("linear_token_logprobs", top_k, top_p, min_p)
    dtype = result_dtype(hidden)
    entropy = hidden.new_empty(labels.shape if return_entropy else (0,), dtype=dtype)
    stats = hidden.new_empty((*labels.shape, width), dtype=dtype)  # (max, log_sum[, threshold]) of each row
    return hidden.new_empty(labels.shape, dtype=dtype), entropy, stats


def _fake_linear_token_logprobs_backward(
    grad_logprobs,
    grad_entropy,
    hidden,
    weight,
    labels,
    bias,
    stats,
    entropy,
    temperature,
    logit_scale,
    logit_softcap,
    ignore_index,
    output_mask,
):
    op = "linear_token_logprobs_backward"
    _check_head(
        op, hidden, weight, labels, bias, temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap
    )
    _check_saved_row_stats(
        op,
        "linear_token_logprobs",
        "hidden",
        hidden,
        labels,
        stats=stats,
        entropy=entropy,
        grad_logprobs=grad_logprobs,
        grad_entropy=grad_entropy,
    )
    grad_bias = grad_or_empty(bias, output_mask[2]) if bias is not None else hidden.new_empty((0,))
    return grad_or_empty(hidden, output_mask[0]), grad_or_empty(weight, output_mask[1]), grad_bias


def _setup_linear_token_logprobs(ctx, inputs, output):
    hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index = inputs[:9]
    _logp, entropy, stats = output
    ctx.save_for_backward(hidden, weight, labels, bias, stats, entropy)
    ctx.args = (temperature, logit_scale, logit_softcap, ignore_index)
    ctx.return_entropy = return_entropy
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)  # an unused output needs no term in the backward


def _backward_linear_token_logprobs(ctx, grad_logprobs, grad_entropy, _grad_stats):
    grad_entropy = grad_entropy if ctx.return_entropy else None
    hidden, weight, labels, bias, stats, entropy = ctx.saved_tensors
    needed = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]]
    if grad_logprobs is None and grad_entropy is None:
        return (None,) * 12
    grads = torch.ops.ppo_fast.linear_token_logprobs_backward(
        grad_logprobs, grad_entropy, hidden, weight, labels, bias, stats, entropy, *ctx.args, needed
    )
    grad_hidden, grad_weight, grad_bias = needed_grads(grads, needed)
    return grad_hidden, grad_weight, None, grad_bias, *(None,) * 8


register(
    "linear_token_logprobs", _fake_linear_token_logprobs, _backward_linear_token_logprobs, _setup_linear_token_logprobs
)
register("linear_token_logprobs_backward", _fake_linear_token_logprobs_backward)


def linear_token_logprobs(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    temperature=1.0,
    logit_scale=1.0,
    logit_softcap=None,
    return_entropy=False,
    ignore_index=-100,
    truncation=NO_TRUNCATION,
):
    logp, entropy, _stats = torch.ops.ppo_fast.linear_token_logprobs(
        hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index, *truncation
    )
    return logp, (entropy if return_entropy else None)
