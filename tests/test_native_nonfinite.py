"""The contract's non-finite rule for every native CPU op (ppo_fast.contract): a value at
a masked position (mask False, or a label equal to ignore_index) is never read into a
result or a gradient, so NaN/inf there changes nothing; NaN (or inf) at a valid position
propagates as in the reference, whose torch.maximum / torch.minimum / torch.clamp
propagate NaN (results and gradients have the reference's NaN pattern).

Poison at masked positions is compared with the same op on clean inputs (bitwise: the
valid tokens' arithmetic is unchanged) and with the reference on the clean inputs."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_fast.backends import reference
from ppo_fast.spec import KL_ESTIMATORS
from ppo_fast.backends import native as native_backend
from test_native_common import policy_inputs, random_holes_mask, requires_native

pytestmark = requires_native

POISON = (math.nan, math.inf, -math.inf)
SHAPE = (4, 13)


def _poisoned(x, where, value):
    x = x.clone()
    x[where] = value
    return x


def _run(fn, inputs, differentiable, out_weights):
    """Outputs of fn(*inputs) and the gradients of sum_k (outputs[k] * out_weights[k]).sum()
    w.r.t. the inputs at the indices in `differentiable`."""
    inputs = list(inputs)
    for i in differentiable:
        inputs[i] = inputs[i].detach().clone().requires_grad_(True)
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = sum((o.double() * w).sum() for o, w in zip(outputs, out_weights) if w is not None)
    grads = torch.autograd.grad(total, [inputs[i] for i in differentiable], allow_unused=True)
    return [o.detach() for o in outputs], list(grads)


def _assert_equal(got, expected, exact):
    for g, e in zip(got, expected):
        if e is None or g is None:
            assert e is None or torch.count_nonzero(e) == 0
            assert g is None or torch.count_nonzero(g) == 0
            continue
        if exact:
            assert torch.equal(g.isnan(), e.isnan()) and torch.equal(g.nan_to_num(), e.nan_to_num()), (g, e)
        else:
            torch.testing.assert_close(g, e, equal_nan=True, rtol=1e-5, atol=1e-6)


def _check_masked_poison(native_fn, reference_fn, clean, poison_index, where, differentiable, out_weights):
    """NaN/inf at the masked positions `where` of input `poison_index` changes nothing."""
    expected = _run(native_fn, clean, differentiable, out_weights)
    ref = _run(reference_fn, clean, differentiable, out_weights)
    _assert_equal(expected[0], ref[0], exact=False)
    _assert_equal(expected[1], ref[1], exact=False)
    for value in POISON:
        inputs = list(clean)
        inputs[poison_index] = _poisoned(clean[poison_index], where, value)
        got = _run(native_fn, inputs, differentiable, out_weights)
        _assert_equal(got[0], expected[0], exact=True)
        _assert_equal(got[1], expected[1], exact=True)


def _check_valid_poison(native_fn, reference_fn, clean, poison_index, where, differentiable, out_weights, values=POISON):
    """NaN/inf at the valid positions `where` of input `poison_index`: the reference's results and gradients."""
    for value in values:
        inputs = list(clean)
        inputs[poison_index] = _poisoned(clean[poison_index], where, value)
        got = _run(native_fn, inputs, differentiable, out_weights)
        expected = _run(reference_fn, inputs, differentiable, out_weights)
        _assert_equal(got[0], expected[0], exact=False)
        _assert_equal(got[1], expected[1], exact=False)
        if value != value:  # NaN reaches the results it feeds
            assert any(torch.isnan(o).any() for o in got[0])


