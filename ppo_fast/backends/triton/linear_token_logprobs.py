"""Fused LM head: log-probs (and entropy) of the chosen tokens straight from the last
hidden states, never materialising the ``[N, V]`` logits (the Cut Cross-Entropy approach).

Per row ``n``: ``z = softcap(logit_scale * (hidden[n] @ weight.T + bias)) / temperature``
with ``softcap(x) = c * tanh(x / c)`` (none when ``logit_softcap`` is None), then
``logp = z[label] - logsumexp(z)`` and ``entropy = -sum softmax(z) * log_softmax(z)``.

Forward: one program per block of ``BLOCK_N`` rows loops over ``BLOCK_V`` vocabulary
tiles; each tile of ``hidden @ weight.T`` is a ``tl.dot`` over ``BLOCK_H`` steps of
the hidden dim (float32 accumulate, tensor cores for bf16/fp16), transformed in
registers and folded into an online logsumexp (and an online ``sum p * z`` for the
entropy): the logits only ever exist one ``[BLOCK_N, BLOCK_V]`` tile at a time.  Where the row
blocks alone would leave multiprocessors idle (an RLHF micro-batch of 2-8k rows is 16-64 blocks
for an H200's 132), each row block's vocabulary is split among as many programs as fill one
wave; each writes its share's running max, sum, entropy sum and chosen logit, and one kernel
merges them as the loop merges its tiles (``_combine_kernel``).  The "epilogue" design (``DESIGN``)
runs this forward as one grouped GEMM: a program a row block and ``EPILOGUE_COLUMNS`` of the
vocabulary, in ``_grouped``'s order.

Backward, by vocabulary chunks: one program per ``(row block, vocabulary block)`` tile
recomputes that tile's logits with the forward's tile code and from its logsumexp, forms ``dz =
g_logp * (onehot - p) - g_entropy * p * (log p + entropy)`` times the transform's derivative and
writes it, rounded to the inputs' dtype, into a ``[N, chunk]`` buffer (at most
``GRADIENT_SCRATCH_BYTES``); cuBLAS then adds ``dz @ weight[chunk]`` into ``d_hidden`` and
writes ``dz.T @ hidden`` into ``d_weight[chunk]`` (float32 sums of the bf16/fp16 products), and
its column sums into ``d_bias[chunk]``.  Why not multiply in the tile kernel as the forward
does: ``d_hidden``'s ``[BLOCK_N, H]`` and ``d_weight``'s ``[BLOCK_V, H]`` accumulators do not
fit in registers for a real ``H``, so the tile kernel would add its products with float32
atomics, one per element per tile, which hold the backward far below its products' speed
(``bench/results/linear-token-logprobs-cuda-h200.json`` measured such a kernel).  No atomics:
the gradients are the same from run to run (as deterministic as torch's own products).  Tiles
are not skipped on a small softmax (CCE's optional filter): every gradient is the exact formula.
Row blocks with no row to compute read nothing and write zeros.

The matrix products use the inputs' dtype on tensor cores (the gradient tile
``dz`` is rounded to it, as eager autograd's logits gradient would be); float32
inputs follow ``torch.backends.cuda.matmul.allow_tf32``, as ``hidden @ weight.T``
does.  Rows whose label is ``ignore_index`` or out of ``[0, V)`` read no hidden
state into a result (an ignored row gives 0 log-prob and entropy, an out-of-range one NaN)
and pass no gradient; a label is never an address.  Any strides for ``hidden`` and
``weight`` (a tied embedding, a transposed or sliced tensor is read in place), int64
addressing throughout.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..._sampling import NO_TRUNCATION, Truncation
from .. import _head_plan
from . import _gemm_head as gemm
from ._dtypes import _INTERPRETED, _bf16_round_to_nearest_even, compute_dtype, result_dtype, scalar, split_scalar
from ._eager import call, custom_op, with_autograd
from ._gemm_head import _head_grad_kernel, _head_stats_kernel, _tanh  # noqa: F401  (bench.static finds its kernels here)
from ._launch import DEVICES, check_same_device, check_shape, device_guard, not_differentiable
from ._truncation import thresholds

SUPPORTED = {"linear_token_logprobs": DEVICES}

# The head's design: "gemm" (cuBLAS products over chunks of rows, the row work in one Triton kernel:
# ``_gemm_head``), "tiles" (this module's tile-fused kernels) or "epilogue" (the forward as one grouped
# GEMM in the tile kernel with the row work in its epilogue, no logits written; truncated calls, whose
# thresholds need whole rows, and the backward are gemm's).  "gemm" until a GPU measurement (``python -m
# bench head_tiles``) says otherwise: its roofline prediction is the better one at the efficiency the tile
# kernels have been measured at (``python -m bench head_model``, which gives the efficiency at which the
# epilogue's forward would win; the tiles re-read hidden from HBM for every tile).
DESIGNS = ("gemm", "tiles", "epilogue")
DESIGN = "gemm"

# (BLOCK_N, BLOCK_V, BLOCK_H, num_warps) per pass and input dtype: the largest tiles that
# compile for sm_90 without register spills (checked in the SASS with triton 3.6, 3.8 and 3.9;
# float32's entries are for TF32 products; IEEE ones take _IEEE_FLOAT32_CONFIG); not timed on a GPU yet.
_FORWARD_CONFIG = {
    torch.bfloat16: (128, 128, 32, 8),
    torch.float16: (128, 128, 32, 8),
    torch.float32: (64, 128, 32, 8),
    torch.float64: (32, 64, 16, 4),
}
_BACKWARD_CONFIG = {
    torch.bfloat16: (64, 128, 32, 8),
    torch.float16: (64, 128, 32, 8),
    torch.float32: (64, 128, 16, 8),
    torch.float64: (32, 64, 16, 4),
}
# IEEE float32 products (torch's default, TF32 off) need more registers than TF32 ones: smaller tiles
# (triton 3.9 holds the forward with a bias, soft-cap and entropy to 128 registers: 32 columns).
_IEEE_FLOAT32_CONFIG = {"forward": (32, 32, 16, 4), "backward": (32, 64, 16, 4)}
_NUM_STAGES = 3


class Launch(NamedTuple):
    """A tile kernel's pipeline stages and its grid's grouping (0: none, two axes)."""

    stages: int
    group: int


# The "epilogue" design's forward: the tile kernel as one grouped GEMM, a program a row block and
# EPILOGUE_COLUMNS of the vocabulary (whole tiles; 16 bytes a row of partials a program: at 256 columns
# 3.1% of bf16 logits' bytes), GROUP row blocks sweeping the vocabulary together.  BLOCK_H 64, not the
# tile design's 32, whose loads the one GPU run found latency-bound.  Chosen without a GPU (no spills in
# its sm_90 code: bench static); python -m bench head_tiles times it and its neighbours on one.
_EPILOGUE_CONFIG = {dtype: (_head_plan.EPILOGUE_ROWS, 128, 64, 8) for dtype in (torch.bfloat16, torch.float16)}
EPILOGUE_LAUNCH = Launch(stages=3, group=_head_plan.EPILOGUE_GROUP)
EPILOGUE_COLUMNS = _head_plan.EPILOGUE_COLUMNS  # bench head_model's, as the group and the rows


def epilogue_launch(dtype: torch.dtype) -> tuple[tuple[int, int, int, int], Launch]:
    """The "epilogue" forward's ``(BLOCK_N, BLOCK_V, BLOCK_H, num_warps)`` and ``Launch`` for ``dtype``
    (the tile forward's tiles for 32- and 64-bit inputs)."""
    return _EPILOGUE_CONFIG.get(dtype) or _tiles("forward", dtype), EPILOGUE_LAUNCH


# At most this much of the logits' gradient at once: larger heads run the backward in vocabulary chunks.
# (2048 columns of 16k bf16 rows; the backward by its size: python -m bench head_tiles on a GPU)
GRADIENT_SCRATCH_BYTES = 64 << 20
# At most this much scratch for the logits of the rows whose truncation thresholds are found at once.
LOGITS_SCRATCH_BYTES = 256 << 20


@triton.jit
def _operand(x):
    """A loaded tile as a ``tl.dot`` operand: as is, except bf16 under the interpreter,
    whose bf16 products are wrong (it is exactly widened to float32 there)."""
    if _INTERPRETED and x.dtype == tl.bfloat16:
        x = x.to(tl.float32)
    return x


@triton.jit
def _rounded_operand(x, dtype: tl.constexpr):
    """A computed float32 tile rounded to ``dtype`` (the inputs' type) for ``tl.dot``;
    under the interpreter bf16 is rounded by hand and kept as float32 (see ``_operand``)."""
    if _INTERPRETED and dtype == tl.bfloat16:
        out = _bf16_round_to_nearest_even(x).to(tl.float32)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def _row_labels(labels_ptr, rows, labels_stride, n_rows, vocab, ignore_index):
    """Each row's label (int64), whether it is a row not ignored, and whether it is one to compute."""
    in_rows = rows < n_rows
    label = tl.load(labels_ptr + rows * labels_stride, mask=in_rows, other=0).to(tl.int64)
    valid = in_rows & (label != ignore_index)
    return label, valid, valid & (label >= 0) & (label < vocab)


@triton.jit
def _raw_logits(
    hidden_ptr, weight_ptr, bias_ptr, rows, cols, row_ok, col_ok, hidden_size,
    hidden_row_stride, hidden_col_stride, weight_row_stride, weight_col_stride, bias_stride,
    HAS_BIAS: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """``hidden[rows] @ weight[cols].T + bias[cols]`` as a ``[BLOCK_N, BLOCK_V]`` tile in ``ACC``
    (rows not to compute read nothing and hold the bias alone)."""
    ks = tl.arange(0, BLOCK_H).to(tl.int64)
    hidden_ptrs = hidden_ptr + rows[:, None] * hidden_row_stride + ks[None, :] * hidden_col_stride
    weight_ptrs = weight_ptr + cols[None, :] * weight_row_stride + ks[:, None] * weight_col_stride
    hidden_step = tl.full([], BLOCK_H, tl.int64) * hidden_col_stride
    weight_step = tl.full([], BLOCK_H, tl.int64) * weight_col_stride
    acc = tl.zeros([BLOCK_N, BLOCK_V], ACC)
    for k in range(0, hidden_size, BLOCK_H):
        k_ok = (k + ks) < hidden_size
        h = tl.load(hidden_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(weight_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(_operand(h), _operand(w), acc, input_precision=DOT_PRECISION, out_dtype=ACC)
        hidden_ptrs += hidden_step
        weight_ptrs += weight_step
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * bias_stride, mask=col_ok, other=0.0).to(ACC)[None, :]
    return acc


@triton.jit
def _grouped(pid, n_rows, vocab, vocab_per_split, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """``(row block, share)`` of program ``pid`` on a one-axis grid: ``GROUP`` row blocks (fewer in the
    last group) take the vocabulary's shares together, share by share, so that the programs in flight
    read the same few rows and weight tiles (from L2, as a grouped GEMM's tiles)."""
    shares = tl.cdiv(vocab, vocab_per_split)
    per_group = GROUP * shares
    first = (pid // per_group) * GROUP
    size = tl.minimum(tl.cdiv(n_rows, BLOCK_N) - first, GROUP)
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def _linear_token_logprobs_fwd_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, logp_ptr, entropy_ptr, stats_ptr, tau_ptr, partial_ptr,
    n_rows, vocab, hidden_size, vocab_per_split,
    hidden_row_stride, hidden_col_stride, weight_row_stride, weight_col_stride, bias_stride, labels_stride,
    logit_scale, logit_scale_lo, logit_softcap, logit_softcap_lo, inv_temperature, inv_temperature_lo, ignore_index,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, RETURN_ENTROPY: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, TRUNCATED: tl.constexpr = False,
    SPLIT: tl.constexpr = False, GROUP: tl.constexpr = 0,
):  # fmt: skip
    """A block of rows over the vocabulary; with ``SPLIT``, over its ``program_id(1)``-th share of
    ``vocab_per_split`` columns, whose running max, sum, entropy sum and chosen logit go to
    ``partial [splits, N, 4]`` for ``_combine_kernel``; with ``GROUP`` (and ``SPLIT``) on one grid axis,
    ``_grouped``'s order."""
    block, share = tl.program_id(0), tl.program_id(1)
    if GROUP > 0:
        block, share = _grouped(tl.program_id(0), n_rows, vocab, vocab_per_split, BLOCK_N, GROUP)
    rows = block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    label, valid, row_ok = _row_labels(labels_ptr, rows, labels_stride, n_rows, vocab, ignore_index)
    tau = tl.full([BLOCK_N], float("-inf"), ACC)
    if TRUNCATED:  # each row's threshold on u (``_truncation``): the tokens below it are -inf
        tau = tl.load(tau_ptr + rows, mask=row_ok, other=float("-inf")).to(ACC)
    inv_t = scalar(inv_temperature, inv_temperature_lo, ACC)
    cap = scalar(logit_softcap, logit_softcap_lo, ACC)
    # z = u * post with u = tanh(raw * scale / cap), post = cap / T, or u = raw, post = scale / T.
    # Every z - max is formed as (u - max u) * post, a subtract then a multiply (post > 0: the
    # max of u is the max of z), in the backward too: never z - max z, whose products round
    # at z's magnitude (ulp(raw / T), large at a low temperature) and which an FMA would
    # round differently in each kernel.
    if HAS_SOFTCAP:
        pre = scalar(logit_scale, logit_scale_lo, ACC) / cap
        post = cap * inv_t
    else:
        post = scalar(logit_scale, logit_scale_lo, ACC) * inv_t
    cols0 = tl.arange(0, BLOCK_V).to(tl.int64)

    run_max = tl.full([BLOCK_N], float("-inf"), ACC)  # of u
    sum_exp = tl.zeros([BLOCK_N], ACC)  # sum exp(z - max z)
    weighted = tl.zeros([BLOCK_N], ACC)  # sum exp(z - max z) * (z - max z), for the entropy
    chosen = tl.zeros([BLOCK_N], ACC)  # u at the label
    vocab_start = share.to(tl.int64) * vocab_per_split  # vocab_per_split = vocab: one share
    vocab_stop = tl.minimum(vocab_start + vocab_per_split, vocab)
    # A block with no row to compute reads nothing: its loop is empty.
    vocab_stop = tl.where(tl.max(row_ok.to(tl.int32), 0) > 0, vocab_stop, vocab_start)
    for start in range(vocab_start, vocab_stop, BLOCK_V):
        cols = start + cols0
        col_ok = cols < vocab
        raw = _raw_logits(
            hidden_ptr, weight_ptr, bias_ptr, rows, cols, row_ok, col_ok, hidden_size,
            hidden_row_stride, hidden_col_stride, weight_row_stride, weight_col_stride, bias_stride,
            HAS_BIAS, ACC, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        u = _tanh(raw * pre) if HAS_SOFTCAP else raw
        u = tl.where(col_ok[None, :], u, float("-inf"))
        if TRUNCATED:
            u = tl.where(u < tau[:, None], float("-inf"), u)
        chosen += tl.sum(tl.where(cols[None, :] == label[:, None], u, 0.0), 1)
        new_max = tl.maximum(run_max, tl.max(u, 1))
        # While every u so far is -inf, shift by 0 so that -inf - -inf never appears.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        d = (u - shift[:, None]) * post
        e = tl.exp(d)
        rescale = tl.exp((run_max - shift) * post)
        if RETURN_ENTROPY:
            # -inf logits have e == 0 and contribute nothing (0 * -inf would be NaN).
            tile_weighted = tl.sum(e * tl.where(e > 0, d, 0.0), 1)
            rebase = ((tl.where(sum_exp > 0, run_max, shift) - shift) * post) * sum_exp
            weighted = rescale * (weighted + rebase) + tile_weighted
        sum_exp = sum_exp * rescale + tl.sum(e, 1)
        run_max = new_max

    in_rows = rows < n_rows
    if SPLIT:
        at = (share.to(tl.int64) * n_rows + rows) * 4  # int64 offsets, as everywhere
        tl.store(partial_ptr + at, run_max, mask=in_rows)
        tl.store(partial_ptr + (at + 1), sum_exp, mask=in_rows)
        tl.store(partial_ptr + (at + 2), weighted, mask=in_rows)
        tl.store(partial_ptr + (at + 3), chosen, mask=in_rows)
    else:
        shift = tl.where(run_max == float("-inf"), 0.0, run_max)
        sum_exp = tl.where(row_ok, sum_exp, 1.0)  # rows not computed: no log(0) or 0 / 0 to mask afterwards
        row, mean = (rows, in_rows, valid, row_ok), weighted / sum_exp
        _store_rows(logp_ptr, entropy_ptr, stats_ptr, row, shift, tl.log(sum_exp), chosen, post, mean, RETURN_ENTROPY)


@triton.jit
def _linear_logits_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, out_ptr,
    row_start, row_stop, vocab, hidden_size,
    hidden_row_stride, hidden_col_stride, weight_row_stride, weight_col_stride, bias_stride, labels_stride,
    logit_scale, logit_scale_lo, logit_softcap, logit_softcap_lo, ignore_index,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """The forward's ``u`` (the logits before ``post``) of rows ``[row_start, row_stop)``, one
    ``[BLOCK_N, BLOCK_V]`` tile a program, into ``out [row_stop - row_start, V]`` (contiguous): the
    truncation thresholds' input, formed by the forward's own tile code."""
    rows = row_start + tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    col_ok = cols < vocab
    label, valid, row_ok = _row_labels(labels_ptr, rows, labels_stride, row_stop, vocab, ignore_index)
    raw = _raw_logits(
        hidden_ptr, weight_ptr, bias_ptr, rows, cols, row_ok, col_ok, hidden_size,
        hidden_row_stride, hidden_col_stride, weight_row_stride, weight_col_stride, bias_stride,
        HAS_BIAS, ACC, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_H,
    )  # fmt: skip
    if HAS_SOFTCAP:
        pre = scalar(logit_scale, logit_scale_lo, ACC) / scalar(logit_softcap, logit_softcap_lo, ACC)
        u = _tanh(raw * pre)
    else:
        u = raw
    in_rows = rows < row_stop
    tl.store(out_ptr + (rows - row_start)[:, None] * vocab + cols[None, :], u, mask=in_rows[:, None] & col_ok[None, :])


@triton.jit
def _linear_token_logprobs_bwd_kernel(
    hidden_ptr, weight_ptr, bias_ptr, labels_ptr, stats_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
    dz_ptr, tau_ptr, power_ptr,
    n_rows, vocab, hidden_size, vocab_start, vocab_stop, dz_stride,
    hidden_row_stride, hidden_col_stride, weight_row_stride, weight_col_stride, bias_stride, labels_stride,
    grad_logp_stride, grad_entropy_stride,
    logit_scale, logit_scale_lo, logit_softcap, logit_softcap_lo, inv_temperature, inv_temperature_lo, ignore_index,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GRAD_LOGP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    ACC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, TRUNCATED: tl.constexpr = False,
    HAS_POWER: tl.constexpr = False,
):  # fmt: skip
    """One ``[BLOCK_N, BLOCK_V]`` tile of the gradient of the raw logits (``hidden @ weight.T + bias``),
    rounded to ``dz``'s dtype, into ``dz [N, vocab_stop - vocab_start]`` (row stride ``dz_stride``: this
    launch's vocabulary chunk).  Rows not to compute get 0.  Over ``scale / T`` (the host applies it
    after the products), or with ``HAS_POWER`` (float16) times it and ``power`` before the rounding."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    cols = vocab_start + tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    col_ok = cols < vocab_stop
    label, valid, row_ok = _row_labels(labels_ptr, rows, labels_stride, n_rows, vocab, ignore_index)
    draw = tl.zeros([BLOCK_N, BLOCK_V], ACC)
    # Ignored and out-of-range rows pass no gradient; a tile with none to compute reads nothing.
    if tl.max(row_ok.to(tl.int32), 0) > 0:
        inv_t = scalar(inv_temperature, inv_temperature_lo, ACC)
        scale = scalar(logit_scale, logit_scale_lo, ACC)
        raw = _raw_logits(
            hidden_ptr, weight_ptr, bias_ptr, rows, cols, row_ok, col_ok, hidden_size,
            hidden_row_stride, hidden_col_stride, weight_row_stride, weight_col_stride, bias_stride,
            HAS_BIAS, ACC, DOT_PRECISION, BLOCK_N, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        # u and post as the forward forms them, and z - max z = (u - max u) * post.
        if HAS_SOFTCAP:
            cap = scalar(logit_softcap, logit_softcap_lo, ACC)
            u = _tanh(raw * (scale / cap))
            post = cap * inv_t
            dz_draw = 1.0 - u * u  # d z / d raw over scale / T, which the host applies after the products
        else:
            u = raw
            post = scale * inv_t
        one_hot = cols[None, :] == label[:, None]
        if TRUNCATED:  # the dropped tokens as in the forward (after dz_draw, which needs their u): p = 0
            tau = tl.load(tau_ptr + rows, mask=row_ok, other=float("-inf")).to(ACC)
            one_hot = one_hot & ~(u < tau[:, None])  # a dropped label's log-prob is -inf, a constant
            u = tl.where(u < tau[:, None], float("-inf"), u)
        shift = tl.load(stats_ptr + 2 * rows, mask=row_ok, other=0.0).to(ACC)
        log_sum = tl.load(stats_ptr + (2 * rows + 1), mask=row_ok, other=0.0).to(ACC)
        # Rows not to compute have no stats: p = 0 there (no overflow to mask afterwards).
        log_p = tl.where(row_ok[:, None], (u - shift[:, None]) * post - log_sum[:, None], float("-inf"))
        p = tl.exp(log_p)
        dz = tl.zeros([BLOCK_N, BLOCK_V], ACC)
        if HAS_GRAD_LOGP:
            g_logp = tl.load(grad_logp_ptr + rows * grad_logp_stride, mask=row_ok, other=0.0).to(ACC)
            dz += g_logp[:, None] * (tl.where(one_hot, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            g_entropy = tl.load(grad_entropy_ptr + rows * grad_entropy_stride, mask=row_ok, other=0.0).to(ACC)
            entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0).to(ACC)
            # dH/dz_j = -p_j (log p_j + H), 0 where p_j == 0 (log p_j = -inf).
            dz -= g_entropy[:, None] * p * (tl.where(p > 0, log_p, 0.0) + entropy[:, None])
        if HAS_SOFTCAP:
            dz = dz * dz_draw
        if HAS_POWER:  # float16: scale / T and the power of two that keep dz in float16's normal range
            dz = dz * (scale * inv_t * tl.load(power_ptr).to(ACC))
        draw = tl.where(row_ok[:, None] & col_ok[None, :], dz, 0.0)
    tl.store(
        dz_ptr + rows[:, None] * dz_stride + (cols - vocab_start)[None, :],
        _rounded_operand(draw, dz_ptr.dtype.element_ty),
        mask=(rows < n_rows)[:, None] & col_ok[None, :],
    )


def _tiles(direction: str, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if dtype == torch.float32 and _dot_precision(dtype) == "ieee":
        return _IEEE_FLOAT32_CONFIG[direction]
    return (_FORWARD_CONFIG if direction == "forward" else _BACKWARD_CONFIG)[dtype]


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 products as ``hidden @ weight.T`` would do them (TF32 only when torch allows it)."""
    return "tf32" if dtype == torch.float32 and _tf32_allowed() else "ieee"


def _tf32_allowed() -> bool:
    """torch's TF32 switch for float32 matmuls: the ``fp32_precision`` API's setting where it has one
    (reading the legacy ``allow_tf32`` raises once that API set "tf32", as transformers' ``tf32=True``
    does), else the legacy flag."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", "none")
    return precision == "tf32" if precision != "none" else bool(matmul.allow_tf32)


def _check_inputs(hidden, weight, labels, bias) -> tuple[int, int, int]:
    """``(N, V, H)``, after the checks that keep every read inside the tensors."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got shapes {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.dtype not in _FORWARD_CONFIG:
        raise TypeError(f"hidden must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    (n_rows, hidden_size), vocab = hidden.shape, weight.shape[0]
    check_shape("weight", weight, (vocab, hidden_size))
    check_shape("bias", bias, (vocab,))
    if labels.dim() != 1 or labels.shape[0] != n_rows:
        raise ValueError(f"labels must have shape ({n_rows},) (hidden's rows), got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must have an integer dtype, got {labels.dtype}")
    for name, x in (("weight", weight), ("bias", bias)):
        if x is not None and x.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {hidden.dtype}, got {x.dtype}")
    check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    return n_rows, vocab, hidden_size


def _scalars(temperature: float, logit_scale: float, logit_softcap: float | None) -> tuple[float, ...]:
    """The float hyper-parameters as the kernels' ``(hi, lo)`` pairs (see ``_dtypes.split_scalar``)."""
    return (*split_scalar(logit_scale), *split_scalar(logit_softcap or 1.0), *split_scalar(1.0 / temperature))


def linear_token_logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    temperature: float,
    logit_scale: float,
    logit_softcap: float | None,
    ignore_index: int,
    return_entropy: bool,
    blocks: tuple[int, int, int] | None = None,
    tau: torch.Tensor | None = None,
    grouped: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logp [N], entropy [N] or None, stats [N, 2])`` for ``hidden [N, H]``, ``weight [V, H]``,
    ``labels [N]`` (any integer dtype), ``bias [V]`` or None, all of any strides;
    float32 (float64 for float64 inputs, computed in float64).  ``stats`` holds, for the
    backward, each row's max of the logits before the temperature and the scale (of the
    softcap's tanh with one) and ``log(sum(exp(z - max z)))`` (0 for rows that are ignored
    or out of range: they read nothing).  ``blocks = (BLOCK_N, BLOCK_V, BLOCK_H)`` overrides the tile
    sizes (each >= 16; tests use small ones to cross tile boundaries).  ``tau [N]`` (from
    :func:`linear_truncation_thresholds`): the softmax over each row's tokens with ``u >= tau`` only.
    ``grouped``: the "epilogue" design's launch (``_forward_launch``)."""
    n_rows, vocab, hidden_size = _check_inputs(hidden, weight, labels, bias)
    dtype = result_dtype(hidden, weight, bias)
    logp = torch.empty(n_rows, dtype=dtype, device=hidden.device)
    stats = logp.new_empty((n_rows, 2))
    entropy = torch.empty_like(logp) if return_entropy else None
    if n_rows == 0:
        return logp, entropy, stats
    if vocab == 0:
        raise ValueError("weight must have a non-empty vocabulary dim")
    acc = compute_dtype(dtype)
    tiles, launch, (splits, vocab_per_split) = _forward_launch(hidden, vocab, blocks, grouped)
    block_n, block_v, block_h, num_warps = tiles
    split = grouped or splits > 1
    partial = logp.new_empty((splits, n_rows, 4)) if split else logp
    grid = (triton.cdiv(n_rows, block_n) * splits, 1) if grouped else (triton.cdiv(n_rows, block_n), splits)
    with device_guard(hidden):
        _linear_token_logprobs_fwd_kernel[grid](
            hidden,
            weight,
            weight if bias is None else bias,
            labels,
            logp,
            logp if entropy is None else entropy,
            stats,
            logp if tau is None else tau,
            partial,
            n_rows,
            vocab,
            hidden_size,
            vocab_per_split,
            hidden.stride(0),
            hidden.stride(1),
            weight.stride(0),
            weight.stride(1),
            0 if bias is None else bias.stride(0),
            labels.stride(0),
            *_scalars(temperature, logit_scale, logit_softcap),
            ignore_index,
            HAS_BIAS=bias is not None,
            HAS_SOFTCAP=logit_softcap is not None,
            RETURN_ENTROPY=return_entropy,
            ACC=acc,
            DOT_PRECISION=_dot_precision(hidden.dtype),
            BLOCK_N=block_n,
            BLOCK_V=block_v,
            BLOCK_H=block_h,
            TRUNCATED=tau is not None,
            SPLIT=split,
            GROUP=launch.group,
            num_warps=num_warps,
            num_stages=launch.stages,
        )
    post = _post(temperature, logit_scale, logit_softcap, logp.dtype)
    if split:
        return _combine_splits(partial, labels, vocab, ignore_index, post, return_entropy)
    return _overflow_is_nan(logp, entropy, stats, post)


def _forward_launch(hidden: torch.Tensor, vocab: int, blocks, grouped: bool) -> tuple:
    """The forward's ``(tiles, Launch, (splits, vocab_per_split))``: the "epilogue" design's (``grouped``:
    ``EPILOGUE_COLUMNS`` a share), else the tile design's (the shares ``_vocab_splits`` fills a GPU with)."""
    if grouped:
        tiles, launch = epilogue_launch(hidden.dtype)
        per_split = triton.cdiv(EPILOGUE_COLUMNS, tiles[1]) * tiles[1]
        return tiles, launch, (triton.cdiv(vocab, per_split), per_split)
    tiles = _tiles("forward", hidden.dtype) if blocks is None else (*blocks, 4)
    return tiles, Launch(_NUM_STAGES, 0), _vocab_splits(hidden.shape[0], vocab, *tiles[:2], hidden.device)


def _overflow_is_nan(logp, entropy, stats, post: float) -> tuple:
    """A row whose max z = max u * post overflows is NaN, as in the reference (the kernel's shifted pass
    never forms it); marked from the stats (whose max is 0 for rows not computed), not in the kernel,
    whose registers are spoken for."""
    overflow = ~((stats[:, 0] * post).abs() < math.inf)
    stats[:, 1] = torch.where(overflow, math.nan, stats[:, 1])
    nan_where = lambda x: None if x is None else torch.where(overflow, math.nan, x)  # noqa: E731
    return nan_where(logp), nan_where(entropy), stats


# Splits of the vocabulary the forward uses when its row blocks alone leave multiprocessors idle
# (None: as the device has them; tests set it to cross the splits under the interpreter).
FORWARD_SPLITS: int | None = None
SM90_MULTIPROCESSORS = 132  # the H100's and H200's: what meta tensors (bench static) are sized for


def _vocab_splits(n_rows: int, vocab: int, block_n: int, block_v: int, device: torch.device) -> tuple[int, int]:
    """``(splits, vocab_per_split)``: as many vocabulary shares per row block as keep the grid within
    one wave of the device's multiprocessors (one program each), at most one per vocabulary tile."""
    row_blocks, tiles = triton.cdiv(n_rows, block_n), triton.cdiv(vocab, block_v)
    if FORWARD_SPLITS is not None:
        wanted = FORWARD_SPLITS
    elif device.type == "cuda":
        wanted = torch.cuda.get_device_properties(device).multi_processor_count // row_blocks
    else:  # the interpreter has no multiprocessors to fill; meta tensors stand for an sm_90 GPU
        wanted = SM90_MULTIPROCESSORS // row_blocks if device.type == "meta" else 1
    per_split = triton.cdiv(tiles, max(1, min(wanted, tiles))) * block_v
    return triton.cdiv(vocab, per_split), per_split


def _rows_to_compute(labels: torch.Tensor, vocab: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, row_ok)`` per row, as the kernels' ``_row_labels``: not ignored, and also a label in
    ``[0, V)`` (a row the head computes)."""
    valid = labels != ignore_index
    return valid, valid & (labels >= 0) & (labels < vocab)


def _post(temperature: float, logit_scale: float, logit_softcap: float | None, dtype: torch.dtype) -> float:
    """The kernels' ``post`` (``z - max z = (u - max u) * post``), rounded as they form it in ``dtype``."""
    factor = logit_scale if logit_softcap is None else logit_softcap
    as_dtype = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731  (on the host: no device sync)
    return (as_dtype(factor) * as_dtype(1.0 / temperature)).item()


def _combine_splits(partial, labels, vocab: int, ignore_index: int, post: float, return_entropy: bool) -> tuple:
    """The forward's results ``(logp, entropy or None, stats)`` from its splits' ``partial [splits, N, 4]``
    (``_combine_kernel``; ``post``: ``_post``'s)."""
    n_rows = partial.shape[1]
    logp = partial.new_empty(n_rows)
    entropy = torch.empty_like(logp) if return_entropy else None
    stats = logp.new_empty((n_rows, 2))
    acc = tl.float64 if partial.dtype == torch.float64 else tl.float32
    with device_guard(partial):
        _combine_kernel[(triton.cdiv(n_rows, COMBINE_ROWS),)](
            partial,
            labels,
            logp,
            logp if entropy is None else entropy,
            stats,
            n_rows,
            partial.shape[0],
            vocab,
            labels.stride(0),
            ignore_index,
            *split_scalar(post),
            RETURN_ENTROPY=return_entropy,
            ACC=acc,
            BLOCK=COMBINE_ROWS,
        )
    return logp, entropy, stats


COMBINE_ROWS = 128  # rows a program of _combine_kernel


@triton.jit
def _combine_kernel(
    partial_ptr,
    labels_ptr,
    logp_ptr,
    entropy_ptr,
    stats_ptr,
    n_rows,
    splits,
    vocab,
    labels_stride,
    ignore_index,
    post_hi,
    post_lo,
    RETURN_ENTROPY: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each row's ``(max u, sum exp, sum exp * (z - max z), chosen u)`` over the splits, each share rebased
    to the row's max as the forward's loop rebases its tiles: its max first, then the sums.  A share
    with nothing (sum 0: every logit -inf) adds nothing; a NaN anywhere stays NaN."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    in_rows = rows < n_rows
    label, valid, row_ok = _row_labels(labels_ptr, rows, labels_stride, n_rows, vocab, ignore_index)
    post = scalar(post_hi, post_lo, ACC)  # the forward kernel's, as _post rounds it
    step = tl.cast(n_rows, tl.int64) * 4  # from a split's rows to the next split's (int64 offsets)
    at = rows * 4
    top = tl.full([BLOCK], float("-inf"), ACC)
    for _ in range(0, splits):
        top = tl.maximum(top, tl.load(partial_ptr + at, mask=in_rows, other=0.0), propagate_nan=tl.PropagateNan.ALL)
        at += step
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([BLOCK], ACC)
    weighted = tl.zeros([BLOCK], ACC)
    chosen = tl.zeros([BLOCK], ACC)
    at = rows * 4
    for _ in range(0, splits):
        run_max = tl.load(partial_ptr + at, mask=in_rows, other=0.0)
        sum_exp = tl.load(partial_ptr + (at + 1), mask=in_rows, other=0.0)
        chosen += tl.load(partial_ptr + (at + 3), mask=in_rows, other=0.0)
        empty = sum_exp == 0
        delta = (tl.where(run_max == float("-inf"), 0.0, run_max) - shift) * post
        rescale = tl.exp(tl.where(empty, 0.0, delta))
        total += tl.where(empty, 0.0, rescale * sum_exp)
        if RETURN_ENTROPY:
            share = tl.load(partial_ptr + (at + 2), mask=in_rows, other=0.0)
            weighted += tl.where(empty, 0.0, rescale * (share + delta * sum_exp))
        at += step
    total = tl.where(row_ok, total, 1.0)
    log_sum = tl.where(tl.abs(top * post) < float("inf"), tl.log(total), float("nan"))
    row = (rows, in_rows, valid, row_ok)
    _store_rows(logp_ptr, entropy_ptr, stats_ptr, row, shift, log_sum, chosen, post, weighted / total, RETURN_ENTROPY)


@triton.jit
def _store_rows(
    logp_ptr, entropy_ptr, stats_ptr, row, shift, log_sum, chosen, post, mean, RETURN_ENTROPY: tl.constexpr
):
    """The rows' log-prob, stats ``(max u, log-sum)`` and entropy (``mean``: the softmax's mean of ``z - max z``):
    0 at rows ignored, NaN at rows not computed (a label out of range); ``row = (rows, in_rows, valid, row_ok)``."""
    rows, in_rows, valid, row_ok = row
    logp = tl.where(row_ok, (chosen - shift) * post - log_sum, float("nan"))
    tl.store(logp_ptr + rows, tl.where(valid, logp, 0.0), mask=in_rows)
    tl.store(stats_ptr + 2 * rows, tl.where(row_ok, shift, 0.0), mask=in_rows)
    tl.store(stats_ptr + (2 * rows + 1), tl.where(row_ok, log_sum, 0.0), mask=in_rows)
    if RETURN_ENTROPY:
        entropy = tl.where(row_ok, log_sum - mean, float("nan"))
        tl.store(entropy_ptr + rows, tl.where(valid, entropy, 0.0), mask=in_rows)


def linear_logits_rows(hidden, weight, labels, bias, start, stop, *, logit_scale, logit_softcap, ignore_index):
    """The forward's ``u`` of rows ``[start, stop)``, ``[stop - start, V]`` in the compute dtype (rows not to
    compute hold the bias alone), by the forward's tiles (``_linear_logits_kernel``)."""
    dtype = result_dtype(hidden, weight, bias)
    vocab, hidden_size = weight.shape
    u = torch.empty(
        (stop - start, vocab), dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=hidden.device
    )
    block_n, block_v, block_h, num_warps = _tiles("forward", hidden.dtype)
    _linear_logits_kernel[(triton.cdiv(stop - start, block_n), triton.cdiv(vocab, block_v))](
        hidden,
        weight,
        weight if bias is None else bias,
        labels,
        u,
        start,
        stop,
        vocab,
        hidden_size,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        0 if bias is None else bias.stride(0),
        labels.stride(0),
        *_scalars(1.0, logit_scale, logit_softcap)[:4],
        ignore_index,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=logit_softcap is not None,
        ACC=compute_dtype(dtype),
        DOT_PRECISION=_dot_precision(hidden.dtype),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCK_H=block_h,
        num_warps=num_warps,
        num_stages=_NUM_STAGES,
    )
    return u


def linear_truncation_thresholds(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    temperature: float,
    logit_scale: float,
    logit_softcap: float | None,
    ignore_index: int,
    truncation: Truncation,
    scratch_bytes: int | None = None,
) -> torch.Tensor:
    """Each row's threshold on ``u`` (``tau [N]`` in the compute dtype, ``-inf``: not truncated).

    The logits are needed whole per row: they are formed again (one more matrix product than the
    forward alone) by the forward's tile code, a chunk of rows at a time into a scratch of at most
    ``scratch_bytes`` (default ``LOGITS_SCRATCH_BYTES``; never ``[N, V]``), and the thresholds found
    there (``_truncation``), each halfway to the row's next lower value so that the forward's and the
    backward's own products (other tiles, other rounding) keep the same tokens."""
    n_rows, vocab, _ = _check_inputs(hidden, weight, labels, bias)
    acc_dtype = torch.float64 if result_dtype(hidden, weight, bias) == torch.float64 else torch.float32
    tau = torch.empty(n_rows, dtype=acc_dtype, device=hidden.device)
    block_n = _tiles("forward", hidden.dtype)[0]
    chunk = max(block_n, (scratch_bytes or LOGITS_SCRATCH_BYTES) // (vocab * acc_dtype.itemsize) // block_n * block_n)
    post = (logit_softcap if logit_softcap is not None else logit_scale) / temperature
    with device_guard(hidden):
        for start in range(0, n_rows, chunk):
            stop = min(n_rows, start + chunk)
            u = linear_logits_rows(
                hidden,
                weight,
                labels,
                bias,
                start,
                stop,
                logit_scale=logit_scale,
                logit_softcap=logit_softcap,
                ignore_index=ignore_index,
            )
            tau[start:stop] = thresholds(
                u,
                labels[start:stop],
                (1, vocab, 0, 1),
                (labels.stride(0), 0),
                post,
                ignore_index,
                truncation=truncation,
                acc_dtype=acc_dtype,
                midpoint=True,
                input_dtype=acc_dtype,
            )
    return tau


def _check_saved(hidden, n_rows, stats, entropy, grad_logprobs, grad_entropy):
    """The backward's inputs from the forward and autograd: devices and shapes."""
    check_same_device(
        hidden=hidden, stats=stats, entropy=entropy, grad_logprobs=grad_logprobs, grad_entropy=grad_entropy
    )
    check_shape("stats", stats, (n_rows, 2))
    for name, x in (("entropy", entropy), ("grad_logprobs", grad_logprobs), ("grad_entropy", grad_entropy)):
        check_shape(name, x, (n_rows,))
    if grad_entropy is not None and entropy is None:
        raise ValueError("the entropy gradient needs the forward's entropy")


def _saved_thresholds(hidden: torch.Tensor, n_rows: int, tau: torch.Tensor | None) -> torch.Tensor | None:
    """The forward's ``tau [N]`` as the backward reads it (contiguous), or None: not truncated."""
    if tau is None:
        return None
    check_same_device(hidden=hidden, tau=tau)
    check_shape("tau", tau, (n_rows,))
    return tau.contiguous()


def linear_token_logprobs_backward(
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    stats: torch.Tensor,
    entropy: torch.Tensor | None,
    temperature: float,
    logit_scale: float,
    logit_softcap: float | None,
    ignore_index: int,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
    blocks: tuple[int, int, int] | None = None,
    scratch_bytes: int | None = None,
    tau: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(d_hidden, d_weight, d_bias)``, each in its input's dtype, contiguous, or None where not needed.
    ``stats`` (and ``entropy``, needed with ``grad_entropy``) come from the forward; ``grad_logprobs`` /
    ``grad_entropy`` ``[N]``, any strides, None for an unused output; ``scratch_bytes`` bounds the logits'
    gradient held at once (default ``GRADIENT_SCRATCH_BYTES``)."""
    n_rows, vocab, hidden_size = _check_inputs(hidden, weight, labels, bias)
    _check_saved(hidden, n_rows, stats, entropy, grad_logprobs, grad_entropy)
    tau = _saved_thresholds(hidden, n_rows, tau)  # the forward's truncation thresholds, or None
    needs_bias = needs_bias and bias is not None
    acc = compute_dtype(result_dtype(hidden, weight, bias))
    acc_dtype = torch.float64 if acc == tl.float64 else torch.float32
    device = hidden.device  # sums in the compute dtype; bf16/fp16 results are cast from them
    d_hidden = torch.zeros((n_rows, hidden_size), dtype=acc_dtype, device=device) if needs_hidden else None
    d_bias = torch.zeros(vocab, dtype=acc_dtype, device=device) if needs_bias else None
    has_work = n_rows > 0 and (grad_logprobs is not None or grad_entropy is not None)  # else no [V, H] fill
    d_weight = (weight.new_empty if has_work else weight.new_zeros)((vocab, hidden_size)) if needs_weight else None
    if has_work and (needs_hidden or needs_weight or needs_bias):
        block_n, block_v, block_h, num_warps = _tiles("backward", hidden.dtype) if blocks is None else (*blocks, 4)
        # The logits' gradient in the products' dtype (the inputs', bf16 rounded as eager autograd's would
        # be), a vocabulary chunk of every row at a time.
        dz = torch.empty(
            (n_rows, _gradient_chunk(n_rows, vocab, block_v, hidden.element_size(), scratch_bytes)),
            dtype=hidden.dtype,
            device=device,
        )
        # d_weight's products read every row: one not to compute counts as zeros, whatever it holds.
        used = _rows_to_compute(labels, vocab, ignore_index)[1]
        grads = (grad_logprobs, grad_entropy)
        power, factor = _gradient_factor(hidden.dtype, used, grads, temperature, logit_scale, vocab)
        hidden_used = torch.where(used[:, None], hidden, 0.0) if needs_weight else None
        stats, entropy = stats.contiguous(), stats if entropy is None else entropy.contiguous()
        with device_guard(hidden):
            for start in range(0, vocab, dz.shape[1]):
                stop = min(vocab, start + dz.shape[1])
                _linear_token_logprobs_bwd_kernel[(triton.cdiv(n_rows, block_n), triton.cdiv(stop - start, block_v))](
                    hidden, weight, weight if bias is None else bias, labels, stats, entropy,
                    stats if grad_logprobs is None else grad_logprobs, stats if grad_entropy is None else grad_entropy,
                    dz, stats if tau is None else tau, stats if power is None else power,
                    n_rows, vocab, hidden_size, start, stop, dz.stride(0),
                    hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), 0 if bias is None else bias.stride(0),
                    labels.stride(0), 0 if grad_logprobs is None else grad_logprobs.stride(0), 0 if grad_entropy is None else grad_entropy.stride(0),
                    *_scalars(temperature, logit_scale, logit_softcap), ignore_index,
                    HAS_BIAS=bias is not None, HAS_SOFTCAP=logit_softcap is not None,
                    HAS_GRAD_LOGP=grad_logprobs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
                    ACC=acc, DOT_PRECISION=_dot_precision(hidden.dtype), TRUNCATED=tau is not None,
                    HAS_POWER=power is not None,
                    BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, num_warps=num_warps, num_stages=_NUM_STAGES,
                )  # fmt: skip
                chunk = dz[:, : stop - start]  # d loss / d raw, over scale / T
                if needs_hidden:
                    d_hidden += _product(chunk, weight[start:stop], acc_dtype)
                if needs_weight:  # scaled in the product's float32 buffer, before it is rounded
                    d_weight[start:stop] = _product(chunk.T, hidden_used, acc_dtype).mul_(factor)
                if needs_bias:
                    d_bias[start:stop] = chunk.sum(0, dtype=acc_dtype).mul_(factor)
        if needs_hidden:  # a non-finite weight row times a zero gradient is NaN: no gradient is 0
            d_hidden.mul_(factor).masked_fill_(~used[:, None], 0.0)
    cast = lambda x, like: None if x is None else x.to(like.dtype)  # noqa: E731
    return cast(d_hidden, hidden), d_weight, cast(d_bias, bias)


def _gemm_backward(grad_logprobs, grad_entropy, hidden, weight, labels, bias, *, stats, entropy, tau=None, **options):
    """The GEMM-first design's backward (``_gemm_head.backward``), with the tile backward's checks."""
    n_rows = _check_inputs(hidden, weight, labels, bias)[0]
    _check_saved(hidden, n_rows, stats, entropy, grad_logprobs, grad_entropy)
    tau = _saved_thresholds(hidden, n_rows, tau)
    needs = (options["needs_hidden"], options["needs_weight"], options["needs_bias"] and bias is not None)
    head = gemm.constants(options["temperature"], options["logit_scale"], options["logit_softcap"])
    saved = (stats.contiguous(), None if entropy is None else entropy.contiguous(), tau)
    with device_guard(hidden):
        return gemm.backward(
            (grad_logprobs, grad_entropy),
            hidden,
            weight,
            labels,
            bias,
            head,
            saved=saved,
            ignore_index=options["ignore_index"],
            needs=needs,
        )


def _gradient_factor(dtype, used, grads, temperature: float, logit_scale: float, vocab: int) -> tuple:
    """``(power or None, factor)``: what the products' results are multiplied by, ``scale / T`` as the
    kernels round it, or for float16 the inverse of the power of two the kernel applies with it."""
    factor = _post(temperature, logit_scale, None, torch.float64 if dtype == torch.float64 else torch.float32)
    power, inverse = gemm.power_of_two(dtype, used, grads, factor, vocab)
    return power, factor if inverse is None else inverse


def _gradient_chunk(n_rows: int, vocab: int, block_v: int, element_size: int, scratch_bytes: int | None) -> int:
    """The vocabulary columns of the logits' gradient held at once: as many whole tiles as
    ``scratch_bytes`` (default ``GRADIENT_SCRATCH_BYTES``) holds for every row, at least one tile."""
    columns = (scratch_bytes or GRADIENT_SCRATCH_BYTES) // (element_size * max(1, n_rows))
    return min(triton.cdiv(vocab, block_v) * block_v, max(block_v, columns // block_v * block_v))


def _product(a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``acc_dtype``: bf16/fp16 products summed in float32 (cuBLAS's ``out_dtype`` on
    CUDA; widened first elsewhere, which is exact), float32 as torch's TF32 switch says."""
    if a.dtype == acc_dtype:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=acc_dtype)
    return a.to(acc_dtype) @ b.to(acc_dtype)


# --------------------------------------------------------------------------- torch custom op and autograd


@custom_op("ppo_fast_triton::linear_token_logprobs", mutates_args=())
def _linear_token_logprobs_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    logit_scale: float,
    logit_softcap: float | None,
    return_entropy: bool,
    ignore_index: int,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    design: str = "gemm",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, stats, tau)``; entropy is empty without ``return_entropy``; ``stats`` and, under the
    sampler's truncation, ``tau [N]`` (each row's threshold) are for the backward; ``design``: ``DESIGNS``."""
    options = dict(temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap)
    truncation = Truncation(top_k, top_p, min_p)
    tau = None
    if design == "gemm":
        _check_inputs(hidden, weight, labels, bias)
        with device_guard(hidden):
            logp, entropy, stats, tau = gemm.forward(
                hidden,
                weight,
                labels,
                bias,
                gemm.constants(**options),
                ignore_index=ignore_index,
                return_entropy=return_entropy,
                truncation=truncation,
            )
        logp, entropy, stats = _overflow_is_nan(logp, entropy, stats, _post(**options, dtype=logp.dtype))
    elif truncation.active:
        tau = linear_truncation_thresholds(
            hidden, weight, labels, bias, **options, ignore_index=ignore_index, truncation=truncation
        )
    if design != "gemm":
        logp, entropy, stats = linear_token_logprobs_forward(
            hidden,
            weight,
            labels,
            bias,
            **options,
            ignore_index=ignore_index,
            return_entropy=return_entropy,
            tau=tau,
            grouped=design == "epilogue",
        )
    # An output of a custom op aliases no other: an empty tensor each for what is not computed.
    entropy = entropy if return_entropy else logp.new_empty(0)
    return logp, entropy, stats, (logp.new_empty(0) if tau is None else tau)


@_linear_token_logprobs_op.register_fake
def _(hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index, top_k=0,
      top_p=1.0, min_p=0.0, design="gemm"):  # fmt: skip
    logp = hidden.new_empty(hidden.shape[:1], dtype=result_dtype(hidden, weight, bias))
    entropy = logp.new_empty(logp.shape if return_entropy else (0,))
    tau = logp.new_empty(logp.shape if Truncation(top_k, top_p, min_p).active else (0,))
    return logp, entropy, logp.new_empty(logp.shape + (2,)), tau


@custom_op("ppo_fast_triton::linear_token_logprobs_backward", mutates_args=())
def _linear_token_logprobs_backward_op(
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    temperature: float,
    logit_scale: float,
    logit_softcap: float | None,
    ignore_index: int,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
    tau: torch.Tensor | None = None,
    design: str = "gemm",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_hidden, d_weight, d_bias)``, each empty where not needed."""
    backward = linear_token_logprobs_backward if design == "tiles" else _gemm_backward
    grads = backward(
        grad_logprobs,
        grad_entropy,
        hidden,
        weight,
        labels,
        bias,
        stats=stats,
        entropy=entropy if grad_entropy is not None else None,
        temperature=temperature,
        logit_scale=logit_scale,
        logit_softcap=logit_softcap,
        ignore_index=ignore_index,
        needs_hidden=needs_hidden,
        needs_weight=needs_weight,
        needs_bias=needs_bias,
        tau=tau,
    )
    return tuple(
        stats.new_empty(0, dtype=like.dtype) if g is None else g for g, like in zip(grads, (hidden, weight, weight))
    )


@_linear_token_logprobs_backward_op.register_fake
def _(grad_logprobs, grad_entropy, hidden, weight, labels, bias, stats, entropy, temperature, logit_scale, logit_softcap, ignore_index,
      needs_hidden, needs_weight, needs_bias, tau=None, design="gemm"):  # fmt: skip
    needs_bias = needs_bias and bias is not None
    return (
        hidden.new_empty(hidden.shape if needs_hidden else (0,)),
        weight.new_empty(weight.shape if needs_weight else (0,)),
        weight.new_empty(weight.shape[:1] if needs_bias else (0,)),
    )


def _linear_token_logprobs_setup(ctx, inputs, output):
    hidden, weight, labels, bias = inputs[:4]
    ctx.temperature, ctx.logit_scale, ctx.logit_softcap, ctx.return_entropy, ctx.ignore_index = inputs[4:9]
    ctx.truncated = Truncation(*inputs[9:12]).active
    ctx.design = inputs[12] if len(inputs) > 12 else "gemm"
    _, entropy, stats, tau = output
    ctx.save_for_backward(hidden, weight, labels, bias, stats, entropy, tau)
    ctx.mark_non_differentiable(stats, tau)
    ctx.set_materialize_grads(False)  # an unused output needs no term in the backward


def _linear_token_logprobs_backward(ctx, grad_logprobs, grad_entropy, _grad_lse, _grad_tau):
    not_differentiable(ctx, labels=2)
    hidden, weight, labels, bias, stats, entropy, tau = ctx.saved_tensors
    tau = [tau] if ctx.truncated else []
    if not ctx.return_entropy:
        grad_entropy = None  # the placeholder output (empty) has no gradient to pass
    needs_hidden, needs_weight, _, needs_bias = ctx.needs_input_grad[:4]
    if grad_logprobs is None and grad_entropy is None:
        return (None,) * len(ctx.needs_input_grad)
    d_hidden, d_weight, d_bias = call(
        _linear_token_logprobs_backward_op,
        grad_logprobs,
        grad_entropy,
        hidden,
        weight,
        labels,
        bias,
        stats,
        entropy,
        ctx.temperature,
        ctx.logit_scale,
        ctx.logit_softcap,
        ctx.ignore_index,
        needs_hidden,
        needs_weight,
        needs_bias,
        tau[0] if tau else None,
        ctx.design,
    )
    pick = lambda grad, needed: grad if needed else None  # noqa: E731
    grads = (pick(d_hidden, needs_hidden), pick(d_weight, needs_weight), None, pick(d_bias, needs_bias))
    return grads + (None,) * (len(ctx.needs_input_grad) - 4)


_linear_token_logprobs = with_autograd(
    _linear_token_logprobs_op, _linear_token_logprobs_backward, _linear_token_logprobs_setup
)


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
    """``hidden [N, H]``, ``weight [V, H]``, ``labels [N]``: ``(logp, entropy or None)`` (the fused
    kernels of ``ppo_fast.linear_logprobs``; no ``[N, V]`` tensor in either pass)."""
    args = (hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index)
    if DESIGN not in DESIGNS:
        raise ValueError(f"linear_token_logprobs.DESIGN must be one of {DESIGNS}, got {DESIGN!r}")
    truncated = Truncation(*truncation).active  # the epilogue's tiles never hold a whole row: gemm's row plan
    design = "gemm" if DESIGN == "epilogue" and truncated else DESIGN
    logp, entropy, _, _ = _linear_token_logprobs(*args, *truncation, design)  # truncated: over the tokens kept
    return logp, (entropy if return_entropy else None)


@contextlib.contextmanager
def _allow_tf32(allowed: bool):
    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"  # the new API where torch has it
    saved = getattr(matmul, name)
    setattr(matmul, name, ("tf32" if allowed else "ieee") if name == "fp32_precision" else allowed)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _static_launches(dtype, tf32: bool, flags: bool, rows: int, hidden: int, vocab: int, *, grouped: bool = False):
    """The forward and backward launches of one static variant (flags: bias, softcap and entropy, or none;
    ``grouped``: the "epilogue" design's forward)."""

    def head():
        return _meta((rows, hidden), dtype), _meta((vocab, hidden), dtype), _meta((rows,), torch.int64)

    def fwd():
        x, w, labels = head()
        with _allow_tf32(tf32):
            return linear_token_logprobs_forward(
                x,
                w,
                labels,
                _meta((vocab,), x.dtype) if flags else None,
                temperature=0.7,
                logit_scale=1.0,
                logit_softcap=30.0 if flags else None,
                ignore_index=-100,
                return_entropy=flags,
                grouped=grouped,
            )

    def bwd():
        x, w, labels = head()
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        row, stats = _meta((rows,), acc), _meta((rows, 2), acc)
        with _allow_tf32(tf32):
            return linear_token_logprobs_backward(
                row,
                row if flags else None,
                x,
                w,
                labels,
                _meta((vocab,), x.dtype) if flags else None,
                stats=stats,
                entropy=row if flags else None,
                temperature=0.7,
                logit_scale=1.0,
                logit_softcap=30.0 if flags else None,
                ignore_index=-100,
                needs_hidden=True,
                needs_weight=True,
                needs_bias=flags,
            )

    return fwd, bwd


def static_variants(rows: int = 16384, hidden: int = 4096, vocab: int = 151936) -> list[dict]:
    """This op's kernel launches for ``bench.static`` (sm_90 code compiled without a GPU), on meta tensors:
    the fused head (tiled tl.dot: no per-element figure) at its launch configurations, float32
    products in TF32 where torch allows it, else IEEE.

    One dict per variant: ``name``, ``run`` (calls a launcher), ``budget_key`` and
    ``bytes_per_element`` (None: neither), ``block`` (None: no per-element figure).
    """
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
    out = []
    for dtype_name, tf32 in (("bf16", False), ("fp16", False), ("fp32", True), ("fp32", False), ("fp64", False)):
        for flags in (False, True):
            fwd, bwd = _static_launches(dtypes[dtype_name], tf32, flags, rows, hidden, vocab)
            shape = (
                f"[{rows}, {hidden}] x [{vocab}, {hidden}] {dtype_name}"
                + (" tf32" if tf32 else "")
                + (" bias+softcap+entropy" if flags else "")
            )
            out.append(
                dict(
                    name=f"linear_token_logprobs fwd {shape}",
                    budget_key=None,
                    bytes_per_element=None,
                    run=fwd,
                    block=None,
                )
            )
            out.append(
                dict(
                    name=f"linear_token_logprobs bwd {shape}",
                    budget_key=None,
                    bytes_per_element=None,
                    run=bwd,
                    block=None,
                )
            )
    split_rows = rows // 8  # 16 row blocks: the forward splits the vocabulary to fill the machine
    fwd, _ = _static_launches(torch.bfloat16, False, False, split_rows, hidden, vocab)
    shape = f"[{split_rows}, {hidden}] x [{vocab}, {hidden}] bf16"
    for kernel, what in (("_linear_token_logprobs_fwd_kernel", "vocab split"), ("_combine_kernel", "splits' combine")):
        name = f"linear_token_logprobs fwd {shape} {what}"
        out.append(dict(name=name, budget_key=None, bytes_per_element=None, run=fwd, block=None, kernel=kernel))
    for flags in (False, True):  # the "epilogue" design's forward: its grouped tile kernel
        fwd, _ = _static_launches(torch.bfloat16, False, flags, rows, hidden, vocab, grouped=True)
        shape = f"[{rows}, {hidden}] x [{vocab}, {hidden}] bf16" + (" bias+softcap+entropy" if flags else "")
        name = f"linear_token_logprobs fwd {shape} epilogue"
        kernel = "_linear_token_logprobs_fwd_kernel"
        out.append(dict(name=name, budget_key=None, bytes_per_element=None, run=fwd, block=None, kernel=kernel))
    return out + _truncated_static_variants(rows, hidden, vocab) + _gemm_static_variants(hidden, vocab)


def _gemm_static_variants(hidden: int, vocab: int) -> list[dict]:
    """The GEMM-first design's row kernels, one chunk of rows (every chunk launches them alike): the
    forward's statistics (bf16; with a bias, soft-cap and entropy), in the 2-D plan (its first and last
    vocabulary slices' folds) and the row plan, and the backward's d_logits (float16, with its power of
    two, a bias and the soft-cap's derivative; the 2-D plan's slices)."""
    rows = gemm.CHUNK_ROWS
    row, stats, labels = _meta((rows,), torch.float32), _meta((rows, 2), torch.float32), _meta((rows,), torch.int64)

    def head(dtype):
        return _meta((rows, hidden), dtype), _meta((vocab, hidden), dtype)

    def fwd(flags, plan=None):
        x, w = head(torch.bfloat16)
        c = gemm.constants(0.7, 1.0, 30.0 if flags else None)
        bias = _meta((vocab,), x.dtype) if flags else None
        return lambda: gemm.forward(
            x, w, labels, bias, c, ignore_index=-100, return_entropy=flags, truncation=NO_TRUNCATION, plan=plan
        )

    def bwd():
        x, w = head(torch.float16)
        saved = (stats, row, None)
        bias, c = _meta((vocab,), x.dtype), gemm.constants(0.7, 1.0, 30.0)
        return gemm.backward((row, row), x, w, labels, bias, c, saved=saved, ignore_index=-100, needs=(True,) * 3)

    def fold_last():  # the 2-D plan's last slice: the rows' state read, their results written
        x, w = head(torch.bfloat16)
        cols = gemm.block_plan(x, w).cols
        used, h_full = gemm.padded_rows(x, labels, vocab, ignore_index=-100, rows=rows)
        chunk = gemm.slice_logits(labels, used, h_full, w[cols:])
        c, fold = gemm.constants(0.7, 1.0, 30.0), (_meta((rows, 4), torch.float32), vocab, cols, False, True)
        bias = _meta((vocab,), x.dtype)[cols:]
        return lambda: gemm.chunk_stats(chunk, bias, c, -100, None, True, fold=fold)

    shape = f"[{rows}, {hidden}] x [{vocab}, {hidden}]"
    launches = {
        f"gemm-first row stats {shape} bf16 bias+softcap+entropy, 2-D plan's last slice": fold_last(),
        f"gemm-first row stats {shape} bf16": fwd(False),
        f"gemm-first row stats {shape} bf16 bias+softcap+entropy": fwd(True),
        f"gemm-first row stats {shape} bf16 bias+softcap+entropy, row plan": fwd(True, gemm.HeadPlan(rows, 2)),
        f"gemm-first d_logits {shape} fp16 bias+softcap+entropy": bwd,
    }
    return [
        dict(name=f"linear_token_logprobs {what}", budget_key=None, bytes_per_element=None, run=run, block=None)
        for what, run in launches.items()
    ]


def _truncated_static_variants(rows: int, hidden: int, vocab: int) -> list[dict]:
    """The truncation's launches of the fused head (bf16): the logits of a chunk of rows for the thresholds
    (``_truncation``'s kernel is token_logprobs' variant), the TRUNCATED forward and backward."""
    x, w, labels = (
        _meta((rows, hidden), torch.bfloat16),
        _meta((vocab, hidden), torch.bfloat16),
        _meta((rows,), torch.int64),
    )
    row, stats = _meta((rows,), torch.float32), _meta((rows, 2), torch.float32)
    options = dict(temperature=0.7, logit_scale=1.0, logit_softcap=None, ignore_index=-100)
    chunk = LOGITS_SCRATCH_BYTES // (4 * vocab)
    launches = {
        "logits rows (thresholds' input)": lambda: linear_logits_rows(
            x, w, labels, None, 0, chunk, logit_scale=1.0, logit_softcap=None, ignore_index=-100
        ),
        "fwd truncated": lambda: linear_token_logprobs_forward(
            x, w, labels, None, **options, return_entropy=True, tau=row
        ),
        "bwd truncated": lambda: linear_token_logprobs_backward(
            row,
            row,
            x,
            w,
            labels,
            None,
            stats=stats,
            entropy=row,
            **options,
            needs_hidden=True,
            needs_weight=True,
            needs_bias=False,
            tau=row,
        ),
    }
    shape = f"[{rows}, {hidden}] x [{vocab}, {hidden}] bf16"
    return [
        dict(name=f"linear_token_logprobs {what} {shape}", budget_key=None, bytes_per_element=None, run=run, block=None)
        for what, run in launches.items()
    ]
