"""The native ops' autograd node (csrc/common/autograd.h ``LeanFunction``, a leaner node than
``torch::autograd::Function``'s): the rules torch's own Function enforced still hold, on the ops
that use it.  Values and gradients are checked against the reference elsewhere
(test_native_cpu_ops.py, test_conformance.py); here: saved tensors modified in place, a second
backward, a forward-mode tangent, the stats without history, an output saved for the backward
(token_logprobs' entropy), and the gradients of only the inputs that ask for one."""

import pytest
import torch
from test_native_common import requires_native

import ppo_fast as pf

pytestmark = requires_native

OPS = torch.ops.ppo_fast


def _policy(requires=("lp",)):
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(3, 7, generator=g, dtype=torch.float64) for k in ("lp", "old", "adv")}
    for k in requires:
        x[k].requires_grad_()
    mask = torch.rand(3, 7, generator=g) < 0.8
    return x, mask


def _clipped(x, mask):
    return OPS.clipped_policy_loss(x["lp"], x["old"], x["adv"], mask, None, 0.2, 0.28, None, "token-mean")


def test_a_saved_input_modified_in_place_raises():
    x, mask = _policy()
    loss = _clipped(x, mask)[0]
    with torch.no_grad():
        x["old"].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_second_backward_raises_and_retain_graph_repeats_it():
    x, mask = _policy()
    loss = _clipped(x, mask)[0]
    (first,) = torch.autograd.grad(loss, x["lp"], retain_graph=True)
    (again,) = torch.autograd.grad(loss, x["lp"])
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_stats_carry_no_history_and_only_asked_gradients_are_given():
    x, mask = _policy(requires=("lp", "adv"))
    loss, clipfrac, clipfrac_lower, approx_kl, row_scale = _clipped(x, mask)
    assert loss.requires_grad and loss.grad_fn is not None
    for stat in (clipfrac, clipfrac_lower, approx_kl, row_scale):
        assert not stat.requires_grad and stat.grad_fn is None
    loss.backward()
    assert x["lp"].grad is not None and x["adv"].grad is not None and x["old"].grad is None
    want = torch.func.grad(
        lambda lp, adv: pf.backends.reference.clipped_policy_loss(
            lp, x["old"], adv, mask, None, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=None, agg="token-mean"
        )[0],
        argnums=(0, 1),
    )(x["lp"].detach(), x["adv"].detach())
    torch.testing.assert_close(x["lp"].grad, want[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x["adv"].grad, want[1], rtol=1e-12, atol=1e-14)


def test_a_forward_mode_tangent_raises():
    import torch.autograd.forward_ad as fwAD

    x, mask = _policy(requires=())
    with fwAD.dual_level():
        dual = fwAD.make_dual(x["lp"], torch.ones_like(x["lp"]))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            OPS.kl_estimate(dual, x["old"], "k3")


def test_an_output_saved_for_the_backward():
    """token_logprobs saves its entropy output: the entropy's gradient flows, and modifying it in place after
    the forward is caught as for any saved tensor."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 9, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 9, (2, 5), generator=g)
    lp, entropy = pf.token_logprobs(logits, labels, return_entropy=True)
    (lp.sum() + 0.5 * entropy.sum()).backward()
    ref_lp, ref_entropy = pf.backends.reference.token_logprobs(logits, labels, 1.0, True, -100)
    (want,) = torch.autograd.grad(ref_lp.sum() + 0.5 * ref_entropy.sum(), logits)
    torch.testing.assert_close(logits.grad, want, rtol=1e-12, atol=1e-14)
    lp, entropy = pf.token_logprobs(logits, labels, return_entropy=True)
    with torch.no_grad():
        entropy.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + entropy.sum()).backward()
