"""The conformance matrix: every backend against the reference, generated from what each
backend declares it serves.

op x backend x device x dtype x layout x poison, forward and backward: the same random
inputs go through the public op under ``use_backend(name)`` and under the reference, and
every output and every input gradient must agree.  Layouts are contiguous, sliced (the
gaps of the storage hold NaN, so a kernel that reads them is caught), transposed and
expanded (stride 0).  Poison puts NaN/inf at masked positions (and in ignored rows),
which must reach no result and no gradient, or NaN at valid positions, which must
propagate exactly as in the reference (``ppo_fast.contract``).

Then the bad inputs: each raises the documented error, or gives the documented result,
on every backend, eagerly and under ``torch.compile(fullgraph=True)``; and Hypothesis
properties of the ops.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import zlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_map

import ppo_fast as pf
from ppo_fast.advantage_methods import REGISTRY as ADVANTAGE_METHODS
from ppo_fast.backends import BACKENDS, backend_info
from ppo_fast.spec import AGG_MODES, KL_ESTIMATORS, OPS, POLICY_LOSS_MODES

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FAST_BACKENDS = [name for name in BACKENDS if name != "reference"]
LAYOUTS = ("contiguous", "sliced", "transposed", "expanded")
POISONS = ("clean", "masked", "valid")
DIMS = (3, 6, 37)  # B, T, V of most cases
# Long rows: past the native CPU kernels' chunks (1024 logits, 256 tokens) and the Triton
# kernels' widest blocks (4096 logits, 1024 tokens), so that the carries between chunks
# are compared too.
LONG_DIMS = {"token_logprobs": (2, 3, 4099), "linear_token_logprobs": (2, 3, 4099), "default": (2, 1100, 0)}
HIDDEN = 11  # H of linear_token_logprobs: odd, not a multiple of any tile


def serving(op: str, device: str) -> list[str]:
    """The fast backends that declare ``op`` on ``device`` and are available here."""
    return [
        name
        for name in FAST_BACKENDS
        if backend_info(name).available and device in backend_info(name).module.SUPPORTED.get(op, set())
    ]


def test_every_backend_declares_only_contract_ops():
    for name in BACKENDS:
        info = backend_info(name)
        if info.available:
            assert set(info.module.SUPPORTED) <= set(OPS), name
    assert set(backend_info("reference").module.SUPPORTED) == set(OPS)


# --------------------------------------------------------------------------- inputs


def laid_out(values: torch.Tensor, layout: str, grad: bool) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """``(leaf, view, grad_of_view)``: ``view`` holds ``values`` (for ``expanded``, its
    first row repeated) in ``layout``; ``grad_of_view`` maps ``leaf.grad`` to the view's shape."""
    if layout == "contiguous":
        leaf = values.clone()
        view_of = lambda t: t  # noqa: E731
    elif layout == "sliced":  # every other column of a wider storage whose gaps hold NaN
        # The gaps hold NaN, or an out-of-range label: a kernel that reads them is caught.
        junk = math.nan if values.is_floating_point() else -(2**40)
        wide = torch.full(
            (values.shape[0], 2 * values.shape[1]) + values.shape[2:], junk, dtype=values.dtype, device=values.device
        )
        wide[:, 1::2] = values
        leaf = wide
        view_of = lambda t: t[:, 1::2]  # noqa: E731
    elif layout == "transposed":
        leaf = values.transpose(0, 1).contiguous()
        view_of = lambda t: t.transpose(0, 1)  # noqa: E731
    elif layout == "expanded":
        leaf = values[:1].clone()
        view_of = lambda t: t.expand(values.shape)  # noqa: E731
    else:
        raise AssertionError(layout)
    if grad:
        leaf.requires_grad_(True)
    return leaf, view_of(leaf), view_of


# Set by the all-masked edge case: every mask 0 and every label ignored.
MASK_EVERYTHING = False


def random_mask(gen: torch.Generator, shape, device) -> torch.Tensor:
    """Interior holes, one all-masked row and one full row."""
    mask = torch.rand(shape, generator=gen) < 0.65
    if shape[0]:
        mask[0] = False
        mask[-1] = True
    return (mask & (not MASK_EVERYTHING)).to(device)


@dataclasses.dataclass
class Built:
    leaves: dict[str, torch.Tensor]  # name -> leaf (requires grad)
    views: dict[str, Callable]  # name -> leaf.grad to the op's input shape
    call: Callable[[], tuple[torch.Tensor, ...]]  # the public op on the laid-out inputs
    differentiable: tuple[int, ...]  # which outputs carry gradient


def _poisoned(x: torch.Tensor, mask: torch.Tensor, poison: str, gen: torch.Generator) -> torch.Tensor:
    """NaN/inf at masked positions (``masked``) or NaN at one valid position (``valid``)."""
    x = x.clone()
    if poison == "masked":
        junk = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype, device=x.device)
        pick = torch.randint(0, 3, x.shape, generator=gen).to(x.device)
        x = torch.where(mask, x, junk[pick])
    elif poison == "valid":
        index = mask.flatten().nonzero()[0, 0]
        x.view(-1)[index] = math.nan
    return x


