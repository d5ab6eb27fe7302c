"""The Triton one-pass loss's fused per-token terms (``triton/_policy_terms.py``, every token-level mode):
per chunk equal to the generic path (``_one_pass._per_token_grads``, the reference's ``chunk_terms`` under
autograd) and to it in float64, through ``pf.linear_policy_loss`` equal to the generic path and the
float64 reference, which calls take it, and its launches a chunk against the generic path's (the
roofline model's counts, ``_head_plan.TERMS_LAUNCHES``)."""

from __future__ import annotations

import collections
import importlib
import itertools
import math
import zlib

import numpy as np
import pytest
import test_linear_policy_loss as lpl
import tiers
import torch
from test_linear_policy_loss import small_chunks  # noqa: F401  (chunks of two sequences)
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import ppo_fast as pf
from ppo_fast.backends import _head_plan, serving
from ppo_fast.backends._one_pass import _per_token_grads
from ppo_fast.backends.reference._loss_terms import Objective, PerToken, Terms, loss_scales
from ppo_fast.spec import AGG_MODES, KL_ESTIMATORS, POLICY_LOSS_MODES

pytestmark = pytest.mark.skipif(
    "triton" not in serving("linear_policy_loss_vanilla", "cpu"), reason="the Triton backend is not served on CPU"
)
VANILLA = POLICY_LOSS_MODES["vanilla"]
# (clip_eps_low, clip_eps_high, dual_clip): the defaults, verl's dual clip, extremes at both ends.
CLIPS = {
    "default": (0.2, 0.28, None),
    "dual": (0.2, 0.28, 3.0),
    "tight": (1e-6, 1e-6, 1.0 + 1e-6),
    "wide": (0.999999, 1e6, 1e6),
}
DPPO = {"default": (0.2, 0.28, 20.0), "tight": (1e-6, 1e-6, 1e-3), "wide": (1e6, 1e6, 1e30)}
# The other token-level modes' parameters (spec order): their defaults and extremes at both ends.
MODE_PARAMS = {
    "vanilla": CLIPS,
    "sapo": {"default": (1.0, 1.05), "tight": (1e-4, 1e-4), "wide": (100.0, 1e3)},
    "cispo": {name: CLIPS[name][:2] for name in ("default", "tight", "wide")},
    "gpg": {"default": ()},
    "dppo_tv": DPPO,
    "dppo_kl": DPPO,
    "dro": {"default": (0.1,), "tight": (1e-6,), "wide": (1e4,)},
    # the sequence-level modes (padded only): geo_mean's clip is on the log-ratio
    "gspo": {name: CLIPS[name][:2] for name in ("default", "tight", "wide")},
    "geo_mean": {"default": (0.2, 0.28), "tight": (1e-6, 1e-6), "wide": (30.0, 1e6)},
}
SEQUENCE_MODES = ("gspo", "geo_mean")
OTHER_MODES = tuple(name for name in MODE_PARAMS if name != "vanilla" and name not in SEQUENCE_MODES)


def objective_of(mode: str, level: str, agg: str) -> Objective:
    """The mode at parameter ``level`` (gpg has none: every level is its one)."""
    levels = MODE_PARAMS[mode]
    return Objective(POLICY_LOSS_MODES[mode], levels.get(level, levels["default"]), agg)


def modules():
    return (
        importlib.import_module("ppo_fast.backends.triton._policy_terms"),
        importlib.import_module("ppo_fast.backends.triton.linear_policy_loss"),
    )


def per_token(seed, dims, *, dtype, weighted, with_ref, packed, ties=None):
    """``(logp, entropy, x)``: float32 head outputs and the ``[B, T]`` inputs in ``dtype`` (NaN where masked
    in old and adv, never read); a response without tokens; ``ties``: tokens whose ratio is exactly there."""
    gen = torch.Generator().manual_seed(seed)
    B, T = dims
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[0] = False
    junk = torch.where(mask, 0.0, torch.nan)
    logp = -torch.rand(B, T, generator=gen) * 2 - 0.05
    old = (logp + torch.randn(B, T, generator=gen) * 0.4).to(dtype)
    if ties is not None:  # logp - old exactly the log-ratio `ties` (old a multiple of 1/8: exact sums)
        old[:, ::3] = (old[:, ::3] * 8).round() / 8
        logp[:, ::3] = old[:, ::3].float() + ties
    old = old + junk.to(dtype)
    adv = (torch.randn(B, T, generator=gen) + junk).to(dtype)
    ref = (logp + torch.randn(B, T, generator=gen) * 0.5).to(dtype) if with_ref else None
    weights = (torch.rand(B, T, generator=gen) + 0.5).to(dtype) if weighted else None
    entropy = torch.rand(B, T, generator=gen) * 3
    x = PerToken(old, adv, mask, weights, ref)
    if packed:  # one row of packed tokens, a factor per token (segment_scale's: seq-mean as token-sum)
        x = PerToken(*(None if t is None else t.reshape(1, -1) for t in x))
        x = x._replace(scale=torch.rand(1, B * T, generator=gen) / B)
        logp, entropy = logp.reshape(1, -1), entropy.reshape(1, -1)
    return logp, entropy, x


