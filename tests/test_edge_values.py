"""Edge values every backend must get right: each case a reproducer of a bug a fuzzer, a
sanitizer build or a peer's test suite once found (the rule it checks in its name), checked
against float64 truth or the reference on every backend that serves the op here.

Extreme temperatures and logits, small KL log-ratios, exp near float32's overflow,
non-finite log-probs at valid tokens, pad ids used as ignore_index, second-order
gradients, symbolic hyper-parameters under torch.compile(dynamic=True), result dtypes."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from harness import CLIP_BOUND_TIES
from torch.utils._pytree import tree_leaves

import ppo_fast as pf
from ppo_fast.backends import serving
from ppo_fast.spec import POLICY_LOSS_MODES


def first(out):
    return out[0] if isinstance(out, tuple) else out


def run_on(backend, call, *inputs):
    """``(outputs, gradients)``: ``call`` on ``backend`` with leaf copies of ``inputs`` (its outputs,
    a stats dict's values included) and the leaves' gradients of the sum of every output."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    with pf.use_backend(backend):
        out = [t for t in tree_leaves(call(*leaves)) if isinstance(t, torch.Tensor)]
        grads = torch.autograd.grad(sum(o.sum() for o in out if o.requires_grad), leaves)
    return [o.detach() for o in out], list(grads)


# --------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("backend", serving("linear_token_logprobs", "cpu"))
def test_pad_id_as_ignore_index_reads_nothing_of_its_rows(backend):
    """ignore_index inside [0, V) (a pad id): its rows give 0 and no gradient, NaN there reaches nothing."""
    hidden, weight, labels = torch.randn(5, 4), torch.randn(6, 4), torch.tensor([0, 2, 5, 0, 1])
    hidden[0], hidden[3] = math.nan, math.inf
    call = lambda h, w: pf.linear_token_logprobs(h, w, labels, ignore_index=0, return_entropy=True)
    (logp, entropy), (hidden_grad, weight_grad) = run_on(backend, call, hidden, weight)
    assert logp[[0, 3]].tolist() == [0.0, 0.0] and entropy[[0, 3]].tolist() == [0.0, 0.0]
    assert torch.isfinite(logp).all() and torch.isfinite(weight_grad).all()
    assert hidden_grad[[0, 3]].abs().sum() == 0
    clean = torch.where(torch.isfinite(hidden), hidden, 0.0)
    truth = torch.log_softmax(clean.double() @ weight.double().T, -1).gather(1, labels[:, None]).squeeze(1)
    torch.testing.assert_close(logp[[1, 2, 4]].double(), truth[[1, 2, 4]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_low_temperature_gradient_rounds_as_the_forward(backend):
    """At T = 1.5e-5 the scaled logits are ~8e7 (ulp 8): a backward that rounds z = x / T
    differently from the forward gets a gradient of ~(e^4 - 1) / T instead of 0."""
    call = lambda x: pf.token_logprobs(x, torch.tensor([1]), temperature=1.5e-5)
    (logp,), (grad,) = run_on(backend, call, torch.tensor([[-355.75, 1232.0]]))
    assert logp.item() == 0.0
    assert grad.abs().max().item() == 0.0


@pytest.mark.parametrize("temperature", [1e-3, 1e-5])
@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_low_temperature_large_logits_against_float64(backend, temperature):
    torch.manual_seed(7)
    logits = torch.randn(6, 50) * 300
    labels = logits.argmax(-1)  # greedy: the rows a low temperature is used for
    labels[-1] = 3

    def truth(x64):
        z = (x64.detach().float() / temperature).double()  # the float32 scaled logits, exactly
        lp64 = torch.log_softmax(z + (x64 - x64.detach()) / temperature, -1)
        return lp64.gather(1, labels[:, None]).squeeze(1), -(lp64.exp() * lp64).sum(-1)

    call = lambda x: pf.token_logprobs(x, labels, temperature=temperature, return_entropy=True)
    (logp, _), (grad,) = run_on(backend, call, logits)
    (want, _), (want_grad,) = run_on("reference", truth, logits.double())
    torch.testing.assert_close(logp.double(), want, atol=1e-3, rtol=1e-5)
    # The gradient is O(1 / T): compared relative to that scale.
    assert (grad.double() - want_grad).abs().max().item() <= 1e-3 / temperature


@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_near_certain_label_gradient_against_float64(backend):
    """Logits 60.5 next to 45.7: the label's gradient 1 - p = 3.6e-7 is below ulp(lse) / 2 = 1.9e-6, so a backward
    that forms log p = z - lse rounds it to 0; log p = (z - max) - log_sum keeps it (found by the fuzzer)."""
    logits = torch.tensor([[-38.868812561035156, 45.70895004272461, 9.709816932678223, 60.53178024291992]])
    got, reference, truth = (
        run_on(name, lambda x: pf.token_logprobs(x, torch.tensor([3])), logits.to(dtype))[1][0].double()
        for name, dtype in ((backend, torch.float32), ("reference", torch.float32), ("reference", torch.float64))
    )
    assert ((got - truth).abs() <= 16 * (reference - truth).abs() + 1e-12).all()


@pytest.mark.parametrize("backend", serving("linear_token_logprobs", "cpu"))
def test_fused_head_low_temperature_gradient_against_float64(backend):
    torch.manual_seed(3)
    hidden, weight = torch.randn(8, 16) * 4, torch.randn(40, 16)
    labels, temperature = (hidden @ weight.T).argmax(-1), 1e-3
    _, (grad, _) = run_on(
        backend, lambda h, w: pf.linear_token_logprobs(h, w, labels, temperature=temperature), hidden, weight
    )
    truth = lambda h, w: torch.log_softmax(h @ w.T / temperature, -1).gather(1, labels[:, None])
    _, (want, _) = run_on("reference", truth, hidden.double(), weight.double())
    assert (grad.double() - want).abs().max().item() <= 1e-2 * (want.abs().max().item() + 1.0 / temperature * 1e-3)


# --------------------------------------------------------------------------- KL estimators


LOG_RATIOS = sorted(
    {s * 10.0**e for s in (1, -1) for e in (-4, -3.5, -3, -2, -1, -0.3, 0, 0.5, 1)} | {0.3, -0.45, 0.55}
)


def kl_truth(r: float, kl_estimator: str) -> tuple[float, float]:
    """KL estimate of log-ratio r = logp - ref and its derivative d/d logp, in float64."""
    if kl_estimator == "k1":
        return r, 1.0
    if kl_estimator == "k2":
        return 0.5 * r * r, r
    if kl_estimator == "abs":
        return abs(r), math.copysign(1.0, r)
    d = -r  # k3 = exp(d) - d - 1, d = ref - logp, clamped to [-10, 10] (the estimator's definition)
    value = math.expm1(d) - d
    return (value, -math.expm1(d)) if value <= 10 else (10.0, 0.0)


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("backend", serving("kl_estimate", "cpu"))
def test_kl_estimators_accurate_at_small_log_ratios(backend, kl_estimator):
    """<= 1e-4 relative to float64 for |r| >= 1e-4 (k3 = exp(r) - r - 1 cancels in float32)."""
    ratios = torch.tensor(LOG_RATIOS, dtype=torch.float64)
    ref = torch.randn(len(LOG_RATIOS), dtype=torch.float64).float()  # exact in float32
    logp = (ref.double() + ratios).float()
    r = logp.double() - ref.double()  # the log-ratio the float32 inputs hold
    logp.requires_grad_()
    with pf.use_backend(backend):
        kl = pf.kl_estimate(logp[None], ref[None], kl_estimator=kl_estimator)[0]
        kl.sum().backward()
    for i, ri in enumerate(r.tolist()):
        value, grad = kl_truth(ri, kl_estimator)
        assert abs(kl[i].item() - value) <= 1e-4 * abs(value) + 1e-30, (ri, kl[i].item(), value)
        assert abs(logp.grad[i].item() - grad) <= 1e-4 * abs(grad) + 1e-30, (ri, logp.grad[i].item(), grad)


def _k3_grid(dtype) -> torch.Tensor:
    """Sorted d = ref - logp: [-3, 2.5], log-spaced down to 1e-8 on both sides, and 300 consecutive
    values of the dtype on each side of +-1 (the series' cut)."""
    wide = torch.cat(
        [torch.linspace(-3, 2.5, 4001, dtype=torch.float64), torch.logspace(-8, 0, 801, dtype=torch.float64)]
    )
    grid = torch.cat([wide, -wide]).to(dtype)
    for cut in (1.0, -1.0):
        x = torch.tensor([cut], dtype=dtype)
        for direction in (math.inf, -math.inf):
            steps = [x := torch.nextafter(x, torch.tensor([direction], dtype=dtype)) for _ in range(300)]
            grid = torch.cat([grid, *steps])
    return grid.unique()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("backend", serving("kl_estimate", "cpu"))
def test_k3_is_rounded_once_and_monotone(backend, dtype):
    """k3 and its gradient against 40-digit truth: float32 rounded once from float64 (within half an
    ulp, so monotone in d across the series' cut), float64 within 8 ulps (the reference's gradient
    is autograd's of the series)."""
    mpmath = pytest.importorskip("mpmath")  # sympy's, which torch requires
    mpmath.mp.dps = 40
    d = _k3_grid(dtype)
    exact = [mpmath.expm1(mpmath.mpf(x)) for x in d.tolist()]
    value = torch.tensor([float(min(e - x, 10)) for e, x in zip(exact, d.tolist())], dtype=torch.float64)
    slope = torch.tensor([float(-e) if e - x <= 10 else 0.0 for e, x in zip(exact, d.tolist())], dtype=torch.float64)
    logp = torch.zeros_like(d, requires_grad=True)
    with pf.use_backend(backend):
        kl = pf.kl_estimate(logp, d, "k3")  # d = ref - logp
        (grad,) = torch.autograd.grad(kl.sum(), logp)
    eps = torch.finfo(dtype).eps
    bound = (0.5 if dtype == torch.float32 else 8.0) * eps * (1 + 1e-6)
    for got, want in ((kl, value), (grad, slope)):
        rel = (got.double() - want).abs() / want.abs().clamp_min(1e-300)
        assert rel.max() <= bound, (d[rel.argmax()].item(), rel.max().item() / eps)
    positive, negative = kl[d > 0], kl[d < 0]
    assert (positive.diff() >= 0).all() and (negative.diff() <= 0).all()


# --------------------------------------------------------------------------- policy losses


(_LOW_TIE, _LOW_RATIO), (_HIGH_TIE, _HIGH_RATIO) = CLIP_BOUND_TIES["low"], CLIP_BOUND_TIES["high"]


@pytest.mark.parametrize("backend", serving("clipped_policy_loss", "cpu"))
def test_ratio_exactly_on_a_clip_bound_is_inside_the_bounds(backend):
    """A ratio exactly on a clip bound gets the unclipped derivative -A r on every backend: where
    the surrogate is smooth (1 - eps with A > 0, 1 + eps with A < 0) and at its kinks alike (a
    clamp's gradient passes on its closed range; torch 2.14's scalar clamp passes none there)."""
    logp = torch.tensor([[_LOW_TIE, _LOW_TIE, _HIGH_TIE, _HIGH_TIE]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    old, mask = torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool)
    eps = {"clip_eps_low": 1.0 - _LOW_RATIO, "clip_eps_high": _HIGH_RATIO - 1.0}
    logp.requires_grad_()
    with pf.use_backend(backend):
        loss, stats = pf.clipped_policy_loss(logp, old, adv, mask, agg="token-mean", **eps)
    (grad,) = torch.autograd.grad(loss, logp)
    want = [-a * math.exp(d) / 4 for a, d in zip(adv[0].tolist(), logp[0].tolist())]
    assert grad[0].tolist() == pytest.approx(want, rel=1e-6)
    assert stats["clipfrac"].item() == 0.0


@pytest.mark.parametrize("backend", serving("policy_loss_gspo", "cpu"))
def test_gspo_ratio_bound_formed_before_rounding(backend):
    """clip_eps_low = 0.999999: the lower ratio bound 1 - eps is 1e-6 (formed in double, as the
    reference's Python float), not float32(1) - float32(eps) = 1.0133e-6."""
    logp, old = torch.full((1, 2), -25.0), torch.full((1, 2), -5.0)  # sequence ratio e^-20 < 1e-6: clipped
    adv, mask = -torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pf.use_backend(backend):
        loss = pf.policy_loss(logp, old, adv, mask, loss_mode="gspo", clip_eps_low=0.999999)[0]
    assert loss.item() == pytest.approx(1.0 - 0.999999, rel=1e-6)


@pytest.mark.parametrize("logp", [88.0, 88.5, 88.7, 89.0, 100.0])
@pytest.mark.parametrize("backend", serving("policy_loss_geo_mean", "cpu"))
def test_geo_mean_exp_up_to_float32_overflow(backend, logp):
    """exp(88.5) = 2.72e38 is a float32: no saturation at exp(88); beyond ln(FLT_MAX), inf."""
    mask = torch.ones(1, 1, dtype=torch.bool)
    args = (torch.full((1, 1), logp), torch.zeros(1, 1), -torch.ones(1, 1), mask)
    with pf.use_backend(backend):
        loss = pf.policy_loss(*args, loss_mode="geo_mean")[0]  # A < 0: the kept log-ratio is lr itself
    x = float(torch.tensor(logp))  # the float32 input
    truth = math.exp(x) if math.exp(x) <= torch.finfo(torch.float32).max else math.inf
    assert loss.item() == pytest.approx(truth, rel=1e-6)


# --------------------------------------------------------------------------- the reference's answer at an edge


def _reference_edges():
    """``(id, op, call, inputs, tolerance)``: on the same inputs, every backend's outputs and
    gradients (of the outputs' sum) are the reference's; ``finite``: and finite, ``floor``: the
    largest gradient above it (the case is the edge it names)."""
    # T = 1e-5 on float16: two tied tokens' logit gradients are +-1e5 (past float16's range) and
    # cancel in d_hidden; no backend may hold them in a float16 scratch.
    yield (
        "float16-fused-head-gradient-at-the-lowest-temperature",
        "linear_token_logprobs",
        lambda h, w: 2.0 * pf.linear_token_logprobs(h, w, torch.tensor([0]), temperature=1e-5),
        (torch.tensor([[0.01, 0.02]]).half(), torch.ones(2, 2).half()),
        {"rtol": 2e-3, "atol": 1e-3, "finite": True},
    )
    # kl_coef at float32's top: the gradient overflows to the same inf (or NaN) as the reference's autograd.
    values = torch.tensor([[-30.0, -2.4, -0.6, -0.4, -1e-3, 0.0, 1e-3, 0.6, 2.5, 30.0, math.nan]])
    yield (
        "k3-rewards-overflow-like-the-reference",
        "kl_penalized_rewards",
        lambda logp, ref: pf.kl_penalized_rewards(
            torch.zeros(1), logp, ref, torch.ones_like(logp, dtype=torch.bool), kl_coef=3.4e38, kl_estimator="k3"
        ),
        (values, torch.zeros_like(values)),
        {"rtol": 1e-5, "atol": 0, "equal_nan": True},
    )
    # float16 inputs whose gradient for an incoming 1 passes float16's range (~1.6e5) while the loss's
    # gradient, scaled by 1/64 (a loss divided over micro-batches), does not: finite, as the reference's.
    head, labels, mask = torch.eye(3, 4, dtype=torch.float16) * 8, torch.tensor([[1, 2]]), torch.ones(1, 2) > 0
    old16, adv16 = torch.full((1, 2), -1.0).half(), torch.full((1, 2), 4e4).half()
    for mode in ("vanilla", "gpg"):  # the native kernel's epilogue, the rows' loop
        yield (
            f"float16-fused-loss-gradient-in-range-once-scaled-{mode}",
            POLICY_LOSS_MODES[mode].linear_op,
            lambda h, m=mode: pf.linear_policy_loss(h, head, labels, old16, adv16, mask, loss_mode=m)[0] / 64,
            (torch.full((1, 2, 4), 4.0, dtype=torch.float16),),
            {"rtol": 2e-3, "atol": 1.0, "finite": True, "floor": 1e3},
        )
    # NaN/inf at a valid log-prob propagates the same way on every backend (loss, gradient, stats).
    old, adv = torch.full((2, 3), -1.1), torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.5, 2.0]])
    ones = torch.ones(2, 3, dtype=torch.bool)
    for mode in ("gspo", "geo_mean", "vanilla"):
        for poison in (-math.inf, math.inf, math.nan):
            yield (
                f"non-finite-log-prob-at-a-valid-token-{mode}-{poison}",
                POLICY_LOSS_MODES[mode].op,
                lambda lp, mode=mode: pf.policy_loss(lp, old, adv, ones, loss_mode=mode),
                (torch.tensor([[-1.0, poison, -2.0], [-0.5, -0.7, -0.2]]),),
                {"equal_nan": True},
            )


@pytest.mark.parametrize(
    "call, inputs, tolerance, backend",
    [
        pytest.param(call, inputs, tolerance, backend, id=f"{name}-{backend}")
        for name, op, call, inputs, tolerance in _reference_edges()
        for backend in serving(op, "cpu")
        if backend != "reference"
    ],
)
def test_edge_values_give_the_reference_s_answer(call, inputs, tolerance, backend):
    tolerance = dict(tolerance)
    finite, floor = tolerance.pop("finite", False), tolerance.pop("floor", None)
    (want, want_grads), (got, got_grads) = (run_on(name, call, *inputs) for name in ("reference", backend))
    if floor is not None:
        assert max(g.abs().max() for g in got_grads) > floor, got_grads
    for g, w in zip(got + got_grads, want + want_grads, strict=True):
        assert not finite or (torch.isfinite(g).all() and torch.isfinite(w).all()), (g, w)
        torch.testing.assert_close(g, w, **tolerance)


# --------------------------------------------------------------------------- second order


def _second_order_cases():
    lp = torch.randn(2, 4, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.bool)
    holes = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.bool)
    # gae's rewards and values: a Hessian-vector product through both of its outputs
    rewards_values = torch.randn(2, 2, 5, dtype=torch.float64)
    yield "gae", lambda x: torch.cat(pf.gae(x[0], x[1], holes, gamma=0.9, lam=0.8)), rewards_values
    yield (
        "token_logprobs",
        lambda x: pf.token_logprobs(x, torch.tensor([[1, 2], [0, 3]])),
        torch.randn(2, 2, 5, dtype=torch.float64),
    )
    yield "kl_estimate", lambda x: pf.kl_estimate(x, lp, kl_estimator="k3"), lp.clone()
    yield "clipped_policy_loss", lambda x: pf.policy_loss(x, lp, lp, mask)[0], lp.clone()
    yield "value_loss", lambda x: pf.value_loss(x, lp, lp, mask)[0], lp.clone()
    yield "policy_loss_gspo", lambda x: pf.policy_loss(x, lp, lp, mask, loss_mode="gspo")[0], lp.clone()
    weight, labels, adv = torch.randn(7, 3, dtype=torch.float64), torch.randint(0, 7, (2, 4)), torch.randn(2, 4)
    head = dict(weight=weight, labels=labels, old=lp - 1.0, adv=adv.double(), mask=mask)
    for mode in ("vanilla", "gpg"):  # the native kernel's epilogue and the rows' loop
        call = partial(_linear_policy_loss, **head, mode=mode)
        yield f"linear_policy_loss_{mode}", call, torch.randn(2, 4, 3, dtype=torch.float64)