def build_logprobs(gen, device, dtype, layout, poison, *, entropy=True, dims=DIMS):
    B, T, V = dims
    logits = (torch.randn(B, T, V, generator=gen) * 3).to(device, dtype)
    labels = torch.randint(0, V, (B, T), generator=gen).to(device)
    ignored = (torch.rand(B, T, generator=gen) < 0.25).to(device) | MASK_EVERYTHING
    labels = torch.where(ignored, -100, labels)
    if layout == "expanded":
        labels = labels[:1].expand(B, T).clone()
        ignored = labels == -100
    if poison == "masked":  # ignored rows hold NaN/inf logits
        logits = torch.where(ignored.unsqueeze(-1), torch.tensor(math.nan, dtype=dtype, device=device), logits)
        logits[..., 0] = torch.where(ignored, torch.tensor(math.inf, dtype=dtype, device=device), logits[..., 0])
    elif poison == "valid":
        row = (~ignored).flatten().nonzero()[0, 0]
        logits.view(-1, V)[row, 3] = math.nan
    leaf, view, grad_view = laid_out(logits, layout, grad=True)
    _, label_view, _ = laid_out(labels, layout, grad=False)

    def call():
        out = pf.token_logprobs(view, label_view, temperature=0.7, return_entropy=entropy)
        return out if entropy else (out,)

    return Built({"logits": leaf}, {"logits": grad_view}, call, (0, 1) if entropy else (0,))


def build_linear_logprobs(gen, device, dtype, layout, poison, *, entropy=True, bias=True, softcap=None, dims=DIMS):
    """``hidden [B, T, H]`` in ``layout`` (poison in its rows), a ``[V, H]`` head and a ``[V]`` bias."""
    B, T, V = dims
    hidden = torch.randn(B, T, HIDDEN, generator=gen).to(device, dtype)
    weight = (torch.randn(V, HIDDEN, generator=gen) / HIDDEN**0.25).to(device, dtype).requires_grad_(True)
    head_bias = torch.randn(V, generator=gen).to(device, dtype).requires_grad_(True) if bias else None
    labels = torch.randint(0, V, (B, T), generator=gen).to(device)
    labels = torch.where((torch.rand(B, T, generator=gen) < 0.25).to(device) | MASK_EVERYTHING, -100, labels)
    if layout == "expanded":
        labels = labels[:1].expand(B, T).clone()
    ignored = labels == -100
    if poison == "masked":  # ignored rows hold NaN/inf hidden states
        hidden = torch.where(ignored.unsqueeze(-1), torch.tensor(math.nan, dtype=dtype, device=device), hidden)
        hidden[..., 0] = torch.where(ignored, torch.tensor(math.inf, dtype=dtype, device=device), hidden[..., 0])
    elif poison == "valid":
        row = (~ignored).flatten().nonzero()[0, 0]
        hidden.view(-1, HIDDEN)[row, 3] = math.nan
    leaf, view, grad_view = laid_out(hidden, layout, grad=True)
    _, label_view, _ = laid_out(labels, layout, grad=False)

    def call():
        out = pf.linear_token_logprobs(
            view,
            weight,
            label_view,
            bias=head_bias,
            temperature=0.7,
            logit_scale=0.8,
            logit_softcap=softcap,
            return_entropy=entropy,
        )
        return out if entropy else (out,)

    leaves, views = {"hidden": leaf, "weight": weight}, {"hidden": grad_view, "weight": lambda g: g}
    if bias:
        leaves["bias"], views["bias"] = head_bias, lambda g: g
    return Built(leaves, views, call, (0, 1) if entropy else (0,))


def _pair_inputs(gen, device, dtype, layout, poison, names, dims, mask=None, scale=1.0):
    B, T, _ = dims
    leaves, views, tensors = {}, {}, {}
    check_mask = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
    for name in names:
        x = (torch.randn(B, T, generator=gen) * scale).to(device, dtype)
        if layout == "expanded":
            x = x[:1].expand(B, T)
        x = _poisoned(x, check_mask, poison, gen)
        leaves[name], tensors[name], views[name] = laid_out(x, layout, grad=True)
    return leaves, views, tensors


def build_kl_estimate(gen, device, dtype, layout, poison, *, kl_estimator, dims=DIMS):
    if poison == "masked":
        pytest.skip("kl_estimate has no mask")
    leaves, views, t = _pair_inputs(gen, device, dtype, layout, poison, ("logprobs", "ref_logprobs"), dims)
    return Built(leaves, views, lambda: (pf.kl_estimate(t["logprobs"], t["ref_logprobs"], kl_estimator),), (0,))


def _mask_for(gen, device, layout, dims):
    B, T, _ = dims
    mask = random_mask(gen, (B, T), device)
    if layout == "expanded":
        mask = mask[1:2].expand(B, T)
    return mask


def build_kl_penalized_rewards(gen, device, dtype, layout, poison, *, kl_estimator, dims=DIMS):
    mask = _mask_for(gen, device, layout, dims)
    leaves, views, t = _pair_inputs(gen, device, dtype, layout, poison, ("logprobs", "ref_logprobs"), dims, mask)
    scores = torch.randn(dims[0], generator=gen).to(device, dtype)
    if poison == "masked" and dims[0] and not mask[0].any():  # the score of a row without valid tokens is never read
        scores[0] = math.nan
    scores.requires_grad_(True)
    leaves["scores"], views["scores"] = scores, lambda g: g

    def call():
        return pf.kl_penalized_rewards(
            scores, t["logprobs"], t["ref_logprobs"], mask, kl_coef=0.3, kl_estimator=kl_estimator
        )

    return Built(leaves, views, call, (0, 1))


def build_gae(gen, device, dtype, layout, poison, *, gamma=0.99, lam=0.95, dims=DIMS):
    mask = _mask_for(gen, device, layout, dims)
    leaves, views, t = _pair_inputs(gen, device, dtype, layout, poison, ("rewards", "values"), dims, mask)
    return Built(leaves, views, lambda: pf.gae(t["rewards"], t["values"], mask, gamma=gamma, lam=lam), (0, 1))