def as_sequences(logp, entropy, x, lengths):
    """The ``[B, T]`` rows' first ``lengths`` tokens as packed sequences: the ``[1, N]`` row with its
    ``cu_seqlens`` on the host (``PerToken.bounds``, a sequence-level mode's packed layout)."""
    valid = torch.arange(logp.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    bounds = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    x = PerToken(*(None if t is None else t[valid][None] for t in x[:5]), bounds=bounds)
    return logp[valid][None], entropy[valid][None], x


def chunked(logp, entropy, x, objective, terms, *, rows, fused: bool):
    """The chunks' summed terms and the ``[B, T]`` gradients of one path, in the head's chunks."""
    policy_terms, head = modules()
    batch, length = logp.shape
    scales = loss_scales(x.mask, objective.agg, x.bounds)
    state = policy_terms.Batch(x, objective, terms) if fused else None
    g_logp, g_entropy, totals = torch.zeros_like(logp), torch.zeros_like(entropy), None
    for rs, bs in head._token_chunks(batch, length, rows, x.scale is not None, x.bounds):
        shape = logp[bs].shape
        if fused:
            g, ge = state.launch(logp[bs].contiguous().view(-1), entropy[bs].contiguous().view(-1), rs.start, shape)
        else:
            out, g, ge = _per_token_grads(logp[bs], entropy[bs], x.rows(bs), objective, terms, scales)
            totals = out if totals is None else [t + o for t, o in zip(totals, out)]
        g_logp[bs] = g.view(shape)
        if ge is not None:
            g_entropy[bs] = ge.view(shape)
    return (state.results() if fused else totals), g_logp, g_entropy


def widened(logp, entropy, x):
    return (
        logp.double(),
        entropy.double(),
        PerToken(*(t if t is None or not t.is_floating_point() else t.double() for t in x)),
    )


def assert_terms_close(got, want, rtol, atol, mode=VANILLA):
    (totals, g_logp, g_entropy), (want_totals, want_g, want_ge) = got, want
    names = ("loss", "pg_loss", "entropy", "kl_loss", *mode.stats)
    assert len(totals) == len(want_totals) == len(names)
    for name, a, b in zip(names, totals, want_totals):
        assert a.dtype == torch.float32 and a.shape == ()
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    scale = max(float(want_g.abs().max()), 1e-30)
    torch.testing.assert_close(g_logp.double(), want_g.double(), rtol=rtol, atol=atol * scale)
    torch.testing.assert_close(g_entropy.double(), want_ge.double(), rtol=rtol, atol=atol)


AXES = dict(
    agg=AGG_MODES,
    kl=(*KL_ESTIMATORS, None),
    clip=tuple(CLIPS),
    entropy_coef=(0.0, 0.01),
    weighted=(False, True),
    packed=(False, True),
    dtype=(torch.float32, torch.float16),
)
TERMS_CASES = tiers.sampled(
    [
        pytest.param(*values, id="-".join(str(v).replace("torch.", "") for v in values))
        for values in itertools.product(*AXES.values())
        if not (values[5] and values[0].startswith("seq-mean"))  # packed: seq-mean is token-sum with its scale
    ]
)


@pytest.mark.parametrize(list(AXES), TERMS_CASES)
def test_fused_terms_equal_the_generic_path_and_float64(agg, kl, clip, entropy_coef, weighted, packed, dtype):
    """Per chunk (odd shapes, several chunks, an empty response, NaN where masked): the fused kernel's
    totals and gradients equal ``_per_token_grads``' in float32 and in float64."""
    seed = zlib.crc32(f"{agg}-{kl}-{clip}-{entropy_coef}-{weighted}-{packed}-{dtype}".encode())
    logp, entropy, x = per_token(seed, (5, 7), dtype=dtype, weighted=weighted, with_ref=kl is not None, packed=packed)
    objective = Objective(VANILLA, CLIPS[clip], agg)
    terms = Terms(0.1, kl or "k3", entropy_coef)
    got = chunked(logp, entropy, x, objective, terms, rows=13, fused=True)
    assert_terms_close(got, chunked(logp, entropy, x, objective, terms, rows=13, fused=False), 2e-5, 2e-6)
    assert_terms_close(got, chunked(*widened(logp, entropy, x), objective, terms, rows=13, fused=False), 1e-5, 1e-6)


MODE_AXES = dict(
    mode=OTHER_MODES,
    level=("default", "tight", "wide"),
    agg=AGG_MODES,
    kl=(*KL_ESTIMATORS, None),
    entropy_coef=(0.0, 0.01),
    weighted=(False, True),
    packed=(False, True),
    dtype=(torch.float32, torch.float16),
)
MODE_CASES = tiers.sampled(
    [
        pytest.param(*values, id="-".join(str(v).replace("torch.", "") for v in values))
        for values in itertools.product(*MODE_AXES.values())
        if not (values[6] and values[2].startswith("seq-mean")) and not (values[0] == "gpg" and values[1] != "default")
    ]
)


@pytest.mark.parametrize(list(MODE_AXES), MODE_CASES)
def test_every_modes_fused_terms_equal_the_generic_path_and_float64(
    mode, level, agg, kl, entropy_coef, weighted, packed, dtype
):
    """As above for the other token-level modes, at their defaults and extreme parameters."""
    seed = zlib.crc32(f"{mode}-{level}-{agg}-{kl}-{entropy_coef}-{weighted}-{packed}-{dtype}".encode())
    logp, entropy, x = per_token(seed, (5, 7), dtype=dtype, weighted=weighted, with_ref=kl is not None, packed=packed)
    objective = objective_of(mode, level, agg)
    terms = Terms(0.1, kl or "k3", entropy_coef)
    got = chunked(logp, entropy, x, objective, terms, rows=13, fused=True)
    generic = chunked(logp, entropy, x, objective, terms, rows=13, fused=False)
    # sapo's gate slope amplifies the float32 ratio's rounding (exp's last bit, which NumPy and torch
    # may round apart) by tau: its gradient's relative error grows to about tau * 2 ulp on either path
    rtol = 1e-5 + (4e-7 * max(objective.params) if mode == "sapo" else 0.0)
    oracle = chunked(*widened(logp, entropy, x), objective, terms, rows=13, fused=False)
    assert_no_worse_than_the_generic_path(got, generic, oracle, objective.mode, rtol=rtol)


SEQUENCE_AXES = {name: values for name, values in MODE_AXES.items() if name != "mode"}
# packed: sequences of these lengths (row 0 all masked, an empty one, one longer than a chunk of 7 tokens)
SEQUENCE_LENGTHS = [9, 0, 4, 9, 2]
SEQUENCE_CASES = tiers.sampled(
    [
        pytest.param(mode, *values, id="-".join(str(v).replace("torch.", "") for v in (mode, *values)))
        for mode in SEQUENCE_MODES
        for values in itertools.product(*SEQUENCE_AXES.values())
    ],
    strength=1,  # 5 cases in the fast tier, all 1200 in the full
)


@pytest.mark.parametrize(["mode", *SEQUENCE_AXES], SEQUENCE_CASES)
def test_sequence_level_fused_terms_equal_the_generic_path_and_float64(
    mode, level, agg, kl, entropy_coef, weighted, packed, dtype
):
    """gspo and geo_mean (padded: a chunk holds whole rows, their means its own), per chunk as above, on
    rows of odd lengths a few to a chunk, one of them without tokens; ``packed``: as packed sequences of
    ``SEQUENCE_LENGTHS`` (``PerToken.bounds``), chunks of whole ones (7 tokens: a longer one alone)."""
    seed = zlib.crc32(f"{mode}-{level}-{agg}-{kl}-{entropy_coef}-{weighted}-{packed}-{dtype}".encode())
    logp, entropy, x = per_token(seed, (5, 9), dtype=dtype, weighted=weighted, with_ref=kl is not None, packed=False)
    rows = 20
    if packed:
        (logp, entropy, x), rows = as_sequences(logp, entropy, x, SEQUENCE_LENGTHS), 7
    objective = objective_of(mode, level, agg)
    terms = Terms(0.1, kl or "k3", entropy_coef)
    got = chunked(logp, entropy, x, objective, terms, rows=rows, fused=True)
    generic = chunked(logp, entropy, x, objective, terms, rows=rows, fused=False)
    oracle = chunked(*widened(logp, entropy, x), objective, terms, rows=rows, fused=False)
    assert_no_worse_than_the_generic_path(got, generic, oracle, objective.mode)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mode", SEQUENCE_MODES)
def test_sequence_level_rows_longer_than_a_tile(monkeypatch, mode, packed):
    """Tiles of 4 tokens (``_BLOCK`` 4: one row a block): each row's means summed over its three tiles, the
    tokens' gradients in each, as the generic path and float64; packed: sequences of 11, 0, 5, 11 and 3
    tokens, two chunks of whole ones (22 tokens), each row's tiles from its own start."""
    policy_terms, _ = modules()
    monkeypatch.setattr(policy_terms, "_BLOCK", 4)
    logp, entropy, x = per_token(9, (5, 11), dtype=torch.float32, weighted=True, with_ref=True, packed=False)
    if packed:
        logp, entropy, x = as_sequences(logp, entropy, x, [11, 0, 5, 11, 3])
    objective = objective_of(mode, "default", "seq-mean-token-mean")
    terms = Terms(0.1, "k3", 0.01)
    got = chunked(logp, entropy, x, objective, terms, rows=22, fused=True)
    generic = chunked(logp, entropy, x, objective, terms, rows=22, fused=False)
    oracle = chunked(*widened(logp, entropy, x), objective, terms, rows=22, fused=False)
    assert_no_worse_than_the_generic_path(got, generic, oracle, objective.mode)


def assert_no_worse_than_the_generic_path(got, generic, oracle, mode, rtol=1e-5, atol=1e-6):
    """Each total and gradient within ``rtol``/``atol`` of float64's (a gradient's ``atol`` times its
    largest entry), or of it by at most 4x the generic path's own float32 error (a gradient's largest)
    plus that: a sum of large terms that cancel (sapo's 4 / tau at tau = 1e-4) loses float32 digits in
    any summation order, and sapo's saturated gate ``(1 - y) y`` at tau = 1e3 its ``1 - y``, a different
    token's on each path; a wrong formula is off by far more."""
    names = ("loss", "pg_loss", "entropy", "kl_loss", *mode.stats)
    assert len(got[0]) == len(generic[0]) == len(oracle[0]) == len(names)
    for name, a, b, want in zip(names, got[0], generic[0], oracle[0]):
        assert a.dtype == torch.float32 and a.shape == ()
        a, b, want = a.double(), b.double(), want.double()
        bound = atol + rtol * abs(want) + 4 * abs(b - want)
        assert abs(a - want) <= bound, (name, float(a), float(b), float(want))
    for a, b, want in zip(got[1:], generic[1:], oracle[1:]):
        a, b, want = a.double(), b.double(), want.double()
        bound = atol * max(float(want.abs().max()), 1e-30) + rtol * want.abs() + 4 * float((b - want).abs().max())
        assert ((a - want).abs() <= bound).all(), float(((a - want).abs() - bound).max())


@pytest.mark.parametrize(
    "mode, dual", [("vanilla", None), ("vanilla", 2.0), ("cispo", None), ("gspo", None), ("geo_mean", None)]
)
def test_a_ratio_exactly_on_a_clip_bound_gets_the_unclipped_derivative(mode, dual):
    """At ratio == 1 - clip_eps_low and 1 + clip_eps_high exactly (docs/ops.md: not clipped, the
    unclipped derivative -A r; cispo: its coefficient the ratio itself; gspo: every token of a row whose
    mean log-ratio is there; geo_mean: a log-ratio == -clip_eps_low or clip_eps_high, its clip in log
    space) the fused gradient is the generic path's, token for token."""
    d = next(  # log-ratios (multiples of 1/16) whose exp rounds alike in torch and numpy (the interpreter's exp)
        d
        for d in torch.arange(-1, -16, -1) / 16
        if all(float(torch.exp(v)) == float(np.exp(v.numpy())) for v in (d, -d))
    )
    below, above = float(torch.exp(d)), float(torch.exp(-d))
    for low, high, ties in ((1.0 - below, 0.3, d), (0.2, above - 1.0, -d)):
        logp, entropy, x = per_token(
            7, (4, 9), dtype=torch.float32, weighted=False, with_ref=False, packed=False, ties=ties
        )
        if mode == "gspo":  # every valid token's log-ratio the tie: its row's mean is exactly it
            old = torch.where(x.mask, (x.old * 8).round() / 8, x.old)
            logp = torch.where(x.mask, old + ties, logp)
            x = x._replace(old=old)
        ratio_at = torch.exp((logp - x.old)[:, ::3][x.mask[:, ::3]])
        assert ((ratio_at == 1.0 - low) | (ratio_at == 1.0 + high)).float().mean() > 0.5  # the ties are there
        if mode == "geo_mean":  # the log-ratio's bounds
            low, high = (-float(d), 0.3) if ties < 0 else (0.2, -float(d))
        params = (low, high, dual) if mode == "vanilla" else (low, high)
        objective = Objective(POLICY_LOSS_MODES[mode], params, "token-mean")
        terms = Terms(0.0, "k3", 0.0)
        got = chunked(logp, entropy, x, objective, terms, rows=9, fused=True)
        want = chunked(logp, entropy, x, objective, terms, rows=9, fused=False)
        assert_terms_close(got, want, 1e-6, 1e-7, objective.mode)
        assert float(got[0][4]) == float(want[0][4])  # clipfrac: a tie is not clipped


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_extreme_log_ratios_pass_no_gradient_beyond_the_exp_clamp(mode):
    """|logp - old| > 20: the ratio is exp(+-20) and the clamp passes no gradient, as the reference
    (dro's log-ratio is not clamped; DPPO's p_old > 1 makes its binary KL NaN, as the reference's; gspo's
    row mean is clamped at 10 only above, geo_mean's clip is on the log-ratio): alternating +-30, and every
    token's log-ratio 12 (a sequence ratio past gspo's clamp), or -30."""
    logp, entropy, x = per_token(3, (3, 8), dtype=torch.float32, weighted=True, with_ref=True, packed=False)
    objective = objective_of(mode, "dual", "seq-mean-token-mean")
    for old in (torch.where(torch.arange(8) % 2 == 0, logp - 30.0, logp + 30.0), logp - 12.0, logp + 30.0):
        x = x._replace(old=old)
        got = chunked(logp, entropy, x, objective, Terms(0.1, "k2", 0.01), rows=8, fused=True)
        want = chunked(logp, entropy, x, objective, Terms(0.1, "k2", 0.01), rows=8, fused=False)
        assert_terms_close(got, want, 2e-5, 2e-6, objective.mode)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_a_non_finite_log_prob_at_a_valid_token_propagates_as_on_the_generic_path(mode):
    """-inf, inf or NaN at a valid token's log-prob (a row whose logits overflow): the same totals and
    gradients, NaN and inf where the generic path has them (its k3 KL term and entropy bonus too)."""
    for poison in (-math.inf, math.inf, math.nan):
        logp, entropy, x = per_token(5, (3, 6), dtype=torch.float32, weighted=True, with_ref=True, packed=False)
        row, token = x.mask.nonzero()[0]
        logp[row, token] = poison
        objective, terms = objective_of(mode, "dual", "token-mean"), Terms(0.1, "k3", 0.01)
        got = chunked(logp, entropy, x, objective, terms, rows=6, fused=True)
        want = chunked(logp, entropy, x, objective, terms, rows=6, fused=False)
        for a, b in zip([*got[0], *got[1:]], [*want[0], *want[1:]]):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, equal_nan=True, msg=lambda m: f"{poison}: {m}")


