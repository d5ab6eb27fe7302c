"""Reference linear_policy_loss: the policy loss through the LM head in one pass over chunks of
whole sequences, each chunk's gradients taken by ``torch.autograd.grad`` in the forward (the
oracle of the fused backends)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...spec import POLICY_LOSS_MODES
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


class _Precomputed(torch.autograd.Function):
    """The loss whose gradients w.r.t. hidden, weight and bias were taken in the forward: the
    backward only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, loss, d_hidden, d_weight, d_bias, hidden, weight, bias):
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        scaled = [None if d is None else d * grad.to(d.dtype) for d in (d_hidden, d_weight, d_bias)]
        return None, None, None, None, *scaled


def _one_pass(mode, hidden, weight, labels, old, adv, mask, weights, bias, ref, head, terms, params, agg):
    mode_fn = getattr(_losses, mode.op)
    rows, length, width = hidden.shape
    weight_c, bias_c = in_common_dtype(weight, bias)
    wanted = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    w_leaf = weight_c.detach().requires_grad_(wanted and weight.requires_grad)
    b_leaf = None if bias is None else bias_c.detach().requires_grad_(wanted and bias.requires_grad)
    scales = loss_scales(mask, agg)
    d_hidden = torch.zeros_like(hidden) if wanted and hidden.requires_grad else None
    d_weight = torch.zeros_like(weight_c) if w_leaf.requires_grad else None
    d_bias = torch.zeros_like(bias_c) if b_leaf is not None and b_leaf.requires_grad else None
    step = max(1, CHUNK_ELEMENTS // max(1, length * weight.shape[0]))  # whole sequences per chunk
    totals = None
    for b0 in range(0, max(rows, 1), step):
        rs = slice(b0, b0 + step)
        with torch.enable_grad():
            h = hidden[rs].detach().requires_grad_(d_hidden is not None)
            logp, entropy = _linear_logprobs_chunk(
                h.reshape(-1, width), w_leaf, b_leaf, labels[rs].reshape(-1), *head[:3], True, head[3]
            )
            shape = labels[rs].shape
            out = _chunk_terms(
                logp.view(shape),
                entropy.view(shape),
                old[rs],
                adv[rs],
                mask[rs],
                None if weights is None else weights[rs],
                None if ref is None else ref[rs],
                mode_fn,
                params,
                agg,
                terms,
                scales,
            )
            leaves = [x for x in (h, w_leaf, b_leaf) if x is not None and x.requires_grad]
            grads = list(torch.autograd.grad(out[0], leaves)) if leaves else []
        if d_hidden is not None:
            d_hidden[rs] = grads.pop(0)
        if d_weight is not None:
            d_weight += grads.pop(0)
        if d_bias is not None:
            d_bias += grads.pop(0)
        out = [o.detach() for o in out]
        totals = out if totals is None else [t + o for t, o in zip(totals, out)]
    loss, *stats = totals
    if not wanted:
        return loss, *stats
    d_weight = None if d_weight is None else d_weight.to(weight.dtype)
    d_bias = None if d_bias is None else d_bias.to(bias.dtype)
    return _Precomputed.apply(loss, d_hidden, d_weight, d_bias, hidden, weight, bias), *stats


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
