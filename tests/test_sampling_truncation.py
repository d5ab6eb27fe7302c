"""Sampling-aware log-probs (top_k / top_p / min_p): the rule of ``ppo_fast._sampling``.

The reference is checked against Hugging Face's own logits warpers (the peers' real
functions, applied in vLLM's order where the two engines' orders differ); every backend that
serves the log-prob ops is checked against the reference, values and gradients, on every
dtype, with odd vocabularies, ties, k >= V, p = 1, labels outside the kept set, ignored and
NaN rows, eager and compiled.
"""

from __future__ import annotations

import math

import pytest
import tiers
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import ppo_fast as pf
from ppo_fast._sampling import Truncation
from ppo_fast.backends import serving
from ppo_fast.backends.reference.token_logprobs import kept_tokens
from ppo_fast.backends.triton import linear_token_logprobs as tlin

TRUNCATIONS = [
    Truncation(top_k=5),
    Truncation(top_k=1),
    Truncation(top_p=0.9),
    Truncation(top_p=0.3),
    Truncation(min_p=0.1),
    Truncation(top_k=50, top_p=0.9),
    Truncation(top_k=3, top_p=0.5, min_p=0.02),
    Truncation(top_p=0.9, min_p=0.05),
]
IDS = [f"k{t.top_k}-p{t.top_p}-m{t.min_p}" for t in TRUNCATIONS]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def as_kwargs(t: Truncation) -> dict:
    return {"top_k": t.top_k, "top_p": t.top_p, "min_p": t.min_p}


def hf_processed(logits: torch.Tensor, temperature: float, t: Truncation) -> torch.Tensor:
    """The logits after Hugging Face's warpers, in vLLM's order: min-p, top-k, top-p."""
    z = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if t.min_p > 0:
        z = MinPLogitsWarper(t.min_p)(None, z)
    if t.top_k > 0:
        z = TopKLogitsWarper(t.top_k)(None, z)
    if t.top_p < 1:
        z = TopPLogitsWarper(t.top_p)(None, z)
    return z


def sampled_labels(logits: torch.Tensor, temperature: float, t: Truncation, outside: int = 2) -> torch.Tensor:
    """Labels drawn from the truncated distribution (as a rollout draws them), and in the
    first ``outside`` rows a token the sampler dropped where there is one."""
    z = (logits.double() / temperature).flatten(0, -2)
    kept = kept_tokens(z, t)
    labels = torch.multinomial(torch.softmax(torch.where(kept, z, -math.inf), -1), 1)[:, 0]
    for row in range(min(outside, z.shape[0])):
        dropped = (~kept[row]).nonzero()
        if len(dropped):
            labels[row] = dropped[torch.randint(len(dropped), ())]
    return labels.view(logits.shape[:-1])


def near_edge(logits: torch.Tensor, temperature: float, t: Truncation, tol: float) -> torch.Tensor:
    """Rows whose top-p edge lies within ``tol`` (relative mass) of a token: there float32
    sums in another order may keep one token more or less, as two engines may."""
    z = (logits.double() / temperature).flatten(0, -2)
    if t.top_p >= 1:
        return torch.zeros(logits.shape[:-1], dtype=torch.bool)
    kept = kept_tokens(z, Truncation(t.top_k, 1.0, t.min_p))
    w = torch.where(kept, torch.exp(z - z.amax(-1, keepdim=True)), 0.0)
    total = w.sum(-1, keepdim=True)
    larger = torch.stack([(w * (z > z[:, j : j + 1])).sum(-1) for j in range(z.shape[1])], -1)
    return ((larger - t.top_p * total).abs() < tol * total).any(-1).view(logits.shape[:-1])


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=IDS)
@pytest.mark.parametrize("vocab", [7, 101, 4099])
def test_reference_equals_hugging_face_warpers(truncation, vocab):
    logits = torch.randn(48, vocab) * 3
    labels = sampled_labels(logits, 0.7, truncation)
    want = torch.log_softmax(hf_processed(logits, 0.7, truncation), -1).gather(-1, labels[:, None])[:, 0]
    with pf.use_backend("reference"):
        got = pf.token_logprobs(logits, labels, temperature=0.7, **as_kwargs(truncation))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.isinf(got[:2]).all() or vocab <= truncation.top_k
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_hugging_face_order_differs_only_with_top_p_and_min_p():
    """HF generate applies min-p after top-p; the rule follows vLLM (min-p first)."""
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -0.1]])
    t = Truncation(top_p=0.99, min_p=0.5)
    hf_order = MinPLogitsWarper(t.min_p)(None, TopPLogitsWarper(t.top_p)(None, logits.clone()))
    kept = kept_tokens(logits, t)
    assert kept.tolist() == [[True, True, True, False, False]]
    assert torch.isfinite(hf_order).tolist() == kept.tolist()  # here the orders agree ...
    t = Truncation(top_p=0.5, min_p=0.9)  # ... here min-p first leaves 2 tokens, top-p keeps 1 of them
    assert kept_tokens(logits, t).tolist() == [[True, False, False, False, False]]


