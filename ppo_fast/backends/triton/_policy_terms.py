"""The one-pass loss's per-token terms and their gradient for every one-pass mode in one launch a chunk.

``_one_pass._per_token_grads`` runs the reference's ``chunk_terms`` under autograd on each chunk's
``[rows, T]`` vectors: ~80 small kernels a chunk without a KL term, ~220 with one (leaf aten kernels
counted on CPU, ``tests/test_policy_terms.py``).  Here one program reads the chunk's log-probs,
entropies and per-token inputs once, writes ``d loss / d logp`` and ``d loss / d entropy`` per token,
and adds the chunk's shares of ``(loss, pg_loss, entropy, kl_loss, clipfrac, clipfrac_lower,
approx_kl)`` into a float64 totals buffer (a mode reports the stats of its ``spec`` entry).  One
program a chunk, its sums a fixed-order tree over a fixed block, and the chunks launched in order on
one stream: the totals are deterministic.

The modes (``MODES``; one kernel body, the mode a constexpr) are the reference's
``policy_loss.py`` token by token, multiplied out in the order of its autograd so that overflow gives
the same inf or NaN: ``vanilla`` (``csrc/common/loss_math.h``'s ``policy_term``/``policy_grad``),
``sapo``, ``cispo``, ``gpg``, ``dppo_tv``, ``dppo_kl`` and ``dro``.  torch's conventions included: a
clamp passes its gradient on the closed range, so a ratio exactly on a clip bound gets the unclipped
derivative; ``maximum`` and ``minimum`` split it at a tie; the detached ratios (cispo, DPPO) pass
none.  The sequence-level modes (the spec's ``sequence_level``: ``gspo``, ``geo_mean``) mix a sequence's tokens:
in the padded layout a chunk holds whole rows (``_head_plan.sequence_chunks``), so the same program first
sweeps each block of rows for their means (``_row_terms``: gspo's mean log-ratio, GMPO's row loss and its
gradient), then writes every token's gradient from them; gspo's ratio ``exp(min(logp - sg(logp) + mean,
10))`` (its surrogate gradient, ``spec``'s ``surrogate_gradient``) clipped as vanilla's, geo_mean's tokens
clipped in log space.  On packed tokens (``PerToken.bounds``: a ``cu_seqlens`` given on the host) a chunk
holds whole packed sequences (``_one_pass.segment_chunks``) and each sequence is a row (``SEGMENTED``):
the rows' starts and lengths read from ``cu_seqlens`` on the device (copied once a call, without a sync),
the chunk's first sequence, rows and longest length found on the host, so no padded ``[S, longest]``
copy is made; its tiles sweep ``rows x longest`` as a padded chunk's would.  Given a CUDA ``cu_seqlens``
(which the host cannot read without a sync), ``pf.linear_policy_loss`` takes its two-pass path for them.
The KL estimators are ``kl_penalized_rewards``' Triton functions, and each ``agg`` is a per-token
coefficient of the batch's sum: ``1/tokens`` (token-mean), 1 (token-sum), ``1/(row tokens * rows)``
(seq-mean-token-mean), ``1/rows`` (seq-mean-token-sum), ``1/(rows * T)`` (seq-mean-token-sum-norm),
with ``tokens`` and ``rows`` (non-empty: with a valid token) the batch's, read on the device, and ``T``
the padded length (packed: the longest sequence's, the padded detour's, ``_varlen``).
"""

from __future__ import annotations

import bisect

import torch
import triton
import triton.language as tl

from ..._varlen import to_device
from ...spec import AGG_MODES
from ..reference._loss_terms import responses
from .kl_penalized_rewards import _clamp, _kl_from_log_ratio, _kl_grad, kl_estimator_code

# The totals buffer's entries, in the order of chunk_terms' outputs (vanilla's stats last).
TOTALS = ("loss", "pg_loss", "entropy", "kl_loss", "clipfrac", "clipfrac_lower", "approx_kl")
# The modes the kernel computes (its MODE: an index here): every one-pass mode (clip_cov, kl_cov are two-pass).
MODES = ("vanilla", "sapo", "cispo", "gpg", "dppo_tv", "dppo_kl", "dro", "gspo", "geo_mean")
# The stats' entries of TOTALS (a mode's spec stats are a selection of them).
_STATS = ("clipfrac", "clipfrac_lower", "approx_kl")
_BLOCK = 1024  # tokens a step: [rows, T] tiles of up to 1024 elements
_NUM_WARPS = 4

