"""The Triton one-pass loss's fused per-token terms (``triton/_policy_terms.py``, the vanilla mode): per
chunk equal to the generic path (``_one_pass._per_token_grads``, the reference's ``chunk_terms`` under
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


def chunked(logp, entropy, x, objective, terms, *, rows, fused: bool):
    """The chunks' summed terms and the ``[B, T]`` gradients of one path, in the head's chunks."""
    policy_terms, head = modules()
    batch, length = logp.shape
    scales = loss_scales(x.mask, objective.agg)
    state = policy_terms.Batch(x, objective, terms) if fused else None
    g_logp, g_entropy, totals = torch.zeros_like(logp), torch.zeros_like(entropy), None
    for rs, bs in head._token_chunks(batch, length, rows, packed=x.scale is not None):
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
        PerToken(*(t if t is None or t.dtype == torch.bool else t.double() for t in x)),
    )


def assert_terms_close(got, want, rtol, atol):
    (totals, g_logp, g_entropy), (want_totals, want_g, want_ge) = got, want
    policy_terms, _ = modules()
    for name, a, b in zip(policy_terms.TOTALS, totals, want_totals):
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


@pytest.mark.parametrize("dual", [None, 2.0])
def test_a_ratio_exactly_on_a_clip_bound_gets_the_unclipped_derivative(dual):
    """At ratio == 1 - clip_eps_low and 1 + clip_eps_high exactly (docs/ops.md: not clipped, the
    unclipped derivative -A r) the fused gradient is the generic path's, token for token."""
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
        ratio_at = torch.exp((logp - x.old)[:, ::3][x.mask[:, ::3]])
        assert ((ratio_at == 1.0 - low) | (ratio_at == 1.0 + high)).float().mean() > 0.5  # the ties are there
        objective = Objective(VANILLA, (low, high, dual), "token-mean")
        terms = Terms(0.0, "k3", 0.0)
        got = chunked(logp, entropy, x, objective, terms, rows=9, fused=True)
        want = chunked(logp, entropy, x, objective, terms, rows=9, fused=False)
        assert_terms_close(got, want, 1e-6, 1e-7)
        assert float(got[0][4]) == float(want[0][4])  # clipfrac: a tie is not clipped


def test_extreme_log_ratios_pass_no_gradient_beyond_the_exp_clamp():
    """|logp - old| > 20: the ratio is exp(+-20) and the clamp passes no gradient, as the reference."""
    logp, entropy, x = per_token(3, (3, 8), dtype=torch.float32, weighted=True, with_ref=True, packed=False)
    x = x._replace(old=torch.where(torch.arange(8) % 2 == 0, logp - 30.0, logp + 30.0))
    objective = Objective(VANILLA, CLIPS["dual"], "seq-mean-token-mean")
    got = chunked(logp, entropy, x, objective, Terms(0.1, "k2", 0.01), rows=8, fused=True)
    want = chunked(logp, entropy, x, objective, Terms(0.1, "k2", 0.01), rows=8, fused=False)
    assert_terms_close(got, want, 2e-5, 2e-6)


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


def loss_call(x, valid, *, agg, kl, entropy_coef, clip, backend="triton"):
    """``pf.linear_policy_loss`` (vanilla) on ``x``, padded, or with ``valid`` its valid tokens packed."""
    packed, layout = x, {}
    if valid is not None:
        packed = {k: v if k in ("weight", "bias") or v is None else v[valid] for k, v in x.items()}
        lengths = valid.sum(-1)
        layout = dict(cu_seqlens=torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32), max_seqlen=7)
    args = [packed[n] for n in ("hidden", "weight", "labels", "old", "adv", "mask")]
    low, high, dual = CLIPS[clip]
    terms = dict(weights=packed["weights"], bias=x["bias"], ref_logprobs=None if kl is None else packed["ref"])
    with pf.use_backend(backend):
        loss, stats = pf.linear_policy_loss(
            *args,
            **terms,
            kl_coef=0.0 if kl is None else 0.1,
            kl_estimator=kl or "k3",
            entropy_coef=entropy_coef,
            agg=agg,
            clip_eps_low=low,
            clip_eps_high=high,
            dual_clip=dual,
            **layout,
        )
    return loss.detach(), stats, torch.autograd.grad(loss * 1.7, lpl.leaves(x))


