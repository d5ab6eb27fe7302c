"""The packed (varlen) layout of the sequence ops: ``[N, ...]`` token tensors with ``cu_seqlens``.

One rule for every op that has a sequence dimension, on every backend that serves it: for any
lengths (empty sequences and a single token included) and masks with holes, the packed result is
the padded layout's at the valid tokens, and so is every gradient, bit for bit.  The padded inputs
are built here by hand; the packed ones are their valid tokens.  Bad ``cu_seqlens`` get a named error.
"""

from __future__ import annotations

import pytest
import torch

import ppo_fast as pf
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

    inputs = {
        "logprobs": per_token(0.5, -1.0),
        "old_logprobs": per_token(0.5, -1.0),
        "ref_logprobs": per_token(0.5, -1.0),
        "rollout_logprobs": per_token(0.5, -1.0),
        "advantages": per_token(),
        "values": per_token(),
        "old_values": per_token(),
        "returns": per_token(),
        "rewards": per_token(),
        "entropy": per_token().abs(),
        "weights": per_token().abs(),
        "hidden": torch.where(
            valid[..., None], torch.randn(rows, width, HIDDEN, generator=g, dtype=torch.float64), 0.0
        ),
        "labels": torch.where(valid, torch.randint(VOCAB, (rows, width), generator=g), 0),
    }
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return inputs, mask, valid, cu_seqlens


def _cases():
    """(id, op's name for ``serving``, call(t, mask, **kw), per-token input names)."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    yield (
        "gae",
        "gae",
        lambda t, m, **kw: pf.gae(t["rewards"], t["values"], m, gamma=0.9, lam=0.8, **kw),
        (
            "rewards",
            "values",
        ),
    )
    yield (
        "kl_penalized_rewards",
        "kl_penalized_rewards",
        lambda t, m, **kw: pf.kl_penalized_rewards(scores, t["logprobs"], t["ref_logprobs"], m, kl_coef=0.1, **kw),
        ("logprobs", "ref_logprobs"),
    )
    for name, mode in POLICY_LOSS_MODES.items():
        yield (
            f"policy_loss-{name}",
            mode.op,
            lambda t, m, name=name, mode=mode, **kw: pf.policy_loss(
                t["logprobs"],
                t["old_logprobs"],
                t["advantages"],
                m,
                loss_mode=name,
                agg="seq-mean-token-mean",
                weights=t["weights"],
                **mode.example_params(),
                **kw,
            ),
            ("logprobs", "old_logprobs", "advantages", "weights"),
        )
    for agg in AGG_MODES:
        yield (
            f"value_loss-{agg}",
            "value_loss",
            lambda t, m, agg=agg, **kw: pf.value_loss(
                t["values"], t["old_values"], t["returns"], m, clip=0.2, agg=agg, **kw
            ),
            ("values", "old_values", "returns"),
        )
        yield f"aggregate-{agg}", None, lambda t, m, agg=agg, **kw: pf.aggregate(t["values"], m, agg, **kw), ("values",)
    yield "masked_mean", None, lambda t, m, **kw: pf.masked_mean(t["values"], m, **kw), ("values",)
    yield "masked_whiten", None, lambda t, m, **kw: pf.masked_whiten(t["values"], m, **kw), ("values",)
    for mode in ROLLOUT_CORRECTION_MODES:
        yield (
            f"rollout_correction-{mode}",
            None,
            lambda t, m, mode=mode, **kw: pf.rollout_correction_weights(
                t["old_logprobs"], t["rollout_logprobs"], m, mode=mode, **kw
            ),
            ("old_logprobs", "rollout_logprobs"),
        )
    yield (
        "policy_objective",
        None,
        lambda t, m, **kw: pf.policy_objective(
            t["logprobs"],
            t["entropy"],
            t["old_logprobs"],
            t["advantages"],
            m,
            agg="seq-mean-token-sum",
            ref_logprobs=t["ref_logprobs"],
            kl_coef=0.1,
            entropy_coef=0.01,
            **kw,
        ),
        ("logprobs", "entropy", "old_logprobs", "advantages", "ref_logprobs"),
    )
    yield (
        "linear_policy_loss",
        "linear_policy_loss",
        lambda t, m, **kw: pf.linear_policy_loss(
            t["hidden"],
            head,
            t["labels"],
            t["old_logprobs"],
            t["advantages"],
            m,
            agg="seq-mean-token-mean",
            ref_logprobs=t["ref_logprobs"],
            kl_coef=0.1,
            **kw,
        ),
        ("hidden", "old_logprobs", "advantages", "ref_logprobs"),
    )


def _params():
    out = []
    for case_id, op, call, grads in _cases():
        backends = ("auto",) if op is None else serving(op, "cpu")
        for backend in backends:
            out.append(pytest.param(call, grads, backend, id=f"{case_id}-{backend}"))
    return out


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat(v)]
    return []


@pytest.mark.parametrize("call, grads, backend", _params())
def test_packed_equals_padded_at_the_valid_tokens_in_value_and_gradient(call, grads, backend):
    padded, mask, valid, cu_seqlens = _padded_case(torch.randint(1000, ()).item())
    packed = {k: v[valid].clone() for k, v in padded.items()}
    for inputs in (padded, packed):
        for name in grads:
            inputs[name].requires_grad_(True)
    with pf.use_backend(backend):
        want = _flat(call(padded, mask))
        got = _flat(call(packed, mask[valid], cu_seqlens=cu_seqlens))
    assert len(got) == len(want)
    for w, h in zip(want, got):
        expected = w[valid] if tuple(w.shape[:2]) == tuple(valid.shape) else w
        assert h.shape == expected.shape and torch.equal(h.detach(), expected.detach())
    g = torch.Generator().manual_seed(3)
    differentiable = [(w, h) for w, h in zip(want, got) if w.requires_grad and w.is_floating_point()]
    if not differentiable:
        return
    pulls = [torch.randn(w.shape, generator=g, dtype=w.dtype) for w, _ in differentiable]
    sum((w * p).sum() for (w, _), p in zip(differentiable, pulls)).backward()
    packed_pulls = [p[valid] if tuple(p.shape[:2]) == tuple(valid.shape) else p for p in pulls]
    sum((h * p).sum() for (_, h), p in zip(differentiable, packed_pulls)).backward()
    assert any(padded[name].grad is not None for name in grads)
    for name in grads:  # an input the op does not differentiate (a detached old_logprobs) has none either way
        want_grad, got_grad = padded[name].grad, packed[name].grad
        assert (got_grad is None) == (want_grad is None), name
        assert want_grad is None or torch.equal(got_grad, want_grad[valid]), name


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
