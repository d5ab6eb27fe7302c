"""The conformance matrix: every backend against the reference, generated from what each
backend declares it serves.

op x backend x device x dtype x layout x poison, forward and backward: the same random
inputs go through the public op under ``use_backend(name)`` and under the reference, and
every output and every input gradient must agree.  Layouts are contiguous, sliced (the
gaps of the storage hold NaN, so a kernel that reads them is caught), transposed and
expanded (stride 0).  Poison puts NaN/inf at masked positions (and in ignored rows),
which must reach no result and no gradient, or NaN at valid positions, which must
propagate exactly as in the reference (``ppo_fast.contract``).

Then the bad inputs (BAD_INPUTS, every argument check of the public functions): each raises
the documented error on every backend, eagerly and under ``torch.compile(fullgraph=True)``;
out-of-range labels, eager and compiled, on both log-prob ops; and Hypothesis
properties of the ops.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from functools import partial

import harness
import pytest
import tiers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_map

import ppo_fast as pf
from ppo_fast.advantage_methods import REGISTRY as ADVANTAGE_METHODS
from ppo_fast.backends import BACKENDS, backend_info, serving
from ppo_fast.spec import AGG_MODES, KL_ESTIMATORS, LINEAR_POLICY_LOSS_OPS, OPS, POLICY_LOSS_MODES, POLICY_LOSS_OPS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FAST_BACKENDS = [name for name in BACKENDS if name != "reference"]
POISONS = ("clean", "masked", "valid")
UNMASKED = {"kl_estimate"}  # ops without a mask: nothing to poison at masked positions


def axes(op: str) -> tuple:
    """The matrix's axes for ``op``: dtypes, layouts, poisons."""
    return FLOATS, harness.LAYOUTS, tuple(p for p in POISONS if p != "masked" or op not in UNMASKED)


FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DIMS = (3, 6, 37)  # B, T, V of most cases
# Long rows: past the native CPU kernels' chunks (1024 logits, 256 tokens) and the Triton
# kernels' widest blocks (4096 logits, 1024 tokens), so that the carries between chunks
# are compared too.
LONG_DIMS = {"logits": (2, 3, 4099), "hidden": (2, 3, 4099), "tokens": (2, 1100, 0)}
HIDDEN = 11  # H of the LM-head ops: odd, not a multiple of any tile


# The Triton one-pass loss runs every mode through one loop whose mode-specific part is the
# mode's reference function.  Interpreted it is slow, so the matrix samples it on a token-level
# and a sequence-level mode, and finite differences check it once (vanilla's first variant);
# tests/test_linear_policy_loss.py checks every mode on it against the two-pass composition.
_TRITON_LOSS_SAMPLE = {POLICY_LOSS_MODES["vanilla"].linear_op, POLICY_LOSS_MODES["gspo"].linear_op}


def fast(op: str, device: str) -> list[str]:
    """The fast backends that serve ``op`` on ``device`` here (the Triton one-pass loss sampled)."""
    sampled = op not in LINEAR_POLICY_LOSS_OPS or op in _TRITON_LOSS_SAMPLE
    return [name for name in serving(op, device) if name != "reference" and (name != "triton" or sampled)]


def _served(ops, backends=serving):
    """``(op, backend, device, marks)``: each op of ``ops`` on each device, on each of ``backends(op, device)``."""
    for op in ops:
        for device in DEVICES:
            for backend in backends(op, device):
                yield op, backend, device, [pytest.mark.cuda] if device == "cuda" else []


def test_every_backend_declares_only_contract_ops():
    for name in BACKENDS:
        info = backend_info(name)
        if info.available:
            assert set(info.module.SUPPORTED) <= set(OPS), name
    assert set(backend_info("reference").module.SUPPORTED) == set(OPS)


# --------------------------------------------------------------------------- inputs (tests/harness.py)

_LOGITS = {"temperature": 0.7, "scale": 3.0, "labels": "random", "ignored": 0.25, "ignore_index": -100, "entropy": True}
_HEAD = {**_LOGITS, "scale": 1.0, "logit_scale": 0.8, "softcap": None, "bias": True, "weight_layout": "contiguous"}


def _loss(mode: str, **more) -> dict:
    """A policy-loss mode's knobs (tests/harness.py's builders) at moderate log-ratios and advantages."""
    params = POLICY_LOSS_MODES[mode].example_params()
    if "clip_eps_high" in {p.name for p in POLICY_LOSS_MODES[mode].params}:
        params["clip_eps_high"] = 0.28
    knobs = {"loss_mode": mode, "agg": AGG_MODES[0], "weighted": False, "entry": "policy_loss", "ratio": "normal"}
    return {**knobs, "adv_scale": 1.0, "adv_sign": "mixed", "params": tuple(params.items()), **more}


def _varied(first: dict, *changes: dict) -> list[dict]:
    """``first``, then ``first`` with each of ``changes``."""
    return [first, *({**first, **change} for change in changes)]


def _aggs(first: dict, *changes: dict) -> list[dict]:
    """``first`` with every agg mode, then with each of ``changes``."""
    return _varied(first, *({"agg": agg} for agg in AGG_MODES[1:]), *changes)


_VANILLA = _loss("vanilla", entry="clipped_policy_loss")
_DUAL_CLIP = {"weighted": True, "params": (*_VANILLA["params"], ("dual_clip", 3.0))}
_VALUE = {"clip": 0.2, "agg": AGG_MODES[0], "old_values": True, "spread": 1.0}
# group_sum: through the public op of each advantage method that runs on the fast backends
_METHODS = [name for name, m in ADVANTAGE_METHODS.items() if m.fn and set(FAST_BACKENDS) <= set(m.backends)]
_GROUPS = {"params": (), "token_scores": True, "groups": 3, "ties": False, "scale": 1.0}
# op -> (its builder, the shape of its dims, its variants: the builder's knobs); here the shape and variants
VARIANTS = {
    "token_logprobs": ("logits", _varied(_LOGITS, {"entropy": False})),
    "linear_token_logprobs": ("hidden", _varied(_HEAD, {"entropy": False, "bias": False}, {"softcap": 2.5})),
    "kl_estimate": ("tokens", [{"ratio": "normal"}]),  # every estimator in one case
    "kl_penalized_rewards": ("tokens", [{"kl_estimator": e, "ratio": "normal", "kl_coef": 0.3} for e in KL_ESTIMATORS]),
    "gae": ("tokens", [{"gamma": g, "lam": lam, "scale": 1.0} for g, lam in ((0.99, 0.95), (1, 1))]),
    "clipped_policy_loss": ("tokens", _aggs(_VANILLA, _DUAL_CLIP)),
    "value_loss": ("tokens", _aggs(_VALUE, {"clip": None})),
    "group_sum": ("tokens", [{"method": name, **_GROUPS} for name in _METHODS]),
}
# Every registered policy-loss mode other than vanilla (clipped_policy_loss above) is its own op,
# and the one-pass loss through the LM head of each mode that allows it.
# The one pass under the sampler's truncation: one setting a mode, in turn (the rows' likeliest tokens as labels).
_TRUNCATIONS = (
    {"truncation": (("top_k", 5),)},
    {"truncation": (("top_p", 0.8),), "softcap": 2.5},
    {"truncation": (("min_p", 0.05), ("top_p", 0.95))},
)
for _mode in POLICY_LOSS_MODES.values():
    VARIANTS.setdefault(_mode.op, ("tokens", _aggs(_loss(_mode.name), {"weighted": True})))
    if _mode.fused_head:
        _first = _loss(_mode.name, **_HEAD, kl_coef=0.1, entropy_coef=0.01)
        _truncated = _TRUNCATIONS[len([v for v in VARIANTS if v in LINEAR_POLICY_LOSS_OPS]) % len(_TRUNCATIONS)]
        _changes = ({"weighted": True, "bias": False}, {"softcap": 2.5}, _truncated)
        VARIANTS[_mode.linear_op] = ("hidden", _aggs(_first, *_changes))
