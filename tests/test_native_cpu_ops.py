"""Native (C++) CPU kernels of gae, kl_estimate, kl_penalized_rewards and token_logprobs
against ppo_fast.reference: dtypes, masks with holes, odd shapes, edge cases, backward,
gradcheck, opcheck and torch.compile."""

import math

import pytest
import torch

import ppo_fast as pf
from ppo_fast import reference
from ppo_fast.reference import KL_ESTIMATORS
from test_native_common import ALL_FLOATS, FLOAT_DTYPES, random_mask, requires_native

pytestmark = requires_native


def _on(backend, fn, *args, **kwargs):
    with pf.use_backend(backend):
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("shape", [(4, 29), (1, 1), (3, 257)])
def test_gae_matches_reference(dtype, shape):
    rewards, values = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    mask = random_mask(shape)
    gamma, lam = 0.5 + 0.5 * torch.rand(()).item(), torch.rand(()).item()
    adv, ret = _on("native", pf.gae, rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = reference.gae(rewards, values, mask, gamma, lam)
    assert adv.dtype == ret.dtype == ref_adv.dtype
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_skips_interior_masked_tokens():
    # The masked token between the two valid ones is passed through, not a terminal.
    rewards = torch.tensor([[1.0, 100.0, 2.0]])
    values = torch.tensor([[0.5, 100.0, 0.25]])
    mask = torch.tensor([[True, False, True]])
    adv, ret = _on("native", pf.gae, rewards, values, mask, gamma=0.9, lam=0.8)
    a2 = 2.0 - 0.25
    a0 = (1.0 + 0.9 * 0.25 - 0.5) + 0.9 * 0.8 * a2
    torch.testing.assert_close(adv, torch.tensor([[a0, 0.0, a2]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, 0.0, a2 + 0.25]]))


def test_gae_empty_batch():
    adv, ret = _on("native", pf.gae, torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool))
    assert adv.shape == ret.shape == (0, 4)


# --------------------------------------------------------------------------- KL


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("dtype", ALL_FLOATS)
def test_kl_estimate_matches_reference(estimator, dtype):
    logprobs = (-3 * torch.rand(3, 5, 7)).to(dtype)
    ref = (logprobs.float() + torch.randn(3, 5, 7)).to(dtype)
    ref[0, 0, 0] = -float("inf")  # the +-20 clamp of k3
    ref[0, 0, 1] = 40.0
    got = _on("native", pf.kl_estimate, logprobs, ref, estimator)
    torch.testing.assert_close(got, reference.kl_estimate(logprobs, ref, estimator), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(5, 23), (1, 1)])
def test_kl_penalized_rewards_matches_reference(estimator, dtype, shape):
    logprobs = (-3 * torch.rand(shape)).to(dtype)
    ref = (logprobs.float() + 0.5 * torch.randn(shape)).to(dtype)
    scores = torch.randn(shape[0]).to(dtype)
    mask = random_mask(shape)
    if shape[1] > 2:
        mask[-1, -1] = False  # the last valid token is not the last position
    rewards, kl = _on("native", pf.kl_penalized_rewards, scores, logprobs, ref, mask, kl_coef=0.07, estimator=estimator)
    ref_rewards, ref_kl = reference.kl_penalized_rewards(scores, logprobs, ref, mask, 0.07, estimator)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rewards, ref_rewards, rtol=1e-5, atol=1e-6)


def test_opcheck_rewards_and_gae():
    shape = (3, 8)
    logprobs, ref, mask = torch.randn(shape), torch.randn(shape), random_mask(shape)
    torch.library.opcheck(torch.ops.ppo_fast.kl_estimate, (logprobs, ref, KL_ESTIMATORS.index("k3")))
    torch.library.opcheck(torch.ops.ppo_fast.kl_penalized_rewards, (torch.randn(3), logprobs, ref, mask, 0.1, 0))
    torch.library.opcheck(torch.ops.ppo_fast.gae, (torch.randn(shape), torch.randn(shape), mask, 1.0, 0.95))


# --------------------------------------------------------------------------- token_logprobs


def _logprobs_both(logits, labels, temperature, return_entropy, ignore_index=-100):
    """(logp, entropy, grad) from native and from the reference; the loss weights both outputs."""
    results = []
    logp_weight = torch.randn(labels.shape)
    entropy_weight = torch.randn(labels.shape)
    for backend in ("native", "reference"):
        x = logits.detach().clone().requires_grad_(True)
        with pf.use_backend(backend):
            out = pf.token_logprobs(x, labels, temperature=temperature, return_entropy=return_entropy, ignore_index=ignore_index)
        logp, entropy = out if return_entropy else (out, None)
        loss = (logp * logp_weight).sum() + ((entropy * entropy_weight).sum() if return_entropy else 0.0)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((logp, entropy, grad))
    return results


