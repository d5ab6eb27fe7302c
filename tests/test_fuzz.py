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
random examples per test, for a nightly job; ``PPO_FAST_FUZZ_SCALE=10`` runs every row's budget ten times over, random draws.  The regressions the fuzzer found are tests of their own,
sharper than its bounds, in tests/test_edge_values.py.

PYTEST_DONT_REWRITE (the messages say what differs; pytest's rewriting would add tensor reprs)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import itertools
import math
import os
from collections.abc import Callable

import harness
import pytest
import torch
from harness import DTYPES, F64, LAYOUTS, Spec, poisoned, run
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st

import ppo_fast as pf
from ppo_fast.advantage_methods import REGISTRY as ADVANTAGE_METHODS
from ppo_fast.backends import serving as backends_serving
from ppo_fast.ops.token_logprobs import MIN_TEMPERATURE
from ppo_fast.spec import AGG_MODES, KL_ESTIMATORS, POLICY_LOSS_MODES, ROLLOUT_CORRECTION_MODES

pytestmark = pytest.mark.fuzz

NIGHTLY = int(os.environ.get("PPO_FAST_FUZZ_EXAMPLES") or 0)
SCALE = float(os.environ.get("PPO_FAST_FUZZ_SCALE") or 1)  # every row's budget times this, random draws
DTYPE_DRAWS = ("float32", "float32", "bfloat16", "float32", "float16", "float64")  # float32 half of the time
POISONS = ("clean", "masked", "valid", "valid", "bad_label")  # valid twice: nan / +inf / -inf share it
C_REF, K_REL, K_ABS = 16.0, 8.0, 2.0  # the accuracy bound's factors (module docstring)
KL_RTOL, KL_MIN_RATIO = 1e-4, 1e-4
UNDERFLOW = 1e-30  # an absolute floor: float32 results this small are noise (an exp flushed to 0 early)
F64_FLOOR = (1e-10, 1e-11)  # float64's (eps, tiny): no float128 truth measures the float64 reference's own error


def budget(ci_examples: int, scale: float = 1.0, shrink: bool = True) -> settings:
    """A fixed, database-less, derandomized budget for CI; N random examples when asked."""
    fixed = dict(deadline=None, print_blob=True, suppress_health_check=list(HealthCheck))
    fixed["phases"] = [p for p in Phase if shrink or p != Phase.shrink]
    if not NIGHTLY and SCALE == 1:
        fixed.update(derandomize=True, database=None)
    if not NIGHTLY and os.environ.get("PPO_FAST_FULL") != "1":
        ci_examples = max(1, ci_examples // 2)  # the fast tier: half the full tier's budget
    ci_examples = max(1, int(ci_examples * SCALE))
    return settings(max_examples=max(1, int(NIGHTLY * scale)) if NIGHTLY else ci_examples, **fixed)


def serving(op: str) -> list[str]:
    """The reference and the fast backends that serve contract op ``op`` on CPU here."""
    fast = backends_serving(op, "cpu")
    return ["reference"] + [b for b in ("native", "triton") if b in fast]  # the order the derandomized draws follow


# --------------------------------------------------------------------------- hyper-parameters, at their ends

pick, knobs = st.sampled_from, lambda **strategies: st.fixed_dictionaries(strategies)
TEMPERATURES = st.one_of(pick([MIN_TEMPERATURE, 1.5e-5, 1e-3]), pick([1.0, 0.7]), st.floats(MIN_TEMPERATURE, 4.0))
RATIOS = pick(["tiny", "normal", "wide", "huge"])
# huge: exp(mean log-ratio) overflows (geo_mean); tie: every ratio exactly on a clip bound
LOSS_RATIOS = pick(["tiny", "normal", "wide", "huge", "huge", "tie"])
UNIT = st.one_of(pick([0.0, 1.0, 0.99, 0.95]), st.floats(0.0, 1.0))
SCALES = pick([1.0, 1e3])
# The fused head's (the LM-head ops'), over the logits' own.
# cotangent: the scale of the backward's random projection (harness.run); small ones are where a float16
# gradient of the head's logits underflows unless it is scaled before rounding.
HEAD = dict(
    scale=pick([1.0, 30.0, 4.0]),
    logit_scale=pick([1.0, 0.8, 3.0]),
    softcap=pick([None, 2.5, 30.0]),
    cotangent=pick([1.0, 1.0, 1e-4, 1e-7]),
)


def extended(k: dict, **more) -> st.SearchStrategy:
    """The knobs ``k`` drawn, and ``more`` (a knob of ``k`` drawn again, in its place)."""
    return knobs(**{**{name: st.just(v) for name, v in k.items()}, **more})


def token_knobs(dims):
    return knobs(
        temperature=TEMPERATURES,
        scale=pick([1e3, 30.0, 4.0, 1.0]),
        labels=pick(["greedy", "random", "mixed"]),
        ignored=pick([0.3, 0.3, 0.0, 1.0]),
        ignore_index=st.one_of(st.integers(0, dims[-1] - 1), pick([-100, -1])),
        entropy=st.booleans(),
    )


def linear_knobs(dims):
    head = dict(HEAD, bias=st.booleans(), weight_layout=pick(["contiguous", "transposed"]))
    return token_knobs(dims).flatmap(lambda k: extended(k, **head))


def param_values(p):
    """A policy-loss mode's parameter at its ends (and its default, and in between)."""
    low = p.low if p.low is not None else -10.0
    ends = [low * (1 + 1e-6) + 1e-6 if p.low_open else low]
    ends.append(1e6 if p.high is None else p.high * (1 - 1e-6) if p.high_open else p.high)
    choices = ([None] if p.optional or p.same_as else []) + ([p.default] if p.default is not None else [])
    return st.one_of(pick(choices + ends), st.floats(ends[0], min(ends[1], ends[0] + 10.0)))


def loss_knobs(name):
    mode = POLICY_LOSS_MODES[name]
    params = st.tuples(*(st.tuples(st.just(p.name), param_values(p)) for p in mode.params))
    return knobs(
        loss_mode=st.just(name),
        params=params.map(lambda ps: tuple((n, v) for n, v in ps if v is not None)),
        entry=pick(["policy_loss", "clipped_policy_loss"] if name == "vanilla" else ["policy_loss"]),
        agg=pick((mode.default_agg,) + AGG_MODES),
        weighted=st.booleans(),
        ratio=LOSS_RATIOS,
        adv_scale=pick([1.0, 1e-3, 30.0]),
        adv_sign=pick(["mixed", "negative", "positive"]),
    )


# The sampler's truncation in the one pass (harness.build_linear_policy_loss: the rows' likeliest tokens as
# labels), half of the draws, at its ends: one token kept (top_k 1, a top_p below any p, min_p near 1) and
# the three rules together.
ONE_PASS_TRUNCATIONS = st.one_of(
    st.just(()),
    pick(
        [
            (("top_k", 1),),
            (("top_k", 3),),
            (("top_p", 1e-6),),
            (("top_p", 0.9),),
            (("min_p", 0.9),),
            (("min_p", 0.05), ("top_p", 0.9), ("top_k", 2)),
        ]
    ),
)


def one_pass_knobs():
    """A one-pass mode (drawn), its loss knobs and the head's, the KL and entropy terms' weights, and the
    layout: padded, or packed (``cu_seqlens``, each row's tokens up to its last valid one: ``harness.packed``).  The
    temperature from 0.3: below, the logits' float32 rounding (any evaluation order's) outgrows the float32
    reference's own error, a bound the linear_token_logprobs row has (its builder's ``rounding``) and this
    one has not, so the lowest temperatures are fuzzed there."""
    modes = [name for name, mode in POLICY_LOSS_MODES.items() if mode.fused_head]
    temperature = st.one_of(pick([0.3, 1.0, 4.0]), st.floats(0.3, 4.0))
    terms = dict(kl_coef=pick([0.0, 0.1, 1e3]), entropy_coef=pick([0.0, 0.01, -1.0, 1e3]))
    head = knobs(
        temperature=temperature,
        **HEAD,
        bias=st.booleans(),
        **terms,
        truncation=ONE_PASS_TRUNCATIONS,
        packed=st.booleans(),
    )
    return pick(modes).flatmap(lambda name: st.tuples(loss_knobs(name), head).map(lambda ks: {**ks[0], **ks[1]}))


def one_pass_backends(k: dict, _) -> list[str]:
    return [b for b in serving(POLICY_LOSS_MODES[k["loss_mode"]].linear_op) if b != "triton"]


def advantage_knobs():
    def for_method(name):
        checks = dict(
            norm_by_std=st.booleans(), epsilon=pick([1e-6, 0.0, 1.0]), gamma=UNIT, f_norm=pick([1.0, 1e-6, 1e3])
        )
        params = st.tuples(*(st.tuples(st.just(p), checks[p]) for p in ADVANTAGE_METHODS[name].params if p in checks))
        groups = dict(token_scores=st.booleans(), groups=st.integers(1, 3), ties=st.booleans(), scale=SCALES)
        return knobs(method=st.just(name), params=params, **groups)

    return pick([n for n, e in ADVANTAGE_METHODS.items() if e.fn is not None]).flatmap(for_method)


def advantage_backends(k: dict, op: str) -> list[str]:
    return [b for b in serving(op) if b in ADVANTAGE_METHODS[k["method"]].backends]


def rollout_knobs(k):
    lows = [0.0] if k["mode"].endswith("tis") else [0.0, k["threshold"] / 2, k["threshold"]]
    return extended(k, threshold_low=pick(lows))


@dataclasses.dataclass(frozen=True)
class Case:
    """One op (a row of the table): its hyper-parameters (a strategy, or one of the dims), CI budget, inputs
    (``harness.build_<name>`` by default) and backends (of the knobs and ``op``, by default the case's name:
    the reference and those serving it)."""

    name: str
    dims: st.SearchStrategy
    knobs: st.SearchStrategy | Callable[[tuple], st.SearchStrategy]
    ci_examples: int
    poisons: tuple = POISONS[:-1]
    compiles: bool = True
    op: str | None = None
    backends: Callable[[dict, str], list[str]] = lambda k, op: serving(op)
    build: Callable | None = None


def size(*values):
    """A dimension (specs() makes one of the first two 0 now and then: empty inputs)."""
    return pick(values)


ROWS, VOCAB, H = size(2, 1, 3), st.integers(1, 40), st.integers(1, 12)
BT = st.tuples(size(2, 1, 3, 4), size(3, 1, 5, 7, 2))
ONE_PASS_DIMS = st.tuples(ROWS, size(3, 1, 5, 2), H, VOCAB)
KL_COEFS = st.one_of(pick([0.0, 0.05, 1.0, 1e3]), st.floats(0.0, 10.0))
VALUE_KNOBS = knobs(
    clip=pick([None, 0.2, 1e-6, 1e6]), agg=pick(AGG_MODES), old_values=st.booleans(), spread=pick([1.0, 1e-3, 30.0])
).filter(lambda k: k["old_values"] or k["clip"] is None)
ROLLOUT_KNOBS = knobs(
    mode=pick(ROLLOUT_CORRECTION_MODES),
    threshold=pick([2.0, 1.0, 1e-6, 1e3]),
    batch_normalize=st.booleans(),
    ratio=RATIOS,
).flatmap(rollout_knobs)
STATS = dict(fn=pick(["whiten", "mean"]), shift_mean=st.booleans(), eps=pick([1e-8, 0.0, 1.0]), dim=pick([None, -1, 0]))
STATS_KNOBS = knobs(**STATS, scale=pick([1.0, 1e-3, 1e3]), offset=pick([0.0, 1e3]))
CASES = {
    case.name: case
    for case in [
        Case("token_logprobs", st.tuples(ROWS, ROWS, VOCAB), token_knobs, 250, POISONS),
        Case("linear_token_logprobs", st.tuples(ROWS, ROWS, H, VOCAB), linear_knobs, 120, POISONS),
        Case("kl_estimate", BT, knobs(ratio=RATIOS), 200, ("clean", "valid", "valid")),
        Case("kl_penalized_rewards", BT, knobs(kl_estimator=pick(KL_ESTIMATORS), ratio=RATIOS, kl_coef=KL_COEFS), 120),
        Case("gae", st.tuples(size(2, 1, 3, 4), size(5, 1, 12, 2)), knobs(gamma=UNIT, lam=UNIT, scale=SCALES), 80),
        Case("value_loss", BT, VALUE_KNOBS, 80),
        Case("group_advantages", BT, advantage_knobs(), 80, op="group_sum", backends=advantage_backends),
        Case("rollout_correction_weights", BT, ROLLOUT_KNOBS, 40),
        Case("masked_stats", BT, STATS_KNOBS, 40, compiles=False),
        # The one-pass loss, every mode that has one (drawn), on the backends that serve its op but the
        # interpreted Triton (its loop is the matrix's and the two-pass comparison's; slow here); compiled:
        # the matrix's fullgraph cases (every backend, the reference sampled).
        Case("linear_policy_loss", ONE_PASS_DIMS, one_pass_knobs(), 60, compiles=False, backends=one_pass_backends),
    ]
    # Each registered policy-loss mode is a row: a bigger budget where a fast backend serves it.
    + [
        Case(
            f"policy_loss_{m.name}",
            BT,
            loss_knobs(m.name),
            200 if len(serving(m.op)) > 1 else 25,
            compiles=not m.syncs_host,
            op=m.op,
            build=harness.build_policy_loss,
        )
        for m in POLICY_LOSS_MODES.values()
    ]
}


@st.composite
def specs(draw, case: Case, compiled: bool = False):
    dims = draw(case.dims)
    if draw(pick(range(10))) == 5:  # empty: B = 0 or T = 0 (one in ten)
        zero = draw(pick([0, 1]))
        dims = tuple(0 if i == zero else d for i, d in enumerate(dims))
    drawn = draw(case.knobs(dims) if callable(case.knobs) else case.knobs)
    poison = draw(pick([p for p in case.poisons if p != "bad_label"] if compiled else case.poisons))
    if poison == "valid":
        poison = draw(pick(["valid nan", "valid inf", "valid -inf"]))
    backends = case.backends(drawn, case.op or case.name)  # the fast ones twice as often as the reference
    backends = [b for b in backends[::-1] for _ in range(1 if b == "reference" and len(backends) > 1 else 2)]
    backend, dtype, layout = draw(pick(backends)), draw(pick(DTYPE_DRAWS)), draw(pick(LAYOUTS))
    seed, poison_input = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 3))
    second_order = not compiled and draw(st.integers(0, 3)) == 0
    return Spec(backend, dtype, layout, poison, dims, drawn, seed, poison_input, second_order)


