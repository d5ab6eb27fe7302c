"""The one-pass loss's per-token terms and their gradient for the ``vanilla`` mode in one launch a chunk.

``_one_pass._per_token_grads`` runs the reference's ``chunk_terms`` under autograd on each chunk's
``[rows, T]`` vectors: ~80 small kernels a chunk without a KL term, ~220 with one (leaf aten kernels
counted on CPU, ``tests/test_policy_terms.py``).  Here one program reads the chunk's log-probs,
entropies and per-token inputs once, writes ``d loss / d logp`` and ``d loss / d entropy`` per token,
and adds the chunk's shares of ``(loss, pg_loss, entropy, kl_loss, clipfrac, clipfrac_lower,
approx_kl)`` into a float64 totals buffer.  One program a chunk, its sums a fixed-order tree over a
fixed block, and the chunks launched in order on one stream: the totals are deterministic.

The math is ``reference.clipped_policy_loss`` token by token (``csrc/common/loss_math.h``'s
``policy_term``/``policy_grad``, torch's conventions included: a clamp passes its gradient on the
closed range, so a ratio exactly on a clip bound gets the unclipped derivative; ``maximum`` and
``minimum`` split it at a tie), the KL estimators are ``kl_penalized_rewards``' Triton functions, and
each ``agg`` is a per-token coefficient of the batch's sum: ``1/tokens`` (token-mean), 1 (token-sum),
``1/(row tokens * rows)`` (seq-mean-token-mean), ``1/rows`` (seq-mean-token-sum), ``1/(rows * T)``
(seq-mean-token-sum-norm), with ``tokens`` and ``rows`` (non-empty) the batch's, read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...spec import AGG_MODES
from .kl_penalized_rewards import _clamp, _kl_from_log_ratio, _kl_grad, kl_estimator_code

# The totals buffer's entries, in the order of chunk_terms' outputs (vanilla's stats last).
TOTALS = ("loss", "pg_loss", "entropy", "kl_loss", "clipfrac", "clipfrac_lower", "approx_kl")
_BLOCK = 1024  # tokens a step: [rows, T] tiles of up to 1024 elements
_NUM_WARPS = 4

_TOKEN_MEAN = tl.constexpr(AGG_MODES.index("token-mean"))
_TOKEN_SUM = tl.constexpr(AGG_MODES.index("token-sum"))
_SEQ_TOKEN_MEAN = tl.constexpr(AGG_MODES.index("seq-mean-token-mean"))
_SEQ_TOKEN_SUM = tl.constexpr(AGG_MODES.index("seq-mean-token-sum"))
_SEQ_TOKEN_SUM_NORM = tl.constexpr(AGG_MODES.index("seq-mean-token-sum-norm"))


@triton.jit
def _max_grad_to(a, b, g):
    """The gradient torch.maximum(a, b) passes to a: g/2 at a tie, 0 where a < b, else g."""
    return tl.where(a == b, g * 0.5, tl.where(a < b, 0.0, g))


@triton.jit
def _min_grad_to(a, b, g):
    return tl.where(a == b, g * 0.5, tl.where(a > b, 0.0, g))


@triton.jit
def _clamp_grad(x, low, high, g):
    """torch.clamp's gradient on its closed range (none outside it or for NaN)."""
    return tl.where((x >= low) & (x <= high), g, 0.0)


