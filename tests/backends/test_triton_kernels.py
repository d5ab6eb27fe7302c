"""What only the Triton kernels can get wrong: blocks and tiles crossed, bf16 pairs read as
words, ``inplace_backward``'s aliasing, reads without copies, incoming gradients in any
layout, float64 hyper-parameters as float32 pairs, the device guard, the custom ops'
registration; and the strides, dtypes and values that the conformance matrix
(tests/test_conformance.py, every cross-backend rule) does not build.  Without a GPU the
kernels run in the interpreter (conftest sets TRITON_INTERPRET=1): shapes stay small."""

import contextlib
import itertools
import math
import os
from itertools import cycle

import pytest
import tiers
import torch

pytest.importorskip("triton")

import ppo_fast as pf  # noqa: E402
from ppo_fast._sampling import NO_TRUNCATION  # noqa: E402
from ppo_fast.backends import _head_plan as head_plan  # noqa: E402
from ppo_fast.backends import backend_info, reference, resolved_backend_name  # noqa: E402
from ppo_fast.backends import triton as tb  # noqa: E402
from ppo_fast.backends.triton import _gemm_head as gemm_head  # noqa: E402
from ppo_fast.backends.triton import _launch  # noqa: E402
from ppo_fast.backends.triton import gae as tgae  # noqa: E402
from ppo_fast.backends.triton import kl_penalized_rewards as tkl  # noqa: E402
from ppo_fast.backends.triton import linear_token_logprobs as tlin  # noqa: E402
from ppo_fast.backends.triton import token_logprobs as tlp  # noqa: E402
from ppo_fast.spec import KL_ESTIMATORS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IGNORE = -100
TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)
F, R = tb.FUNCTIONS, reference.FUNCTIONS


def rand(*shape, dtype=torch.float32):
    return torch.randn(shape, device=DEVICE).to(dtype)


def ints(high, *shape, ignored=()):
    labels = torch.randint(0, high, shape, device=DEVICE)
    for index in ignored:
        labels[index] = IGNORE
    return labels


def _grads(fn, leaves, weights=None):
    """``fn(*leaves)``'s outputs and the gradients w.r.t. ``leaves`` of a (random) weighting of them."""
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    outs = fn(*leaves)
    outs = tuple(o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None)
    if weights is None:
        gen = torch.Generator(device=DEVICE).manual_seed(7)
        weights = [torch.randn(o.shape, generator=gen, device=DEVICE).to(o.dtype) for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, leaves, allow_unused=True))


def _assert_same(actual, expected, grad_tol=None, **tol):
    """Outputs and gradients of two ``_grads`` results agree (a None gradient on both sides)."""
    for i, (a, e) in enumerate(zip(actual[0] + actual[1], expected[0] + expected[1])):
        assert (a is None) == (e is None)
        if e is not None:
            assert a.dtype == e.dtype
            close = (grad_tol if i >= len(actual[0]) else None) or tol or TOL
            torch.testing.assert_close(a, e, equal_nan=True, **close)


def _vs_reference(call, leaves, **tol):
    """``call(functions, *leaves)`` with the Triton and the reference backend functions agree."""
    got = _grads(lambda *x: call(F, *x), leaves)
    _assert_same(got, _grads(lambda *x: call(R, *x), leaves), **tol)
    return got


def test_registered_for_cuda_and_never_auto_for_cpu_tensors():
    info = backend_info("triton")
    assert info.available, info.detail  # triton imports here, so a failure is a bug, not a skip
    for op, devices in info.module.SUPPORTED.items():
        assert "cuda" in devices and ("cpu" in devices) == (not torch.cuda.is_available()), op
        assert resolved_backend_name(op, "cpu") != "triton", op  # the interpreter is for tests
    assert resolved_backend_name("linear_token_logprobs", "cuda") == "triton"


# --------------------------------------------------------------------------- what the matrix does not build


def _layout_cases():
    """name -> (leaves, call): strides the matrix's layouts never give (stride (0, 0), 0-d, 1-D,
    3-D, a flat strided label view), operands of one call in different layouts, int masks."""
    mask = torch.rand(3, 11, device=DEVICE) < 0.6
    mask[0], mask[1, -1] = False, True
    int_mask = torch.cat([mask[:, :1], mask], 1)[:, 1:].long()  # a shifted int64 view
    t_mask = mask.t().contiguous().t()

    def lp(labels):
        return lambda f, x: f["token_logprobs"](x, labels, 0.8, True, IGNORE, False)

    def kl(view_a, view_b=None):
        return lambda f, a, b: f["kl_estimate"](view_a(a), (view_b or view_a)(b), "k3")

    def seq(op, m, scores=None):
        """A sliced and a transposed operand, mask ``m`` (bool for the reference), strided scores."""
        rest = (0.25, "k3") if op == "kl_penalized_rewards" else (0.9, 0.8)
        return lambda f, *x: f[op](*map(scores, x[:-2]), x[-2][:, 1::2], x[-1].t(), m if f is F else m != 0, *rest)

    two = [rand(3, 22), rand(11, 3)]
    return {
        "labels-stride-0-0": ([rand(2, 5, 19)], lp(torch.tensor(5, device=DEVICE).expand(2, 5))),
        "labels-shifted-int32": ([rand(2, 5, 19)], lp(ints(19, 2, 6, ignored=[(0, 2)]).int()[:, 1:])),
        "labels-flat-strided": ([rand(10, 19)], lp(ints(19, 2, 5, 2, ignored=[(0, 1, 1)])[..., 1].reshape(-1))),
        "kl-3d-permuted": ([rand(3, 4, 5), rand(3, 4, 5)], kl(lambda x: x.permute(2, 0, 1))),
        "kl-0d-expanded": ([rand(), rand()], kl(lambda x: x.expand(4, 6))),
        "kl-0d": ([rand(), rand()], kl(lambda x: x)),
        "kl-1d-strided-and-contiguous": ([rand(12), rand(4)], kl(lambda x: x[1::3], lambda x: x)),
        "rewards-transposed-mask": ([rand(3, 2), *two], seq("kl_penalized_rewards", t_mask, lambda s: s[:, 1])),
        "rewards-int-mask": ([rand(1), *two], seq("kl_penalized_rewards", int_mask, lambda s: s.expand(3))),
        "gae-transposed-mask": (two, seq("gae", t_mask)),
        "gae-int-mask": (two, seq("gae", int_mask)),
    }


LAYOUT_CASES = ["labels-stride-0-0", "labels-shifted-int32", "labels-flat-strided", "kl-3d-permuted", "kl-0d-expanded"]
LAYOUT_CASES += ["kl-0d", "kl-1d-strided-and-contiguous", "rewards-transposed-mask", "rewards-int-mask"]
LAYOUT_CASES += ["gae-transposed-mask", "gae-int-mask"]


@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_inputs_in_layouts_the_matrix_does_not_build(case):
    cases = _layout_cases()
    assert list(cases) == LAYOUT_CASES
    leaves, call = cases[case]
    _vs_reference(call, leaves)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", ["vocab stride 3", "vocab-major"])
def test_logits_with_a_vocabulary_stride(name, inplace):
    """Read in place; vocab-major logits are dense, so their gradient is written in place too."""
    leaf, view = (rand(2, 5, 57), lambda x: x[..., ::3]) if name == "vocab stride 3" else (rand(19, 4), lambda x: x.t())
    labels = ints(19, *view(leaf).shape[:-1])
    labels.view(-1)[0] = IGNORE
    _vs_reference(lambda f, x: f["token_logprobs"](view(x * 1), labels, 0.8, True, IGNORE, inplace), [leaf])


def _one_output_cases():
    labels, mask = ints(33, 4, 6, ignored=[(0, 0)]), torch.rand(4, 6, device=DEVICE) < 0.6
    return {
        "token_logprobs": ([rand(4, 6, 33)], lambda f, x: f["token_logprobs"](x, labels, 0.5, True, IGNORE, False)),
        "linear_token_logprobs": (
            [rand(24, 9), rand(33, 9), rand(33)],
            lambda f, h, w, b: f["linear_token_logprobs"](
                h, w, labels.view(-1), bias=b, temperature=0.8, return_entropy=True
            ),
        ),
        "kl_penalized_rewards": (
            [rand(4), rand(4, 6), rand(4, 6)],
            lambda f, s, a, b: f["kl_penalized_rewards"](s, a, b, mask, 0.25, "k3"),
        ),
        "gae": ([rand(4, 6), rand(4, 6)], lambda f, r, v: f["gae"](r, v, mask, 0.95, 0.9)),
    }