_TOKEN_MEAN = tl.constexpr(AGG_MODES.index("token-mean"))
_TOKEN_SUM = tl.constexpr(AGG_MODES.index("token-sum"))
_SEQ_TOKEN_MEAN = tl.constexpr(AGG_MODES.index("seq-mean-token-mean"))
_SEQ_TOKEN_SUM = tl.constexpr(AGG_MODES.index("seq-mean-token-sum"))
_SEQ_TOKEN_SUM_NORM = tl.constexpr(AGG_MODES.index("seq-mean-token-sum-norm"))
_VANILLA, _SAPO, _CISPO, _GPG, _DPPO_TV, _DPPO_KL, _DRO, _GSPO, _GEO_MEAN = (tl.constexpr(i) for i in range(len(MODES)))


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
def _clipped_surrogate(ratio, adv, g, ratio_low, ratio_high, dual, HAS_DUAL: tl.constexpr):
    """The clipped surrogate of a ratio (vanilla's and gspo's): ``(pg, clipped, capped, g * d pg / d ratio)``."""
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
    return pg, is_clipped, is_capped, g_ratio


@triton.jit
def _vanilla(logp, old, adv, g, ratio_low, ratio_high, dual, HAS_DUAL: tl.constexpr):
    """One token of reference.clipped_policy_loss before its weight: ``(pg, clipped, capped, g * d pg / d logp)``."""
    diff = logp - old
    ratio = tl.exp(_clamp(diff, -20.0, 20.0))  # NaN stays NaN, as torch.clamp
    pg, is_clipped, is_capped, g_ratio = _clipped_surrogate(ratio, adv, g, ratio_low, ratio_high, dual, HAS_DUAL)
    g_diff = _clamp_grad(diff, -20.0, 20.0, g_ratio * ratio)
    return pg, is_clipped, is_capped, g_diff


@triton.jit
def _gspo(logp, adv, g, seq_log_ratio, ratio_low, ratio_high):
    """One token of reference.policy_loss_gspo: the clipped surrogate of ``exp(min(logp - sg(logp) +
    seq_log_ratio, 10))``, ``seq_log_ratio`` its row's (detached) mean log-ratio."""
    log_ratio = (logp - logp) + seq_log_ratio  # logp - sg(logp): 0, NaN where logp is not finite
    ratio = tl.exp(tl.minimum(log_ratio, 10.0, propagate_nan=tl.PropagateNan.ALL))
    pg, is_clipped, _, g_ratio = _clipped_surrogate(ratio, adv, g, ratio_low, ratio_high, 0.0, False)
    return pg, is_clipped, tl.where(log_ratio <= 10.0, g_ratio * ratio, 0.0)  # the clamp passes at 10


@triton.jit
def _geo_mean_token(logp, old, adv, g_kept, eps_low, eps_high):
    """One token of reference.policy_loss_geo_mean: ``(kept, clipped with A > 0, clipped with A < 0,
    g_kept * d kept / d logp)``, ``kept = sign(A) min(sign(A) log r, sign(A) clip(log r, -eps_low,
    eps_high))`` the token's share of its row's mean."""
    log_ratio = logp - old
    sign = tl.where(adv > 0.0, 1.0, tl.where(adv < 0.0, -1.0, adv * 0.0))  # torch.sign: NaN stays NaN
    clamped = _clamp(log_ratio, -eps_low, eps_high)
    a = sign * log_ratio
    b = sign * clamped
    kept = sign * tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
    g_min = g_kept * sign
    g_log_ratio = _min_grad_to(a, b, g_min) * sign + _clamp_grad(
        log_ratio, -eps_low, eps_high, _min_grad_to(b, a, g_min) * sign
    )
    clipped = log_ratio != clamped
    return kept, (clipped & (adv > 0.0)).to(tl.float32), (clipped & (adv < 0.0)).to(tl.float32), g_log_ratio