def test_ties_at_the_edge_are_all_kept():
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, 1.0]])
    assert kept_tokens(logits, Truncation(top_k=2)).tolist() == [[True, True, True, True, False, True]]
    w = torch.exp(logits - 2.0)
    p_edge = float(w[0, 0] / w.sum()) + 1e-3  # just past the largest token alone: the tie at 1.0 joins whole
    assert kept_tokens(logits, Truncation(top_p=p_edge)).tolist() == [[True, True, True, True, False, True]]


def test_off_values_and_k_at_least_v_keep_everything():
    logits = torch.randn(5, 9)
    labels = torch.randint(0, 9, (5,))
    plain = pf.token_logprobs(logits, labels)
    for kwargs in ({"top_k": 0}, {"top_k": -1}, {"top_k": 9}, {"top_k": 1000}, {"top_p": 1.0}, {"min_p": 0.0}):
        assert torch.equal(pf.token_logprobs(logits, labels, **kwargs), plain), kwargs


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"top_k": True}, TypeError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_p": math.nan}, ValueError, "top_p"),
        ({"top_p": "0.9"}, TypeError, "top_p"),
        ({"min_p": -0.1}, ValueError, "min_p"),
        ({"min_p": 1.1}, ValueError, "min_p"),
    ],
)
@pytest.mark.parametrize("op", ["token_logprobs", "linear_token_logprobs"])
def test_bad_truncation_arguments_are_named(op, kwargs, error, words):
    labels = torch.zeros(3, dtype=torch.long)
    with pytest.raises(error, match=words):
        if op == "token_logprobs":
            pf.token_logprobs(torch.randn(3, 5), labels, **kwargs)
        else:
            pf.linear_token_logprobs(torch.randn(3, 4), torch.randn(5, 4), labels, **kwargs)


# --------------------------------------------------------------------------- every backend


def assert_matches_reference(backend, call, *inputs):
    """``call(*leaves)`` (log-probs and entropy; the fused head's when it takes more than logits) on
    ``backend`` against the reference: the same dropped (-inf) labels, values, and gradients of the
    finite log-probs plus half the entropy."""
    results = {}
    for name in ("reference", backend):
        leaves = [t.clone().requires_grad_() for t in inputs]
        with pf.use_backend(name):
            logp, ent = call(*leaves)
        (torch.where(torch.isfinite(logp), logp, 0.0).sum() + 0.5 * ent.sum()).backward()
        results[name] = (logp.detach(), ent.detach(), [leaf.grad for leaf in leaves])
    (logp, ent, grads), (want_logp, want_ent, want_grads) = results[backend], results["reference"]
    assert torch.equal(torch.isneginf(logp), torch.isneginf(want_logp))
    dtype = inputs[0].dtype
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype != torch.float64 else {"rtol": 1e-10, "atol": 1e-10}
    finite = torch.isfinite(want_logp)
    torch.testing.assert_close(logp[finite], want_logp[finite], **tol)
    torch.testing.assert_close(ent, want_ent, **tol, equal_nan=True)
    tol = {"rtol": 1e-4, "atol": 1e-4 if len(inputs) > 1 else 1e-5}  # the fused head's gradients, the logits'
    if dtype in (torch.bfloat16, torch.float16):
        tol = {"rtol": 1e-3, "atol": 1e-3}
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got.float(), want.float(), **tol)