def build_clipped_policy_loss(gen, device, dtype, layout, poison, *, agg, dual_clip=None, weighted=False, dims=DIMS):
    mask = _mask_for(gen, device, layout, dims)
    names = ("logprobs", "old_logprobs", "advantages") + (("weights",) if weighted else ())
    leaves, views, t = _pair_inputs(gen, device, dtype, layout, poison, names, dims, mask, scale=0.5)

    def call():
        loss, stats = pf.clipped_policy_loss(
            t["logprobs"],
            t["old_logprobs"],
            t["advantages"],
            mask,
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            dual_clip=dual_clip,
            agg=agg,
            weights=t.get("weights"),
        )
        return loss, stats["clipfrac"], stats["clipfrac_lower"], stats["approx_kl"]

    return Built(leaves, views, call, (0,))


def build_value_loss(gen, device, dtype, layout, poison, *, agg, clip=0.2, dims=DIMS):
    mask = _mask_for(gen, device, layout, dims)
    leaves, views, t = _pair_inputs(gen, device, dtype, layout, poison, ("values", "old_values", "returns"), dims, mask)

    def call():
        loss, stats = pf.value_loss(t["values"], t["old_values"], t["returns"], mask, clip=clip, agg=agg)
        return loss, stats["clipfrac"]

    return Built(leaves, views, call, (0,))


def build_policy_loss(gen, device, dtype, layout, poison, *, loss_mode, agg, weighted=False, dims=DIMS):
    """A registered policy-loss mode; log-probs made negative (DPPO reads p = exp(logp)),
    weights positive (GMPO takes their log)."""
    mask = _mask_for(gen, device, layout, dims)
    names = ("logprobs", "old_logprobs", "advantages") + (("weights",) if weighted else ())
    leaves, views, t = _pair_inputs(gen, device, dtype, layout, poison, names, dims, mask, scale=0.5)
    params = {"dro_beta": 0.3} if loss_mode == "dro" else {}
    if "clip_eps_high" in {p.name for p in pf.policy_loss_modes()[loss_mode].params}:
        params["clip_eps_high"] = 0.28

    def call():
        if pf.policy_loss_modes()[loss_mode].syncs_host:
            torch.manual_seed(0)  # clip_cov draws the tokens it cuts (never compiled: it syncs the host)
        loss, stats = pf.policy_loss(
            -t["logprobs"].abs() - 0.05,
            -t["old_logprobs"].abs() - 0.05,
            t["advantages"],
            mask,
            loss_mode=loss_mode,
            agg=agg,
            weights=t["weights"].abs() if weighted else None,
            **params,
        )
        return loss, *stats.values()

    return Built(leaves, views, call, (0,))


def build_group_sum(gen, device, dtype, layout, poison, *, method, dims=DIMS):
    """group_sum through the public op of each advantage method that runs on the fast backends."""
    mask = _mask_for(gen, device, layout, dims)
    leaves, views, t = _pair_inputs(gen, device, dtype, layout, poison, ("scores",), dims, mask)
    ids = (torch.randint(0, 3, (dims[0],), generator=gen) * 5 - 2).to(device)  # uneven groups, singletons
    if layout == "expanded":  # equal rows: in a group of them d advantage / d score ~ 1/epsilon overflows float16
        ids = torch.arange(dims[0], device=device)

    return Built(leaves, views, lambda: (pf.group_advantages(t["scores"], ids, mask, method=method),), (0,))


# op -> (builder, its variants, the input dtypes it takes)
FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
VARIANTS = {
    "token_logprobs": (build_logprobs, [{"entropy": True}, {"entropy": False}]),
    "linear_token_logprobs": (
        build_linear_logprobs,
        [{"entropy": True}, {"entropy": False, "bias": False}, {"entropy": True, "softcap": 2.5}],
    ),
    "kl_estimate": (build_kl_estimate, [{"kl_estimator": e} for e in KL_ESTIMATORS]),
    "kl_penalized_rewards": (build_kl_penalized_rewards, [{"kl_estimator": e} for e in KL_ESTIMATORS]),
    "gae": (build_gae, [{}, {"gamma": 1.0, "lam": 1.0}]),
    "clipped_policy_loss": (
        build_clipped_policy_loss,
        [{"agg": a} for a in AGG_MODES] + [{"agg": "token-mean", "dual_clip": 3.0, "weighted": True}],
    ),
    "value_loss": (build_value_loss, [{"agg": a} for a in AGG_MODES] + [{"agg": "token-mean", "clip": None}]),
    "group_sum": (
        build_group_sum,
        [
            {"method": name}
            for name, entry in ADVANTAGE_METHODS.items()
            if entry.fn is not None and set(FAST_BACKENDS) <= set(entry.backends)
        ],
    ),
}
# Every registered policy-loss mode other than vanilla (clipped_policy_loss above) is its own op.
for _mode in POLICY_LOSS_MODES.values():
    VARIANTS.setdefault(
        _mode.op,
        (
            build_policy_loss,
            [{"loss_mode": _mode.name, "agg": a} for a in AGG_MODES]
            + [{"loss_mode": _mode.name, "agg": "token-mean", "weighted": True}],
        ),
    )
for _op, (_, _variants) in VARIANTS.items():
    _variants.append({**_variants[0], "dims": LONG_DIMS.get(_op, LONG_DIMS["default"])})
