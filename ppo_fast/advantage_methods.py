"""The advantage methods' formulas: one function per method, registered against its metadata in
``ppo_fast.spec.ADVANTAGE_METHODS`` (torch-free, so the CLI and config read it without torch).

Each method is one plain-PyTorch function of :class:`Inputs` (sequence scores, token
rewards, mask and the batch's :class:`Groups`) and its keyword parameters, registered
with what it needs (a critic, group ids, a baseline) and which backends implement it.
The group statistics go through the backend op ``group_sum`` (reference, native C++ and
Triton kernels), so a method that only uses ``Groups.sum``/``mean``/``mean_std`` runs on
every backend serving ``group_sum``; one that needs anything else (a group max, a scan
over tokens) is declared ``reference`` only, and ``auto`` falls back to the reference
for that method alone.

The formulas are verl 0.9.1's (``verl.trainer.ppo.core_algos``, tested against its own
functions), with verl's conventions: a group of one response has mean 0 and std 1; the
standard deviation is unbiased; ``epsilon`` (default 1e-6, verl's) is added to it.
``gae`` is listed (it needs the critic) but is its own op, :func:`ppo_fast.gae`.

Adding a method: its entry in ``ppo_fast.spec.ADVANTAGE_METHODS``, one function decorated
with :func:`register` here (plus a check in ``PARAM_CHECKS`` for a new parameter name) and
one entry in ``tests/test_group_advantages.py``'s table of verl oracles.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import _validation as check
from .backends.reference import masked_whiten
from .spec import ADVANTAGE_METHODS, BACKENDS


@dataclass(frozen=True)
class Groups:
    """The groups of a flat batch: ``index [B]`` dense ids in ``[0, B)`` and the backend's
    ``group_sum`` (row i gets the sum over its group of each column)."""

    index: torch.Tensor
    group_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def sums(self, *columns: torch.Tensor) -> list[torch.Tensor]:
        """Per row, its group's sum of each ``[B]`` column (one reduction for all)."""
        totals = self.group_sum(torch.stack(columns, dim=-1), self.index)
        return list(totals.unbind(-1))

    def mean(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Per row, the (weighted) mean of its group; 0 for a group of one (verl's rule)."""
        w = torch.ones_like(x) if weights is None else weights
        count, total_w, total = self.sums(torch.ones_like(x), w, w * x)
        return torch.where(count > 1, total / torch.where(total_w != 0, total_w, 1.0), 0.0)

    def mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, its group's mean and unbiased std (two passes, as torch.std); 0 and 1 for a
        group of one.  In a group of equal values the std's gradient is taken as 0 (torch.std's
        is NaN there), so that such a group passes finite gradients."""
        count, total = self.sums(torch.ones_like(x), x)
        mean = total / count
        (squares,) = self.sums((x - mean).square())
        many = count > 1
        variance = torch.where(many, squares / torch.where(many, count - 1.0, 1.0), 1.0)
        std = torch.where(variance > 0, torch.sqrt(torch.where(variance > 0, variance, 1.0)), 0.0)
        return torch.where(many, mean, 0.0), std


@dataclass(frozen=True)
class Inputs:
    scores: torch.Tensor  # [B] sequence-level score (0 for a row without a valid token)
    rewards: torch.Tensor  # [B, T] token-level rewards, 0 at masked positions
    mask: torch.Tensor  # [B, T] bool
    groups: Groups | None  # None for the methods that use no group

    def per_token(self, per_row: torch.Tensor) -> torch.Tensor:
        """A ``[B]`` advantage on every valid token of its row, 0 elsewhere."""
        return torch.where(self.mask, per_row.unsqueeze(-1), 0.0)


@dataclass(frozen=True)
class AdvantageMethod:
    """A method's metadata (``ppo_fast.spec.AdvantageMethodSpec``) and its formula."""

    name: str
    fn: Callable[..., torch.Tensor] | None  # None for gae, which is its own op (pf.gae)
    summary: str
    backends: tuple[str, ...]
    needs_critic: bool = False
    needs_groups: bool = True
    normalized: bool = False  # already scale-free per batch or group (the trainer skips its whitening)
    min_group_size: int = 1  # checked on CPU in eager mode (elsewhere a smaller group gives NaN/inf)
    params: dict = field(default_factory=dict)  # keyword parameter -> default (from the function)


REGISTRY: dict[str, AdvantageMethod] = {}


def _non_negative(name, value):
    return check.real(name, value, low=0.0)


def _positive(name, value):
    return check.real(name, value, low=0.0, low_open=True)


def _unit(name, value):
    return check.real(name, value, low=0.0, high=1.0)


def _baselines(name, value):
    return check.tensor(name, value, ndim=1)


# Every parameter a method may take, with its check (one place, whichever methods share it).
PARAM_CHECKS: dict[str, Callable] = {
    "norm_by_std": check.flag,  # verl: algorithm.norm_adv_by_std_in_grpo
    "epsilon": _non_negative,
    "gamma": _unit,
    "f_norm": _positive,
    "baselines": _baselines,  # verl: reward_baselines
    "zero_singletons": check.flag,  # verl: rloo_vectorized (True) vs rloo (False) for a group of one
}


def register(name: str):
    """Register ``fn(inputs: Inputs, **params) -> [B, T]`` as advantage method ``name``, whose
    metadata is ``ppo_fast.spec.ADVANTAGE_METHODS[name]`` (its parameters and defaults must agree)."""

    def decorator(fn):
        spec = ADVANTAGE_METHODS[name]
        assert name not in REGISTRY, f"advantage method {name!r} registered twice"
        params = {p.name: p.default for p in list(inspect.signature(fn).parameters.values())[1:]}
        assert params == spec.params, f"{name}: the function's parameters {params} are not the spec's {spec.params}"
        unknown = set(params) - set(PARAM_CHECKS)
        assert not unknown, f"{name}: add a check for parameter(s) {sorted(unknown)} to PARAM_CHECKS"
        REGISTRY[name] = AdvantageMethod(
            name,
            fn,
            spec.summary,
            spec.backends,
            spec.needs_critic,
            spec.needs_groups,
            spec.normalized,
            spec.min_group_size,
            params,
        )
        return fn

    return decorator


_gae = ADVANTAGE_METHODS["gae"]
REGISTRY["gae"] = AdvantageMethod("gae", None, _gae.summary, _gae.backends, needs_critic=True, needs_groups=False)


@register("grpo")
def grpo(inputs: Inputs, norm_by_std: bool = True, epsilon: float = 1e-6) -> torch.Tensor:
    mean, std = inputs.groups.mean_std(inputs.scores)
    centred = inputs.scores - mean
    return inputs.per_token(centred / (std + epsilon) if norm_by_std else centred)


@register("grpo_passk")
def grpo_passk(inputs: Inputs, norm_by_std: bool = True, epsilon: float = 1e-6) -> torch.Tensor:
    scores, index = inputs.scores, inputs.groups.index
    rows = torch.arange(scores.shape[0], device=scores.device)

    def group_max(x):
        return torch.full_like(x, -torch.inf).scatter_reduce(0, index, x, "amax")[index]

    best = group_max(scores)
    no_row = rows.shape[0]
    first_best = torch.full_like(rows, no_row).scatter_reduce(
        0, index, torch.where(scores == best, rows, no_row), "amin"
    )
    is_best = rows == first_best[index]  # one row per group (the first of tied best ones)
    second = group_max(torch.where(is_best, -torch.inf, scores))
    advantage = best - second  # ties for the best give 0, whichever row holds it
    if norm_by_std:
        advantage = advantage / (inputs.groups.mean_std(scores)[1] + epsilon)
    return inputs.per_token(torch.where(is_best, advantage, 0.0))


@register("rloo")
def rloo(inputs: Inputs, zero_singletons: bool = False) -> torch.Tensor:
    x = inputs.scores
    count, total = inputs.groups.sums(torch.ones_like(x), x)
    scale = count / torch.where(count > 1, count - 1.0, 1.0)
    # A group of one has no other response: verl's rloo keeps its score, rloo_vectorized gives 0.
    single = torch.zeros_like(x) if zero_singletons else x
    return inputs.per_token(torch.where(count > 1, x * scale - (total / count) * scale, single))


@register("reinforce_plus_plus")
def reinforce_plus_plus(inputs: Inputs, gamma: float = 1.0) -> torch.Tensor:
    rewards, mask = inputs.rewards, inputs.mask
    returns = torch.zeros_like(rewards) if rewards.shape[1] else rewards.clone()  # T = 0: still in the graph
    running = rewards.new_zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):  # a masked token passes the return through
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, 0.0)
    return masked_whiten(returns, mask, True, 1e-8)