@triton.jit
def _sapo(logp, old, adv, g, tau_pos, tau_neg):
    """reference.policy_loss_sapo: ``-A * sigmoid(tau (r - 1)) * 4 / tau``, tau_pos where A > 0."""
    diff = logp - old
    ratio = tl.exp(_clamp(diff, -20.0, 20.0))
    tau = tl.where(adv > 0.0, tau_pos, tau_neg)
    gate = tl.sigmoid(tau * (ratio - 1.0))
    four_over_tau = 4.0 / tau
    neg_adv = -adv
    pg = neg_adv * gate * four_over_tau
    g_gate = (g * four_over_tau) * neg_adv
    g_ratio = ((g_gate * (1.0 - gate)) * gate) * tau  # torch's sigmoid_backward: g (1 - y) y
    return pg, _clamp_grad(diff, -20.0, 20.0, g_ratio * ratio)


@triton.jit
def _cispo(logp, old, adv, g, ratio_low, ratio_high):
    """reference.policy_loss_cispo: ``-sg(clip(r)) * A * logp``; clipped where ``r != clip(r)`` (NaN too)."""
    ratio = tl.exp(_clamp(logp - old, -20.0, 20.0))
    clipped_ratio = _clamp(ratio, ratio_low, ratio_high)
    coef = -clipped_ratio * adv
    return coef * logp, (ratio != clipped_ratio).to(tl.float32), g * coef


@triton.jit
def _dppo(logp, old, adv, g, eps_low, eps_high, ratio_cap, BINARY_KL: tl.constexpr):
    """reference._dppo: ``-A * sg(min(r, ratio_cap)) * logp * keep``, ``keep`` the trust region of
    policy_loss_dppo_tv (``BINARY_KL`` False) or policy_loss_dppo_kl, bounds inclusive."""
    ratio = tl.exp(_clamp(logp - old, -20.0, 20.0))
    p = tl.exp(logp)
    p_old = tl.exp(old)
    if BINARY_KL:
        binary_kl = p_old * (old - logp) + (1.0 - p_old) * tl.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        keep = tl.where(adv > 0.0, (binary_kl <= eps_high) | (p <= p_old), (binary_kl <= eps_low) | (p >= p_old))
    else:
        keep = tl.where(adv > 0.0, p - p_old <= eps_high, p - p_old >= -eps_low)
    keep = keep.to(tl.float32)
    coef = -adv * tl.minimum(ratio, ratio_cap, propagate_nan=tl.PropagateNan.ALL)
    capped = (ratio > ratio_cap).to(tl.float32) * keep
    return (coef * logp) * keep, 1.0 - keep, capped, (g * keep) * coef


@triton.jit
def _mode_term(logp, old, adv, g, p0, p1, p2, row_a, row_b, MODE: tl.constexpr, HAS_DUAL: tl.constexpr):
    """One token of MODE's loss before its weight: ``(pg, clipped, lower, g * d pg / d logp)``, the two
    stats the mode's clipfrac and clipfrac_lower (0 where it has none); ``(p0, p1, p2)``: ``Batch.params``;
    ``(row_a, row_b)``: the token's row's ``_row_terms`` (a sequence-level mode's)."""
    zero = tl.zeros_like(logp)
    if MODE == _VANILLA:
        pg, clipped, lower, g_logp = _vanilla(logp, old, adv, g, p0, p1, p2, HAS_DUAL)
    elif MODE == _SAPO:
        pg, g_logp = _sapo(logp, old, adv, g, p0, p1)
        clipped, lower = zero, zero
    elif MODE == _CISPO:
        pg, clipped, g_logp = _cispo(logp, old, adv, g, p0, p1)
        lower = zero
    elif MODE == _GPG:  # -A * logp
        neg_adv = -adv
        pg, clipped, lower, g_logp = neg_adv * logp, zero, zero, g * neg_adv
    elif MODE == _DPPO_TV:
        pg, clipped, lower, g_logp = _dppo(logp, old, adv, g, p0, p1, p2, False)
    elif MODE == _DPPO_KL:
        pg, clipped, lower, g_logp = _dppo(logp, old, adv, g, p0, p1, p2, True)
    elif MODE == _DRO:  # -(A logp - beta/2 (logp - old)^2), p0 = beta/2
        log_ratio = logp - old
        pg = -(adv * logp - p0 * (log_ratio * log_ratio))
        g_logp = -g * adv + (g * p0) * (2.0 * log_ratio)
        clipped, lower = zero, zero
    elif MODE == _GSPO:  # row_a: the row's mean log-ratio
        pg, clipped, g_logp = _gspo(logp, adv, g, row_a, p0, p1)
        lower = zero
    elif MODE == _GEO_MEAN:  # row_a, row_b: the row's loss and d loss / d kept (g unused: weights are in row_a)
        _, clipped, lower, g_logp = _geo_mean_token(logp, old, adv, row_b, p0, p1)
        pg = row_a + zero
    else:
        tl.static_assert(False, "policy terms: a mode of MODES without its branch")
    return pg, clipped, lower, g_logp