assert set(VARIANTS) == set(OPS), "every op of the contract is in the matrix"


def _matrix():
    for op in OPS:
        _, variants = VARIANTS[op]
        for device in DEVICES:
            for backend in serving(op, device):
                for dtype in FLOATS:
                    for layout in LAYOUTS:
                        for poison in POISONS:
                            # Every variant on the contiguous clean float32 case; one per other cell.
                            chosen = (
                                variants
                                if (layout, poison, dtype) == ("contiguous", "clean", torch.float32)
                                else variants[:1]
                            )
                            for variant in chosen:
                                label = "-".join(f"{k}={v}" for k, v in variant.items())
                                yield pytest.param(
                                    op,
                                    backend,
                                    device,
                                    dtype,
                                    layout,
                                    poison,
                                    variant,
                                    marks=[pytest.mark.cuda] if device == "cuda" else [],
                                    id=f"{op}-{backend}-{device}-{str(dtype)[6:]}-{layout}-{poison}"
                                    + (f"-{label}" if label else ""),
                                )


def _tolerance(dtype: torch.dtype) -> dict:
    """Outputs are computed in float32 (float64 for float64 inputs) by every backend from
    the same inputs; gradients are rounded to the input dtype."""
    if dtype == torch.float64:
        return {"rtol": 1e-9, "atol": 1e-11}
    return {"rtol": 2e-5, "atol": 2e-5}


def _grad_tolerance(dtype: torch.dtype) -> dict:
    return {
        torch.float64: {"rtol": 1e-9, "atol": 1e-11},
        torch.float32: {"rtol": 2e-5, "atol": 2e-5},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-4},
        torch.float16: {"rtol": 2e-3, "atol": 1e-5},
    }[dtype]


def run_case(backend, op, device, dtype, layout, poison, variant, seed):
    """Outputs and input gradients of the op on ``backend``, from inputs made with ``seed``."""
    builder, _ = VARIANTS[op]
    built = builder(torch.Generator().manual_seed(seed), device, dtype, layout, poison, **variant)
    with pf.use_backend(backend):
        outputs = built.call()
    weights_gen = torch.Generator().manual_seed(seed + 1)
    total = 0.0
    for i in built.differentiable:
        w = torch.randn(outputs[i].shape, generator=weights_gen, dtype=torch.float64).to(device, outputs[i].dtype)
        total = total + torch.where(torch.isfinite(outputs[i]), outputs[i] * w, 0.0).sum()
    leaves = list(built.leaves.values())
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [o.detach() for o in outputs], {name: g for name, g in zip(built.leaves, grads)}


@pytest.mark.parametrize("op, backend, device, dtype, layout, poison, variant", list(_matrix()))
def test_backend_matches_reference(op, backend, device, dtype, layout, poison, variant, request):
    seed = zlib.crc32(request.node.nodeid.encode())
    expected_out, expected_grads = run_case("reference", op, device, dtype, layout, poison, variant, seed)
    got_out, got_grads = run_case(backend, op, device, dtype, layout, poison, variant, seed)
    for i, (got, want) in enumerate(zip(got_out, expected_out)):
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"output {i}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
        )
        torch.testing.assert_close(got, want, equal_nan=True, **_tolerance(dtype), msg=lambda m: f"output {i}: {m}")
    for name, want in expected_grads.items():
        got = got_grads[name]
        if want is None:  # an input the op does not read (value_loss's old_values without clipping)
            assert got is None, f"{backend}: a gradient for {name}, which the reference does not read"
            continue
        assert got is not None, f"{backend}: no gradient for {name} (the reference has one)"
        assert got.dtype == want.dtype, f"grad {name}: {got.dtype} vs {want.dtype}"
        if poison == "valid":  # the gradient at a NaN input itself is unspecified; the rest must agree
            keep = torch.isfinite(want)
            got, want = got[keep], want[keep]
        tolerance = _grad_tolerance(dtype)
        if op == "linear_token_logprobs" and dtype in (torch.bfloat16, torch.float16) and want.numel():
            # A fused head may round d_logits to the input dtype before its products (as
            # tensor cores need): an error of that precision times the gradient's scale.
            tolerance["atol"] = max(tolerance["atol"], tolerance["rtol"] * float(want.abs().max()))
        torch.testing.assert_close(got, want, equal_nan=True, **tolerance, msg=lambda m: f"grad of {name}: {m}")
    if poison == "masked":  # masked NaN/inf reaches nothing
        for i, out in enumerate(got_out):
            assert torch.isfinite(out).all(), f"output {i} is not finite: masked values leaked"
        for name, g in got_grads.items():
            assert g is None or torch.isfinite(g).all(), f"grad of {name} is not finite: masked values leaked"


# --------------------------------------------------------------------------- compiled


# Modes whose token selection is data-dependent (nonzero, topk sizes from .item(), as verl's)
# break the graph: no fullgraph case for them.
_GRAPH_BREAKING = {mode.op for mode in POLICY_LOSS_MODES.values() if mode.syncs_host}


def _compiled_cases():
    for op in [op for op in OPS if op not in _GRAPH_BREAKING]:
        for device in DEVICES:
            for backend in ["reference"] + serving(op, device):
                yield pytest.param(
                    op,
                    backend,
                    device,
                    marks=[pytest.mark.cuda] if device == "cuda" else [],
                    id=f"{op}-{backend}-{device}",
                )