def _linear_policy_loss(hidden, *, weight, labels, old, adv, mask, mode, two_pass=False):
    if two_pass:  # linear_token_logprobs, then the objective: the two-pass composition
        logp, entropy = pf.linear_token_logprobs(hidden, weight, labels, return_entropy=True)
        return pf.policy_objective(logp, entropy, old, adv, mask, loss_mode=mode)[0]
    return pf.linear_policy_loss(hidden, weight, labels, old, adv, mask, loss_mode=mode)[0]


@pytest.mark.parametrize("case", list(_second_order_cases()), ids=lambda c: c[0])
def test_second_order_gradients_match_the_reference_or_raise(case):
    op, fn, x = case

    def second(name, f=fn):
        leaf = x.clone().requires_grad_()
        with pf.use_backend(name):
            out = first(f(leaf))
            (g,) = torch.autograd.grad((out**2).sum(), leaf, create_graph=True)
            return torch.autograd.grad(g.sum(), leaf)[0]

    want = second("reference")
    if op.startswith("linear_policy_loss"):  # not a silent zero: the two-pass composition's, on the reference
        torch.testing.assert_close(want, second("reference", partial(fn, two_pass=True)))
    for backend in (b for b in serving(op, "cpu") if b != "reference"):
        try:
            got = second(backend)
        except RuntimeError as error:
            assert "second-order" in str(error) or "no autograd formula" in str(error), str(error)
            continue
        torch.testing.assert_close(got, want, msg=f"{backend}: {op}")


