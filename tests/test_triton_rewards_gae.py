"""Triton KL estimate, KL-penalised rewards and GAE scan against the reference, forward and backward."""

import math

import pytest
import torch

pytest.importorskip("triton")

import ppo_fast as pf  # noqa: E402
from ppo_fast.backends import reference
from ppo_fast.backends.triton import gae as triton_gae  # noqa: E402
from ppo_fast.backends.triton import kl_penalized_rewards as triton_kl_penalized_rewards  # noqa: E402
from ppo_fast.spec import KL_ESTIMATORS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# Not representable in float32: float64 results still match the reference at 1e-12, as
# the launchers pass each hyper-parameter as a float32 pair hi + lo.
KL_COEF = 0.3


def _tolerance(dtype):
    """Computed in float32 (float64) from the same inputs as the reference: only rounding differs.

    Gradients in bf16/fp16 may differ by one unit in the last place (a float32 value
    one rounding away from the reference's, then rounded to nearest by both): torch's
    default tolerances for those dtypes.
    """
    if dtype == torch.float64:
        return dict(rtol=1e-12, atol=1e-12)
    if dtype in (torch.bfloat16, torch.float16):
        return {}
    return dict(rtol=1e-5, atol=1e-5)


def _mask(batch, length, keep=0.7):
    """Random mask with an all-masked row, a single valid token row and interior holes."""
    mask = torch.rand(batch, length, device=DEVICE) < keep
    mask[0] = False
    if batch > 1:
        mask[1] = False
        mask[1, length // 2] = True
    return mask


def _run(backend, fn, leaves, *rest):
    """``fn(*leaves, *rest)`` on ``backend`` and the gradients of a random weighting of its outputs."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    with pf.use_backend(backend):
        outputs = fn(*leaves, *rest)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    gen = torch.Generator(device=DEVICE).manual_seed(1234)
    loss = sum((out * torch.randn(out.shape, generator=gen, device=DEVICE, dtype=out.dtype)).sum() for out in outputs)
    loss.backward()
    return [out.detach() for out in outputs], [x.grad for x in leaves]


def _assert_matches_reference(fn, leaves, *rest, equal_nan=False):
    (outs, grads), (ref_outs, ref_grads) = _run("triton", fn, leaves, *rest), _run("reference", fn, leaves, *rest)
    for out, ref in zip(outs, ref_outs):
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out, ref, equal_nan=equal_nan, **_tolerance(ref.dtype))
    for grad, ref, leaf in zip(grads, ref_grads, leaves):
        assert grad.dtype == leaf.dtype
        torch.testing.assert_close(grad, ref, equal_nan=equal_nan, **_tolerance(leaf.dtype))


# --------------------------------------------------------------------------- kl_estimate


@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
def test_kl_estimate_infinite_log_probs(kl_estimator):
    logp = torch.tensor([-math.inf, -1.0, -math.inf, math.nan, -2.0], device=DEVICE)
    ref = torch.tensor([-1.0, -math.inf, -math.inf, -1.0, -2.0], device=DEVICE)
    with pf.use_backend("triton"):
        out = pf.kl_estimate(logp, ref, kl_estimator)
    with pf.use_backend("reference"):
        expected = pf.kl_estimate(logp, ref, kl_estimator)
    torch.testing.assert_close(out, expected, equal_nan=True)


def test_kl_estimate_mixed_dtypes_and_empty():
    logp = torch.randn(6, device=DEVICE, dtype=torch.bfloat16)
    ref = torch.randn(6, device=DEVICE, dtype=torch.float64)
    _assert_matches_reference(lambda a, b: pf.kl_estimate(a, b, "k3"), [logp, ref])
    with pf.use_backend("triton"):
        assert pf.kl_estimate(torch.empty(0, 3, device=DEVICE), torch.empty(0, 3, device=DEVICE)).shape == (0, 3)


# --------------------------------------------------------------------------- kl_penalized_rewards


def test_kl_penalized_rewards_strided_inputs_and_int_mask():
    batch, length = 3, 11
    full_logp = torch.randn(batch, length + 1, device=DEVICE)
    full_ref = torch.randn(length + 1, batch, device=DEVICE)
    scores = torch.randn(batch, 2, device=DEVICE)[:, 1]
    mask = (torch.rand(batch, length, device=DEVICE) < 0.6).to(torch.int64)

    def fn(scores, full_logp, full_ref):
        return pf.kl_penalized_rewards(scores, full_logp[:, 1:], full_ref[1:].t(), mask, kl_coef=0.2, kl_estimator="k2")

    _assert_matches_reference(fn, [scores, full_logp, full_ref])


@pytest.mark.parametrize("block_t", [4, 8])
def test_kl_rewards_kernel_chunks(block_t):
    """Small chunks: the last valid token is found in the first chunk from the end that has one."""
    batch, length = 6, 29
    logp, ref, scores = torch.randn(batch, length), torch.randn(batch, length), torch.randn(batch)
    mask = _mask(batch, length)
    mask[2, :] = False
    mask[2, :3] = True  # last valid token in the last chunk processed
    mask[3, :] = True
    rewards, kl, last = triton_kl_penalized_rewards.kl_penalized_rewards_forward(
        scores, logp, ref, mask, 0.1, "k3", block_t=block_t
    )
    expected_rewards, expected_kl = reference.kl_penalized_rewards(scores, logp, ref, mask, 0.1, "k3")
    torch.testing.assert_close(rewards, expected_rewards, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kl, expected_kl, rtol=1e-6, atol=1e-6)
    expected_last, has_valid = reference.last_valid_index(mask)
    assert last.tolist() == torch.where(has_valid, expected_last, -1).tolist()


# --------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("block_t", [2, 4, 16])
def test_gae_kernel_carries_across_chunks(block_t):
    """Small chunks: masked runs that span chunk borders pass the advantage and the next valid value through."""
    batch, length = 5, 41
    rewards, values = torch.randn(batch, length), torch.randn(batch, length)
    mask = _mask(batch, length, keep=0.5)
    mask[2, 5:30] = False  # a masked run wider than several chunks
    mask[3] = True
    mask[4, -7:] = False  # masked tail
    advantages, returns = triton_gae.gae_forward(rewards, values, mask, 0.97, 0.9, block_t=block_t)
    expected_adv, expected_ret = reference.gae(rewards, values, mask, 0.97, 0.9)
    torch.testing.assert_close(advantages, expected_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns, expected_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 37])
@pytest.mark.parametrize("outputs", ["both", "advantages", "returns"])
def test_gae_gradients_match_reference(dtype, length, outputs):
    batch = 4
    rewards = torch.randn(batch, length, device=DEVICE).to(dtype)
    values = torch.randn(batch, length, device=DEVICE).to(dtype)
    mask = _mask(batch, length, keep=0.6)

    def fn(rewards, values):
        advantages, returns = pf.gae(rewards, values, mask, gamma=0.97, lam=0.9)
        return {"both": (advantages, returns), "advantages": advantages, "returns": returns}[outputs]

    _assert_matches_reference(fn, [rewards, values])


@pytest.mark.parametrize("block_t", [2, 8])
def test_gae_backward_kernel_carries_across_chunks(block_t):
    batch, length = 5, 29
    mask = _mask(batch, length, keep=0.5)
    mask[2, 3:20] = False
    mask[3] = True
    grad_adv, grad_ret = torch.randn(batch, length), torch.randn(batch, length)
    grad_rewards, grad_values = triton_gae.gae_backward(
        grad_adv, grad_ret, mask, 0.9, 0.8, torch.float32, torch.float32, block_t=block_t
    )
    rewards = torch.randn(batch, length, requires_grad=True)
    values = torch.randn(batch, length, requires_grad=True)
    advantages, returns = reference.gae(rewards, values, mask, 0.9, 0.8)
    ((advantages * grad_adv).sum() + (returns * grad_ret).sum()).backward()
    torch.testing.assert_close(grad_rewards, rewards.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_values, values.grad, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- float64 gradcheck and torch.compile
