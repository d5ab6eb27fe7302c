"""Differential fuzzing of every public op.

Hypothesis draws op x backend x dtype x layout x poison x hyper-parameter extremes; each
example runs the op on the drawn backend, on the float32 reference (same inputs, same
layout) and on the reference in float64 (the same values), forward and backward (a random
projection of the outputs), and where drawn also the second-order gradients.  The rules,
from ``ppo_fast.contract``:

* results have the reference's dtype and shape; a backend raises exactly where the
  reference raises, the same type (an out-of-range label on CPU eager: ValueError);
* NaN/+inf/-inf at the same output positions as the reference (NaN or inf at a valid
  position propagates one way on every backend; where only the float32 reference overflows,
  the float64 value is right too); a masked position (mask 0, a label equal to
  ignore_index) is never read: its outputs are exactly 0, its inputs get exactly 0
  gradient, and NaN/inf there changes nothing (against the reference on clean inputs);
* accuracy: ``|got - ref64| <= C * (|ref32 - ref64| + mean |ref32 - ref64|) + floor``: a few
  times the reference's own float32 error (apple/ml-cross-entropy's bound), plus as much
  again as float64 moves when the inputs move by an ulp (an ill-conditioned result), the
  floor a few ulps of the output's dtype (the input's dtype for gradients) at the tensor's scale;
  gradients where the reference's is finite (at a NaN input, or of a non-finite loss, they
  are unspecified);
* KL estimates are within 1e-4 relative of float64 where ``|log-ratio| >= 1e-4``, on every
  backend, the reference included (no cancellation in ``exp(r) - r - 1``);
* double backward: a backend raises, or gives the reference's second-order gradients (never
  zeros or None silently);
* ``torch.compile(fullgraph=True)`` (some examples ``dynamic=True``) follows the same rules.

A new op is one row of ``CASES`` (its inputs' builder in tests/harness.py, its hyper-parameter
strategy, its backends and CI budget); each registered policy-loss mode is a row by itself.
Budget: a fixed, derandomized budget per row (no example database): the fast tier runs half of
it, ``--full`` all of it (about 1.5 minutes on 2 cores); ``pytest --fuzz-examples=2000`` (or ``PPO_FAST_FUZZ_EXAMPLES=2000``) runs that many
random examples per test, for a nightly job.  The regressions the fuzzer found are tests of their own,
sharper than its bounds, in tests/test_edge_values.py.

PYTEST_DONT_REWRITE (the messages say what differs; pytest's rewriting would add tensor reprs)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Callable

import pytest
import torch
from harness import (
    DTYPES,
    F64,
    LAYOUTS,
    Spec,
    build_gae,
    build_group_advantages,
    build_kl_estimate,
    build_kl_penalized_rewards,
    build_linear_policy_loss,
    build_linear_token_logprobs,
    build_masked_stats,
    build_policy_loss,
    build_rollout_correction,
    build_token_logprobs,
    build_value_loss,
    poisoned,
    run,
)
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st

import ppo_fast as pf
from ppo_fast.advantage_methods import REGISTRY as ADVANTAGE_METHODS
from ppo_fast.backends import serving as backends_serving
from ppo_fast.ops.token_logprobs import MIN_TEMPERATURE
from ppo_fast.spec import AGG_MODES, KL_ESTIMATORS, POLICY_LOSS_MODES, ROLLOUT_CORRECTION_MODES

pytestmark = pytest.mark.fuzz

NIGHTLY = int(os.environ.get("PPO_FAST_FUZZ_EXAMPLES") or 0)
DTYPE_DRAWS = ("float32", "float32", "bfloat16", "float32", "float16", "float64")  # float32 half of the time
POISONS = ("clean", "masked", "valid", "valid", "bad_label")  # valid twice: nan / +inf / -inf share it
C_REF, K_REL, K_ABS = 16.0, 8.0, 2.0  # the accuracy bound's factors (module docstring)
KL_RTOL, KL_MIN_RATIO = 1e-4, 1e-4
UNDERFLOW = 1e-30  # an absolute floor: float32 results this small are noise (an exp flushed to 0 early)
F64_FLOOR = (1e-10, 1e-11)  # float64's (eps, tiny): no float128 truth measures the float64 reference's own error


def budget(ci_examples: int, scale: float = 1.0, shrink: bool = True) -> settings:
    """A fixed, database-less, derandomized budget for CI; N random examples when asked."""
    fixed = dict(derandomize=True, database=None) if not NIGHTLY else {}
    fixed["phases"] = [p for p in Phase if shrink or p != Phase.shrink]
    if not NIGHTLY and os.environ.get("PPO_FAST_FULL") != "1":
        ci_examples = max(1, ci_examples // 2)  # the fast tier: half the full tier's budget
    return settings(
        max_examples=max(1, int(NIGHTLY * scale)) if NIGHTLY else ci_examples,
        deadline=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
        **fixed,
    )


def serving(op: str) -> list[str]:
    """The reference and the fast backends that serve contract op ``op`` on CPU here."""
    fast = backends_serving(op, "cpu")
    return ["reference"] + [b for b in ("native", "triton") if b in fast]  # the order the derandomized draws follow


# --------------------------------------------------------------------------- hyper-parameters, at their ends

TEMPERATURES = st.one_of(
    st.sampled_from([MIN_TEMPERATURE, 1.5e-5, 1e-3]), st.sampled_from([1.0, 0.7]), st.floats(MIN_TEMPERATURE, 4.0)
)
RATIOS = st.sampled_from(["tiny", "normal", "wide", "huge"])
LOSS_RATIOS = st.sampled_from(["tiny", "normal", "wide", "huge", "huge"])  # exp(mean log-ratio) overflows (geo_mean)
UNIT = st.one_of(st.sampled_from([0.0, 1.0, 0.99, 0.95]), st.floats(0.0, 1.0))


def token_knobs(vocab):
    return st.fixed_dictionaries(
        {
            "temperature": TEMPERATURES,
            "scale": st.sampled_from([1e3, 30.0, 4.0, 1.0]),
            "labels": st.sampled_from(["greedy", "random", "mixed"]),
            "ignored": st.sampled_from([0.3, 0.3, 0.0, 1.0]),
            "ignore_index": st.one_of(st.integers(0, vocab - 1), st.sampled_from([-100, -1])),
            "entropy": st.booleans(),
        }
    )


def linear_knobs(dims):
    return token_knobs(dims[-1]).flatmap(
        lambda k: st.fixed_dictionaries(
            {
                **{name: st.just(v) for name, v in k.items()},
                "scale": st.sampled_from([1.0, 30.0, 4.0]),
                "logit_scale": st.sampled_from([1.0, 0.8, 3.0]),
                "softcap": st.sampled_from([None, 2.5, 30.0]),
                "bias": st.booleans(),
                "weight_layout": st.sampled_from(["contiguous", "transposed"]),
            }
        )
    )


def param_values(p):
    """A policy-loss mode's parameter at its ends (and its default, and in between)."""
    low = p.low if p.low is not None else -10.0
    ends = [low * (1 + 1e-6) + 1e-6 if p.low_open else low]
    if p.high is not None:
        ends.append(p.high * (1 - 1e-6) if p.high_open else p.high)
    else:
        ends.append(1e6)
    choices = ([None] if p.optional or p.same_as else []) + ([p.default] if p.default is not None else [])
    return st.one_of(st.sampled_from(choices + ends), st.floats(ends[0], min(ends[1], ends[0] + 10.0)))