@pytest.mark.parametrize("op, backend, device", list(_compiled_cases()))
def test_compiled_fullgraph_matches_eager(op, backend, device):
    """One graph (fullgraph=True) through the public op, forward and backward, equal to eager."""
    builder, variants = VARIANTS[op]

    def outputs_and_grads(compile_it):
        built = builder(torch.Generator().manual_seed(7), device, torch.float32, "contiguous", "clean", **variants[0])
        call = torch.compile(built.call, fullgraph=True, backend="aot_eager") if compile_it else built.call
        with pf.use_backend(backend):
            outs = call()
        total = sum(outs[i].sum() for i in built.differentiable)
        return [o.detach() for o in outs], torch.autograd.grad(total, list(built.leaves.values()), allow_unused=True)

    torch._dynamo.reset()
    eager_out, eager_grads = outputs_and_grads(False)
    compiled_out, compiled_grads = outputs_and_grads(True)
    for got, want in zip(compiled_out + list(compiled_grads), eager_out + list(eager_grads)):
        if want is None:  # an input the op does not read (GSPO's old_logprobs)
            assert got is None
            continue
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- edge shapes

EDGE_SHAPES = {"one-token": (1, 1, 5), "empty-responses": (3, 0, 5), "empty-batch": (0, 3, 5), "all-masked": (3, 4, 5)}


def _edge_cases():
    for op in OPS:
        for device in DEVICES:
            for backend in ["reference"] + serving(op, device):
                for edge in EDGE_SHAPES:
                    if not (edge == "all-masked" and op == "kl_estimate"):  # no mask
                        yield pytest.param(
                            op,
                            backend,
                            device,
                            edge,
                            marks=[pytest.mark.cuda] if device == "cuda" else [],
                            id=f"{op}-{backend}-{device}-{edge}",
                        )


@pytest.mark.parametrize("op, backend, device, edge", list(_edge_cases()))
def test_edge_shapes_match_reference(op, backend, device, edge, monkeypatch):
    """One token, empty responses, an empty batch: the reference's shapes, values and
    gradients.  With everything masked every output and every gradient is 0."""
    monkeypatch.setattr(sys.modules[__name__], "MASK_EVERYTHING", edge == "all-masked")
    variant = {**VARIANTS[op][1][0], "dims": EDGE_SHAPES[edge]}
    want_out, want_grads = run_case("reference", op, device, torch.float32, "contiguous", "clean", variant, 11)
    got_out, got_grads = run_case(backend, op, device, torch.float32, "contiguous", "clean", variant, 11)
    for got, want in zip(got_out, want_out):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for name, leaf in built_leaves(op, device, variant).items():  # no gradient: a zero one
        got, want = (g[name] if g[name] is not None else torch.zeros_like(leaf) for g in (got_grads, want_grads))
        assert got.shape == want.shape == leaf.shape, name
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    if edge == "all-masked":
        assert all(torch.count_nonzero(out) == 0 for out in got_out)
        assert all(g is None or torch.count_nonzero(g) == 0 for g in got_grads.values())


def built_leaves(op, device, variant):
    builder, _ = VARIANTS[op]
    return builder(torch.Generator().manual_seed(11), device, torch.float32, "contiguous", "clean", **variant).leaves


# --------------------------------------------------------------------------- gradcheck

GRADCHECK_DIMS = (2, 3, 5)


# Losses whose gradient is by design not their derivative (a stop-gradient inside): their
# backward is checked against the reference's autograd only (test_backend_matches_reference).
STOP_GRADIENT_SURROGATES = {"policy_loss_gspo", "policy_loss_cispo", "policy_loss_dppo_tv", "policy_loss_dppo_kl"}


def _gradcheck_cases():
    for op in [op for op in OPS if op not in STOP_GRADIENT_SURROGATES]:
        for backend in ["reference"] + serving(op, "cpu"):
            for i, variant in enumerate(VARIANTS[op][1][:-1]):  # not the long rows
                yield pytest.param(op, backend, variant, id=f"{op}-{backend}-{i}")


@pytest.mark.parametrize("op, backend, variant", list(_gradcheck_cases()))
def test_gradcheck_float64(op, backend, variant):
    """Every backend's backward against finite differences (float64 inputs are computed in float64)."""
    builder, _ = VARIANTS[op]
    built = builder(
        torch.Generator().manual_seed(3),
        "cpu",
        torch.float64,
        "contiguous",
        "clean",
        **{**variant, "dims": GRADCHECK_DIMS},
    )

    def differentiable_outputs(*_leaves):  # gradcheck perturbs the leaves in place; call() reads them
        with pf.use_backend(backend):
            outputs = built.call()
        return tuple(outputs[i] for i in built.differentiable)

    assert torch.autograd.gradcheck(differentiable_outputs, tuple(built.leaves.values()))


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
                snapshot = tree_map(
                    lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a, (args, kwargs or {})
                )
                calls.setdefault(func._schema.name.split("::")[1], []).append((func, *snapshot))
            return func(*args, **(kwargs or {}))

    with Record(), pf.use_backend("native"):
        for op in [op for op in OPS if "native" in serving(op, "cpu")]:
            builder, variants = VARIANTS[op]
            for variant in variants[:-1]:
                built = builder(
                    torch.Generator().manual_seed(5), "cpu", torch.float32, "contiguous", "clean", **variant
                )
                outputs = built.call()
                total = sum(outputs[i].sum() for i in built.differentiable)
                leaves = list(built.leaves.values())
                torch.autograd.grad(total, leaves, retain_graph=True, allow_unused=True)
                torch.autograd.grad(total, leaves[:1], allow_unused=True)
        pf.gae(
            torch.randn(2, 3), torch.randn(2, 3), torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
        )  # a 0/1 float mask: bool_mask
    return calls


