"""Public ops: the registered advantage estimators over flat batches with group ids."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._dtypes import result_dtype
from ..advantage_methods import PARAM_CHECKS, REGISTRY, Groups, Inputs, advantage_methods
from ..backends import reference, resolve

__all__ = ["group_advantages", "advantage_methods"]


def dense_group_index(group_ids: torch.Tensor) -> torch.Tensor:
    """Any integer ids ``[B]`` as dense ids in ``[0, B)`` (equal ids, equal dense id), by a
    stable sort: no host sync, no loop over groups."""
    sorted_ids, order = torch.sort(group_ids, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    dense_sorted = starts.cumsum(0) - 1
    return torch.empty_like(dense_sorted).scatter_(0, order, dense_sorted)


def _registered(method):
    entry = REGISTRY.get(method) if isinstance(method, str) else None
    if entry is None or entry.fn is None:
        names = tuple(name for name, e in REGISTRY.items() if e.fn is not None)
        hint = "; gae needs values: use ppo_fast.gae" if method == "gae" else ""
        raise ValueError(f"method must be one of {names}, got {method!r}{hint}")
    return entry


def group_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor | None,
    mask: torch.Tensor,
    *,
    method: str = "grpo",
    **params: float | bool | torch.Tensor | None,
):
    """Advantages ``[B, T]`` of a registered estimator (``pf.advantage_methods()``).

    Args:
        scores: ``[B]`` sequence-level scores, or ``[B, T]`` token-level rewards (summed
            over the valid tokens for the outcome methods; ``reinforce_plus_plus`` and
            ``remax`` use them per token and put a ``[B]`` score on each row's last valid
            token).  A row without a valid token scores 0.
        group_ids: ``[B]`` integer ids, any values, in any order (responses with equal ids
            form a group); ``None`` for the methods that use no group.
        mask: ``[B, T]`` 1/True at valid response tokens.
        method: a name in ``pf.advantage_methods()`` (all but ``gae``, which is ``pf.gae``).
        **params: the method's keyword parameters (``norm_by_std``, ``epsilon``, ``gamma``,
            ``f_norm``, ``baselines``, ``zero_singletons``; see the registry).

    Returns:
        ``[B, T]`` float32 (float64 for float64 inputs), 0 at masked positions.  Equal to
        verl 0.9.1's function of the same name at the valid positions (verl's
        ``remax`` also writes its return at interior masked tokens).  Differentiable in
        ``scores`` as its plain-PyTorch formula is.
    """
    entry = _registered(method)
    unknown = sorted(set(params) - set(entry.params))
    if unknown:
        raise TypeError(
            f"group_advantages(method={method!r}) got unexpected parameter(s) {unknown}; "
            f"it takes {sorted(entry.params) or 'none'}"
        )
    check.tensor("scores", scores, min_ndim=1)
    if scores.dim() > 2:
        raise ValueError(f"scores must be [B] or [B, T], got shape {tuple(scores.shape)}")
    check.tensor("mask", mask, dtypes=None, ndim=2)
    batch = mask.shape[0]
    if scores.shape[0] != batch or (scores.dim() == 2 and scores.shape != mask.shape):
        raise ValueError(
            f"scores must have shape ({batch},) or {tuple(mask.shape)} (the mask's), got {tuple(scores.shape)}"
        )
    mask = check.mask("mask", mask, mask.shape)
    values = {**entry.params, **params}
    for name, value in params.items():
        values[name] = PARAM_CHECKS[name](name, value)
    for name, value in values.items():
        if value is None:
            raise TypeError(f"group_advantages(method={method!r}) needs {name}")
        if isinstance(value, torch.Tensor) and value.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},), got {tuple(value.shape)}")
    tensors = {name: v for name, v in values.items() if isinstance(v, torch.Tensor)}
    check.same_device(scores=scores, mask=mask, group_ids=group_ids, **tensors)
    # Also for a method without groups: an explicit backend that does not implement it raises.
    group_sum = resolve("group_sum", scores.device.type, entry.backends, f"group_advantages(method={method!r})")
    groups = None
    if entry.needs_groups:
        if group_ids is None:
            raise TypeError(f"group_advantages(method={method!r}) needs group_ids, got None")
        check.tensor("group_ids", group_ids, dtypes=check.INT_DTYPES, ndim=1)
        if group_ids.shape[0] != batch:
            raise ValueError(f"group_ids must have shape ({batch},), got {tuple(group_ids.shape)}")
        groups = Groups(dense_group_index(group_ids.long()), group_sum)
        if entry.min_group_size > 1 and check.host_checks_free(scores) and batch:
            (count,) = groups.sums(torch.ones(batch, dtype=torch.float32, device=scores.device))
            if bool((count < entry.min_group_size).any()):
                raise ValueError(
                    f"group_advantages(method={method!r}) needs at least {entry.min_group_size} "
                    "responses in every group (group_ids)"
                )
    sequence_scores, rewards = _scores_and_rewards(scores, mask, result_dtype(scores, *tensors.values()))
    return entry.fn(Inputs(sequence_scores, rewards, mask, groups), **values)


def _scores_and_rewards(scores, mask, dtype) -> tuple:
    """``(sequence scores [B], token rewards [B, T])`` of ``[B]`` scores or ``[B, T]`` rewards."""
    if scores.dim() == 2:
        rewards = torch.where(mask, scores.to(dtype), 0.0)
        return rewards.sum(-1), rewards
    sequence_scores = torch.where(mask.any(-1), scores.to(dtype), 0.0)
    if not mask.shape[-1]:  # no token: empty, still in the autograd graph of the scores
        return sequence_scores, sequence_scores.unsqueeze(-1)[:, :0]
    last, _ = reference.last_valid_index(mask)  # the score on the row's last valid token
    return sequence_scores, sequence_scores.new_zeros(mask.shape).scatter(
        -1, last.unsqueeze(-1), sequence_scores.unsqueeze(-1)
    )