# --------------------------------------------------------------------------- torch.compile(dynamic=True)


def _all_ops(t, temperature, gamma, lam, clip):
    logits, labels, hidden, weight, logp, old, adv, values, returns, scores, mask = t
    out = [first(pf.token_logprobs(logits, labels, temperature=temperature))]
    out.append(pf.linear_token_logprobs(hidden, weight, labels.reshape(-1), temperature=temperature))
    out += list(pf.gae(values, returns, mask, gamma=gamma, lam=lam))
    out += list(pf.kl_penalized_rewards(scores, logp, old, mask, kl_coef=clip))
    out.append(pf.kl_estimate(logp, old, kl_estimator="k3"))
    out.append(pf.policy_loss(logp, old, adv, mask, clip_eps_low=clip)[0])
    out.append(pf.value_loss(values, old, returns, mask, clip=clip)[0])
    out.append(pf.masked_whiten(adv, mask))
    out.append(pf.rollout_correction_weights(logp, old, mask, mode="seq_tis", threshold=1.0 + clip))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(  # the interpreter: slow; the reference (Inductor's 17 s) in the full tier
    "backend",
    [
        pytest.param(b, marks=[pytest.mark.full] if b == "reference" else [])
        for b in serving("gae", "cpu")
        if b != "triton"
    ],
)
def test_compile_dynamic_symbolic_hyper_parameters(backend):
    """Under dynamic=True the floats are symbolic: the ops compile in one graph, agree with
    eager, and a bad value still raises (its check became a guard, so it recompiles)."""
    torch._dynamo.reset()
    B, T, V, H = 3, 5, 7, 4
    mask = torch.rand(B, T) > 0.3
    mask[:, 0] = True
    per_token = [torch.randn(B, T) for _ in range(5)]  # logp, old, adv, values, returns
    args = (torch.randn(B, T, V), torch.randint(0, V, (B, T)), torch.randn(B * T, H), torch.randn(V, H), *per_token)
    args += (torch.randn(B), mask)
    compiled = torch.compile(_all_ops, fullgraph=True, dynamic=True, backend="aot_eager")
    with pf.use_backend(backend):
        for hyper in ((0.7, 0.99, 0.95, 0.2), (1.3, 0.9, 0.5, 0.1)):
            got, want = compiled(args, *hyper), _all_ops(args, *hyper)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, equal_nan=True)
        # fullgraph: Dynamo reports the raise as an unsupported graph break quoting the message
        with pytest.raises(torch._dynamo.exc.Unsupported, match="gamma must be <= 1.0, got 1.5"):
            compiled(args, 0.7, 1.5, 0.95, 0.2)


