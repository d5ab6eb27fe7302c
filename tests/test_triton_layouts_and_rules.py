"""The Triton kernels whatever their inputs: strides and layouts, out-of-range labels,
``inplace_backward``, the non-finite rule, differentiability and the device guard.

Each must hold whether or not the public ops' value checks ran, so many tests call the
backend functions (``ppo_fast.ops.triton_backend``) or the launchers
(``ppo_fast.kernels``) directly, and some run under ``torch.compile``, where the
checks are skipped.  The cross-backend comparison on random inputs is
``tests/test_conformance.py``; this file covers what is specific to the kernels.
"""

import contextlib
import math

import pytest
import torch

pytest.importorskip("triton")

import ppo_fast as pf  # noqa: E402
from ppo_fast.backends import reference
from ppo_fast.backends import triton as tb  # noqa: E402
from ppo_fast.backends.triton import _launch  # noqa: E402
from ppo_fast.backends.triton import gae as triton_gae  # noqa: E402
from ppo_fast.backends.triton import kl_penalized_rewards as triton_kl_penalized_rewards  # noqa: E402
from ppo_fast.backends.triton import token_logprobs as triton_token_logprobs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
TOL = dict(rtol=1e-5, atol=1e-5)


def _grads(fn, leaves, weights=None):
    """``fn(*leaves)`` (outputs as a tuple) and the gradients of a weighted sum of the outputs w.r.t. ``leaves``."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    outs = tuple(o for o in outs if o is not None)
    if weights is None:
        gen = torch.Generator(device=DEVICE).manual_seed(7)
        weights = [torch.randn(o.shape, generator=gen, device=DEVICE, dtype=o.dtype) for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def _assert_same(actual, expected, **tol):
    """Outputs and gradients of two ``_grads`` results agree (a None gradient on both sides)."""
    for a, e in zip(actual[0] + actual[1], expected[0] + expected[1]):
        if e is None:
            assert a is None
            continue
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, **(tol or TOL))


# --------------------------------------------------------------------------- token_logprobs: layouts


def _logprobs_fn(backend_fn, labels, **kwargs):
    kwargs = dict(dict(temperature=0.8, return_entropy=True, ignore_index=IGNORE, inplace_backward=False), **kwargs)
    return lambda x: backend_fn(
        x, labels, kwargs["temperature"], kwargs["return_entropy"], kwargs["ignore_index"], kwargs["inplace_backward"]
    )


def _triton_vs_reference_logprobs(leaf, view, labels, **kwargs):
    """Backend functions (no validation) on ``view(leaf)``: outputs and the gradient w.r.t. ``leaf``."""
    got = _grads(lambda x: _logprobs_fn(tb.FUNCTIONS["token_logprobs"], labels, **kwargs)(view(x)), [leaf])
    want = _grads(lambda x: _logprobs_fn(reference.token_logprobs, labels, **kwargs)(view(x)), [leaf])
    _assert_same(got, want)
    return got


def _label_layouts(batch, length, vocab):
    """(name, labels [B, T]) in layouts the kernels must read in place."""
    ids = torch.randint(0, vocab, (batch, length, 2), device=DEVICE)
    ids[0, 1, 1] = IGNORE
    transposed = torch.randint(0, vocab, (length, batch), device=DEVICE).t()
    return [
        ("last-dim slice", ids[..., 1]),  # stride (2T, 2): the case that was off by 3.3
        ("transposed", transposed),
        ("expanded scalar", torch.tensor(5, device=DEVICE).expand(batch, length)),  # stride (0, 0)
        ("expanded row", torch.randint(0, vocab, (1, length), device=DEVICE).expand(batch, length)),
        ("int32", ids[..., 1].to(torch.int32)),  # contiguous: the dtype is the point
        ("shifted int32", torch.randint(0, vocab, (batch, length + 1), device=DEVICE, dtype=torch.int32)[:, 1:]),
    ]


@pytest.mark.parametrize("case", range(6))
def test_logprobs_labels_in_any_layout(case):
    batch, length, vocab = 2, 5, 37
    name, labels = _label_layouts(batch, length, vocab)[case]
    assert not labels.is_contiguous() or name == "int32"
    logits = 2 * torch.randn(batch, length, vocab, device=DEVICE)
    # 3-D logits: labels [B, T] read through their two strides.
    _triton_vs_reference_logprobs(logits, lambda x: x, labels)
    # 2-D logits: labels viewed as [N] (a strided view when one exists, else a small copy).
    _triton_vs_reference_logprobs(logits.reshape(-1, vocab), lambda x: x, labels.reshape(-1))
    # And through the public op.
    with pf.use_backend("triton"):
        got = pf.token_logprobs(logits, labels, temperature=0.8, ignore_index=IGNORE)
    with pf.use_backend("reference"):
        want = pf.token_logprobs(logits, labels, temperature=0.8, ignore_index=IGNORE)
    torch.testing.assert_close(got, want, **TOL)


_LOGITS_VIEWS = {
    # leaf shape, view: layouts of the logits the kernels read without copying
    "shifted slice": ((2, 6, 19), lambda x: x[:, :-1]),
    "transposed rows": ((5, 2, 19), lambda x: x.transpose(0, 1)),
    "vocab stride 3": ((2, 5, 57), lambda x: x[..., ::3]),
    "vocab-major": ((19, 4), lambda x: x.t()),  # stride(-1) == 4
    "expanded rows": ((1, 19), lambda x: x.expand(6, 19)),  # stride (0, 1)
    "expanded batch": ((1, 5, 19), lambda x: x.expand(3, 5, 19)),
    "every other row": ((8, 19), lambda x: x[::2]),
}


@pytest.mark.parametrize("name", list(_LOGITS_VIEWS))
@pytest.mark.parametrize("inplace", [False, True])
def test_logprobs_logits_in_any_layout(name, inplace):
    """Forward and gradient as the reference, with or without ``inplace_backward``."""
    shape, view = _LOGITS_VIEWS[name]
    leaf = 2 * torch.randn(shape, device=DEVICE)
    lead = view(leaf).shape[:-1]
    labels = torch.randint(0, view(leaf).shape[-1], lead, device=DEVICE)
    labels.view(-1)[0] = IGNORE
    _triton_vs_reference_logprobs(leaf, view, labels, inplace_backward=inplace)


def test_logprobs_forward_reads_logits_in_place(monkeypatch):
    """No [N, V] copy of strided logits: the kernel gets the caller's storage."""
    seen = []
    launch = triton_token_logprobs._token_logprobs_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(logits, *args, **kwargs):
                seen.append(logits.data_ptr())
                return launch[grid](logits, *args, **kwargs)

            return run

    monkeypatch.setattr(triton_token_logprobs, "_token_logprobs_fwd_kernel", Spy())
    for shape, view in _LOGITS_VIEWS.values():
        leaf = torch.randn(shape, device=DEVICE)
        logits = view(leaf)
        triton_token_logprobs.token_logprobs_forward(
            logits, torch.zeros(logits.shape[:-1], dtype=torch.long, device=DEVICE), 1.0, True, IGNORE
        )
        assert seen.pop() == logits.data_ptr()


