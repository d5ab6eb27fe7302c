"""Triton fused log-softmax + gather (``token_logprobs``) against the reference, forward and backward.

On a CPU-only machine the kernels run under the Triton interpreter (conftest sets
TRITON_INTERPRET=1), so shapes stay small.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

import ppo_fast as pf  # noqa: E402
from ppo_fast.backends import backend_info, resolved_backend_name  # noqa: E402
from ppo_fast.backends.triton import token_logprobs as triton_token_logprobs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
# (forward rtol/atol on the float32 outputs, gradient rtol/atol in the logits' dtype)
TOLERANCES = {
    torch.float32: ((1e-5, 1e-5), (1e-5, 1e-6)),
    torch.float16: ((1e-5, 1e-5), (1e-3, 1e-5)),
    torch.bfloat16: ((1e-5, 1e-5), (1.6e-2, 1e-5)),
}


def test_backend_is_available_and_registered():
    available, detail = backend_info("triton").available, backend_info("triton").detail
    assert available, detail  # triton imports here, so a failure is a bug, not a skip
    module = backend_info("triton").module
    for op in ("token_logprobs", "kl_estimate", "kl_penalized_rewards", "gae"):
        assert "cuda" in module.SUPPORTED[op]
        assert ("cpu" in module.SUPPORTED[op]) == (not torch.cuda.is_available())
    # The interpreter is for tests: auto never picks triton for CPU tensors.
    assert resolved_backend_name("token_logprobs", "cpu") != "triton"


def _logprobs_and_grads(backend, leaf, view, labels, weights, **kwargs):
    """Outputs of ``token_logprobs(view(leaf), ...)`` and the gradient of a weighted sum w.r.t. ``leaf``."""
    leaf = leaf.detach().clone().requires_grad_()
    with pf.use_backend(backend):
        out = pf.token_logprobs(view(leaf), labels, **kwargs)
    logp, entropy = out if kwargs.get("return_entropy") else (out, None)
    loss = (logp * weights[0]).sum() + (0 if entropy is None else (entropy * weights[1]).sum())
    loss.backward()
    return logp.detach(), (None if entropy is None else entropy.detach()), leaf.grad


def _compare_with_reference(leaf, view, labels, **kwargs):
    lead_shape = labels.shape
    weights = (torch.randn(lead_shape, device=DEVICE), torch.randn(lead_shape, device=DEVICE))
    fwd_tol, grad_tol = TOLERANCES[leaf.dtype]
    expected = _logprobs_and_grads("reference", leaf, view, labels, weights, **kwargs)
    actual = _logprobs_and_grads("triton", leaf, view, labels, weights, **kwargs)
    for name, a, e in zip(("logp", "entropy"), actual[:2], expected[:2]):
        if e is not None:
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, e, rtol=fwd_tol[0], atol=fwd_tol[1], msg=name)
    assert actual[2].dtype == leaf.dtype
    torch.testing.assert_close(actual[2], expected[2], rtol=grad_tol[0], atol=grad_tol[1])
    return actual


def _labels(shape, vocab, ignore_fraction=0.25):
    labels = torch.randint(0, vocab, shape, device=DEVICE)
    ignored = torch.rand(shape, device=DEVICE) < ignore_fraction
    return torch.where(ignored, IGNORE, labels)


def test_forward_reads_the_slice_without_copying(monkeypatch):
    full = torch.randn(2, 4, 9, device=DEVICE)
    sliced = full[:, :-1]
    seen = {}
    original = triton_token_logprobs.token_logprobs_forward

    def spy(logits, *args, **kwargs):
        seen["ptr"], seen["shape"] = logits.data_ptr(), tuple(logits.shape)
        return original(logits, *args, **kwargs)

    monkeypatch.setattr(triton_token_logprobs, "token_logprobs_forward", spy)
    with pf.use_backend("triton"):
        pf.token_logprobs(sliced, torch.zeros(2, 3, dtype=torch.long, device=DEVICE))
    assert seen == {"ptr": full.data_ptr(), "shape": (2, 3, 9)}


@pytest.mark.parametrize("block_v", [16, 64])
def test_small_vocab_blocks_match_reference(block_v):
    """Many BLOCK_V iterations per row (the online max / sum-exp across blocks), forward and backward."""
    logits = 4 * torch.randn(6, 203, device=DEVICE)
    logits[0, :150] -= 30.0  # the running max changes late in the row
    labels = _labels((6,), 203)
    logp, entropy, stats = triton_token_logprobs.token_logprobs_forward(
        logits, labels, 0.9, True, IGNORE, block_v=block_v
    )
    with pf.use_backend("reference"):
        ref_logp, ref_entropy = pf.token_logprobs(
            logits, labels, temperature=0.9, return_entropy=True, ignore_index=IGNORE
        )
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    # Ignored rows read no logits, so they have no stats.
    valid = labels != IGNORE
    # stats: the row's max logit and log(sum(exp((logits - max) / T))), whose sum with max / T is the logsumexp
    lse = stats[..., 0] / 0.9 + stats[..., 1]
    torch.testing.assert_close(lse[valid], torch.logsumexp(logits / 0.9, -1)[valid], rtol=1e-6, atol=1e-5)

    g_logp, g_entropy = torch.randn(6, device=DEVICE), torch.randn(6, device=DEVICE)
    grad = triton_token_logprobs.token_logprobs_backward(
        g_logp, g_entropy, logits, labels, stats, entropy, 0.9, IGNORE, block_v=block_v
    )
    leaf = logits.clone().requires_grad_()
    with pf.use_backend("reference"):
        ref_logp, ref_entropy = pf.token_logprobs(
            leaf, labels, temperature=0.9, return_entropy=True, ignore_index=IGNORE
        )
    ((ref_logp * g_logp).sum() + (ref_entropy * g_entropy).sum()).backward()
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab, group", [(64, 8), (68, 4), (66, 2), (67, 1)])
def test_bf16_pairs_read_as_words_match_reference(vocab, group):
    """bf16 rows read as 32-bit words (two logits each) in 8-, 4- and 2-wide groups, and the
    element path of an odd V: whole blocks and the tail, forward and both gradients."""
    from ppo_fast.backends.triton.token_logprobs import _group

    logits = (3 * torch.randn(5, vocab, device=DEVICE)).bfloat16()
    logits[1, 5] = float("-inf")
    assert _group(16, 1, (logits, vocab, 0)) == group
    labels = _labels((5,), vocab)
    logp, entropy, stats = triton_token_logprobs.token_logprobs_forward(logits, labels, 0.8, True, IGNORE, block_v=16)
    g_logp, g_entropy = torch.randn(5, device=DEVICE), torch.randn(5, device=DEVICE)
    grad = triton_token_logprobs.token_logprobs_backward(
        g_logp, g_entropy, logits, labels, stats, entropy, 0.8, IGNORE, block_v=16
    )
    leaf = logits.clone().requires_grad_()
    with pf.use_backend("reference"):
        ref_logp, ref_entropy = pf.token_logprobs(
            leaf, labels, temperature=0.8, return_entropy=True, ignore_index=IGNORE
        )
    ((ref_logp * g_logp).sum() + (ref_entropy * g_entropy).sum()).backward()
    torch.testing.assert_close(logp, ref_logp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, leaf.grad, rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_gradient_of_one_output_only(which):
    logits = torch.randn(4, 6, 33, device=DEVICE)
    labels = _labels((4, 6), 33)
    grads = {}
    for backend in ("reference", "triton"):
        leaf = logits.clone().requires_grad_()
        with pf.use_backend(backend):
            logp, entropy = pf.token_logprobs(leaf, labels, temperature=0.5, return_entropy=True, ignore_index=IGNORE)
        (logp if which == "logp" else entropy).sum().backward()
        grads[backend] = leaf.grad
    torch.testing.assert_close(grads["triton"], grads["reference"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_backward_gives_the_same_gradient(dtype):
    leaf_logits = (2 * torch.randn(3, 4, 300, device=DEVICE)).to(dtype)
    labels = _labels((3, 4), 300)
    weights = torch.randn(3, 4, device=DEVICE), torch.randn(3, 4, device=DEVICE)
    grads = {}
    for inplace in (False, True):
        leaf = leaf_logits.clone().requires_grad_()
        logits = leaf * 1  # a non-leaf buffer that the in-place backward may overwrite
        with pf.use_backend("triton"):
            logp, entropy = pf.token_logprobs(
                logits, labels, return_entropy=True, ignore_index=IGNORE, inplace_backward=inplace
            )
        ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        grads[inplace] = leaf.grad
        # In place, the logits buffer now holds the gradient (the memory saving is real).
        assert torch.equal(logits.detach(), leaf.grad) == inplace
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)


def test_extreme_logits_match_reference():
    vocab = 40
    logits = torch.randn(8, vocab, device=DEVICE)
    labels = torch.randint(1, vocab, (8,), device=DEVICE)
    logits[0] *= 1e4  # huge spread: one token takes all the mass
    logits[1] -= 1e4  # uniformly very negative
    logits[2, 0] = -math.inf  # -inf in a non-chosen position
    logits[3, labels[3]] = -math.inf  # chosen token impossible: log-prob -inf, entropy finite
    logits[4, 5:] = -math.inf  # most of the row impossible
    logits[5, 3] = math.nan  # NaN in: NaN out, for this row only
    logits[6, 0] = 3e38  # near the float32 limit
    logits[7, :] = 0.0  # uniform
    # Rows whose outputs are finite: outputs and gradients as the reference.
    finite_rows = torch.tensor([0, 1, 2, 4, 6, 7], device=DEVICE)
    weights = (torch.randn(6, device=DEVICE), torch.randn(6, device=DEVICE))
    ref = _logprobs_and_grads(
        "reference", logits[finite_rows], lambda x: x, labels[finite_rows], weights, return_entropy=True
    )
    out = _logprobs_and_grads(
        "triton", logits[finite_rows], lambda x: x, labels[finite_rows], weights, return_entropy=True
    )
    for actual, expected in zip(out, ref):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)

    with pf.use_backend("triton"):
        logp, entropy = pf.token_logprobs(logits, labels, return_entropy=True)
    with pf.use_backend("reference"):
        ref_logp, ref_entropy = pf.token_logprobs(logits, labels, return_entropy=True)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert logp[3] == -math.inf and torch.isfinite(entropy[3])
    assert torch.isnan(logp[5]) and torch.isnan(entropy[5])
    others = torch.arange(8) != 5
    assert not torch.isnan(logp[others]).any() and not torch.isnan(entropy[others]).any()


def test_chosen_minus_inf_and_nan_rows_gradients():
    """Where the reference's gradient is finite the kernel's matches; a NaN row does not leak into others."""
    logits = torch.randn(3, 10, device=DEVICE)
    labels = torch.tensor([2, 4, 6], device=DEVICE)
    logits[0, 2] = -math.inf
    logits[1, 7] = math.nan
    weights = (torch.randn(3, device=DEVICE), torch.randn(3, device=DEVICE))
    ref = _logprobs_and_grads("reference", logits, lambda x: x, labels, weights)
    out = _logprobs_and_grads("triton", logits, lambda x: x, labels, weights)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isfinite(out[2][[0, 2]]).all() and torch.isnan(out[2][1]).all()
