"""Native CUDA loss kernels at real sizes: bitwise determinism (vector and scalar paths),
kernel launches per op at 1M tokens, the device guard.  Skipped without a GPU or without a
CUDA build of the extension (values and gradients on CUDA: tests/test_conformance.py's
matrix; no host sync: test_cuda_no_host_sync.py)."""

import pytest
import torch
from test_native_common import NATIVE, policy_inputs, random_mask, requires_native

import ppo_fast as pf

pytestmark = [
    pytest.mark.cuda,
    requires_native,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        NATIVE.available and not NATIVE.module.built_with_cuda(), reason="the extension was built without CUDA kernels"
    ),
]


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
        "policy forward": (
            2,
            lambda: ops.clipped_policy_loss(logprobs, old, adv, mask, None, 0.2, 0.2, 3.0, "token-mean"),
        ),
        "policy backward": (
            1,
            lambda: ops.clipped_policy_loss_backward(
                grad_loss, logprobs, old, adv, mask, None, policy[4], 0.2, 0.2, 3.0, [True, False, False, False]
            ),
        ),
        "value forward": (2, lambda: ops.value_loss(logprobs, old, adv, mask, 0.2, "token-mean")),
        "value backward": (
            1,
            lambda: ops.value_loss_backward(grad_loss, logprobs, old, adv, mask, value[2], 0.2, [True, False, False]),
        ),
    }
    for name, (most, call) in calls.items():
        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert 1 <= len(kernels) <= most, (name, [e.name for e in kernels])


# --------------------------------------------------------------------------- device guard


def _bad_call(case):
    shape = (4, 9)
    logprobs, old, adv = policy_inputs(shape, torch.float32, device="cuda")
    mask = random_mask(shape, device="cuda")
    row_scale = torch.ones(4, device="cuda")
    ops = torch.ops.ppo_fast
    return {
        "policy-input-on-cpu": lambda: ops.clipped_policy_loss(
            logprobs, old.cpu(), adv, mask, None, 0.2, 0.2, None, "token-mean"
        ),
        "value-mask-on-cpu": lambda: ops.value_loss(logprobs, old, adv, mask.cpu(), 0.2, "token-mean"),
        "policy-shape": lambda: ops.clipped_policy_loss(
            logprobs, old[:, :-1], adv, mask, None, 0.2, 0.2, None, "token-mean"
        ),
        "policy-grad-loss-on-cpu": lambda: ops.clipped_policy_loss_backward(  # a CPU scalar read on the device
            torch.tensor(1.0), logprobs, old, adv, mask, None, row_scale, 0.2, 0.2, None, [True, False, False, False]
        ),
        "value-row-scale-shape": lambda: ops.value_loss_backward(
            torch.tensor(1.0, device="cuda"), logprobs, old, adv, mask, row_scale[:2], 0.2, [True, True, True]
        ),
    }[case]


# One case per test: a case that crashes its process names itself.
@pytest.mark.parametrize(
    "case, message",
    [
        ("policy-input-on-cpu", "all inputs must be on one device"),
        ("value-mask-on-cpu", "all inputs must be on one device"),
        ("policy-shape", "old_logprobs must have the shape of logprobs"),
        ("policy-grad-loss-on-cpu", "grad_loss is on cpu"),
        ("value-row-scale-shape", "row_scale must have shape"),
    ],
)
def test_losses_cuda_refuse_bad_inputs(case, message):
    call = _bad_call(case)
    with pytest.raises(RuntimeError, match=message):
        call()
