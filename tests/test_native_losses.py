"""Native (C++) PPO losses on CPU against ppo_fast.reference: forward, stats, backward
(w.r.t. every input that requires grad, with the reference's autograd conventions at
ties), every agg mode, dtypes, masks, weights, dual and asymmetric clip; gradcheck,
opcheck of the forward and backward ops, torch.compile and bitwise determinism."""

import pytest
import torch
from test_native_common import leaves, policy_inputs, random_holes_mask, random_mask, requires_native

import ppo_fast as pf
from ppo_fast.backends import native as native_backend
from ppo_fast.backends import reference

pytestmark = requires_native

SHAPES = [(5, 37), (1, 1), (3, 300)]


def _policy_both(logprobs, old, adv, mask, weights, clip_low, clip_high, dual_clip, agg):
    """(loss, stats, grad) from the native public op and from the reference."""
    results = []
    for backend in ("native", "reference"):
        logp = logprobs.detach().clone().requires_grad_(True)
        with pf.use_backend(backend):
            loss, stats = pf.clipped_policy_loss(
                logp,
                old,
                adv,
                mask,
                clip_eps_low=clip_low,
                clip_eps_high=clip_high,
                dual_clip=dual_clip,
                agg=agg,
                weights=weights,
            )
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss, stats, grad))
    return results


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