# --------------------------------------------------------------------------- result dtypes and small rules


@pytest.mark.parametrize("backend", serving("kl_penalized_rewards", "cpu"))
def test_float64_scores_give_float64_rewards(backend):
    score, zeros = 1.0 + 2.0**-40, torch.zeros(1, 2)  # not a float32
    scores = torch.tensor([score], dtype=torch.float64)
    with pf.use_backend(backend):
        rewards, kl = pf.kl_penalized_rewards(scores, zeros, zeros, zeros == 0, kl_coef=0.1)
    assert rewards.dtype == kl.dtype == torch.float64
    assert rewards[0, -1].item() == score


@pytest.mark.parametrize("mode", ["seq_tis", "seq_mis", "token_tis", "token_mis"])
def test_rollout_correction_of_no_token(mode):
    empty = torch.zeros(2, 0)
    weights = pf.rollout_correction_weights(empty, empty, empty.bool(), mode=mode, batch_normalize=True)
    assert weights.shape == (2, 0)


def test_labels_at_ignore_index_and_negative_zero_masks_pass():
    assert torch.isfinite(pf.token_logprobs(torch.zeros(3, 4), torch.tensor([-100, 3, 0]))).all()
    assert torch.isfinite(pf.token_logprobs(torch.zeros(3, 4), torch.tensor([9, 3, 9]), ignore_index=9)).all()
    adv, _ = pf.gae(torch.ones(1, 3), torch.zeros(1, 3), torch.tensor([[1.0, -0.0, 1.0]]))
    assert adv[0, 1].item() == 0.0