@triton.jit
def _vanilla(logp, old, adv, g, ratio_low, ratio_high, dual, HAS_DUAL: tl.constexpr):
    """One token of reference.clipped_policy_loss before its weight: ``(pg, clipped, capped, g * d pg / d logp)``."""
    diff = logp - old
    ratio = tl.exp(_clamp(diff, -20.0, 20.0))  # NaN stays NaN, as torch.clamp
    ratio_clipped = _clamp(ratio, ratio_low, ratio_high)
    neg_adv = -adv
    unclipped = neg_adv * ratio
    clipped = neg_adv * ratio_clipped
    pg0 = tl.maximum(unclipped, clipped, propagate_nan=tl.PropagateNan.ALL)
    is_clipped = (clipped > unclipped).to(tl.float32)
    if HAS_DUAL:
        cap = neg_adv * dual
        in_min = adv < 0.0
        pg = tl.where(in_min, tl.minimum(pg0, cap, propagate_nan=tl.PropagateNan.ALL), pg0)
        is_capped = (in_min & (cap < pg0)).to(tl.float32)
        g_pg0 = tl.where(in_min, _min_grad_to(pg0, cap, g), g)
    else:
        pg = pg0
        is_capped = tl.zeros_like(pg)
        g_pg0 = g
    g_unclipped = _max_grad_to(unclipped, clipped, g_pg0)
    g_clipped = _max_grad_to(clipped, unclipped, g_pg0)
    g_ratio = g_unclipped * neg_adv + _clamp_grad(ratio, ratio_low, ratio_high, g_clipped * neg_adv)
    g_diff = _clamp_grad(diff, -20.0, 20.0, g_ratio * ratio)
    return pg, is_clipped, is_capped, g_diff


@triton.jit
def _row_coefficients(
    mask_ptr, norms_ptr, rows_i, row_ok, start, row_len, row_stride, norm_len, AGG: tl.constexpr, T_BLOCK: tl.constexpr
):
    """Each row's factor of a token's loss in the batch's ``agg`` loss ([R_BLOCK] float32)."""
    total_tokens = tl.load(norms_ptr)
    total_rows = tl.load(norms_ptr + tl.full([], 1, tl.int64))  # 64-bit offsets throughout
    if AGG == _TOKEN_MEAN:
        coef = tl.zeros(rows_i.shape, tl.float64) + 1.0 / total_tokens
    elif AGG == _TOKEN_SUM:
        coef = tl.zeros(rows_i.shape, tl.float64) + 1.0
    elif AGG == _SEQ_TOKEN_MEAN:
        count = tl.zeros(rows_i.shape, tl.float32)
        for t0 in range(0, row_len, T_BLOCK):
            t = t0 + tl.arange(0, T_BLOCK)
            ok = row_ok[:, None] & (t < row_len)[None, :]
            m = tl.load(mask_ptr + (start + rows_i[:, None] * row_stride + t[None, :]), mask=ok, other=0)
            count += tl.sum((m != 0).to(tl.float32), 1)
        coef = 1.0 / (tl.maximum(count, 1.0).to(tl.float64) * total_rows)
    elif AGG == _SEQ_TOKEN_SUM:
        coef = tl.zeros(rows_i.shape, tl.float64) + 1.0 / total_rows
    elif AGG == _SEQ_TOKEN_SUM_NORM:
        coef = tl.zeros(rows_i.shape, tl.float64) + 1.0 / (total_rows * norm_len)  # norm_len: max(T, 1)
    else:
        tl.static_assert(False, "policy terms: an agg mode without its coefficient")
    return coef.to(tl.float32)


