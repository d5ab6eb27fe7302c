"""Native (C++) CPU kernels of gae, kl_estimate, kl_penalized_rewards and token_logprobs
against ppo_fast.reference: dtypes, masks with holes, odd shapes, edge cases, backward
(every differentiable input, each gradient in its input's dtype, the reference's
autograd conventions), gradcheck of the raw ops, opcheck of every op, out-of-range
labels and torch.compile."""

import math

import pytest
import torch
from test_native_common import leaves, random_holes_mask, random_mask, requires_native

import ppo_fast as pf
from ppo_fast.backends import native as native_backend
from ppo_fast.backends import reference
from ppo_fast.spec import KL_ESTIMATORS

pytestmark = requires_native


def _on(backend, fn, *args, **kwargs):
    with pf.use_backend(backend):
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------- GAE


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


# --------------------------------------------------------------------------- KL


# --------------------------------------------------------------------------- KL / GAE gradients


def _kl_inputs(shape, dtype, ref_dtype=None):
    """log-probs and reference log-probs with log-ratios beyond k3's clamps and exact zeros (abs)."""
    logprobs = -3 * torch.rand(shape)
    ref = logprobs + torch.randn(shape)
    ref.view(-1)[0] = logprobs.view(-1)[0] + 25.0  # k3: inner clamp (-log_ratio > 20)
    ref.view(-1)[1] = logprobs.view(-1)[1] - 25.0  # k3: inner clamp (-log_ratio < -20)
    ref.view(-1)[2] = logprobs.view(-1)[2] - 5.0  # k3: inside the outer clamp (exp(-5) + 4 < 10)
    ref.view(-1)[3] = logprobs.view(-1)[3] + 5.0  # k3: beyond the outer clamp (exp(5) - 6 > 10)
    ref.view(-1)[4] = logprobs.view(-1)[4]  # abs: sign(0) = 0
    return logprobs.to(dtype), ref.to(ref_dtype or dtype)


def _compare_grads(got, expected, inputs, exact=False):
    for g, e, x in zip(got, expected, inputs):
        if e is None:
            assert g is None
            continue
        assert g.dtype == x.dtype and g.shape == x.shape
        tol = {"rtol": 1e-5, "atol": 1e-6} if x.dtype in (torch.float32, torch.float64) else {}
        torch.testing.assert_close(g, e, **tol)


@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
def test_kl_estimate_gradient_conventions(kl_estimator):
    # abs: sign(0) = 0; k3: no gradient beyond either clamp; k1: -1 to the reference.
    logprobs = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    ref = torch.tensor([0.0, 25.0, -25.0, 5.0, -0.5])
    x, r = leaves(logprobs, ref)
    grad_logp, grad_ref = torch.autograd.grad(native_backend.FUNCTIONS["kl_estimate"](x, r, kl_estimator).sum(), (x, r))
    log_ratio = logprobs - ref
    expected = {
        "k1": torch.ones(5),
        "k2": log_ratio,
        "abs": torch.sign(log_ratio),
        "k3": torch.where(torch.tensor([True, False, False, False, True]), 1 - torch.exp(-log_ratio), 0.0),
    }[kl_estimator]
    torch.testing.assert_close(grad_logp, expected)
    torch.testing.assert_close(grad_ref, -expected)


@pytest.mark.parametrize("used", ["rewards", "kl"])
def test_kl_penalized_rewards_gradient_through_one_output(used):
    shape = (4, 9)
    logprobs, ref = _kl_inputs(shape, torch.float32)
    scores, mask = torch.randn(4), random_holes_mask(shape)
    results = []
    for impl in (native_backend, reference):
        inputs = leaves(scores, logprobs, ref)
        rewards, kl = impl.FUNCTIONS["kl_penalized_rewards"](*inputs, mask, 0.3, "k2")
        out = rewards if used == "rewards" else kl
        results.append(torch.autograd.grad((out * torch.arange(36.0).view(shape)).sum(), inputs, allow_unused=True))
    native, expected = results
    if used == "kl":  # no path to the scores
        assert native[0] is None or torch.count_nonzero(native[0]) == 0
        native, expected = native[1:], expected[1:]
    for g, e in zip(native, expected):
        torch.testing.assert_close(g, e)