def _fused_head_near_tie(backend, softcap, temperature):
    """logp, entropy and d_weight on ``backend``, or (None) by the plain formula in float64."""
    weight = torch.tensor([[16.0], [15.99999], [3.0], [-2.0]], dtype=torch.float64 if backend is None else None)
    weight.requires_grad_()
    hidden, labels = torch.ones(2, 1, dtype=weight.dtype), torch.tensor([0, 1])
    if backend is None:
        raw = hidden @ weight.T
        raw = raw if softcap is None else softcap * torch.tanh(raw / softcap)
        lp64 = torch.log_softmax(raw / temperature, -1)
        logp, entropy = lp64.gather(1, labels[:, None]).squeeze(1), -(lp64.exp() * lp64).sum(-1)
    else:
        with pf.use_backend(backend):
            logp, entropy = pf.linear_token_logprobs(
                hidden, weight, labels, temperature=temperature, logit_softcap=softcap, return_entropy=True
            )
    (logp.sum() + 0.5 * entropy.sum()).backward()
    return logp.detach().double(), entropy.detach().double(), weight.grad.double()


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("backend", [b for b in serving("linear_token_logprobs", "cpu") if b != "reference"])
def test_fused_head_near_tie_at_low_temperature(backend, softcap):
    """Two logits 1e-5 apart at T = 1e-5 (z ~ 1.6e6, ulp 0.125): both have p = O(1).  Each
    value and gradient is within twice the reference's own float32 error against float64, or
    within 2 ulp(z) of it (in log space; times 1/T for the gradients), which float32 z = x/T
    costs anyway: a backward that rounds z - logsumexp otherwise than its forward is not."""
    temperature = 1e-5
    want, reference, got = (_fused_head_near_tie(name, softcap, temperature) for name in (None, "reference", backend))
    ulp_z = 2.0 ** (math.floor(math.log2(16.0 / temperature)) - 23)
    for name, g, r, w, unit in zip(("logp", "entropy", "d_weight"), got, reference, want, (1, 1, 1 / temperature)):
        bound = max(2 * (r - w).abs().max().item(), 2 * ulp_z * unit)
        assert (g - w).abs().max().item() <= bound, (name, g, r, w)