@triton.jit
def _vanilla_terms_kernel(
    logp_ptr,  # the chunk's [rows * row_len] float32 log-probs and entropies
    entropy_ptr,
    old_ptr,  # the batch's contiguous [B, T] inputs, from `start` with `row_stride`
    adv_ptr,
    mask_ptr,
    weights_ptr,
    ref_ptr,
    scale_ptr,
    g_logp_ptr,  # the chunk's [rows * row_len] float32 gradients
    g_entropy_ptr,
    norms_ptr,  # float64 [2]: the batch's valid tokens and non-empty rows (at least 1 each)
    totals_ptr,  # float64 [7]: TOTALS, added to
    start,
    rows,
    row_len,
    row_stride,
    norm_len,  # T of seq-mean-token-sum-norm
    ratio_low,
    ratio_high,
    dual,
    kl_coef,
    entropy_coef,
    AGG: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,  # entropy_coef != 0: d loss / d entropy is written
    KL_ESTIMATOR: tl.constexpr,
    R_BLOCK: tl.constexpr,
    T_BLOCK: tl.constexpr,
):
    inv_tokens = (1.0 / tl.load(norms_ptr)).to(tl.float32)
    acc_pg = tl.zeros([R_BLOCK, T_BLOCK], tl.float32)
    acc_entropy = tl.zeros([R_BLOCK, T_BLOCK], tl.float32)
    acc_kl = tl.zeros([R_BLOCK, T_BLOCK], tl.float32)
    acc_clipped = tl.zeros([R_BLOCK, T_BLOCK], tl.float32)
    acc_capped = tl.zeros([R_BLOCK, T_BLOCK], tl.float32)
    acc_approx = tl.zeros([R_BLOCK, T_BLOCK], tl.float32)
    for r0 in range(0, rows, R_BLOCK):
        rows_i = (r0 + tl.arange(0, R_BLOCK)).to(tl.int64)
        row_ok = rows_i < rows
        coef = _row_coefficients(
            mask_ptr, norms_ptr, rows_i, row_ok, start, row_len, row_stride, norm_len, AGG, T_BLOCK
        )[:, None]
        for t0 in range(0, row_len, T_BLOCK):
            t = t0 + tl.arange(0, T_BLOCK)
            ok = row_ok[:, None] & (t < row_len)[None, :]
            at = start + rows_i[:, None] * row_stride + t[None, :]  # the batch's [B, T] inputs
            local = rows_i[:, None] * row_len + t[None, :]  # the chunk's vectors
            valid = ok & (tl.load(mask_ptr + at, mask=ok, other=0) != 0)
            logp = tl.where(valid, tl.load(logp_ptr + local, mask=valid, other=0.0), 0.0)
            old = tl.where(valid, tl.load(old_ptr + at, mask=valid, other=0.0).to(tl.float32), 0.0)
            adv = tl.where(valid, tl.load(adv_ptr + at, mask=valid, other=0.0).to(tl.float32), 0.0)
            token = tl.where(valid, coef, 0.0)  # d loss / d (the token's weighted loss)
            if HAS_SCALE:
                scale = tl.where(valid, tl.load(scale_ptr + at, mask=valid, other=0.0).to(tl.float32), 0.0)
            weight = tl.full([R_BLOCK, T_BLOCK], 1.0, tl.float32)
            if HAS_WEIGHTS:
                weight = tl.where(valid, tl.load(weights_ptr + at, mask=valid, other=0.0).to(tl.float32), 0.0)
            if HAS_SCALE:
                weight = weight * scale
            pg, is_clipped, is_capped, g_logp = _vanilla(
                logp, old, adv, token * weight, ratio_low, ratio_high, dual, HAS_DUAL
            )
            acc_pg += tl.where(valid, pg * weight * coef, 0.0)
            acc_clipped += tl.where(valid, is_clipped, 0.0)
            acc_capped += tl.where(valid, is_capped, 0.0)
            acc_approx += old - logp
            if HAS_REF:
                log_ratio = logp - tl.where(valid, tl.load(ref_ptr + at, mask=valid, other=0.0).to(tl.float32), 0.0)
                kl_token = token * scale if HAS_SCALE else token
                acc_kl += tl.where(valid, _kl_from_log_ratio(log_ratio, KL_ESTIMATOR) * kl_token, 0.0)
                g_logp += _kl_grad(log_ratio, kl_coef * kl_token, KL_ESTIMATOR)
            tl.store(g_logp_ptr + local, tl.where(valid, g_logp, 0.0), mask=ok)
            entropy = tl.where(valid, tl.load(entropy_ptr + local, mask=valid, other=0.0), 0.0)
            acc_entropy += entropy
            if HAS_ENTROPY:
                tl.store(g_entropy_ptr + local, tl.where(valid, -entropy_coef * inv_tokens, 0.0), mask=ok)
    pg_sum = tl.sum(tl.sum(acc_pg, 1), 0)
    entropy_sum = tl.sum(tl.sum(acc_entropy, 1), 0) * inv_tokens
    kl_sum = tl.sum(tl.sum(acc_kl, 1), 0)
    loss = pg_sum - entropy_coef * entropy_sum + kl_coef * kl_sum
    _add(totals_ptr, 0, loss)
    _add(totals_ptr, 1, pg_sum)
    _add(totals_ptr, 2, entropy_sum)
    _add(totals_ptr, 3, kl_sum)
    _add(totals_ptr, 4, tl.sum(tl.sum(acc_clipped, 1), 0) * inv_tokens)
    _add(totals_ptr, 5, tl.sum(tl.sum(acc_capped, 1), 0) * inv_tokens)
    _add(totals_ptr, 6, tl.sum(tl.sum(acc_approx, 1), 0) * inv_tokens)