def exact_ties(values_torch, values_numpy, where):
    """The first position in ``where`` at which the float32 values torch and NumPy (the interpreter's
    math) compute are equal: a bound set to it is a tie on both paths."""
    agree = where & torch.from_numpy(values_numpy == values_torch.numpy())
    return values_torch[agree][0].item()


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_keeps_a_token_exactly_on_its_trust_region_bound(mode):
    """DPPO's bounds are inclusive (``<=``): tokens whose probability change (tv) or binary KL (kl) equals
    clip_eps_high (A > 0, p > p_old) or clip_eps_low (A <= 0, p < p_old) keep their gradient, and a ratio
    equal to ratio_cap is not counted in clipfrac_lower, as the generic path."""
    logp, entropy, x = per_token(11, (6, 9), dtype=torch.float32, weighted=False, with_ref=False, packed=False)
    lp, old = logp.numpy(), x.old.numpy()
    p, p_old = torch.exp(logp), torch.exp(x.old)
    if mode == "dppo_tv":
        change, change_np = p - p_old, np.exp(lp) - np.exp(old)
        high = exact_ties(change, change_np, x.mask & (x.adv > 0) & (p > p_old))
        low = -exact_ties(change, change_np, x.mask & (x.adv <= 0) & (p < p_old))
    else:
        q, q_np = p_old, np.exp(old)
        bkl = q * (x.old - logp) + (1.0 - q) * torch.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        with np.errstate(invalid="ignore"):  # p_old > 1 where masked (old is NaN there) or old > 0
            bkl_np = q_np * (old - lp) + (1.0 - q_np) * np.log(
                (1.0 - q_np + np.float32(1e-8)) / (1.0 - np.exp(lp) + np.float32(1e-8))
            )
        high = exact_ties(bkl, bkl_np, x.mask & (x.adv > 0) & (p > p_old))
        low = exact_ties(bkl, bkl_np, x.mask & (x.adv <= 0) & (p < p_old))
    ratio = torch.exp(logp - x.old)
    cap = exact_ties(ratio, np.exp(lp - old), x.mask & (x.adv <= 0) & (ratio > 1.0))  # kept: p > p_old
    objective = Objective(POLICY_LOSS_MODES[mode], (low, high, cap), "token-sum")
    terms = Terms(0.0, "k3", 0.0)
    got = chunked(logp, entropy, x, objective, terms, rows=9, fused=True)
    want = chunked(logp, entropy, x, objective, terms, rows=9, fused=False)
    assert_terms_close(got, want, 1e-6, 1e-7, objective.mode)
    assert float(got[0][5]) == float(want[0][5])  # clipfrac_lower: a ratio on the cap is not capped