def test_every_native_operator_is_exercised(native_operator_calls):
    assert set(native_operator_calls) == set(_native_operators())


@pytest.mark.parametrize("operator", _native_operators())
def test_opcheck_native_operator(operator, native_operator_calls):
    """Schema, fake kernel, autograd registration and dispatch of every call the matrix makes."""
    differentiable = not operator.endswith("_backward") and operator != "bool_mask"
    for func, args, kwargs in native_operator_calls[operator]:
        args = tree_map(
            lambda a: (
                a.clone().requires_grad_(differentiable and a.is_floating_point()) if isinstance(a, torch.Tensor) else a
            ),
            args,
        )
        torch.library.opcheck(func, args, kwargs)


# --------------------------------------------------------------------------- out-of-range labels


def _logprobs_backends(device="cpu"):
    return ["reference"] + serving("token_logprobs", device)


# Past every kernel's vocabulary chunk (native CPU 1024, Triton 4096), so that a NaN row's carry is crossed too.
VOCAB = 4099
BAD_LABELS = [VOCAB, VOCAB + 1, -1, -5, 10**11, -(10**11), -(2**40)]


@pytest.mark.parametrize("backend", _logprobs_backends())
@pytest.mark.parametrize("bad_label, inplace", [(label, False) for label in BAD_LABELS] + [(VOCAB, True)])
def test_out_of_range_label_compiled_gives_nan_and_no_gradient(backend, bad_label, inplace):
    """Under torch.compile the label check (a host sync) is skipped: the row's log-prob and
    entropy are NaN, its gradient is 0, and the other rows (one ignored) are exact.  Never a
    read or a write outside the logits."""
    logits = torch.randn(4, VOCAB, requires_grad=True)
    labels = torch.tensor([1, -100, VOCAB - 1, bad_label])

    def fn(l, y):
        return pf.token_logprobs(l * 1.0, y, return_entropy=True, inplace_backward=inplace)

    with pf.use_backend(backend):
        torch._dynamo.reset()
        logp, entropy = torch.compile(fn, fullgraph=True, backend="aot_eager")(logits, labels)
        (logp[:3].sum() + entropy[:3].sum()).backward()
        grad_compiled = logits.grad.clone()
        logits.grad = None
        # The same result from the eager op on the good rows.
        good_logp, good_entropy = fn(logits[:3], labels[:3])
    assert torch.isnan(logp[3]) and torch.isnan(entropy[3]) and logp[1] == 0 and entropy[1] == 0
    torch.testing.assert_close(logp[:3], good_logp.detach())
    torch.testing.assert_close(entropy[:3], good_entropy.detach())
    assert (grad_compiled[3] == 0).all() and (grad_compiled[1] == 0).all()
    (good_logp.sum() + good_entropy.sum()).backward()
    torch.testing.assert_close(grad_compiled[:3], logits.grad[:3])


