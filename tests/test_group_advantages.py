"""The advantage-estimator registry: every method against verl 0.9.1's own function (skipped
where verl is not installed) and against a plain per-group formula, on flat batches with
uneven, singleton, unsorted and non-contiguous groups and masks with holes; the dispatch
rules (per-method backends, ``auto`` fallback).  The errors: BAD_INPUTS in tests/test_conformance.py.

Adding a method: one entry in ``ORACLES`` (verl's call) and in ``FORMULAS`` (plain Python).
The fast backends' group_sum is compared with the reference by tests/test_conformance.py
(every method that declares them) and here on its own, forward and backward.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ppo_fast as pf
from ppo_fast import BackendUnavailableError
from ppo_fast.advantage_methods import REGISTRY
from ppo_fast.backends import backend_info, reference, serving
from ppo_fast.ops.group_advantages import dense_group_index

METHODS = [name for name, entry in REGISTRY.items() if entry.fn is not None]
PARAMS = {  # each method's parameter sets to test (defaults first)
    "grpo": [{}, {"norm_by_std": False}, {"epsilon": 1e-3}],
    "grpo_passk": [{}, {"norm_by_std": False}],
    "rloo": [{}],
    "reinforce_plus_plus": [{}, {"gamma": 0.9}],
    "reinforce_plus_plus_baseline": [{}],
    "remax": [{"baselines": None}],  # filled with a random [B] tensor
    "opo": [{}],
    "gpg": [{}, {"f_norm": 2.5}],
}


def batch(seed, *, min_group=1, dtype=torch.float64):
    """Token rewards [B, T] (a score on each row's last valid token, some zero scores), a mask
    with holes and a row without tokens, ids that are unsorted, negative, non-contiguous,
    with groups of uneven sizes (singletons unless ``min_group`` > 1)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [3, 1, 4, 2, 1, 5] if min_group == 1 else [3, 2, 4, 2, 5]
    names = [-7, 42, 3, 1000, 5, 0][: len(sizes)]
    ids = torch.tensor([n for n, k in zip(names, sizes) for _ in range(k)])
    ids = ids[torch.randperm(len(ids), generator=gen)]
    b, t = len(ids), 7
    mask = torch.rand(b, t, generator=gen) < 0.7
    mask[1] = False
    mask[-1] = True
    scores = torch.randint(0, 3, (b,), generator=gen).to(dtype) + torch.rand(b, generator=gen, dtype=dtype) * 0.5
    scores[torch.rand(b, generator=gen) < 0.2] = 0.0
    rewards = torch.zeros(b, t, dtype=dtype)
    rewards += torch.randn(b, t, generator=gen, dtype=dtype) * 0.1  # per-token terms (a KL penalty)
    last, has = reference.last_valid_index(mask)
    rewards[torch.arange(b), last] += torch.where(has, scores, 0.0)
    rewards = torch.where(mask, rewards, 0.0)
    baselines = torch.rand(b, generator=gen, dtype=dtype)
    return rewards, mask, ids, baselines


def with_baselines(params, baselines):
    return {k: (baselines if k == "baselines" else v) for k, v in params.items()}


# --------------------------------------------------------------------------- verl's functions

core = None
try:
    from verl.trainer.ppo import core_algos as core
except ImportError:  # verl not installed: the oracle tests skip
    pass


def _verl(name, rewards, mask, ids, params):
    fn = core.get_adv_estimator_fn(name)
    index = np.array(ids.tolist(), dtype=object)
    norm = params.get("norm_by_std", True)
    eps = params.get("epsilon", 1e-6)
    m = mask.to(rewards.dtype)
    if name == "grpo":
        return fn(rewards, m, index, epsilon=eps, norm_adv_by_std_in_grpo=norm)[0]
    if name == "grpo_passk":
        return fn(rewards, m, index, epsilon=eps, config={"norm_adv_by_std_in_grpo": norm})[0]
    if name == "reinforce_plus_plus":
        return fn(rewards, m, config=SimpleNamespace(gamma=params.get("gamma", 1.0)))[0]
    if name == "remax":
        return fn(rewards, params["baselines"], m)[0]
    if name == "gpg":
        return fn(rewards, m, index, f_norm=params.get("f_norm", 1.0))[0]
    return fn(rewards, m, index)[0]  # rloo, opo, reinforce_plus_plus_baseline


def _cases():
    for method in METHODS:
        for params in PARAMS[method]:
            yield pytest.param(method, params, id=f"{method}-" + "-".join(f"{k}={v}" for k, v in params.items()))


def test_every_method_has_test_entries():
    assert set(PARAMS) == set(METHODS) and set(FORMULAS) == set(METHODS)


@pytest.mark.skipif(core is None, reason="verl is not installed")
@pytest.mark.parametrize("method, params", list(_cases()))
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_verl(method, params, seed):
    rewards, mask, ids, baselines = batch(seed, min_group=REGISTRY[method].min_group_size)
    params = with_baselines(params, baselines)
    got = pf.group_advantages(rewards, ids, mask, method=method, **params)
    want = _verl(method, rewards.clone(), mask, ids, params)
    assert got.dtype == torch.float64
    # Float64 agrees to ~1e-7 relative, not 1e-15: verl gives a group of one a float32 std of 1
    # (torch.tensor(1.0)) and its masked_whiten divides sums by count + 1e-8.
    torch.testing.assert_close(got[mask], want[mask].to(got.dtype), rtol=1e-7, atol=1e-9)
    assert (got[~mask] == 0).all()
    # float32 inputs: float32 results, equal to verl's float32 computation within float32 rounding
    got32 = pf.group_advantages(rewards.float(), ids, mask, method=method, **with_baselines(params, baselines.float()))
    want32 = _verl(method, rewards.float(), mask, ids, with_baselines(params, baselines.float()))
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32[mask], want32[mask], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- plain formulas


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # unbiased
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _whiten(values, like):  # over a list of (row, t, value) tokens; 0 elsewhere
    xs = [v for _, _, v in values]
    m, s = _mean(xs), _std(xs)
    out = torch.zeros_like(like)
    for i, t, v in values:
        out[i, t] = (v - m) / math.sqrt(s * s + 1e-8)
    return out


def _outcome(fn):
    """A formula ``fn(score, group scores, group lengths, row length, all scores, params)`` per row."""

    def formula(rewards, mask, ids, params):
        scores = rewards.sum(-1).tolist()
        lengths = mask.sum(-1).tolist()
        out = torch.zeros_like(rewards)
        for i in range(len(scores)):
            members = [j for j in range(len(scores)) if ids[j] == ids[i]]
            value = fn(i, scores, members, lengths, params)
            out[i] = torch.where(mask[i], torch.tensor(value, dtype=out.dtype), 0.0)
        return out

    return formula


def _grpo(i, s, members, lengths, p):
    group = [s[j] for j in members]
    if len(group) == 1:
        return s[i] / (1 + p.get("epsilon", 1e-6)) if p.get("norm_by_std", True) else s[i]
    centred = s[i] - _mean(group)
    return centred / (_std(group) + p.get("epsilon", 1e-6)) if p.get("norm_by_std", True) else centred


def _passk(i, s, members, lengths, p):
    ranked = sorted(members, key=lambda j: (-s[j], j))
    if i != ranked[0]:
        return 0.0
    gap = s[ranked[0]] - s[ranked[1]]
    return gap / (_std([s[j] for j in members]) + p.get("epsilon", 1e-6)) if p.get("norm_by_std", True) else gap


def _rloo(i, s, members, lengths, p):
    others = [s[j] for j in members if j != i]
    return s[i] - _mean(others) if others else s[i]


def _opo(i, s, members, lengths, p):
    if len(members) == 1:
        return s[i]
    return s[i] - sum(lengths[j] * s[j] for j in members) / sum(lengths[j] for j in members)


def _gpg(i, s, members, lengths, p):
    alpha = len(s) / max(1, sum(1 for x in s if x != 0))
    mean = _mean([s[j] for j in members]) if len(members) > 1 else 0.0
    return alpha * (s[i] - mean) / p.get("f_norm", 1.0)


def _rpp_baseline(rewards, mask, ids, params):
    s = rewards.sum(-1).tolist()
    centred = []
    for i in range(len(s)):
        group = [s[j] for j in range(len(s)) if ids[j] == ids[i]]
        centred.append(s[i] - (_mean(group) if len(group) > 1 else 0.0))
    return _whiten([(i, t, centred[i]) for i in range(len(s)) for t in range(mask.shape[1]) if mask[i, t]], rewards)


def _rpp(rewards, mask, ids, params):
    gamma = params.get("gamma", 1.0)
    tokens = []
    for i in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[i, t]:
                running = float(rewards[i, t]) + gamma * running
                tokens.append((i, t, running))
    return _whiten(tokens, rewards)


def _remax(rewards, mask, ids, params):
    out = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        for t in range(rewards.shape[1]):
            if mask[i, t]:
                out[i, t] = float(rewards[i, t:].sum()) - float(params["baselines"][i])
    return out


FORMULAS = {
    "grpo": _outcome(_grpo),
    "grpo_passk": _outcome(_passk),
    "rloo": _outcome(_rloo),
    "reinforce_plus_plus": _rpp,
    "reinforce_plus_plus_baseline": _rpp_baseline,
    "remax": _remax,
    "opo": _outcome(_opo),
    "gpg": _outcome(_gpg),
}


@pytest.mark.parametrize(
    "method, params, backend",
    [
        pytest.param(*case.values, backend, id=f"{case.id}-{backend}")
        for case in _cases()
        for backend in serving("group_sum", "cpu")
        if backend in REGISTRY[case.values[0]].backends
    ],
)
def test_matches_plain_formula(method, params, backend):
    """On every backend serving group_sum that the method declares (the others: test_fast_backend_fallback)."""
    rewards, mask, ids, baselines = batch(5, min_group=REGISTRY[method].min_group_size)
    params = with_baselines(params, baselines)
    with pf.use_backend(backend):
        got = pf.group_advantages(rewards, ids, mask, method=method, **params)
    torch.testing.assert_close(got, FORMULAS[method](rewards, mask, ids, params), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("method", [m for m in METHODS if not m.startswith("reinforce") and m != "remax"])
def test_sequence_scores_equal_token_rewards(method):
    """A [B] score is the same as token rewards holding it on the last valid token."""
    rewards, mask, ids, _ = batch(3, min_group=REGISTRY[method].min_group_size)
    torch.testing.assert_close(
        pf.group_advantages(rewards.sum(-1), ids, mask, method=method),
        pf.group_advantages(rewards, ids, mask, method=method),
    )


@pytest.mark.parametrize("method", ["grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"])
def test_equal_scores_give_exactly_zero(method):
    """A group whose responses all score the same learns nothing from it: advantage exactly 0."""
    mask = torch.ones(8, 3, dtype=torch.bool)
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = pf.group_advantages(scores, ids, mask, method=method)
    assert (adv[:4] == 0).all(), adv[:4]
    assert (adv[4:] != 0).any()


def test_ids_need_not_be_contiguous_or_sorted():
    rewards, mask, ids, _ = batch(2)
    relabelled = ids * 1000 - 17  # same partition, other values
    order = torch.randperm(len(ids))
    base = pf.group_advantages(rewards, ids, mask, method="grpo")
    torch.testing.assert_close(pf.group_advantages(rewards, relabelled, mask, method="grpo"), base)
    torch.testing.assert_close(pf.group_advantages(rewards[order], ids[order], mask[order], method="grpo"), base[order])
    dense = dense_group_index(ids)
    assert dense.min() == 0 and dense.max() == len(set(ids.tolist())) - 1
    assert all((dense[i] == dense[j]) == (ids[i] == ids[j]) for i in range(len(ids)) for j in range(len(ids)))


def test_masked_values_are_never_read():
    rewards, mask, ids, _ = batch(4, dtype=torch.float32)
    poisoned = torch.where(mask, rewards, torch.nan)
    for method in ("grpo", "rloo", "reinforce_plus_plus"):
        torch.testing.assert_close(
            pf.group_advantages(poisoned, ids, mask, method=method),
            pf.group_advantages(rewards, ids, mask, method=method),
        )


# --------------------------------------------------------------------------- registry and dispatch


def test_registry_lists_every_method_with_needs():
    methods = pf.advantage_methods()
    names = "gae grpo grpo_passk rloo reinforce_plus_plus reinforce_plus_plus_baseline remax opo gpg"
    assert set(methods) == set(names.split())
    assert methods["gae"].needs_critic and not any(m.needs_critic for n, m in methods.items() if n != "gae")
    assert not methods["remax"].needs_groups and methods["grpo"].needs_groups
    for entry in methods.values():
        assert "reference" in entry.backends


FAST = [name for name in serving("group_sum", "cpu") if name != "reference"]


@pytest.mark.parametrize("backend, method", [(b, m) for b in FAST for m in METHODS if b not in REGISTRY[m].backends])
def test_fast_backend_fallback(backend, method):
    """A method a backend does not implement: refused explicitly, naming it; ``auto`` takes the reference for it."""
    rewards, mask, ids, baselines = batch(8, min_group=2)
    params = with_baselines(PARAMS[method][0], baselines)
    with pf.use_backend("reference"):
        want = pf.group_advantages(rewards, ids, mask, method=method, **params)
    with pf.use_backend(backend), pytest.raises(BackendUnavailableError, match=method):
        pf.group_advantages(rewards, ids, mask, method=method, **params)
    with pf.use_backend("auto"):
        torch.testing.assert_close(pf.group_advantages(rewards, ids, mask, method=method, **params), want)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_sum_matches_reference_forward_and_backward(backend, dtype):
    gen = torch.Generator().manual_seed(11)
    for b, c in [(1, 1), (13, 3), (300, 2)]:  # 300 rows: past the Triton kernel's row block
        values = torch.randn(b, c, generator=gen, dtype=dtype)
        index = dense_group_index(torch.randint(0, max(1, b // 3), (b,), generator=gen))
        x, y = (values.clone().requires_grad_() for _ in range(2))
        got, want = backend_info(backend).module.FUNCTIONS["group_sum"](x, index), reference.group_sum(y, index)
        tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(got, want, **tol)
        g = torch.randn(b, c, generator=gen, dtype=dtype)
        (got * g).sum().backward()
        (want * g).sum().backward()
        torch.testing.assert_close(x.grad, y.grad, **tol)


@pytest.mark.skipif("native" not in FAST, reason="native backend not built")
def test_group_sum_native_is_deterministic_and_exact():
    values = torch.randn(257, 2)
    index = dense_group_index(torch.randint(0, 5, (257,)))
    first = backend_info("native").module.FUNCTIONS["group_sum"](values, index)
    assert torch.equal(first, backend_info("native").module.FUNCTIONS["group_sum"](values, index))
    assert torch.equal(first, reference.group_sum(values, index))  # same order as index_add on CPU


def test_trainer_config_names_agree_with_the_registry():
    """trainer/config.py reads the registry's names from ppo_fast.spec without importing torch (for the launcher)."""
    from ppo_fast.trainer import config

    assert config.ADVANTAGE_METHOD_NAMES == tuple(REGISTRY)
    assert config.CRITIC_METHODS == tuple(n for n, m in REGISTRY.items() if m.needs_critic)
    assert config.GROUP_METHODS == tuple(n for n, m in REGISTRY.items() if m.needs_groups and m.fn is not None)
    assert config.CHOICES["advantage_method"] == tuple(REGISTRY)
