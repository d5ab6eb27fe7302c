"""Native (C++) PPO losses on CPU against ppo_fast.reference: forward, stats, backward,
every agg mode, dtypes, masks, weights, dual and asymmetric clip; gradcheck, opcheck,
torch.compile and bitwise determinism."""

import pytest
import torch

import ppo_fast as pf
from ppo_fast import reference
from ppo_fast.reference import AGG_MODES
from test_native_common import ALL_FLOATS, policy_inputs, random_mask, requires_native

pytestmark = requires_native

SHAPES = [(5, 37), (1, 1), (3, 300)]


def _policy_both(logprobs, old, adv, mask, weights, clip_low, clip_high, dual_clip, agg):
    """(loss, stats, grad) from the native public op and from the reference."""
    results = []
    for backend in ("native", "reference"):
        logp = logprobs.detach().clone().requires_grad_(True)
        with pf.use_backend(backend):
            loss, stats = pf.clipped_policy_loss(
                logp, old, adv, mask, clip_eps=clip_low, clip_eps_high=clip_high, dual_clip=dual_clip, agg=agg, weights=weights
            )
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss, stats, grad))
    return results


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_policy_loss_matches_reference(agg, dtype, dual_clip, weighted, shape):
    logprobs, old, adv = policy_inputs(shape, dtype)
    mask = random_mask(shape)
    weights = torch.rand(shape).to(dtype) if weighted else None
    (loss, stats, grad), (ref_loss, ref_stats, ref_grad) = _policy_both(
        logprobs, old, adv, mask, weights, 0.2, 0.28, dual_clip, agg
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name in ("clipfrac", "clipfrac_lower", "approx_kl"):
        torch.testing.assert_close(stats[name], ref_stats[name], rtol=1e-5, atol=1e-6)
        assert not stats[name].requires_grad
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad)


