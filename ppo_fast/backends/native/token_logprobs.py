"""Native token_logprobs: fake kernel and autograd around torch.ops.ppo_fast.token_logprobs."""

from __future__ import annotations

import math

import torch

from ..._dtypes import result_dtype
from ..._sampling import NO_TRUNCATION, Truncation
from ._common import check_float, check_same_device, check_shape, register

SUPPORTED = {"token_logprobs": {"cpu"}}


def _check_logits(op, logits, labels, temperature):
    check_float(op, "logits", logits)
    torch._check(
        logits.dim() in (2, 3), lambda: f"{op}: logits must be [N, V] or [B, T, V], got shape {list(logits.shape)}"
    )
    torch._check(
        not labels.dtype.is_floating_point and not labels.dtype.is_complex and labels.dtype != torch.bool,
        lambda: f"{op}: labels must be an integer tensor, got {labels.dtype}",
    )
    check_shape(op, "labels", labels, logits.shape[:-1], "logits.shape[:-1]")
    check_same_device(op, logits=logits, labels=labels)
    torch._check(0 < temperature < math.inf, lambda: f"{op}: temperature must be finite and > 0, got {temperature}")


def check_truncation(op, top_k, top_p, min_p):
    """csrc/token_logprobs.cpp's check_truncation; returns the stats' width (3 when truncated)."""
    torch._check(top_k >= -1, lambda: f"{op}: top_k must be >= 0 (0 or -1: off), got {top_k}")
    torch._check(0 < top_p <= 1, lambda: f"{op}: top_p must lie in (0, 1], got {top_p}")
    torch._check(0 <= min_p <= 1, lambda: f"{op}: min_p must lie in [0, 1], got {min_p}")
    return 3 if Truncation(top_k, top_p, min_p).active else 2


def _fake_token_logprobs(logits, labels, temperature, return_entropy, ignore_index, top_k=0, top_p=1.0, min_p=0.0):
    _check_logits("token_logprobs", logits, labels, temperature)
    width = check_truncation("token_logprobs", top_k, top_p, min_p)
    dtype = result_dtype(logits)
    entropy = logits.new_empty(labels.shape if return_entropy else (0,), dtype=dtype)
    stats = logits.new_empty((*labels.shape, width), dtype=dtype)  # (max, log_sum[, threshold]) of each row
    return logits.new_empty(labels.shape, dtype=dtype), entropy, stats


def _check_saved_row_stats(op, forward_op, input_name, x, labels, *, stats, entropy, grad_logprobs, grad_entropy):
    """A log-prob backward's per-row inputs: the forward's stats (and entropy when its gradient
    is given) in the result dtype of ``x``, the incoming gradients, of ``labels``' shape (stats:
    [..., 2], or [..., 3] with the kept set's threshold when the forward truncated)."""
    dtype = result_dtype(x)
    torch._check(
        stats.dtype == dtype,
        lambda: f"{op}: stats must have dtype {dtype} (as {forward_op} returns it), got {stats.dtype}",
    )
    width = 3 if stats.dim() == labels.dim() + 1 and stats.shape[-1] == 3 else 2
    check_shape(op, "stats", stats, (*labels.shape, width))
    check_same_device(op, **{input_name: x, "stats": stats})
    for name, grad in (("grad_logprobs", grad_logprobs), ("grad_entropy", grad_entropy)):
        if grad is not None:
            check_float(op, name, grad)
            check_shape(op, name, grad, labels.shape, "labels")
            check_same_device(op, **{input_name: x, name: grad})
    if grad_entropy is not None:
        torch._check(entropy.dtype == dtype, lambda: f"{op}: entropy must have dtype {dtype}, got {entropy.dtype}")
        check_shape(op, "entropy", entropy, labels.shape, "labels")
        check_same_device(op, **{input_name: x, "entropy": entropy})


def _fake_token_logprobs_backward(
    grad_logprobs, grad_entropy, logits, labels, stats, entropy, temperature, ignore_index
):
    op = "token_logprobs_backward"
    _check_logits(op, logits, labels, temperature)
    _check_saved_row_stats(
        op,
        "token_logprobs",
        "logits",
        logits,
        labels,
        stats=stats,
        entropy=entropy,
        grad_logprobs=grad_logprobs,
        grad_entropy=grad_entropy,
    )
    return logits.new_empty(logits.shape)


register("token_logprobs", _fake_token_logprobs)
register("token_logprobs_backward", _fake_token_logprobs_backward)


def token_logprobs(
    logits,
    labels,
    temperature: float,
    return_entropy: bool,
    ignore_index: int,
    inplace_backward: bool = False,
    *,
    truncation: Truncation = NO_TRUNCATION,
):
    # inplace_backward is a memory hint this backend does not take: its backward allocates the gradient.
    logp, entropy, _stats = torch.ops.ppo_fast.token_logprobs.default(
        logits, labels, temperature, return_entropy, ignore_index, *truncation
    )
    return logp, (entropy if return_entropy else None)