@pytest.mark.parametrize("method", [m for m in pf.advantage_methods() if m != "gae"])
def test_group_advantages_of_no_token_stay_in_the_graph(method):
    """T = 0 (found by the nightly fuzz budget: reinforce_plus_plus and remax lost the graph)."""
    scores = torch.randn(4, requires_grad=True)
    kwargs = {"baselines": torch.zeros(4)} if method == "remax" else {}
    ids, mask = torch.tensor([0, 0, 1, 1]), torch.ones(4, 0, dtype=torch.bool)
    out = first(pf.group_advantages(scores, ids, mask, method=method, **kwargs))
    assert out.shape == (4, 0) and out.requires_grad
    out.sum().backward()
    assert scores.grad is not None and (scores.grad == 0).all()


@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_near_certain_token_keeps_its_small_log_prob(backend):
    """log p = -3.7e-7 at logits [60, 45.2]: the logsumexp must not round it away at 60's ulp (3.8e-6)."""
    truth = -math.log1p(math.exp(45.2 - 60.0))
    with pf.use_backend(backend):
        logp = pf.token_logprobs(torch.tensor([[60.0, 45.2]]), torch.tensor([0])).item()
        if backend in serving("linear_token_logprobs", "cpu"):
            head = pf.linear_token_logprobs(torch.ones(1, 1), torch.tensor([[60.0], [45.2]]), torch.tensor([0])).item()
            assert head == pytest.approx(truth, rel=0.1)
    assert logp == pytest.approx(truth, rel=0.1)


