"""The public API contract: the seeds' worked example, properties, gradients and input validation.

Run on every backend that serves CPU tensors here (reference always; native when the
extension is built; triton through the interpreter), so every backend meets the contract.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ppo_fast as pf
from ppo_fast.backends import BACKENDS, backend_info


def cpu_backends(*ops):
    """The backends that serve all of ``ops`` on CPU tensors here."""
    return [
        name
        for name in BACKENDS
        if backend_info(name).available
        and all("cpu" in backend_info(name).module.SUPPORTED.get(op, set()) for op in ops)
    ]


def on_backends(*ops):
    """Run the test once per CPU backend that serves ``ops``, inside ``use_backend``."""
    return pytest.mark.parametrize("backend", cpu_backends(*ops), indirect=True)


@pytest.fixture
def backend(request):
    with pf.use_backend(request.param):
        yield request.param


# --------------------------------------------------------------------------- the seeds' example


@on_backends("kl_penalized_rewards", "gae")
def test_seed_example_rewards_and_advantages(backend):
    """beta=0.1, gamma=1, lambda=0.95, r_RM=1.5, log-ratios +0.2/-0.2, V=[0.8, 1.0]."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref_logprobs = logprobs - torch.tensor([[0.2, -0.2]])
    rewards, kl = pf.kl_penalized_rewards(torch.tensor([1.5]), logprobs, ref_logprobs, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.2, -0.2]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.02, 1.52]]))

    advantages, returns = pf.gae(rewards, torch.tensor([[0.8, 1.0]]), mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.674, 0.52]]))
    torch.testing.assert_close(returns, torch.tensor([[1.474, 1.52]]))


@on_backends("clipped_policy_loss")
def test_seed_example_clipped_objective(backend):
    """Token 1 at ratio 1.3 with A = 0.674: the clip holds the objective at 1.2 * 0.674 = 0.809."""
    old = torch.tensor([[-1.0]])
    new = old + math.log(1.3)
    loss, stats = pf.clipped_policy_loss(new, old, torch.tensor([[0.674]]), torch.ones(1, 1), clip_eps_low=0.2)
    assert loss.item() == pytest.approx(-0.8088, abs=1e-4)
    assert round(-loss.item(), 3) == 0.809
    assert stats["clipfrac"].item() == 1.0


@on_backends("value_loss")
def test_seed_example_value_loss(backend):
    """The critic regresses toward R = [1.474, 1.52]: 0.5 * mean squared error when nothing clips."""
    values = torch.tensor([[0.8, 1.0]])
    returns = torch.tensor([[1.474, 1.52]])
    loss, stats = pf.value_loss(values, values, returns, torch.ones(1, 2), clip=10.0)
    expected = 0.5 * ((0.8 - 1.474) ** 2 + (1.0 - 1.52) ** 2) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clipfrac"].item() == 0.0


# --------------------------------------------------------------------------- GAE