@pytest.mark.parametrize("output", [0, 1])
@pytest.mark.parametrize("op", ["token_logprobs", "linear_token_logprobs", "kl_penalized_rewards", "gae"])
def test_gradient_of_one_output_only(op, output):
    """The other output's incoming gradient is None (the scores reach only the rewards, as in the reference)."""
    leaves, call = _one_output_cases()[op]
    _vs_reference(lambda f, *x: call(f, *x)[output], leaves, rtol=2e-5, atol=2e-5)


def test_linear_gradient_of_the_hidden_states_only():
    """A head and a bias that need no gradient, and no entropy."""
    weight, bias, labels = rand(33, 9), rand(33), ints(33, 7)
    _vs_reference(lambda f, h: f["linear_token_logprobs"](h, weight, labels, bias=bias)[0], [rand(7, 9)])


def test_gradient_dtypes_follow_each_input():
    mask = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    bf16, f16, f32 = (-torch.rand(2, 5, device=DEVICE).to(d) for d in (torch.bfloat16, torch.float16, torch.float32))
    cases = [
        ([rand(2, dtype=torch.bfloat16), f16, f32], lambda f, *x: f["kl_penalized_rewards"](*x, mask, 0.1, "k2")),
        ([f16, f32.double()], lambda f, a, b: f["kl_estimate"](a, b, "k3")),
        ([bf16, f32.double()], lambda f, a, b: f["kl_estimate"](a, b, "k3")),
        ([bf16, f32], lambda f, r, v: f["gae"](r, v, mask, 1.0, 0.9)),
    ]
    for leaves, call in cases:
        _, grads = _vs_reference(call, leaves, **BF16_TOL)
        assert [g.dtype for g in grads] == [x.dtype for x in leaves]


@pytest.mark.parametrize("kl_estimator", KL_ESTIMATORS)
def test_kl_estimate_of_infinite_log_probs(kl_estimator):
    logp = torch.tensor([-math.inf, -1.0, -math.inf, math.nan, -2.0], device=DEVICE)
    ref = torch.tensor([-1.0, -math.inf, -math.inf, -1.0, -2.0], device=DEVICE)
    want = R["kl_estimate"](logp, ref, kl_estimator)
    torch.testing.assert_close(F["kl_estimate"](logp, ref, kl_estimator), want, equal_nan=True)


def test_extreme_logits_match_reference():
    """Huge spreads, -inf (chosen or not), NaN, near float32's limit, uniform: outputs and gradients
    as the reference's; a chosen -inf gives -inf, a finite entropy and gradient; NaN stays in its row."""
    logits, labels = rand(8, 40), ints(39, 8) + 1
    logits[0] *= 1e4
    logits[1] -= 1e4
    logits[2, 0] = logits[4, 5:] = logits[3, labels[3]] = -math.inf
    logits[5, 3], logits[6, 0], logits[7] = math.nan, 3e38, 0.0
    call = lambda f, x: f["token_logprobs"](x, labels, 1.0, True, IGNORE, False)  # noqa: E731
    (logp, entropy), (grad,) = _vs_reference(call, [logits])
    assert logp[3] == -math.inf and torch.isfinite(entropy[3]) and torch.isfinite(grad[3]).all()
    assert torch.isnan(logp[5]) and torch.isnan(entropy[5]) and torch.isnan(grad[5]).all()
    others = torch.arange(8, device=DEVICE) != 5
    assert not logp[others].isnan().any() and not entropy[others].isnan().any() and grad[others].isfinite().all()


@pytest.mark.parametrize("case", [f"kl_penalized_rewards-{e}" for e in KL_ESTIMATORS] + ["gae"])
def test_masked_values_and_incoming_gradients_reach_nothing(case):
    """NaN/inf inputs and NaN incoming gradients at masked positions (and the score of a row
    without valid tokens): every output and gradient bit for bit the clean run's, 0 there."""
    op, _, estimator = case.partition("-")
    mask = torch.rand(3, 9, device=DEVICE) < 0.6
    mask[:, 0], mask[:, 1], mask[2] = False, True, False
    scores, a, b, g = rand(3), -torch.rand(3, 9, device=DEVICE), -torch.rand(3, 9, device=DEVICE), rand(3, 9)

    def run(s, a, b, grad):
        leaves = [x.clone().requires_grad_() for x in ((s, a, b) if op != "gae" else (a, b))]
        outs = F[op](*leaves, mask, *((0.1, estimator) if op != "gae" else (0.97, 0.9)))
        torch.autograd.backward(list(outs), [grad, grad])
        return [o.detach() for o in outs] + [x.grad for x in leaves]

    clean = run(scores, a, b, g)
    scores[2] = math.nan
    dirty = run(scores, *(x.masked_fill(~mask, v) for x, v in ((a, math.nan), (b, -math.inf), (g, math.nan))))
    assert all(torch.equal(x, y) for x, y in zip(clean, dirty))
    assert all((grad[~mask] == 0).all() for grad in dirty[-2:])


# --------------------------------------------------------------------------- token_logprobs: blocks, words, copies


@pytest.mark.parametrize("block_v", [16, 64])
def test_small_vocab_blocks_match_reference(block_v):
    """Many BLOCK_V iterations per row (the online max / sum-exp across blocks), forward and backward."""
    logits = 4 * rand(6, 203)
    logits[0, :150] -= 30.0  # the running max changes late in the row
    labels = ints(203, 6, ignored=[2])
    logp, entropy, stats = tlp.token_logprobs_forward(logits, labels, 0.9, True, IGNORE, block_v=block_v)
    g = rand(6), rand(6)
    grad = tlp.token_logprobs_backward(
        *g, logits, labels, stats, entropy, temperature=0.9, ignore_index=IGNORE, block_v=block_v
    )
    want = _grads(lambda x: reference.token_logprobs(x, labels, 0.9, True, IGNORE), [logits], g)
    _assert_same(([logp, entropy], [grad]), want, grad_tol=dict(rtol=1e-5, atol=1e-6))
    # stats: the row's max logit and log(sum(exp((logits - max) / T))), whose sum with max / T is the logsumexp
    valid = labels != IGNORE  # ignored rows read no logits, so they have no stats
    lse = stats[..., 0] / 0.9 + stats[..., 1]
    torch.testing.assert_close(lse[valid], torch.logsumexp(logits / 0.9, -1)[valid], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("vocab, group", [(64, 8), (68, 4), (66, 2), (67, 1)])
def test_bf16_pairs_read_as_words_match_reference(vocab, group):
    """bf16 rows read as 32-bit words (two logits each) in 8-, 4- and 2-wide groups, and the
    element path of an odd V: whole blocks and the tail, forward and both gradients."""
    logits = (3 * rand(5, vocab)).bfloat16()
    logits[1, 5] = -math.inf
    assert tlp._group(16, 1, (logits, vocab, 0)) == group
    labels = ints(vocab, 5, ignored=[3])
    logp, entropy, stats = tlp.token_logprobs_forward(logits, labels, 0.8, True, IGNORE, block_v=16)
    g = rand(5), rand(5)
    grad = tlp.token_logprobs_backward(
        *g, logits, labels, stats, entropy, temperature=0.8, ignore_index=IGNORE, block_v=16
    )
    want = _grads(lambda x: reference.token_logprobs(x, labels, 0.8, True, IGNORE), [logits], g)
    _assert_same(([logp, entropy], [grad]), want, grad_tol=BF16_TOL)


def test_forward_reads_strided_logits_without_a_copy(monkeypatch):
    """No [N, V] copy of strided logits: the kernel gets the caller's storage."""
    seen, kernel = [], tlp._token_logprobs_fwd_kernel

    class Spy:
        def __getitem__(self, grid):
            return lambda logits, *args, **kw: seen.append(logits.data_ptr()) or kernel[grid](logits, *args, **kw)

    monkeypatch.setattr(tlp, "_token_logprobs_fwd_kernel", Spy())
    for shape, view in [
        ((2, 6, 19), lambda x: x[:, :-1]),
        ((5, 2, 19), lambda x: x.transpose(0, 1)),
        ((19, 4), lambda x: x.t()),
        ((2, 5, 57), lambda x: x[..., ::3]),
        ((1, 5, 19), lambda x: x.expand(3, 5, 19)),
        ((8, 19), lambda x: x[::2]),
    ]:
        logits = view(rand(*shape))
        labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=DEVICE)
        tlp.token_logprobs_forward(logits, labels, 1.0, True, IGNORE)
        assert seen.pop() == logits.data_ptr()
        if logits.stride(-1) == 1:  # (the public op hands the launcher a unit vocabulary stride)
            with pf.use_backend("triton"):
                pf.token_logprobs(logits, labels)
            assert seen.pop() == logits.data_ptr()