@pytest.mark.parametrize("backend", _logprobs_backends())
@pytest.mark.parametrize("label_dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_out_of_range_small_integer_labels_compiled(backend, label_dtype):
    logits = torch.randn(4, 50, requires_grad=True)
    labels = torch.tensor([0, 49, 100, 120], dtype=label_dtype)
    with pf.use_backend(backend):
        torch._dynamo.reset()
        logp = torch.compile(lambda l, y: pf.token_logprobs(l, y), fullgraph=True, backend="aot_eager")(logits, labels)
        logp.backward(torch.ones(4))
    assert torch.isfinite(logp[:2]).all() and torch.isnan(logp[2:]).all()
    assert torch.count_nonzero(logits.grad[2:]) == 0 and torch.count_nonzero(logits.grad[:2]) > 0


@pytest.mark.parametrize("backend", _logprobs_backends())
def test_out_of_range_label_backward_of_the_nan_row_writes_nothing(backend):
    """Even a gradient flowing into the NaN row itself leaves the logits' gradient 0 there."""
    logits = torch.randn(3, 50, requires_grad=True)
    labels = torch.tensor([0, 50, 7])
    with pf.use_backend(backend):
        logp = torch.compile(lambda l, y: pf.token_logprobs(l, y), fullgraph=True, backend="aot_eager")(logits, labels)
        logp.backward(torch.ones(3))
    assert (logits.grad[1] == 0).all() and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("backend", _logprobs_backends())
@pytest.mark.parametrize("bad_label", BAD_LABELS)
def test_out_of_range_label_eager_on_cpu_raises(backend, bad_label):
    with pf.use_backend(backend), pytest.raises(ValueError, match=rf"labels must lie in \[0, {VOCAB}\).*{bad_label}"):
        pf.token_logprobs(torch.randn(4, VOCAB), torch.tensor([1, 2, 3, bad_label]))


@pytest.mark.parametrize("backend", _logprobs_backends())
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


def _batch(t=3):
    return torch.randn(2, t), torch.randn(2, t), torch.randn(2, t), torch.ones(2, t, dtype=torch.bool)


BAD_INPUTS = {
    "token_logprobs": [
        (lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1, 2])), ValueError, "labels must have shape"),
        (
            lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]), ignore_index=2**70),
            ValueError,
            "ignore_index",
        ),
        (
            lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]), temperature=1e-300),
            ValueError,
            "temperature",
        ),
        (
            lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]), temperature=1e300),
            ValueError,
            "temperature",
        ),
        (lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1.0])), TypeError, "labels"),
    ],
    "linear_token_logprobs": [
        (
            lambda: pf.linear_token_logprobs(torch.randn(2, 4), torch.randn(5, 3), torch.tensor([0, 1])),
            ValueError,
            "hidden's last dim",
        ),
        (
            lambda: pf.linear_token_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])),
            ValueError,
            "labels must have shape",
        ),
        (
            lambda: pf.linear_token_logprobs(
                torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), bias=torch.randn(4)
            ),
            ValueError,
            "bias",
        ),
        (
            lambda: pf.linear_token_logprobs(torch.randn(2, 4), torch.randn(5, 4).double(), torch.tensor([0, 1])),
            TypeError,
            "weight",
        ),
        (
            lambda: pf.linear_token_logprobs(
                torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), logit_softcap=0.0
            ),
            ValueError,
            "logit_softcap",
        ),
        (
            lambda: pf.linear_token_logprobs(
                torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0, 1]), temperature=1e-300
            ),
            ValueError,
            "temperature",
        ),
    ],
    "kl_estimate": [
        (lambda: pf.kl_estimate(torch.randn(2), torch.randn(3)), ValueError, "ref_logprobs"),
        (lambda: pf.kl_estimate(torch.randn(2), None), TypeError, "ref_logprobs"),
        (lambda: pf.kl_estimate(torch.randn(2), torch.randn(2), "k4"), ValueError, "kl_estimator"),
    ],
    "kl_penalized_rewards": [
        (
            lambda: pf.kl_penalized_rewards(torch.randn(2), *_batch()[:2], _batch()[3], kl_coef=1e300),
            ValueError,
            "kl_coef",
        ),
        (
            lambda: pf.kl_penalized_rewards(
                torch.randn(2), torch.randn(2, 3), torch.randn(2, 4), _batch()[3], kl_coef=0.1
            ),
            ValueError,
            "ref_logprobs",
        ),
        (
            lambda: pf.kl_penalized_rewards(torch.randn(2), *_batch()[:2], torch.ones(2, 4), kl_coef=0.1),
            ValueError,
            "mask",
        ),
        # A value check: on the device (torch._assert_async, no host sync) when compiled.
        (
            lambda: pf.kl_penalized_rewards(torch.randn(2), *_batch()[:2], torch.full((2, 3), 0.5), kl_coef=0.1),
            ValueError,
            "0 and 1",
            RuntimeError,
        ),
    ],
    "gae": [
        (lambda: pf.gae(torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3)), ValueError, "values"),
        (lambda: pf.gae(torch.randn(2, 3), None, torch.ones(2, 3)), TypeError, "values"),
        (lambda: pf.gae(*_batch()[:2], torch.ones(2, 3, device="meta")), ValueError, "mask is on meta"),
    ],
    "clipped_policy_loss": [
        (
            lambda: pf.clipped_policy_loss(torch.randn(2, 3), None, torch.randn(2, 3), torch.ones(2, 3)),
            TypeError,
            "old_logprobs",
        ),
        (
            lambda: pf.clipped_policy_loss(torch.randn(2, 3), torch.randn(2, 3), None, torch.ones(2, 3)),
            TypeError,
            "advantages",
        ),
        (
            lambda: pf.clipped_policy_loss(torch.randn(2, 3), torch.randn(2, 2), torch.randn(2, 3), torch.ones(2, 3)),
            ValueError,
            "old_logprobs",
        ),
        (lambda: pf.clipped_policy_loss(*_batch(), dual_clip=1e300), ValueError, "dual_clip"),
    ],
    "value_loss": [
        (lambda: pf.value_loss(torch.randn(2, 3), None, torch.randn(2, 3), torch.ones(2, 3)), TypeError, "old_values"),
        (lambda: pf.value_loss(torch.randn(2, 3), torch.randn(2, 3), None, torch.ones(2, 3)), TypeError, "returns"),
        (lambda: pf.value_loss(*_batch(), clip=float("inf")), ValueError, "clip"),
    ],
    "group_sum": [
        (
            lambda: pf.group_advantages(torch.randn(2), torch.tensor([0, 1, 2]), torch.ones(2, 3)),
            ValueError,
            "group_ids must have shape",
        ),
        (
            lambda: pf.group_advantages(torch.randn(2), torch.tensor([0.0, 1.0]), torch.ones(2, 3)),
            TypeError,
            "group_ids",
        ),
        (
            lambda: pf.group_advantages(torch.randn(2, 4), torch.tensor([0, 1]), torch.ones(2, 3)),
            ValueError,
            "scores must have shape",
        ),
    ],
}
# The policy-loss modes share pf.policy_loss's checks (each mode's are tested eagerly in
# tests/test_policy_losses.py); here, on every backend and compiled, the modes a fast backend serves.
for _mode in POLICY_LOSS_MODES.values():
    BAD_INPUTS.setdefault(
        _mode.op,
        [
            (
                lambda m=_mode.name: pf.policy_loss(
                    torch.randn(2, 3), torch.randn(2, 2), torch.randn(2, 3), torch.ones(2, 3), loss_mode=m
                ),
                ValueError,
                "old_logprobs",
            ),
            (
                lambda m=_mode.name: pf.policy_loss(*_batch(), loss_mode=m, not_a_param=1.0),
                TypeError,
                "unexpected not_a_param",
            ),
        ]
        if any(serving(_mode.op, device) for device in DEVICES)
        else [],
    )
assert set(BAD_INPUTS) == set(OPS)