# --------------------------------------------------------------------------- the rules


def pattern(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    return torch.isnan(x).long() + 2 * (x == math.inf).long() + 3 * (x == -math.inf).long()


def refuse(bad: torch.Tensor, what: str, rule: str, **shown):
    """Fails where ``bad``: ``what`` breaks ``rule``, at the first such entry, with the first four of
    each of ``shown`` (tensors of ``bad``'s shape) there."""
    if bad.any():
        at = f"at flat index {bad.flatten().nonzero()[0, 0].item()} of shape {tuple(bad.shape)}"
        values = ", ".join(f"{name} {x[bad][:4].tolist()}" for name, x in shown.items())
        raise AssertionError(f"{what}: {rule} {at}: {values}")


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
    keep = torch.isfinite(torch.stack([ref32, ref64, moved])).all(0) & (True if relaxed is None else relaxed)
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
    rule = f"|got - float64| > {C_REF:g} x the reference's float32 error + floor"
    refuse(~((g - e).abs() <= allowed), what, rule, got=g, float64=e, reference32=r, allowed=allowed)


def moved_by_an_ulp(values: dict, dtype, gen) -> dict:
    """The inputs times ``1 + eps * u`` (``u`` uniform in [-1, 1], ``eps`` of the compute dtype)."""
    eps = torch.finfo(F64 if dtype == F64 else torch.float32).eps
    return {n: v * (1 + eps * (2 * torch.rand(v.shape, generator=gen, dtype=F64) - 1)) for n, v in values.items()}


def check(case: Case, spec: Spec, compiled=None):
    note(f"{case.name} on {spec.backend}{'' if compiled is None else f' compiled (dynamic={compiled})'}: {spec}")
    gen = torch.Generator().manual_seed(spec.seed)
    built = (case.build or getattr(harness, f"build_{case.name}"))(spec, gen, spec.knobs)
    built = harness.without_interpreter_bf16_subnormals(built, spec)
    values, dtype, second = poisoned(built, spec, gen), DTYPES[spec.dtype], spec.second_order
    ref32 = run(built, spec, values, "reference", dtype, second_order=second)
    again = lambda values, backend, dtype, **kw: run(built, spec, values, backend, dtype, ref32.projection, **kw)  # noqa: E731
    got = again(values, spec.backend, dtype, compiled=compiled, second_order=second)
    # NaN/inf at masked positions is never read: the truth is that of the clean inputs.
    masked_poison = spec.poison == "masked"
    clean = {name: inp.values for name, inp in built.inputs.items()} if masked_poison else values
    ref64 = again(clean, "reference", F64, second_order=second)
    clean32 = again(clean, "reference", dtype) if masked_poison else ref32
    moved = again(moved_by_an_ulp(clean, dtype, gen), "reference", F64, second_order=second)
    if compiled is not None:
        assume(ref32.error is None)  # value checks are skipped when compiled: another contract
    if ref32.error is not None or got.error is not None:
        assert type(got.error) is type(ref32.error), f"reference: {ref32.error!r}, {spec.backend}: {got.error!r}"
        return
    error = ref64.error or clean32.error or moved.error
    assert error is None, f"the reference raises on float64 or clean inputs: {error!r}"
    assert len(got.outputs) == len(ref32.outputs)
    for i, (o, r, e, c, m) in enumerate(zip(got.outputs, ref32.outputs, ref64.outputs, clean32.outputs, moved.outputs)):
        what = f"output {i} of {case.name} on {spec.backend}"
        assert (o.dtype, o.shape) == (r.dtype, r.shape), f"{what}: {o.dtype, o.shape} vs reference {r.dtype, r.shape}"
        if i in built.differentiable and got.grads:
            assert got.requires_grad[i], f"{what} does not require grad although its inputs do"
        # Where the float32 reference overflows and float64 does not, a backend may be right instead.
        closer = torch.isinf(r) & torch.isfinite(e) & ((o.double() - e).abs() <= 1e-3 * e.abs())
        bad = (pattern(o) != pattern(r)) & ~closer
        refuse(bad, what, "NaN/inf where the reference is not (or not where it is)", got=o, reference=r)
        bad = (pattern(r) != pattern(c)) | (pattern(o) != pattern(c)) & ~closer
        refuse(bad, what, "NaN/inf at masked positions changes the result", got=o, clean=c)
        if i in built.zero_out:
            refuse((o != 0) & built.zero_out[i], what, "nonzero at a masked position", got=o)
        assert_accurate(what, o, r, e, m, r.dtype, rounding=built.rounding.get(i))
        if i in built.kl_ratio and o.dtype != F64:
            ratio = built.kl_ratio[i].to(dtype).double()
            sel = (ratio.abs() >= KL_MIN_RATIO) & torch.isfinite(e) & torch.isfinite(ratio)
            err = ((o.double() - e).abs() / e.abs().clamp_min(1e-300))[sel]
            rule = f"relative error > {KL_RTOL:g} vs float64 at |log-ratio| >= {KL_MIN_RATIO:g}"
            refuse(~(err <= KL_RTOL), what, rule, error=err, log_ratio=ratio[sel], got=o.double()[sel], float64=e[sel])
    if any(ref32.outputs[i].dim() == 0 and not torch.isfinite(ref32.outputs[i]) for i in built.differentiable):
        return  # the gradient of a non-finite loss is unspecified
    for name, g in got.grads.items():
        what = f"gradient of {name} ({case.name} on {spec.backend})"
        r, e, c = ref32.grads[name], ref64.grads[name], clean32.grads[name]
        if g is not None and r is not None:
            assert (g.dtype, g.shape) == (r.dtype, r.shape), (
                f"{what}: {g.dtype, g.shape} vs reference {r.dtype, r.shape}"
            )
            refuse(~torch.isfinite(g) & torch.isfinite(r), what, "not finite where the reference's is", got=g)
        if r is not None and c is not None:
            refuse(~torch.isfinite(r) & torch.isfinite(c), what, "NaN/inf at masked positions reaches the reference's")
        masked = built.inputs[name].masked
        if g is not None and masked is not None:
            view = got.views[name](g)
            refuse((view != 0) & masked, what, "nonzero at a masked position", got=view)
        # The gradient at a NaN/inf input itself is unspecified: compared where the reference's is finite.
        relaxed = None if r is None else torch.isfinite(r)
        floor = built.grad_floor + built.grad_rounding * largest(e)
        assert_accurate(what, g, r, e, moved.grads[name], dtype, relaxed=relaxed, floor=floor)
    if spec.second_order:
        error = ref32.second_error or ref64.second_error
        assert error is None, f"the reference's double backward raises: {error!r}"
        for name in got.grads if got.second_error is None else ():  # it claims double backward: the reference's
            what = f"second-order gradient of {name} ({case.name} on {spec.backend})"
            g, r, e = got.second[name], ref32.second[name], ref64.second[name]
            assert nonzero(g) or not (nonzero(r) and nonzero(e)), (
                f"{what} is zero/None without an error (the reference's is not): a backend without double "
                "backward must raise"
            )
            assert_accurate(what, g, r, e, moved.second[name], dtype, relaxed=None if r is None else torch.isfinite(r))


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


def test_interpreted_bfloat16_cases_have_no_subnormal_input():
    """The input filter named for the Triton interpreter's bfloat16 subnormal bug (tests/harness.py) is
    live while the bug is: the upstream reproducer still finds it (when it stops, the interpreter is
    fixed and the filter can go), and an interpreted bfloat16 case gets no subnormal input, while every
    other case keeps its inputs."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "tools" / "triton_interpreter_bf16_subnormal.py"
    spec_ = importlib.util.spec_from_file_location("repro", path)
    repro = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(repro)
    if torch.cuda.is_available():
        pytest.skip("Triton runs compiled here: no interpreter, no filter")
    assert repro.main() == 1, "the Triton interpreter converts bfloat16 subnormals exactly now: drop the filter"
    tiny = torch.finfo(torch.bfloat16).tiny
    values = torch.tensor([tiny / 4, -tiny / 2, tiny, 1.0], dtype=F64)

    def built():
        return harness.Built({"x": harness.Input(values.clone())}, {}, lambda t: ())

    interpreted = Spec("triton", "bfloat16", "contiguous", "clean", (4,), {})
    got = harness.without_interpreter_bf16_subnormals(built(), interpreted).inputs["x"].values
    assert got.tolist() == [0.0, -0.0, tiny, 1.0] and math.copysign(1.0, got[1].item()) == -1.0
    for other in (
        dataclasses.replace(interpreted, backend="native"),
        dataclasses.replace(interpreted, dtype="float32"),
    ):
        assert torch.equal(harness.without_interpreter_bf16_subnormals(built(), other).inputs["x"].values, values)


def _packed_ops():
    """test_varlen's table of packed calls (each op, mode and agg), with masked_mean's ``dim`` drawn."""
    from test_varlen import _cases

    return list(_cases())


@budget(24, shrink=False)
@given(data=st.data())
def test_fuzz_packed(data):
    """The packed layout (``cu_seqlens``), drawn: an op of tests/test_varlen.py's table (every mode and agg),
    a backend serving it, random lengths (empty sequences included) and mask, float32 or float64, eager or
    ``torch.compile(fullgraph=True)``, and ``masked_mean``'s ``dim``.  The packed call equals the padded
    one at the valid tokens (test_varlen's rule: bit for bit where it says so, else to rounding), values
    and gradients; ``dim`` with ``cu_seqlens`` is a named error; a compiled call gives the eager packed
    result or is refused naming ``cu_seqlens`` (or ``max_seqlen``)."""
    from test_varlen import EXACT, GRADS, VALUES, _flat, equality

    case_id, op, call, equal = data.draw(st.sampled_from(_packed_ops()), label="op")
    backend = data.draw(st.sampled_from(["auto"] if op is None else list(backends_serving(op, "cpu"))), label="backend")
    equal = equality(case_id, backend, equal)
    lengths = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=5), label="lengths")
    dtypes = (
        [torch.float64] if case_id.startswith("linear_policy_loss") else [torch.float64, torch.float32]
    )  # its head's
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    compiled = data.draw(st.sampled_from([None, None, None, False, True]), label="compiled (dynamic)")
    dim = data.draw(st.sampled_from([None, None, 0, -1]), label="dim") if case_id == "masked_mean" else None
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), label="seed"))
    rows, width = len(lengths), max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    mask = valid & (torch.rand(rows, width, generator=g) > data.draw(st.sampled_from([0.0, 0.3, 1.0]), label="holes"))
    names = ("lp", "old", "ref", "rollout", "adv", "values", "old_values", "returns", "rewards", "entropy", "weights")
    padded = {n: torch.where(valid, torch.randn(rows, width, generator=g, dtype=dtype) - 0.5, 0.0) for n in names}
    padded["hidden"] = torch.where(valid[..., None], torch.randn(rows, width, 5, generator=g, dtype=dtype), 0.0)
    padded["labels"] = torch.where(valid, torch.randint(11, (rows, width), generator=g), 0)
    padded["weights"] = padded["weights"].abs()
    padded["scores"] = torch.randn(rows, generator=g, dtype=dtype)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = {k: v if k == "scores" else v[valid].clone() for k, v in padded.items()}
    extra = {} if dim is None else {"dim": dim}
    with pf.use_backend(backend):
        if dim is not None:
            with pytest.raises(ValueError, match="masked_mean: dim must be None with cu_seqlens"):
                call(packed, mask[valid], cu_seqlens=cu_seqlens, **extra)
            return
        for inputs in (padded, packed):
            for x in inputs.values():
                x.requires_grad_(x.is_floating_point())
        try:
            want = _flat(call(padded, mask))
        except ValueError as err:  # the packed call refuses the same input (a whitening of nothing)
            with pytest.raises(ValueError, match=str(err)):
                call(packed, mask[valid], cu_seqlens=cu_seqlens)
            return
        got = _flat(call(packed, mask[valid], cu_seqlens=cu_seqlens))
        if compiled is not None:
            torch._dynamo.reset()
            fn = torch.compile(
                lambda: call(packed, mask[valid], cu_seqlens=cu_seqlens, max_seqlen=width),
                fullgraph=True,
                dynamic=compiled,
            )
            try:
                again = _flat(fn())
            except Exception as err:  # refused: a padded detour under compile, by name
                assert "cu_seqlens" in str(err) or "max_seqlen" in str(err), f"{case_id} on {backend}: {err!r}"
                return
            for h, c in zip(got, again, strict=True):
                torch.testing.assert_close(
                    c, h, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-6, equal_nan=True
                )
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-14}
    pairs = [(w[valid] if tuple(w.shape[:2]) == tuple(valid.shape) else w, h) for w, h in zip(want, got, strict=True)]
    for w, h in pairs:
        if equal in (EXACT, VALUES):
            assert (
                torch.equal(h.detach(), w.detach())
                or torch.equal(h.detach().isnan(), w.detach().isnan())
                and torch.equal(h.detach().nan_to_num(), w.detach().nan_to_num())
            ), f"{case_id} on {backend}: packed != padded"
        else:
            torch.testing.assert_close(h.detach(), w.detach(), **tol, equal_nan=True)
    pulls = [
        (w, h, torch.randn(w.shape, generator=g, dtype=w.dtype))
        for w, h in pairs
        if w.requires_grad and w.is_floating_point()
    ]
    if not pulls:
        return
    leaves = [x for x in (*padded.values(), *packed.values()) if x.requires_grad]
    total = sum((w * p).sum() + (h * p).sum() for w, h, p in pulls)
    total.backward()
    for name in padded:
        if name == "scores" or padded[name].grad is None:
            continue
        w, h = padded[name].grad[valid], packed[name].grad
        if equal in (EXACT, GRADS):
            assert torch.equal(h, w), f"{case_id} on {backend}: the gradient of {name}"
        else:
            torch.testing.assert_close(h, w, **tol)
    assert leaves


def _drawn_param(draw, p):
    """A mode parameter drawn log-uniformly inside its declared range (spec ``Param``), at most 1e6."""
    if p.optional and draw(st.booleans()):
        return None
    low = max(p.low if p.low is not None else 1e-6, 1e-6) * (1 + 1e-9 if p.low_open else 1)
    high = min(p.high if p.high is not None else 1e6, 1e6) * (1 - 1e-9 if p.high_open else 1)
    return math.exp(draw(st.floats(math.log(low), math.log(high))))


@budget(40, shrink=False)
@given(data=st.data())
def test_fuzz_fused_policy_terms(data):
    """The Triton one-pass loss's fused per-token terms (``triton/_policy_terms.py``) per chunk, drawn: a
    mode (the sequence-level ones padded), its parameters log-uniform over their declared ranges, log-ratios up to about 40,
    odd shapes and chunk rows, every agg, KL estimator, entropy bonus, weights, packed, float32/float16
    inputs: each total and gradient within float64's bound or 4x the generic path's own error
    (``test_policy_terms.assert_no_worse_than_the_generic_path``).  The head's fuzz row above never
    reaches this kernel (float64, and no interpreted Triton)."""
    if "triton" not in backends_serving("linear_policy_loss_vanilla", "cpu"):
        pytest.skip("the Triton backend is not served on CPU")
    from test_policy_terms import assert_no_worse_than_the_generic_path, chunked, per_token, widened

    from ppo_fast.backends.reference._loss_terms import Objective, Terms

    draw = data.draw
    mode = POLICY_LOSS_MODES[draw(pick([n for n, m in POLICY_LOSS_MODES.items() if m.fused_head]))]
    params = tuple(_drawn_param(draw, p) for p in mode.params)
    if mode.name == "vanilla" and params[2] is not None and params[2] <= 1.0:
        params = params[:2] + (None,)
    packed = draw(st.booleans()) and not mode.sequence_level  # packed gspo/geo_mean: not fused (generic terms)
    agg = draw(pick([a for a in AGG_MODES if not (packed and a.startswith("seq-mean"))]))
    kl = draw(pick([*KL_ESTIMATORS, None]))
    dims = (draw(st.integers(1, 6)), draw(st.integers(1, 9)))
    dtype = draw(pick([torch.float32, torch.float16]))
    logp, entropy, x = per_token(
        draw(st.integers(0, 2**31)),
        dims,
        dtype=dtype,
        weighted=draw(st.booleans()),
        with_ref=kl is not None,
        packed=packed,
    )
    spread = draw(pick([1.0, 1e-3, 30.0, 100.0]))  # the log-ratios' scale: per_token's is about 0.4
    x = x._replace(old=(logp + (x.old.float() - logp) * spread).to(dtype))
    objective = Objective(mode, params, agg)
    terms = Terms(draw(pick([0.0, 0.1, 1e3])), kl or "k3", draw(pick([0.0, 0.01, -1.0, 1e3])))
    rows = draw(st.integers(1, 20))
    note(f"{mode.name} {params} {agg} kl={kl} {dims} rows={rows} {dtype} spread={spread} packed={packed}")
    got = chunked(logp, entropy, x, objective, terms, rows=rows, fused=True)
    generic = chunked(logp, entropy, x, objective, terms, rows=rows, fused=False)
    oracle = chunked(*widened(logp, entropy, x), objective, terms, rows=rows, fused=False)
    rtol = 1e-5 + (4e-7 * max(params) if mode.name == "sapo" else 0.0)
    assert_no_worse_than_the_generic_path(got, generic, oracle, mode, rtol=rtol)


# --------------------------------------------------------------------------- the GEMM-first head's 2-D plan


@contextlib.contextmanager
def module_globals(module, **values):
    """``module``'s globals set to ``values`` for the block and restored after it, even when it fails (a
    hypothesis test runs many examples in one call: pytest's monkeypatch would restore them at its end)."""
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


# Bias kinds: a ramp puts each row's largest logits in the last slice (every earlier one rescaled, its exps
# underflowing at low temperature); "far" and "-inf" one or more whole slices (the first included) far below
# the rest (exp(z - max) = 0 there, or a running max still -inf after the first slices).
HEAD_BIASES = ("ramp", "-inf", "normal", "far", "none")


@st.composite
def head_2d_draws(draw):
    """An odd problem and a small 2-D plan ``(rows, cols)``: several slices, and blocks where ``N`` allows, with
    at most about 50 (row, slice) programs a pass (the interpreter's cost)."""
    v = draw(st.integers(3, 64), label="V")
    cols = draw(st.integers(1, (v - 1) // 2 if v > 4 else 1), label="slice columns")
    slices = -(-v // cols)
    n = draw(st.integers(1, max(1, min(70, 48 // slices))), label="N")
    rows = draw(st.integers(1, 16), label="block rows")
    k = draw(
        knobs(
            dtype=pick(["float32", "float16", "float64"]),
            hidden_size=st.integers(1, 12),
            bias=pick(HEAD_BIASES),
            scale=pick([1.0, 4.0, 30.0]),
            temperature=st.one_of(pick([1.0, 0.7, 0.3]), st.floats(0.05, 4.0), pick([MIN_TEMPERATURE, 1e-3])),
            logit_scale=HEAD["logit_scale"],
            softcap=pick([None, 2.5, None, 30.0]),  # none half of the time: a soft-cap makes -inf finite
            ignore_index=pick([-100, 0]),
            ignored=pick([0.3, 0.0, 0.3, 1.0]),
            out_of_range=pick([0.0, 0.0, 0.2]),
            entropy=pick([True, True, False]),
            cotangent=pick([1.0, 1e-4]),
            poison=pick(["clean", "clean", "used row", "unused row"]),
            value=pick([math.nan, math.inf, -math.inf]),
            tile=pick([16, 64]),
            seed=st.integers(0, 2**31),
        ),
        label="knobs",
    )
    return (n, v, rows, cols), k


def _head_2d_inputs(n, v, cols, k):
    """float64 values exactly representable in the drawn dtype: ``(hidden, weight, bias, labels, far)``, ``far``
    the columns of a far (or -inf) bias region (whole slices, one column at least left out; no label there)."""
    gen = torch.Generator().manual_seed(k["seed"])
    dtype, h = DTYPES[k["dtype"]], k["hidden_size"]
    hidden = (torch.randn(n, h, generator=gen, dtype=F64) * k["scale"]).to(dtype).double()
    weight = (torch.randn(v, h, generator=gen, dtype=F64) / h**0.5).to(dtype).double()
    far = torch.zeros(v, dtype=torch.bool)
    bias = None
    if k["bias"] != "none":
        bias = torch.linspace(-30.0, 30.0, v, dtype=F64) if k["bias"] == "ramp" else torch.randn(v, generator=gen)
        if k["bias"] in ("far", "-inf"):
            # -inf from the first slice on (a running max still -inf after it), far anywhere
            first = 0 if k["bias"] == "-inf" else int(torch.randint(0, -(-v // cols), (), generator=gen)) * cols
            far[first : first + cols * int(torch.randint(1, 3, (), generator=gen))] = True
            far[-1] = far[-1] & ~far.all()
            bias = torch.where(far, -1e4 if k["bias"] == "far" else -math.inf, bias.double())
        bias = bias.to(dtype).double()
    near = (~far).nonzero().squeeze(-1)
    labels = near[torch.randint(0, len(near), (n,), generator=gen)]
    labels = torch.where(torch.rand(n, generator=gen) < k["ignored"], k["ignore_index"], labels)
    bad = torch.tensor([v, -1, 10**12])[torch.randint(0, 3, (n,), generator=gen)]
    labels = torch.where(torch.rand(n, generator=gen) < k["out_of_range"], bad, labels)
    return hidden, weight, bias, labels, far


def _head_truth(hidden, weight, bias, labels, k):
    """The plain formula in float64: ``log_softmax(softcap(scale * (h @ W.T + b)) / T)`` at the label and its
    entropy; 0 at an ignored row, NaN at an out-of-range one, and no gradient from either."""
    used = (labels != k["ignore_index"]) & (labels >= 0) & (labels < weight.shape[0])
    x = torch.where(used[:, None], hidden, 0.0) @ weight.T + (0.0 if bias is None else bias)
    logsm = torch.log_softmax(harness.head_logits(x, k) / k["temperature"], -1)
    p = logsm.exp()
    entropy = -(p * torch.where(p > 0, logsm, 0.0)).sum(-1)
    logp = logsm.gather(-1, torch.where(used, labels, 0)[:, None]).squeeze(-1)
    unread = torch.where(labels == k["ignore_index"], 0.0, math.nan).to(logp.dtype)
    return torch.where(used, logp, unread), torch.where(used, entropy, unread)


def _head_run(fn, values, labels, k, cotangents=None):
    """``(outputs, gradients of hidden, weight and bias)`` of ``fn`` on ``values`` (leaves made here), the
    outputs pulled back along ``cotangents`` (drawn here when None, returned too)."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in values]
    options = dict(temperature=k["temperature"], logit_scale=k["logit_scale"], logit_softcap=k["softcap"])
    logp, entropy = fn(
        *leaves[:2], labels, bias=leaves[2], return_entropy=k["entropy"], ignore_index=k["ignore_index"], **options
    )
    outs = [logp] + ([entropy] if k["entropy"] else [])
    if cotangents is None:
        gen = torch.Generator().manual_seed(k["seed"] + 1)
        cotangents = [torch.randn(o.shape, generator=gen, dtype=F64) * k["cotangent"] for o in outs]
    wanted = [x for x in leaves if x is not None]
    pulled = [c.to(o.dtype) for c, o in zip(cotangents, outs)]
    grads = torch.autograd.grad(outs, wanted, pulled, allow_unused=True) if outs[0].requires_grad else [None] * 3
    grads = iter(grads)
    return [o.detach() for o in outs], [None if x is None else next(grads) for x in leaves], cotangents


def _head_bounds(values64, far, k):
    """harness.head_bounds on the columns that count: without a soft-cap the far region's exps are exactly 0
    and its columns left out (their own rounding would swamp the bound); with one its -inf read as -1e4
    (tanh saturates at either)."""
    hidden, weight, bias = values64
    if bias is not None and k["softcap"] is None:
        weight, bias = weight[~far], bias[~far]
    elif bias is not None:
        bias = bias.clamp_min(-1e4)
    inputs = {"hidden": harness.Input(hidden), "weight": harness.Input(weight)}
    if bias is not None:
        inputs["bias"] = harness.Input(bias)
    return harness.head_bounds(Spec("triton", k["dtype"], "contiguous", "clean", (), {}), k, inputs)


def _check_head_2d(got, rows, ref32, truth, *, bounds, k, unused):
    """The 2-D plan's ``got = (outputs, grads)`` against the row plan's (NaN/inf at the same places, both
    within the bound of float64) and the float64 formula's ``truth`` (the float32 reference ``ref32``
    setting the bound's scale, as in ``check``); rows not read give exactly 0 (or NaN) and no gradient."""
    dtype = DTYPES[k["dtype"]]
    for i, (o, r, e, c) in enumerate(zip(got[0], rows[0], truth[0], ref32[0])):
        what = f"output {i} of the 2-D plan"
        assert (o.dtype, o.shape) == (r.dtype, r.shape) == (c.dtype, c.shape), f"{what}: {o.dtype} vs {r.dtype}"
        refuse(pattern(o) != pattern(r), what, "NaN/inf where the row plan's is not (or not where)", got=o, rows=r)
        refuse(pattern(o) != pattern(e.to(o.dtype)), what, "NaN/inf where float64's is not", got=o, float64=e)
        refuse((o != 0) & (unused == 0), what, "nonzero at an ignored row", got=o)
        for name, x in (("2-D plan", o), ("row plan", r)):
            assert_accurate(f"output {i} of the {name}", x, c, e, e, o.dtype, rounding=bounds["rounding"].get(i))
    for name, g, r, e, c in zip(("hidden", "weight", "bias"), got[1], rows[1], truth[1], ref32[1]):
        if e is None:
            continue
        what = f"gradient of {name} (2-D plan)"
        assert (g.dtype, g.shape) == (r.dtype, r.shape) == (e.to(dtype).dtype, e.shape), what
        refuse(pattern(g) != pattern(r), what, "NaN/inf where the row plan's is not (or not where)", got=g, rows=r)
        # float64 rounded to the dtype: a float16 gradient beyond its range is inf (as the reference's)
        refuse(~torch.isfinite(g) & torch.isfinite(e.to(dtype)), what, "not finite where float64's is", got=g)
        if name == "hidden":
            refuse((g != 0) & (unused != 1)[:, None], what, "nonzero at a row not read", got=g)
        floor = bounds["grad_floor"] + bounds["grad_rounding"] * largest(e)
        for plan, x in (("2-D plan", g), ("row plan", r)):
            assert_accurate(f"gradient of {name} ({plan})", x, c, e, e, dtype, relaxed=torch.isfinite(c), floor=floor)


@budget(12, shrink=False)
@given(data=st.data())
def test_fuzz_gemm_head_2d_plan(data):
    """The GEMM-first head's 2-D plan (``_gemm_head.TWO_D``) in small blocks and slices (``BLOCK`` forced:
    at these sizes the default plan is one slice, so the fold of the running max / sum of exp / entropy /
    chosen logit across slices and the per-slice backward run only so), drawn: odd N, H, V (V not always a
    multiple of the slice), float32 / float16 / float64 (the interpreter's bfloat16 is wrong), a bias whose
    largest logits come last or with whole slices far below the rest or -inf (the first slice included),
    temperature, logit_scale, soft-cap, ignored and out-of-range labels, the entropy or not, NaN / +-inf in a
    read or an unread row of hidden.  Outputs and the gradients of hidden, weight and bias (random
    cotangents) against the plain float64 formula and the row plan (``TWO_D = False``) of the same call; and
    the "epilogue" design's forward (the tile kernel in grouped shares, small) against the same."""
    if "triton" not in backends_serving("linear_token_logprobs", "cpu"):
        pytest.skip("the Triton backend is not served on CPU")
    from ppo_fast.backends import _head_plan
    from ppo_fast.backends import reference as reference_backend
    from ppo_fast.backends import triton as triton_backend
    from ppo_fast.backends.triton import _gemm_head, linear_token_logprobs

    (n, v, rows, cols), k = data.draw(head_2d_draws())
    hidden, weight, bias, labels, far = _head_2d_inputs(n, v, cols, k)
    used = (labels != k["ignore_index"]) & (labels >= 0) & (labels < v)
    unused = torch.where(used, 1, torch.where(labels == k["ignore_index"], 0, 2))  # 0 ignored, 2 out of range
    poisoned = hidden.clone()
    targets = (used if k["poison"] == "used row" else ~used).nonzero().squeeze(-1)
    if k["poison"] != "clean" and len(targets):
        gen = torch.Generator().manual_seed(k["seed"] + 2)
        at = targets[torch.randint(0, len(targets), (), generator=gen)]
        poisoned[at, torch.randint(0, hidden.shape[1], (), generator=gen)] = k["value"]
    truth_in = poisoned if k["poison"] == "used row" else hidden  # an unread row's poison changes nothing
    note(f"N={n} V={v} block=({rows}, {cols}) used={used.tolist()}")
    dtype = DTYPES[k["dtype"]]
    as_dtype = lambda *xs: [None if x is None else x.to(dtype) for x in xs]  # noqa: E731
    truth = _head_run(lambda *a, **kw: _head_truth(*a[:2], kw["bias"], a[2], k), [truth_in, weight, bias], labels, k)
    cot = truth[2]
    ref32 = _head_run(
        reference_backend.FUNCTIONS["linear_token_logprobs"], as_dtype(truth_in, weight, bias), labels, k, cot
    )
    fn = triton_backend.FUNCTIONS["linear_token_logprobs"]
    with (
        module_globals(linear_token_logprobs, DESIGN="gemm"),
        module_globals(_head_plan, LOGPROBS_ROWS=rows),
        module_globals(_gemm_head, BLOCK=(rows, cols), ROW_BLOCK_V=k["tile"]),
    ):
        with module_globals(_gemm_head, TWO_D=True):
            got = _head_run(fn, as_dtype(poisoned, weight, bias), labels, k, cot)
        with module_globals(_gemm_head, TWO_D=False, ROW_BLOCK_V=64):  # a row one tile: half the cost
            row_plan = _head_run(fn, as_dtype(poisoned, weight, bias), labels, k, cot)
    # the epilogue design's forward: 16-wide tiles, a share of 16 or 32 columns, groups of 1-3 row blocks
    epilogue = dict(
        _EPILOGUE_CONFIG={},
        EPILOGUE_COLUMNS=16 * (1 + cols % 2),
        EPILOGUE_LAUNCH=linear_token_logprobs.Launch(2, 1 + rows % 3),
    )
    tiles = {d: (16, 16, 16, 4) for d in linear_token_logprobs._FORWARD_CONFIG}
    with module_globals(linear_token_logprobs, DESIGN="epilogue", _FORWARD_CONFIG=tiles, **epilogue):
        fused = _head_run(fn, as_dtype(poisoned, weight, bias), labels, k, cot)
    bounds = _head_bounds((hidden, weight, bias), far, k)
    _check_head_2d(got, row_plan, ref32, truth, bounds=bounds, k=k, unused=unused)
    _check_head_2d(fused, row_plan, ref32, truth, bounds=bounds, k=k, unused=unused)


# --------------------------------------------------------------------------- packed sequence-level modes, one pass

SEQUENCE_LEVEL = [name for name, m in POLICY_LOSS_MODES.items() if m.sequence_level and m.fused_head]


@st.composite
def packed_sequence_draws(draw):
    """A sequence-level mode, its parameters log-uniform over their declared ranges (``_drawn_param``; a
    ``same_as`` one left out half of the time), a backend serving it, lengths (0, 1, short ones several to
    a chunk of ``chunk`` tokens, and one longer than the chunk) and the loss's, terms' and head's knobs."""
    mode = POLICY_LOSS_MODES[draw(pick(SEQUENCE_LEVEL), label="mode")]
    params = {}
    for p in mode.params:
        value = None if p.same_as and draw(st.booleans()) else _drawn_param(draw, p)
        if value is not None:
            params[p.name] = value
    k = draw(
        knobs(
            # the interpreted Triton half as often as the others (the slowest)
            backend=pick([b for b in serving(mode.linear_op) for _ in range(1 if b == "triton" else 2)]),
            dtype=pick(["float32", "float64"]),
            agg=pick(AGG_MODES[::-1]),  # the sequence-level aggs first: a chunk's share of the responses
            chunk=st.one_of(st.integers(4, 8), st.integers(1, 3)),
            # short ones (several sequences a chunk) and long ones (longer than a chunk)
            lengths=st.lists(st.one_of(pick([1, 2, 0, 3]), st.integers(0, 12)), min_size=2, max_size=4),
            holes=pick([0.3, 0.0, 0.3, 1.0]),
            ignored=pick([0.2, 0.0]),
            hidden_size=st.integers(1, 6),
            vocab=st.integers(1, 17),
            bias=st.booleans(),
            weighted=st.booleans(),
            ratio_spread=pick([1.0, 0.01, 30.0]),
            adv_scale=pick([1.0, 1e-3, 30.0]),
            kl_coef=pick([0.1, 0.0, 1e3]),
            kl_estimator=pick(KL_ESTIMATORS),
            entropy_coef=pick([0.01, 0.0, -1.0, 1e3]),
            temperature=pick([1.0, 0.7, 3.0]),
            logit_scale=pick([1.0, 3.0]),
            softcap=pick([None, 2.5]),
            seed=st.integers(0, 2**31),
        ),
        label="knobs",
    )
    if k["backend"] == "triton":  # interpreted: fewer, shorter sequences
        k["lengths"] = [min(length, 5) for length in k["lengths"][:3]]
    longer = k["chunk"] + draw(st.integers(1, 4), label="a sequence longer than the chunk by")
    at = draw(st.integers(0, len(k["lengths"])), label="at")
    k["lengths"] = [*k["lengths"][:at], longer, *k["lengths"][at:]]
    return mode.name, params, k


def _packed_sequence_inputs(k):
    """The packed tokens' float64 values (exactly representable in the drawn dtype) and ``cu_seqlens``:
    ``hidden [N, H]``, ``weight``, ``bias``, and ``[N]`` labels (some ignored), mask (holes inside the
    sequences), old and ref log-probs, advantages and weights; NaN in old and advantages where masked
    (never read)."""
    gen = torch.Generator().manual_seed(k["seed"])
    dtype, h, v = DTYPES[k["dtype"]], k["hidden_size"], k["vocab"]
    n = sum(k["lengths"])
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    mask = torch.rand(n, generator=gen) >= k["holes"]
    labels = torch.randint(0, v, (n,), generator=gen)
    labels = torch.where(torch.rand(n, generator=gen) < k["ignored"], -100, labels)
    junk = torch.where(mask, 0.0, math.nan)
    x = dict(
        hidden=rnd(n, h),
        weight=rnd(v, h) / h**0.5,
        bias=rnd(v) if k["bias"] else None,
        old=-rnd(n).abs() * k["ratio_spread"] - math.log(max(v, 2)) + junk,
        adv=rnd(n) * k["adv_scale"] + junk,
        ref=-rnd(n).abs() - 0.1 if k["kl_coef"] else None,
        weights=torch.rand(n, generator=gen, dtype=F64) + 0.5 if k["weighted"] else None,
    )
    x = {name: None if t is None else t.to(dtype).double() for name, t in x.items()}
    cu_seqlens = torch.tensor([0, *itertools.accumulate(k["lengths"])], dtype=torch.int32)
    return x, labels, mask, cu_seqlens


def _padded(t, lengths, fill):
    """Packed ``[N, ...]`` as ``[S, longest, ...]`` (``fill`` beyond each sequence's end)."""
    valid = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    out = torch.full((len(lengths), max(lengths), *t.shape[1:]), fill, dtype=t.dtype)
    out[valid] = t
    return out


def _sequence_loss(inputs, k, *, mode, params, backend, dtype, padded):
    """``(loss, stats, gradients of hidden, weight and bias, the last at the packed tokens)`` of the call
    on ``backend`` in ``dtype``, packed (``cu_seqlens``) or on the same sequences padded (NaN in the floats'
    padding, False in the mask: never read); an error raised is returned instead."""
    (x, labels, mask, cu_seqlens), lengths = inputs, k["lengths"]
    leaves = {name: None if t is None else t.to(dtype).requires_grad_() for name, t in x.items()}
    lay = (lambda t, fill: _padded(t, lengths, fill)) if padded else (lambda t, fill: t)  # noqa: E731
    per_token = {name: None if leaves[name] is None else lay(leaves[name], math.nan) for name in ("old", "adv")}
    for name in ("ref", "weights"):
        per_token[name] = None if leaves[name] is None else lay(leaves[name], 0.0)
    layout = {} if padded else dict(cu_seqlens=cu_seqlens, max_seqlen=max(lengths))
    try:
        with pf.use_backend(backend):
            loss, stats = pf.linear_policy_loss(
                lay(leaves["hidden"], 0.0),
                leaves["weight"],
                lay(labels, -100),
                per_token["old"],
                per_token["adv"],
                lay(mask, False),
                loss_mode=mode,
                agg=k["agg"],
                weights=per_token["weights"],
                bias=leaves["bias"],
                ref_logprobs=per_token["ref"],
                kl_coef=k["kl_coef"],
                kl_estimator=k["kl_estimator"],
                entropy_coef=k["entropy_coef"],
                temperature=k["temperature"],
                logit_scale=k["logit_scale"],
                logit_softcap=k["softcap"],
                **layout,
                **params,
            )
    except (ValueError, RuntimeError) as err:
        return err
    wanted = [leaves[name] for name in ("hidden", "weight", "bias") if leaves[name] is not None]
    grads = iter(torch.autograd.grad(loss * 1.7, wanted, allow_unused=True))
    grads = [None if leaves[name] is None else next(grads) for name in ("hidden", "weight", "bias")]
    # unused (no tokens): zero, whether autograd says None or a backend gives zeros
    grads = [
        g if g is not None or leaves[n] is None else torch.zeros_like(leaves[n])
        for n, g in zip(("hidden", "weight", "bias"), grads)
    ]
    return loss.detach(), {name: s.detach() for name, s in stats.items()}, grads


def _check_sequence_results(what, got, want, ref32, ref64, *, dtype, share):
    """``got`` (loss, stats, gradients) against ``want`` (the same call padded): NaN/inf at the same places
    and, where the float64 reference ``ref64`` is finite, both within the bound of ``check`` (the float32
    reference ``ref32`` setting its scale; a stat in its own dtype: clip fractions are float32); float64
    values also within a few ulps of each other.  A float32 call's clip fraction may differ by ``share``,
    the longest sequence's share of the tokens (a sequence's ratio rounded across its clip bound)."""
    (loss, stats, grads), (w_loss, w_stats, w_grads) = got, want
    assert stats.keys() == w_stats.keys() == ref64[1].keys(), f"{what}: stats {sorted(stats)} vs {sorted(w_stats)}"
    values = [("loss", loss, w_loss, ref32[0], ref64[0])]
    values += [(f"stat {n}", stats[n], w_stats[n], ref32[1][n], ref64[1][n]) for n in w_stats]
    values += [
        (f"gradient of {n}", *xs)
        for n, *xs in zip(("hidden", "weight", "bias"), grads, w_grads, *ref32[2:], *ref64[2:])
    ]
    for name, g, w, r, e in values:
        if e is None:
            assert g is None and w is None, f"{what}: {name} is not None"
            continue
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{what}: {name} {g.dtype, g.shape} vs {w.dtype, w.shape}"
        if name.startswith("stat clipfrac") and dtype != F64:
            refuse((g - w).abs() > share, what, f"{name}: packed far from padded", got=g, padded=w)
            continue
        refuse(
            pattern(g) != pattern(w),
            what,
            f"{name}: NaN/inf where the padded call's is not (or not where)",
            got=g,
            padded=w,
        )
        for layout, x in (("packed", g), ("padded", w)):
            assert_accurate(f"{what} ({layout}): {name}", x, r, e, e, g.dtype, relaxed=torch.isfinite(e))
        if g.dtype == F64:
            tol = 1e-9 * (w.abs().max() if w.numel() else 0.0) + 1e-12
            refuse(~((g - w).abs() <= tol) & torch.isfinite(w), what, f"{name}: packed != padded", got=g, padded=w)


def _two_passes(*args, **kwargs):
    raise AssertionError("the packed sequence-level call took two passes (linear_token_logprobs)")


@budget(10, shrink=False)
@given(data=st.data())
def test_fuzz_packed_sequence_level(data):
    """A sequence-level mode (GSPO, GMPO) on packed tokens with ``cu_seqlens`` on the host: one pass over
    chunks of whole sequences (the chunk forced to a few tokens on every backend, so that sequences
    longer than it, empty and single-token ones fall where they may), never ``linear_token_logprobs``;
    drawn: lengths, masks inside the sequences, every agg, the mode's parameters at the ends of their
    declared ranges, weights, a KL term and the entropy bonus at their extremes, the head's temperature,
    scale and soft-cap, reference / native / interpreted Triton, float32 / float64.  Loss, stats and the
    gradients of hidden, weight and bias: the padded call's on the same sequences (NaN/inf at the same
    places), both within ``check``'s bound of the float64 reference."""
    from ppo_fast.backends import _head_plan, _one_pass
    from ppo_fast.backends.reference import linear_policy_loss as reference_module

    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    mode, params, k = data.draw(packed_sequence_draws())
    x, labels, mask, cu_seqlens = _packed_sequence_inputs(k)
    note(f"{mode} {params} {k['backend']} {k['dtype']} {k['agg']} lengths={k['lengths']} chunk={k['chunk']}")
    dtype = DTYPES[k["dtype"]]
    call = lambda backend, dtype, padded: _sequence_loss(  # noqa: E731
        (x, labels, mask, cu_seqlens), k, mode=mode, params=params, backend=backend, dtype=dtype, padded=padded
    )
    elements = k["chunk"] * k["vocab"]
    with (
        module_globals(reference_module, CHUNK_ELEMENTS=elements),
        module_globals(_one_pass, CHUNK_ELEMENTS=elements),
        module_globals(_head_plan, MIN_ROWS=k["chunk"], MAX_ROWS=k["chunk"]),
    ):
        want = call(k["backend"], dtype, padded=True)
        with module_globals(op_module, linear_token_logprobs=_two_passes):
            got = call(k["backend"], dtype, padded=False)
        ref32, ref64 = call("reference", dtype, padded=True), call("reference", F64, padded=True)
    if isinstance(want, Exception) or isinstance(ref64, Exception):
        assert type(got) is type(want) and str(got) == str(want), f"padded: {want!r}, packed: {got!r}"
        return
    assert not isinstance(got, Exception), f"packed: {got!r}, padded: no error"
    share = max(k["lengths"]) / max(1, int(mask.sum())) + 1e-6
    _check_sequence_results(f"{mode} on {k['backend']}", got, want, ref32, ref64, dtype=dtype, share=share)


# --------------------------------------------------------------------------- the one pass's paired d_weight products

TOKEN_LEVEL = [name for name, m in POLICY_LOSS_MODES.items() if m.fused_head and not m.sequence_level]


@st.composite
def paired_loss_draws(draw):
    """A token-level mode (its default parameters), an agg, the forced chunk rows ``m``, the layout and the
    sequences (padded ``[B, T]``; packed: lengths, some empty), so that the chunks count odd and even."""
    k = draw(
        knobs(
            mode=pick(TOKEN_LEVEL),
            agg=pick(AGG_MODES),
            m=st.integers(2, 8),
            packed=st.booleans(),
            batch=st.integers(1, 6),
            length=st.integers(1, 8),
            vocab=st.integers(2, 40),
            hidden_size=st.integers(1, 12),
            bias=st.booleans(),
            weighted=st.booleans(),
            seed=st.integers(0, 2**31),
        ),
        label="knobs",
    )
    k["lengths"] = draw(st.lists(st.integers(0, k["length"]), min_size=k["batch"], max_size=k["batch"]))
    return k


@budget(8, shrink=False)
@given(data=st.data())
def test_fuzz_paired_loss(data):
    """The Triton one pass's paired ``d_weight`` products (``HeadPlan.pair``, bf16) in forced small chunks,
    drawn (``paired_loss_draws``): the products are a pair's ``2 r`` rows and an odd last chunk's ``r``
    (``r`` the first chunk's rows: whole sequences padded, ``m`` tokens packed); the loss, stats, d_hidden
    and d_bias bitwise the unpaired plan's (only d_weight's summation order differs); d_weight's error
    against float64 at most 1.5x the unpaired plan's (a chunk's product lost or misplaced is many times it)."""
    if "triton" not in backends_serving("linear_policy_loss_vanilla", "cpu"):
        pytest.skip("the Triton backend is not served on CPU")
    from test_linear_policy_loss import leaves, make_inputs, packed_call

    from ppo_fast.backends import _head_plan
    from ppo_fast.backends.triton import _gemm_head

    k = data.draw(paired_loss_draws())
    b, t, m = k["batch"], k["length"], k["m"]
    dims = (b, t, k["vocab"], k["hidden_size"])
    x = make_inputs(k["seed"], dtype=torch.bfloat16, dims=dims, bias=k["bias"], weighted=k["weighted"])
    valid = torch.arange(t)[None, :] < torch.tensor(k["lengths"])[:, None] if k["packed"] else None
    if valid is not None:
        x["mask"] = x["mask"] & valid
    tokens = int(valid.sum()) if valid is not None else b * t
    assume(tokens > 0)
    if valid is not None:  # token slices of m, the first's rows every product's
        rows, count = min(tokens, m), -(-tokens // m)
    else:  # whole sequences, as many as m rows hold (at least one)
        per = max(1, m // t)
        rows, count = min(b, per) * t, -(-b // per)
    note(f"{k['mode']} {k['agg']} chunks: {count} of {rows} product rows")
    products, addmm = [], _gemm_head._addmm_

    def spy(out, a, b_):
        if out.shape == x["weight"].shape:  # d_weight's products: their rows
            products.append(a.shape[1])
        addmm(out, a, b_)

    def result(pair, inputs=x, backend="triton"):
        products.clear()
        with module_globals(_gemm_head, head_plan=lambda *a, **kw: _head_plan.HeadPlan(m, 2, pair), _addmm_=spy):
            loss, stats = packed_call(inputs, valid, k["mode"], k["agg"], backend)
            return loss.detach(), stats, torch.autograd.grad(loss * 1.7, leaves(inputs))

    with module_globals(_head_plan, MEMORY_BUDGET=1e9):  # the pairs fit: the plan alone decides
        got = result(True)
        assert products == [2 * rows] * (count // 2) + [rows] * (count % 2), products
        unpaired = result(False)
        assert products == [rows] * count, products
    same = functools.partial(torch.testing.assert_close, rtol=0, atol=0, equal_nan=True)  # bitwise, NaN too
    same(got[0], unpaired[0])
    for s in got[1]:
        same(got[1][s], unpaired[1][s], msg=s)
    for i in (0, 2) if k["bias"] else (0,):  # d_hidden, d_bias
        same(got[2][i], unpaired[2][i], msg="d_hidden" if i == 0 else "d_bias")
    wide = {
        n: v if v is None or not v.is_floating_point() else v.detach().double().requires_grad_() for n, v in x.items()
    }
    oracle = result(False, wide, "reference")
    errors = [float((r[2][1].double() - oracle[2][1]).norm()) for r in (got, unpaired)]
    floor = 1e-3 * float(oracle[2][1].norm()) + 1e-30  # a couple of bf16 roundings of the whole
    assert errors[0] <= 1.5 * errors[1] + floor, errors