def test_policy_gradient_zero_where_clipped_clamped_or_capped():
    # Row 0: A > 0 and ratio e^1 > 1 + clip: clipped.  Row 1: |log-ratio| > 20: clamped.
    # Row 2: A < 0 and ratio e^2 > dual_clip 3: capped.  Row 3: inside the clip range.
    logprobs = torch.tensor([[1.0], [25.0], [2.0], [0.05]])
    old = torch.zeros(4, 1)
    adv = torch.tensor([[1.0], [1.0], [-1.0], [2.0]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    (_, stats, grad), (_, ref_stats, ref_grad) = _policy_both(
        logprobs, old, adv, mask, None, 0.2, 0.2, 3.0, "token-sum"
    )
    expected = torch.tensor([[0.0], [0.0], [0.0], [-2.0 * torch.exp(torch.tensor(0.05)).item()]])
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(ref_grad, expected)
    assert stats["clipfrac"].item() == pytest.approx(0.5)  # rows 0 and 1 (the clamped ratio e^20 is clipped too)
    assert stats["clipfrac_lower"].item() == pytest.approx(0.25)


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


# --------------------------------------------------------------------------- gradients w.r.t. every input


def _policy_grads(impl, inputs, mask, clip_low, clip_high, dual_clip, agg, requires=(True, True, True, True)):
    """(loss, stats, grads) of impl.clipped_policy_loss with the inputs (logprobs, old,
    advantages, weights) that `requires` selects as leaves."""
    leaves_ = [x.detach().clone().requires_grad_(r) if x is not None else None for x, r in zip(inputs, requires)]
    logp, old, adv, w = leaves_
    loss, clipfrac, clipfrac_lower, approx_kl = impl.FUNCTIONS["clipped_policy_loss"](
        logp, old, adv, mask, w, clip_low, clip_high, dual_clip, agg
    )
    wrt = [x for x, r in zip(leaves_, requires) if x is not None and r]
    grads = torch.autograd.grad(loss, wrt) if wrt else ()
    return loss, (clipfrac, clipfrac_lower, approx_kl), grads


def _assert_grads_close(grads, ref_grads, inputs):
    for g, e, x in zip(grads, ref_grads, inputs):
        assert g.dtype == x.dtype and g.shape == x.shape
        tol = {"rtol": 1e-5, "atol": 1e-6} if x.dtype in (torch.float32, torch.float64) else {}
        torch.testing.assert_close(g, e, **tol)


@pytest.mark.parametrize(
    "requires",
    [
        (False, True, False, False),
        (False, False, True, False),
        (False, False, False, True),
        (True, False, True, False),
        (False, True, True, True),
    ],
)
def test_policy_loss_gradients_only_where_asked(requires):
    shape = (3, 11)
    inputs = (*policy_inputs(shape, torch.float32), torch.rand(shape, dtype=torch.float16))
    mask = random_holes_mask(shape)
    _, _, grads = _policy_grads(native_backend, inputs, mask, 0.2, 0.2, 2.0, "seq-mean-token-mean", requires)
    _, _, ref_grads = _policy_grads(reference, inputs, mask, 0.2, 0.2, 2.0, "seq-mean-token-mean", requires)
    assert len(grads) == sum(requires)
    _assert_grads_close(grads, ref_grads, [x for x, r in zip(inputs, requires) if r])


def test_policy_loss_mixed_dtypes_give_each_gradient_its_dtype():
    shape = (4, 19)
    logprobs, old, adv = policy_inputs(shape, torch.float32)
    inputs = (logprobs.bfloat16(), old, adv.half(), torch.rand(shape, dtype=torch.float64))
    mask = random_holes_mask(shape)
    loss, _, grads = _policy_grads(native_backend, inputs, mask, 0.1, 0.3, 2.0, "token-mean")
    _, _, ref_grads = _policy_grads(reference, inputs, mask, 0.1, 0.3, 2.0, "token-mean")
    assert loss.dtype == torch.float64
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float16, torch.float64]
    _assert_grads_close(grads, ref_grads, inputs)


def test_policy_loss_tie_conventions_match_reference():
    # Row 0: A = 0 with the ratio clipped (unclipped == clipped: the A gradient is split).
    # Row 1: the dual-clip cap equals pg (ratio 1, dual_clip 1): minimum splits the gradient.
    # Row 2: ratio inside the clip range (unclipped == clipped).
    logprobs = torch.tensor([[1.0], [0.0], [0.1]], dtype=torch.float64)
    old = torch.zeros(3, 1, dtype=torch.float64)
    adv = torch.tensor([[0.0], [-1.0], [0.7]], dtype=torch.float64)
    inputs = (logprobs, old, adv, torch.full((3, 1), 0.5, dtype=torch.float64))
    mask = torch.ones(3, 1, dtype=torch.bool)
    _, _, grads = _policy_grads(native_backend, inputs, mask, 0.2, 0.2, 1.0, "token-sum")
    _, _, ref_grads = _policy_grads(reference, inputs, mask, 0.2, 0.2, 1.0, "token-sum")
    for g, e in zip(grads, ref_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=0)
    e = torch.exp(torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(grads[2][0, 0], -0.5 * (e + 1.2) * 0.5)  # weight 0.5
    torch.testing.assert_close(grads[0][1, 0], torch.tensor(0.25, dtype=torch.float64))  # half of w * -A * ratio


def test_policy_loss_log_ratio_clamp_passes_gradient_on_its_closed_range():
    # clamp(logp - old, -20, 20) passes the gradient at exactly +-20 (and not beyond).
    logprobs = torch.tensor([[20.0], [-20.0], [20.5]], dtype=torch.float64)
    old = torch.zeros(3, 1, dtype=torch.float64)
    adv = torch.tensor([[-1.0], [1.0], [-1.0]], dtype=torch.float64)  # the unclipped term wins
    inputs = (logprobs, old, adv, None)
    mask = torch.ones(3, 1, dtype=torch.bool)
    _, _, (grad_logp, grad_old, grad_adv) = _policy_grads(
        native_backend, inputs, mask, 0.2, 0.2, None, "token-sum", (True, True, True, False)
    )
    ratio = torch.exp(torch.tensor([20.0, -20.0, 20.0], dtype=torch.float64))
    torch.testing.assert_close(grad_logp[:, 0], -adv[:, 0] * ratio * torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(grad_old, -grad_logp)
    torch.testing.assert_close(grad_adv[:, 0], -ratio)


def _value_grads(impl, inputs, mask, clip, agg, requires=(True, True, True)):
    leaves_ = [x.detach().clone().requires_grad_(r) for x, r in zip(inputs, requires)]
    loss, clipfrac = impl.FUNCTIONS["value_loss"](*leaves_, mask, clip, agg)
    wrt = [x for x, r in zip(leaves_, requires) if r]
    return loss, clipfrac, torch.autograd.grad(loss, wrt)


def _value_inputs(shape, dtype=torch.float32):
    values = torch.randn(shape)
    old = values + 0.3 * torch.randn(shape)
    returns = torch.randn(shape)
    return values.to(dtype), old.to(dtype), returns.to(dtype)


@pytest.mark.parametrize(
    "requires", [(False, True, False), (False, False, True), (True, False, True), (False, True, True)]
)
def test_value_loss_gradients_only_where_asked(requires):
    shape = (3, 11)
    inputs = _value_inputs(shape)
    mask = random_holes_mask(shape)
    _, _, grads = _value_grads(native_backend, inputs, mask, 0.2, "token-mean", requires)
    _, _, ref_grads = _value_grads(reference, inputs, mask, 0.2, "token-mean", requires)
    assert len(grads) == sum(requires)
    _assert_grads_close(grads, ref_grads, [x for x, r in zip(inputs, requires) if r])


def test_value_loss_tie_conventions_match_reference():
    # V exactly at V_old + clip and at V_old - clip (minimum / maximum ties), V == R, V inside the range.
    values = torch.tensor([[0.5], [-0.5], [0.25], [1.0]], dtype=torch.float64)
    old = torch.tensor([[0.0], [0.0], [0.0], [0.5]], dtype=torch.float64)
    returns = torch.tensor([[2.0], [-2.0], [0.25], [3.0]], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    _, _, grads = _value_grads(native_backend, (values, old, returns), mask, 0.5, "token-sum")
    _, _, ref_grads = _value_grads(reference, (values, old, returns), mask, 0.5, "token-sum")
    for g, e in zip(grads, ref_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=0)


def test_loss_backward_ops_return_empty_tensors_for_unrequested_gradients():
    shape = (3, 5)
    logprobs, old, adv = policy_inputs(shape, torch.float32)
    mask, row_scale = random_mask(shape), torch.ones(3)
    grads = torch.ops.ppo_fast.clipped_policy_loss_backward(
        torch.tensor(1.0), logprobs, old, adv, mask, None, row_scale, 0.2, 0.2, None, [False, True, False, True]
    )
    assert [g.numel() for g in grads] == [0, 15, 0, 0]  # no weights: no weight gradient either
    grads = torch.ops.ppo_fast.value_loss_backward(
        torch.tensor(1.0), logprobs, old, adv, mask, row_scale, 0.2, [False, False, True]
    )
    assert [g.numel() for g in grads] == [0, 0, 15]


def test_loss_stats_are_not_differentiable():
    shape = (3, 5)
    logprobs, old, adv = leaves(*policy_inputs(shape, torch.float32))
    outputs = torch.ops.ppo_fast.clipped_policy_loss(
        logprobs, old, adv, random_mask(shape), None, 0.2, 0.2, None, "token-mean"
    )
    assert outputs[0].requires_grad and not any(o.requires_grad for o in outputs[1:])
    outputs = torch.ops.ppo_fast.value_loss(logprobs, old, adv, random_mask(shape), 0.2, "token-mean")
    assert outputs[0].requires_grad and not any(o.requires_grad for o in outputs[1:])


def test_reference_functions_are_the_oracle():
    # The native functions take the reference's exact signature.
    import inspect

    from ppo_fast.backends import native as native_backend

    for op in native_backend.SUPPORTED:
        assert list(inspect.signature(native_backend.FUNCTIONS[op]).parameters) == list(
            inspect.signature(reference.FUNCTIONS[op]).parameters
        ), op