def _logits_and_labels(dtype, truncation, shape=(3, 5, 4099), ties=False):
    logits = torch.randn(shape) * 2
    if ties:  # integer logits: many ties, at every edge
        logits = logits.round()
    logits = logits.to(dtype)
    labels = sampled_labels(logits.float(), 0.8, truncation)
    labels[0, -1] = -100
    return logits, labels


def _interpreted(backend: str) -> bool:
    return backend == "triton" and not torch.cuda.is_available()


def _fast_backends(op: str) -> list[str]:
    """The backends compared with the reference (the reference itself against the warpers, above)."""
    return [name for name in serving(op, "cpu") if name != "reference"]


def _cost(row) -> float:
    """What a case costs, for the fast tier's covering: the interpreted Triton's float32 rows are the widest."""
    return (10.0 if row[1] in (torch.float32, torch.float64) else 3.0) if _interpreted(row[0]) else 1.0


# The fast tier: every pair of backend, dtype and truncation (tests/tiers.py), the cheapest first.
@pytest.mark.parametrize(
    "backend, dtype, truncation",
    tiers.sampled(
        [
            pytest.param(b, d, t, id=f"{b}-{str(d)[6:]}-{i}")
            for b in _fast_backends("token_logprobs")
            for d in DTYPES
            for t, i in zip(TRUNCATIONS, IDS)
        ],
        cost=_cost,
    ),
)
def test_token_logprobs_every_backend(backend, dtype, truncation):
    # Past the native chunks (1,024) and the Triton blocks (4,096) in float32; the Triton interpreter
    # runs a program at a time, so its other dtypes take a narrower row, and float64 (whose threshold
    # search takes a pass per bit of its 64-bit keys, a row a program) 5 rows, not 15.
    vocab = 1031 if _interpreted(backend) and dtype != torch.float32 else 4099
    rows = 1 if _interpreted(backend) and dtype == torch.float64 else 3
    logits, labels = _logits_and_labels(dtype, truncation, shape=(rows, 5, vocab), ties=dtype == torch.bfloat16)
    ambiguous = near_edge(logits.float(), 0.8, truncation, 1e-5)
    labels[ambiguous] = -100  # only rows where the kept set is unambiguous in float32
    kwargs = {"temperature": 0.8, "return_entropy": True, **as_kwargs(truncation)}
    assert_matches_reference(backend, lambda x: pf.token_logprobs(x, labels, **kwargs), logits)


@pytest.mark.parametrize(
    "backend, truncation",
    tiers.sampled(
        [
            pytest.param(b, t, id=f"{b}-{i}")
            for b in _fast_backends("linear_token_logprobs")
            for t, i in zip(TRUNCATIONS[:3] + TRUNCATIONS[5:6], IDS[:3] + IDS[5:6])
        ],
        strength=1,
        cost=lambda row: 10.0 if _interpreted(row[0]) else 1.0,
    ),
)
def test_linear_token_logprobs_every_backend(backend, truncation):
    n, width, vocab = 37, 11, 1031
    hidden, weight, bias = torch.randn(n, width), torch.randn(vocab, width) / 2, torch.randn(vocab)
    labels = sampled_labels((hidden @ weight.T + bias) * 1.5, 0.9, truncation)
    labels[3] = -100
    ambiguous = near_edge(((hidden @ weight.T + bias) * 1.5)[None], 0.9, truncation, 1e-4)[0]
    labels[ambiguous] = -100
    kwargs = {"temperature": 0.9, "logit_scale": 1.5, "return_entropy": True, **as_kwargs(truncation)}
    call = lambda h, w, b: pf.linear_token_logprobs(h, w, labels, bias=b, **kwargs)
    assert_matches_reference(backend, call, hidden, weight, bias)