@pytest.mark.parametrize("block_v", [8, None])
def test_logprobs_backward_reads_strided_and_expanded_gradients(block_v):
    """grad_logp / grad_entropy / entropy / labels in any layout give the gradient of their contiguous copies."""
    batch, length, vocab = 3, 4, 21
    logits = torch.randn(batch, length, vocab, device=DEVICE)
    labels = torch.randint(0, vocab, (batch, length, 2), device=DEVICE)[..., 0]
    logp, entropy, stats = triton_token_logprobs.token_logprobs_forward(
        logits, labels, 1.3, True, IGNORE, block_v=block_v
    )
    layouts = {
        "transposed": lambda g: g.t().contiguous().t(),
        "sliced": lambda g: torch.stack([g, g], -1)[..., 1],
        "expanded": lambda g: g[:1, :1].expand_as(g),
    }
    base = torch.randn(batch, length, device=DEVICE)
    for name, layout in layouts.items():
        g_logp, g_entropy = layout(base), layout(2 * base + 1)
        ent = layout(entropy) if name != "expanded" else entropy.t().contiguous().t()
        got = triton_token_logprobs.token_logprobs_backward(
            g_logp, g_entropy, logits, labels.t().contiguous().t(), stats, ent, 1.3, IGNORE, block_v=block_v
        )
        want = triton_token_logprobs.token_logprobs_backward(
            g_logp.contiguous(),
            g_entropy.contiguous(),
            logits,
            labels.contiguous(),
            stats,
            entropy,
            1.3,
            IGNORE,
            block_v=block_v,
        )
        assert torch.equal(got, want), name
        only_entropy = triton_token_logprobs.token_logprobs_backward(
            None, g_entropy, logits, labels, stats, ent, 1.3, IGNORE, block_v=block_v
        )
        want = triton_token_logprobs.token_logprobs_backward(
            torch.zeros_like(base), g_entropy.contiguous(), logits, labels, stats, entropy, 1.3, IGNORE, block_v=block_v
        )
        assert torch.equal(only_entropy, want), name


