"""The packed (varlen) layout of the sequence ops: ``[N, ...]`` token tensors with ``cu_seqlens``.

One rule for every op that has a sequence dimension, on every backend that serves it: for any
lengths (empty sequences and a single token included) and masks with holes, the packed result is
the padded layout's at the valid tokens, and so is every gradient: bit for bit where the padded
path does not depend on the layout (per-token values, per-sequence scans and their gradients), and
to float64 rounding where it sums over tokens of several rows (a token mean, a whitening), whose
order the layout sets.  The padded inputs are built here by hand; the packed ones are their valid
tokens.  Bad ``cu_seqlens`` get a named error.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from tiers import case
from torch.utils._pytree import tree_leaves

import ppo_fast as pf
from ppo_fast import _varlen
from ppo_fast.backends import serving
from ppo_fast.spec import AGG_MODES, POLICY_LOSS_MODES, ROLLOUT_CORRECTION_MODES

LENGTHS = [3, 0, 1, 6, 2]  # an empty sequence and a single token among them
VOCAB, HIDDEN = 11, 5


def _padded_case(seed: int):
    """``(padded per-token inputs [S, T], the valid-token mask [S, T], cu_seqlens)``."""
    g = torch.Generator().manual_seed(seed)
    rows, width = len(LENGTHS), max(LENGTHS)
    valid = torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]
    mask = valid & (torch.rand(rows, width, generator=g) > 0.2)  # holes inside the sequences
    mask[3, 0] = True  # a sequence that starts valid

    def per_token(scale=1.0, shift=0.0):
        return torch.where(valid, torch.randn(rows, width, generator=g, dtype=torch.float64) * scale + shift, 0.0)

    inputs = {name: per_token(0.5, -1.0) for name in ("lp", "old", "ref", "rollout")}  # log-probs
    inputs |= {name: per_token() for name in ("adv", "values", "old_values", "returns", "rewards")}
    inputs |= {name: per_token().abs() for name in ("entropy", "weights")}
    hidden = torch.randn(rows, width, HIDDEN, generator=g, dtype=torch.float64)
    inputs["hidden"] = torch.where(valid[..., None], hidden, 0.0)
    inputs["labels"] = torch.where(valid, torch.randint(VOCAB, (rows, width), generator=g), 0)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return inputs, mask, valid, cu_seqlens


# How a packed result must equal the padded one: EXACT in value and gradient; GRADS exact in every
# gradient, the values to rounding (a sum over the batch's tokens); VALUES exact in value, the
# gradients to rounding (the reference scan's autograd adds a token's terms in another order);
# CLOSE both to rounding.
EXACT, GRADS, VALUES, CLOSE = "exact", "grads", "values", "close"


def _cases():
    """(id, op's name for ``serving``, call(t, mask, **kw), how equal): ``t`` the per-token inputs by name."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    yield "gae", "gae", lambda t, m, **kw: pf.gae(t["rewards"], t["values"], m, gamma=0.9, lam=0.8, **kw), EXACT
    yield (
        "kl_penalized_rewards",
        "kl_penalized_rewards",
        lambda t, m, **kw: pf.kl_penalized_rewards(t.get("scores", scores), t["lp"], t["ref"], m, kl_coef=0.1, **kw),
        EXACT,
    )
    for name, mode in POLICY_LOSS_MODES.items():
        for agg in ("seq-mean-token-mean", "token-mean"):
            loss = partial(pf.policy_loss, loss_mode=name, agg=agg, **mode.example_params())
            yield (
                f"policy_loss-{name}-{agg}",
                mode.op,
                lambda t, m, loss=loss, **kw: loss(t["lp"], t["old"], t["adv"], m, weights=t["weights"], **kw),
                GRADS if agg == "token-mean" and not mode.sequence_level else CLOSE,
            )
    for agg in AGG_MODES:
        yield (
            f"value_loss-{agg}",
            "value_loss",
            lambda t, m, agg=agg, **kw: pf.value_loss(
                t["values"], t["old_values"], t["returns"], m, clip=0.2, agg=agg, **kw
            ),
            GRADS,
        )
        yield f"aggregate-{agg}", None, lambda t, m, agg=agg, **kw: pf.aggregate(t["values"], m, agg, **kw), GRADS
    yield "masked_mean", None, lambda t, m, **kw: pf.masked_mean(t["values"], m, **kw), GRADS
    yield "masked_whiten", None, lambda t, m, **kw: pf.masked_whiten(t["values"], m, **kw), CLOSE
    for mode in ROLLOUT_CORRECTION_MODES:
        yield (
            f"rollout_correction-{mode}",
            None,
            lambda t, m, mode=mode, **kw: pf.rollout_correction_weights(t["old"], t["rollout"], m, mode=mode, **kw),
            EXACT if mode.startswith("token") else CLOSE,
        )
    objective = partial(pf.policy_objective, agg="seq-mean-token-sum", kl_coef=0.1, entropy_coef=0.01)
    yield (
        "policy_objective",
        None,
        lambda t, m, **kw: objective(t["lp"], t["entropy"], t["old"], t["adv"], m, ref_logprobs=t["ref"], **kw),
        CLOSE,
    )
    for name, agg in LINEAR_CASES:  # the one pass on the packed row, and the sequence-level modes' two passes
        mode = POLICY_LOSS_MODES[name]
        fused = partial(pf.linear_policy_loss, loss_mode=name, agg=agg, kl_coef=0.1, **mode.example_params())
        yield (
            f"linear_policy_loss-{name}-{agg}",
            mode.linear_op,  # its one-pass op (a bare "linear_policy_loss" matched no backend)
            lambda t, m, fused=fused, **kw: fused(
                t["hidden"], head, t["labels"], t["old"], t["adv"], m, weights=t["weights"], ref_logprobs=t["ref"], **kw
            ),
            CLOSE,  # the chunks' sums and products group the tokens by the layout
        )


# linear_policy_loss's packed cases: each kind of aggregation and a sequence-level mode of each kind.
LINEAR_CASES = [
    ("vanilla", "seq-mean-token-mean"),
    ("gspo", "seq-mean-token-sum"),
    ("geo_mean", "seq-mean-token-sum-norm"),
    ("dro", "token-mean"),
]


def equality(case_id: str, backend: str, equal: str) -> str:
    """The table's rule, where a backend's packed kernel is stricter or looser: the native sequence-level
    losses and value loss run the padded kernels' rows on the segments (exact); the reference scan's autograd adds a
    token's gradient terms in another order (values exact)."""
    if backend == "native" and case_id.startswith(("policy_loss-gspo", "policy_loss-geo_mean", "value_loss-seq")):
        return EXACT
    return VALUES if (case_id, backend) == ("gae", "reference") else equal


def _params():
    out, turn = [], 0
    for case_id, op, call, equal in _cases():
        backends = ("auto",) if op is None else serving(op, "cpu")
        for b, backend in enumerate(backends):
            # the fused head's cases: one backend each in the fast tier, in turn (the fuzzer draws them all)
            fast = not case_id.startswith("linear_policy_loss") or b == turn % len(backends)
            out.append(case(call, backend, equality(case_id, backend, equal), fast=fast, id=f"{case_id}-{backend}"))
        turn += case_id.startswith("linear_policy_loss")
    return out


def _flat(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _assert_equal(got, want, exact, what):
    if exact:
        assert torch.equal(got, want), what
    else:  # float64 inputs: the sums' order changes the last bits only
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=what)


def _no_padding(*args, **kwargs):
    raise AssertionError("the packed call built the [S, longest] padded layout")


@pytest.mark.parametrize("call, backend, equal", _params())
def test_packed_equals_padded_at_the_valid_tokens_in_value_and_gradient(call, backend, equal, monkeypatch):
    """The module's rule, and no packed call builds the padded layout (``_varlen.Layout``: made to fail)."""
    padded, mask, valid, cu_seqlens = _padded_case(torch.randint(1000, ()).item())
    packed = {k: v[valid].clone() for k, v in padded.items()}
    floats = [name for name, x in padded.items() if x.is_floating_point()]
    for inputs in (padded, packed):
        for name in floats:  # an input the op does not read has no gradient either way
            inputs[name].requires_grad_(True)
    with pf.use_backend(backend):
        want = _flat(call(padded, mask))
        with monkeypatch.context() as patch:
            patch.setattr(_varlen.Layout, "of", _no_padding)
            got = _flat(call(packed, mask[valid], cu_seqlens=cu_seqlens))
    assert len(got) == len(want)
    for w, h in zip(want, got):
        expected = w[valid] if tuple(w.shape[:2]) == tuple(valid.shape) else w
        assert h.shape == expected.shape
        _assert_equal(h.detach(), expected.detach(), equal in (EXACT, VALUES), "value")
    g = torch.Generator().manual_seed(3)
    differentiable = [(w, h) for w, h in zip(want, got) if w.requires_grad and w.is_floating_point()]
    if not differentiable:
        return
    pulls = [torch.randn(w.shape, generator=g, dtype=w.dtype) for w, _ in differentiable]
    sum((w * p).sum() for (w, _), p in zip(differentiable, pulls)).backward()
    packed_pulls = [p[valid] if tuple(p.shape[:2]) == tuple(valid.shape) else p for p in pulls]
    sum((h * p).sum() for (_, h), p in zip(differentiable, packed_pulls)).backward()
    assert any(padded[name].grad is not None for name in floats)
    for name in floats:  # nor one it does not differentiate (a detached old_logprobs)
        want_grad, got_grad = padded[name].grad, packed[name].grad
        assert (got_grad is None) == (want_grad is None), name
        if want_grad is not None:
            _assert_equal(got_grad, want_grad[valid], equal in (EXACT, GRADS), f"the gradient of {name}")


@pytest.mark.parametrize(
    "cu_seqlens, words",
    [
        (torch.tensor([1, 3, 12], dtype=torch.int32), "must start at 0"),
        (torch.tensor([0, 8, 3, 12]), "must be non-decreasing"),
        (torch.tensor([0, 3, 11]), "must end at the number of packed tokens 12"),
        (torch.tensor([0.0, 3.0, 12.0]), "must have dtype int32 or int64"),
        (torch.tensor([[0, 12]]), r"must be 1-D \[S \+ 1\]"),
        (torch.tensor([0, 12], device="meta"), "must be on the tokens' device"),
        ([0, 12], "must be a torch.Tensor"),
    ],
)
def test_bad_cu_seqlens_is_a_named_error(cu_seqlens, words):
    x = torch.randn(12)
    with pytest.raises((TypeError, ValueError), match=f"cu_seqlens {words}"):
        pf.gae(x, x, torch.ones(12, dtype=torch.bool), cu_seqlens=cu_seqlens)


def test_a_token_tensor_packed_unlike_the_first_is_a_named_error():
    x = torch.randn(12)
    with pytest.raises(
        ValueError, match=r"values must be packed like rewards, \[12, ...\] with cu_seqlens, got \(11,\)"
    ):
        pf.gae(x, torch.randn(11), torch.ones(12, dtype=torch.bool), cu_seqlens=torch.tensor([0, 12]))


def test_packed_hidden_states_must_be_n_by_h():
    """The fused head's packed ``hidden`` is ``[N, H]``: a padded ``[B, T, H]`` one with cu_seqlens is a named error."""
    x, mask, head = torch.randn(12), torch.ones(12, dtype=torch.bool), torch.randn(VOCAB, HIDDEN)
    labels, cu_seqlens = torch.zeros(12, dtype=torch.long), torch.tensor([0, 5, 12])
    with pytest.raises(ValueError, match=r"hidden must be \[N, H\] \(the packed tokens\) with cu_seqlens, got shape"):
        pf.linear_policy_loss(torch.randn(12, 1, HIDDEN), head, labels, x, x, mask, cu_seqlens=cu_seqlens)


def test_masked_mean_refuses_dim_with_cu_seqlens():
    """The packed ``[N]`` tokens have no row dimension: ``dim`` would reduce over the hidden padded
    layout's (issue 53's per-column means of the padding), so it is refused, naming it."""
    x, mask, cu_seqlens = torch.randn(12), torch.ones(12, dtype=torch.bool), torch.tensor([0, 5, 12])
    for dim in (0, 1, -1, (0,)):
        with pytest.raises(ValueError, match="masked_mean: dim must be None with cu_seqlens"):
            pf.masked_mean(x, mask, dim=dim, cu_seqlens=cu_seqlens)
    assert torch.equal(pf.masked_mean(x, mask, cu_seqlens=cu_seqlens), x.mean())


# Issue 53's long tail: 18,432 tokens in 2,049 sequences, whose padded layout is 2,049 x 16,384 (1,821x N).
LONG_TAIL = [16384] + [1] * 2048


def _long_tail_params():
    for case_id, op, call, _ in _cases():
        for backend in ("native", "reference"):
            if op and backend not in serving(op, "cpu"):
                continue
            if case_id == "gae" and backend == "reference":  # 16,384 Python steps: the native scan is the check
                continue
            if op is None and backend == "reference":  # a helper of the public layer: one backend
                continue
            yield case(call, backend, fast=f"{case_id}-{backend}" in LONG_TAIL_FAST, id=f"{case_id}-{backend}")


# The fast tier's share: each kind of packed implementation once (the full tier runs every case).
LONG_TAIL_FAST = {
    "gae-native",
    "kl_penalized_rewards-native",
    "policy_loss-vanilla-seq-mean-token-mean-native",
    "policy_loss-gspo-seq-mean-token-mean-reference",
    "policy_loss-geo_mean-seq-mean-token-mean-native",
    "value_loss-seq-mean-token-sum-norm-reference",
    "rollout_correction-seq_mis-native",
    "linear_policy_loss-vanilla-seq-mean-token-mean-native",
    "linear_policy_loss-gspo-seq-mean-token-sum-reference",
}


@pytest.mark.parametrize("call, backend", list(_long_tail_params()))
def test_the_packed_layout_builds_no_padded_layout(call, backend, monkeypatch):
    """Memory and time linear in N (issue 53, point 5): no packed op pads, checked by making the
    padded detour fail; the long tail runs forward and backward."""
    monkeypatch.setattr(_varlen.Layout, "of", _no_padding)
    tokens, g = sum(LONG_TAIL), torch.Generator().manual_seed(0)
    names = ("lp", "old", "ref", "rollout", "adv", "values", "old_values", "returns", "rewards", "entropy", "weights")
    inputs = {name: torch.randn(tokens, generator=g, dtype=torch.float64, requires_grad=True) for name in names}
    inputs["hidden"] = torch.randn(tokens, HIDDEN, generator=g, dtype=torch.float64, requires_grad=True)
    inputs["labels"] = torch.randint(VOCAB, (tokens,), generator=g)
    inputs["scores"] = torch.randn(len(LONG_TAIL), generator=g, dtype=torch.float64)
    mask = torch.rand(tokens, generator=g) > 0.1
    cu_seqlens = torch.tensor([0, *torch.tensor(LONG_TAIL).cumsum(0).tolist()])
    with pf.use_backend(backend):
        out = [t for t in _flat(call(inputs, mask, cu_seqlens=cu_seqlens)) if t.requires_grad]
    if out:
        sum(t.sum() for t in out).backward()
    assert all(t.shape[0] == tokens for t in _flat(out) if t.dim() >= 1)


def test_packed_calls_compile_fullgraph_or_refuse_naming_cu_seqlens():
    """Issue 53, point 4: a packed call under torch.compile(fullgraph=True) compiles (to the eager
    result) where the backend has a packed kernel (the fused head's included); the reference scan
    needs max_seqlen."""
    padded, mask, valid, cu_seqlens = _padded_case(11)
    t = {k: v[valid] for k, v in padded.items()}
    m = mask[valid]
    with pf.use_backend("native"):
        for call in (
            lambda: pf.gae(t["rewards"], t["values"], m, gamma=0.9, lam=0.8, cu_seqlens=cu_seqlens),
            lambda: pf.policy_loss(
                t["lp"], t["old"], t["adv"], m, agg="seq-mean-token-sum-norm", cu_seqlens=cu_seqlens
            ),
            lambda: pf.kl_penalized_rewards(
                torch.ones(len(LENGTHS)), t["lp"], t["ref"], m, kl_coef=0.1, cu_seqlens=cu_seqlens
            ),
        ):
            torch._dynamo.reset()
            want, got = _flat(call()), _flat(torch.compile(call, fullgraph=True)())
            for w, h in zip(want, got, strict=True):
                torch.testing.assert_close(h, w, rtol=1e-12, atol=1e-14)
        head = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
        for mode in ("vanilla", "gspo"):  # the one pass on the packed row, and GSPO's two passes
            torch._dynamo.reset()
            fused = lambda mode=mode: pf.linear_policy_loss(  # noqa: E731
                t["hidden"], head, t["labels"], t["old"], t["adv"], m, loss_mode=mode, cu_seqlens=cu_seqlens
            )
            for w, h in zip(_flat(fused()), _flat(torch.compile(fused, fullgraph=True)()), strict=True):
                torch.testing.assert_close(h, w, rtol=1e-12, atol=1e-14)
    with pf.use_backend("reference"):
        torch._dynamo.reset()
        scan = lambda **kw: pf.gae(t["rewards"], t["values"], m, cu_seqlens=cu_seqlens, **kw)  # noqa: E731
        with pytest.raises(Exception, match="gae: pass max_seqlen with cu_seqlens under torch.compile"):
            torch.compile(scan, fullgraph=True)()
        torch._dynamo.reset()
        for w, h in zip(scan(), torch.compile(lambda: scan(max_seqlen=max(LENGTHS)), fullgraph=True)(), strict=True):
            assert torch.equal(h, w)


@pytest.mark.parametrize("call, backend, equal", _params())
def test_no_packed_token_at_all(call, backend, equal):
    """Sequences but no token (cu_seqlens [0, 0]; found by the packed fuzzer): the padded call's
    result on its [1, 0] layout, forward and backward, and no index past the empty tensors."""
    names = ("lp", "old", "ref", "rollout", "adv", "values", "old_values", "returns", "rewards", "entropy", "weights")
    empty = {name: torch.zeros(0, dtype=torch.float64, requires_grad=True) for name in names}
    empty |= {"hidden": torch.zeros(0, HIDDEN, dtype=torch.float64), "labels": torch.zeros(0, dtype=torch.long)}
    empty["scores"] = torch.randn(1, dtype=torch.float64)
    padded = {k: v if k == "scores" else v.detach()[None].requires_grad_(v.requires_grad) for k, v in empty.items()}
    mask = torch.zeros(0, dtype=torch.bool)
    with pf.use_backend(backend):
        try:
            want = _flat(call(padded, mask[None]))
        except ValueError as err:  # nothing to whiten: refused the same way
            with pytest.raises(ValueError, match=str(err)):
                call(empty, mask, cu_seqlens=torch.tensor([0, 0]))
            return
        got = _flat(call(empty, mask, cu_seqlens=torch.tensor([0, 0])))
    assert [tuple(w.shape[1:]) if w.dim() >= 2 else tuple(w.shape) for w in want] == [tuple(h.shape) for h in got]
    for w, h in zip(want, got):
        assert torch.equal(h.detach().reshape(-1), w.detach().reshape(-1))
    live = [h for h in got if h.requires_grad]
    if live:
        sum(h.sum() for h in live).backward()


def test_a_host_cu_seqlens_is_refused_while_a_cuda_graph_captures(monkeypatch):
    """The capture's refusal (``_varlen.to_device``) without a GPU: a replay would copy a reused pinned
    block (tests/backends/test_cuda_no_host_sync.py captures one on a GPU)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="cu_seqlens on the host cannot be captured in a CUDA graph"):
        _varlen.to_device(torch.tensor([0, 3]), torch.device("cuda"))