# --------------------------------------------------------------------------- through pf.linear_policy_loss


PACKED_LENGTHS = [7, 0, 1, 5, 7]  # odd lengths, an empty sequence and a single token
OP_AXES = dict(
    agg=AGG_MODES,
    kl=(*KL_ESTIMATORS, None),
    clip=tuple(CLIPS),
    entropy_coef=(0.0, 0.01),
    packed=(False, True),
    dtype=(torch.float32, torch.float16),
)
OP_CASES = tiers.sampled(
    [
        pytest.param(*values, id="-".join(str(v).replace("torch.", "") for v in values))
        for values in itertools.product(*OP_AXES.values())
    ],
    strength=1,
)


def loss_call(x, valid, *, agg, kl, entropy_coef, clip, backend="triton", mode="vanilla"):
    """``pf.linear_policy_loss`` (``mode`` at parameter level ``clip``) on ``x``, padded, or with ``valid``
    its valid tokens packed."""
    packed, layout = x, {}
    if valid is not None:
        packed = {k: v if k in ("weight", "bias") or v is None else v[valid] for k, v in x.items()}
        lengths = valid.sum(-1)
        layout = dict(cu_seqlens=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32), max_seqlen=7)
    args = [packed[n] for n in ("hidden", "weight", "labels", "old", "adv", "mask")]
    objective = objective_of(mode, clip, agg)
    terms = dict(weights=packed["weights"], bias=x["bias"], ref_logprobs=None if kl is None else packed["ref"])
    with pf.use_backend(backend):
        loss, stats = pf.linear_policy_loss(
            *args,
            **terms,
            kl_coef=0.0 if kl is None else 0.1,
            kl_estimator=kl or "k3",
            entropy_coef=entropy_coef,
            agg=agg,
            loss_mode=mode,
            **objective.mode.named(objective.params),
            **layout,
        )
    return loss.detach(), stats, torch.autograd.grad(loss * 1.7, lpl.leaves(x))