def test_logprobs_gradient_of_a_sum_is_expanded():
    """``logp.sum().backward()`` hands the backward a stride-0 gradient: read as such."""
    logits = torch.randn(3, 4, 29, device=DEVICE)
    labels = torch.randint(0, 29, (3, 4), device=DEVICE)
    grads = {}
    for backend in ("triton", "reference"):
        leaf = logits.clone().requires_grad_()
        with pf.use_backend(backend):
            logp, entropy = pf.token_logprobs(leaf, labels, return_entropy=True)
        (logp.sum() + entropy.sum()).backward()
        grads[backend] = leaf.grad
    torch.testing.assert_close(grads["triton"], grads["reference"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- inplace_backward


def test_inplace_backward_on_expanded_logits_is_not_in_place():
    """Expanded (stride-0) logits: every row shares memory, so the gradient is allocated, and right."""
    base = torch.randn(1, 33, device=DEVICE)
    labels = torch.randint(0, 33, (5,), device=DEVICE)
    weights = [torch.randn(5, device=DEVICE), torch.randn(5, device=DEVICE)]
    got = _grads(
        lambda b: tb.FUNCTIONS["token_logprobs"](b.expand(5, 33), labels, 1.0, True, IGNORE, True), [base], weights
    )
    want = _grads(lambda b: reference.token_logprobs(b.expand(5, 33), labels, 1.0, True, IGNORE), [base], weights)
    _assert_same(got, want)
    # The same through a non-leaf expanded buffer: the buffer is left alone.
    leaf = base.clone().requires_grad_()
    shared = leaf * 1
    with pf.use_backend("triton"):
        logp = pf.token_logprobs(shared.expand(5, 33), labels, inplace_backward=True)
    before = shared.detach().clone()
    (logp * weights[0]).sum().backward()
    assert torch.equal(shared.detach(), before)


@pytest.mark.parametrize(
    "layout,in_place",
    [("contiguous", True), ("transposed (dense)", True), ("sliced (gaps)", False), ("expanded", False)],
)
def test_inplace_backward_only_on_dense_memory(layout, in_place):
    batch, length, vocab = 2, 3, 17
    labels = torch.randint(0, vocab, (batch, length), device=DEVICE)
    weights = [torch.randn(batch, length, device=DEVICE), torch.randn(batch, length, device=DEVICE)]
    make = {
        "contiguous": lambda y: y,
        "transposed (dense)": lambda y: y.transpose(0, 1).contiguous().transpose(0, 1),
        "sliced (gaps)": lambda y: torch.cat([y, y[:, :1]], 1)[:, :length],
        "expanded": lambda y: y[:1].expand(batch, length, vocab),
    }[layout]
    leaf = torch.randn(batch, length, vocab, device=DEVICE, requires_grad=True)
    buffer = make(leaf * 1)  # a non-leaf the backward may overwrite
    assert _launch.is_non_overlapping_and_dense(buffer) == in_place
    before = buffer.detach().clone()
    logp, entropy = tb.FUNCTIONS["token_logprobs"](buffer, labels, 1.0, True, IGNORE, True)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    want = _grads(lambda x: reference.token_logprobs(make(x), labels, 1.0, True, IGNORE), [leaf], weights)[1][0]
    torch.testing.assert_close(leaf.grad, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(buffer.detach(), before) != in_place


def test_inplace_backward_under_torch_compile():
    """The in-place decision is made on the traced (fake) logits' strides: expanded logits get
    an allocated gradient, a dense buffer the in-place one; both right."""
    pf.available_backends()

    def step(base, full, labels):
        expanded = pf.token_logprobs(base.expand(4, 3, 11), labels, inplace_backward=True)
        dense = pf.token_logprobs(full * 1, labels, inplace_backward=True)
        return expanded.sum() + (dense * torch.arange(3, device=DEVICE)).sum()

    base, full = torch.randn(1, 3, 11, device=DEVICE), torch.randn(4, 3, 11, device=DEVICE)
    labels = torch.randint(0, 11, (4, 3), device=DEVICE)
    grads = {}
    for backend in ("reference", "triton"):
        with pf.use_backend(backend):
            torch._dynamo.reset()
            fn = torch.compile(step, fullgraph=True, backend="aot_eager") if backend == "triton" else step
            leaves = base.clone().requires_grad_(), full.clone().requires_grad_()
            fn(*leaves, labels).backward()
            grads[backend] = [x.grad for x in leaves]
    for got, want in zip(grads["triton"], grads["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_is_non_overlapping_and_dense():
    x = torch.empty(3, 4, 5)
    assert _launch.is_non_overlapping_and_dense(x)
    assert _launch.is_non_overlapping_and_dense(x.permute(2, 0, 1))
    assert _launch.is_non_overlapping_and_dense(x[:1])
    assert _launch.is_non_overlapping_and_dense(torch.empty(0, 5).expand(0, 5))
    assert not _launch.is_non_overlapping_and_dense(x[:, :2])
    assert not _launch.is_non_overlapping_and_dense(x[..., ::2])
    assert not _launch.is_non_overlapping_and_dense(x[:1].expand(3, 4, 5))
    assert not _launch.is_non_overlapping_and_dense(torch.empty(4).as_strided((3, 2), (1, 1)))


# --------------------------------------------------------------------------- token_logprobs: out-of-range labels

BAD_LABELS = [None, 0, -5, 10**11, -(2**40), -1]  # None: the vocabulary size V itself


# --------------------------------------------------------------------------- kl_estimate: layouts

_KL_VIEWS = {
    "every other token": ((3, 10), lambda x: x[:, ::2]),  # the case that was off by 4.3
    "transposed": ((6, 4), lambda x: x.t()),
    "3-D permuted": ((3, 4, 5), lambda x: x.permute(2, 0, 1)),
    "expanded scalar": ((), lambda x: x.expand(4, 6)),
    "expanded row": ((1, 7), lambda x: x.expand(3, 7)),
    "1-D strided": ((12,), lambda x: x[1::3]),
    "0-d": ((), lambda x: x),
}


@pytest.mark.parametrize("name", list(_KL_VIEWS))
@pytest.mark.parametrize("kl_estimator", ["k2", "k3"])
def test_kl_estimate_any_layout(name, kl_estimator):
    shape, view = _KL_VIEWS[name]
    logp = -torch.rand(shape, device=DEVICE)
    ref = logp + 0.5 * torch.randn(shape, device=DEVICE)

    def fn(module):
        return lambda a, b: module.FUNCTIONS["kl_estimate"](view(a), view(b), kl_estimator)

    got, want = _grads(fn(tb), [logp, ref]), _grads(fn(reference), [logp, ref])
    _assert_same(got, want)
    # Mixed layouts: one operand contiguous, the other strided.
    got = _grads(lambda a, b: tb.FUNCTIONS["kl_estimate"](view(a).contiguous(), view(b), kl_estimator), [logp, ref])
    _assert_same(got, want)


def test_kl_backward_reads_strided_and_expanded_grad():
    logp, ref = torch.randn(4, 6, device=DEVICE), torch.randn(4, 6, device=DEVICE)
    g = torch.randn(6, 4, device=DEVICE).t()
    for grad_kl in (g, g[:1].expand(4, 6), torch.tensor(2.0, device=DEVICE).expand(4, 6)):
        got = triton_kl_penalized_rewards.kl_estimate_backward(grad_kl, logp[:, :], ref.t().contiguous().t(), "k2")
        want = triton_kl_penalized_rewards.kl_estimate_backward(grad_kl.contiguous(), logp, ref, "k2")
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# --------------------------------------------------------------------------- kl_penalized_rewards


def _rewards_layouts(batch, length):
    mask = torch.rand(batch, length, device=DEVICE) < 0.6
    mask[0] = False
    mask[1, -1] = True
    return {
        "contiguous": (lambda s: s, lambda x: x, mask),
        "sliced and transposed": (
            lambda s: torch.stack([s, s], 1)[:, 1],
            lambda x: torch.cat([x, x[:, :1]], 1)[:, :length],
            mask.t().contiguous().t(),
        ),
        "expanded": (
            lambda s: s[:1].expand(batch),
            lambda x: x[:1].expand(batch, length),
            mask[1:2].expand(batch, length),
        ),
        "int mask, shifted": (
            lambda s: s,
            lambda x: torch.cat([x[:, :1], x], 1)[:, 1:],
            torch.cat([mask[:, :1], mask], 1)[:, 1:].long(),
        ),
    }


@pytest.mark.parametrize("layout", ["contiguous", "sliced and transposed", "expanded", "int mask, shifted"])
@pytest.mark.parametrize("outputs", ["both", "rewards", "kl"])
def test_kl_penalized_rewards_any_layout(layout, outputs):
    batch, length = 3, 11
    score_view, view, mask = _rewards_layouts(batch, length)[layout]
    scores, logp, ref = (
        torch.randn(batch, device=DEVICE),
        -torch.rand(batch, length, device=DEVICE),
        -torch.rand(batch, length, device=DEVICE),
    )
    pick = {"both": lambda o: o, "rewards": lambda o: o[0], "kl": lambda o: o[1]}[outputs]

    def fn(module, m):
        return lambda s, a, b: pick(
            module.FUNCTIONS["kl_penalized_rewards"](score_view(s), view(a), view(b), m, 0.25, "k3")
        )

    got = _grads(fn(tb, mask), [scores, logp, ref])
    want = _grads(fn(reference, mask != 0), [scores, logp, ref])
    _assert_same(got, want)
    if outputs == "kl":
        assert got[1][0] is None  # the scores reach only the rewards, as in the reference


@pytest.mark.parametrize("block_t", [4, None])
def test_kl_rewards_backward_strided_gradients_and_chunks(block_t):
    batch, length = 4, 13
    logp, ref = torch.randn(batch, length, device=DEVICE), torch.randn(batch, length, device=DEVICE)
    mask = torch.rand(batch, length, device=DEVICE) < 0.5
    mask[2] = False
    mask[3, :2] = True
    _, _, last = triton_kl_penalized_rewards.kl_penalized_rewards_forward(
        torch.randn(batch, device=DEVICE), logp, ref, mask, 0.3, "k2", block_t=block_t
    )
    g_rewards, g_kl = (
        torch.randn(length, batch, device=DEVICE).t(),
        torch.randn(batch, 1, device=DEVICE).expand(batch, length),
    )
    got = triton_kl_penalized_rewards.kl_penalized_rewards_backward(
        g_rewards, g_kl, logp, ref, mask, last, 0.3, "k2", torch.float32, block_t=block_t
    )
    want = triton_kl_penalized_rewards.kl_penalized_rewards_backward(
        g_rewards.contiguous(), g_kl.contiguous(), logp, ref, mask, last, 0.3, "k2", torch.float32, block_t=block_t
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    scores = torch.randn(batch, device=DEVICE, requires_grad=True)
    leaves = [logp.clone().requires_grad_(), ref.clone().requires_grad_()]
    rewards, kl = reference.kl_penalized_rewards(scores, *leaves, mask, 0.3, "k2")
    torch.autograd.backward([rewards, kl], [g_rewards, g_kl])
    for a, b in zip(got, [scores.grad] + [x.grad for x in leaves]):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3", "abs"])
def test_kl_rewards_nan_at_masked_vs_valid_positions(kl_estimator):
    batch, length = 3, 9
    scores = torch.randn(batch, device=DEVICE)
    logp, ref = -torch.rand(batch, length, device=DEVICE), -torch.rand(batch, length, device=DEVICE)
    mask = torch.rand(batch, length, device=DEVICE) < 0.6
    mask[:, 0] = False
    mask[:, 1] = True
    mask[2] = False  # no valid token: its score is never read
    dirty_logp, dirty_ref, dirty_scores = logp.clone(), ref.clone(), scores.clone()
    dirty_logp[:, 0] = math.nan
    dirty_ref[:, 0] = -math.inf
    dirty_scores[2] = math.nan
    g = torch.randn(batch, length, device=DEVICE)
    g_dirty = torch.where(mask, g, math.nan)  # NaN incoming gradients at masked positions

    def run(s, a, b, grad):
        leaves = [x.clone().requires_grad_() for x in (s, a, b)]
        rewards, kl = tb.FUNCTIONS["kl_penalized_rewards"](*leaves, mask, 0.1, kl_estimator)
        torch.autograd.backward([rewards, kl], [grad, grad])
        return [rewards.detach(), kl.detach()] + [x.grad for x in leaves]

    clean, dirty = run(scores, logp, ref, g), run(dirty_scores, dirty_logp, dirty_ref, g_dirty)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    for grad in dirty[3:]:
        assert (grad[~mask] == 0).all()
    # NaN at a valid position propagates to that token's kl and reward; gradients as the reference's.
    nan_logp = logp.clone()
    nan_logp[0, 1] = math.nan
    out = run(scores, nan_logp, ref, g)
    assert torch.isnan(out[0][0, 1]) and torch.isnan(out[1][0, 1])
    assert torch.isfinite(out[0][1:]).all() and torch.isfinite(out[0][0, 2:]).all()
    leaves = [x.clone().requires_grad_() for x in (scores, nan_logp, ref)]
    want = list(reference.kl_penalized_rewards(*leaves, mask, 0.1, kl_estimator))
    torch.autograd.backward(want, [g, g])
    for a, b in zip(out, [w.detach() for w in want] + [x.grad for x in leaves]):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL)


# --------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("outputs", ["both", "advantages", "returns"])
def test_gae_any_layout(outputs):
    batch, length = 3, 10
    rewards, values = torch.randn(batch, length, device=DEVICE), torch.randn(batch, length, device=DEVICE)
    mask = torch.rand(batch, length, device=DEVICE) < 0.7
    pick = {"both": lambda o: o, "advantages": lambda o: o[0], "returns": lambda o: o[1]}[outputs]
    for view, m in (
        (lambda x: x.t().contiguous().t(), mask[:, :]),
        (lambda x: torch.cat([x, x], 1)[:, 1 : length + 1], mask.t().contiguous().t()),
        (lambda x: x[:1].expand(batch, length), mask[:1].expand(batch, length)),
    ):
        got = _grads(lambda r, v: pick(tb.FUNCTIONS["gae"](view(r), view(v), m, 0.95, 0.9)), [rewards, values])
        want = _grads(lambda r, v: pick(reference.gae(view(r), view(v), m, 0.95, 0.9)), [rewards, values])
        _assert_same(got, want)


@pytest.mark.parametrize("block_t", [2, None])
def test_gae_backward_strided_and_expanded_gradients(block_t):
    batch, length = 3, 11
    mask = torch.rand(batch, length, device=DEVICE) < 0.6
    g_adv = torch.randn(length, batch, device=DEVICE).t()
    g_ret = torch.tensor(0.5, device=DEVICE).expand(batch, length)
    for pair in ((g_adv, g_ret), (g_adv, None), (None, g_ret)):
        got = triton_gae.gae_backward(*pair, mask, 0.9, 0.8, torch.float32, torch.bfloat16, block_t=block_t)
        want = triton_gae.gae_backward(
            *(None if g is None else g.contiguous() for g in pair),
            mask,
            0.9,
            0.8,
            torch.float32,
            torch.bfloat16,
            block_t=block_t,
        )
        assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_gae_nan_at_masked_vs_valid_positions():
    batch, length = 3, 12
    rewards, values = torch.randn(batch, length, device=DEVICE), torch.randn(batch, length, device=DEVICE)
    mask = torch.rand(batch, length, device=DEVICE) < 0.6
    mask[:, 5] = True
    mask[:, 4] = False
    g = torch.randn(batch, length, device=DEVICE)

    def run(r, v, grad):
        leaves = [r.clone().requires_grad_(), v.clone().requires_grad_()]
        advantages, returns = tb.FUNCTIONS["gae"](*leaves, mask, 0.97, 0.9)
        torch.autograd.backward([advantages, returns], [grad, grad])
        return [advantages.detach(), returns.detach()] + [x.grad for x in leaves]

    clean = run(rewards, values, g)
    dirty = run(
        torch.where(mask, rewards, math.nan), torch.where(mask, values, math.inf), torch.where(mask, g, math.nan)
    )
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    for grad in dirty[2:]:
        assert (grad[~mask] == 0).all()
    # A NaN value at a valid position: NaN in that row up to there, nothing in the other rows.
    nan_values = values.clone()
    nan_values[0, 5] = math.nan
    out = run(rewards, nan_values, g)
    leaves = [rewards.clone().requires_grad_(), nan_values.clone().requires_grad_()]
    want = list(reference.gae(*leaves, mask, 0.97, 0.9))
    torch.autograd.backward(want, [g, g])
    for a, b in zip(out, [w.detach() for w in want] + [x.grad for x in leaves]):
        torch.testing.assert_close(a, b, equal_nan=True, **TOL)
    assert torch.isnan(out[0][0, 5]) and torch.isfinite(out[0][1:]).all()
    assert (out[0][~mask] == 0).all()


# --------------------------------------------------------------------------- differentiability


def test_gradient_dtypes_follow_each_input():
    batch, length = 2, 5
    scores = torch.randn(batch, device=DEVICE, dtype=torch.bfloat16)
    logp = -torch.rand(batch, length, device=DEVICE, dtype=torch.float16)
    ref = -torch.rand(batch, length, device=DEVICE, dtype=torch.float32)
    mask = torch.ones(batch, length, dtype=torch.bool, device=DEVICE)
    _, grads = _grads(
        lambda s, a, b: tb.FUNCTIONS["kl_penalized_rewards"](s, a, b, mask, 0.1, "k2"), [scores, logp, ref]
    )
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float16, torch.float32]
    _, grads = _grads(lambda a, b: tb.FUNCTIONS["kl_estimate"](a, b, "k3"), [logp, ref.double()])
    assert [g.dtype for g in grads] == [torch.float16, torch.float64]
    _, grads = _grads(lambda r, v: tb.FUNCTIONS["gae"](r, v, mask, 1.0, 0.9), [logp.bfloat16(), ref])
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32]
    _, grads = _grads(
        lambda x: tb.FUNCTIONS["token_logprobs"](
            x, torch.zeros(3, dtype=torch.long, device=DEVICE), 1.0, False, IGNORE, False
        )[0],
        [torch.randn(3, 7, device=DEVICE, dtype=torch.float16)],
    )
    assert grads[0].dtype == torch.float16


def test_non_differentiable_inputs_raise_instead_of_dropping_the_gradient():
    """A float mask that requires grad (possible only by calling the backend directly) is not
    silently given no gradient."""
    batch, length = 2, 4
    mask = torch.ones(batch, length, device=DEVICE, requires_grad=True)
    logp, ref, scores = (
        torch.randn(batch, length, device=DEVICE),
        torch.randn(batch, length, device=DEVICE),
        torch.randn(batch, device=DEVICE),
    )
    with pytest.raises(RuntimeError, match="not differentiable w.r.t. mask"):
        tb.FUNCTIONS["kl_penalized_rewards"](scores, logp.requires_grad_(), ref, mask, 0.1, "k1")[0].sum().backward()
    with pytest.raises(RuntimeError, match="not differentiable w.r.t. mask"):
        tb.FUNCTIONS["gae"](logp, ref, mask, 1.0, 0.9)[0].sum().backward()


def test_double_backward_raises():
    """The backward kernels have no gradient themselves: asking for one raises."""
    logits = torch.randn(3, 9, device=DEVICE, requires_grad=True)
    with pf.use_backend("triton"):
        logp = pf.token_logprobs(logits, torch.tensor([1, 2, 3], device=DEVICE))
    (grad,) = torch.autograd.grad(logp.sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        grad.sum().backward()


# --------------------------------------------------------------------------- float64 and hyper-parameters


@pytest.mark.parametrize("compiled", [False, True])
def test_float64_exact_with_hyper_parameters_not_representable_in_float32(compiled):
    """temperature 0.7, kl_coef 0.3, gamma 0.99, lam 0.95 reach the kernels as float32 pairs hi + lo:
    float64 results match the reference to float64 rounding, in eager mode (float32 kernel
    arguments) and under torch.compile (float64 ones)."""
    pf.available_backends()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64).to(DEVICE)
    labels = torch.randint(0, 11, (2, 3), generator=gen).to(DEVICE)
    logp, ref, values = (torch.randn(2, 3, generator=gen, dtype=torch.float64).to(DEVICE) for _ in range(3))
    scores = torch.randn(2, generator=gen, dtype=torch.float64).to(DEVICE)
    mask = torch.tensor([[True, False, True], [True, True, False]], device=DEVICE)

    def step(logits, logp, scores, values):
        lp, entropy = pf.token_logprobs(logits, labels, temperature=0.7, return_entropy=True)
        rewards, kl = pf.kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.3, kl_estimator="k2")
        advantages, returns = pf.gae(rewards, values, mask, gamma=0.99, lam=0.95)
        return lp, entropy, rewards, kl, advantages, returns

    results = {}
    for backend in ("reference", "triton"):
        with pf.use_backend(backend):
            torch._dynamo.reset()
            fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled and backend == "triton" else step
            results[backend] = _grads(fn, [logits, logp, scores, values])
    _assert_same(results["triton"], results["reference"], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- device guard and host syncs


def test_every_launch_runs_under_the_inputs_device_guard(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def spy(x):
        entered.append(x.device)
        with _launch.device_guard(x):
            yield

    for module in (triton_token_logprobs, triton_kl_penalized_rewards, triton_gae):
        monkeypatch.setattr(module, "device_guard", spy)
    logits = torch.randn(2, 3, 8, device=DEVICE, requires_grad=True)
    logp, entropy = tb.FUNCTIONS["token_logprobs"](
        logits, torch.ones(2, 3, dtype=torch.long, device=DEVICE), 1.0, True, IGNORE, False
    )
    (logp.sum() + entropy.sum()).backward()
    x, y = torch.randn(2, 3, device=DEVICE, requires_grad=True), torch.randn(2, 3, device=DEVICE, requires_grad=True)
    tb.FUNCTIONS["kl_estimate"](x, y, "k1").sum().backward()
    mask = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    sum(
        tb.FUNCTIONS["kl_penalized_rewards"](torch.zeros(2, device=DEVICE, requires_grad=True), x, y, mask, 0.1, "k2")
    ).sum().backward()
    sum(tb.FUNCTIONS["gae"](x, y, mask, 1.0, 0.9)).sum().backward()
    assert len(entered) == 8 and all(d == logits.device for d in entered)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tensors_on_the_second_gpu_while_the_first_is_current():
    dev = torch.device("cuda:1")
    torch.cuda.set_device(0)
    logits = torch.randn(4, 50, device=dev, requires_grad=True)
    labels = torch.randint(0, 50, (4,), device=dev)
    x, y = torch.randn(2, 6, device=dev, requires_grad=True), torch.randn(2, 6, device=dev, requires_grad=True)
    mask = torch.rand(2, 6, device=dev) < 0.7
    scores = torch.randn(2, device=dev, requires_grad=True)
    with pf.use_backend("triton"):
        outs = [
            pf.token_logprobs(logits, labels),
            pf.kl_estimate(x, y, "k3"),
            *pf.kl_penalized_rewards(scores, x, y, mask, kl_coef=0.1),
            *pf.gae(x, y, mask),
        ]
    sum(o.sum() for o in outs).backward()
    with pf.use_backend("reference"):
        want = [
            pf.token_logprobs(logits.detach().cpu(), labels.cpu()),
            pf.kl_estimate(x.detach().cpu(), y.detach().cpu(), "k3"),
            *pf.kl_penalized_rewards(
                scores.detach().cpu(), x.detach().cpu(), y.detach().cpu(), mask.cpu(), kl_coef=0.1
            ),
            *pf.gae(x.detach().cpu(), y.detach().cpu(), mask.cpu()),
        ]
    for o, w in zip(outs, want):
        assert o.device == dev
        torch.testing.assert_close(o.detach().cpu(), w, **TOL)
    assert all(t.grad.device == dev for t in (logits, x, y, scores))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are detectable on CUDA only")
def test_launchers_do_not_sync_with_the_host():
    logits = torch.randn(4, 3, 40, device="cuda", requires_grad=True)
    labels = torch.randint(0, 40, (4, 3), device="cuda")
    x, y = torch.randn(4, 3, device="cuda", requires_grad=True), torch.randn(4, 3, device="cuda", requires_grad=True)
    mask = torch.rand(4, 3, device="cuda") < 0.7
    scores = torch.randn(4, device="cuda", requires_grad=True)
    buffer = logits * 1  # a non-leaf, for the in-place backward
    tb.FUNCTIONS["token_logprobs"](buffer, labels, 1.0, True, IGNORE, False)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logp, entropy = tb.FUNCTIONS["token_logprobs"](buffer, labels, 1.0, True, IGNORE, True)
        outs = [
            logp,
            entropy,
            tb.FUNCTIONS["kl_estimate"](x, y, "k3"),
            *tb.FUNCTIONS["kl_penalized_rewards"](scores, x, y, mask, 0.1, "k2"),
            *tb.FUNCTIONS["gae"](x, y, mask, 1.0, 0.9),
        ]
        torch.autograd.backward([o.sum() for o in outs])
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------- custom-op registration


def _opcheck_cases():
    """Every custom op (forward and backward) on strided inputs: the fake kernels must give the real outputs' strides."""
    x = torch.randn(6, 4, device=DEVICE).t().requires_grad_()
    y = torch.randn(4, 6, device=DEVICE, requires_grad=True)
    mask = torch.rand(4, 6, device=DEVICE) < 0.6
    scores = torch.randn(4, device=DEVICE, requires_grad=True)
    logits = torch.randn(2, 5, 9, device=DEVICE).transpose(0, 1).requires_grad_()
    labels = torch.randint(0, 9, (5, 2), device=DEVICE)
    _, entropy, stats = triton_token_logprobs._token_logprobs_op(logits.detach(), labels, 0.7, True, IGNORE, False)
    g = torch.randn(2, 5, device=DEVICE).t()
    g_t = torch.randn(6, 4, device=DEVICE).t()
    last = torch.tensor([5, 4, 3, -1], dtype=torch.int32, device=DEVICE)
    return [
        ("kl_estimate", triton_kl_penalized_rewards._kl_estimate_op, (x, y, "k3")),
        ("kl_penalized_rewards", triton_kl_penalized_rewards._kl_penalized_rewards_op, (scores, x, y, mask, 0.1, "k2")),
        ("gae", triton_gae._gae_op, (x, y, mask, 0.9, 0.8)),
        ("token_logprobs", triton_token_logprobs._token_logprobs_op, (logits, labels, 0.7, True, IGNORE, False)),
        (
            "token_logprobs no entropy",
            triton_token_logprobs._token_logprobs_op,
            (logits, labels, 0.7, False, IGNORE, False),
        ),
        (
            "token_logprobs_backward",
            triton_token_logprobs._token_logprobs_backward_op,
            (g, g[:1].expand(5, 2), logits.detach(), labels, stats, entropy, 0.7, IGNORE),
        ),
        (
            "token_logprobs_backward entropy only",
            triton_token_logprobs._token_logprobs_backward_op,
            (None, g, logits.detach(), labels, stats, entropy, 0.7, IGNORE),
        ),
        ("kl_estimate_backward", triton_kl_penalized_rewards._kl_estimate_backward_op, (g_t, x.detach(), y.detach(), "k3")),
        (
            "kl_penalized_rewards_backward",
            triton_kl_penalized_rewards._kl_penalized_rewards_backward_op,
            (g_t, None, x.detach(), y.detach(), mask, last, 0.1, "k2", torch.bfloat16),
        ),
        (
            "kl_penalized_rewards_backward kl only",
            triton_kl_penalized_rewards._kl_penalized_rewards_backward_op,
            (None, g_t, x.detach(), y.detach(), mask, last, 0.1, "k2", torch.bfloat16),
        ),
        ("gae_backward", triton_gae._gae_backward_op, (g_t, None, mask, 0.9, 0.8, torch.float32, torch.float16)),
    ]


@pytest.mark.parametrize("case", range(11))
def test_custom_ops_pass_opcheck(case):
    """Schema, autograd registration, fake tensors (shapes, dtypes and strides as the real
    outputs) and AOT dispatch with dynamic shapes, as torch.compile relies on them."""
    name, op, args = _opcheck_cases()[case]
    result = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in result.values()), (name, result)