@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_empty_batch_log_probs_stay_in_the_graph_in_their_dtype(backend):
    for shape, dtype, grad in [
        ((0, 3), torch.float32, True),
        ((2, 0, 3), torch.float32, True),
        ((0, 5), torch.float64, False),
    ]:
        logits = torch.zeros(shape, dtype=dtype, requires_grad=grad)
        with pf.use_backend(backend):
            logp, entropy = pf.token_logprobs(logits, torch.zeros(shape[:-1], dtype=torch.long), return_entropy=True)
        assert logp.shape == shape[:-1] and logp.requires_grad == entropy.requires_grad == grad
        assert logp.dtype == entropy.dtype == dtype


@pytest.mark.parametrize("backend", serving("linear_policy_loss_vanilla", "cpu"))
def test_an_empty_one_pass_gives_every_gradient_the_reference_gives(backend):
    """No token (B = 0 or T = 0): the one pass's loss is 0 and hidden, weight and bias each get a zero
    gradient of their own shape, as the reference's: ``torch.autograd.grad`` over all three does not raise
    (the empty ``[0]`` the op returns for a gradient not asked for is not one)."""
    for batch, length in ((0, 5), (2, 0)):
        hidden = torch.zeros(batch, length, 4, dtype=torch.float64, requires_grad=True)
        weight = torch.ones(6, 4, dtype=torch.float64, requires_grad=True)
        bias = torch.zeros(6, dtype=torch.float64, requires_grad=True)
        zeros = torch.zeros(batch, length, dtype=torch.float64)
        with pf.use_backend(backend):
            loss, _ = pf.linear_policy_loss(
                hidden, weight, zeros.long(), zeros, zeros, zeros.bool(), bias=bias, agg="seq-mean-token-mean"
            )
        grads = torch.autograd.grad(loss, [hidden, weight, bias])
        assert loss.item() == 0.0
        for g, x in zip(grads, (hidden, weight, bias)):
            assert g.shape == x.shape and g.dtype == x.dtype and not g.any()