def loss_knobs(name):
    mode = POLICY_LOSS_MODES[name]
    params = st.tuples(*(st.tuples(st.just(p.name), param_values(p)) for p in mode.params))
    return st.fixed_dictionaries(
        {
            "loss_mode": st.just(name),
            "params": params.map(lambda ps: tuple((n, v) for n, v in ps if v is not None)),
            "entry": st.sampled_from(["policy_loss", "clipped_policy_loss"] if name == "vanilla" else ["policy_loss"]),
            "agg": st.sampled_from((mode.default_agg,) + AGG_MODES),
            "weighted": st.booleans(),
            "ratio": LOSS_RATIOS,
            "adv_scale": st.sampled_from([1.0, 1e-3, 30.0]),
            "adv_sign": st.sampled_from(["mixed", "negative", "positive"]),
        }
    )


def one_pass_knobs():
    """A one-pass mode (drawn), its loss knobs and the head's, the KL and entropy terms' weights.  The
    temperature from 0.3: below, the logits' float32 rounding (any evaluation order's) outgrows the float32
    reference's own error, a bound the linear_token_logprobs row has (its builder's ``rounding``) and this
    one has not, so the lowest temperatures are fuzzed there."""
    modes = [name for name, mode in POLICY_LOSS_MODES.items() if mode.fused_head]
    head = {
        "temperature": st.one_of(st.sampled_from([0.3, 1.0, 4.0]), st.floats(0.3, 4.0)),
        "scale": st.sampled_from([1.0, 30.0, 4.0]),
        "logit_scale": st.sampled_from([1.0, 0.8, 3.0]),
        "softcap": st.sampled_from([None, 2.5, 30.0]),
        "bias": st.booleans(),
        "kl_coef": st.sampled_from([0.0, 0.1, 1e3]),
        "entropy_coef": st.sampled_from([0.0, 0.01, -1.0, 1e3]),
    }
    return st.sampled_from(modes).flatmap(
        lambda name: st.tuples(loss_knobs(name), st.fixed_dictionaries(head)).map(lambda ks: {**ks[0], **ks[1]})
    )