# The builders: harness.build_<op>, or the one of the op's kind.
_KINDS = {"group_sum": "group_advantages", **dict.fromkeys(POLICY_LOSS_OPS, "policy_loss")}
_KINDS.update(dict.fromkeys(LINEAR_POLICY_LOSS_OPS, "linear_policy_loss"))
VARIANTS = {op: (getattr(harness, f"build_{_KINDS.get(op, op)}"), *entry) for op, entry in VARIANTS.items()}
for _op, (_, _shape, _variants) in VARIANTS.items():
    _variants.append({**_variants[0], "dims": LONG_DIMS[_shape]})
assert set(VARIANTS) == set(OPS), "every op of the contract is in the matrix"


def built_case(op, variant, dtype=torch.float32, layout="contiguous", poison="clean", device="cpu", **more):
    """``(built, spec, values)``: the op's inputs (tests/harness.py) for a cell of the matrix;
    ``more``: the Spec's seed, dims ``(B, T, V)`` (else the variant's, else DIMS), all_masked or the
    backend compared (its input filter: ``harness.without_interpreter_bf16_subnormals``)."""
    build, shape, _ = VARIANTS[op]
    knobs = {k: v for k, v in variant.items() if k != "dims"}
    B, T, V = more.pop("dims", variant.get("dims", DIMS))
    dims = {"logits": (B, T, V), "hidden": (B, T, HIDDEN, V), "tokens": (B, T)}[shape]
    poison = "valid nan" if poison == "valid" else poison
    backend = more.pop("backend", "reference")
    spec = harness.Spec(backend, str(dtype)[6:], layout, poison, dims, knobs, device=device, **more)
    gen = torch.Generator().manual_seed(spec.seed)
    built = harness.without_interpreter_bf16_subnormals(build(spec, gen, knobs), spec)
    return built, spec, harness.poisoned(built, spec, gen)


def run_case(backend, op, variant, **cell) -> tuple[harness.Run, harness.Run, dict]:
    """The op on ``backend`` and on the reference (outputs and the gradients of the same projection),
    and the float inputs' values."""
    built, spec, values = built_case(op, variant, backend=backend, **cell)
    dtype = harness.DTYPES[spec.dtype]
    want = harness.run(built, spec, values, "reference", dtype, raises=True)
    return harness.run(built, spec, values, backend, dtype, want.projection, raises=True), want, values


def _label(variant: dict, first: dict) -> str:
    return "".join(f"-{k}={v}" for k, v in variant.items() if first.get(k) != v)


def _matrix():
    """Every op x backend x device on every dtype, layout, poison and variant.  The fast tier takes
    every pair of dtype, layout and poison (every value once on the interpreted Triton) and every
    variant on the contiguous clean float32 cell; the rest is the full tier (``--full``)."""
    for op, backend, device, marks in _served(OPS, fast):
        # The first cell: contiguous clean float32.
        cells, variants = list(itertools.product(*axes(op))), VARIANTS[op][2]
        fast_tier = {cells[i] for i in tiers.covering(cells, strength=_strength(backend, device))}
        for dtype, layout, poison in cells:
            # Every variant on the contiguous clean float32 case; one per other cell.
            for variant in variants if (dtype, layout, poison) == cells[0] else variants[:1]:
                yield tiers.case(
                    *(op, backend, device, dtype, layout, poison, variant),
                    fast=(dtype, layout, poison) in fast_tier,
                    id=f"{op}-{backend}-{device}-{str(dtype)[6:]}-{layout}-{poison}{_label(variant, variants[0])}",
                    marks=marks,
                )


def _strength(backend: str, device: str) -> int:
    """Pairs of the matrix's axes in the fast tier; each value once on the interpreted Triton (slow)."""
    return 1 if backend == "triton" and device == "cpu" else 2


def test_the_fast_tier_covers_every_value_and_pair_of_every_op_and_backend():
    """The fast tier drops no rule: per op x backend x device, every variant, and every pair of
    dtype, layout and poison (every value, on the interpreted Triton) has a cell without the ``full`` mark."""
    cells: dict[tuple, set] = {}
    for param in _matrix():
        if not tiers.is_full(param):
            op, backend, device, dtype, layout, poison, variant = param.values
            cells.setdefault((op, backend, device), set()).add((dtype, layout, poison, repr(variant)))
    assert set(cells) == {(op, b, d) for op in OPS for d in DEVICES for b in fast(op, d)}
    for (op, backend, device), got in cells.items():
        for chosen in itertools.combinations(range(3), _strength(backend, device)):
            want = set(itertools.product(*(axes(op)[i] for i in chosen)))
            assert {tuple(c[i] for i in chosen) for c in got} == want, (op, backend, device, chosen)
        assert {c[3] for c in got} == {repr(v) for v in VARIANTS[op][2]}, (op, backend, device)


# Outputs are computed in float32 (float64 for float64 inputs) by every backend from the same
# inputs (the tolerance of their compute dtype); gradients are rounded to the input dtype.
TOLERANCE = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-11},
    torch.float32: {"rtol": 2e-5, "atol": 2e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 1e-5},
}