def _non_finite_rows(op: str):
    """Rows 1-3 NaN by the rule (a NaN, a +inf, a logit whose x / T overflows at T = 0.5), row 4 finite (a
    -x / T that overflows is a -inf logit), row 0 plain: as logits, or as a fused head's h and W."""
    logits = torch.randn(5, 33)
    logits[1, 7], logits[2, 3], logits[3, 5], logits[4, 6] = math.nan, math.inf, 3e38, -3e38
    labels = torch.tensor([2, 0, 1, 4, 0])
    labels[[0, 4]] = logits[[0, 4]].argmax(-1)  # kept under any truncation: finite
    if op == "token_logprobs":
        return (logits,), labels
    hidden, weight = torch.zeros(5, 34), torch.zeros(33, 34)  # z = h @ W.T = logits: one-hot hidden columns
    weight[:, :33] = torch.eye(33)
    hidden[:, :33] = logits.nan_to_num(posinf=3e38, neginf=-3e38)
    hidden[1, :] = math.nan
    hidden[2, 3], hidden[2, 33], weight[3, 33] = 1e30, 1e30, 1e30  # z = 1e30 * 1e30: +inf
    return (hidden, weight), labels


@pytest.mark.parametrize("truncation", [{}, {"top_k": 4, "top_p": 0.8}], ids=["plain", "truncated"])
@pytest.mark.parametrize(
    "op, backend",
    [(op, b) for op in ("token_logprobs", "linear_token_logprobs") for b in serving(op, "cpu") if b != "reference"],
)
def test_nan_rows_stay_nan_and_alone(op, backend, truncation, monkeypatch):
    """One rule for non-finite rows on every backend: NaN values and gradients in the NaN rows only."""
    if truncation:  # the Triton fused head's forward split over the vocabulary, combined on the host
        monkeypatch.setattr(tlin, "FORWARD_SPLITS", 3)
    inputs, labels = _non_finite_rows(op)
    results = {}
    for name in ("reference", backend):
        leaves = [x.clone().requires_grad_() for x in inputs]
        with pf.use_backend(name):
            logp, ent = getattr(pf, op)(*leaves, labels, temperature=0.5, return_entropy=True, **truncation)
        grads = torch.autograd.grad(logp.sum() + ent.sum(), leaves)
        results[name] = (logp, ent, grads[0][[0, 3, 4]])
    got, want = results[backend], results["reference"]
    assert torch.isnan(got[0][1:4]).all() and torch.isfinite(got[0][[0, 4]]).all(), got[0]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_compiled_equals_eager(backend):
    logits, labels = _logits_and_labels(torch.float32, TRUNCATIONS[5], shape=(2, 3, 257))

    def run(x):
        return pf.token_logprobs(x, labels, temperature=0.8, return_entropy=True, top_k=50, top_p=0.9)

    with pf.use_backend(backend):
        eager = run(logits)
        compiled = torch.compile(run, fullgraph=True)(logits)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gradcheck_reference_float64():
    logits = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 5, 10])
    with torch.no_grad():
        kept = kept_tokens(logits, Truncation(top_k=4, top_p=0.9))
    labels = torch.where(kept.gather(-1, labels[:, None])[:, 0], labels, kept.float().argmax(-1))

    def fn(x):
        return pf.token_logprobs(x, labels, top_k=4, top_p=0.9, return_entropy=True)

    with pf.use_backend("reference"):
        assert torch.autograd.gradcheck(fn, (logits,))


# --------------------------------------------------------------------------- native edge rows

native_only = pytest.mark.skipif("native" not in serving("token_logprobs", "cpu"), reason="native backend not built")


