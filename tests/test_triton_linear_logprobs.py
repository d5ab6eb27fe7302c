"""Triton fused LM head (``linear_token_logprobs``) against the plain formula
``log_softmax(softcap(scale * (h @ W.T + b)) / T).gather(labels)``, forward and backward
(hidden, weight, bias), and against ``ppo_fast.reference``.

On a CPU-only machine the kernels run under the Triton interpreter (conftest sets
TRITON_INTERPRET=1): shapes are small, and the ``small_tiles`` fixture shrinks the
tiles to 16 so that odd N, V and H cross several tiles (and bf16/fp16 ``d_weight``
several vocabulary chunks).
"""

import pytest
import torch

pytest.importorskip("triton")

import ppo_fast as pf  # noqa: E402
from ppo_fast.backends import (  # noqa: E402
    backend_info,
    reference,  # noqa: E402
    resolved_backend_name,
)
from ppo_fast.backends import triton as triton_backend  # noqa: E402
from ppo_fast.backends.triton import linear_token_logprobs as kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
N, V, H = 37, 75, 41  # none a multiple of the 16-wide test tiles
# Forward (log-prob, entropy) rtol/atol, and the gradients' tolerance relative to their largest entry.
TOLERANCES = {
    torch.float64: ((1e-10, 1e-10), 1e-10),
    torch.float32: ((1e-5, 2e-5), 2e-5),
    torch.float16: ((1e-5, 2e-5), 4e-3),
    torch.bfloat16: ((1e-5, 2e-5), 2e-2),
}


@pytest.fixture
def small_tiles(monkeypatch):
    """16-wide tiles in both passes and a ``d_weight`` scratch of two vocabulary tiles."""
    for config in ("_FORWARD_CONFIG", "_BACKWARD_CONFIG"):
        monkeypatch.setattr(kernel, config, {acc: (16, 16, 16, 4) for acc in getattr(kernel, config)})
    monkeypatch.setattr(kernel, "WEIGHT_SCRATCH_BYTES", 2 * 16 * H * 4)