@pytest.mark.parametrize("op, backend, device, dtype, layout, poison, variant", list(_matrix()))
def test_backend_matches_reference(op, backend, device, dtype, layout, poison, variant, request):
    seed = zlib.crc32(request.node.nodeid.encode())
    cell = dict(dtype=dtype, layout=layout, poison=poison, device=device, seed=seed)
    got, want, _ = run_case(backend, op, variant, **cell)
    for i, (o, r) in enumerate(zip(got.outputs, want.outputs, strict=True)):  # assert_close: dtype, shape, values
        tolerance = TOLERANCE[dtype if dtype == torch.float64 else torch.float32]
        torch.testing.assert_close(o, r, equal_nan=True, **tolerance, msg=lambda m: f"output {i}: {m}")
    for name, r in want.grads.items():
        g = got.grads[name]
        if r is None:  # an input the op does not read (value_loss's old_values without clipping)
            assert g is None, f"{backend}: a gradient for {name}, which the reference does not read"
            continue
        assert g is not None, f"{backend}: no gradient for {name} (the reference has one)"
        if poison == "valid":  # the gradient at a NaN input itself is unspecified; the rest must agree
            keep = torch.isfinite(r)
            g, r = g[keep], r[keep]
        tolerance = dict(TOLERANCE[dtype])
        if op == "linear_token_logprobs" and dtype in (torch.bfloat16, torch.float16) and r.numel():
            # A fused head may round d_logits to the input dtype before its products (as
            # tensor cores need): an error of that precision times the gradient's scale.
            tolerance["atol"] = max(tolerance["atol"], tolerance["rtol"] * float(r.abs().max()))
        torch.testing.assert_close(g, r, equal_nan=True, **tolerance, msg=lambda m: f"grad of {name}: {m}")
    if poison == "masked":  # masked NaN/inf reaches nothing
        for i, out in enumerate(got.outputs):
            assert torch.isfinite(out).all(), f"output {i} is not finite: masked values leaked"
        for name, g in got.grads.items():
            assert g is None or torch.isfinite(g).all(), f"grad of {name} is not finite: masked values leaked"


# --------------------------------------------------------------------------- compiled


# Modes whose token selection is data-dependent (nonzero, topk sizes from .item(), as verl's)
# break the graph: no fullgraph case for them.
_GRAPH_BREAKING = {mode.op for mode in POLICY_LOSS_MODES.values() if mode.syncs_host}


def _compiled_cases():
    for op, backend, device, marks in _served([op for op in OPS if op not in _GRAPH_BREAKING]):
        # The reference one-pass loss is a plain composition: one of its modes in the fast tier.  The
        # others' modes share one traced path (the head's operators; the modes differ in torch terms):
        # on the CPU every third mode on the interpreted Triton, the next third on the native kernels.
        sampled = backend == "reference" and op in LINEAR_POLICY_LOSS_OPS and op != "linear_policy_loss_gpg"
        if backend in ("triton", "native") and op in LINEAR_POLICY_LOSS_OPS and device == "cpu":
            sampled = LINEAR_POLICY_LOSS_OPS.index(op) % 3 != ("triton", "native").index(backend)
        yield tiers.case(op, backend, device, fast=not sampled, marks=marks, id=f"{op}-{backend}-{device}")


@pytest.mark.parametrize("op, backend, device", list(_compiled_cases()))
def test_compiled_fullgraph_matches_eager(op, backend, device):
    """One graph (fullgraph=True) through the public op, forward and backward, equal to eager."""
    built, spec, values = built_case(op, VARIANTS[op][2][0], device=device, seed=7)
    torch._dynamo.reset()
    eager = harness.run(built, spec, values, backend, torch.float32, raises=True)
    compiled = harness.run(built, spec, values, backend, torch.float32, eager.projection, compiled=False, raises=True)
    for got, want in zip(compiled.outputs + list(compiled.grads.values()), eager.outputs + list(eager.grads.values())):
        if want is None:  # an input the op does not read (GSPO's old_logprobs)
            assert got is None
            continue
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- edge shapes

EDGE_SHAPES = {"one-token": (1, 1, 5), "empty-responses": (3, 0, 5), "empty-batch": (0, 3, 5), "all-masked": (3, 4, 5)}


def _edge_cases():
    for op, backend, device, marks in _served(OPS):
        for edge in EDGE_SHAPES:
            if not (edge == "all-masked" and op in UNMASKED):
                yield pytest.param(op, backend, device, edge, marks=marks, id=f"{op}-{backend}-{device}-{edge}")


@pytest.mark.parametrize("op, backend, device, edge", list(_edge_cases()))
def test_edge_shapes_match_reference(op, backend, device, edge):
    """One token, empty responses, an empty batch: the reference's shapes, values and
    gradients.  With everything masked every output and every gradient is 0."""
    cell = dict(device=device, seed=11, dims=EDGE_SHAPES[edge], all_masked=edge == "all-masked")
    got, want, values = run_case(backend, op, VARIANTS[op][2][0], **cell)
    for o, r in zip(got.outputs, want.outputs, strict=True):  # assert_close: dtype, shape, values
        torch.testing.assert_close(o, r, rtol=2e-5, atol=2e-5)
    zero = {name: torch.zeros_like(x, device=device) for name, x in values.items()}
    for name in want.grads:  # no gradient: a zero one
        g, r = (zero[name] if x.grads[name] is None else x.grads[name] for x in (got, want))
        assert g.shape == r.shape == values[name].shape, name
        torch.testing.assert_close(g, r.to(g.dtype), rtol=2e-5, atol=2e-5)
    if edge == "all-masked":
        assert all(torch.count_nonzero(out) == 0 for out in got.outputs)
        assert all(g is None or torch.count_nonzero(g) == 0 for g in got.grads.values())


# --------------------------------------------------------------------------- gradcheck

GRADCHECK_DIMS = (2, 3, 5)


# Losses whose gradient is by design not their derivative (a stop-gradient inside): their
# backward is checked against the reference's autograd only (test_backend_matches_reference).
STOP_GRADIENT_SURROGATES = {
    op for mode in POLICY_LOSS_MODES.values() if mode.surrogate_gradient for op in (mode.op, mode.linear_op)
}


def _gradcheck_cases():
    """Every op x backend x variant.  The fast tier takes the first variant and one more (each op
    another), and on the interpreted Triton torch's fast gradcheck (a random projection of the
    Jacobian: two evaluations instead of one per input element); the full tier all of them, whole."""
    for k, op in enumerate(op for op in OPS if op not in STOP_GRADIENT_SURROGATES):
        for backend in serving(op, "cpu"):
            variants, one_pass = VARIANTS[op][2][:-1], op in LINEAR_POLICY_LOSS_OPS  # not the long rows
            for i, variant in enumerate(variants):
                if backend == "triton" and one_pass and (i or op != POLICY_LOSS_MODES["vanilla"].linear_op):
                    continue
                for fast_mode in (True, False) if backend == "triton" else (False,):
                    # The one-pass losses' variants (aggs, soft-cap) are the two-pass ops' (checked above): one here.
                    more = () if one_pass else (1 + k % max(1, len(variants) - 1),)
                    sampled = i in (0, *more) and (fast_mode or backend != "triton")
                    name = f"{op}-{backend}-{i}" + ("-fast" if fast_mode else "")
                    yield tiers.case(op, backend, variant, fast_mode, fast=sampled, id=name)


@pytest.mark.parametrize("op, backend, variant, fast_mode", list(_gradcheck_cases()))
def test_gradcheck_float64(op, backend, variant, fast_mode):
    """Every backend's backward against finite differences (float64 inputs are computed in float64)."""
    built, spec, values = built_case(op, variant, dtype=torch.float64, seed=3, dims=GRADCHECK_DIMS)
    tensors, leaves, views = harness.tensors_of(built, spec, values, torch.float64)

    def differentiable_outputs(*xs):
        with pf.use_backend(backend):
            outputs = built.call({**tensors, **{name: views[name](x) for name, x in zip(leaves, xs)}})
        return tuple(outputs[i] for i in built.differentiable)

    assert torch.autograd.gradcheck(differentiable_outputs, tuple(leaves.values()), fast_mode=fast_mode)