@triton.jit
def _rows(block, SEGMENTED: tl.constexpr):
    """A block of the chunk's rows, ``block = (ends_ptr, rows_i, row_ok, start, first, row_len, row_stride)``
    (the kernel's): ``(row_at, row_local, row_n)``, each row's first token's offset in the batch's inputs
    and in the chunk's vectors ([R_BLOCK]), and its tokens ([R_BLOCK, 1]; padded, the scalar).  Padded: rows
    of ``row_len`` every ``row_stride`` from ``start``; ``SEGMENTED``: the packed sequences ``first + rows_i``
    (``ends_ptr``: ``cu_seqlens`` on the device), the chunk's tokens from ``start`` of the packed row."""
    ends_ptr, rows_i, row_ok, start, first, row_len, row_stride = block
    if SEGMENTED:
        sequence = first + rows_i  # int64, as every offset
        row_at = tl.load(ends_ptr + sequence, mask=row_ok, other=0)
        row_n = (tl.load(ends_ptr + (sequence + 1), mask=row_ok, other=0) - row_at).to(tl.int32)[:, None]
        row_local = row_at - start
    else:
        row_at = start + rows_i * row_stride
        row_local = rows_i * row_len
        row_n = row_len  # every row's length: a scalar
    return row_at, row_local, row_n


@triton.jit
def _tile(mask_ptr, block, t, SEGMENTED: tl.constexpr):
    """A ``[R_BLOCK, T_BLOCK]`` tile's ``(in bounds, offsets in the batch's inputs, in the chunk, valid)``, the
    rows' offsets (``_rows``) formed here, in the tile's loop: held across the loops, they spilled the padded
    seq-mean variant under Triton 3.6 (bench static)."""
    row_at, row_local, row_n = _rows(block, SEGMENTED)
    row_ok = block[2]
    ok = row_ok[:, None] & (t[None, :] < row_n)  # row_n: [R_BLOCK, 1] (segmented) or a scalar (padded)
    at = row_at[:, None] + t[None, :]  # the batch's inputs
    local = row_local[:, None] + t[None, :]  # the chunk's vectors
    valid = ok & (tl.load(mask_ptr + at, mask=ok, other=0) != 0)
    return ok, at, local, valid


@triton.jit
def _load(ptr, at, valid):
    """float32 values at the valid tokens, 0 elsewhere (whatever a masked token holds reaches nothing)."""
    return tl.where(valid, tl.load(ptr + at, mask=valid, other=0.0).to(tl.float32), 0.0)


@triton.jit
def _row_terms(
    logp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    weights_ptr,
    block,
    coef,
    p0,
    p1,
    MODE: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    SEGMENTED: tl.constexpr,
    T_BLOCK: tl.constexpr,
):
    """A sequence-level mode's ``(row_a, row_b)`` per row ([R_BLOCK] float32), the reference's row means
    (over the valid tokens, a row without any 0): gspo ``(mean log r, 0)``; geo_mean ``(row loss,
    d loss / d kept)``, the row loss ``-mean(A) * exp(mean kept) * exp(mean log(weights + 1e-10))``
    and its gradient by autograd's chain, ``coef * tokens`` the loss's factor of it; ``block``: ``_rows``'."""
    row_ok, row_len = block[2], block[5]
    count = tl.zeros(row_ok.shape, tl.float32)
    sum_a = tl.zeros(row_ok.shape, tl.float32)  # gspo: log r; geo_mean: kept
    sum_adv = tl.zeros(row_ok.shape, tl.float32)
    sum_log_w = tl.zeros(row_ok.shape, tl.float32)
    for t0 in range(0, row_len, T_BLOCK):
        ok, at, local, valid = _tile(mask_ptr, block, t0 + tl.arange(0, T_BLOCK), SEGMENTED)
        logp = _load(logp_ptr, local, valid)
        old = _load(old_ptr, at, valid)
        count += tl.sum(valid.to(tl.float32), 1)
        if MODE == _GSPO:
            sum_a += tl.sum(tl.where(valid, logp - old, 0.0), 1)
        else:
            adv = _load(adv_ptr, at, valid)
            kept, _, _, _ = _geo_mean_token(logp, old, adv, tl.zeros_like(logp), p0, p1)
            sum_a += tl.sum(tl.where(valid, kept, 0.0), 1)
            sum_adv += tl.sum(adv, 1)
            if HAS_WEIGHTS:  # verl's geometric mean of the weights, with its 1e-10
                sum_log_w += tl.sum(tl.where(valid, tl.log(_load(weights_ptr, at, valid) + 1e-10), 0.0), 1)
    tokens = tl.maximum(count, 1.0)
    if MODE == _GSPO:
        row_a, row_b = sum_a / tokens, tl.zeros_like(sum_a)
    else:
        neg_mean_adv = -(sum_adv / tokens)
        geo = tl.exp(sum_a / tokens)
        geo_weight = tl.exp(sum_log_w / tokens)  # 1 without weights
        row_a = (neg_mean_adv * geo) * geo_weight
        row_b = ((((coef * count) * geo_weight) * neg_mean_adv) * geo) / tokens
    return row_a, row_b