@pytest.mark.parametrize(list(OP_AXES), OP_CASES)
def test_linear_policy_loss_fused_equals_the_generic_path_and_float64(
    monkeypatch, agg, kl, clip, entropy_coef, packed, dtype
):
    """Through the op (chunks of two sequences, or 14 packed tokens cutting through sequences): the fused
    terms give the generic path's loss, stats and gradients, and the float64 reference's."""
    policy_terms, _ = modules()
    launches = count_launches(monkeypatch, policy_terms)
    x = lpl.make_inputs(
        zlib.crc32(f"{agg}-{kl}-{clip}-{packed}".encode()), dtype=dtype, dims=(5, 7, 53, 13), weighted=True
    )
    valid = None
    if packed:
        valid = torch.arange(7)[None, :] < torch.tensor(PACKED_LENGTHS)[:, None]
        x["mask"] = x["mask"] & valid
    options = dict(agg=agg, kl=kl, entropy_coef=entropy_coef, clip=clip)
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


def count_launches(monkeypatch, policy_terms) -> collections.Counter:
    """Counts the fused kernel's launches (``["kernel"]``) from now on."""
    seen = collections.Counter()
    kernel = policy_terms._vanilla_terms_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["kernel"] += 1
                with _disable_current_modes():  # the interpreter's own tensor work is no launch
                    return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(policy_terms, "_vanilla_terms_kernel", Counted())
    return seen


@pytest.mark.parametrize(
    "mode, dtype, fused",
    [
        ("vanilla", torch.float32, True),
        ("vanilla", torch.float16, True),
        ("vanilla", torch.float64, False),
        ("sapo", torch.float32, False),
    ],
)
def test_which_calls_take_the_fused_terms(monkeypatch, mode, dtype, fused):
    """The dispatch is on the arguments: vanilla with inputs of at most 32 bits is fused (a launch a
    chunk), float64 inputs (float64 terms) and every other mode take ``_per_token_grads``."""
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
        )
    chunks = 3  # 5 sequences, two a chunk
    assert (launches["kernel"], generic["call"]) == ((chunks, 0) if fused else (0, chunks))
    assert torch.isfinite(loss)


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


def one_chunk_kernels(monkeypatch, fused: bool, with_ref: bool) -> int:
    """The kernels of one chunk's terms and gradient (vanilla, token-mean, an entropy bonus; a k3 KL term
    where ``with_ref``) on a [4, 96] chunk, counted on CPU: a proxy for the launches on CUDA."""
    policy_terms, _ = modules()
    logp, entropy, x = per_token(0, (4, 96), dtype=torch.float32, weighted=False, with_ref=with_ref, packed=False)
    objective, terms = Objective(VANILLA, CLIPS["default"], "token-mean"), Terms(0.1, "k3", 0.01)
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


def test_the_fused_terms_once_a_call():
    """What the fused path launches once a call besides its chunks (the normalisers, the totals' zeros and
    results) is the model's ``TERMS_CALL_LAUNCHES["fused"]``."""
    policy_terms, _ = modules()
    logp, entropy, x = per_token(0, (4, 96), dtype=torch.float32, weighted=False, with_ref=True, packed=False)
    with CountKernels() as count:
        policy_terms.Batch(x, Objective(VANILLA, CLIPS["default"], "token-mean"), Terms(0.1, "k3", 0.01)).results()
    assert count.kernels() == _head_plan.TERMS_CALL_LAUNCHES["fused"]


@pytest.mark.parametrize("with_ref", [False, True])
def test_the_models_launch_counts_are_the_paths_counts(monkeypatch, with_ref):
    """``_head_plan.TERMS_LAUNCHES`` (what ``bench head_model`` charges a chunk) against the counts: the
    fused path one Triton launch and no aten kernel; the generic path its leaf aten kernels on CPU, within
    15% (they vary a little with torch's decompositions)."""
    assert one_chunk_kernels(monkeypatch, True, with_ref) == _head_plan.TERMS_LAUNCHES["fused"] == 1
    generic = one_chunk_kernels(monkeypatch, False, with_ref)
    modelled = _head_plan.TERMS_LAUNCHES["generic, KL" if with_ref else "generic"]
    assert math.isclose(generic, modelled, rel_tol=0.15), (generic, modelled)