# --------------------------------------------------------------------------- opcheck of the native operators


def _native_operators():
    info = backend_info("native")
    return info.module.OPERATORS if info.available else ()


@pytest.fixture(scope="module")
def native_operator_calls():
    """operator name -> the argument lists it was called with by the matrix's cases on the
    native backend: forward, backward of every input and of the first input only."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: dict[str, list] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "ppo_fast":
                snapshot = tree_map(lambda a: a.detach().clone() if torch.is_tensor(a) else a, (args, kwargs or {}))
                calls.setdefault(func._schema.name.split("::")[1], []).append((func, *snapshot))
            return func(*args, **(kwargs or {}))

    with Record(), pf.use_backend("native"):
        for op in [op for op in OPS if "native" in serving(op, "cpu")]:
            for variant in VARIANTS[op][2][:-1]:
                built, spec, values = built_case(op, variant, seed=5)
                tensors, leaves, _ = harness.tensors_of(built, spec, values, torch.float32)
                outputs = built.call(tensors)
                total = sum(outputs[i].sum() for i in built.differentiable)
                leaves = list(leaves.values())
                for subset in (leaves, leaves[:1], leaves[1:2]):  # every input, the first only, the second only
                    if subset:
                        torch.autograd.grad(total, subset, retain_graph=True, allow_unused=True)
        pf.gae(torch.randn(2, 3), torch.randn(2, 3), torch.tensor([[1.0, 0.0, 1.0]] * 2))  # a 0/1 float mask: bool_mask
        rewards = torch.randn(5, requires_grad=True)  # the packed layout's gae_varlen and its backward
        pf.gae(rewards, torch.randn(5), torch.ones(5), cu_seqlens=torch.tensor([0, 2, 5]))[0].sum().backward()
        for mode in ("gspo", "geo_mean"):  # and the sequence-level losses' policy_loss_<mode>_varlen
            inputs = (rewards, torch.randn(5), torch.randn(5), torch.ones(5))
            pf.policy_loss(*inputs, loss_mode=mode, cu_seqlens=torch.tensor([0, 2, 5]))[0].backward()
        packed_value_loss = pf.value_loss(*inputs, agg="seq-mean-token-mean", cu_seqlens=torch.tensor([0, 2, 5]))
        packed_value_loss[0].backward()  # value_loss_varlen and its backward
    return calls


def test_every_native_operator_is_exercised(native_operator_calls):
    assert set(native_operator_calls) == set(_native_operators())


@pytest.mark.parametrize("operator", _native_operators())
def test_opcheck_native_operator(operator, native_operator_calls):
    """Schema, fake kernel, autograd registration and dispatch of every call the matrix makes (the
    fast tier: the first two, a forward and its backward of every input)."""
    differentiable = not operator.endswith("_backward") and operator != "bool_mask"
    calls = native_operator_calls[operator]
    leaf = lambda a: a.clone().requires_grad_(differentiable and a.is_floating_point())  # noqa: E731
    for func, args, kwargs in calls if os.environ.get("PPO_FAST_FULL") == "1" else calls[:2]:
        torch.library.opcheck(func, tree_map(lambda a: leaf(a) if isinstance(a, torch.Tensor) else a, args), kwargs)


# --------------------------------------------------------------------------- out-of-range labels

# Past every kernel's vocabulary chunk (native CPU 1024, Triton 4096), so that a NaN row's carry is crossed too.
VOCAB = 4099
BAD_LABELS = [VOCAB, VOCAB + 1, -1, -5, 10**11, -(10**11), -(2**40)]
LABEL_OPS = ("token_logprobs", "linear_token_logprobs")


def scored(op, rows, vocab, **kwargs):
    """``(leaves, fn(labels, *leaves) -> (logp, entropy))``: logits, or hidden states, head and bias."""
    if op == "token_logprobs":
        leaves = [torch.randn(rows, vocab, requires_grad=True)]
        return leaves, lambda y, x: pf.token_logprobs(x * 1.0, y, return_entropy=True, **kwargs)
    leaves = [torch.randn(*shape, requires_grad=True) for shape in ((rows, HIDDEN), (vocab, HIDDEN), (vocab,))]
    return leaves, lambda y, h, w, b: pf.linear_token_logprobs(h, w, y, bias=b, return_entropy=True, **kwargs)


def _label_cases(labels, inplace=False):
    for op in LABEL_OPS:
        for backend in serving(op, "cpu"):
            for label in labels:
                name = "-".join(map(str, label)) if isinstance(label, tuple) else label
                yield pytest.param(op, backend, label, False, id=f"{op}-{backend}-{name}")
            if inplace and op == "token_logprobs":
                yield pytest.param(op, backend, VOCAB, True, id=f"{op}-{backend}-{VOCAB}-inplace")


def _compiled_label_cases():
    """The fast tier: three labels per op x backend (past V, negative, huge), two on the interpreted Triton."""
    for param in _label_cases(BAD_LABELS, inplace=True):
        _, backend, label, _ = param.values
        keep = (VOCAB, -(10**11)) if backend == "triton" else (VOCAB, -1, 10**11)
        yield tiers.case(*param.values, fast=label in keep, id=param.id)


@pytest.mark.parametrize("op, backend, bad_label, inplace", list(_compiled_label_cases()))
def test_out_of_range_label_compiled_gives_nan_and_no_gradient(op, backend, bad_label, inplace):
    """Under torch.compile the label check (a host sync) is skipped: the row's log-prob and
    entropy are NaN, its gradient is 0 (a gradient flows into the NaN row too), and the other
    rows (one ignored) and every gradient are the eager op's on the good rows.  Never a read
    or a write outside the logits."""
    leaves, fn = scored(op, 4, VOCAB, **({"inplace_backward": True} if inplace else {}))
    labels = torch.tensor([1, -100, VOCAB - 1, bad_label])
    with pf.use_backend(backend):
        torch._dynamo.reset()
        logp, entropy = torch.compile(fn, fullgraph=True, backend="aot_eager")(labels, *leaves)
        compiled = torch.autograd.grad(logp.sum() + entropy[:3].sum(), leaves)
        good_logp, good_entropy = fn(labels[:3], leaves[0][:3], *leaves[1:])
        good = torch.autograd.grad(good_logp.sum() + good_entropy.sum(), leaves)
    assert torch.isnan(logp[3]) and torch.isnan(entropy[3]) and logp[1] == 0 and entropy[1] == 0
    torch.testing.assert_close(logp[:3], good_logp.detach())
    torch.testing.assert_close(entropy[:3], good_entropy.detach())
    assert (compiled[0][3] == 0).all() and (compiled[0][1] == 0).all()
    torch.testing.assert_close(compiled[0][:3], good[0][:3])
    torch.testing.assert_close(compiled[1:], good[1:])  # the head and bias: the good rows' gradient


SMALL_LABEL_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32)


def _small_label_cases():
    """Every op x backend x small label dtype; the fast tier one dtype per op x backend, each dtype at least once."""
    for k, param in enumerate(_label_cases([50])):
        for j, label_dtype in enumerate(SMALL_LABEL_DTYPES):
            name = f"{param.id}-{str(label_dtype)[6:]}"
            yield tiers.case(*param.values, label_dtype, fast=j == k % len(SMALL_LABEL_DTYPES), id=name)


@pytest.mark.parametrize("op, backend, _, __, label_dtype", list(_small_label_cases()))
def test_out_of_range_small_integer_labels_compiled(op, backend, _, __, label_dtype):
    leaves, fn = scored(op, 4, 50)
    labels = torch.tensor([0, 49, 100, 120], dtype=label_dtype)
    with pf.use_backend(backend):
        torch._dynamo.reset()
        logp, _ = torch.compile(fn, fullgraph=True, backend="aot_eager")(labels, *leaves)
        logp.backward(torch.ones(4))
    assert torch.isfinite(logp[:2]).all() and torch.isnan(logp[2:]).all()
    assert torch.count_nonzero(leaves[0].grad[2:]) == 0 and torch.count_nonzero(leaves[0].grad[:2]) > 0


# (ignore_index, label): every bad label; with another ignore_index, -100 is out of range too.
EAGER_BAD_LABELS = [(-100, label) for label in BAD_LABELS] + [(VOCAB + 2, VOCAB), (VOCAB + 2, -100)]


@pytest.mark.parametrize("op, backend, case, _", list(_label_cases(EAGER_BAD_LABELS)))
def test_out_of_range_label_eager_on_cpu_raises(op, backend, case, _):
    ignore_index, bad_label = case
    leaves, fn = scored(op, 4, VOCAB, ignore_index=ignore_index)
    labels = torch.tensor([1, ignore_index, 3, bad_label])
    message = rf"labels must lie in \[0, {VOCAB}\) or equal ignore_index={ignore_index}; got {bad_label}\b"
    with pf.use_backend(backend), pytest.raises(ValueError, match=message):
        fn(labels, *leaves)


@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_inplace_backward_on_expanded_logits_gives_the_right_gradient(backend):
    """Three rows share each row of memory (stride 0): an in-place gradient would clobber
    them, so the backends must not write it in place."""
    base = torch.randn(1, 4, 29, requires_grad=True)
    labels = torch.randint(0, 29, (3, 4))
    grads = []
    for name, inplace in ((backend, True), ("reference", False)):
        base.grad = None
        with pf.use_backend(name):
            logp = pf.token_logprobs((base * 1.0).expand(3, 4, 29), labels, inplace_backward=inplace)
        logp.sum().backward()
        grads.append(base.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- bad inputs, every backend

r, ones, tensor = torch.randn, torch.ones, torch.tensor
T = True  # the same error at trace time (torch.compile), Unsupported quoting it with fullgraph=True


def _default(name):
    tensors = {"scores": (2,), "hidden": (2, 4), "weight": (5, 4)}
    if name in ("labels", "group_ids"):
        return tensor([0, 1])
    return ones(2, 3, dtype=torch.bool) if name == "mask" else r(*tensors.get(name, (2, 3)))


def _on(fn, *names, **defaults):
    """``fn`` on valid [2, 3] inputs (or ``defaults``), but for the arguments given."""

    def call(**kwargs):
        kwargs = {**defaults, **kwargs}
        return fn(*[kwargs.pop(n) if n in kwargs else _default(n) for n in names], **kwargs)

    return call


_logp = _on(pf.token_logprobs, "logits", "labels")
_head = _on(pf.linear_token_logprobs, "hidden", "weight", "labels")
_kl = _on(pf.kl_estimate, "logprobs", "ref_logprobs")
_rewards = _on(pf.kl_penalized_rewards, "scores", "logprobs", "ref_logprobs", "mask", kl_coef=0.1)
_gae = _on(pf.gae, "rewards", "values", "mask")
_pg = _on(pf.clipped_policy_loss, "logprobs", "old_logprobs", "advantages", "mask")
_value = _on(pf.value_loss, "values", "old_values", "returns", "mask")
_adv = _on(pf.group_advantages, "scores", "group_ids", "mask", method="grpo")
_policy = _on(pf.policy_loss, "logprobs", "old_logprobs", "advantages", "mask")
_rollout = _on(pf.rollout_correction_weights, "old_logprobs", "rollout_logprobs", "mask")
_mean, _whiten = _on(pf.masked_mean, "values", "mask"), _on(pf.masked_whiten, "values", "mask")
_objective = _on(pf.policy_objective, "logprobs", "entropy", "old_logprobs", "advantages", "mask")
META = ones(2, 3, dtype=torch.bool, device="meta")

# Every check of the public functions' arguments: op -> (call, error, message, under torch.compile
# too: T, or the error of a check of values made there on the device, with no host sync; None:
# eagerly only), run on every backend serving the op (None: the functions outside the ops).
BAD_INPUTS = {
    "token_logprobs": [
        (lambda: _logp(labels=tensor([0, 1, 2])), ValueError, "labels must have shape", T),
        (lambda: _logp(ignore_index=2**70), ValueError, "ignore_index", T),
        (lambda: _logp(temperature=1e-300), ValueError, "temperature", T),
        (lambda: _logp(temperature=1e300), ValueError, "temperature", T),
        (lambda: _logp(labels=tensor([0, 1.0])), TypeError, "labels", T),
        (lambda: _logp(logits=[1.0], labels=tensor([0])), TypeError, "logits", None),
        (lambda: _logp(logits=r(2, 3).long()), TypeError, "logits", None),
        (lambda: _logp(temperature=0.0), ValueError, "temperature", None),
        (lambda: _logp(temperature=math.nan), ValueError, "temperature", None),
        (lambda: _logp(logits=r(2, 0)), ValueError, "logits", None),
        (lambda: _logp(return_entropy=1), TypeError, "return_entropy", None),
    ],
    "linear_token_logprobs": [
        (lambda: _head(weight=r(5, 3)), ValueError, "hidden's last dim", T),
        (lambda: _head(labels=tensor([0, 1, 2])), ValueError, "labels must have shape", T),
        (lambda: _head(bias=r(4)), ValueError, "bias", T),
        (lambda: _head(weight=r(5, 4).double()), TypeError, "weight", T),
        (lambda: _head(logit_softcap=0.0), ValueError, "logit_softcap", T),
        (lambda: _head(temperature=1e-300), ValueError, "temperature", T),
    ],
    "kl_estimate": [
        (lambda: _kl(logprobs=r(2), ref_logprobs=r(3)), ValueError, "ref_logprobs", T),
        (lambda: _kl(ref_logprobs=None), TypeError, "ref_logprobs", T),
        (lambda: _kl(kl_estimator="k4"), ValueError, "kl_estimator", T),
        (lambda: _kl(kl_estimator=["k3"]), TypeError, "estimator must be a str", None),
    ],
    "kl_penalized_rewards": [
        (lambda: _rewards(kl_coef=1e300), ValueError, "kl_coef", T),
        (lambda: _rewards(ref_logprobs=r(2, 4)), ValueError, "ref_logprobs", T),
        (lambda: _rewards(mask=ones(2, 4)), ValueError, "mask", T),
        (lambda: _rewards(mask=torch.full((2, 3), 0.5)), ValueError, "0 and 1", RuntimeError),
        (lambda: _rewards(scores=r(3)), ValueError, "scores", None),
        (lambda: _rewards(kl_coef=-0.1), ValueError, "kl_coef", None),
        (lambda: _rewards(kl_coef=math.inf), ValueError, "kl_coef", None),
    ],
    "gae": [
        (lambda: _gae(values=r(2, 4)), ValueError, "values", T),
        (lambda: _gae(values=None), TypeError, "values", T),
        (lambda: _gae(mask=ones(2, 3, device="meta")), ValueError, "mask is on meta", T),
        (lambda: _gae(mask=torch.full((2, 3), 0.5)), ValueError, "mask must hold only 0 and 1", None),
        (lambda: _gae(mask=tensor([[1.0, math.nan, 0.0]] * 2)), ValueError, "mask must hold only 0 and 1", None),
        (lambda: _gae(gamma=1.5), ValueError, "gamma", None),
        (lambda: _gae(lam=-0.1), ValueError, "lam", None),
        (lambda: _gae(rewards=r(6), values=r(6), mask=ones(6)), ValueError, "rewards", None),
        (lambda: _gae(mask="mask"), TypeError, "mask", None),
    ],
    "clipped_policy_loss": [
        (lambda: _pg(old_logprobs=None), TypeError, "old_logprobs", T),
        (lambda: _pg(advantages=None), TypeError, "advantages", T),
        (lambda: _pg(old_logprobs=r(2, 2)), ValueError, "old_logprobs", T),
        (lambda: _pg(dual_clip=1e300), ValueError, "dual_clip", T),
        (lambda: _pg(clip_eps_low=0.0), ValueError, "clip_eps_low", None),
        (lambda: _pg(clip_eps_high=-0.1), ValueError, "clip_eps_high", None),
        (lambda: _pg(dual_clip=1.0), ValueError, "dual_clip", None),
        (lambda: _pg(agg="mean"), ValueError, "agg", None),
        (lambda: _pg(weights=ones(3, 2)), ValueError, "weights", None),
        (lambda: _pg(advantages=torch.randint(0, 2, (2, 3))), TypeError, "advantages", None),
    ],
    "value_loss": [
        (lambda: _value(old_values=None), TypeError, "old_values", T),
        (lambda: _value(returns=None), TypeError, "returns", T),
        (lambda: _value(clip=math.inf), ValueError, "clip", T),
        (lambda: _value(clip=0.0), ValueError, "clip", None),
        (lambda: _value(clip=True), TypeError, "clip", None),
    ],
    "group_sum": [
        (lambda: _adv(group_ids=tensor([0, 1, 2])), ValueError, r"group_ids must have shape \(2,\)", T),
        (lambda: _adv(group_ids=tensor([0.0, 1.0])), TypeError, "group_ids must have dtype", T),
        (lambda: _adv(scores=r(2, 4)), ValueError, "scores must have shape", T),
        (lambda: _adv(group_ids=None), TypeError, "needs group_ids", None),
        (lambda: _adv(gamma=0.9), TypeError, "unexpected parameter.*'gamma'", None),
        (lambda: _adv(norm_by_std=1), TypeError, "norm_by_std must be a bool", None),
    ],
    None: [
        (lambda: _adv(method="grpo_passk"), ValueError, "at least 2 responses in every group", None),
        (lambda: _objective(kl_coef=0.1), ValueError, "needs ref_logprobs", None),
        (lambda: _adv(method="gae"), ValueError, "method must be one of .*gae needs values", None),
        (lambda: _adv(method="ppo"), ValueError, "method must be one of", None),
        (lambda: _adv(method="remax", group_ids=None), TypeError, "needs baselines", None),
        (lambda: _adv(method="remax", baselines=torch.zeros(3)), ValueError, r"baselines must have shape \(2,\)", None),
        (lambda: _adv(method="reinforce_plus_plus", gamma=1.5), ValueError, "gamma must be <= 1", None),
        (lambda: _policy(loss_mode="ppo"), ValueError, r"loss_mode must be one of \('vanilla', 'gspo'", None),
        (lambda: _policy(loss_mode=["vanilla"]), TypeError, "loss_mode must be a str", None),
        (lambda: _mean(mask=META), ValueError, "mask is on meta", None),
        (lambda: _whiten(mask=META), ValueError, "mask is on meta", None),
        (lambda: _whiten(mask=torch.zeros(2, 3)), ValueError, "mask", None),
        (lambda: _mean(mask=ones(3, 2)), ValueError, "mask", None),
        (lambda: _mean(dim=5), ValueError, "dim must lie in", None),
        (lambda: _mean(dim=True), TypeError, "dim must be", None),
        (lambda: _mean(dim=(0, 1.0)), TypeError, "dim must be", None),
        (lambda: pf.AdaptiveKLController(0.1, target_kl=0.0, horizon=100), ValueError, "target_kl", None),
        (lambda: _rollout(mode="tis"), ValueError, "mode must be one of", None),
        (lambda: _rollout(threshold=0.0), ValueError, "threshold must be > 0", None),
        (lambda: _rollout(mode="token_mis", threshold=2.0, threshold_low=3.0), ValueError, "_low must be <= 2.0", None),
        (lambda: _rollout(mode="token_tis", threshold_low=0.5), ValueError, "threshold_low applies to the", None),
        (lambda: _rollout(batch_normalize=1), TypeError, "batch_normalize must be a bool", None),
        (lambda: _rollout(rollout_logprobs=r(2, 2)), ValueError, "rollout_logprobs must have the shape of", None),
        (lambda: _rollout(rollout_logprobs=None), TypeError, "rollout_logprobs must be a torch.Tensor, got None", None),
        (lambda: _rollout(mask=ones(1, 3)), ValueError, "mask must have shape", None),
    ],
}
# Each policy-loss mode: its parameter checks (PolicyLossMode.bind), tensors of another shape or
# missing, an unknown parameter; also compiled where a fast backend serves it.
MODE_PARAMETERS = [
    ("gspo", {"tau_pos": 1.0}, TypeError, "'gspo' takes clip_eps_low, clip_eps_high; got unexpected tau_pos"),
    ("gpg", {"clip_eps_low": 0.2}, TypeError, "'gpg' takes no parameters; got unexpected clip_eps_low"),
    ("dro", {}, TypeError, "'dro' needs dro_beta"),
    ("dro", {"dro_beta": 0.0}, ValueError, "dro_beta must be > 0.0"),
    ("vanilla", {"clip_eps_low": 1.0}, ValueError, "clip_eps_low must be < 1.0"),
    ("vanilla", {"dual_clip": 1.0}, ValueError, "dual_clip must be > 1.0"),
    ("sapo", {"tau_neg": "1"}, TypeError, "tau_neg must be a real number"),
    ("cispo", {"agg": "mean"}, ValueError, "agg must be one of"),
]
for _mode in POLICY_LOSS_MODES.values():
    _traced = T if any(fast(_mode.op, device) for device in DEVICES) else None
    _fn = partial(_policy, loss_mode=_mode.name, **_mode.example_params())
    BAD_INPUTS[_mode.op] = [
        *BAD_INPUTS.get(_mode.op, []),
        (lambda c=_fn: c(old_logprobs=r(2, 2)), ValueError, "old_logprobs must have the shape", _traced),
        (lambda c=_fn: c(not_a_param=1.0), TypeError, "unexpected not_a_param", _traced),
        (lambda c=_fn: c(advantages=r(2, 2)), ValueError, "advantages must have the shape of", None),
        (lambda c=_fn: c(old_logprobs=None), TypeError, "old_logprobs must be a torch.Tensor", None),
        *[(partial(_policy, loss_mode=m, **k), e, w, None) for m, k, e, w in MODE_PARAMETERS if m == _mode.name],
    ]
    if _mode.fused_head:  # pf.linear_policy_loss on valid inputs (hidden [2, 3, 4], a [5, 4] head) but one argument
        _names = ("hidden", "weight", "labels", "old_logprobs", "advantages", "mask")
        _fn = _on(pf.linear_policy_loss, *_names, hidden=r(2, 3, 4), labels=tensor([[0, 1, 2], [3, 4, 0]]))
        _fn = partial(_fn, loss_mode=_mode.name, **_mode.example_params())
        BAD_INPUTS[_mode.linear_op] = [
            (lambda c=_fn: c(hidden=r(2, 4)), ValueError, r"hidden must be \[B, T, H\]", None),
            (lambda c=_fn: c(labels=tensor([[0, 1], [2, 3]])), ValueError, "labels must have shape", None),
            (lambda c=_fn: c(old_logprobs=r(2, 2)), ValueError, "must have the shape of old_logprobs", None),
            (lambda c=_fn: c(weight=r(5, 3)), ValueError, "hidden's last dim", None),
            (lambda c=_fn: c(kl_coef=0.1), ValueError, "kl_coef=0.1 needs ref_logprobs", None),
            (lambda c=_fn: c(kl_estimator="k4"), ValueError, "kl_estimator", None),
            (lambda c=_fn: c(labels=tensor([[0, 1, 2], [3, 5, 0]])), ValueError, r"labels must lie in \[0, 5\)", None),
            (lambda c=_fn: c(not_a_param=1.0), TypeError, "unexpected not_a_param", None),
            (lambda c=_fn: c(top_p=1.5), ValueError, "top_p", None),
            (lambda c=_fn: c(agg="mean"), ValueError, "agg must be one of", None),
        ]
assert set(BAD_INPUTS) == set(OPS) | {None}


def _bad_input_cases():
    """Every check on every backend, eager and fullgraph; the fast tier compiles with Inductor
    (a build per case) on one backend per check, each check another."""
    for op, cases in BAD_INPUTS.items():
        for i, (call, error, match, traced) in enumerate(cases):
            backends = serving(op, "cpu") if op else ["auto"]
            for j, backend in enumerate(backends):
                for mode in ("eager", "compiled", "fullgraph") if traced else ("eager",):
                    sampled = mode != "compiled" or j == i % len(backends)
                    name = f"{op or 'api'}-{i}-{backend}-{mode}"
                    yield tiers.case(backend, mode, call, error, match, traced, fast=sampled, id=name)


@pytest.mark.parametrize("backend, mode, call, error, match, traced", list(_bad_input_cases()))
def test_bad_inputs_raise_the_documented_error(backend, mode, call, error, match, traced):
    """Every backend serving the op raises the same error.  Checks of shapes, dtypes, devices
    and arguments need no tensor values, so they run under torch.compile too: the same error
    (at trace time); with fullgraph=True Dynamo reports the raise as an unsupported graph
    break that quotes our message.  A check of values runs on the device when compiled."""
    if mode != "eager":
        call = torch.compile(call, fullgraph=mode == "fullgraph", backend="aot_eager")
        error = traced if traced is not T else torch._dynamo.exc.Unsupported if mode == "fullgraph" else error
    with pf.use_backend(backend), pytest.raises(error, match=match):
        torch._dynamo.reset()
        call()


def test_masked_stats_on_meta_tensors_give_meta_results():
    """Shape inference (meta tensors) needs no values: no data check runs on them."""
    x, mask = torch.empty(2, 3, device="meta"), torch.empty(2, 3, dtype=torch.bool, device="meta")
    assert pf.masked_mean(x, mask).device.type == "meta"
    assert pf.masked_whiten(x, mask).shape == (2, 3)
    assert pf.masked_mean(x, torch.empty(2, 3, device="meta")).device.type == "meta"


# --------------------------------------------------------------------------- edge cases, every backend


def _all_cpu(op):
    return pytest.mark.parametrize("backend", serving(op, "cpu"))


@_all_cpu("value_loss")
def test_value_loss_without_clipping(backend):
    values, old, returns, mask = r(2, 5), r(2, 5), r(2, 5), ones(2, 5, dtype=torch.bool)
    old = torch.full_like(old, math.nan)  # not read without clipping
    values.requires_grad_(True)
    with pf.use_backend(backend):
        loss, stats = pf.value_loss(values, old, returns, mask, clip=None, agg="token-sum")
        loss_no_old, _ = pf.value_loss(values, None, returns, mask, clip=None, agg="token-sum")
    torch.testing.assert_close(loss, 0.5 * (values - returns).square().sum())
    torch.testing.assert_close(loss_no_old, loss)
    assert stats["clipfrac"] == 0


@_all_cpu("kl_penalized_rewards")
def test_kl_penalized_rewards_of_empty_responses(backend):
    empty = torch.randn(3, 0)
    with pf.use_backend(backend):
        rewards, kl = pf.kl_penalized_rewards(torch.randn(3), empty, empty, torch.ones(3, 0), kl_coef=0.1)
    assert rewards.shape == kl.shape == (3, 0)


@_all_cpu("clipped_policy_loss")
@pytest.mark.parametrize("agg", AGG_MODES)
def test_losses_of_empty_responses_are_zero(backend, agg):
    empty = torch.randn(3, 0, requires_grad=True)
    with pf.use_backend(backend):
        loss, stats = pf.clipped_policy_loss(empty, empty.detach(), empty.detach(), torch.ones(3, 0), agg=agg)
    assert loss.item() == 0.0 and not math.isnan(stats["clipfrac"].item())
    loss.backward()
    assert empty.grad.shape == (3, 0)


@_all_cpu("clipped_policy_loss")
def test_mixed_float64_and_float32_inputs_are_computed_in_float64(backend):
    """One compute dtype for all inputs: the clip fraction of a float32 log-prob with float64
    advantages is that of the float64 computation."""
    logp = torch.tensor([[math.log(1.2) + 1e-9, math.log(0.8) - 1e-9]], dtype=torch.float64)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pf.use_backend(backend):
        loss, stats = pf.clipped_policy_loss(logp, old, adv, mask, clip_eps_low=0.2)
    assert loss.dtype == torch.float64 and stats["approx_kl"].dtype == torch.float64
    assert stats["clipfrac"].item() == 1.0  # both ratios lie just outside [0.8, 1.2] in float64


# --------------------------------------------------------------------------- properties (Hypothesis)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 9),
    pad=st.tuples(st.integers(0, 2), st.integers(1, 4)),
    agg=st.sampled_from([a for a in AGG_MODES if a != "seq-mean-token-sum-norm"]),
    dual=st.sampled_from([None, 2.0, 3.0]),
    scale=st.floats(0.01, 30.0),
    seed=st.integers(0, 2**31 - 1),
    backend=st.sampled_from(serving("clipped_policy_loss", "cpu")),
)
def test_aggregation_unchanged_by_padding(batch, length, pad, agg, dual, scale, seed, backend):
    """Masked columns and all-masked rows, holding anything at all, change no loss (the -norm mode
    divides by the padded length by definition, so it is left out); the clip fractions lie in [0, 1]."""
    gen = torch.Generator().manual_seed(seed)
    logp, old, adv = (torch.randn(batch, length, generator=gen) * scale for _ in range(3))
    mask = torch.rand(batch, length, generator=gen) < 0.7
    padded = [torch.full((batch + pad[0], length + pad[1]), math.nan) for _ in range(3)]
    for big, small in zip(padded, (logp, old, adv)):
        big[:batch, :length] = small
    padded_mask = torch.zeros(padded[0].shape, dtype=torch.bool)
    padded_mask[:batch, :length] = mask
    with pf.use_backend(backend):
        got = [
            [*pf.clipped_policy_loss(*x, agg=agg, dual_clip=dual), *pf.value_loss(*x, agg=agg, clip=0.1)]
            for x in ((logp, old, adv, mask), (*padded, padded_mask))
        ]
    torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-6, equal_nan=True)
    for value in (got[0][1]["clipfrac"], got[0][1]["clipfrac_lower"], got[0][3]["clipfrac"]):
        assert 0.0 <= value.item() <= 1.0


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 40),
    shift=st.floats(-1e3, 1e3),
    seed=st.integers(0, 2**31 - 1),
    backend=st.sampled_from(serving("token_logprobs", "cpu")),
)
def test_logprobs_invariant_to_a_per_row_shift(rows, vocab, shift, seed, backend):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    with pf.use_backend(backend):
        logp, ent = pf.token_logprobs(logits, labels, return_entropy=True)
        shifted_logp, shifted_ent = pf.token_logprobs(logits + shift, labels, return_entropy=True)
    torch.testing.assert_close(shifted_logp, logp, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(shifted_ent, ent, rtol=1e-9, atol=1e-9)
    assert (logp <= 0).all() and (ent >= -1e-12).all() and (ent <= math.log(vocab) + 1e-9).all()


# --------------------------------------------------------------------------- batch invariance

# Each row op's dims (B, T, V) and changes to its first variant (tests/harness.py's inputs): a row
# computed alone must equal, bit for bit, the same row inside a batch of 1,000 shuffled rows.
BATCH_INVARIANT = {
    "token_logprobs": ((1000, 1, 301), {}),
    "linear_token_logprobs": ((1000, 1, 301), {}),
    "kl_penalized_rewards": ((1000, 9, 0), {"kl_estimator": "k3"}),
    "gae": ((1000, 33, 0), {}),
}
TRUNCATED = ("token_logprobs", "linear_token_logprobs")  # also with top_k/top_p


def _batch_invariance_cases():
    """Every op x backend x eager/compiled x truncation.  The fast tier: eager on every op x
    backend, compiled on the fast backends (the reference's Inductor build on one op), truncated
    outside the interpreted Triton (its threshold passes cost a minute there)."""
    for op in BATCH_INVARIANT:
        for backend in serving(op, "cpu"):
            for compiled in (False, True):
                for truncation in ({}, {"top_k": 40, "top_p": 0.9}) if op in TRUNCATED else ({},):
                    sampled = (
                        (not compiled or backend != "reference" or op == "kl_penalized_rewards")
                        and not (truncation and backend == "triton")
                        and not (truncation and compiled and backend == "reference")
                        # the interpreted Triton compiled: the eager case's kernels behind an opaque op
                        and not (compiled and backend == "triton")
                    )
                    name = f"{op}-{backend}-{compiled}-{truncation}"
                    yield tiers.case(op, backend, compiled, truncation, fast=sampled, id=name)


def _rows(x: dict, index) -> dict:
    """The rows ``index`` of every per-row input (a head [V, H] and its bias are shared by every row)."""
    return {k: v if k in ("weight", "bias") else v[index] for k, v in x.items()}


def _numpy_matmul_is_row_invariant() -> bool:
    """Whether NumPy's matmul rounds a row the same wherever it lies in the left operand.  The Triton
    interpreter runs ``tl.dot`` as NumPy's matmul, and some BLAS builds (OpenBLAS on AMD EPYC, seen
    here) round a row by its position in the tile: an artifact of the interpreter, not of a kernel."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 11), dtype=np.float32), rng.standard_normal((11, 64), dtype=np.float32)
    alone = [np.pad(a[r : r + 1], ((0, 63), (0, 0))) for r in range(64)]  # the row, then zeros
    return all(np.array_equal((x @ b)[0], full) for x, full in zip(alone, a @ b))