# --------------------------------------------------------------------------- backward launchers: incoming gradients


def _backward_case(op, block):
    """(launch(g1, g2, strided) -> gradients, the reference's function, its leaves)."""
    mask = torch.rand(3, 11, device=DEVICE) < 0.5
    mask[2], mask[1, :2] = False, True
    a, b, scores = rand(3, 11), rand(3, 11), rand(3)
    if op == "token_logprobs":
        logits, labels = rand(3, 11, 21), ints(21, 3, 11, ignored=[(0, 3)])
        _, entropy, stats = tlp.token_logprobs_forward(logits, labels, 1.3, True, IGNORE, block_v=block)
        strided_residuals = torch.stack([entropy, entropy], -1)[..., 1], labels.t().contiguous().t()

        def launch(g1, g2, strided=False):
            ent, lab = strided_residuals if strided else (entropy, labels)
            return [
                tlp.token_logprobs_backward(
                    g1, g2, logits, lab, stats, ent, temperature=1.3, ignore_index=IGNORE, block_v=block
                )
            ]

        return launch, lambda x: reference.token_logprobs(x, labels, 1.3, True, IGNORE), [logits]
    if op == "kl_estimate":
        b_t = b.t().contiguous().t()
        return (
            lambda g1, g2, strided=False: tkl.kl_estimate_backward(g1, a, b_t if strided else b, "k2"),
            lambda x, y: reference.kl_estimate(x, y, "k2"),
            [a, b],
        )
    if op == "kl_penalized_rewards":
        last = tkl.kl_penalized_rewards_forward(scores, a, b, mask, 0.3, "k2", block_t=block)[2]
        return (
            lambda *g, strided=False: tkl.kl_penalized_rewards_backward(
                *g, a, b, mask, last, kl_coef=0.3, kl_estimator="k2", scores_dtype=torch.float32, block_t=block
            ),
            lambda s, x, y: reference.kl_penalized_rewards(s, x, y, mask, 0.3, "k2"),
            [scores, a, b],
        )
    return (
        lambda *g, strided=False: tgae.gae_backward(
            *g, mask, 0.9, 0.8, rewards_dtype=torch.float32, values_dtype=torch.bfloat16, block_t=block
        ),
        lambda r, v: reference.gae(r, v, mask, 0.9, 0.8),
        [a, b.bfloat16()],
    )


@pytest.mark.parametrize("small_blocks", [True, pytest.param(False, marks=pytest.mark.full)])  # fast tier: the carries
@pytest.mark.parametrize("op", ["token_logprobs", "kl_estimate", "kl_penalized_rewards", "gae"])
def test_backward_launchers_read_incoming_gradients_in_any_layout(op, small_blocks):
    """Transposed, sliced, expanded and stride-0 incoming gradients (and a None one) give bit for
    bit the gradients of their contiguous copies, which are the reference's; small blocks carry."""
    block = {"token_logprobs": 8, "kl_penalized_rewards": 4, "gae": 2}.get(op) if small_blocks else None
    launch, ref, leaves = _backward_case(op, block)
    base = rand(3, 11)
    layouts = [
        lambda g: g.t().contiguous().t(),
        lambda g: torch.stack([g, g], -1)[..., 1],
        lambda g: g[:1].expand_as(g),
        lambda g: g[0, 0].expand_as(g),
    ]
    pairs = [(base, None)] + ([(None, base), (base, 2 * base + 1)] if op != "kl_estimate" else [])
    # The fast tier: each layout and each pair once (the full tier: every layout with every pair).
    combos = itertools.product(pairs, layouts) if os.environ.get("PPO_FAST_FULL") == "1" else zip(cycle(pairs), layouts)
    for pair, layout in combos:
        laid = [None if g is None else layout(g) for g in pair]
        want = launch(*[None if g is None else g.contiguous() for g in laid])
        got = launch(*laid, strided=True)
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(got, want))
    for pair in pairs:
        weights = [torch.zeros_like(base) if g is None else g for g in pair][: 1 if op == "kl_estimate" else 2]
        for x, e in zip(launch(*pair), _grads(ref, leaves, weights)[1]):
            if x is None:  # no incoming gradient of the rewards: none of the scores
                assert e is None or not e.any()
            else:
                assert x.dtype == e.dtype
                torch.testing.assert_close(x, e, **(BF16_TOL if x.dtype == torch.bfloat16 else TOL))


# --------------------------------------------------------------------------- inplace_backward


@pytest.mark.parametrize(
    "layout, dtype",
    [("contiguous", torch.float32), ("contiguous", torch.bfloat16), ("transposed", torch.float32)]
    + [("sliced", torch.float32)],
)
def test_inplace_backward_writes_only_into_dense_memory(layout, dtype):
    """In place, a dense non-leaf logits buffer then holds the gradient (the memory saving is
    real); a buffer with gaps is left alone; the gradient is the same bit for bit.  (Shared rows,
    expanded logits: tests/test_conformance.py's test_inplace_backward_on_expanded_logits_...)"""
    make = {
        "contiguous": lambda y: y,
        "transposed": lambda y: y.transpose(0, 1).contiguous().transpose(0, 1),
        "sliced": lambda y: torch.cat([y, y[:, :1]], 1)[:, :3],
    }[layout]
    dense = layout in ("contiguous", "transposed")
    base, labels, weights = (2 * rand(2, 3, 17)).to(dtype), ints(17, 2, 3), rand(2, 3)
    grads = {}
    for inplace in (False, True):
        leaf = base.clone().requires_grad_()
        buffer = make(leaf * 1)  # a non-leaf the backward may overwrite
        assert _launch.is_non_overlapping_and_dense(buffer) == dense
        before = buffer.detach().clone()
        logp, entropy = F["token_logprobs"](buffer, labels, 1.0, True, IGNORE, inplace)
        ((logp * weights).sum() + entropy.sum()).backward()
        grads[inplace] = leaf.grad
        assert torch.equal(buffer.detach(), before) != (inplace and dense)
        assert not (inplace and dense) or torch.equal(buffer.detach(), leaf.grad)
    assert torch.equal(grads[True], grads[False])
    want = _grads(lambda x: reference.token_logprobs(make(x), labels, 1.0, True, IGNORE), [base], [weights, 1.0])
    torch.testing.assert_close(grads[True], want[1][0], **(BF16_TOL if dtype == torch.bfloat16 else TOL))