def _plain(hidden, weight, bias, labels, temperature=1.0, logit_scale=1.0, logit_softcap=None, **_):
    """The formula in float64, on the rows to compute (others: 0 log-prob / entropy, as ignored)."""
    raw = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    x = raw * logit_scale
    z = (x if logit_softcap is None else logit_softcap * torch.tanh(x / logit_softcap)) / temperature
    log_softmax = torch.log_softmax(z, -1)
    used = (labels != IGNORE) & (labels >= 0) & (labels < weight.shape[0])
    logp = log_softmax.gather(-1, torch.where(used, labels, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return torch.where(used, logp, 0.0), torch.where(used, entropy, 0.0)


def _labels(n, vocab, ignore_fraction=0.25):
    labels = torch.randint(0, vocab, (n,), device=DEVICE)
    return torch.where(torch.rand(n, device=DEVICE) < ignore_fraction, IGNORE, labels)


def _inputs(dtype, with_bias=True, n=N, vocab=V, width=H):
    hidden = torch.randn(n, width, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, width, device=DEVICE) / width**0.25).to(dtype)
    bias = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    return hidden, weight, bias


def _outputs_and_grads(fn, hidden, weight, bias, labels, weights, **options):
    """``fn``'s log-probs and entropy and the gradients of a weighted sum of both w.r.t. hidden, weight, bias."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in (hidden, weight, bias)]
    logp, entropy = fn(leaves[0], leaves[1], leaves[2], labels, **options)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return logp.detach(), entropy.detach(), [None if x is None else x.grad for x in leaves]


def _triton(hidden, weight, bias, labels, **options):
    return triton_backend.FUNCTIONS["linear_token_logprobs"](
        hidden, weight, labels, bias=bias, return_entropy=True, ignore_index=IGNORE, **options
    )


def _check(hidden, weight, bias, labels, **options):
    """The Triton op against the float64 formula: outputs, and gradients in the inputs' dtypes."""
    weights = (torch.randn(labels.shape, device=DEVICE), torch.randn(labels.shape, device=DEVICE))
    fwd_tol, grad_tol = TOLERANCES[hidden.dtype]
    logp, entropy, grads = _outputs_and_grads(_triton, hidden, weight, bias, labels, weights, **options)
    e_logp, e_entropy, e_grads = _outputs_and_grads(_plain, hidden, weight, bias, labels, weights, **options)
    assert logp.dtype == entropy.dtype == (torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(logp.double(), e_logp, rtol=fwd_tol[0], atol=fwd_tol[1])
    torch.testing.assert_close(entropy.double(), e_entropy, rtol=fwd_tol[0], atol=fwd_tol[1])
    for name, grad, expected, leaf in zip(("hidden", "weight", "bias"), grads, e_grads, (hidden, weight, bias)):
        if leaf is None:
            continue
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        scale = expected.abs().max().item()
        torch.testing.assert_close(
            grad.double(), expected.double(), rtol=grad_tol, atol=grad_tol * scale, msg=lambda m: f"d_{name}: {m}"
        )
    return logp, entropy, grads


OPTIONS = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "scale_softcap": dict(temperature=1.3, logit_scale=2.5, logit_softcap=4.0),
}


@pytest.mark.parametrize("variant", list(OPTIONS))
def test_float32_matches_formula(small_tiles, variant):
    hidden, weight, bias = _inputs(torch.float32, with_bias=variant != "plain")
    _check(hidden, weight, bias, _labels(N, V), **OPTIONS[variant])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_match_formula(small_tiles, dtype):
    """Half inputs run the products in their dtype (float32 accumulate) and cross d_weight's
    vocabulary chunks; float64 computes in float64."""
    hidden, weight, bias = _inputs(dtype)
    _check(hidden, weight, bias, _labels(N, V), **OPTIONS["scale_softcap"])


def test_default_tiles_match_formula():
    """The launch configuration used on a GPU (one tile covers these shapes)."""
    hidden, weight, bias = _inputs(torch.float32)
    _check(hidden, weight, bias, _labels(N, V), temperature=0.9)


def test_strided_hidden_and_transposed_weight_are_read_in_place(small_tiles, monkeypatch):
    """A sliced hidden (every other column here) and a weight stored transposed (column-major)
    are read in place, forward and backward."""
    hidden_full = torch.randn(N, 2 * H, device=DEVICE)
    weight_t = torch.randn(H, V, device=DEVICE)
    labels = _labels(N, V)
    seen = {}
    original = kernel.linear_token_logprobs_forward

    def spy(h, w, *args, **kwargs):
        seen["ptrs"] = (h.data_ptr(), w.data_ptr())
        return original(h, w, *args, **kwargs)

    monkeypatch.setattr(kernel, "linear_token_logprobs_forward", spy)
    grads = []
    for fn in (_triton, _plain):
        leaves = [hidden_full.clone().requires_grad_(), weight_t.clone().requires_grad_()]
        logp, entropy = fn(leaves[0][:, ::2], leaves[1].T, None, labels, temperature=1.1)
        (logp.sum() - entropy.sum()).backward()
        grads.append([x.grad for x in leaves])
        if fn is _triton:
            assert seen.pop("ptrs") == (leaves[0].data_ptr(), leaves[1].data_ptr())
    for actual, expected in zip(*grads):
        torch.testing.assert_close(
            actual.double(), expected.double(), rtol=2e-5, atol=2e-5 * expected.abs().max().item()
        )


def test_tied_weights_accumulate_both_uses(small_tiles):
    """The LM head is the input embedding (tied): its gradient sums the lookup's and the head's."""
    ids = torch.randint(0, V, (N,), device=DEVICE)
    embedding = torch.randn(V, H, device=DEVICE)
    mix = torch.randn(H, H, device=DEVICE) / H**0.5
    labels = _labels(N, V)
    grads = []
    for fn in (_triton, _plain):
        table = embedding.clone().requires_grad_()
        hidden = torch.tanh(table[ids] @ mix)
        logp, entropy = fn(hidden, table, None, labels)
        (logp.sum() + 0.5 * entropy.sum()).backward()
        grads.append(table.grad)
    torch.testing.assert_close(grads[0].double(), grads[1].double(), rtol=2e-5, atol=2e-5 * grads[1].abs().max().item())


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_gradient_of_one_output_only(small_tiles, which):
    hidden, weight, bias = _inputs(torch.float32)
    labels = _labels(N, V)
    grads = []
    for fn in (_triton, _plain):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        logp, entropy = fn(*leaves, labels, temperature=0.8)
        (logp if which == "logp" else entropy).sum().backward()
        grads.append([x.grad for x in leaves])
    for actual, expected in zip(*grads):
        torch.testing.assert_close(
            actual.double(), expected.double(), rtol=2e-5, atol=2e-5 * expected.abs().max().item()
        )


def test_without_entropy_and_without_bias_grad(small_tiles):
    hidden, weight, bias = _inputs(torch.float32)
    labels = _labels(N, V)
    leaf = hidden.clone().requires_grad_()
    logp, entropy = triton_backend.FUNCTIONS["linear_token_logprobs"](
        leaf, weight, labels, bias=bias, ignore_index=IGNORE
    )
    assert entropy is None
    logp.sum().backward()
    expected_leaf = hidden.double().requires_grad_()
    _plain(expected_leaf, weight, bias, labels)[0].sum().backward()
    torch.testing.assert_close(leaf.grad.double(), expected_leaf.grad.double(), rtol=2e-5, atol=1e-6)


def test_ignored_and_out_of_range_rows_read_nothing(small_tiles):
    """Ignored rows: 0 log-prob and entropy; out-of-range labels (never checked on CUDA):
    NaN; both pass no gradient and their hidden states (NaN here) reach nothing.  A whole
    ignored tile of rows is skipped."""
    hidden, weight, bias = _inputs(torch.float32)
    labels = _labels(N, V)
    labels[:16] = IGNORE  # the first row tile computes nothing
    bad = torch.tensor([17, 20, 30], device=DEVICE)
    labels[bad] = torch.tensor([V, -1, 10**12], device=DEVICE)
    ignored = labels == IGNORE
    poisoned = hidden.clone()
    poisoned[ignored] = float("nan")
    poisoned[bad] = float("inf")
    weights = (torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE))
    logp, entropy, grads = _outputs_and_grads(_triton, poisoned, weight, bias, labels, weights)
    assert (logp[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert logp[bad].isnan().all() and entropy[bad].isnan().all()
    assert (grads[0][ignored] == 0).all() and (grads[0][bad] == 0).all()
    # Every other result and gradient is the formula's without those rows.
    used = ~ignored
    used[bad] = False
    e_logp, e_entropy, e_grads = _outputs_and_grads(_plain, hidden, weight, bias, labels, weights)
    torch.testing.assert_close(logp[used].double(), e_logp[used], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(entropy[used].double(), e_entropy[used], rtol=1e-5, atol=2e-5)
    for grad, expected in zip(grads, e_grads):
        torch.testing.assert_close(grad.double(), expected.double(), rtol=2e-5, atol=2e-5 * expected.abs().max().item())


def test_all_rows_ignored_and_empty_inputs():
    hidden, weight, bias = _inputs(torch.float32)
    labels = torch.full((N,), IGNORE, device=DEVICE)
    weights = (torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE))
    logp, entropy, grads = _outputs_and_grads(_triton, hidden, weight, bias, labels, weights)
    assert (logp == 0).all() and (entropy == 0).all() and all((g == 0).all() for g in grads)
    logp, entropy, grads = _outputs_and_grads(_triton, hidden[:0], weight, bias, labels[:0], [w[:0] for w in weights])
    assert logp.shape == entropy.shape == (0,) and grads[0].shape == (0, H)
    assert (grads[1] == 0).all() and (grads[2] == 0).all()


def test_matches_the_reference(small_tiles):
    hidden, weight, bias = _inputs(torch.float32)
    labels = _labels(N, V)
    weights = (torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE))
    options = dict(temperature=0.9, logit_scale=0.5, logit_softcap=6.0)

    def ref(h, w, b, lab, **kw):
        return reference.linear_token_logprobs(h, w, lab, bias=b, return_entropy=True, ignore_index=IGNORE, **kw)

    actual = _outputs_and_grads(_triton, hidden, weight, bias, labels, weights, **options)
    expected = _outputs_and_grads(ref, hidden, weight, bias, labels, weights, **options)
    torch.testing.assert_close(actual[:2], expected[:2], rtol=1e-5, atol=2e-5)
    for grad, e in zip(actual[2], expected[2]):
        torch.testing.assert_close(grad, e, rtol=2e-5, atol=2e-5 * e.abs().max().item())


def test_large_logits_and_masked_vocabulary(small_tiles):
    """Logits up to ~250 whose row maximum comes in the last tiles (the online logsumexp
    rescales), and a -inf bias on the first 20 columns (a masked-out padded vocabulary: p = 0
    there, whole tiles of -inf), against the reference."""
    hidden, weight, _ = _inputs(torch.float32)
    bias = torch.linspace(-60.0, 60.0, V, device=DEVICE)
    bias[:20] = float("-inf")
    labels = torch.where(torch.rand(N, device=DEVICE) < 0.2, IGNORE, torch.randint(20, V, (N,), device=DEVICE))
    weights = (torch.randn(N, device=DEVICE), torch.randn(N, device=DEVICE))

    def ref(h, w, b, lab, **kw):
        return reference.linear_token_logprobs(h, w, lab, bias=b, return_entropy=True, ignore_index=IGNORE, **kw)

    actual = _outputs_and_grads(_triton, hidden, weight, bias, labels, weights, temperature=0.5)
    expected = _outputs_and_grads(ref, hidden, weight, bias, labels, weights, temperature=0.5)
    torch.testing.assert_close(actual[:2], expected[:2], rtol=1e-5, atol=2e-5)
    for grad, e in zip(actual[2], expected[2]):
        assert grad.isfinite().all()
        torch.testing.assert_close(grad, e, rtol=2e-5, atol=2e-5 * e.abs().max().item())


def test_launcher_rejects_mismatched_inputs():
    hidden, weight, bias = _inputs(torch.float32)
    labels = _labels(N, V)
    options = dict(temperature=1.0, logit_scale=1.0, logit_softcap=None, ignore_index=IGNORE, return_entropy=False)
    with pytest.raises(ValueError, match="bias must have shape"):
        kernel.linear_token_logprobs_forward(hidden, weight, labels, bias[:-1], **options)
    with pytest.raises(ValueError, match="weight must have shape"):
        kernel.linear_token_logprobs_forward(hidden, weight[:, :-1], labels, bias, **options)
    with pytest.raises(ValueError, match="labels must have shape"):
        kernel.linear_token_logprobs_forward(hidden, weight, labels[:-1], bias, **options)
    with pytest.raises(TypeError, match="weight must have hidden's dtype"):
        kernel.linear_token_logprobs_forward(hidden, weight.double(), labels, None, **options)


def test_registered_for_cuda_and_preferred_there():
    module = backend_info("triton").module
    assert "cuda" in module.SUPPORTED["linear_token_logprobs"]
    assert ("cpu" in module.SUPPORTED["linear_token_logprobs"]) == (not torch.cuda.is_available())
    assert resolved_backend_name("linear_token_logprobs", "cuda") == "triton"
    assert resolved_backend_name("linear_token_logprobs", "cpu") != "triton"


def test_torch_compile_fullgraph_matches_eager():
    """The custom op is one opaque node under torch.compile(fullgraph=True), forward and backward."""
    hidden, weight, bias = _inputs(torch.float32, vocab=40, width=24)
    labels = _labels(N, 40)

    def loss(h, w, b):
        logp, entropy = triton_backend.FUNCTIONS["linear_token_logprobs"](
            h, w, labels, bias=b, temperature=0.7, logit_softcap=3.0, return_entropy=True, ignore_index=IGNORE
        )
        return logp.sum() + entropy.sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        value = fn(*leaves)
        results.append((value.detach(), *torch.autograd.grad(value, leaves)))
    for actual, expected in zip(*results):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


@pytest.fixture
def deterministic():
    """``torch.use_deterministic_algorithms`` for one test (``deterministic(warn_only=...)``)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda warn_only=False: torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_algorithms_pass_over_the_atomic_backward(deterministic):
    """Under torch.use_deterministic_algorithms(True): auto takes the reference for the fused head
    (the Triton backward adds with atomics) and keeps Triton elsewhere; an explicit Triton
    choice raises, or warns and runs with warn_only."""
    hidden, weight, bias = _inputs(torch.float32)
    labels = _labels(N, V)
    deterministic()
    assert resolved_backend_name("linear_token_logprobs", "cuda") == "reference"
    assert resolved_backend_name("token_logprobs", "cuda") == "triton"
    with (
        pf.use_backend("triton"),
        pytest.raises(RuntimeError, match="linear_token_logprobs: backend 'triton' is not deterministic"),
    ):
        pf.linear_token_logprobs(hidden, weight, labels, bias=bias)
    deterministic(warn_only=True)
    with pf.use_backend("triton"), pytest.warns(UserWarning, match="float32 atomics"):
        logp = pf.linear_token_logprobs(hidden, weight, labels, bias=bias)
    torch.testing.assert_close(logp.double(), _plain(hidden, weight, bias, labels)[0], rtol=1e-5, atol=2e-5)


def test_deterministic_choice_under_torch_compile(deterministic):
    """The choice is made while tracing: fullgraph, and the reference's result."""
    hidden, weight, bias = _inputs(torch.float32)
    labels = _labels(N, V)
    deterministic()
    with pf.use_backend("auto"):
        compiled = torch.compile(
            lambda h: pf.linear_token_logprobs(h, weight, labels, bias=bias), fullgraph=True, backend="aot_eager"
        )
        torch.testing.assert_close(
            compiled(hidden).double(), _plain(hidden, weight, bias, labels)[0], rtol=1e-5, atol=2e-5
        )