def _bad_input_cases():
    for op, cases in BAD_INPUTS.items():
        for backend in ["reference"] + serving(op, "cpu"):
            for i, case in enumerate(cases):
                for mode in ("eager", "compiled", "fullgraph"):
                    yield pytest.param(
                        backend, mode, *case[:3], case[3] if len(case) > 3 else None, id=f"{op}-{i}-{backend}-{mode}"
                    )


@pytest.mark.parametrize("backend, mode, call, error, match, traced_error", list(_bad_input_cases()))
def test_bad_inputs_raise_the_documented_error(backend, mode, call, error, match, traced_error):
    """Checks of shapes, dtypes, devices and arguments need no tensor values, so they run
    under torch.compile too: the same error (at trace time); with fullgraph=True Dynamo
    reports the raise as an unsupported graph break that quotes our message.  A check of
    values runs on the device when compiled (``traced_error``)."""
    if mode != "eager":
        call = torch.compile(call, fullgraph=mode == "fullgraph", backend="aot_eager")
        error = traced_error or (torch._dynamo.exc.Unsupported if mode == "fullgraph" else error)
    with pf.use_backend(backend), pytest.raises(error, match=match):
        torch._dynamo.reset()
        call()


def test_masked_stats_check_the_device():
    with pytest.raises(ValueError, match="mask is on meta"):
        pf.masked_mean(torch.randn(2, 3), torch.ones(2, 3, device="meta"))
    with pytest.raises(ValueError, match="mask is on meta"):
        pf.masked_whiten(torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool, device="meta"))


def test_masked_stats_on_meta_tensors_give_meta_results():
    """Shape inference (meta tensors) needs no values: no data check runs on them."""
    x, mask = torch.empty(2, 3, device="meta"), torch.empty(2, 3, dtype=torch.bool, device="meta")
    assert pf.masked_mean(x, mask).device.type == "meta"
    assert pf.masked_whiten(x, mask).shape == (2, 3)
    assert pf.masked_mean(x, torch.empty(2, 3, device="meta")).device.type == "meta"


# --------------------------------------------------------------------------- edge cases, every backend


def _all_cpu(op):
    return pytest.mark.parametrize("backend", ["reference"] + serving(op, "cpu"))


@_all_cpu("value_loss")
def test_value_loss_without_clipping(backend):
    values, old, returns, mask = _batch(5)
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
    with pf.use_backend(backend):
        rewards, kl = pf.kl_penalized_rewards(
            torch.randn(3), torch.randn(3, 0), torch.randn(3, 0), torch.ones(3, 0), kl_coef=0.1
        )
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


def _loss_backends():
    return ["reference"] + serving("clipped_policy_loss", "cpu")


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 7),
    pad_rows=st.integers(0, 2),
    pad_cols=st.integers(1, 4),
    agg=st.sampled_from([a for a in AGG_MODES if a != "seq-mean-token-sum-norm"]),
    seed=st.integers(0, 2**31 - 1),
    backend=st.sampled_from(_loss_backends()),
)
def test_aggregation_unchanged_by_padding(batch, length, pad_rows, pad_cols, agg, seed, backend):
    """Masked columns and all-masked rows, holding anything at all, change no loss (the
    -norm mode divides by the padded length by definition, so it is left out)."""
    gen = torch.Generator().manual_seed(seed)
    logp, old, adv = (torch.randn(batch, length, generator=gen) for _ in range(3))
    mask = torch.rand(batch, length, generator=gen) < 0.7
    padded = [torch.full((batch + pad_rows, length + pad_cols), math.nan) for _ in range(3)]
    for big, small in zip(padded, (logp, old, adv)):
        big[:batch, :length] = small
    padded_mask = torch.zeros(batch + pad_rows, length + pad_cols, dtype=torch.bool)
    padded_mask[:batch, :length] = mask
    with pf.use_backend(backend):
        loss, stats = pf.clipped_policy_loss(logp, old, adv, mask, agg=agg)
        padded_loss, padded_stats = pf.clipped_policy_loss(*padded, padded_mask, agg=agg)
        vloss, _ = pf.value_loss(logp, old, adv, mask, agg=agg)
        padded_vloss, _ = pf.value_loss(*padded, padded_mask, agg=agg)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_vloss, vloss, rtol=1e-5, atol=1e-6)
    for name in stats:
        torch.testing.assert_close(padded_stats[name], stats[name], rtol=1e-5, atol=1e-6)
    assert 0.0 <= stats["clipfrac"].item() <= 1.0 and 0.0 <= stats["clipfrac_lower"].item() <= 1.0


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 40),
    shift=st.floats(-1e3, 1e3),
    seed=st.integers(0, 2**31 - 1),
    backend=st.sampled_from(_logprobs_backends()),
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


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 4),
    length=st.integers(1, 9),
    dual=st.sampled_from([None, 2.0, 3.0]),
    scale=st.floats(0.01, 30.0),
    seed=st.integers(0, 2**31 - 1),
    backend=st.sampled_from(_loss_backends()),
)
def test_clip_fractions_lie_in_unit_interval(batch, length, dual, scale, seed, backend):
    gen = torch.Generator().manual_seed(seed)
    logp, old, adv = (torch.randn(batch, length, generator=gen) * scale for _ in range(3))
    mask = torch.rand(batch, length, generator=gen) < 0.6
    with pf.use_backend(backend):
        _, stats = pf.clipped_policy_loss(logp, old, adv, mask, dual_clip=dual)
        _, vstats = pf.value_loss(logp, old, adv, mask, clip=0.1)
    for value in (stats["clipfrac"], stats["clipfrac_lower"], vstats["clipfrac"]):
        assert 0.0 <= value.item() <= 1.0