@pytest.mark.parametrize(
    "op, call",
    [
        (
            "policy_loss_geo_mean",
            lambda zeros, mask: pf.policy_loss(
                zeros + 88, zeros, zeros - 1, mask, loss_mode="geo_mean", agg="token-sum"
            ),
        ),
        ("value_loss", lambda zeros, mask: pf.value_loss(zeros + 2e19, None, zeros, mask, clip=None, agg="token-sum")),
    ],
    ids=["geo_mean", "value_loss"],
)
def test_a_loss_beyond_float32_is_inf_not_an_error(op, call):
    """Per-token losses within float32 whose batch sum is not: +inf on every backend (native
    raised "value cannot be converted to type float without overflow"); value_loss: 2e38 a token."""
    for backend in serving(op, "cpu"):
        with pf.use_backend(backend):
            value = call(torch.zeros(3, 1), torch.ones(3, 1, dtype=torch.bool))[0]
        assert value.item() == math.inf, (backend, value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", serving("linear_token_logprobs", "cpu"))
def test_hidden_size_zero_gives_the_uniform_distribution(backend, dtype):
    """H = 0: every logit is 0 (the bias), log p = -log V; the backward's scratch sizing divided by H."""
    hidden, weight = torch.randn(2, 3, 0, dtype=dtype, requires_grad=True), torch.randn(5, 0, dtype=dtype)
    labels, mask = torch.tensor([[0, 4, -100], [1, 2, 3]]), torch.ones(2, 3, dtype=torch.bool)
    with pf.use_backend(backend):
        logp, entropy = pf.linear_token_logprobs(hidden, weight.requires_grad_(), labels, return_entropy=True)
        grads = torch.autograd.grad(logp.sum() + entropy.sum(), (hidden, weight))
        loss, _ = pf.linear_policy_loss(hidden, weight, labels, -torch.ones(2, 3), torch.ones(2, 3), mask)
        loss.backward()
    want = torch.where(labels == -100, 0.0, -math.log(5))
    torch.testing.assert_close(logp, want)
    torch.testing.assert_close(entropy, torch.where(labels == -100, 0.0, math.log(5)))
    assert [g.shape for g in grads] == [hidden.shape, weight.shape] and torch.isfinite(loss)