def advantage_knobs():
    def for_method(name):
        checks = {
            "norm_by_std": st.booleans(),
            "epsilon": st.sampled_from([1e-6, 0.0, 1.0]),
            "gamma": UNIT,
            "f_norm": st.sampled_from([1.0, 1e-6, 1e3]),
        }
        params = st.tuples(*(st.tuples(st.just(p), checks[p]) for p in ADVANTAGE_METHODS[name].params if p in checks))
        return st.fixed_dictionaries(
            {
                "method": st.just(name),
                "params": params,
                "token_scores": st.booleans(),
                "groups": st.integers(1, 3),
                "ties": st.booleans(),
                "scale": st.sampled_from([1.0, 1e3]),
            }
        )

    return st.sampled_from([n for n, e in ADVANTAGE_METHODS.items() if e.fn is not None]).flatmap(for_method)


def rollout_knobs():
    def low_for(k):
        lows = [0.0] if k["mode"].endswith("tis") else [0.0, k["threshold"] / 2, k["threshold"]]
        return st.fixed_dictionaries({**{n: st.just(v) for n, v in k.items()}, "threshold_low": st.sampled_from(lows)})

    return st.fixed_dictionaries(
        {
            "mode": st.sampled_from(ROLLOUT_CORRECTION_MODES),
            "threshold": st.sampled_from([2.0, 1.0, 1e-6, 1e3]),
            "batch_normalize": st.booleans(),
            "ratio": RATIOS,
        }
    ).flatmap(low_for)


@dataclasses.dataclass(frozen=True)
class Case:
    """One op (a row of the table): its inputs, hyper-parameters, backends and budget."""

    name: str
    build: Callable
    dims: st.SearchStrategy
    knobs: Callable[[tuple], st.SearchStrategy]
    backends: Callable[[dict], list[str]]
    ci_examples: int
    poisons: tuple = POISONS[:-1]
    compiles: bool = True


def size(*values):
    """A dimension (specs() makes one of the first two 0 now and then: empty inputs)."""
    return st.sampled_from(values)


