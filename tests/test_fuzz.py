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

A new op is one row of ``CASES`` (a builder of its inputs and call, its hyper-parameter
strategy, its backends and CI budget); each registered policy-loss mode is a row by itself.
Budget: a fixed, derandomized budget per row (no example database): the fast tier runs half of
it, ``--full`` all of it (about 1.5 minutes on 2 cores); ``pytest --fuzz-examples=2000`` (or ``PPO_FAST_FUZZ_EXAMPLES=2000``) runs that many
random examples per test, for a nightly job.  ``EXAMPLES`` holds known regressions.

PYTEST_DONT_REWRITE (the messages say what differs; pytest's rewriting would add tensor reprs)
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import pytest
import torch
from harness import LAYOUTS, laid_out
from hypothesis import HealthCheck, Phase, assume, example, given, note, settings
from hypothesis import strategies as st

import ppo_fast as pf
from ppo_fast.advantage_methods import REGISTRY as ADVANTAGE_METHODS
from ppo_fast.backends import serving as backends_serving
from ppo_fast.ops.token_logprobs import MIN_TEMPERATURE
from ppo_fast.spec import AGG_MODES, KL_ESTIMATORS, POLICY_LOSS_MODES, ROLLOUT_CORRECTION_MODES

pytestmark = pytest.mark.fuzz

NIGHTLY = int(os.environ.get("PPO_FAST_FUZZ_EXAMPLES") or 0)
F64 = torch.float64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": F64}
DTYPE_DRAWS = ("float32", "float32", "bfloat16", "float32", "float16", "float64")  # float32 half of the time
POISONS = ("clean", "masked", "valid", "valid", "bad_label")  # valid twice: nan / +inf / -inf share it
C_REF, K_REL, K_ABS = 16.0, 8.0, 2.0  # the accuracy bound's factors (module docstring)
KL_RTOL, KL_MIN_RATIO = 1e-4, 1e-4
UNDERFLOW = 1e-30  # an absolute floor: float32 results this small are noise (an exp flushed to 0 early)
F64_FLOOR = (1e-10, 1e-11)  # float64's (eps, tiny): no float128 truth measures the float64 reference's own error


def budget(ci_examples: int, scale: float = 1.0, shrink: bool = True) -> settings:
    """A fixed, database-less, derandomized budget for CI; N random examples when asked.
    ``PPO_FAST_FUZZ_DRAWS_ONLY=1`` skips the explicit examples (do the draws find a bug alone?)."""
    fixed = dict(derandomize=True, database=None) if not NIGHTLY else {}
    skip = {Phase.explicit} if os.environ.get("PPO_FAST_FUZZ_DRAWS_ONLY") == "1" else set()
    fixed["phases"] = [p for p in Phase if p not in skip | (set() if shrink else {Phase.shrink})]
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


@dataclasses.dataclass(frozen=True)
class Spec:
    """One example: what Hypothesis draws (its repr is the falsifying example)."""

    backend: str
    dtype: str
    layout: str
    poison: str  # clean | masked | valid nan/inf/-inf | bad_label
    dims: tuple
    knobs: dict  # the op's hyper-parameters and input distributions
    seed: int = 0
    poison_input: int = 0  # which float input a valid-position poison goes into
    second_order: bool = False


@dataclasses.dataclass
class Input:
    values: torch.Tensor  # float64, logical shape, exactly representable in the spec's dtype
    grad: bool = True
    masked: torch.Tensor | None = None  # positions the op never reads (bool, values' shape)
    layout: bool = True  # takes the spec's layout (else contiguous)


@dataclasses.dataclass
class Built:
    inputs: dict[str, Input]
    others: dict[str, torch.Tensor]  # labels, masks, group ids (laid out like the floats when sliced/transposed)
    call: Callable[[dict], tuple]  # the public op on the laid-out tensors
    differentiable: tuple[int, ...] = (0,)
    zero_out: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # output -> positions exactly 0
    kl_ratio: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # output -> log-ratio (KL rule)
    # output -> an error any evaluation in the compute dtype may make (the float32 rounding of a product's logits)
    rounding: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------- input distributions


def mask_of(gen, shape) -> torch.Tensor:
    """Interior holes, an all-masked first row and a full last row (when there are rows)."""
    mask = torch.rand(shape, generator=gen) < 0.65
    if shape[0] > 1:
        mask[0], mask[-1] = False, True
    return mask


def log_ratio(gen, shape, mode: str) -> torch.Tensor:
    """log-ratios: normal, tiny (|r| in [1e-4, 1e-3]), wide (beyond the +-20 clamps) or huge (85 to 92: exp overflows float32)."""
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    u = torch.rand(shape, generator=gen, dtype=F64)
    return {
        "normal": torch.randn(shape, generator=gen, dtype=F64) * 0.5,
        "tiny": sign * 10 ** (u - 4),
        "wide": torch.randn(shape, generator=gen, dtype=F64) * 30,
        "huge": 85 + 7 * u,
    }[mode]


def rounded(x: torch.Tensor, spec: Spec) -> torch.Tensor:
    return x.to(DTYPES[spec.dtype]).double()


def labels_of(gen, logits64, spec, k) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels, ignored)``: random or greedy (argmax) token ids, some set to ignore_index."""
    vocab = logits64.shape[-1]
    labels = torch.randint(0, vocab, logits64.shape[:-1], generator=gen)
    greedy = logits64.argmax(-1) if logits64.numel() else labels
    pick = {"random": 0.0, "greedy": 1.0, "mixed": 0.5}[k["labels"]]
    labels = torch.where(torch.rand(labels.shape, generator=gen) < pick, greedy, labels)
    labels = torch.where(torch.rand(labels.shape, generator=gen) < k["ignored"], k["ignore_index"], labels)
    if spec.poison == "bad_label" and labels.numel():
        bad = vocab if k["ignore_index"] != vocab else -7
        labels.view(-1)[torch.randint(0, labels.numel(), (1,), generator=gen)] = bad
    return labels, labels == k["ignore_index"]


# --------------------------------------------------------------------------- the ops (one builder each)


def build_token_logprobs(spec, gen, k):
    B, T, V = spec.dims
    logits = rounded(torch.randn(B, T, V, generator=gen, dtype=F64) * k["scale"], spec)
    labels, ignored = labels_of(gen, logits, spec, k)

    def call(t):
        out = pf.token_logprobs(
            t["logits"],
            t["labels"],
            temperature=k["temperature"],
            return_entropy=k["entropy"],
            ignore_index=k["ignore_index"],
        )
        return out if k["entropy"] else (out,)

    inputs = {"logits": Input(logits, masked=ignored.unsqueeze(-1).expand(B, T, V))}
    return Built(inputs, {"labels": labels}, call, (0, 1) if k["entropy"] else (0,), {0: ignored, 1: ignored})


def build_linear_token_logprobs(spec, gen, k):
    B, T, H, V = spec.dims
    hidden = rounded(torch.randn(B, T, H, generator=gen, dtype=F64) * k["scale"], spec)
    weight = rounded(torch.randn(V, H, generator=gen, dtype=F64) / H**0.5, spec)
    bias = rounded(torch.randn(V, generator=gen, dtype=F64), spec) if k["bias"] else None
    z = hidden @ weight.T + (0 if bias is None else bias)
    z = z * k["logit_scale"] if k["softcap"] is None else k["softcap"] * torch.tanh(z * k["logit_scale"] / k["softcap"])
    labels, ignored = labels_of(gen, z, spec, k)

    def call(t):
        w = t["weight"] if k["weight_layout"] == "contiguous" else t["weight"].T.contiguous().T
        out = pf.linear_token_logprobs(
            t["hidden"],
            w,
            t["labels"],
            bias=t.get("bias"),
            temperature=k["temperature"],
            logit_scale=k["logit_scale"],
            logit_softcap=k["softcap"],
            return_entropy=k["entropy"],
            ignore_index=k["ignore_index"],
        )
        return out if k["entropy"] else (out,)

    inputs = {
        "hidden": Input(hidden, masked=ignored.unsqueeze(-1).expand(B, T, H)),
        "weight": Input(weight, layout=False),
    }
    if bias is not None:
        inputs["bias"] = Input(bias, layout=False)
    # A float32 dot product of H terms is off by up to H eps sum|h_i w_i| (and its rounding, eps |u|); a log-prob
    # z_y - lse moves by at most twice the largest error of the row's z = logit_scale * u / T (tanh is 1-Lipschitz).
    eps = torch.finfo(torch.float32).eps if spec.dtype != "float64" else 0.0
    u = hidden @ weight.T + (0 if bias is None else bias)
    spread = hidden.abs() @ weight.abs().T + (0 if bias is None else bias.abs())
    z_error = (H * eps * spread + eps * u.abs()) * k["logit_scale"] / k["temperature"]
    rounding = {0: 2 * z_error.amax(-1)}
    return Built(
        inputs, {"labels": labels}, call, (0, 1) if k["entropy"] else (0,), {0: ignored, 1: ignored}, rounding=rounding
    )


def _pair(gen, spec, k, shape):
    logp = rounded(-torch.randn(shape, generator=gen, dtype=F64).abs() * 2 - 0.01, spec)
    return logp, rounded(logp - log_ratio(gen, shape, k["ratio"]), spec)


def build_kl_estimate(spec, gen, k):
    """Every estimator (one output each) of the same log-probs."""
    logp, ref = _pair(gen, spec, k, spec.dims)
    call = lambda t: tuple(pf.kl_estimate(t["logprobs"], t["ref_logprobs"], e) for e in KL_ESTIMATORS)  # noqa: E731
    outputs = range(len(KL_ESTIMATORS))
    return Built(
        {"logprobs": Input(logp), "ref_logprobs": Input(ref)},
        {},
        call,
        tuple(outputs),
        kl_ratio=dict.fromkeys(outputs, logp - ref),
    )


def build_kl_penalized_rewards(spec, gen, k):
    mask = mask_of(gen, spec.dims)
    logp, ref = _pair(gen, spec, k, spec.dims)
    scores = rounded(torch.randn(spec.dims[0], generator=gen, dtype=F64), spec)
    call = lambda t: pf.kl_penalized_rewards(
        t["scores"],
        t["logprobs"],
        t["ref_logprobs"],
        t["mask"],  # noqa: E731
        kl_coef=k["kl_coef"],
        kl_estimator=k["kl_estimator"],
    )
    inputs = {
        "scores": Input(scores, masked=~mask.any(-1), layout=False),
        "logprobs": Input(logp, masked=~mask),
        "ref_logprobs": Input(ref, masked=~mask),
    }
    return Built(inputs, {"mask": mask}, call, (0, 1), {0: ~mask, 1: ~mask}, {1: torch.where(mask, logp - ref, 0.0)})


def build_gae(spec, gen, k):
    mask = mask_of(gen, spec.dims)
    rewards, values = (rounded(torch.randn(spec.dims, generator=gen, dtype=F64) * k["scale"], spec) for _ in range(2))
    call = lambda t: pf.gae(t["rewards"], t["values"], t["mask"], gamma=k["gamma"], lam=k["lam"])  # noqa: E731
    return Built(
        {"rewards": Input(rewards, masked=~mask), "values": Input(values, masked=~mask)},
        {"mask": mask},
        call,
        (0, 1),
        {0: ~mask, 1: ~mask},
    )


def build_policy_loss(spec, gen, k):
    """A registered policy-loss mode (vanilla also through pf.clipped_policy_loss)."""
    shape = spec.dims
    mask = mask_of(gen, shape)
    old = rounded(-torch.randn(shape, generator=gen, dtype=F64).abs() * 2 - 0.05, spec)
    logp = rounded(old + log_ratio(gen, shape, k["ratio"]), spec)
    adv = torch.randn(shape, generator=gen, dtype=F64) * k["adv_scale"]
    adv = rounded({"mixed": adv, "negative": -adv.abs(), "positive": adv.abs()}[k["adv_sign"]], spec)
    inputs = {
        "logprobs": Input(logp, masked=~mask),
        "old_logprobs": Input(old, masked=~mask),
        "advantages": Input(adv, masked=~mask),
    }
    if k["weighted"]:
        inputs["weights"] = Input(rounded(torch.rand(shape, generator=gen, dtype=F64) * 2, spec), masked=~mask)
    mode, params = POLICY_LOSS_MODES[k["loss_mode"]], dict(k["params"])

    def call(t):
        if mode.syncs_host:
            torch.manual_seed(0)  # clip_cov draws the tokens it cuts from the default generator
        args = (t["logprobs"], t["old_logprobs"], t["advantages"], t["mask"])
        if k["entry"] == "clipped_policy_loss":
            loss, stats = pf.clipped_policy_loss(*args, agg=k["agg"], weights=t.get("weights"), **params)
        else:
            loss, stats = pf.policy_loss(*args, loss_mode=mode.name, agg=k["agg"], weights=t.get("weights"), **params)
        return loss, *stats.values()

    return Built(inputs, {"mask": mask}, call)


def build_value_loss(spec, gen, k):
    mask = mask_of(gen, spec.dims)
    values, old, returns = (rounded(torch.randn(spec.dims, generator=gen, dtype=F64), spec) for _ in range(3))
    old = rounded(values + (old - values) * k["spread"], spec)
    inputs = {"values": Input(values, masked=~mask), "returns": Input(returns, masked=~mask)}
    if k["old_values"]:
        inputs["old_values"] = Input(old, masked=~mask)  # not read without clipping: no gradient either

    def call(t):
        loss, stats = pf.value_loss(
            t["values"], t.get("old_values"), t["returns"], t["mask"], clip=k["clip"], agg=k["agg"]
        )
        return loss, stats["clipfrac"]

    return Built(inputs, {"mask": mask}, call)


def build_group_advantages(spec, gen, k):
    B, T = spec.dims
    mask = mask_of(gen, (B, T))
    shape = (B, T) if k["token_scores"] else (B,)
    scores = torch.randn(shape, generator=gen, dtype=F64) * k["scale"]
    if k["ties"]:  # equal scores in a group: a std of 0
        scores = scores.round()
    inputs = {"scores": Input(rounded(scores, spec), masked=~mask if k["token_scores"] else ~mask.any(-1))}
    params = dict(k["params"])
    if "baselines" in ADVANTAGE_METHODS[k["method"]].params:
        inputs["baselines"] = Input(rounded(torch.randn(B, generator=gen, dtype=F64), spec), grad=False, layout=False)
    ids = torch.randint(0, k["groups"], (B,), generator=gen) * 7 - 3

    def call(t):
        extra = {"baselines": t["baselines"]} if "baselines" in t else {}
        return (pf.group_advantages(t["scores"], t["group_ids"], t["mask"], method=k["method"], **params, **extra),)

    return Built(inputs, {"mask": mask, "group_ids": ids}, call, (0,), {0: ~mask})


def build_rollout_correction(spec, gen, k):
    mask = mask_of(gen, spec.dims)
    old, rollout = _pair(gen, spec, k, spec.dims)
    inputs = {
        "old_logprobs": Input(old, grad=False, masked=~mask),
        "rollout_logprobs": Input(rollout, grad=False, masked=~mask),
    }
    call = lambda t: (
        pf.rollout_correction_weights(
            t["old_logprobs"],
            t["rollout_logprobs"],
            t["mask"],
            mode=k["mode"],  # noqa: E731
            threshold=k["threshold"],
            threshold_low=k["threshold_low"],
            batch_normalize=k["batch_normalize"],
        ),
    )
    return Built(inputs, {"mask": mask}, call, (), {0: ~mask})


def build_masked_stats(spec, gen, k):
    mask = mask_of(gen, spec.dims)
    x = rounded(torch.randn(spec.dims, generator=gen, dtype=F64) * k["scale"] + k["offset"], spec)

    def call(t):
        if k["fn"] == "whiten":
            return (pf.masked_whiten(t["x"], t["mask"], shift_mean=k["shift_mean"], eps=k["eps"]),)
        return (pf.masked_mean(t["x"], t["mask"], dim=k["dim"]),)

    return Built({"x": Input(x, masked=~mask)}, {"mask": mask}, call, (0,), {0: ~mask} if k["fn"] == "whiten" else {})


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


def poisoned(built: Built, spec: Spec, gen) -> dict[str, torch.Tensor]:
    """The float inputs' values with the spec's poison: NaN/+-inf at masked positions, or one
    NaN/+-inf at a valid position of one input; expanded inputs repeat their first row."""
    out = {}
    names = list(built.inputs)
    for name, inp in built.inputs.items():
        x = inp.values.clone()
        if spec.poison == "masked" and inp.masked is not None:
            junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=F64)[torch.randint(0, 3, x.shape, generator=gen)]
            x = torch.where(inp.masked, junk, x)
        elif spec.poison.startswith("valid") and name == names[spec.poison_input % len(names)]:
            valid = (
                (~inp.masked if inp.masked is not None else torch.ones_like(x, dtype=torch.bool)).flatten().nonzero()
            )
            if len(valid):
                x.view(-1)[valid[torch.randint(0, len(valid), (1,), generator=gen)]] = float(spec.poison.split()[1])
        if spec.layout == "expanded" and inp.layout and x.dim() and x.shape[0]:
            x = x[:1].expand_as(x).clone()
        out[name] = x
    return out


@dataclasses.dataclass
class Run:
    error: BaseException | None = None
    outputs: list = dataclasses.field(default_factory=list)
    requires_grad: list = dataclasses.field(default_factory=list)
    grads: dict = dataclasses.field(default_factory=dict)  # leaf name -> gradient in the leaf's layout (None: none)
    views: dict = dataclasses.field(default_factory=dict)  # leaf name -> leaf gradient to the input's shape
    second: dict | None = None  # leaf name -> second-order gradient
    second_error: BaseException | None = None
    projection: tuple | None = None


def run(built, spec, values, backend, dtype, projection=None, compiled=None, second_order=False) -> Run:
    """The op on ``backend`` on ``values`` in ``dtype`` and the spec's layout, and the gradients
    of ``sum(w * out)`` over the outputs where ``finite``: ``projection = (finite, w)``, by
    default this run's finite outputs and random weights (the reference's, for the others)."""
    tensors, leaves, views = {}, {}, {}
    for name, inp in built.inputs.items():
        leaf, view_of = laid_out(values[name].to(dtype), spec.layout if inp.layout else "contiguous")
        if inp.grad:
            leaves[name], views[name] = leaf.requires_grad_(True), view_of
        tensors[name] = view_of(leaf)
    for name, t in built.others.items():
        leaf, view_of = laid_out(t, spec.layout if spec.layout in ("sliced", "transposed") else "contiguous")
        tensors[name] = view_of(leaf)
    result = Run(views=views)
    fn = (
        built.call
        if compiled is None
        else torch.compile(built.call, fullgraph=True, backend="aot_eager", dynamic=compiled)
    )
    try:
        with pf.use_backend(backend):
            outputs = fn(tensors)
    except Exception as err:  # compared with the reference's
        return Run(error=err)
    result.outputs = [o.detach() for o in outputs]
    result.requires_grad = [o.requires_grad for o in outputs]
    if projection is None:
        wgen = torch.Generator().manual_seed(spec.seed + 1)
        projection = (
            [torch.isfinite(o) for o in result.outputs],
            [torch.randn(o.shape, generator=wgen) for o in result.outputs],
        )
    result.projection = finite, weights = projection
    total = sum(
        (torch.where(finite[i], outputs[i], 0.0) * weights[i].to(outputs[i].dtype)).sum() for i in built.differentiable
    )
    result.grads = result.second = dict.fromkeys(leaves)
    if not leaves or not isinstance(total, torch.Tensor) or not total.requires_grad:
        return result
    grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True, retain_graph=second_order)
    result.grads = dict(zip(leaves, grads))
    if second_order:  # d/dx of sum(v * d total/dx): raising is fine, silent zeros are not
        try:
            grads = torch.autograd.grad(total, list(leaves.values()), allow_unused=True, create_graph=True)
            gen = torch.Generator().manual_seed(spec.seed + 2)
            s = sum(
                (g * torch.randn(g.shape, generator=gen).to(g.dtype)).sum()
                for g in grads
                if g is not None and g.requires_grad
            )
            second = (
                torch.autograd.grad(s, list(leaves.values()), allow_unused=True)
                if isinstance(s, torch.Tensor)
                else [None] * len(leaves)
            )
            result.second = dict(zip(leaves, second))
        except (RuntimeError, NotImplementedError) as err:
            result.second_error = err
    return result


# --------------------------------------------------------------------------- the rules


def pattern(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    return torch.isnan(x).long() + 2 * (x == math.inf).long() + 3 * (x == -math.inf).long()


def first_at(x, bad):
    return f"at flat index {bad.flatten().nonzero()[0, 0].item()} of shape {tuple(x.shape)}"


def nonzero(x) -> bool:
    return x is not None and bool(((x != 0) & torch.isfinite(x)).any())


def assert_accurate(what, got, ref32, ref64, moved, dtype, relaxed=None, rounding=None):
    """``got`` within C x the float32 reference's own error of float64, plus C x how far float64
    moves when the inputs move by an ulp (``moved``: an ill-conditioned result, exp of a large
    mean, is that uncertain in any evaluation order), plus a floor, where the reference is
    finite; below the dtype's smallest normal number or 1e-30 (flushed subnormals, an exp
    that underflows a little early) is no error."""
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
    got = run(built, spec, values, spec.backend, dtype, ref32.projection, compiled, spec.second_order)
    # NaN/inf at masked positions is never read: the truth is that of the clean inputs.
    masked_poison = spec.poison == "masked" and spec.layout != "expanded"
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
        if g is not None and masked is not None and spec.layout != "expanded":
            bad = (got.views[name](g) != 0) & masked
            assert not bad.any(), (
                f"{what}: nonzero at a masked position {first_at(masked, bad)}: {got.views[name](g)[bad][:4].tolist()}"
            )
        # The gradient at a NaN/inf input itself is unspecified: compared where the reference's is finite.
        assert_accurate(what, g, r, e, moved.grads[name], dtype, None if r is None else torch.isfinite(r))
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
                    None if r is None else torch.isfinite(r),
                )


# --------------------------------------------------------------------------- the tests


# Known regressions (the random draws reach each of them too), as explicit examples.
_HEAD = {
    "scale": 1.0,
    "labels": "greedy",
    "ignored": 0.0,
    "ignore_index": -100,
    "entropy": False,
    "logit_scale": 1.0,
    "softcap": None,
    "bias": False,
    "weight_layout": "contiguous",
}
_LOSS = {"params": (), "entry": "policy_loss", "agg": "token-mean", "weighted": False, "adv_scale": 1.0}
EXAMPLES = {
    "linear_token_logprobs": [
        # ignore_index a valid token id, NaN in those rows' hidden states: 0 and no gradient there.
        Spec(
            "native",
            "float32",
            "contiguous",
            "masked",
            (1, 3, 4, 5),
            {**_HEAD, "temperature": 1.0, "labels": "random", "ignored": 0.5, "ignore_index": 0},
            seed=1,
        ),
        # greedy labels at T = 1e-3: d_hidden is 0, as the reference's (native's was not).
        Spec("native", "float32", "contiguous", "clean", (2, 3, 8, 11), {**_HEAD, "temperature": 1e-3}),
    ],
    # logits ~1e3 at the minimum temperature, greedy labels: the gradient is 0 (native's was ~1e4-1e5).
    "token_logprobs": [
        Spec(
            "native",
            "float32",
            "contiguous",
            "clean",
            (2, 3, 7),
            {
                "temperature": MIN_TEMPERATURE,
                "scale": 1e3,
                "labels": "greedy",
                "ignored": 0.0,
                "ignore_index": -100,
                "entropy": False,
            },
        )
    ],
    # k3 at log-ratios 1e-4..1e-3: within 1e-4 of float64 (float32 exp(r) - r - 1 cancels to 0).
    "kl_estimate": [Spec("reference", "float32", "contiguous", "clean", (3, 5), {"ratio": "tiny"})],
    # exp(mean log-ratio) at float32's overflow (85..92): the reference's inf or value (native saturated below it).
    "policy_loss_geo_mean": [
        Spec(
            "native",
            "float32",
            "contiguous",
            "clean",
            (2, 1),
            {**_LOSS, "loss_mode": "geo_mean", "ratio": "huge", "adv_sign": "negative"},
        )
    ],
    # -inf log-prob at a valid token: NaN as the reference (native gave a finite loss).
    "policy_loss_gspo": [
        Spec(
            "native",
            "float32",
            "contiguous",
            "valid -inf",
            (2, 3),
            {**_LOSS, "loss_mode": "gspo", "ratio": "normal", "adv_sign": "mixed"},
        )
    ],
}


def _make_test(case: Case):
    @budget(case.ci_examples)
    @given(spec=specs(case))
    def test(spec):
        check(case, spec)

    for spec in EXAMPLES.get(case.name, []):
        test = example(spec=spec)(test)
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