def _check_logprobs(logits, labels, temperature, return_entropy, ignore_index=-100):
    (logp, ent, grad), (ref_logp, ref_ent, ref_grad) = _logprobs_both(logits, labels, temperature, return_entropy, ignore_index)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=2e-5)
    if return_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=2e-5)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    tol = {} if logits.dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(grad, ref_grad, **tol)


@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("return_entropy", [False, True])
@pytest.mark.parametrize("vocab", [1, 33, 2500])
def test_token_logprobs_2d_matches_reference(dtype, return_entropy, vocab):
    n = 7
    logits = (3 * torch.randn(n, vocab)).to(dtype)
    if vocab > 1024:  # the row max in a later chunk: the running sums get rescaled
        logits[:, 2000] = 15.0
    labels = torch.randint(0, vocab, (n,))
    labels[3] = -100
    _check_logprobs(logits, labels, 0.7, return_entropy)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_token_logprobs_strided_3d_without_copy(dtype):
    # logits[:, :-1] of a [B, T, V] tensor cannot be viewed as [N, V]; the op reads it in place.
    full = torch.randn(3, 6, 41).to(dtype)
    logits = full[:, :-1]
    labels = torch.randint(0, 41, (3, 5))
    labels[1, 2] = 7  # any ignore_index works
    _check_logprobs(logits, labels, 1.3, True, ignore_index=7)


def test_token_logprobs_edge_rows():
    logits = torch.randn(4, 10)
    labels = torch.tensor([2, 5, 6, 0])
    logits[0, 2] = -float("inf")  # chosen logit -inf: log-prob -inf
    logits[1, 7] = float("nan")  # NaN only poisons its own row
    logits[2, :5] = -float("inf")  # other -inf logits: p = 0, finite entropy
    logp, ent = _on("native", pf.token_logprobs, logits, labels, return_entropy=True)
    ref_logp, ref_ent = reference.token_logprobs(logits, labels, 1.0, True, -100)
    assert logp[0].item() == -math.inf
    assert math.isnan(logp[1].item()) and math.isnan(ent[1].item())
    torch.testing.assert_close(logp, ref_logp, equal_nan=True)
    torch.testing.assert_close(ent, ref_ent, equal_nan=True)
    assert torch.isfinite(logp[2:]).all() and torch.isfinite(ent[[0, 2, 3]]).all()


def test_token_logprobs_ignored_rows_get_zero_gradient():
    logits = torch.randn(5, 12, requires_grad=True)
    labels = torch.tensor([-100, 3, -100, 11, 0])
    with pf.use_backend("native"):
        logp, ent = pf.token_logprobs(logits, labels, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert logp[0] == 0 and ent[2] == 0
    assert torch.count_nonzero(logits.grad[[0, 2]]) == 0
    assert torch.count_nonzero(logits.grad[[1, 3, 4]]) > 0


@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs_gradcheck_float64(return_entropy):
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 8, -100, 4])

    def fn(x):
        with pf.use_backend("native"):
            return pf.token_logprobs(x, labels, temperature=0.8, return_entropy=return_entropy)

    assert torch.autograd.gradcheck(fn, (logits,))


def test_opcheck_token_logprobs():
    labels = torch.tensor([1, -100, 4])
    for return_entropy in (False, True):
        args = (torch.randn(3, 6, requires_grad=True), labels, 0.9, return_entropy, -100)
        torch.library.opcheck(torch.ops.ppo_fast.token_logprobs, args)


def test_torch_compile_fullgraph(monkeypatch):
    monkeypatch.setenv("PPO_FAST_BACKEND", "native")
    logits = torch.randn(2, 5, 17)
    labels = torch.randint(0, 17, (2, 5))
    mask = random_mask((2, 5))
    scores, ref_logp = torch.randn(2), torch.randn(2, 5)

    def step(x):
        logp, ent = pf.token_logprobs(x, labels, temperature=0.9, return_entropy=True)
        rewards, _ = pf.kl_penalized_rewards(scores, logp.detach(), ref_logp, mask, kl_coef=0.05)
        adv, _ = pf.gae(rewards, torch.zeros_like(rewards), mask)
        return (logp * adv).sum() + 0.01 * ent.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x_c = logits.clone().requires_grad_(True)
    out = compiled(x_c)
    out.backward()
    monkeypatch.setenv("PPO_FAST_BACKEND", "reference")
    x_r = logits.clone().requires_grad_(True)
    ref_out = step(x_r)
    ref_out.backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_c.grad, x_r.grad, rtol=1e-5, atol=1e-6)