@triton.jit
def _row_coefficients(
    mask_ptr, norms_ptr, block, norm_len, AGG: tl.constexpr, SEGMENTED: tl.constexpr, T_BLOCK: tl.constexpr
):
    """Each row's factor of a token's loss in the batch's ``agg`` loss ([R_BLOCK] float32); ``block``: ``_rows``'."""
    row_ok, row_len = block[2], block[5]
    total_tokens = tl.load(norms_ptr)
    total_rows = tl.load(norms_ptr + tl.full([], 1, tl.int64))  # 64-bit offsets throughout
    if AGG == _TOKEN_MEAN:
        coef = tl.zeros(row_ok.shape, tl.float64) + 1.0 / total_tokens
    elif AGG == _TOKEN_SUM:
        coef = tl.zeros(row_ok.shape, tl.float64) + 1.0
    elif AGG == _SEQ_TOKEN_MEAN:
        count = tl.zeros(row_ok.shape, tl.float32)
        for t0 in range(0, row_len, T_BLOCK):
            _, _, _, valid = _tile(mask_ptr, block, t0 + tl.arange(0, T_BLOCK), SEGMENTED)
            count += tl.sum(valid.to(tl.float32), 1)
        coef = 1.0 / (tl.maximum(count, 1.0).to(tl.float64) * total_rows)
    elif AGG == _SEQ_TOKEN_SUM:
        coef = tl.zeros(row_ok.shape, tl.float64) + 1.0 / total_rows
    elif AGG == _SEQ_TOKEN_SUM_NORM:
        coef = tl.zeros(row_ok.shape, tl.float64) + 1.0 / (total_rows * norm_len)  # norm_len: max(T, 1)
    else:
        tl.static_assert(False, "policy terms: an agg mode without its coefficient")
    return coef.to(tl.float32)