def test_policy_loss_mixed_input_dtypes():
    shape = (4, 19)
    logprobs, old, adv = policy_inputs(shape, torch.float32)
    mask = random_mask(shape)
    weights = torch.rand(shape, dtype=torch.float16)
    (loss, stats, grad), (ref_loss, ref_stats, ref_grad) = _policy_both(
        logprobs.bfloat16(), old, adv.half(), mask, weights, 0.1, 0.3, 2.0, "seq-mean-token-mean"
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["approx_kl"], ref_stats["approx_kl"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_all_masked_is_zero(agg):
    logprobs, old, adv = policy_inputs((3, 7), torch.float32)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    (loss, stats, grad), _ = _policy_both(logprobs, old, adv, mask, None, 0.2, 0.2, None, agg)
    assert loss.item() == 0.0 and stats["clipfrac"].item() == 0.0 and stats["approx_kl"].item() == 0.0
    assert torch.count_nonzero(grad) == 0


def test_policy_loss_empty_batch():
    empty = torch.zeros(0, 5)
    (loss, stats, grad), (ref_loss, _, _) = _policy_both(empty, empty, empty, empty.bool(), None, 0.2, 0.2, None, "seq-mean-token-mean")
    assert loss.item() == ref_loss.item() == 0.0 and grad.shape == (0, 5)


def test_policy_gradient_zero_where_clipped_clamped_or_capped():
    # Row 0: A > 0 and ratio e^1 > 1 + clip: clipped.  Row 1: |log-ratio| > 20: clamped.
    # Row 2: A < 0 and ratio e^2 > dual_clip 3: capped.  Row 3: inside the clip range.
    logprobs = torch.tensor([[1.0], [25.0], [2.0], [0.05]])
    old = torch.zeros(4, 1)
    adv = torch.tensor([[1.0], [1.0], [-1.0], [2.0]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    (_, stats, grad), (_, ref_stats, ref_grad) = _policy_both(logprobs, old, adv, mask, None, 0.2, 0.2, 3.0, "token-sum")
    expected = torch.tensor([[0.0], [0.0], [0.0], [-2.0 * torch.exp(torch.tensor(0.05)).item()]])
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(ref_grad, expected)
    assert stats["clipfrac"].item() == pytest.approx(0.5)  # rows 0 and 1 (the clamped ratio e^20 is clipped too)
    assert stats["clipfrac_lower"].item() == pytest.approx(0.25)


def _value_both(values, old, returns, mask, clip, agg):
    results = []
    for backend in ("native", "reference"):
        v = values.detach().clone().requires_grad_(True)
        with pf.use_backend(backend):
            loss, stats = pf.value_loss(v, old, returns, mask, clip=clip, agg=agg)
        (grad,) = torch.autograd.grad(loss, v)
        results.append((loss, stats, grad))
    return results


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dtype", ALL_FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_value_loss_matches_reference(agg, dtype, shape):
    values = torch.randn(shape).to(dtype)
    old = (values.float() + 0.3 * torch.randn(shape)).to(dtype)
    returns = torch.randn(shape).to(dtype)
    mask = random_mask(shape)
    (loss, stats, grad), (ref_loss, ref_stats, ref_grad) = _value_both(values, old, returns, mask, 0.2, agg)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["clipfrac"], ref_stats["clipfrac"], rtol=1e-5, atol=1e-6)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, ref_grad)


def _away_from_kinks(logprobs, old, clip, dual_clip):
    """Shift log-probs whose ratio lies within 0.02 of a clip bound (where the loss has a kink)."""
    ratio = torch.exp(logprobs - old)
    near = torch.zeros_like(ratio, dtype=torch.bool)
    for bound in (1 - clip, 1 + clip, dual_clip):
        near |= (ratio - bound).abs() < 0.02
    return torch.where(near, logprobs + 0.05, logprobs)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_gradcheck_float64(agg):
    # float64 inputs are computed in float64, so gradcheck's default tolerances hold.
    shape = (3, 6)
    old = -torch.rand(shape, dtype=torch.float64)
    logprobs = _away_from_kinks(old + 0.3 * torch.randn(shape, dtype=torch.float64), old, 0.2, 3.0)
    adv = torch.randn(shape, dtype=torch.float64)
    mask = random_mask(shape)
    weights = torch.rand(shape, dtype=torch.float64)

    def loss_of(logp):
        with pf.use_backend("native"):
            return pf.clipped_policy_loss(logp, old, adv, mask, dual_clip=3.0, agg=agg, weights=weights)[0]

    assert torch.autograd.gradcheck(loss_of, (logprobs.requires_grad_(True),))


def test_value_loss_gradcheck_float64():
    shape = (3, 6)
    old = torch.randn(shape, dtype=torch.float64)
    step = 0.5 * torch.randn(shape, dtype=torch.float64)
    values = old + torch.where((step.abs() - 0.2).abs() < 0.02, step + 0.05, step)  # away from the clip bounds
    returns = torch.randn(shape, dtype=torch.float64)
    mask = random_mask(shape)

    def loss_of(v):
        with pf.use_backend("native"):
            return pf.value_loss(v, old, returns, mask, clip=0.2, agg="seq-mean-token-mean")[0]

    assert torch.autograd.gradcheck(loss_of, (values.requires_grad_(True),))


def test_losses_bitwise_deterministic_across_calls_and_threads():
    shape = (64, 517)
    logprobs, old, adv = policy_inputs(shape, torch.float32)
    mask = random_mask(shape)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (threads, 1, threads):
            torch.set_num_threads(n)
            with pf.use_backend("native"):
                outputs.append(pf.clipped_policy_loss(logprobs, old, adv, mask, agg="token-mean")[0])
                outputs.append(pf.value_loss(logprobs, old, adv, mask, agg="seq-mean-token-sum")[0])
    finally:
        torch.set_num_threads(threads)
    for i in range(2, len(outputs)):
        assert torch.equal(outputs[i], outputs[i % 2])


def test_opcheck_policy_loss():
    shape = (4, 9)
    logprobs, old, adv = policy_inputs(shape, torch.float32)
    mask = random_mask(shape)
    weights = torch.rand(shape)
    for w, dual in ((None, None), (weights, 3.0)):
        args = (logprobs.clone().requires_grad_(True), old, adv, mask, w, 0.2, 0.28, dual, AGG_MODES.index("seq-mean-token-mean"))
        torch.library.opcheck(torch.ops.ppo_fast.clipped_policy_loss, args)


def test_opcheck_value_loss():
    shape = (4, 9)
    values, old, returns = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    args = (values.requires_grad_(True), old, returns, random_mask(shape), 0.2, AGG_MODES.index("token-mean"))
    torch.library.opcheck(torch.ops.ppo_fast.value_loss, args)


def test_torch_compile_fullgraph(monkeypatch):
    monkeypatch.setenv("PPO_FAST_BACKEND", "native")
    shape = (3, 11)
    logprobs, old, adv = policy_inputs(shape, torch.float32)
    values, returns = torch.randn(shape), torch.randn(shape)
    mask = random_mask(shape)

    def step(logp, v):
        policy, stats = pf.clipped_policy_loss(logp, old, adv, mask, dual_clip=3.0, agg="seq-mean-token-mean")
        value, _ = pf.value_loss(v, values, returns, mask, agg="token-mean")
        return policy + 0.5 * value, stats["clipfrac"]

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    logp_c, v_c = logprobs.clone().requires_grad_(True), values.clone().requires_grad_(True)
    total, clipfrac = compiled(logp_c, v_c)
    total.backward()
    monkeypatch.setenv("PPO_FAST_BACKEND", "reference")
    logp_r, v_r = logprobs.clone().requires_grad_(True), values.clone().requires_grad_(True)
    ref_total, ref_clipfrac = step(logp_r, v_r)
    ref_total.backward()
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clipfrac, ref_clipfrac)
    torch.testing.assert_close(logp_c.grad, logp_r.grad)
    torch.testing.assert_close(v_c.grad, v_r.grad)


def test_reference_functions_are_the_oracle():
    # The native functions take the reference's exact signature.
    import inspect

    from ppo_fast.ops import native_backend

    for op in native_backend.SUPPORTED:
        assert list(inspect.signature(getattr(native_backend, op)).parameters) == list(
            inspect.signature(getattr(reference, op)).parameters
        ), op