@triton.jit
def _add(totals_ptr, I: tl.constexpr, value):
    at = totals_ptr + tl.full([], I, tl.int64)
    tl.store(at, tl.load(at) + value.to(tl.float64))


def fused(objective, logp_dtype: torch.dtype, x) -> bool:
    """Whether :class:`Batch` serves this call (else ``_one_pass._per_token_grads``): the vanilla mode
    with float32 log-probs (the head's for every input dtype but float64) and per-token inputs of at
    most 32 bits, so that its terms are float32 as the reference's (float64 inputs give float64 terms:
    the generic path)."""
    floats = [t for t in x if t is not None and t.dtype != torch.bool]
    return (
        objective.mode.name == "vanilla"
        and logp_dtype == torch.float32
        and all(t.dtype in (torch.float32, torch.float16, torch.bfloat16) for t in floats)
    )


class Batch:
    """The per-call state of the fused terms: the per-token inputs contiguous (a copy only where one is
    strided or expanded), the normalisers from the mask on the device (no host sync) and the totals."""

    def __init__(self, x, objective, terms):
        self.x = [None if t is None else t.contiguous() for t in x]
        self.x[2] = self.x[2].view(torch.uint8)  # the mask's bytes
        mask = x.mask
        self.norms = torch.stack((mask.sum(dtype=torch.float64), mask.any(-1).sum(dtype=torch.float64))).clamp_min_(1)
        self.totals = torch.zeros(len(TOTALS), dtype=torch.float64, device=mask.device)
        self.length = mask.shape[-1]
        low, high, dual = objective.params
        self.params = (1.0 - low, 1.0 + high, 0.0 if dual is None else dual, dual is not None)
        self.agg = AGG_MODES.index(objective.agg)
        self.terms = terms

    def launch(self, logp, entropy, start: int, shape: tuple[int, int]):
        """One chunk: ``shape = (rows, row_len)`` tokens from flat index ``start`` of the batch's ``[B, T]``;
        ``logp``/``entropy`` its float32 vectors.  Returns ``(g_logp, g_entropy or None)``."""
        rows, row_len = shape
        g_logp = torch.empty_like(logp)
        has_entropy = self.terms.entropy_coef != 0.0
        g_entropy = torch.empty_like(entropy) if has_entropy else None
        t_block = min(triton.next_power_of_2(max(row_len, 1)), _BLOCK)
        old, adv, mask, weights, ref, scale = self.x
        low, high, dual, has_dual = self.params
        _vanilla_terms_kernel[(1,)](
            logp,
            entropy,
            old,
            adv,
            mask,
            weights if weights is not None else old,
            ref if ref is not None else old,
            scale if scale is not None else old,
            g_logp,
            g_entropy if has_entropy else g_logp,
            self.norms,
            self.totals,
            start,
            rows,
            row_len,
            self.length,
            float(max(self.length, 1)),
            low,
            high,
            dual,
            self.terms.kl_coef,
            self.terms.entropy_coef,
            AGG=self.agg,
            HAS_DUAL=has_dual,
            HAS_WEIGHTS=weights is not None,
            HAS_REF=ref is not None,
            HAS_SCALE=scale is not None,
            HAS_ENTROPY=has_entropy,
            KL_ESTIMATOR=kl_estimator_code(self.terms.kl_estimator),
            R_BLOCK=_BLOCK // t_block,
            T_BLOCK=t_block,
            num_warps=_NUM_WARPS,
        )
        return g_logp, g_entropy

    def results(self) -> list[torch.Tensor]:
        """The totals as float32 scalars, one tensor each (a custom op's outputs alias no other)."""
        totals = self.totals.float()
        return [totals[i].clone() for i in range(len(TOTALS))]