@pytest.mark.parametrize(list(OP_AXES), OP_CASES)
def test_linear_policy_loss_fused_equals_the_generic_path_and_float64(
    monkeypatch, agg, kl, clip, entropy_coef, packed, dtype, mode="vanilla"
):
    """Through the op (chunks of two sequences, or 14 packed tokens cutting through sequences): the fused
    terms give the generic path's loss, stats and gradients, and the float64 reference's."""
    policy_terms, _ = modules()
    launches = count_launches(monkeypatch, policy_terms)
    x = lpl.make_inputs(
        zlib.crc32(f"{agg}-{kl}-{clip}-{packed}{mode}".encode()), dtype=dtype, dims=(5, 7, 53, 13), weighted=True
    )
    valid = None
    if packed:
        valid = torch.arange(7)[None, :] < torch.tensor(PACKED_LENGTHS)[:, None]
        x["mask"] = x["mask"] & valid
    options = dict(agg=agg, kl=kl, entropy_coef=entropy_coef, clip=clip, mode=mode)
    got = loss_call(x, valid, **options)
    assert launches["kernel"] >= 2  # fused, a launch a chunk
    with monkeypatch.context() as patch:
        patch.setattr(policy_terms, "fused", lambda *args: False)
        generic = loss_call(x, valid, **options)
    lpl.assert_result_close(got, generic, lpl.TOLERANCE[torch.float32], "fused vs generic")
    wide = {
        k: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_() for k, v in x.items()
    }
    oracle = loss_call(wide, valid, **options, backend="reference")
    if dtype == torch.float32:
        lpl.assert_result_close(got, oracle, lpl.TOLERANCE[dtype], "fused vs float64")
    for g, generic_g, want in zip(got[2], generic[2], oracle[2]):  # float16: the head's rounding dominates
        error, generic_error = (float((a.double() - want).abs().max()) for a in (g, generic_g))
        assert error <= 1.25 * generic_error + 2e-5 * float(want.abs().max()), (error, generic_error)


