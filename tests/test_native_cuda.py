"""Native CUDA loss kernels against ppo_fast.reference on CUDA tensors at real sizes,
forward and backward, plus bitwise determinism.  Skipped without a GPU or without a
CUDA build of the extension."""

import pytest
import torch

import ppo_fast as pf
from ppo_fast.spec import AGG_MODES
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
    kwargs = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip, agg=agg, weights=weights)
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


def _misaligned(t):
    """t's values in a contiguous tensor whose data starts one element past a 16-byte
    boundary: the kernels' scalar path (the same token order as the vector path)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


def _loss_and_grads(inputs, mask, policy):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    with pf.use_backend("native"):
        if policy:
            loss = pf.clipped_policy_loss(*xs, mask, dual_clip=3.0, agg="token-mean")[0]
        else:
            loss = pf.value_loss(*xs, mask, agg="seq-mean-token-mean")[0]
    return (loss, *torch.autograd.grad(loss, xs))


# (512, 2048): the vector path, several warp chunks per row; (333, 1001): rows not a
# multiple of the vector width (scalar path); (3, 1 << 19): long rows, many chunks per row.
@pytest.mark.parametrize("shape", [(512, 2048), (333, 1001), (3, 1 << 19)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_losses_cuda_bitwise_deterministic(shape, dtype):
    logprobs, old, adv = policy_inputs(shape, dtype, device="cuda")
    mask = random_mask(shape, device="cuda")
    for policy in (True, False):
        first = _loss_and_grads((logprobs, old, adv), mask, policy)
        for _ in range(3):
            again = _loss_and_grads((logprobs, old, adv), mask, policy)
            assert all(torch.equal(a, b) for a, b in zip(again, first))
        # Misaligned pointers take the scalar path: the same tokens in the same order.
        scalar = _loss_and_grads(tuple(_misaligned(x) for x in (logprobs, old, adv)), _misaligned(mask), policy)
        assert all(torch.equal(a, b) for a, b in zip(scalar, first))


def test_losses_cuda_launches_at_1m_tokens():
    """At most 2 kernels per forward op and 1 per backward op at 1M tokens."""
    from torch.profiler import ProfilerActivity, profile

    shape = (256, 4096)
    logprobs, old, adv = policy_inputs(shape, torch.bfloat16, device="cuda")
    mask = random_mask(shape, device="cuda")
    ops = torch.ops.ppo_fast
    policy = ops.clipped_policy_loss(logprobs, old, adv, mask, None, 0.2, 0.2, 3.0, "token-mean")
    value = ops.value_loss(logprobs, old, adv, mask, 0.2, "token-mean")
    grad_loss = torch.ones((), device="cuda")
    calls = {
        "policy forward": (2, lambda: ops.clipped_policy_loss(logprobs, old, adv, mask, None, 0.2, 0.2, 3.0, "token-mean")),
        "policy backward": (1, lambda: ops.clipped_policy_loss_backward(
            grad_loss, logprobs, old, adv, mask, None, policy[4], 0.2, 0.2, 3.0, [True, False, False, False])),
        "value forward": (2, lambda: ops.value_loss(logprobs, old, adv, mask, 0.2, "token-mean")),
        "value backward": (1, lambda: ops.value_loss_backward(grad_loss, logprobs, old, adv, mask, value[2], 0.2,
                                                              [True, False, False])),
    }
    for name, (most, call) in calls.items():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert 1 <= len(kernels) <= most, (name, [e.name for e in kernels])


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


# --------------------------------------------------------------------------- every input's gradient, checks, no host sync


def _all_grads(impl, inputs, mask, *args):
    xs = [x.detach().clone().requires_grad_(True) if x is not None else None for x in inputs]
    fn = impl.clipped_policy_loss if len(inputs) == 4 else impl.value_loss
    call = (*xs[:3], mask, xs[3], *args) if len(inputs) == 4 else (*xs, mask, *args)
    loss = fn(*call)[0]
    return loss, torch.autograd.grad(loss, [x for x in xs if x is not None])


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_cuda_gradients_to_every_input(agg, dual_clip):
    from ppo_fast.backends import reference
    from ppo_fast.backends import native as native_backend

    shape = (7, 1000)
    logprobs, old, adv = policy_inputs(shape, torch.float64, device="cuda")
    inputs = (logprobs, old, adv, torch.rand(shape, device="cuda", dtype=torch.float64))
    mask = random_mask(shape, device="cuda")
    args = (0.2, 0.28, dual_clip, agg)
    loss, grads = _all_grads(native_backend, inputs, mask, *args)
    ref_loss, ref_grads = _all_grads(reference, inputs, mask, *args)
    torch.testing.assert_close(loss, ref_loss)
    for g, e in zip(grads, ref_grads):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_cuda_gradients_to_every_input(agg):
    from ppo_fast.backends import reference
    from ppo_fast.backends import native as native_backend

    shape = (7, 1000)
    values = torch.randn(shape, device="cuda", dtype=torch.float64)
    inputs = (values, values + 0.3 * torch.randn_like(values), torch.randn_like(values))
    mask = random_mask(shape, device="cuda")
    loss, grads = _all_grads(native_backend, inputs, mask, 0.2, agg)
    ref_loss, ref_grads = _all_grads(reference, inputs, mask, 0.2, agg)
    torch.testing.assert_close(loss, ref_loss)
    for g, e in zip(grads, ref_grads):
        torch.testing.assert_close(g, e)


def test_losses_cuda_ignore_nonfinite_at_masked_positions():
    from ppo_fast.backends import native as native_backend

    shape = (16, 300)
    logprobs, old, adv = policy_inputs(shape, torch.float32, device="cuda")
    weights = torch.rand(shape, device="cuda")
    mask = random_mask(shape, device="cuda")
    clean = _all_grads(native_backend, (logprobs, old, adv, weights), mask, 0.2, 0.2, 3.0, "token-mean")
    for i in range(4):
        for value in (float("nan"), float("inf")):
            inputs = [logprobs, old, adv, weights]
            inputs[i] = torch.where(mask, inputs[i], value)
            loss, grads = _all_grads(native_backend, inputs, mask, 0.2, 0.2, 3.0, "token-mean")
            assert torch.equal(loss, clean[0])
            for g, e in zip(grads, clean[1]):
                assert torch.equal(g, e)
    values = torch.randn(shape, device="cuda")
    old_values = torch.where(mask, values + 0.3, float("nan"))
    old_values[2, 0] = float("nan")  # row 2 is all valid: NaN propagates
    assert mask[2, 0]
    loss, _ = native_backend.FUNCTIONS["value_loss"](values, old_values, torch.randn_like(values), mask, 0.2, "token-mean")
    assert torch.isnan(loss)


def test_losses_cuda_backward_without_host_sync():
    from ppo_fast.backends import native as native_backend

    shape = (64, 513)
    logprobs, old, adv = policy_inputs(shape, torch.bfloat16, device="cuda")
    inputs = [x.clone().requires_grad_(True) for x in (logprobs, old, adv)]
    mask = random_mask(shape, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, *_ = native_backend.FUNCTIONS["clipped_policy_loss"](*inputs, mask, None, 0.2, 0.2, 3.0, "seq-mean-token-mean")
        value, _ = native_backend.FUNCTIONS["value_loss"](inputs[0], inputs[1], inputs[2], mask, 0.2, "token-mean")
        torch.autograd.grad(loss + value, inputs)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_losses_cuda_check_devices_and_shapes():
    shape = (4, 9)
    logprobs, old, adv = policy_inputs(shape, torch.float32, device="cuda")
    mask = random_mask(shape, device="cuda")
    with pytest.raises(RuntimeError, match="all inputs must be on one device"):
        torch.ops.ppo_fast.clipped_policy_loss(logprobs, old.cpu(), adv, mask, None, 0.2, 0.2, None, "token-mean")
    with pytest.raises(RuntimeError, match="all inputs must be on one device"):
        torch.ops.ppo_fast.value_loss(logprobs, old, adv, mask.cpu(), 0.2, "token-mean")
    with pytest.raises(RuntimeError, match="old_logprobs must have the shape of logprobs"):
        torch.ops.ppo_fast.clipped_policy_loss(logprobs, old[:, :-1], adv, mask, None, 0.2, 0.2, None, "token-mean")
    row_scale = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="grad_loss is on cpu"):  # a CPU scalar would be read on the device
        torch.ops.ppo_fast.clipped_policy_loss_backward(
            torch.tensor(1.0), logprobs, old, adv, mask, None, row_scale, 0.2, 0.2, None, [True, False, False, False]
        )
    with pytest.raises(RuntimeError, match="row_scale must have shape"):
        torch.ops.ppo_fast.value_loss_backward(
            torch.tensor(1.0, device="cuda"), logprobs, old, adv, mask, row_scale[:2], 0.2, [True, True, True]
        )