def _edge_logits(vocab: int, dtype) -> torch.Tensor:
    """Rows that stress the selection: all tied, two values, a -inf half, one huge logit, integer ties."""
    rows = torch.randn(6, vocab) * 2
    rows[0] = 1.5  # all tied: every truncation keeps the whole row
    rows[1] = torch.where(torch.arange(vocab) % 3 == 0, 2.0, -1.0)  # two values, many ties at each edge
    rows[2, ::2] = -math.inf  # the dropped -inf half has probability 0 either way
    rows[3, vocab // 2] = 40.0  # one token holds the mass
    rows[4] = rows[4].round()
    return rows.to(dtype)


@native_only
@pytest.mark.parametrize(
    "truncation", [Truncation(top_k=1), Truncation(top_p=0.6), Truncation(top_k=7, top_p=0.8, min_p=0.01)], ids=str
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", [3, 1031, 5003])
def test_native_edge_rows_equal_reference(vocab, dtype, truncation):
    logits = _edge_logits(vocab, dtype)
    labels = sampled_labels(logits.float(), 0.9, truncation, outside=6)
    labels[near_edge(logits.float(), 0.9, truncation, 1e-5)] = -100
    kwargs = {"temperature": 0.9, "return_entropy": True, **as_kwargs(truncation)}
    assert_matches_reference("native", lambda x: pf.token_logprobs(x, labels, **kwargs), logits)


@pytest.mark.parametrize("backend", serving("token_logprobs", "cpu"))
def test_dropped_label_is_minus_inf_and_gets_no_one_hot(backend):
    """A label the sampler dropped: log-prob -inf, and its cotangent (not zeroed here) reaches only
    the kept tokens (-p each), never the label's logit (nor, through the fused head, its weight row)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -math.inf]])
    p = torch.softmax(logits[0, :2], -1)
    for label in (3, 4):  # outside top-k = 2: a finite and a -inf logit
        leaf = logits.clone().requires_grad_()
        with pf.use_backend(backend):
            logp = pf.token_logprobs(leaf, torch.tensor([label]), top_k=2)
        assert torch.isneginf(logp).all()
        logp.sum().backward()
        torch.testing.assert_close(leaf.grad[0], torch.cat([-p, torch.zeros(3)]))
    hidden, weight = torch.eye(4)[:1], torch.tensor([[3.0, 0, 0, 0], [2.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 0, 0, 0]])
    weight.requires_grad_()
    with pf.use_backend(backend):
        logp = pf.linear_token_logprobs(hidden, weight, torch.tensor([3]), top_k=2)
    logp.sum().backward()
    assert torch.isneginf(logp).all() and weight.grad[2:].abs().sum() == 0
    torch.testing.assert_close(weight.grad[:2, 0], -p)


@native_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_truncated_rows_are_bitwise_independent_of_threads(dtype):
    logits, labels = _logits_and_labels(dtype, TRUNCATIONS[6], shape=(4, 9, 3001))
    outputs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for t in (Truncation(top_p=0.9), TRUNCATIONS[6]):
                leaf = logits.clone().requires_grad_()
                with pf.use_backend("native"):
                    logp, ent = pf.token_logprobs(leaf, labels, return_entropy=True, **as_kwargs(t))
                (torch.where(torch.isfinite(logp), logp, 0.0).sum() + ent.sum()).backward()
                outputs.append((logp, ent, leaf.grad))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outputs[:2], outputs[2:], rtol=0, atol=0)  # bitwise


@native_only
@pytest.mark.parametrize("truncation", [Truncation(top_p=0.9, min_p=0.05), Truncation(top_k=3)], ids=str)
def test_native_fused_head_with_softcap_equals_reference(truncation):
    n, width, vocab = 29, 8, 2053
    hidden, weight = torch.randn(n, width), torch.randn(vocab, width)
    kwargs = {"temperature": 0.7, "logit_scale": 2.0, "logit_softcap": 5.0, "return_entropy": True}
    z = torch.tanh(hidden @ weight.T * 2.0 / 5.0) * 5.0
    labels = sampled_labels(z, 0.7, truncation)
    labels[near_edge(z[None], 0.7, truncation, 1e-4)[0]] = -100
    call = lambda h, w: pf.linear_token_logprobs(h, w, labels, **kwargs, **as_kwargs(truncation))
    assert_matches_reference("native", call, hidden, weight)