@register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: Inputs) -> torch.Tensor:
    centred = inputs.scores - inputs.groups.mean(inputs.scores)
    return masked_whiten(inputs.per_token(centred), inputs.mask, True, 1e-8)


@register("remax")
def remax(inputs: Inputs, baselines: torch.Tensor | None = None) -> torch.Tensor:
    returns = inputs.rewards.flip(-1).cumsum(-1).flip(-1)
    return torch.where(inputs.mask, returns - baselines.to(returns.dtype).unsqueeze(-1), 0.0)


@register("opo")
def opo(inputs: Inputs) -> torch.Tensor:
    lengths = inputs.mask.sum(-1).to(inputs.scores.dtype)
    return inputs.per_token(inputs.scores - inputs.groups.mean(inputs.scores, weights=lengths))


@register("gpg")
def gpg(inputs: Inputs, f_norm: float = 1.0) -> torch.Tensor:
    x = inputs.scores
    alpha = x.shape[0] / torch.count_nonzero(x).clamp_min(1).to(x.dtype)
    return inputs.per_token(alpha * (x - inputs.groups.mean(x)) / f_norm)


assert set(REGISTRY) == set(ADVANTAGE_METHODS), f"registered {sorted(REGISTRY)}, spec lists {sorted(ADVANTAGE_METHODS)}"
assert all(set(m.backends) <= set(BACKENDS) for m in REGISTRY.values())


def advantage_methods() -> dict[str, AdvantageMethod]:
    """The registered advantage estimators by name (a copy)."""
    return dict(REGISTRY)