def test_inplace_backward_under_torch_compile():
    """The in-place decision is made on the traced (fake) logits' strides: expanded logits get
    an allocated gradient, a dense buffer the in-place one; both right."""
    pf.available_backends()

    def step(base, full, labels):
        expanded = pf.token_logprobs(base.expand(4, 3, 11), labels, inplace_backward=True)
        dense = pf.token_logprobs(full * 1, labels, inplace_backward=True)
        return expanded.sum() + (dense * torch.arange(3, device=DEVICE)).sum()

    base, full, labels = rand(1, 3, 11), rand(4, 3, 11), ints(11, 4, 3)
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
    x, dense = torch.empty(3, 4, 5), _launch.is_non_overlapping_and_dense
    assert dense(x) and dense(x.permute(2, 0, 1)) and dense(x[:1]) and dense(torch.empty(0, 5).expand(0, 5))
    assert not any(
        map(dense, (x[:, :2], x[..., ::2], x[:1].expand(3, 4, 5), torch.empty(4).as_strided((3, 2), (1, 1))))
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are detectable on CUDA only")
def test_inplace_backward_does_not_sync_with_the_host():
    """(Every public op: backends/test_cuda_no_host_sync.py.)"""
    buffer, labels = torch.randn(4, 3, 40, device="cuda", requires_grad=True) * 1, ints(40, 4, 3)
    F["token_logprobs"](buffer, labels, 1.0, True, IGNORE, True)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.backward([o.sum() for o in F["token_logprobs"](buffer, labels, 1.0, True, IGNORE, True)])
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------- kl_penalized_rewards and GAE: chunks


@pytest.mark.parametrize("block_t", [4, 8])
def test_kl_rewards_kernel_chunks(block_t):
    """Small chunks: the last valid token is found in the first chunk from the end that has one."""
    logp, ref, scores, mask = rand(6, 29), rand(6, 29), rand(6), torch.rand(6, 29, device=DEVICE) < 0.7
    mask[0], mask[1], mask[1, 14], mask[2], mask[2, :3], mask[3] = False, False, True, False, True, True
    rewards, kl, last = tkl.kl_penalized_rewards_forward(scores, logp, ref, mask, 0.1, "k3", block_t=block_t)
    want = reference.kl_penalized_rewards(scores, logp, ref, mask, 0.1, "k3")
    torch.testing.assert_close((rewards, kl), want, rtol=1e-6, atol=1e-6)
    expected_last, has_valid = reference.last_valid_index(mask)
    assert last.tolist() == torch.where(has_valid, expected_last, -1).tolist()


@pytest.mark.parametrize("block_t", [2, 16])
def test_gae_kernel_carries_across_chunks(block_t):
    """Masked runs that span chunk borders pass the advantage and the next valid value through."""
    rewards, values, mask = rand(5, 41), rand(5, 41), torch.rand(5, 41, device=DEVICE) < 0.5
    mask[0], mask[1], mask[1, 20], mask[2, 5:30], mask[3], mask[4, -7:] = False, False, True, False, True, False
    got = tgae.gae_forward(rewards, values, mask, 0.97, 0.9, block_t=block_t)
    torch.testing.assert_close(got, reference.gae(rewards, values, mask, 0.97, 0.9), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- differentiability, float64 (second order: tests/test_edge_values.py)


def test_non_differentiable_inputs_raise_instead_of_dropping_the_gradient():
    """A float mask that requires grad (possible only by calling the backend directly) is not silently given none."""
    mask, logp, ref = torch.ones(2, 4, device=DEVICE, requires_grad=True), rand(2, 4).requires_grad_(), rand(2, 4)
    with pytest.raises(RuntimeError, match="not differentiable w.r.t. mask"):
        F["kl_penalized_rewards"](rand(2), logp, ref, mask, 0.1, "k1")[0].sum().backward()
    with pytest.raises(RuntimeError, match="not differentiable w.r.t. mask"):
        F["gae"](logp, ref, mask, 1.0, 0.9)[0].sum().backward()


def test_float64_exact_under_torch_compile_with_hyper_parameters_not_representable_in_float32():
    """temperature 0.7, kl_coef 0.3, gamma 0.99, lam 0.95 reach the kernels as float32 pairs hi + lo:
    float64 results match the reference to float64 rounding under torch.compile (float64 kernel
    arguments; in eager mode, float32 ones: the conformance matrix's float64 cells, at these values)."""
    pf.available_backends()
    logits, logp, ref, values, scores = (rand(*s, dtype=torch.float64) for s in [(2, 3, 11)] + 3 * [(2, 3)] + [(2,)])
    labels, mask = ints(11, 2, 3), torch.tensor([[True, False, True], [True, True, False]], device=DEVICE)

    def step(logits, logp, scores, values):
        lp, entropy = pf.token_logprobs(logits, labels, temperature=0.7, return_entropy=True)
        rewards, kl = pf.kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.3, kl_estimator="k2")
        return lp, entropy, rewards, kl, *pf.gae(rewards, values, mask, gamma=0.99, lam=0.95)

    results = {}
    for backend in ("reference", "triton"):
        with pf.use_backend(backend):
            torch._dynamo.reset()
            fn = torch.compile(step, fullgraph=True, backend="aot_eager") if backend == "triton" else step
            results[backend] = _grads(fn, [logits, logp, scores, values])
    _assert_same(results["triton"], results["reference"], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- device guard, custom ops


def test_every_launch_runs_under_the_inputs_device_guard(monkeypatch):
    entered = []

    def spy(name):
        @contextlib.contextmanager
        def guard(x):
            entered.append((name.rsplit(".", 1)[1], x.device))
            with _launch.device_guard(x):
                yield

        return guard

    for module in tb.MODULES:
        monkeypatch.setattr(module, "device_guard", spy(module.__name__))
    x, y, mask, labels = rand(2, 3), rand(2, 3), torch.ones(2, 3, dtype=torch.bool, device=DEVICE), ints(8, 2, 3)
    x.requires_grad_(), y.requires_grad_()
    outs = [
        *F["token_logprobs"](rand(2, 3, 8).requires_grad_(), labels, 1.0, True, IGNORE, False),
        *F["linear_token_logprobs"](rand(6, 4).requires_grad_(), rand(8, 4), labels.view(-1), return_entropy=True),
        F["kl_estimate"](x, y, "k1"),
        *F["kl_penalized_rewards"](rand(2).requires_grad_(), x, y, mask, 0.1, "k2"),
        *F["gae"](x, y, mask, 1.0, 0.9),
        F["group_sum"](x, torch.tensor([0, 0], device=DEVICE)),
    ]
    sum(o.sum() for o in outs).backward()
    assert all(device == x.device for _, device in entered)
    ops = ["token_logprobs", "linear_token_logprobs", "kl_penalized_rewards", "kl_penalized_rewards", "gae"]
    assert sorted(name for name, _ in entered) == sorted(2 * (ops + ["group_advantages"]))  # forward and backward


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gradients_on_the_second_gpu_while_the_first_is_current():
    """(The forward of every public op: backends/test_cuda_no_host_sync.py.)"""
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    logits, x, y, scores = (torch.randn(*s, device=dev, requires_grad=True) for s in [(4, 50), (2, 6), (2, 6), (2,)])
    labels, mask = torch.randint(0, 50, (4,), device=dev), torch.rand(2, 6, device=dev) < 0.7
    with pf.use_backend("triton"):
        outs = [pf.token_logprobs(logits, labels), pf.kl_estimate(x, y, "k3")]
        outs += [*pf.kl_penalized_rewards(scores, x, y, mask, kl_coef=0.1), *pf.gae(x, y, mask)]
    sum(o.sum() for o in outs).backward()
    assert all(t.grad.device == dev for t in (logits, x, y, scores))


def _opcheck_cases():
    """Every custom op (forward and backward) on strided inputs: the fake kernels must give the real outputs' strides."""
    x, y = torch.randn(6, 4, device=DEVICE).t().requires_grad_(), rand(4, 6).requires_grad_()
    mask, scores, labels = torch.rand(4, 6, device=DEVICE) < 0.6, rand(4).requires_grad_(), ints(9, 5, 2)
    logits = torch.randn(2, 5, 9, device=DEVICE).transpose(0, 1).requires_grad_()
    _, entropy, stats, _ = tlp._token_logprobs_op(logits.detach(), labels, 0.7, True, IGNORE, False)
    g, g_t = torch.randn(2, 5, device=DEVICE).t(), torch.randn(6, 4, device=DEVICE).t()
    saved = (logits.detach(), labels, stats, entropy, 0.7, IGNORE)
    last = torch.tensor([5, 4, 3, -1], dtype=torch.int32, device=DEVICE)
    residuals = (x.detach(), y.detach(), mask, last, 0.1, "k2", torch.bfloat16)
    cu_seqlens = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32, device=DEVICE)  # an empty segment among them
    packed = (torch.randn(18, device=DEVICE)[::2].requires_grad_(), rand(9).requires_grad_(), rand(9) > 0, cu_seqlens)
    hyper, dtypes = {"gamma": 0.9, "lam": 0.8}, {"rewards_dtype": torch.float32, "values_dtype": torch.float16}
    return {
        "kl_estimate": (tkl._kl_estimate_op, (x, y, "k3")),
        "kl_penalized_rewards": (tkl._kl_penalized_rewards_op, (scores, x, y, mask, 0.1, "k2")),
        "gae": (tgae._gae_op, (x, y, mask, 0.9, 0.8)),
        "token_logprobs": (tlp._token_logprobs_op, (logits, labels, 0.7, True, IGNORE, False)),
        "token_logprobs no entropy": (tlp._token_logprobs_op, (logits, labels, 0.7, False, IGNORE, False)),
        "token_logprobs truncated": (tlp._token_logprobs_op, (logits, labels, 0.7, True, IGNORE, False, 3, 0.9, 0.1)),
        "token_logprobs_backward": (tlp._token_logprobs_backward_op, (g, g[:1].expand(5, 2), *saved)),
        "token_logprobs_backward entropy only": (tlp._token_logprobs_backward_op, (None, g, *saved)),
        "kl_estimate_backward": (tkl._kl_estimate_backward_op, (g_t, x.detach(), y.detach(), "k3")),
        "kl_penalized_rewards_backward": (tkl._kl_penalized_rewards_backward_op, (g_t, None, *residuals)),
        "kl_penalized_rewards_backward kl only": (tkl._kl_penalized_rewards_backward_op, (None, g_t, *residuals)),
        "gae_backward": (tgae._gae_backward_op, (g_t, None, mask, 0.9, 0.8, torch.float32, torch.float16)),
        "gae_varlen": (tgae._gae_varlen_op, (*packed, None), hyper),
        "gae_varlen max_seqlen": (tgae._gae_varlen_op, (*packed, 4), hyper),
        "gae_varlen_backward": (
            tgae._gae_varlen_backward_op,
            (None, packed[1].detach(), *packed[2:], 4),
            {**hyper, **dtypes},
        ),
    }


OPCHECK_CASES = ["kl_estimate", "kl_penalized_rewards", "gae", "token_logprobs", "token_logprobs no entropy"]
OPCHECK_CASES += ["token_logprobs truncated"]
OPCHECK_CASES += ["token_logprobs_backward", "token_logprobs_backward entropy only", "kl_estimate_backward"]
OPCHECK_CASES += ["kl_penalized_rewards_backward", "kl_penalized_rewards_backward kl only", "gae_backward"]
OPCHECK_CASES += ["gae_varlen", "gae_varlen max_seqlen", "gae_varlen_backward"]


# The fast tier on the CPU: "gae_varlen max_seqlen" checks the same operator (its AOT dispatch without
# max_seqlen: 15 s here).  On a GPU (bench/gpu_check.sh) every case.
@pytest.mark.parametrize(
    "case", [tiers.case(c, fast=c != "gae_varlen" or DEVICE == "cuda", id=c) for c in OPCHECK_CASES]
)
def test_custom_ops_pass_opcheck(case):
    """Schema, autograd registration, fake tensors (shapes, dtypes and strides as the real
    outputs) and AOT dispatch with dynamic shapes, as torch.compile relies on them."""
    cases = _opcheck_cases()
    assert list(cases) == OPCHECK_CASES
    op, args, *kwargs = cases[case]
    result = torch.library.opcheck(op, args, *kwargs)
    assert all(v == "SUCCESS" for v in result.values()), result


# --------------------------------------------------------------------------- linear_token_logprobs: tiles

N, V, H = 37, 75, 41  # none a multiple of the 16-wide test tiles


# the epilogue's forward in the fast tier: tests/test_fuzz.py's 2-D head fuzzer (every dtype, NaN/inf, masks)
@pytest.fixture(params=["gemm", "gemm-rows", "tiles", pytest.param("epilogue", marks=pytest.mark.full)])
def small_tiles(monkeypatch, request):
    """Each design of the head (``tlin.DESIGNS``) made small.  GEMM-first: its 2-D plan in blocks of 16 rows
    (the last shorter) by vocabulary slices of 24 columns (75 = 3 x 24 + 3, a slice not a whole number of
    tiles), or (gemm-rows) the row plan in chunks of 16 rows, and 16-wide row-kernel tiles.  Tiles: 16-wide tiles in both passes, the forward in three
    vocabulary splits (two tiles, two, one) and a gradient scratch of a tile or a few of every row, so
    that odd N, V and H cross several tiles, the forward its splits and the backward several
    vocabulary chunks.  Epilogue: 16-wide tiles, 32 columns a program (three shares: 32, 32, 11) in groups
    of 2 row blocks (three blocks: a whole group and a group of one), the backward gemm's 2-D plan."""
    monkeypatch.setattr(tlin, "DESIGN", request.param.split("-")[0])
    monkeypatch.setattr(gemm_head, "TWO_D", request.param == "gemm")
    monkeypatch.setattr(gemm_head, "BLOCK", (16, 24))
    monkeypatch.setattr(head_plan, "LOGPROBS_ROWS", 16)
    monkeypatch.setattr(gemm_head, "ROW_BLOCK_V", 16)
    for config in ("_FORWARD_CONFIG", "_BACKWARD_CONFIG"):
        monkeypatch.setattr(tlin, config, {acc: (16, 16, 16, 4) for acc in getattr(tlin, config)})
    monkeypatch.setattr(tlin, "FORWARD_SPLITS", 3)
    monkeypatch.setattr(tlin, "GRADIENT_SCRATCH_BYTES", 2 * 16 * N * 4)
    monkeypatch.setattr(tlin, "_EPILOGUE_CONFIG", {})  # every dtype: the 16-wide forward tiles
    monkeypatch.setattr(tlin, "EPILOGUE_LAUNCH", tlin.Launch(stages=2, group=2))
    monkeypatch.setattr(tlin, "EPILOGUE_COLUMNS", 32)


def _plain(hidden, weight, bias, labels, *, temperature=1.0, logit_scale=1.0, logit_softcap=None):
    """``log_softmax(softcap(scale * (h @ W.T + b)) / T).gather(labels)`` in float64 (0 where not computed)."""
    x = (hidden.double() @ weight.double().T + (0 if bias is None else bias.double())) * logit_scale
    x = x if logit_softcap is None else logit_softcap * torch.tanh(x / logit_softcap)
    log_softmax, used = torch.log_softmax(x / temperature, -1), (labels >= 0) & (labels < weight.shape[0])
    logp = log_softmax.gather(-1, torch.where(used, labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(used, logp, 0.0), torch.where(used, -(log_softmax.exp() * log_softmax).sum(-1), 0.0)


def _triton(hidden, weight, bias, labels, **options):
    return F["linear_token_logprobs"](hidden, weight, labels, bias=bias, return_entropy=True, **options)


def _linear_inputs(dtype=torch.float32, bias=True):
    labels = torch.where(torch.rand(N, device=DEVICE) < 0.25, IGNORE, ints(V, N))
    return rand(N, H, dtype=dtype), (rand(V, H) / H**0.25).to(dtype), rand(V, dtype=dtype) if bias else None, labels


def _check_linear(fn, inputs, want=_plain, tol=(1e-5, 2e-5), grad_rtol=2e-5, **options):
    """``fn`` against ``want``: outputs, and gradients relative to their largest entry."""
    leaves = [x for x in inputs[:3] if x is not None]
    call = lambda f: lambda h, w, *b: f(h, w, b[0] if b else None, inputs[3], **options)  # noqa: E731
    got, expected = _grads(call(fn), leaves), _grads(call(want), leaves)
    for a, e in zip(got[0], expected[0]):
        torch.testing.assert_close(a.double(), e.double(), rtol=tol[0], atol=tol[1])
    for a, e, leaf in zip(got[1], expected[1], leaves):
        assert a.dtype == leaf.dtype and a.isfinite().all()
        torch.testing.assert_close(a.double(), e.double(), rtol=grad_rtol, atol=grad_rtol * e.abs().max().item())
    return got


_SMALL_TILES_DTYPES = [(torch.float32, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float64, 1e-10)]
# The fast tier: every dtype on the tiles (a second a case); two each on GEMM-first's plans (seconds a
# case in the interpreter: the 2-D head fuzzer draws float32, float16 and float64 on both); on a GPU
# (bench/gpu_check.sh) every dtype on each.
_SMALL_TILES_FAST = {"tiles": (0, 1, 2, 3), "gemm": (0, 1), "gemm-rows": (2, 3)}


@pytest.mark.parametrize(
    "small_tiles, dtype, grad_rtol",
    [
        tiers.case(
            design,
            dtype,
            rtol,
            fast=i in _SMALL_TILES_FAST.get(design, ()) or (DEVICE == "cuda" and design != "epilogue"),
            id=f"{design}-{str(dtype)[6:]}",
        )
        for design in ("gemm", "gemm-rows", "tiles", "epilogue")
        for i, (dtype, rtol) in enumerate(_SMALL_TILES_DTYPES)
    ],
    indirect=["small_tiles"],
)
def test_linear_small_tiles_match_formula(small_tiles, dtype, grad_rtol):
    """Half inputs run the products in their dtype (float32 accumulate) and cross d_weight's
    vocabulary chunks; float64 computes in float64; float32 here without a bias."""
    f32, f64 = dtype == torch.float32, dtype == torch.float64
    options = dict(temperature=0.7) if f32 else dict(temperature=1.3, logit_scale=2.5, logit_softcap=4.0)
    tol = (1e-10, 1e-10) if f64 else (1e-5, 2e-5)
    (logp, _), _ = _check_linear(_triton, _linear_inputs(dtype, not f32), tol=tol, grad_rtol=grad_rtol, **options)
    assert logp.dtype == (torch.float64 if f64 else torch.float32)


def test_linear_large_logits_and_masked_vocabulary(small_tiles):
    """Logits up to ~250 whose row maximum comes in the last tiles (the online logsumexp
    rescales), and a -inf bias on the first 40 columns (a masked-out padded vocabulary: p = 0
    there, whole tiles and a whole vocabulary split of -inf), against the reference."""
    hidden, weight, _, _ = _linear_inputs()
    bias = torch.linspace(-60.0, 60.0, V, device=DEVICE)
    bias[:40] = -math.inf
    labels = torch.where(torch.rand(N, device=DEVICE) < 0.2, IGNORE, torch.randint(40, V, (N,), device=DEVICE))

    def ref(h, w, b, lab, **kw):
        return reference.linear_token_logprobs(h, w, lab, bias=b, return_entropy=True, **kw)

    _check_linear(_triton, (hidden, weight, bias, labels), ref, temperature=0.5)


def test_linear_ignored_and_out_of_range_rows_read_nothing(small_tiles):
    """Ignored rows: 0 log-prob and entropy; out-of-range labels (never checked on CUDA): NaN;
    both pass no gradient and their hidden states (NaN, inf here) reach nothing.  A whole
    ignored tile of rows is skipped."""
    hidden, weight, bias, labels = _linear_inputs()
    labels[:16] = IGNORE  # the first row tile computes nothing
    bad = torch.tensor([17, 20, 30], device=DEVICE)
    labels[bad] = torch.tensor([V, -1, 10**12], device=DEVICE)
    ignored, used = labels == IGNORE, (labels >= 0) & (labels < V)
    poisoned = hidden.clone()
    poisoned[ignored], poisoned[bad] = math.nan, math.inf
    weights = rand(N), rand(N)
    (logp, entropy), grads = _grads(lambda h, w, b: _triton(h, w, b, labels), [poisoned, weight, bias], weights)
    assert (logp[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert logp[bad].isnan().all() and entropy[bad].isnan().all() and (grads[0][~used] == 0).all()
    (e_logp, e_entropy), e_grads = _grads(lambda h, w, b: _plain(h, w, b, labels), [hidden, weight, bias], weights)
    torch.testing.assert_close(logp[used].double(), e_logp[used], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(entropy[used].double(), e_entropy[used], rtol=1e-5, atol=2e-5)
    for grad, expected in zip(grads, e_grads):
        torch.testing.assert_close(grad, expected, rtol=2e-5, atol=2e-5 * expected.abs().max().item())


def test_linear_strided_hidden_and_transposed_weight_are_read_in_place(small_tiles, monkeypatch):
    """Every other hidden column and a weight stored transposed (column-major): no copy, and the formula's results."""
    module, name = (gemm_head, "forward") if tlin.DESIGN == "gemm" else (tlin, "linear_token_logprobs_forward")
    seen, forward = [], getattr(module, name)
    spy = lambda h, w, *args, **kw: seen.append((h.stride(), w.stride())) or forward(h, w, *args, **kw)  # noqa: E731
    monkeypatch.setattr(module, name, spy)
    views = lambda f: lambda h, w, *rest, **kw: f(h[:, ::2], w.T, *rest, **kw)  # noqa: E731
    _check_linear(
        views(_triton), (rand(N, 2 * H), rand(H, V), None, _linear_inputs()[3]), views(_plain), temperature=1.1
    )
    assert seen == [((2 * H, 2), (1, V))]


def test_linear_launcher_rejects_mismatched_inputs():
    hidden, weight, bias, labels = _linear_inputs()
    options = dict(temperature=1.0, logit_scale=1.0, logit_softcap=None, ignore_index=IGNORE, return_entropy=False)
    for args, error, match in [
        ((hidden, weight, labels, bias[:-1]), ValueError, "bias must have shape"),
        ((hidden, weight[:, :-1], labels, bias), ValueError, "weight must have shape"),
        ((hidden, weight, labels[:-1], bias), ValueError, "labels must have shape"),
        ((hidden, weight.double(), labels, None), TypeError, "weight must have hidden's dtype"),
    ]:
        with pytest.raises(error, match=match):
            tlin.linear_token_logprobs_forward(*args, **options)


def test_fused_head_forward_fills_an_sm90_gpu_from_2048_rows():
    """Row blocks alone leave most of 132 multiprocessors idle at RLHF micro-batch sizes: the forward
    splits the vocabulary so that its grid is one wave, nearly full (the combine costs little)."""
    block_n, block_v = tlin._FORWARD_CONFIG[torch.bfloat16][:2]
    meta = torch.device("meta")
    for rows in (2048, 4096, 8192):
        splits, per_split = tlin._vocab_splits(rows, 151936, block_n, block_v, meta)
        programs = triton.cdiv(rows, block_n) * splits
        assert 0.95 * 132 <= programs <= 132 and splits == triton.cdiv(151936, per_split), rows
    assert tlin._vocab_splits(16384, 151936, block_n, block_v, meta)[0] == 1  # 128 row blocks: no split
    assert tlin._vocab_splits(64, 100, block_n, block_v, meta)[0] == 1  # one vocabulary tile: nothing to split


@pytest.mark.skipif(DEVICE != "cuda", reason="its shipped tiles compiled; the interpreter runs it small (test_fuzz)")
def test_epilogue_at_its_shipped_tiles_matches_float64_on_a_gpu(monkeypatch):
    """The "epilogue" design at its own configuration on a GPU (128 x 128 x 64 tiles, 256-column shares,
    groups of 8 row blocks: 1100 rows are 9 blocks, a whole group and a group of one, the last block ragged;
    V = 5000 not a whole number of shares), bf16 with a bias, soft-cap and entropy: log-probs and entropy
    against float64 of the same inputs, gradients (the 2-D plan's backward, from its own stats) against
    the GEMM-first design's."""
    torch.manual_seed(4901)
    n, h, v = 1100, 256, 5000
    hidden, weight = rand(n, h, dtype=torch.bfloat16), (rand(v, h) / h**0.5).to(torch.bfloat16)
    bias, labels = rand(v, dtype=torch.bfloat16), torch.where(torch.rand(n, device=DEVICE) < 0.3, IGNORE, ints(v, n))
    options = dict(temperature=0.7, logit_softcap=30.0)
    used = labels != IGNORE
    got = {}
    for design in ("epilogue", "gemm"):
        monkeypatch.setattr(tlin, "DESIGN", design)
        got[design] = _grads(lambda x, w, b: _triton(x, w, b, labels, **options), [hidden, weight, bias])
    want = _plain(hidden, weight, bias, labels, **options)
    for out, expected in zip(got["epilogue"][0], want):
        assert out.dtype == torch.float32 and (out[~used] == 0).all()
        torch.testing.assert_close(out[used].double(), expected[used], rtol=1e-4, atol=1e-4)
    for g, e in zip(got["epilogue"][1], got["gemm"][1]):
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2 * e.abs().max().item())


def test_fused_head_gradients_are_the_same_from_run_to_run(small_tiles):
    """No atomics in the backward: bitwise the same gradients of hidden, weight and bias each run,
    across the vocabulary chunks; under torch.use_deterministic_algorithms(True) auto keeps Triton."""
    hidden, weight, bias, labels = _linear_inputs(torch.bfloat16)

    def gradients():
        leaves = [x.detach().requires_grad_() for x in (hidden, weight, bias)]
        logp, entropy = _triton(*leaves[:2], leaves[2], labels, temperature=0.7)
        return torch.autograd.grad((logp * 0.3 + entropy).sum(), leaves)

    first = gradients()
    assert all(torch.equal(a, b) for a, b in zip(gradients(), first))
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert resolved_backend_name("linear_token_logprobs", "cuda") == "triton"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _bf16_d_weight(acc: int, rows: int, seed: int, chunks: int = 12):
    """The GEMM-first head's bf16 ``d_weight`` of ``log p`` weighted by random cotangents, in chunks of
    ``rows`` with a float32 (``acc`` 4) or bf16 (``acc`` 2: the gradient itself) accumulator, and its
    float64 counterpart: ``(got, exact, partial sums [K, V, H], sum of |d_logits| |hidden| [V, H])``."""
    gen = torch.Generator().manual_seed(seed)
    n, width, vocab = chunks * rows, 24, 40
    hidden = torch.randn(n, width, generator=gen).bfloat16()
    weight = (torch.randn(vocab, width, generator=gen) / width**0.25).bfloat16()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.2] = IGNORE
    grad = torch.randn(n, generator=gen)
    c, plan = gemm_head.constants(0.9, 1.0, None), head_plan.HeadPlan(rows, acc)
    args = (hidden, weight, labels, None, c)
    _, _, stats, _ = gemm_head.forward(
        *args, ignore_index=IGNORE, return_entropy=False, truncation=NO_TRUNCATION, plan=plan
    )
    got = gemm_head.backward(
        (grad, None), *args, saved=(stats, None, None), ignore_index=IGNORE, needs=(False, True, False), plan=plan
    )[1]
    used = labels != IGNORE
    p = torch.softmax(hidden.double() @ weight.double().T / 0.9, -1)
    one_hot = torch.nn.functional.one_hot(torch.where(used, labels, 0), vocab).double()
    dz = torch.where(used[:, None], grad.double()[:, None] * (one_hot - p) / 0.9, 0.0)
    h = hidden.double()
    partial = torch.stack([dz[i : i + rows].T @ h[i : i + rows] for i in range(0, n, rows)]).cumsum(0)
    return got, partial[-1], partial, dz.abs().T @ h.abs()


@pytest.mark.parametrize(
    "seed", [tiers.case(seed, fast=seed == 0 or DEVICE == "cuda", id=str(seed)) for seed in (0, 1)]
)
def test_gemm_head_bf16_d_weight_accumulator_error_is_bounded_against_float64(monkeypatch, seed):
    """d_weight accumulated in the bf16 gradient (the plan where the budget does not hold a float32
    accumulator) adds at most one bf16 rounding of the running sum a chunk: with u = 2**-8,
    ``|got - exact| <= u (sum_k |S_k| + sum_r |dz_r| |h_r|)`` (the second term: d_logits rounded to bf16),
    against ``u (|exact| + sum_r |dz_r| |h_r|)`` for the float32 accumulator rounded once.  Both bounds
    are checked on every weight, over 12 chunks."""
    monkeypatch.setattr(gemm_head, "ROW_BLOCK_V", 16)
    u = 2.0**-8
    narrow, exact, partial, spread = _bf16_d_weight(2, 8, seed)
    wide = _bf16_d_weight(4, 8, seed)[0]
    assert narrow.dtype == wide.dtype == torch.bfloat16
    slack = 1e-5 * spread + 1e-30  # float32 logits and products against float64
    assert ((wide.double() - exact).abs() <= u * (exact.abs() + spread) + slack).all()
    assert ((narrow.double() - exact).abs() <= u * (partial.abs().sum(0) + spread) + slack).all()
    assert not torch.equal(narrow, wide)  # the two accumulators round differently: both paths ran


def test_gemm_head_paired_gradients_refuse_a_wide_accumulator_and_a_wrong_buffer():
    """Pairs are for the bf16 gradient as accumulator; ``chunk_gradient``'s ``out`` must be the chunk's padded
    ``[rows, V]`` in the inputs' dtype: otherwise a clear error naming the argument."""
    hidden, weight = torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(5, 3, dtype=torch.bfloat16)
    dtypes = (torch.bfloat16,) * 3
    with pytest.raises(ValueError, match="pair"):
        gemm_head.Gradients(hidden, weight, None, (True, True, False), dtypes, pair=True)
    labels = torch.tensor([0, 1, IGNORE, 4])
    c = gemm_head.constants(1.0, 1.0, None)
    chunk = gemm_head.chunk_logits(hidden, weight, None, labels, c, ignore_index=IGNORE, form=False, rows=6)
    stats = torch.zeros(4, 2)
    for bad in (torch.empty(4, 5, dtype=torch.bfloat16), torch.empty(6, 5)):
        with pytest.raises(ValueError, match="out must be"):
            gemm_head.chunk_gradient(chunk, None, c, IGNORE, (stats, None, None), (torch.ones(4), None), out=bad)


@pytest.mark.xfail(
    strict=True, reason="open: the fused head's entropy gradient of a near-certain row (found by the fuzzer)"
)
def test_fused_head_entropy_gradient_of_a_near_certain_row_against_float64():
    """Logits 30x apart: p of the other tokens ~1e-22, d hidden ~1e-21 from log-prob and entropy terms that cancel."""
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):  # the fourth draw of this generator is the fuzzer's case
        hidden = torch.randn(1, 6, generator=gen, dtype=torch.float64) * 30
        weight = torch.randn(19, 6, generator=gen, dtype=torch.float64) / 6**0.5
    labels = (hidden @ weight.T).argmax(-1)
    grads = {}
    for name, dtype in (("triton", torch.float32), ("reference", torch.float32), ("reference", torch.float64)):
        h = hidden.to(dtype).to(DEVICE).requires_grad_()
        with pf.use_backend(name):
            logp, entropy = pf.linear_token_logprobs(
                h, weight.to(dtype).to(DEVICE), labels.to(DEVICE), return_entropy=True
            )
        (grads[name, dtype],) = torch.autograd.grad(logp.sum() + 0.7 * entropy.sum(), h)
    truth = grads["reference", torch.float64].double().cpu()
    own_error = (grads["reference", torch.float32].double().cpu() - truth).abs()
    assert ((grads["triton", torch.float32].double().cpu() - truth).abs() <= 16 * own_error + 1e-30).all()


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_float32_head_under_the_new_tf32_api(precision):
    """transformers' ``tf32=True`` sets torch's ``fp32_precision`` API, after which reading the legacy
    ``allow_tf32`` raises: the fused head follows the new setting instead of crashing."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    hidden, weight, labels = rand(5, 7), rand(13, 7), ints(13, 5)
    try:
        matmul.fp32_precision = precision
        assert tlin._dot_precision(torch.float32) == precision
        with pf.use_backend("triton"):
            got = pf.linear_token_logprobs(hidden, weight, labels)
        with tlin._allow_tf32(precision != "tf32"):  # the switch flips through the same API, and back
            assert tlin._dot_precision(torch.float32) != precision
        assert matmul.fp32_precision == precision
    finally:
        matmul.fp32_precision = saved
    want = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------- the soft-cap's tanh

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, tlin._tanh(x), mask=offsets < n)


def test_softcap_tanh_is_accurate_to_a_few_ulps_of_its_value():
    """The fused head's tanh against float64 (where (1 - e) / (1 + e) erred by ulps of 1, not of
    tanh x, near 0): within 4 float32 ulps of the true value from 1e-30 to 20 (either sign,
    the series' edge at 0.55 included); exact at 0 and +-inf, NaN for NaN."""
    small = torch.logspace(-30, 1.3, 2000, dtype=torch.float64)
    edge = torch.linspace(0.54, 0.56, 101, dtype=torch.float64)
    x = torch.cat([small, -small, edge, -edge]).float()
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    x = torch.cat([x, special]).to(DEVICE)
    out = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    n = x.numel() - special.numel()
    want = torch.tanh(x[:n].double())
    ulps = ((out[:n].double() - want).abs() / torch.finfo(torch.float32).eps / want.abs()).max().item()
    assert ulps <= 4, f"max error {ulps:.2f} float32 ulps of tanh x"
    assert out[n:].tolist()[:4] == [0.0, -0.0, 1.0, -1.0] and math.isnan(out[-1].item())


def test_a_kl_estimator_without_a_triton_branch_does_not_compute_another(monkeypatch):
    """An estimator added to spec.KL_ESTIMATORS but not to the kernels' branches is an error, not
    another estimator's values (the branches' last case used to be a bare else)."""
    from ppo_fast.backends.triton import kl_penalized_rewards as module

    monkeypatch.setattr(module, "kl_estimator_code", lambda name: len(module.KL_ESTIMATORS))
    with pytest.raises(Exception, match="without a Triton branch"):
        module.kl_estimate_forward(torch.zeros(2, 3), torch.zeros(2, 3), "k4")


# --------------------------------------------------------------------------- packed (varlen) gae


def _packed_gae_inputs(seed, dtype):
    """Random lengths (an empty sequence and a single token among them, one long enough to cross
    small chunks), packed ``[N]`` inputs with holes in the mask, and their padded ``[S, W]`` layout."""
    g = torch.Generator().manual_seed(seed)
    lengths = [0, 1, 17, *torch.randint(0, 12, (4,), generator=g).tolist()]
    lengths = [lengths[i] for i in torch.randperm(len(lengths), generator=g)]
    tokens, width = sum(lengths), max(lengths)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    rewards, values = (torch.randn(tokens, generator=g).to(DEVICE, dtype) for _ in range(2))
    mask = (torch.rand(tokens, generator=g) > 0.25).to(DEVICE)

    def pad(x):
        out = x.new_zeros((len(lengths), width))
        out[valid.to(DEVICE)] = x
        return out

    return (rewards, values, mask), cu_seqlens, width, valid.to(DEVICE), pad


@pytest.mark.parametrize(
    "dtype, block, given",
    [
        (torch.float32, 4, True),
        (torch.float64, 2, False),
        (torch.float16, 8, False),
        (torch.bfloat16, None, True),
        pytest.param(torch.float32, None, False, marks=pytest.mark.full),
        pytest.param(torch.float64, None, True, marks=pytest.mark.full),
    ],
)
def test_packed_gae_kernels_equal_the_padded_kernels_bit_for_bit(dtype, block, given):
    """One scan per cu_seqlens segment, its bounds read on the device: the padded kernels' result at
    the valid tokens, bit for bit, forward and backward, with the chunks the padded launch takes for
    the longest length (``max_seqlen`` given) or ``MAX_BLOCK_T`` (found on the device); small chunks
    cross the carries and skip the chunks past a short segment's end.  The incoming gradients are
    strided and expanded, as a sum's are."""
    seed = torch.randint(1 << 30, ()).item()
    (rewards, values, mask), cu_seqlens, width, valid, pad = _packed_gae_inputs(seed, dtype)
    max_seqlen = width if given else None
    padded_block = block or (tgae.varlen_block(max_seqlen))
    got = tgae.gae_varlen_forward(rewards, values, mask, cu_seqlens, 0.97, 0.9, max_seqlen=max_seqlen, block_t=block)
    want = tgae.gae_forward(pad(rewards), pad(values), pad(mask), 0.97, 0.9, block_t=padded_block)
    for h, w in zip(got, want, strict=True):
        assert torch.equal(h, w[valid]), f"seed {seed}"
    grad_adv = torch.randn(2 * len(mask), device=DEVICE)[::2]  # strided
    grad_ret = torch.ones((), device=DEVICE).expand(len(mask))  # expanded (stride 0)
    dtypes = (dtype, torch.float32)
    got = tgae.gae_varlen_backward(
        grad_adv, grad_ret, mask, cu_seqlens, 0.97, 0.9, dtypes=dtypes, max_seqlen=max_seqlen, block_t=block
    )
    padded_grads = (pad(grad_adv), pad(grad_ret), pad(mask))
    want = tgae.gae_backward(
        *padded_grads, 0.97, 0.9, rewards_dtype=dtype, values_dtype=torch.float32, block_t=padded_block
    )
    for h, w in zip(got, want, strict=True):
        assert torch.equal(h, w[valid]), f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_gae_matches_float64_without_a_padded_layout(dtype, monkeypatch):
    """``pf.gae(cu_seqlens=...)`` on the Triton backend runs the segmented kernels (the padded detour
    fails here) and agrees with the float64 reference on the same tokens, forward and backward."""
    from ppo_fast import _varlen

    monkeypatch.setattr(_varlen.Layout, "of", lambda *a, **k: pytest.fail("the packed gae took the padded detour"))
    seed = torch.randint(1 << 30, ()).item()
    (rewards, values, mask), cu_seqlens, *_ = _packed_gae_inputs(seed, dtype)
    leaves = [rewards, values]

    def run(backend, *x):
        with pf.use_backend(backend):
            return pf.gae(*x, mask, gamma=0.97, lam=0.9, cu_seqlens=cu_seqlens)

    got = _grads(lambda *x: run("triton", *x), leaves)
    want = _grads(lambda *x: run("reference", *(y.double() for y in x)), leaves)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    for h, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(h.double(), w.double(), **tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("plan", [head_plan.BlockPlan(16, 24, 4), head_plan.HeadPlan(16, 4)])
def test_gemm_head_row_results_are_bitwise_independent_of_the_batch(monkeypatch, plan):
    """A row's log-prob, entropy and d_hidden are bitwise the same whether the batch has N or N + k rows
    (k more in its last block and beyond), in the 2-D plan (blocks of 16 rows by slices of 24 of V = 75
    columns: the rows' stats folded over four slices) as in the row plan: every product has the plan's
    fixed rows and the slices are folded in a fixed order."""
    monkeypatch.setattr(gemm_head, "ROW_BLOCK_V", 16)
    hidden, weight, bias, labels = _linear_inputs(torch.float32)
    more, more_labels = rand(11, H), ints(V, 11)
    c, grads = gemm_head.constants(0.8, 1.5, 6.0), (rand(N + 11), rand(N + 11))

    def run(h, lab):
        g = (grads[0][: h.shape[0]], grads[1][: h.shape[0]])
        args = (h, weight, lab, bias, c)
        logp, entropy, stats, _ = gemm_head.forward(
            *args, ignore_index=IGNORE, return_entropy=True, truncation=NO_TRUNCATION, plan=plan
        )
        d_hidden = gemm_head.backward(
            g, *args, saved=(stats, entropy, None), ignore_index=IGNORE, needs=(True, False, False), plan=plan
        )[0]
        return logp, entropy, d_hidden

    alone = run(hidden, labels)
    batch = run(torch.cat([hidden, more]), torch.cat([labels, more_labels]))
    _, e_entropy = _plain(hidden, weight, bias, labels, temperature=0.8, logit_scale=1.5, logit_softcap=6.0)
    torch.testing.assert_close(alone[1].double(), e_entropy, rtol=1e-5, atol=2e-5)  # the plan ran
    for a, b in zip(alone, batch):
        assert torch.equal(a, b[:N]), plan


def test_gemm_head_plan_by_truncation():
    """Untruncated calls take the 2-D plan by default, truncated ones the row plan (their thresholds need
    whole rows), and a 2-D plan handed to a truncated call is refused, naming the argument."""
    from ppo_fast._sampling import Truncation

    hidden, weight, _, labels = _linear_inputs(torch.float32, bias=False)
    assert isinstance(gemm_head._plan(None, hidden, weight, False), head_plan.BlockPlan)
    assert isinstance(gemm_head._plan(None, hidden, weight, True), head_plan.HeadPlan)
    with pytest.raises(ValueError, match="plan: a truncated call"):
        gemm_head.forward(
            hidden,
            weight,
            labels,
            None,
            gemm_head.constants(1.0, 1.0, None),
            ignore_index=IGNORE,
            return_entropy=False,
            truncation=Truncation(5, 1.0, 0.0),
            plan=head_plan.BlockPlan(16, 24, 4),
        )