def other_mode_op_cases() -> list:
    """Each other token-level mode padded and packed, the other axes cycled through (a covering of each);
    the fast tier each mode once, padded and packed in turn (the per-chunk test has every mode in both)."""
    cases = []
    for i, (mode, packed) in enumerate(itertools.product(OTHER_MODES, (False, True))):
        values = (
            AGG_MODES[i % len(AGG_MODES)],  # packed seq-mean: the op's per-token scale
            (*KL_ESTIMATORS, None)[i % 5],
            ("default", "tight", "wide")[i // 2 % 3],
            (0.0, 0.01)[i // 3 % 2],
            packed,
            (torch.float32, torch.float16)[i // 4 % 2],
            mode,
        )
        ident = "-".join(str(v).replace("torch.", "") for v in values)
        cases.append(tiers.case(*values, fast=packed == bool(i // 2 % 2), id=ident))
    for i, mode in enumerate(SEQUENCE_MODES):  # padded only: packed, they are not fused (generic terms)
        values = (
            ("token-mean", "seq-mean-token-mean")[i],
            ("k3", None)[i],
            "default",
            0.01,
            False,
            torch.float16,
            mode,
        )
        ident = "-".join(str(v).replace("torch.", "") for v in values)
        cases.append(tiers.case(*values, fast=mode == "gspo", id=ident))  # geo_mean's in the full tier
    return cases


@pytest.mark.parametrize([*OP_AXES, "mode"], other_mode_op_cases())
def test_linear_policy_loss_every_modes_fused_terms(monkeypatch, agg, kl, clip, entropy_coef, packed, dtype, mode):
    """As above for the other token-level modes, each padded and packed, and the sequence-level modes padded."""
    test_linear_policy_loss_fused_equals_the_generic_path_and_float64(
        monkeypatch, agg, kl, clip, entropy_coef, packed, dtype, mode
    )


def count_launches(monkeypatch, policy_terms) -> collections.Counter:
    """Counts the fused kernel's launches (``["kernel"]``) from now on."""
    seen = collections.Counter()
    kernel = policy_terms._terms_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["kernel"] += 1
                with _disable_current_modes():  # the interpreter's own tensor work is no launch
                    return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(policy_terms, "_terms_kernel", Counted())
    return seen


@pytest.mark.parametrize(
    "mode, dtype, fused",
    [
        ("vanilla", torch.float32, True),
        ("vanilla", torch.float16, True),
        ("vanilla", torch.float64, False),
        ("sapo", torch.float32, True),  # each other mode's fused launches: its op test
        ("dro", torch.float64, False),
        ("gspo", torch.float32, True),
    ],
)
def test_which_calls_take_the_fused_terms(monkeypatch, mode, dtype, fused):
    """The dispatch is on the arguments: a one-pass mode with inputs of at most 32 bits is fused (a launch
    a chunk); float64 inputs (float64 terms) take ``_per_token_grads``.  (The sequence-level modes on
    packed tokens never reach the one pass: ``fused`` refuses them, ``test_packed_sequence_level_...``.)"""
    policy_terms, head = modules()
    launches = count_launches(monkeypatch, policy_terms)
    generic = collections.Counter()
    real = head._per_token_grads
    monkeypatch.setattr(head, "_per_token_grads", lambda *a: generic.update(["call"]) or real(*a))
    x = lpl.make_inputs(1, dtype=dtype)
    with pf.use_backend("triton"):
        loss, _ = pf.linear_policy_loss(
            *(x[n] for n in ("hidden", "weight", "labels", "old", "adv", "mask")),
            loss_mode=mode,
            ref_logprobs=x["ref"],
            kl_coef=0.1,
            **POLICY_LOSS_MODES[mode].example_params(),
        )
    chunks = 3  # 5 sequences, two a chunk
    assert (launches["kernel"], generic["call"]) == ((chunks, 0) if fused else (0, chunks))
    assert torch.isfinite(loss)


def test_the_fused_modes_are_every_one_pass_mode():
    """``_policy_terms.MODES`` is the spec's one-pass modes, and this file's ``SEQUENCE_MODES`` the spec's
    sequence-level ones (``fused`` reads the spec's flag; a row pass first): a new mode needs its kernel branch."""
    policy_terms, _ = modules()
    assert set(policy_terms.MODES) == {m.name for m in POLICY_LOSS_MODES.values() if m.fused_head}
    assert set(SEQUENCE_MODES) == {m.name for m in POLICY_LOSS_MODES.values() if m.sequence_level}


def test_packed_sequence_level_modes_are_fused_on_whole_sequences():
    """On packed tokens with a factor per token (token slices, which cut through sequences: a sequence-level
    mode's row means are not a chunk's own) ``fused`` refuses gspo and geo_mean and serves a token-level
    mode; with the sequences' bounds instead (``PerToken.bounds``: int64, not a per-token input) it serves
    them, for float32 log-probs only."""
    policy_terms, _ = modules()
    _, _, x = per_token(2, (3, 5), dtype=torch.float32, weighted=False, with_ref=False, packed=True)
    bounded = x._replace(scale=None, bounds=torch.tensor([0, 5, 5, 15]))
    for mode in ("gspo", "geo_mean", "vanilla"):
        objective = objective_of(mode, "default", "token-sum")
        assert policy_terms.fused(objective, torch.float32, x) == (mode == "vanilla")
        assert policy_terms.fused(objective, torch.float32, x._replace(scale=None))
        assert policy_terms.fused(objective, torch.float32, bounded)
        assert not policy_terms.fused(objective, torch.float64, bounded)


# --------------------------------------------------------------------------- launches a chunk (the model's counts)

# Aten ops that launch no kernel on a GPU: views, allocations, metadata, a Python number wrapped as a CPU scalar.
NOT_KERNELS = {
    "view",
    "_unsafe_view",
    "reshape",
    "expand",
    "t",
    "transpose",
    "unsqueeze",
    "squeeze",
    "select",
    "slice",
    "as_strided",
    "detach",
    "alias",
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "scalar_tensor",
    "is_same_size",
    "_reshape_alias",
    "permute",
}


class CountKernels(TorchDispatchMode):
    """Leaf aten ops (the autograd backward's included) by name, and those that launch a kernel."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        return sum(n for name, n in self.ops.items() if name not in NOT_KERNELS)


def one_chunk_kernels(monkeypatch, fused: bool, with_ref: bool, mode: str = "vanilla") -> int:
    """The kernels of one chunk's terms and gradient (``mode``, token-mean, an entropy bonus; a k3 KL term
    where ``with_ref``) on a [4, 96] chunk, counted on CPU: a proxy for the launches on CUDA."""
    policy_terms, _ = modules()
    logp, entropy, x = per_token(0, (4, 96), dtype=torch.float32, weighted=False, with_ref=with_ref, packed=False)
    objective = objective_of(mode, "default", "token-mean")
    terms = Terms(0.1, "k3", 0.01)
    if fused:
        state = policy_terms.Batch(x, objective, terms)  # once a call, not a chunk
        launches = count_launches(monkeypatch, policy_terms)
        with CountKernels() as count:
            state.launch(logp.view(-1), entropy.view(-1), 0, tuple(logp.shape))
        return count.kernels() + launches["kernel"]
    scales = loss_scales(x.mask, objective.agg)
    with CountKernels() as count:
        _per_token_grads(logp, entropy, x, objective, terms, scales)
    return count.kernels()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_fused_terms_once_a_call(packed):
    """What the fused path launches once a call besides its chunks (the normalisers, the totals' zeros and
    results) is the model's ``TERMS_CALL_LAUNCHES["fused"]``; on packed sequences (their rows with a valid
    token counted through ``cu_seqlens``) ``TERMS_CALL_LAUNCHES["fused, packed"]``."""
    policy_terms, _ = modules()
    logp, entropy, x = per_token(0, (4, 96), dtype=torch.float32, weighted=False, with_ref=True, packed=False)
    if packed:
        logp, entropy, x = as_sequences(logp, entropy, x, [96, 0, 50, 7])
    with CountKernels() as count:
        policy_terms.Batch(x, Objective(VANILLA, CLIPS["default"], "token-mean"), Terms(0.1, "k3", 0.01)).results()
    assert count.kernels() == _head_plan.TERMS_CALL_LAUNCHES["fused, packed" if packed else "fused"]


@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "geo_mean"])
def test_the_models_launch_counts_are_the_paths_counts(monkeypatch, with_ref, mode):
    """``_head_plan.TERMS_LAUNCHES`` (what ``bench head_model`` charges a chunk) against the counts: the
    fused path (every mode, the sequence-level ones included) one Triton launch and no aten kernel; the
    generic path (float64 inputs) its leaf aten kernels on CPU: vanilla's within 15% (they vary a little
    with torch's decompositions), gspo's and geo_mean's within 30% (their row means: 94 and 110 kernels
    against 87 without a KL term, 256 and 272 against the model's 249 with one)."""
    assert one_chunk_kernels(monkeypatch, True, with_ref, mode) == _head_plan.TERMS_LAUNCHES["fused"] == 1
    generic = one_chunk_kernels(monkeypatch, False, with_ref, mode)
    modelled = _head_plan.TERMS_LAUNCHES["generic, KL" if with_ref else "generic"]
    assert math.isclose(generic, modelled, rel_tol=0.15 if mode == "vanilla" else 0.3), (generic, modelled)


@pytest.mark.parametrize("mode", OTHER_MODES)
def test_every_fused_mode_is_one_launch_a_chunk(monkeypatch, mode):
    """Every other token-level mode's chunk: one Triton launch and no aten kernel (with a KL term and an entropy
    bonus), the model's ``TERMS_LAUNCHES["fused"]``."""
    assert one_chunk_kernels(monkeypatch, True, True, mode) == _head_plan.TERMS_LAUNCHES["fused"] == 1