def _naive_gae(rewards, values, mask, gamma, lam):
    """Per row in plain Python: the valid tokens, in order, are the episode."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_value = float(values[b, steps[i + 1]]) if i + 1 < len(steps) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
    returns = torch.where(mask, adv + values.double(), 0.0)
    return adv, returns


@st.composite
def gae_batch(draw):
    batch = draw(st.integers(1, 5))
    length = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    keep = draw(st.floats(0.0, 1.0))
    mask = torch.rand(batch, length, generator=g) < keep
    if draw(st.booleans()):
        mask[0] = False  # an empty row
    rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    gamma = draw(st.sampled_from([1.0, 0.99, 0.5, 0.0]))
    lam = draw(st.sampled_from([1.0, 0.95, 0.3, 0.0]))
    return rewards, values, mask, gamma, lam


@pytest.mark.parametrize("backend_name", cpu_backends("gae"))
@settings(max_examples=60, deadline=None)
@given(case=gae_batch())
def test_gae_matches_naive_loop(backend_name, case):
    rewards, values, mask, gamma, lam = case
    with pf.use_backend(backend_name):
        advantages, returns = pf.gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected_adv, expected_ret = _naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages.double(), expected_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns.double(), expected_ret, rtol=1e-5, atol=1e-5)


@on_backends("gae")
def test_gae_ignores_masked_inputs(backend):
    rewards = torch.randn(3, 9)
    values = torch.randn(3, 9)
    mask = torch.rand(3, 9) < 0.6
    advantages, returns = pf.gae(rewards, values, mask)
    garbage = torch.where(mask, rewards, torch.full_like(rewards, 1e6))
    advantages2, returns2 = pf.gae(garbage, torch.where(mask, values, -1e6), mask)
    torch.testing.assert_close(advantages, advantages2)
    torch.testing.assert_close(returns, returns2)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()


@on_backends("gae")
def test_gae_length_one_row(backend):
    advantages, returns = pf.gae(torch.tensor([[2.0]]), torch.tensor([[0.5]]), torch.ones(1, 1), gamma=0.9, lam=0.9)
    torch.testing.assert_close(advantages, torch.tensor([[1.5]]))
    torch.testing.assert_close(returns, torch.tensor([[2.0]]))


# --------------------------------------------------------------------------- KL and rewards


@on_backends("kl_estimate")
def test_kl_estimators_match_their_formulas(backend):
    logp = torch.randn(4, 7)
    ref = torch.randn(4, 7)
    d = (logp - ref).double()
    torch.testing.assert_close(pf.kl_estimate(logp, ref, "k1").double(), d)
    torch.testing.assert_close(pf.kl_estimate(logp, ref, "k2").double(), 0.5 * d**2)
    torch.testing.assert_close(pf.kl_estimate(logp, ref, "abs").double(), d.abs())
    k3 = (torch.exp(-d) + d - 1).clamp(-10, 10)
    torch.testing.assert_close(pf.kl_estimate(logp, ref, "k3").double(), k3, rtol=1e-5, atol=1e-6)
    # k3 is non-negative and capped at 10 for a far-off reference
    far = pf.kl_estimate(torch.tensor([0.0]), torch.tensor([50.0]), "k3")
    assert far.item() == 10.0


@on_backends("kl_penalized_rewards")
def test_kl_penalized_rewards_place_score_at_last_valid_token(backend):
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    logp = torch.randn(3, 6)
    ref = torch.randn(3, 6)
    scores = torch.tensor([2.0, 3.0, -1.0])
    rewards, kl = pf.kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.05, kl_estimator="k2")
    expected_kl = torch.where(mask, 0.5 * (logp - ref) ** 2, 0.0)
    torch.testing.assert_close(kl, expected_kl)
    expected = -0.05 * expected_kl
    expected[0, 3] += 2.0
    expected[2, 0] += -1.0
    torch.testing.assert_close(rewards, expected)


# --------------------------------------------------------------------------- log-probs


@on_backends("token_logprobs")
def test_logprobs_of_all_labels_normalise(backend):
    vocab = 13
    logits = torch.randn(5, vocab) * 3
    labels = torch.arange(vocab).repeat(5, 1)
    logp = pf.token_logprobs(logits.unsqueeze(1).expand(5, vocab, vocab).contiguous(), labels, temperature=0.7)
    assert torch.logsumexp(logp, dim=-1).abs().max() < 1e-5


@on_backends("token_logprobs")
def test_logprobs_shift_invariant_and_match_log_softmax(backend):
    logits = torch.randn(3, 4, 11)
    labels = torch.randint(0, 11, (3, 4))
    logp, ent = pf.token_logprobs(logits, labels, temperature=1.3, return_entropy=True)
    logp_shifted, ent_shifted = pf.token_logprobs(logits + 17.5, labels, temperature=1.3, return_entropy=True)
    torch.testing.assert_close(logp, logp_shifted, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ent_shifted, atol=1e-5, rtol=1e-5)
    full = torch.log_softmax(logits.double() / 1.3, -1)
    torch.testing.assert_close(logp.double(), full.gather(-1, labels.unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1), atol=1e-5, rtol=1e-5)


@on_backends("token_logprobs")
def test_logprobs_ignore_index_gives_zero_and_no_gradient(backend):
    logits = torch.randn(6, 9, requires_grad=True)
    labels = torch.tensor([1, -100, 3, -100, 8, 0])
    logp, ent = pf.token_logprobs(logits, labels, return_entropy=True)
    assert (logp[labels == -100] == 0).all() and (ent[labels == -100] == 0).all()
    (logp.sum() + ent.sum()).backward()
    assert (logits.grad[labels == -100] == 0).all()
    assert (logits.grad[labels != -100] != 0).any()


@on_backends("token_logprobs")
def test_logprobs_extreme_rows(backend):
    """-inf elsewhere in a row is harmless; a -inf chosen logit gives -inf; NaN stays in its row."""
    logits = torch.randn(4, 6)
    labels = torch.tensor([0, 1, 2, 3])
    logits[0, 3] = float("-inf")
    logits[1, 1] = float("-inf")
    logits[2, 5] = float("nan")
    logits[3] *= 1e4
    logp, ent = pf.token_logprobs(logits, labels, return_entropy=True)
    assert torch.isfinite(logp[0]) and torch.isfinite(ent[0])
    assert logp[1].item() == float("-inf") and torch.isfinite(ent[1])
    assert torch.isnan(logp[2]) and torch.isnan(ent[2])
    assert torch.isfinite(logp[3]) and torch.isfinite(ent[3])


# --------------------------------------------------------------------------- losses


def _policy_loss_by_formula(logp, old, adv, mask, clip_low, clip_high, dual_clip, agg, weights):
    """Token by token in Python floats, then the agg mode as verl defines it."""
    batch, length = logp.shape
    per_token = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        for t in range(length):
            ratio = math.exp(max(-20.0, min(20.0, float(logp[b, t] - old[b, t]))))
            a = float(adv[b, t])
            pg = max(-a * ratio, -a * max(1 - clip_low, min(1 + clip_high, ratio)))
            if dual_clip is not None and a < 0:
                pg = min(pg, -a * dual_clip)
            per_token[b][t] = pg * (float(weights[b, t]) if weights is not None else 1.0)
    m = mask.tolist()
    sums = [sum(p * v for p, v in zip(per_token[b], m[b])) for b in range(batch)]
    counts = [sum(m[b]) for b in range(batch)]
    rows = [b for b in range(batch) if counts[b] > 0]
    if agg == "token-sum":
        return sum(sums)
    if agg == "token-mean":
        return sum(sums) / max(sum(counts), 1)
    if agg == "seq-mean-token-mean":
        return sum(sums[b] / counts[b] for b in rows) / max(len(rows), 1)
    seq_sum = sum(sums[b] for b in rows) / max(len(rows), 1)
    return seq_sum / length if agg == "seq-mean-token-sum-norm" else seq_sum


@on_backends("clipped_policy_loss")
@pytest.mark.parametrize(
    "agg", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("variant", ["plain", "asymmetric", "dual", "weighted"])
def test_clipped_policy_loss_matches_formula(backend, agg, variant):
    batch, length = 4, 7
    old = torch.randn(batch, length)
    logp = old + 0.4 * torch.randn(batch, length)
    adv = torch.randn(batch, length)
    mask = torch.rand(batch, length) < 0.7
    mask[1] = False
    kwargs = {"agg": agg, "clip_eps_low": 0.2}
    clip_high, dual, weights = 0.2, None, None
    if variant == "asymmetric":
        kwargs["clip_eps_high"] = clip_high = 0.28
    if variant == "dual":
        kwargs["dual_clip"] = dual = 1.5
        adv = adv - 1.0
    if variant == "weighted":
        kwargs["weights"] = weights = torch.rand(batch, length) * 2
    loss, stats = pf.clipped_policy_loss(logp, old, adv, mask, **kwargs)
    expected = _policy_loss_by_formula(logp, old, adv, mask, 0.2, clip_high, dual, agg, weights)
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(
        float(((old - logp) * mask).sum() / mask.sum()), rel=1e-5, abs=1e-6
    )
    assert 0.0 <= stats["clipfrac"].item() <= 1.0
    if variant == "dual":
        ratio = torch.exp(logp - old)
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        capped = (adv < 0) & (-adv * 1.5 < pg) & mask
        assert stats["clipfrac_lower"].item() == pytest.approx(capped.sum().item() / mask.sum().item())


@on_backends("value_loss")
def test_value_loss_clip(backend):
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0]])
    loss, stats = pf.value_loss(values, old, returns, torch.ones(1, 3), clip=0.5, agg="token-sum")
    # token 0: max(1, 0.25) = 1; token 1: max(1, 1) = 1; token 2: max(4, 0.25) = 4
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 4))
    assert stats["clipfrac"].item() == 0.0
    loss, stats = pf.value_loss(
        values, old, torch.tensor([[3.0, 1.0, 3.0]]), torch.ones(1, 3), clip=0.5, agg="token-sum"
    )
    # token 0: max(4, 6.25); token 1: max(1, 1); token 2: max(1, 6.25)
    assert loss.item() == pytest.approx(0.5 * (6.25 + 1 + 6.25))
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)


@on_backends("clipped_policy_loss")
def test_loss_gradients_point_the_right_way(backend):
    old = torch.zeros(2, 3)
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, -2.0, 0.0]])
    loss, _ = pf.clipped_policy_loss(logp, old, adv, torch.ones(2, 3))
    loss.backward()
    # minimising the loss raises positive-advantage log-probs and lowers negative ones
    torch.testing.assert_close(logp.grad, -adv / 6)


# --------------------------------------------------------------------------- gradcheck (float64)


def test_gradcheck_token_logprobs_reference():
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, -100, 3, 2])
    with pf.use_backend("reference"):
        torch.autograd.gradcheck(
            lambda x: pf.token_logprobs(x, labels, temperature=0.8, return_entropy=True), (logits,)
        )


def test_gradcheck_losses_reference():
    old = torch.randn(3, 5, dtype=torch.float64)
    logp = (old + 0.5 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) < 0.8
    with pf.use_backend("reference"):
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            torch.autograd.gradcheck(
                lambda x: pf.clipped_policy_loss(x, old, adv, mask, agg=agg, dual_clip=2.0)[0], (logp,)
            )
        values = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        returns = torch.randn(3, 5, dtype=torch.float64)
        torch.autograd.gradcheck(lambda v: pf.value_loss(v, old, returns, mask, clip=0.3)[0], (values,))


# --------------------------------------------------------------------------- whitening and means


def test_masked_mean_and_whiten():
    x = torch.randn(4, 6)
    mask = torch.rand(4, 6) < 0.6
    mask[0, 0] = mask[0, 1] = True
    valid = x[mask].double()
    assert pf.masked_mean(x, mask).item() == pytest.approx(valid.mean().item(), rel=1e-6)
    row_means = pf.masked_mean(x, mask, dim=1)
    for b in range(4):
        expected = x[b][mask[b]].mean().item() if mask[b].any() else 0.0
        assert row_means[b].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    white = pf.masked_whiten(x, mask)
    assert white[mask].double().mean().item() == pytest.approx(0.0, abs=1e-6)
    assert white[mask].double().std().item() == pytest.approx(1.0, rel=1e-4)
    assert (white[~mask] == 0).all()
    scaled = pf.masked_whiten(x, mask, shift_mean=False)
    # as in TRL and verl: whitened, then the mean added back (input mean, unit variance)
    torch.testing.assert_close(scaled[mask].double().mean(), valid.mean(), rtol=1e-4, atol=1e-6)
    assert scaled[mask].double().std().item() == pytest.approx(1.0, rel=1e-4)


# --------------------------------------------------------------------------- KL controllers


def test_kl_controllers():
    fixed = pf.FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    adaptive = pf.AdaptiveKLController(0.2, target_kl=6.0, horizon=10000)
    adaptive.update(12.0, 256)  # error clipped to +0.2
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    adaptive.update(3.0, 100)  # error -0.5 clipped to -0.2
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.2 * 100 / 10000))
    with pytest.raises(ValueError, match="target_kl"):
        pf.AdaptiveKLController(0.1, target_kl=0.0, horizon=100)


# --------------------------------------------------------------------------- backends


def test_backend_selection_and_errors(monkeypatch):
    report = pf.available_backends()
    assert set(report) == set(BACKENDS)
    assert report["reference"].startswith("available")
    with pytest.raises(ValueError, match="backend must be one of"):
        with pf.use_backend("cuda-magic"):
            pass
    monkeypatch.setenv("PPO_FAST_BACKEND", "reference")
    assert pf.current_backend() == "reference"
    monkeypatch.setenv("PPO_FAST_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="PPO_FAST_BACKEND"):
        pf.current_backend()


def test_explicit_backend_that_cannot_serve_raises():
    unavailable = [name for name in BACKENDS if not backend_info(name).available]
    cpu_less = [
        name
        for name in BACKENDS
        if backend_info(name).available
        and "cpu" not in backend_info(name).module.SUPPORTED.get("token_logprobs", set())
    ]
    for name in unavailable + cpu_less:
        with pf.use_backend(name), pytest.raises(pf.BackendUnavailableError, match="token_logprobs"):
            pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]))
    # a fake CUDA-only op request on CPU must also say why
    with pf.use_backend("reference"):
        assert pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1])).shape == (2,)


# --------------------------------------------------------------------------- bad inputs


def _batch():
    return torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: pf.token_logprobs([1.0], torch.tensor([0])), TypeError, "logits"),
        (lambda: pf.token_logprobs(torch.randn(2, 3).long(), torch.tensor([0, 1])), TypeError, "logits"),
        (lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0.0, 1.0])), TypeError, "labels"),
        (lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1, 2])), ValueError, "labels"),
        (lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 3])), ValueError, "labels"),
        (lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, -1])), ValueError, "labels"),
        (
            lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]), temperature=0.0),
            ValueError,
            "temperature",
        ),
        (
            lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]), temperature=float("nan")),
            ValueError,
            "temperature",
        ),
        (lambda: pf.token_logprobs(torch.randn(2, 0), torch.tensor([0, 1])), ValueError, "logits"),
        (
            lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]), return_entropy=1),
            TypeError,
            "return_entropy",
        ),
        (lambda: pf.kl_estimate(torch.randn(2), torch.randn(3)), ValueError, "ref_logprobs"),
        (lambda: pf.kl_estimate(torch.randn(2), torch.randn(2), "k4"), ValueError, "kl_estimator"),
        (
            lambda: pf.kl_penalized_rewards(torch.randn(3), *_batch()[:2], _batch()[3], kl_coef=0.1),
            ValueError,
            "scores",
        ),
        (
            lambda: pf.kl_penalized_rewards(torch.randn(2), *_batch()[:2], _batch()[3], kl_coef=-0.1),
            ValueError,
            "kl_coef",
        ),
        (
            lambda: pf.kl_penalized_rewards(torch.randn(2), *_batch()[:2], _batch()[3], kl_coef=float("inf")),
            ValueError,
            "kl_coef",
        ),
        (
            lambda: pf.kl_penalized_rewards(torch.randn(2), *_batch()[:2], torch.ones(2, 4), kl_coef=0.1),
            ValueError,
            "mask",
        ),
        (lambda: pf.gae(*_batch()[:2], torch.full((2, 3), 0.5)), ValueError, "mask"),
        (lambda: pf.gae(*_batch()[:2], _batch()[3], gamma=1.5), ValueError, "gamma"),
        (lambda: pf.gae(*_batch()[:2], _batch()[3], lam=-0.1), ValueError, "lam"),
        (lambda: pf.gae(torch.randn(6), torch.randn(6), torch.ones(6)), ValueError, "rewards"),
        (lambda: pf.gae(torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3)), ValueError, "values"),
        (lambda: pf.gae(*_batch()[:2], "mask"), TypeError, "mask"),
        (lambda: pf.clipped_policy_loss(*_batch(), clip_eps_low=0.0), ValueError, "clip_eps_low"),
        (lambda: pf.clipped_policy_loss(*_batch(), clip_eps_high=-0.1), ValueError, "clip_eps_high"),
        (lambda: pf.clipped_policy_loss(*_batch(), dual_clip=1.0), ValueError, "dual_clip"),
        (lambda: pf.clipped_policy_loss(*_batch(), agg="mean"), ValueError, "agg"),
        (lambda: pf.clipped_policy_loss(*_batch(), weights=torch.ones(3, 2)), ValueError, "weights"),
        (
            lambda: pf.clipped_policy_loss(torch.randn(2, 3), torch.randn(2, 2), torch.randn(2, 3), torch.ones(2, 3)),
            ValueError,
            "old_logprobs",
        ),
        (
            lambda: pf.clipped_policy_loss(
                torch.randn(2, 3), torch.randn(2, 3), torch.randint(0, 2, (2, 3)), torch.ones(2, 3)
            ),
            TypeError,
            "advantages",
        ),
        (lambda: pf.value_loss(*_batch(), clip=0.0), ValueError, "clip"),
        (lambda: pf.value_loss(*_batch(), clip=True), TypeError, "clip"),
        (lambda: pf.masked_whiten(torch.randn(2, 3), torch.zeros(2, 3)), ValueError, "mask"),
        (lambda: pf.masked_mean(torch.randn(2, 3), torch.ones(3, 2)), ValueError, "mask"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_torch_compile_of_public_ops_on_cpu():
    """The public ops trace under torch.compile (reference backend on CPU)."""

    def step(logits, labels, ref, scores, values, mask):
        logp = pf.token_logprobs(logits, labels, temperature=0.9)
        rewards, _ = pf.kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.05)
        adv, ret = pf.gae(rewards, values, mask)
        loss, _ = pf.clipped_policy_loss(logp, logp.detach(), adv, mask)
        vloss, _ = pf.value_loss(values, values, ret, mask)
        return loss + vloss

    args = (
        torch.randn(2, 5, 11),
        torch.randint(0, 11, (2, 5)),
        torch.randn(2, 5),
        torch.randn(2),
        torch.randn(2, 5),
        torch.rand(2, 5) < 0.8,
    )
    with pf.use_backend("reference"):
        expected = step(*args)
        compiled = torch.compile(step, backend="aot_eager")(*args)
    torch.testing.assert_close(compiled, expected)
