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


# The packed layout: a long tail (one long sequence, many short ones, empty ones) at real sizes.
PACKED_LENGTHS = [40_000, 0, 1, *([3] * 500), *range(7, 2_000, 97), 0]


def _packed_call(name):
    if name == "value_loss":
        return lambda v, o, r, m, **kw: pf.value_loss(v, o, r, m, agg="seq-mean-token-sum-norm", **kw)[0]
    mode = pf.policy_loss_modes()[name]
    return lambda lp, old, adv, m, **kw: pf.policy_loss(
        lp, old, adv, m, loss_mode=name, agg="seq-mean-token-mean", **mode.example_params(), **kw
    )[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["value_loss", "gspo", "geo_mean"])
def test_packed_losses_cuda_equal_the_cpu_kernels(name, dtype):
    """The CUDA segmented kernels (value_loss_varlen, policy_loss_*_varlen) against the native CPU
    ones on the same packed tokens (the CPU's, in turn, equal the padded kernels bit for bit:
    tests/test_varlen.py), value and every gradient, with and without max_seqlen, bitwise
    deterministic on CUDA; the padded detour is never taken."""
    from ppo_fast import _varlen

    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    tokens = sum(PACKED_LENGTHS)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
    lp, old = (-torch.rand(tokens, generator=g, dtype=dtype) * 3 for _ in range(2))
    inputs = [lp, old, torch.randn(tokens, generator=g, dtype=dtype)]
    mask = torch.rand(tokens, generator=g) > 0.2
    call = _packed_call(name)

    def run(device, **kw):
        xs = [x.to(device).requires_grad_(True) for x in inputs]
        with pf.use_backend("native"):
            loss = call(*xs, mask.to(device), cu_seqlens=cu.to(device), **kw)
        grads = torch.autograd.grad(loss, [x for x in xs if x.requires_grad], allow_unused=True)
        return [t.cpu() for t in (loss, *grads) if t is not None]

    want = run("cpu")
    layout_of = _varlen.Layout.of
    _varlen.Layout.of = lambda *a, **k: pytest.fail("the packed CUDA loss took the padded detour")
    try:
        got = [run("cuda"), run("cuda"), run("cuda", max_seqlen=max(PACKED_LENGTHS))]
    finally:
        _varlen.Layout.of = layout_of
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    for h, w in zip(got[0], want, strict=True):
        torch.testing.assert_close(h, w, **tol)
    for other in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, got[0], strict=True))


@pytest.mark.parametrize("given", [False, True])
def test_packed_gae_triton_cuda_equals_its_padded_kernel(given):
    """The Triton segmented scan on CUDA against the padded kernel at the valid tokens: bit for bit with
    max_seqlen (the same chunks); without it (1024-token chunks, the bound found on the device) bit
    for bit against the padded kernel at 1024-token chunks."""
    pytest.importorskip("triton")
    from ppo_fast.backends.triton import gae as tgae

    g = torch.Generator().manual_seed(0)
    lengths = [3000, 0, 1, *([5] * 300), *range(2, 900, 37)]
    tokens, width = sum(lengths), max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    valid = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).cuda()
    rewards, values = (torch.randn(tokens, generator=g).cuda() for _ in range(2))
    mask = (torch.rand(tokens, generator=g) > 0.2).cuda()

    def pad(x):
        out = x.new_zeros(valid.shape)
        out[valid] = x
        return out

    max_seqlen = width if given else None
    got = tgae.gae_varlen_forward(rewards, values, mask, cu, 0.99, 0.95, max_seqlen=max_seqlen)
    block = tgae.varlen_block(max_seqlen)
    want = tgae.gae_forward(pad(rewards), pad(values), pad(mask), 0.99, 0.95, block_t=block)
    for h, w in zip(got, want, strict=True):
        assert torch.equal(h, w[valid])
    grads = tgae.gae_varlen_backward(
        rewards, values, mask, cu, 0.99, 0.95, dtypes=(torch.float32, torch.float32), max_seqlen=max_seqlen
    )
    padded = (pad(rewards), pad(values), pad(mask))
    want = tgae.gae_backward(
        *padded, 0.99, 0.95, rewards_dtype=torch.float32, values_dtype=torch.float32, block_t=block
    )
    for h, w in zip(grads, want, strict=True):
        assert torch.equal(h, w[valid])