@pytest.mark.parametrize("op, backend, compiled, truncation", list(_batch_invariance_cases()))
def test_a_row_is_bitwise_independent_of_its_batch(op, backend, compiled, truncation):
    cpu_triton = backend == "triton" and not torch.cuda.is_available()
    if op == "linear_token_logprobs" and cpu_triton and not _numpy_matmul_is_row_invariant():
        pytest.skip("the Triton interpreter's tl.dot (NumPy's matmul) rounds a row by its tile position here")
    dims, changes = BATCH_INVARIANT[op]
    built, spec, values = built_case(op, {**VARIANTS[op][2][0], **changes}, dims=dims, seed=zlib.crc32(op.encode()))
    x = {k: v.detach() for k, v in harness.tensors_of(built, spec, values, torch.float32)[0].items()}
    if compiled:  # the op's call site is compiled anew for each case, not against the recompile limit
        torch._dynamo.reset()
    fn = torch.compile(built.call, fullgraph=True, dynamic=False) if compiled else built.call
    # The Triton interpreter runs a program at a time: a batch of 1,000 there costs minutes.
    rows = 160 if cpu_triton else 1000
    order = torch.randperm(1000)[:rows]
    with pf.use_backend(backend):
        batch = fn({**_rows(x, order), **truncation})
        for row in (0, rows // 2 + 17, rows - 1):  # where the row lies in the shuffled batch
            alone = fn({**_rows(x, order[row : row + 1]), **truncation})
            for got, want in zip(alone, batch):
                assert torch.equal(got[0], want[row]), (op, backend, row)