def _valid_positions(mask):
    """Two valid positions: the first of row 2 (a full row) and an interior one."""
    where = torch.zeros_like(mask)
    valid = mask.nonzero()
    where[2, 0] = True
    where[tuple(valid[len(valid) // 2])] = True
    assert (mask | ~where).all()
    return where


# --------------------------------------------------------------------------- losses

POLICY_INPUTS = ("logprobs", "old_logprobs", "advantages", "weights")


def _policy_fns(agg, dual_clip):
    def native(logp, old, adv, w, mask):
        return native_backend.FUNCTIONS["clipped_policy_loss"](logp, old, adv, mask, w, 0.2, 0.28, dual_clip, agg)

    def ref(logp, old, adv, w, mask):
        return reference.clipped_policy_loss(logp, old, adv, mask, w, 0.2, 0.28, dual_clip, agg)

    return native, ref


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("poisoned", POLICY_INPUTS)
def test_policy_loss_ignores_nonfinite_at_masked_positions(agg, dual_clip, poisoned):
    mask = random_holes_mask(SHAPE)
    clean = (*policy_inputs(SHAPE, torch.float32), torch.rand(SHAPE), mask)
    native, ref = _policy_fns(agg, dual_clip)
    _check_masked_poison(native, ref, clean, POLICY_INPUTS.index(poisoned), ~mask, range(4), (1.0, 1.0, 1.0, 1.0))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("poisoned", POLICY_INPUTS)
def test_policy_loss_propagates_nonfinite_at_valid_positions_as_the_reference(agg, dual_clip, poisoned):
    mask = random_holes_mask(SHAPE)
    logprobs, old, adv = policy_inputs(SHAPE, torch.float32)
    adv[2, 0] = -abs(adv[2, 0].item())  # A < 0 at a poisoned token: the dual clip's minimum sees it
    clean = (logprobs, old, adv, torch.rand(SHAPE), mask)
    native, ref = _policy_fns(agg, dual_clip)
    _check_valid_poison(native, ref, clean, POLICY_INPUTS.index(poisoned), _valid_positions(mask), range(4), (1.0, 1.0, 1.0, 1.0))


VALUE_INPUTS = ("values", "old_values", "returns")


def _value_fns(agg):
    def native(v, old, ret, mask):
        return native_backend.FUNCTIONS["value_loss"](v, old, ret, mask, 0.2, agg)

    def ref(v, old, ret, mask):
        return reference.value_loss(v, old, ret, mask, 0.2, agg)

    return native, ref


def _value_clean(mask):
    values = torch.randn(SHAPE)
    return values, values + 0.3 * torch.randn(SHAPE), torch.randn(SHAPE), mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("poisoned", VALUE_INPUTS)
def test_value_loss_ignores_nonfinite_at_masked_positions(agg, poisoned):
    mask = random_holes_mask(SHAPE)
    native, ref = _value_fns(agg)
    _check_masked_poison(native, ref, _value_clean(mask), VALUE_INPUTS.index(poisoned), ~mask, range(3), (1.0, 1.0))


@pytest.mark.parametrize("agg", ["token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("poisoned", VALUE_INPUTS)
def test_value_loss_propagates_nonfinite_at_valid_positions_as_the_reference(agg, poisoned):
    # NaN in old_values: clip(V) is NaN, so max((V - R)^2, NaN) is NaN (a ternary max would drop it).
    mask = random_holes_mask(SHAPE)
    native, ref = _value_fns(agg)
    _check_valid_poison(native, ref, _value_clean(mask), VALUE_INPUTS.index(poisoned), _valid_positions(mask), range(3), (1.0, 1.0))


def test_value_loss_nan_old_value_reaches_the_loss():
    values, old, returns = torch.zeros(1, 2), torch.tensor([[math.nan, 0.0]]), torch.ones(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, _ = native_backend.FUNCTIONS["value_loss"](values, old, returns, mask, 0.2, "token-mean")
    assert math.isnan(loss.item()) and math.isnan(reference.value_loss(values, old, returns, mask, 0.2, "token-mean")[0].item())


# --------------------------------------------------------------------------- KL, rewards, GAE


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("poisoned", [0, 1])
def test_kl_estimate_nonfinite_as_the_reference(estimator, poisoned):
    # No mask: every position is valid.
    logprobs = -3 * torch.rand(SHAPE)
    clean = (logprobs, logprobs + torch.randn(SHAPE))
    where = torch.rand(SHAPE) < 0.2

    def native(x, r):
        return native_backend.FUNCTIONS["kl_estimate"](x, r, estimator)

    def ref(x, r):
        return reference.kl_estimate(x, r, estimator)

    _check_valid_poison(native, ref, clean, poisoned, where, (0, 1), (torch.randn(SHAPE, dtype=torch.float64),))


def _rewards_fns(estimator):
    def native(scores, x, r, mask):
        return native_backend.FUNCTIONS["kl_penalized_rewards"](scores, x, r, mask, 0.1, estimator)

    def ref(scores, x, r, mask):
        return reference.kl_penalized_rewards(scores, x, r, mask, 0.1, estimator)

    return native, ref


def _rewards_clean(mask):
    logprobs = -3 * torch.rand(SHAPE)
    return torch.randn(SHAPE[0]), logprobs, logprobs + torch.randn(SHAPE), mask


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("poisoned", [1, 2])
def test_kl_penalized_rewards_ignore_nonfinite_at_masked_positions(estimator, poisoned):
    mask = random_holes_mask(SHAPE)
    native, ref = _rewards_fns(estimator)
    weights = (torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64))
    _check_masked_poison(native, ref, _rewards_clean(mask), poisoned, ~mask, (0, 1, 2), weights)


def test_kl_penalized_rewards_ignore_the_score_of_a_row_without_valid_tokens():
    mask = random_holes_mask(SHAPE)  # row 0 has no valid token
    native, ref = _rewards_fns("k1")
    weights = (torch.randn(SHAPE, dtype=torch.float64), None)
    empty_row = torch.tensor([True, False, False, False])
    _check_masked_poison(native, ref, _rewards_clean(mask), 0, empty_row, (0, 1, 2), weights)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("poisoned", [0, 1, 2])
def test_kl_penalized_rewards_propagate_nonfinite_at_valid_positions_as_the_reference(estimator, poisoned):
    mask = random_holes_mask(SHAPE)
    native, ref = _rewards_fns(estimator)
    weights = (torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64))
    where = torch.tensor([False, False, True, True]) if poisoned == 0 else _valid_positions(mask)
    _check_valid_poison(native, ref, _rewards_clean(mask), poisoned, where, (0, 1, 2), weights)


def _gae_fns():
    def native(r, v, mask):
        return native_backend.FUNCTIONS["gae"](r, v, mask, 0.99, 0.95)

    def ref(r, v, mask):
        return reference.gae(r, v, mask, 0.99, 0.95)

    return native, ref


@pytest.mark.parametrize("poisoned", [0, 1])
def test_gae_ignores_nonfinite_at_masked_positions(poisoned):
    mask = random_holes_mask(SHAPE)
    clean = (torch.randn(SHAPE), torch.randn(SHAPE), mask)
    weights = (torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64))
    _check_masked_poison(*_gae_fns(), clean, poisoned, ~mask, (0, 1), weights)


@pytest.mark.parametrize("poisoned", [0, 1])
def test_gae_propagates_nonfinite_at_valid_positions_as_the_reference(poisoned):
    mask = random_holes_mask(SHAPE)
    clean = (torch.randn(SHAPE), torch.randn(SHAPE), mask)
    weights = (torch.randn(SHAPE, dtype=torch.float64), torch.randn(SHAPE, dtype=torch.float64))
    _check_valid_poison(*_gae_fns(), clean, poisoned, _valid_positions(mask), (0, 1), weights)


# --------------------------------------------------------------------------- token_logprobs


def _logprobs_fns(return_entropy):
    def native(logits, labels):
        logp, entropy = native_backend.FUNCTIONS["token_logprobs"](logits, labels, 0.9, return_entropy, -100)
        return (logp, entropy) if return_entropy else logp

    def ref(logits, labels):
        logp, entropy = reference.token_logprobs(logits, labels, 0.9, return_entropy, -100)
        return (logp, entropy) if return_entropy else logp

    return native, ref


@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs_ignore_nonfinite_logits_of_ignored_rows(return_entropy):
    logits, labels = torch.randn(6, 40), torch.randint(0, 40, (6,))
    labels[[1, 4]] = -100
    rows = torch.zeros(6, 40, dtype=torch.bool)
    rows[[1, 4]] = True
    weights = (torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64) if return_entropy else None)
    _check_masked_poison(*_logprobs_fns(return_entropy), (logits, labels), 0, rows, (0,), weights)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_token_logprobs_nonfinite_logits_as_the_reference(return_entropy):
    logits, labels = torch.randn(6, 40), torch.randint(0, 40, (6,))
    where = torch.zeros(6, 40, dtype=torch.bool)
    where[2, 7] = True  # one logit of row 2
    where[5, labels[5]] = True  # the chosen logit of row 5
    weights = (torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64) if return_entropy else None)
    # +inf logits make the reference's softmax NaN; the native rows are NaN there too.
    _check_valid_poison(*_logprobs_fns(return_entropy), (logits, labels), 0, where, (0,), weights)
