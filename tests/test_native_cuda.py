"""Native CUDA loss kernels against ppo_fast.reference on CUDA tensors at real sizes,
forward and backward, plus bitwise determinism.  Skipped without a GPU or without a
CUDA build of the extension."""

import pytest
import torch

import ppo_fast as pf
from ppo_fast.reference import AGG_MODES
from test_native_common import ALL_FLOATS, NATIVE, policy_inputs, random_mask, requires_native

pytestmark = [
    pytest.mark.cuda,
    requires_native,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        NATIVE.available and not NATIVE.module.built_with_cuda(), reason="the extension was built without CUDA kernels"
    ),
]

SHAPES = [(64, 4096), (7, 1000), (1000, 3)]


def _run(backend, fn, tensor, *args, **kwargs):
    x = tensor.detach().clone().requires_grad_(True)
    with pf.use_backend(backend):
        loss, stats = fn(x, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, x)
    return loss, stats, grad


def _near_kinks(logprobs, old, ratio_bounds, margin=1e-5):
    """Tokens whose ratio lies within a relative ``margin`` of one of ``ratio_bounds``."""
    ratio = torch.exp(logprobs.double() - old.double())
    near = torch.zeros_like(ratio, dtype=torch.bool)
    for bound in ratio_bounds:
        near |= (ratio / bound - 1).abs() < margin
    return near


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_policy_loss_cuda_matches_reference(agg, dtype, dual_clip, weighted, shape):
    logprobs, old, adv = policy_inputs(shape, dtype, device="cuda")
    mask = random_mask(shape, device="cuda")
    weights = torch.rand(shape, device="cuda").to(dtype) if weighted else None
    kwargs = dict(clip_eps=0.2, clip_eps_high=0.28, dual_clip=dual_clip, agg=agg, weights=weights)
    loss, stats, grad = _run("native", pf.clipped_policy_loss, logprobs, old, adv, mask, **kwargs)
    ref_loss, ref_stats, ref_grad = _run("reference", pf.clipped_policy_loss, logprobs, old, adv, mask, **kwargs)
    # The kernels use the fast exp of --use_fast_math (a few ulp): a ratio within a hair
    # of a clip bound may land on the other side of it than in the reference.
    kinks = _near_kinks(logprobs, old, (0.8, 1.28) + ((dual_clip,) if dual_clip else ())) & mask
    flips_allowed = kinks.sum().item() / max(mask.sum().item(), 1)
    # Sums over up to 262k tokens in another order.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for name in ("clipfrac", "clipfrac_lower"):
        torch.testing.assert_close(stats[name], ref_stats[name], rtol=0, atol=flips_allowed + 1e-6)
    torch.testing.assert_close(stats["approx_kl"], ref_stats["approx_kl"], rtol=1e-4, atol=1e-5)
    assert grad.dtype == dtype
    exact = {"rtol": 1e-4, "atol": 1e-6} if dtype in (torch.float32, torch.float64) else {}
    torch.testing.assert_close(grad[~kinks], ref_grad[~kinks], **exact)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_value_loss_cuda_matches_reference(agg, dtype, shape):
    values = torch.randn(shape, device="cuda").to(dtype)
    old = (values.float() + 0.3 * torch.randn(shape, device="cuda")).to(dtype)
    returns = torch.randn(shape, device="cuda").to(dtype)
    mask = random_mask(shape, device="cuda")
    loss, stats, grad = _run("native", pf.value_loss, values, old, returns, mask, clip=0.2, agg=agg)
    ref_loss, ref_stats, ref_grad = _run("reference", pf.value_loss, values, old, returns, mask, clip=0.2, agg=agg)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stats["clipfrac"], ref_stats["clipfrac"], rtol=1e-4, atol=1e-5)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad)


def test_losses_cuda_bitwise_deterministic():
    shape = (512, 2048)
    logprobs, old, adv = policy_inputs(shape, torch.bfloat16, device="cuda")
    mask = random_mask(shape, device="cuda")
    with pf.use_backend("native"):
        first = pf.clipped_policy_loss(logprobs, old, adv, mask, agg="token-mean")[0]
        first_value = pf.value_loss(logprobs, old, adv, mask, agg="seq-mean-token-mean")[0]
        for _ in range(5):
            assert torch.equal(pf.clipped_policy_loss(logprobs, old, adv, mask, agg="token-mean")[0], first)
            assert torch.equal(pf.value_loss(logprobs, old, adv, mask, agg="seq-mean-token-mean")[0], first_value)


def test_losses_cuda_empty_and_all_masked():
    for shape in ((0, 16), (4, 16)):
        logprobs, old, adv = policy_inputs(shape, torch.float32, device="cuda")
        mask = torch.zeros(shape, dtype=torch.bool, device="cuda")
        loss, stats, grad = _run("native", pf.clipped_policy_loss, logprobs, old, adv, mask, agg="seq-mean-token-mean")
        assert loss.item() == 0.0 and stats["clipfrac"].item() == 0.0
        assert grad.shape == shape and torch.count_nonzero(grad) == 0


def test_losses_cuda_torch_compile(monkeypatch):
    monkeypatch.setenv("PPO_FAST_BACKEND", "native")
    shape = (32, 257)
    logprobs, old, adv = policy_inputs(shape, torch.float32, device="cuda")
    mask = random_mask(shape, device="cuda")

    def step(logp):
        return pf.clipped_policy_loss(logp, old, adv, mask, dual_clip=3.0, agg="seq-mean-token-sum-norm")[0]

    compiled = torch.compile(step, fullgraph=True)
    x = logprobs.clone().requires_grad_(True)
    compiled(x).backward()
    monkeypatch.setenv("PPO_FAST_BACKEND", "reference")
    x_ref = logprobs.clone().requires_grad_(True)
    step(x_ref).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-6)