def test_kl_penalized_rewards_mixed_dtypes_give_each_gradient_its_dtype():
    shape = (3, 11)
    logprobs, ref = _kl_inputs(shape, torch.bfloat16, torch.float32)
    scores = torch.randn(3, dtype=torch.float64)
    mask = random_holes_mask(shape)
    inputs = leaves(scores, logprobs, ref)
    rewards, kl = native_backend.FUNCTIONS["kl_penalized_rewards"](*inputs, mask, 0.1, "k3")
    assert rewards.dtype == kl.dtype == torch.float32  # scores do not set the compute dtype
    grads = torch.autograd.grad(rewards.sum() + kl.sum(), inputs)
    assert [g.dtype for g in grads] == [torch.float64, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("used", ["advantages", "returns"])
def test_gae_gradient_through_one_output(used):
    shape = (3, 17)
    rewards, values, mask = torch.randn(shape), torch.randn(shape), random_holes_mask(shape)
    results = []
    for impl in (native_backend, reference):
        inputs = leaves(rewards, values)
        adv, ret = impl.FUNCTIONS["gae"](*inputs, mask, 1.0, 0.95)
        results.append(torch.autograd.grad((adv if used == "advantages" else ret).sum(), inputs))
    for g, e in zip(*results):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_gae_only_values_need_grad():
    shape = (3, 8)
    rewards, mask = torch.randn(shape), random_holes_mask(shape)
    values = torch.randn(shape, requires_grad=True)
    adv, _ = native_backend.FUNCTIONS["gae"](rewards, values, mask, 0.99, 0.95)
    (grad,) = torch.autograd.grad(adv.sum(), values)
    adv_ref, _ = reference.gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(grad, torch.autograd.grad(adv_ref.sum(), values)[0])


def test_gae_gradcheck_float64():
    shape = (3, 9)
    inputs = leaves(torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64))
    mask = random_holes_mask(shape)
    assert torch.autograd.gradcheck(lambda r, v: torch.ops.ppo_fast.gae(r, v, mask, 0.9, 0.8), inputs)
    # One input in float32: the compute dtype is still float64, the float32 input gets a float32 gradient.
    values = torch.randn(shape, requires_grad=True)
    _, ret = torch.ops.ppo_fast.gae(inputs[0], values, mask, 0.9, 0.8)
    assert ret.dtype == torch.float64 and torch.autograd.grad(ret.sum(), values)[0].dtype == torch.float32


def test_reward_and_gae_backward_ops_skip_unrequested_gradients():
    shape = (2, 6)
    logprobs, ref, mask = torch.randn(shape), torch.randn(shape), random_mask(shape)
    grad_logp, grad_ref = torch.ops.ppo_fast.kl_estimate_backward(torch.ones(shape), logprobs, ref, "k2", [False, True])
    assert grad_logp.numel() == 0 and grad_ref.shape == shape
    grad_scores, grad_logp, grad_ref = torch.ops.ppo_fast.kl_penalized_rewards_backward(
        torch.ones(shape), None, logprobs, ref, mask, 0.1, "k1", torch.float16, [True, False, False]
    )
    assert (
        grad_scores.shape == (2,) and grad_scores.dtype == torch.float16 and grad_logp.numel() == grad_ref.numel() == 0
    )
    grad_rewards, grad_values = torch.ops.ppo_fast.gae_backward(
        None, torch.ones(shape), mask, 1.0, 1.0, torch.float32, torch.bfloat16, [False, True]
    )
    assert grad_rewards.numel() == 0 and grad_values.dtype == torch.bfloat16
    # No upstream gradient at all: zero gradients.
    grads = torch.ops.ppo_fast.kl_penalized_rewards_backward(
        None, None, logprobs, ref, mask, 0.1, "k3", torch.float32, [True] * 3
    )
    assert all(torch.count_nonzero(g) == 0 for g in grads)


# --------------------------------------------------------------------------- token_logprobs


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_exp_underflow_and_saturation(dtype):
    """Logits around the float32 exp's ends (fast_exp: 0 below about -87.68 relative to the
    row max, where the exact value is subnormal): log-probs, entropy and gradient as the
    float64 reference, in rows long enough for the vector loops and several chunks."""
    gen = torch.Generator().manual_seed(12)
    offsets = torch.tensor([0.0, -20.0, -87.0, -87.5, -87.68, -87.7, -88.03, -88.1, -100.0, -1e30])
    logits = offsets[torch.randint(0, len(offsets), (6, 2100), generator=gen)] + 0.01 * torch.randn(
        6, 2100, generator=gen
    )
    logits[:, 0] = 0.5  # every row has its max away from the ends
    logits = logits.to(dtype)
    labels = torch.randint(0, 2100, (6,), generator=gen)
    labels[0] = 0
    x = logits.clone().requires_grad_(True)
    logp, ent = _on("native", pf.token_logprobs, x, labels, return_entropy=True)
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), x)
    x64 = logits.double().requires_grad_(True)
    ref_logp, ref_ent = reference.token_logprobs(x64, labels, 1.0, True, -100)
    (ref_grad,) = torch.autograd.grad(ref_logp.sum() + ref_ent.sum(), x64)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6 if dtype == torch.float32 else 1e-2)


# --------------------------------------------------------------------------- out-of-range labels

VOCAB = 1000
BAD_LABELS = [VOCAB, -5, 10**11, -(10**11), VOCAB + 1, -1]


def test_backward_ops_bitwise_deterministic_across_threads():
    shape = (64, 700)
    logprobs, ref = _kl_inputs(shape, torch.float32)
    mask = random_holes_mask(shape)
    grad = torch.randn(shape)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (threads, 1, threads):
            torch.set_num_threads(n)
            outputs.append(
                (
                    *torch.ops.ppo_fast.kl_estimate_backward(grad, logprobs, ref, "k3", [True, True]),
                    *torch.ops.ppo_fast.kl_penalized_rewards_backward(
                        grad, grad, logprobs, ref, mask, 0.1, "k2", torch.float32, [True] * 3
                    ),
                    *torch.ops.ppo_fast.gae_backward(
                        grad, grad, mask, 0.99, 0.95, torch.float32, torch.float32, [True, True]
                    ),
                )
            )
    finally:
        torch.set_num_threads(threads)
    for run in outputs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, outputs[0]))