@triton.jit
def _terms_kernel(
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
    ends_ptr,  # SEGMENTED: cu_seqlens [S + 1] int64 on the device
    start,
    first,  # SEGMENTED: the chunk's first sequence
    rows,
    row_len,  # the chunk's longest row
    row_stride,
    norm_len,  # T of seq-mean-token-sum-norm
    p0,  # the mode's parameters (Batch.params)
    p1,
    p2,
    kl_coef,
    entropy_coef,
    MODE: tl.constexpr,
    AGG: tl.constexpr,
    HAS_DUAL: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,  # entropy_coef != 0: d loss / d entropy is written
    KL_ESTIMATOR: tl.constexpr,
    SEGMENTED: tl.constexpr,
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
        block = (ends_ptr, rows_i, row_ok, start, first, row_len, row_stride)  # the row block's geometry (_rows)
        row_coef = _row_coefficients(mask_ptr, norms_ptr, block, norm_len, AGG, SEGMENTED, T_BLOCK)
        coef = row_coef[:, None]
        if MODE == _GSPO or MODE == _GEO_MEAN:  # a first pass over the rows (the chunk holds whole rows)
            row_a, row_b = _row_terms(
                logp_ptr,
                old_ptr,
                adv_ptr,
                mask_ptr,
                weights_ptr,
                block,
                row_coef,
                p0,
                p1,
                MODE,
                HAS_WEIGHTS,
                SEGMENTED,
                T_BLOCK,
            )
        else:
            row_a, row_b = tl.zeros_like(row_coef), tl.zeros_like(row_coef)
        for t0 in range(0, row_len, T_BLOCK):
            ok, at, local, valid = _tile(mask_ptr, block, t0 + tl.arange(0, T_BLOCK), SEGMENTED)
            logp = _load(logp_ptr, local, valid)
            if MODE == _GPG:  # its loss does not read old_logprobs
                old = tl.zeros_like(logp)
            else:
                old = _load(old_ptr, at, valid)
            adv = _load(adv_ptr, at, valid)
            token = tl.where(valid, coef, 0.0)  # d loss / d (the token's weighted loss)
            if HAS_SCALE:
                scale = _load(scale_ptr, at, valid)
            weight = tl.full([R_BLOCK, T_BLOCK], 1.0, tl.float32)
            if HAS_WEIGHTS and MODE != _GEO_MEAN:  # GMPO's weights are a factor of its row loss
                weight = _load(weights_ptr, at, valid)
            if HAS_SCALE:
                weight = weight * scale
            pg, is_clipped, is_capped, g_logp = _mode_term(
                logp, old, adv, token * weight, p0, p1, p2, row_a[:, None], row_b[:, None], MODE, HAS_DUAL
            )
            acc_pg += tl.where(valid, pg * weight * coef, 0.0)
            acc_clipped += tl.where(valid, is_clipped, 0.0)
            acc_capped += tl.where(valid, is_capped, 0.0)
            acc_approx += old - logp
            if HAS_REF:
                log_ratio = logp - _load(ref_ptr, at, valid)
                kl_token = token * scale if HAS_SCALE else token
                acc_kl += tl.where(valid, _kl_from_log_ratio(log_ratio, KL_ESTIMATOR) * kl_token, 0.0)
                g_logp += _kl_grad(log_ratio, kl_coef * kl_token, KL_ESTIMATOR)
            tl.store(g_logp_ptr + local, tl.where(valid, g_logp, 0.0), mask=ok)
            entropy = _load(entropy_ptr, local, valid)
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
    """Whether :class:`Batch` serves this call (else ``_one_pass._per_token_grads``): a mode of ``MODES``
    (every one-pass mode; a sequence-level one on rows or whole packed sequences, not on token slices
    with a factor per token, ``x.scale``) with float32 log-probs (the head's for every input dtype but float64) and
    per-token inputs of at most 32 bits, so that its terms are float32 as the reference's (float64
    inputs give float64 terms: the generic path)."""
    floats = [t for t in x[:6] if t is not None and t.dtype != torch.bool]  # not the bounds (int64)
    return (
        objective.mode.name in MODES
        and (not objective.mode.sequence_level or x.scale is None)
        and logp_dtype == torch.float32
        and all(t.dtype in (torch.float32, torch.float16, torch.bfloat16) for t in floats)
    )


def mode_params(objective) -> tuple[float, float, float, bool]:
    """The kernel's ``(p0, p1, p2, HAS_DUAL)`` from the mode's bound parameters (``spec`` order), each
    formed in Python as the reference forms the scalar it compares or multiplies by (float: an int 1
    would reach Triton as a constexpr integer)."""
    name, params = objective.mode.name, objective.params
    if name == "vanilla":
        low, high, dual = params
        values, has_dual = (1.0 - low, 1.0 + high, 0.0 if dual is None else dual), dual is not None
    elif name in ("cispo", "gspo"):
        low, high = params
        values, has_dual = (1.0 - low, 1.0 + high, 0.0), False
    elif name in ("sapo", "dppo_tv", "dppo_kl"):  # (tau_pos, tau_neg); (clip_eps_low, clip_eps_high, ratio_cap)
        values, has_dual = (*params, 0.0)[:3], False
    elif name == "geo_mean":  # its clip in log space: (clip_eps_low, clip_eps_high)
        values, has_dual = (*params, 0.0), False
    elif name == "dro":
        values, has_dual = (0.5 * params[0], 0.0, 0.0), False  # the reference's 0.5 * dro_beta
    elif name == "gpg":
        values, has_dual = (0.0, 0.0, 0.0), False
    else:
        raise ValueError(f"the fused policy terms have no kernel for mode {name!r} (they serve {', '.join(MODES)})")
    return (*(float(v) for v in values), has_dual)


class Batch:
    """The per-call state of the fused terms: the per-token inputs contiguous (a copy only where one is
    strided or expanded), the normalisers from the mask on the device (no host sync) and the totals.
    With ``x.bounds`` (a sequence-level mode's packed ``[1, N]`` row, ``cu_seqlens`` on the host) each
    packed sequence is a row: its bounds copied to the device once (``_varlen.to_device``, no sync), the
    rows with a valid token counted per sequence, ``T`` the longest length, and a chunk's sequences found
    on the host (:meth:`launch`)."""

    def __init__(self, x, objective, terms):
        self.x = [None if t is None else t.contiguous() for t in x[:6]]
        self.x[2] = self.x[2].view(torch.uint8)  # the mask's bytes
        mask = x.mask
        self.ends, self.host_ends = None, None
        if x.bounds is not None:  # packed sequences: rows of their own lengths
            self.host_ends = x.bounds.tolist()
            self.ends = to_device(x.bounds, mask.device)
            rows = responses(mask, self.ends)
            self.length = max((b - a for a, b in zip(self.host_ends, self.host_ends[1:])), default=0)
        else:
            rows = mask.any(-1).sum(dtype=torch.float64)
            self.length = mask.shape[-1]
        self.norms = torch.stack((mask.sum(dtype=torch.float64), rows)).clamp_min_(1)
        self.totals = torch.zeros(len(TOTALS), dtype=torch.float64, device=mask.device)
        self.params = mode_params(objective)
        self.mode = MODES.index(objective.mode.name)
        self.outputs = (0, 1, 2, 3, *(4 + _STATS.index(name) for name in objective.mode.stats))
        self.agg = AGG_MODES.index(objective.agg)
        self.terms = terms

    def _sequences(self, start: int, tokens: int) -> tuple[int, int, int]:
        """``(first, rows, longest)``: the packed sequences that the chunk's tokens ``[start, start + tokens)``
        are (whole ones, ``segment_chunks``'), from the host bounds; empty ones at its ends included."""
        ends = self.host_ends
        first, last = bisect.bisect_left(ends, start), bisect.bisect_right(ends, start + tokens) - 1
        if ends[first] != start or ends[last] != start + tokens:
            raise ValueError(f"the fused terms' chunk [{start}, {start + tokens}) is not whole packed sequences")
        return first, last - first, max((ends[s + 1] - ends[s] for s in range(first, last)), default=0)

    def launch(self, logp, entropy, start: int, shape: tuple[int, int]):
        """One chunk: ``shape = (rows, row_len)`` tokens from flat index ``start`` of the batch's ``[B, T]``
        (with bounds: ``(1, tokens)`` of the packed row, whole sequences); ``logp``/``entropy`` its float32
        vectors.  Returns ``(g_logp, g_entropy or None)``."""
        rows, row_len = shape
        first = 0
        if self.ends is not None:
            first, rows, row_len = self._sequences(start, rows * row_len)
        g_logp = torch.empty_like(logp)
        has_entropy = self.terms.entropy_coef != 0.0
        g_entropy = torch.empty_like(entropy) if has_entropy else None
        t_block = min(triton.next_power_of_2(max(row_len, 1)), _BLOCK)
        old, adv, mask, weights, ref, scale = self.x
        p0, p1, p2, has_dual = self.params
        _terms_kernel[(1,)](
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
            self.ends if self.ends is not None else self.norms,
            start,
            first,
            rows,
            row_len,
            self.length,
            float(max(self.length, 1)),
            p0,
            p1,
            p2,
            self.terms.kl_coef,
            self.terms.entropy_coef,
            MODE=self.mode,
            AGG=self.agg,
            HAS_DUAL=has_dual,
            HAS_WEIGHTS=weights is not None,
            HAS_REF=ref is not None,
            HAS_SCALE=scale is not None,
            HAS_ENTROPY=has_entropy,
            KL_ESTIMATOR=kl_estimator_code(self.terms.kl_estimator),
            SEGMENTED=self.ends is not None,
            R_BLOCK=_BLOCK // t_block,
            T_BLOCK=t_block,
            num_warps=_NUM_WARPS,
        )
        return g_logp, g_entropy

    def results(self) -> list[torch.Tensor]:
        """``(loss, pg_loss, entropy, kl_loss, *the mode's stats)`` as float32 scalars, one tensor each
        (a custom op's outputs alias no other)."""
        totals = self.totals.float()
        return [totals[i].clone() for i in self.outputs]