BT = st.tuples(size(2, 1, 3, 4), size(3, 1, 5, 7, 2))
CASES = {
    case.name: case
    for case in [
        Case(
            "token_logprobs",
            build_token_logprobs,
            st.tuples(size(2, 1, 3), size(2, 1, 3), st.integers(1, 40)),
            lambda d: token_knobs(d[-1]),
            lambda k: serving("token_logprobs"),
            250,
            POISONS,
        ),
        Case(
            "linear_token_logprobs",
            build_linear_token_logprobs,
            st.tuples(size(2, 1, 3), size(2, 1, 3), st.integers(1, 12), st.integers(1, 40)),
            linear_knobs,
            lambda k: serving("linear_token_logprobs"),
            200,
            POISONS,
        ),
        Case(
            "kl_estimate",
            build_kl_estimate,
            BT,
            lambda d: st.fixed_dictionaries({"ratio": RATIOS}),
            lambda k: serving("kl_estimate"),
            200,
            ("clean", "valid", "valid"),
        ),
        Case(
            "kl_penalized_rewards",
            build_kl_penalized_rewards,
            BT,
            lambda d: st.fixed_dictionaries(
                {
                    "kl_estimator": st.sampled_from(KL_ESTIMATORS),
                    "ratio": RATIOS,
                    "kl_coef": st.one_of(st.sampled_from([0.0, 0.05, 1.0, 1e3]), st.floats(0.0, 10.0)),
                }
            ),
            lambda k: serving("kl_penalized_rewards"),
            120,
        ),
        Case(
            "gae",
            build_gae,
            st.tuples(size(2, 1, 3, 4), size(5, 1, 12, 2)),
            lambda d: st.fixed_dictionaries({"gamma": UNIT, "lam": UNIT, "scale": st.sampled_from([1.0, 1e3])}),
            lambda k: serving("gae"),
            80,
        ),
        Case(
            "value_loss",
            build_value_loss,
            BT,
            lambda d: st.fixed_dictionaries(
                {
                    "clip": st.sampled_from([None, 0.2, 1e-6, 1e6]),
                    "agg": st.sampled_from(AGG_MODES),
                    "old_values": st.booleans(),
                    "spread": st.sampled_from([1.0, 1e-3, 30.0]),
                }
            ).filter(lambda k: k["old_values"] or k["clip"] is None),
            lambda k: serving("value_loss"),
            80,
        ),
        Case(
            "group_advantages",
            build_group_advantages,
            BT,
            lambda d: advantage_knobs(),
            lambda k: [b for b in serving("group_sum") if b in ADVANTAGE_METHODS[k["method"]].backends],
            80,
        ),
        Case(
            "rollout_correction_weights",
            build_rollout_correction,
            BT,
            lambda d: rollout_knobs(),
            lambda k: ["reference"],
            40,
        ),
        Case(
            "masked_stats",
            build_masked_stats,
            BT,
            lambda d: st.fixed_dictionaries(
                {
                    "fn": st.sampled_from(["whiten", "mean"]),
                    "shift_mean": st.booleans(),
                    "eps": st.sampled_from([1e-8, 0.0, 1.0]),
                    "dim": st.sampled_from([None, -1, 0]),
                    "scale": st.sampled_from([1.0, 1e-3, 1e3]),
                    "offset": st.sampled_from([0.0, 1e3]),
                }
            ),
            lambda k: ["reference"],
            40,
            compiles=False,
        ),
    ]
}
# The one-pass loss, every mode that has one (drawn), on the backends that serve its op but the
# interpreted Triton (its loop is the matrix's and the two-pass comparison's; slow here).
CASES["linear_policy_loss"] = Case(
    "linear_policy_loss",
    build_linear_policy_loss,
    st.tuples(size(2, 1, 3), size(3, 1, 5, 2), st.integers(1, 12), st.integers(1, 40)),
    lambda d: one_pass_knobs(),
    lambda k: [b for b in serving(POLICY_LOSS_MODES[k["loss_mode"]].linear_op) if b != "triton"],
    60,
    compiles=False,  # compiled: the matrix's fullgraph cases (every backend, the reference sampled)
)
# Each registered policy-loss mode is a row: a bigger budget where a fast backend serves it.
for _mode in POLICY_LOSS_MODES.values():
    CASES[f"policy_loss_{_mode.name}"] = Case(
        f"policy_loss_{_mode.name}",
        build_policy_loss,
        BT,
        lambda d, m=_mode.name: loss_knobs(m),
        lambda k, op=_mode.op: serving(op),
        200 if len(serving(_mode.op)) > 1 else 25,
        compiles=not _mode.syncs_host,
    )


@st.composite
def specs(draw, case: Case, compiled: bool = False):
    dims = draw(case.dims)
    if draw(st.sampled_from(range(10))) == 5:  # empty: B = 0 or T = 0 (one in ten)
        zero = draw(st.sampled_from([0, 1]))
        dims = tuple(0 if i == zero else d for i, d in enumerate(dims))
    knobs = draw(case.knobs(dims))
    poisons = [p for p in case.poisons if p != "bad_label"] if compiled else case.poisons
    poison = draw(st.sampled_from(poisons))
    if poison == "valid":
        poison = draw(st.sampled_from(["valid nan", "valid inf", "valid -inf"]))
    backends = case.backends(knobs)  # the fast ones twice as often as the reference
    backends = [b for b in backends[::-1] for _ in range(1 if b == "reference" and len(backends) > 1 else 2)]
    return Spec(
        draw(st.sampled_from(backends)),
        draw(st.sampled_from(DTYPE_DRAWS)),
        draw(st.sampled_from(LAYOUTS)),
        poison,
        dims,
        knobs,
        draw(st.integers(0, 2**32 - 1)),
        draw(st.integers(0, 3)),
        not compiled and draw(st.integers(0, 3)) == 0,
    )


# --------------------------------------------------------------------------- running one backend


# --------------------------------------------------------------------------- the rules


def pattern(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    return torch.isnan(x).long() + 2 * (x == math.inf).long() + 3 * (x == -math.inf).long()


def first_at(x, bad):
    return f"at flat index {bad.flatten().nonzero()[0, 0].item()} of shape {tuple(x.shape)}"


def largest(x) -> float:
    """The largest finite |entry| (0 for None or none)."""
    finite = None if x is None else x[torch.isfinite(x)]
    return 0.0 if finite is None or not finite.numel() else float(finite.abs().max())


def nonzero(x) -> bool:
    return x is not None and bool(((x != 0) & torch.isfinite(x)).any())


def assert_accurate(what, got, ref32, ref64, moved, dtype, *, relaxed=None, rounding=None, floor=0.0):
    """``got`` within C x the float32 reference's own error of float64, plus C x how far float64
    moves when the inputs move by an ulp (``moved``: an ill-conditioned result, exp of a large
    mean, is that uncertain in any evaluation order), plus a floor, where the reference is
    finite; below the dtype's smallest normal number or 1e-30 (flushed subnormals, an exp
    that underflows a little early), or below ``floor`` (float64's own error), is no error."""
    eps, tiny = F64_FLOOR if dtype == F64 else (torch.finfo(dtype).eps, max(torch.finfo(dtype).tiny, UNDERFLOW))
    got, ref32, ref64, moved = (torch.zeros(()) if x is None else x.double() for x in (got, ref32, ref64, moved))
    got, ref32, ref64, moved = torch.broadcast_tensors(got, ref32, ref64, moved)
    keep = (
        torch.isfinite(ref32)
        & torch.isfinite(ref64)
        & torch.isfinite(moved)
        & (relaxed if relaxed is not None else True)
    )
    if not keep.any():
        return
    g, r, e = got[keep], ref32[keep], ref64[keep]
    ref_err, moved_by = (r - e).abs(), (moved[keep] - e).abs()
    allowed = (
        C_REF * (ref_err + ref_err.mean() + moved_by + moved_by.mean())
        + eps * (K_REL * e.abs() + K_ABS * e.abs().max())
        + tiny
        + floor
        + (0.0 if rounding is None else torch.broadcast_to(rounding.double(), keep.shape)[keep])
    )
    bad = ~((g - e).abs() <= allowed)
    assert not bad.any(), (
        f"{what}: |got - float64| > {C_REF:g} x the reference's float32 error + floor {first_at(g, bad)}: "
        f"got {g[bad][:4].tolist()}, float64 {e[bad][:4].tolist()}, float32 reference {r[bad][:4].tolist()}, "
        f"allowed {allowed[bad][:4].tolist()}"
    )


def moved_by_an_ulp(values: dict, dtype, gen) -> dict:
    """The inputs times ``1 + eps * u`` (``u`` uniform in [-1, 1], ``eps`` of the compute dtype)."""
    eps = torch.finfo(F64 if dtype == F64 else torch.float32).eps
    return {n: v * (1 + eps * (2 * torch.rand(v.shape, generator=gen, dtype=F64) - 1)) for n, v in values.items()}


def check(case: Case, spec: Spec, compiled=None):
    note(f"{case.name} on {spec.backend}{'' if compiled is None else f' compiled (dynamic={compiled})'}: {spec}")
    gen = torch.Generator().manual_seed(spec.seed)
    built = case.build(spec, gen, spec.knobs)
    values = poisoned(built, spec, gen)
    dtype = DTYPES[spec.dtype]
    ref32 = run(built, spec, values, "reference", dtype, second_order=spec.second_order)
    got = run(
        built, spec, values, spec.backend, dtype, ref32.projection, compiled=compiled, second_order=spec.second_order
    )
    # NaN/inf at masked positions is never read: the truth is that of the clean inputs.
    masked_poison = spec.poison == "masked"
    clean = {name: inp.values for name, inp in built.inputs.items()} if masked_poison else values
    ref64 = run(built, spec, clean, "reference", F64, ref32.projection, second_order=spec.second_order)
    clean32 = run(built, spec, clean, "reference", dtype, ref32.projection) if masked_poison else ref32
    moved = run(
        built,
        spec,
        moved_by_an_ulp(clean, dtype, gen),
        "reference",
        F64,
        ref32.projection,
        second_order=spec.second_order,
    )
    if compiled is not None:
        assume(ref32.error is None)  # value checks are skipped when compiled: another contract
    if ref32.error is not None or got.error is not None:
        assert type(got.error) is type(ref32.error), (
            f"the reference raises {ref32.error!r}, {spec.backend} {got.error!r}"
        )
        return
    assert ref64.error is None and clean32.error is None and moved.error is None, (
        f"the reference raises on float64 or clean inputs: {ref64.error or clean32.error or moved.error!r}"
    )
    assert len(got.outputs) == len(ref32.outputs)
    for i, (o, r, e, c, m) in enumerate(zip(got.outputs, ref32.outputs, ref64.outputs, clean32.outputs, moved.outputs)):
        what = f"output {i} of {case.name} on {spec.backend}"
        assert (o.dtype, o.shape) == (r.dtype, r.shape), (
            f"{what}: {o.dtype}{tuple(o.shape)}, the reference's {r.dtype}{tuple(r.shape)}"
        )
        if i in built.differentiable and got.grads:
            assert got.requires_grad[i], f"{what} does not require grad although its inputs do"
        # Where the float32 reference overflows and float64 does not, a backend may be right instead.
        closer = torch.isinf(r) & torch.isfinite(e) & ((o.double() - e).abs() <= 1e-3 * e.abs())
        bad = (pattern(o) != pattern(r)) & ~closer
        assert not bad.any(), (
            f"{what}: NaN/inf where the reference is not (or not where it is) {first_at(o, bad)}: "
            f"got {o[bad][:4].tolist()}, reference {r[bad][:4].tolist()}"
        )
        bad = (pattern(r) != pattern(c)) | (pattern(o) != pattern(c)) & ~closer
        assert not bad.any(), (
            f"{what}: NaN/inf at masked positions changes the result {first_at(o, bad)}: "
            f"got {o[bad][:4].tolist()}, clean {c[bad][:4].tolist()}"
        )
        if i in built.zero_out:
            bad = (o != 0) & built.zero_out[i]
            assert not bad.any(), f"{what}: nonzero at a masked position {first_at(o, bad)}: {o[bad][:4].tolist()}"
        assert_accurate(what, o, r, e, m, r.dtype, rounding=built.rounding.get(i))
        if i in built.kl_ratio and o.dtype != F64:
            ratio = built.kl_ratio[i].to(dtype).double()
            sel = (ratio.abs() >= KL_MIN_RATIO) & torch.isfinite(e) & torch.isfinite(ratio)
            err = ((o.double() - e).abs() / e.abs().clamp_min(1e-300))[sel]
            bad = ~(err <= KL_RTOL)
            assert not bad.any(), (
                f"{what}: relative error {err[bad][:4].tolist()} > {KL_RTOL:g} vs float64 at log-ratios "
                f"{ratio[sel][bad][:4].tolist()} (|r| >= {KL_MIN_RATIO:g}): got {o.double()[sel][bad][:4].tolist()}, "
                f"float64 {e[sel][bad][:4].tolist()}"
            )
    if any(ref32.outputs[i].dim() == 0 and not torch.isfinite(ref32.outputs[i]) for i in built.differentiable):
        return  # the gradient of a non-finite loss is unspecified
    for name, g in got.grads.items():
        what = f"gradient of {name} ({case.name} on {spec.backend})"
        r, e, c = ref32.grads[name], ref64.grads[name], clean32.grads[name]
        if g is not None and r is not None:
            assert g.dtype == r.dtype and g.shape == r.shape, (
                f"{what}: {g.dtype}{tuple(g.shape)}, the reference's {r.dtype}{tuple(r.shape)}"
            )
            bad = ~torch.isfinite(g) & torch.isfinite(r)
            assert not bad.any(), (
                f"{what}: not finite where the reference's is {first_at(g, bad)}: {g[bad][:4].tolist()}"
            )
        if r is not None and c is not None:
            bad = ~torch.isfinite(r) & torch.isfinite(c)
            assert not bad.any(), (
                f"{what}: NaN/inf at masked positions reaches the reference's gradient {first_at(r, bad)}"
            )
        masked = built.inputs[name].masked
        if g is not None and masked is not None:
            bad = (got.views[name](g) != 0) & masked
            assert not bad.any(), (
                f"{what}: nonzero at a masked position {first_at(masked, bad)}: {got.views[name](g)[bad][:4].tolist()}"
            )
        # The gradient at a NaN/inf input itself is unspecified: compared where the reference's is finite.
        relaxed = None if r is None else torch.isfinite(r)
        floor = built.grad_floor + built.grad_rounding * largest(e)
        assert_accurate(what, g, r, e, moved.grads[name], dtype, relaxed=relaxed, floor=floor)
    if spec.second_order:
        assert ref32.second_error is None and ref64.second_error is None, (
            f"the reference's double backward raises: {ref32.second_error!r}"
        )
        if got.second_error is None:  # it claims double backward: the reference's values
            for name in got.grads:
                g, r, e = got.second[name], ref32.second[name], ref64.second[name]
                assert nonzero(g) or not (nonzero(r) and nonzero(e)), (
                    f"second-order gradient of {name} ({case.name} on {spec.backend}) is zero/None without an error "
                    f"(the reference's is not): a backend without double backward must raise"
                )
                assert_accurate(
                    f"second-order gradient of {name} ({case.name} on {spec.backend})",
                    g,
                    r,
                    e,
                    moved.second[name],
                    dtype,
                    relaxed=None if r is None else torch.isfinite(r),
                )


# --------------------------------------------------------------------------- the tests


def _make_test(case: Case):
    @budget(case.ci_examples)
    @given(spec=specs(case))
    def test(spec):
        check(case, spec)

    test.__name__ = f"test_fuzz_{case.name}"
    test.__doc__ = f"{case.name}: every backend against the reference and float64 (module docstring)."
    return test


for _case in CASES.values():
    globals()[f"test_fuzz_{_case.name}"] = _make_test(_case)


@budget(8, scale=1 / 20, shrink=False)  # each example compiles: no shrinking
@given(data=st.data())
def test_fuzz_compiled(data):
    """A few examples under torch.compile(fullgraph=True), static or dynamic shapes."""
    case = data.draw(
        st.sampled_from([c for c in CASES.values() if c.compiles]), label="case"
    )  # not the host-syncing modes
    spec = data.draw(specs(case, compiled=True), label="spec")
    torch._dynamo.reset()
    check(case, spec, compiled=data.draw(st.booleans(), label="dynamic"))


@budget(40)
@given(data=st.data())
def test_fuzz_cu_seqlens(data):
    """Random lengths (empty sequences included) and random corruptions of ``cu_seqlens``: a valid one
    gives the padded layout's advantages at the valid tokens bit for bit; any other a named error."""
    lengths = data.draw(st.lists(st.integers(0, 7), min_size=0, max_size=6), label="lengths")
    ends = [0, *itertools.accumulate(lengths)]
    tokens = ends[-1]
    corruption = data.draw(st.sampled_from(["none", "start", "order", "end", "dtype", "shape"]), label="corruption")
    if corruption == "start":
        ends[0] = data.draw(st.integers(1, 3))
    elif corruption == "order" and len(ends) > 2:
        ends[1], ends[2] = ends[2] + 1, ends[1]
    elif corruption == "end":
        ends[-1] += data.draw(st.sampled_from([-1, 1, 1000]))
    cu_seqlens = torch.tensor(ends, dtype=torch.float32 if corruption == "dtype" else torch.int64)
    if corruption == "shape":
        cu_seqlens = cu_seqlens[None]
    rewards, values = torch.randn(tokens), torch.randn(tokens)
    mask = torch.rand(tokens) > 0.2
    broken = [0, *itertools.accumulate(lengths)] != ends or corruption in ("dtype", "shape")
    if broken:
        with pytest.raises((TypeError, ValueError), match="cu_seqlens"):
            pf.gae(rewards, values, mask, gamma=0.9, lam=0.9, cu_seqlens=cu_seqlens)
        return
    got, _ = pf.gae(rewards, values, mask, gamma=0.9, lam=0.9, cu_seqlens=cu_seqlens)
    width = max(lengths, default=0)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
    padded = [torch.zeros(len(lengths), width, dtype=x.dtype).masked_scatter(valid, x) for x in (rewards, values, mask)]
    want, _ = pf.gae(*padded, gamma=0.9, lam=0.9)
    assert torch.equal(got, want[valid])
