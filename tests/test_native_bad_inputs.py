"""Every torch.ops.ppo_fast op, forward and backward, called directly with bad arguments
(mismatched shapes, wrong ranks, dtypes, unknown names): each must raise RuntimeError
with a message naming the op and the argument, never crash.

The C++ kernels are run first in a separate interpreter (one for all cases, restarted
after a case that kills it), so that a regression that segfaults shows up as a failure
of that case instead of killing pytest; a case that raised there is then run again
in-process.  The same cases on meta tensors check the fake kernels' checks (what
torch.compile sees)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_native_common import requires_native

pytestmark = requires_native

B, T, N, V = 3, 5, 4, 11


def _policy(**changes):
    args = dict(
        logprobs=torch.randn(B, T),
        old_logprobs=torch.randn(B, T),
        advantages=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        weights=torch.rand(B, T),
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg="token-mean",
    )
    args.update(changes)
    return tuple(args.values())


def _policy_backward(**changes):
    args = dict(
        grad_loss=torch.tensor(1.0),
        logprobs=torch.randn(B, T),
        old_logprobs=torch.randn(B, T),
        advantages=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        weights=torch.rand(B, T),
        row_scale=torch.ones(B),
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=3.0,
        output_mask=[True, True, True, True],
    )
    args.update(changes)
    return tuple(args.values())


def _value(**changes):
    args = dict(
        values=torch.randn(B, T),
        old_values=torch.randn(B, T),
        returns=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        clip=0.2,
        agg="token-mean",
    )
    args.update(changes)
    return tuple(args.values())


def _value_backward(**changes):
    args = dict(
        grad_loss=torch.tensor(1.0),
        values=torch.randn(B, T),
        old_values=torch.randn(B, T),
        returns=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        row_scale=torch.ones(B),
        clip=0.2,
        output_mask=[True, True, True],
    )
    args.update(changes)
    return tuple(args.values())


def _kl(**changes):
    args = dict(logprobs=torch.randn(B, T), ref_logprobs=torch.randn(B, T), kl_estimator="k3")
    args.update(changes)
    return tuple(args.values())


def _kl_backward(**changes):
    args = dict(
        grad_kl=torch.randn(B, T),
        logprobs=torch.randn(B, T),
        ref_logprobs=torch.randn(B, T),
        kl_estimator="k3",
        output_mask=[True, True],
    )
    args.update(changes)
    return tuple(args.values())


def _rewards(**changes):
    args = dict(
        scores=torch.randn(B),
        logprobs=torch.randn(B, T),
        ref_logprobs=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        kl_coef=0.1,
        kl_estimator="k1",
    )
    args.update(changes)
    return tuple(args.values())


def _rewards_backward(**changes):
    args = dict(
        grad_rewards=torch.randn(B, T),
        grad_kl=torch.randn(B, T),
        logprobs=torch.randn(B, T),
        ref_logprobs=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        kl_coef=0.1,
        kl_estimator="k1",
        scores_dtype=torch.float32,
        output_mask=[True, True, True],
    )
    args.update(changes)
    return tuple(args.values())


def _gae(**changes):
    args = dict(
        rewards=torch.randn(B, T),
        values=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        gamma=1.0,
        lam=0.95,
    )
    args.update(changes)
    return tuple(args.values())


def _gae_backward(**changes):
    args = dict(
        grad_advantages=torch.randn(B, T),
        grad_returns=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        gamma=1.0,
        lam=0.95,
        rewards_dtype=torch.float32,
        values_dtype=torch.float32,
        output_mask=[True, True],
    )
    args.update(changes)
    return tuple(args.values())


def _logprobs(**changes):
    args = dict(
        logits=torch.randn(N, V),
        labels=torch.randint(0, V, (N,)),
        temperature=1.0,
        return_entropy=True,
        ignore_index=-100,
    )
    args.update(changes)
    return tuple(args.values())


def _logprobs_backward(**changes):
    args = dict(
        grad_logprobs=torch.randn(N),
        grad_entropy=torch.randn(N),
        logits=torch.randn(N, V),
        labels=torch.randint(0, V, (N,)),
        stats=torch.randn(N),
        entropy=torch.randn(N),
        temperature=1.0,
        ignore_index=-100,
    )
    args.update(changes)
    return tuple(args.values())


H = 6  # the fused head's hidden size


def _head(**changes):
    args = dict(
        hidden=torch.randn(N, H),
        weight=torch.randn(V, H),
        labels=torch.randint(0, V, (N,)),
        bias=torch.randn(V),
        temperature=1.0,
        logit_scale=1.0,
        logit_softcap=30.0,
        return_entropy=True,
        ignore_index=-100,
    )
    args.update(changes)
    return tuple(args.values())


def _head_backward(**changes):
    args = dict(
        grad_logprobs=torch.randn(N),
        grad_entropy=torch.randn(N),
        hidden=torch.randn(N, H),
        weight=torch.randn(V, H),
        labels=torch.randint(0, V, (N,)),
        bias=torch.randn(V),
        stats=torch.randn(N),
        entropy=torch.randn(N),
        temperature=1.0,
        logit_scale=1.0,
        logit_softcap=30.0,
        ignore_index=-100,
        output_mask=[True, True, True],
    )
    args.update(changes)
    return tuple(args.values())


def _group_sum(**changes):
    args = dict(values=torch.randn(B, T), group_index=torch.tensor([0, 2, 0]))
    args.update(changes)
    return tuple(args.values())


def _sequence_policy(**changes):  # policy_loss_gspo and policy_loss_geo_mean
    args = dict(
        logprobs=torch.randn(B, T),
        old_logprobs=torch.randn(B, T),
        advantages=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        weights=torch.rand(B, T),
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        agg="token-mean",
    )
    args.update(changes)
    return tuple(args.values())


def _sequence_policy_backward(**changes):
    args = dict(
        grad_loss=torch.tensor(1.0),
        logprobs=torch.randn(B, T),
        old_logprobs=torch.randn(B, T),
        advantages=torch.randn(B, T),
        mask=torch.ones(B, T, dtype=torch.bool),
        weights=torch.rand(B, T),
        row_scale=torch.ones(B),
        row_state=torch.zeros(B, 2),
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        output_mask=[True, True, True, True],
    )
    args.update(changes)
    return tuple(args.values())


SHAPE = "must have the shape of"
FLOAT = "must be float32, float64, float16 or bfloat16"
BOOL_MASK = "mask must be a bool tensor"
POLICY_FLOATS = ("logprobs", "old_logprobs", "advantages", "weights")

# id -> (op, args builder, message the RuntimeError must contain).  The args builders run
# in both interpreters, so that each case's tensors are made where it runs.
CASES = {
    # clipped_policy_loss
    "policy-old-shape": (
        "clipped_policy_loss",
        lambda: _policy(old_logprobs=torch.randn(B, T - 1)),
        f"old_logprobs {SHAPE} logprobs",
    ),
    "policy-adv-rows": (
        "clipped_policy_loss",
        lambda: _policy(advantages=torch.randn(B + 1, T)),
        f"advantages {SHAPE} logprobs",
    ),
    "policy-adv-flat": (
        "clipped_policy_loss",
        lambda: _policy(advantages=torch.randn(B * T)),
        f"advantages {SHAPE} logprobs",
    ),
    "policy-mask-shape": (
        "clipped_policy_loss",
        lambda: _policy(mask=torch.ones(B, 2 * T, dtype=torch.bool)),
        f"mask {SHAPE} logprobs",
    ),
    "policy-mask-dtype": ("clipped_policy_loss", lambda: _policy(mask=torch.ones(B, T)), BOOL_MASK),
    "policy-weights-shape": (
        "clipped_policy_loss",
        lambda: _policy(weights=torch.rand(1, T)),
        f"weights {SHAPE} logprobs",
    ),
    "policy-weights-dtype": ("clipped_policy_loss", lambda: _policy(weights=torch.ones(B, T, dtype=torch.long)), FLOAT),
    "policy-1d": (
        "clipped_policy_loss",
        lambda: _policy(**{k: torch.randn(T) for k in POLICY_FLOATS}, mask=torch.ones(T, dtype=torch.bool)),
        "logprobs must be 2-D",
    ),
    "policy-3d": (
        "clipped_policy_loss",
        lambda: _policy(**{k: torch.randn(B, T, 2) for k in POLICY_FLOATS}, mask=torch.ones(B, T, 2, dtype=torch.bool)),
        "logprobs must be 2-D",
    ),
    "policy-int-logprobs": (
        "clipped_policy_loss",
        lambda: _policy(logprobs=torch.zeros(B, T, dtype=torch.int32)),
        FLOAT,
    ),
    "policy-agg": ("clipped_policy_loss", lambda: _policy(agg="tokens-mean"), "agg must be one of"),
    # clipped_policy_loss_backward
    "policy-bwd-grad-numel": (
        "clipped_policy_loss_backward",
        lambda: _policy_backward(grad_loss=torch.ones(2)),
        "grad_loss must have one element",
    ),
    "policy-bwd-grad-empty": (
        "clipped_policy_loss_backward",
        lambda: _policy_backward(grad_loss=torch.ones(0)),
        "grad_loss must have one element",
    ),
    "policy-bwd-grad-int": ("clipped_policy_loss_backward", lambda: _policy_backward(grad_loss=torch.tensor(1)), FLOAT),
    "policy-bwd-row-scale": (
        "clipped_policy_loss_backward",
        lambda: _policy_backward(row_scale=torch.ones(B - 1)),
        "row_scale must have shape",
    ),
    "policy-bwd-row-scale-2d": (
        "clipped_policy_loss_backward",
        lambda: _policy_backward(row_scale=torch.ones(B, 1)),
        "row_scale must have shape",
    ),
    "policy-bwd-old-shape": (
        "clipped_policy_loss_backward",
        lambda: _policy_backward(old_logprobs=torch.randn(T, B)),
        f"old_logprobs {SHAPE} logprobs",
    ),
    "policy-bwd-weights": (
        "clipped_policy_loss_backward",
        lambda: _policy_backward(weights=torch.rand(B, T + 3)),
        f"weights {SHAPE} logprobs",
    ),
    "policy-bwd-mask": (
        "clipped_policy_loss_backward",
        lambda: _policy_backward(mask=torch.ones(B, T, dtype=torch.uint8)),
        BOOL_MASK,
    ),
    # group_sum
    "group-sum-index-rows": (
        "group_sum",
        lambda: _group_sum(group_index=torch.tensor([0, 1])),
        "group_index must have shape [3]",
    ),
    "group-sum-index-2d": (
        "group_sum",
        lambda: _group_sum(group_index=torch.tensor([[0, 1, 0]])),
        "group_index must have shape [3]",
    ),
    "group-sum-index-int32": (
        "group_sum",
        lambda: _group_sum(group_index=torch.tensor([0, 1, 0], dtype=torch.int32)),
        "group_index must be int64",
    ),
    "group-sum-index-float": (
        "group_sum",
        lambda: _group_sum(group_index=torch.tensor([0.0, 1.0, 0.0])),
        "group_index must be int64",
    ),
    "group-sum-values-1d": ("group_sum", lambda: _group_sum(values=torch.randn(B)), "values must be 2-D"),
    "group-sum-values-3d": ("group_sum", lambda: _group_sum(values=torch.randn(B, T, 2)), "values must be 2-D"),
    "group-sum-values-half": (
        "group_sum",
        lambda: _group_sum(values=torch.randn(B, T).half()),
        "values must be float32 or float64",
    ),
    # A value check: the C++ kernel's only (the fake kernel sees no values).
    "group-sum-index-range": (
        "group_sum",
        lambda: _group_sum(group_index=torch.tensor([0, 3, 0])),
        "group_index must lie in [0, 3)",
    ),
    "group-sum-index-negative": (
        "group_sum",
        lambda: _group_sum(group_index=torch.tensor([0, -1, 0])),
        "group_index must lie in [0, 3)",
    ),
    # policy_loss_gspo
    "gspo-old-shape": (
        "policy_loss_gspo",
        lambda: _sequence_policy(old_logprobs=torch.randn(B, T - 1)),
        f"old_logprobs {SHAPE} logprobs",
    ),
    "gspo-mask-dtype": ("policy_loss_gspo", lambda: _sequence_policy(mask=torch.ones(B, T)), BOOL_MASK),
    "gspo-weights-shape": (
        "policy_loss_gspo",
        lambda: _sequence_policy(weights=torch.rand(1, T)),
        f"weights {SHAPE} logprobs",
    ),
    "gspo-1d": (
        "policy_loss_gspo",
        lambda: _sequence_policy(**{k: torch.randn(T) for k in POLICY_FLOATS}, mask=torch.ones(T, dtype=torch.bool)),
        "logprobs must be 2-D",
    ),
    "gspo-int-advantages": (
        "policy_loss_gspo",
        lambda: _sequence_policy(advantages=torch.ones(B, T, dtype=torch.long)),
        FLOAT,
    ),
    "gspo-agg": ("policy_loss_gspo", lambda: _sequence_policy(agg="tokens"), "agg must be one of"),
    # policy_loss_gspo_backward
    "gspo-bwd-grad-numel": (
        "policy_loss_gspo_backward",
        lambda: _sequence_policy_backward(grad_loss=torch.ones(2)),
        "grad_loss must have one element",
    ),
    "gspo-bwd-row-scale": (
        "policy_loss_gspo_backward",
        lambda: _sequence_policy_backward(row_scale=torch.ones(B + 1)),
        "row_scale must have shape [3]",
    ),
    "gspo-bwd-row-state": (
        "policy_loss_gspo_backward",
        lambda: _sequence_policy_backward(row_state=torch.zeros(B + 1, 2)),
        "row_state must have shape [3, 2]",
    ),
    "gspo-bwd-old-shape": (
        "policy_loss_gspo_backward",
        lambda: _sequence_policy_backward(old_logprobs=torch.randn(T, B)),
        f"old_logprobs {SHAPE} logprobs",
    ),
    "gspo-bwd-mask": (
        "policy_loss_gspo_backward",
        lambda: _sequence_policy_backward(mask=torch.ones(B, T, dtype=torch.uint8)),
        BOOL_MASK,
    ),
    # policy_loss_geo_mean
    "geo-mean-old-shape": (
        "policy_loss_geo_mean",
        lambda: _sequence_policy(old_logprobs=torch.randn(B, T - 1)),
        f"old_logprobs {SHAPE} logprobs",
    ),
    "geo-mean-mask-dtype": ("policy_loss_geo_mean", lambda: _sequence_policy(mask=torch.ones(B, T)), BOOL_MASK),
    "geo-mean-weights-shape": (
        "policy_loss_geo_mean",
        lambda: _sequence_policy(weights=torch.rand(1, T)),
        f"weights {SHAPE} logprobs",
    ),
    "geo-mean-1d": (
        "policy_loss_geo_mean",
        lambda: _sequence_policy(**{k: torch.randn(T) for k in POLICY_FLOATS}, mask=torch.ones(T, dtype=torch.bool)),
        "logprobs must be 2-D",
    ),
    "geo-mean-int-advantages": (
        "policy_loss_geo_mean",
        lambda: _sequence_policy(advantages=torch.ones(B, T, dtype=torch.long)),
        FLOAT,
    ),
    "geo-mean-agg": ("policy_loss_geo_mean", lambda: _sequence_policy(agg="tokens"), "agg must be one of"),
    # policy_loss_geo_mean_backward
    "geo-mean-bwd-grad-numel": (
        "policy_loss_geo_mean_backward",
        lambda: _sequence_policy_backward(grad_loss=torch.ones(2)),
        "grad_loss must have one element",
    ),
    "geo-mean-bwd-row-scale": (
        "policy_loss_geo_mean_backward",
        lambda: _sequence_policy_backward(row_scale=torch.ones(B + 1)),
        "row_scale must have shape [3]",
    ),
    "geo-mean-bwd-row-state": (
        "policy_loss_geo_mean_backward",
        lambda: _sequence_policy_backward(row_state=torch.zeros(B + 1, 2)),
        "row_state must have shape [3, 2]",
    ),
    "geo-mean-bwd-old-shape": (
        "policy_loss_geo_mean_backward",
        lambda: _sequence_policy_backward(old_logprobs=torch.randn(T, B)),
        f"old_logprobs {SHAPE} logprobs",
    ),
    "geo-mean-bwd-mask": (
        "policy_loss_geo_mean_backward",
        lambda: _sequence_policy_backward(mask=torch.ones(B, T, dtype=torch.uint8)),
        BOOL_MASK,
    ),
    # value_loss
    "value-old-shape": ("value_loss", lambda: _value(old_values=torch.randn(B, T + 1)), f"old_values {SHAPE} values"),
    "value-returns-shape": ("value_loss", lambda: _value(returns=torch.randn(1, 1)), f"returns {SHAPE} values"),
    "value-mask-shape": (
        "value_loss",
        lambda: _value(mask=torch.ones(B - 1, T, dtype=torch.bool)),
        f"mask {SHAPE} values",
    ),
    "value-mask-dtype": ("value_loss", lambda: _value(mask=torch.ones(B, T, dtype=torch.int64)), BOOL_MASK),
    "value-1d": (
        "value_loss",
        lambda: _value(
            values=torch.randn(T),
            old_values=torch.randn(T),
            returns=torch.randn(T),
            mask=torch.ones(T, dtype=torch.bool),
        ),
        "values must be 2-D",
    ),
    "value-int-returns": ("value_loss", lambda: _value(returns=torch.ones(B, T, dtype=torch.int64)), FLOAT),
    "value-agg": ("value_loss", lambda: _value(agg=""), "agg must be one of"),
    # value_loss_backward
    "value-bwd-grad-numel": (
        "value_loss_backward",
        lambda: _value_backward(grad_loss=torch.ones(B, T)),
        "grad_loss must have one element",
    ),
    "value-bwd-row-scale": (
        "value_loss_backward",
        lambda: _value_backward(row_scale=torch.ones(B + 5)),
        "row_scale must have shape",
    ),
    "value-bwd-returns": (
        "value_loss_backward",
        lambda: _value_backward(returns=torch.randn(B)),
        f"returns {SHAPE} values",
    ),
    "value-bwd-mask": (
        "value_loss_backward",
        lambda: _value_backward(mask=torch.ones(B, 1, dtype=torch.bool)),
        f"mask {SHAPE} values",
    ),
    # kl_estimate
    "kl-ref-shape": ("kl_estimate", lambda: _kl(ref_logprobs=torch.randn(B, T - 1)), f"ref_logprobs {SHAPE} logprobs"),
    "kl-ref-same-numel": (
        "kl_estimate",
        lambda: _kl(ref_logprobs=torch.randn(B * T)),
        f"ref_logprobs {SHAPE} logprobs",
    ),
    "kl-int": ("kl_estimate", lambda: _kl(logprobs=torch.zeros(B, T, dtype=torch.int64)), FLOAT),
    "kl-bool-ref": ("kl_estimate", lambda: _kl(ref_logprobs=torch.zeros(B, T, dtype=torch.bool)), FLOAT),
    "kl-estimator": ("kl_estimate", lambda: _kl(kl_estimator="k4"), "estimator must be one of"),
    # kl_estimate_backward
    "kl-bwd-grad-shape": (
        "kl_estimate_backward",
        lambda: _kl_backward(grad_kl=torch.randn(B, T + 1)),
        f"grad_kl {SHAPE} logprobs",
    ),
    "kl-bwd-ref-shape": (
        "kl_estimate_backward",
        lambda: _kl_backward(ref_logprobs=torch.randn(1)),
        f"ref_logprobs {SHAPE} logprobs",
    ),
    "kl-bwd-grad-int": (
        "kl_estimate_backward",
        lambda: _kl_backward(grad_kl=torch.ones(B, T, dtype=torch.int32)),
        FLOAT,
    ),
    "kl-bwd-estimator": ("kl_estimate_backward", lambda: _kl_backward(kl_estimator="KL"), "estimator must be one of"),
    # kl_penalized_rewards
    "rewards-scores-long": (
        "kl_penalized_rewards",
        lambda: _rewards(scores=torch.randn(B + 1)),
        "scores must have shape",
    ),
    "rewards-scores-short": ("kl_penalized_rewards", lambda: _rewards(scores=torch.randn(1)), "scores must have shape"),
    "rewards-scores-2d": ("kl_penalized_rewards", lambda: _rewards(scores=torch.randn(B, 1)), "scores must have shape"),
    "rewards-scores-int": ("kl_penalized_rewards", lambda: _rewards(scores=torch.ones(B, dtype=torch.int64)), FLOAT),
    "rewards-ref-shape": (
        "kl_penalized_rewards",
        lambda: _rewards(ref_logprobs=torch.randn(B, 1)),
        f"ref_logprobs {SHAPE} logprobs",
    ),
    "rewards-mask-shape": (
        "kl_penalized_rewards",
        lambda: _rewards(mask=torch.ones(B, T + 7, dtype=torch.bool)),
        f"mask {SHAPE} logprobs",
    ),
    "rewards-mask-dtype": ("kl_penalized_rewards", lambda: _rewards(mask=torch.ones(B, T)), BOOL_MASK),
    "rewards-1d": (
        "kl_penalized_rewards",
        lambda: _rewards(logprobs=torch.randn(T), ref_logprobs=torch.randn(T), mask=torch.ones(T, dtype=torch.bool)),
        "logprobs must be 2-D",
    ),
    "rewards-estimator": ("kl_penalized_rewards", lambda: _rewards(kl_estimator="k 1"), "estimator must be one of"),
    # kl_penalized_rewards_backward
    "rewards-bwd-grad-rewards": (
        "kl_penalized_rewards_backward",
        lambda: _rewards_backward(grad_rewards=torch.randn(B, T - 1)),
        f"grad_rewards {SHAPE} logprobs",
    ),
    "rewards-bwd-grad-kl": (
        "kl_penalized_rewards_backward",
        lambda: _rewards_backward(grad_kl=torch.randn(B + 1, T)),
        f"grad_kl {SHAPE} logprobs",
    ),
    "rewards-bwd-mask": (
        "kl_penalized_rewards_backward",
        lambda: _rewards_backward(mask=torch.ones(1, T, dtype=torch.bool)),
        f"mask {SHAPE} logprobs",
    ),
    "rewards-bwd-ref": (
        "kl_penalized_rewards_backward",
        lambda: _rewards_backward(ref_logprobs=torch.randn(T, B)),
        f"ref_logprobs {SHAPE} logprobs",
    ),
    "rewards-bwd-scores-dtype": (
        "kl_penalized_rewards_backward",
        lambda: _rewards_backward(scores_dtype=torch.int64),
        "scores_dtype must be a floating dtype",
    ),
    # gae
    # bool_mask (the public ops' host check of 0/1 masks)
    "bool-mask-bool": ("bool_mask", lambda: (torch.ones(B, T, dtype=torch.bool), "mask"), "mask is already bool"),
    "bool-mask-complex": (
        "bool_mask",
        lambda: (torch.ones(B, T, dtype=torch.complex64), "mask"),
        "mask must be a float or integer",
    ),
    "gae-values-shape": ("gae", lambda: _gae(values=torch.randn(B, T - 1)), f"values {SHAPE} rewards"),
    "gae-values-rows": ("gae", lambda: _gae(values=torch.randn(1, T)), f"values {SHAPE} rewards"),
    "gae-mask-shape": ("gae", lambda: _gae(mask=torch.ones(B, T + 100, dtype=torch.bool)), f"mask {SHAPE} rewards"),
    "gae-mask-dtype": ("gae", lambda: _gae(mask=torch.ones(B, T, dtype=torch.float64)), BOOL_MASK),
    "gae-1d": (
        "gae",
        lambda: _gae(rewards=torch.randn(T), values=torch.randn(T), mask=torch.ones(T, dtype=torch.bool)),
        "rewards must be 2-D",
    ),
    "gae-int-values": ("gae", lambda: _gae(values=torch.ones(B, T, dtype=torch.int64)), FLOAT),
    # gae_backward
    "gae-bwd-grad-adv": (
        "gae_backward",
        lambda: _gae_backward(grad_advantages=torch.randn(B, T + 1)),
        f"grad_advantages {SHAPE} mask",
    ),
    "gae-bwd-grad-ret": (
        "gae_backward",
        lambda: _gae_backward(grad_returns=torch.randn(B * T)),
        f"grad_returns {SHAPE} mask",
    ),
    "gae-bwd-mask-1d": (
        "gae_backward",
        lambda: _gae_backward(mask=torch.ones(T, dtype=torch.bool), grad_advantages=None, grad_returns=None),
        "mask must be 2-D",
    ),
    "gae-bwd-mask-dtype": ("gae_backward", lambda: _gae_backward(mask=torch.ones(B, T)), BOOL_MASK),
    "gae-bwd-dtype": (
        "gae_backward",
        lambda: _gae_backward(values_dtype=torch.int32),
        "values_dtype must be a floating dtype",
    ),
    # token_logprobs
    "logprobs-labels-long": (
        "token_logprobs",
        lambda: _logprobs(labels=torch.zeros(N + 1, dtype=torch.long)),
        f"labels {SHAPE} logits.shape[:-1]",
    ),
    "logprobs-labels-2d": (
        "token_logprobs",
        lambda: _logprobs(labels=torch.zeros(N, 1, dtype=torch.long)),
        f"labels {SHAPE} logits.shape[:-1]",
    ),
    "logprobs-labels-float": (
        "token_logprobs",
        lambda: _logprobs(labels=torch.zeros(N)),
        "labels must be an integer tensor",
    ),
    "logprobs-labels-bool": (
        "token_logprobs",
        lambda: _logprobs(labels=torch.zeros(N, dtype=torch.bool)),
        "labels must be an integer tensor",
    ),
    "logprobs-logits-1d": (
        "token_logprobs",
        lambda: _logprobs(logits=torch.randn(V), labels=torch.zeros((), dtype=torch.long)),
        "logits must be [N, V] or [B, T, V]",
    ),
    "logprobs-logits-4d": (
        "token_logprobs",
        lambda: _logprobs(logits=torch.randn(1, 1, N, V), labels=torch.zeros(1, 1, N, dtype=torch.long)),
        "logits must be [N, V] or [B, T, V]",
    ),
    "logprobs-logits-int": ("token_logprobs", lambda: _logprobs(logits=torch.zeros(N, V, dtype=torch.int64)), FLOAT),
    "logprobs-temperature": (
        "token_logprobs",
        lambda: _logprobs(temperature=0.0),
        "temperature must be finite and > 0",
    ),
    # token_logprobs_backward
    "logprobs-bwd-stats-shape": (
        "token_logprobs_backward",
        lambda: _logprobs_backward(stats=torch.randn(N - 1)),
        f"stats {SHAPE} labels",
    ),
    "logprobs-bwd-stats-dtype": (
        "token_logprobs_backward",
        lambda: _logprobs_backward(stats=torch.randn(N, dtype=torch.float16)),
        "stats must have dtype",
    ),
    "logprobs-bwd-entropy-shape": (
        "token_logprobs_backward",
        lambda: _logprobs_backward(entropy=torch.randn(0)),
        f"entropy {SHAPE} labels",
    ),
    "logprobs-bwd-grad-shape": (
        "token_logprobs_backward",
        lambda: _logprobs_backward(grad_logprobs=torch.randn(N, 2)),
        f"grad_logprobs {SHAPE} labels",
    ),
    "logprobs-bwd-grad-entropy-shape": (
        "token_logprobs_backward",
        lambda: _logprobs_backward(grad_entropy=torch.randn(2 * N)),
        f"grad_entropy {SHAPE} labels",
    ),
    "logprobs-bwd-labels": (
        "token_logprobs_backward",
        lambda: _logprobs_backward(labels=torch.zeros(N + 2, dtype=torch.long)),
        f"labels {SHAPE} logits.shape[:-1]",
    ),
    "logprobs-bwd-logits-3d": (
        "token_logprobs_backward",
        lambda: _logprobs_backward(logits=torch.randn(2, N, V)),
        f"labels {SHAPE} logits.shape[:-1]",
    ),
    # linear_token_logprobs (the fused LM head)
    "head-hidden-3d": ("linear_token_logprobs", lambda: _head(hidden=torch.randn(1, N, H)), "hidden must be 2-D"),
    "head-hidden-int": ("linear_token_logprobs", lambda: _head(hidden=torch.zeros(N, H, dtype=torch.int64)), FLOAT),
    "head-weight-1d": ("linear_token_logprobs", lambda: _head(weight=torch.randn(V)), "weight must be 2-D"),
    "head-weight-width": (
        "linear_token_logprobs",
        lambda: _head(weight=torch.randn(V, H + 1)),
        "weight must be [V, H] with H = hidden.size(1)",
    ),
    "head-weight-empty": (
        "linear_token_logprobs",
        lambda: _head(weight=torch.randn(0, H), bias=None),
        "weight must have a non-empty vocabulary dim",
    ),
    "head-weight-dtype": (
        "linear_token_logprobs",
        lambda: _head(weight=torch.randn(V, H, dtype=torch.float64)),
        "weight must have hidden's dtype",
    ),
    "head-labels-float": (
        "linear_token_logprobs",
        lambda: _head(labels=torch.zeros(N)),
        "labels must be an integer tensor",
    ),
    "head-labels-shape": (
        "linear_token_logprobs",
        lambda: _head(labels=torch.zeros(N + 1, dtype=torch.long)),
        "labels must have shape",
    ),
    "head-bias-shape": ("linear_token_logprobs", lambda: _head(bias=torch.randn(V + 1)), "bias must have shape"),
    "head-bias-dtype": (
        "linear_token_logprobs",
        lambda: _head(bias=torch.randn(V, dtype=torch.float16)),
        "bias must have hidden's dtype",
    ),
    "head-temperature": ("linear_token_logprobs", lambda: _head(temperature=0.0), "temperature must be finite and > 0"),
    "head-logit-scale": (
        "linear_token_logprobs",
        lambda: _head(logit_scale=float("inf")),
        "logit_scale must be finite and > 0",
    ),
    "head-softcap": ("linear_token_logprobs", lambda: _head(logit_softcap=-1.0), "logit_softcap"),
    # linear_token_logprobs_backward
    "head-bwd-stats-shape": (
        "linear_token_logprobs_backward",
        lambda: _head_backward(stats=torch.randn(N - 1)),
        f"stats {SHAPE} labels",
    ),
    "head-bwd-stats-dtype": (
        "linear_token_logprobs_backward",
        lambda: _head_backward(stats=torch.randn(N, dtype=torch.float16)),
        "stats must have dtype",
    ),
    "head-bwd-entropy-shape": (
        "linear_token_logprobs_backward",
        lambda: _head_backward(entropy=torch.randn(0)),
        f"entropy {SHAPE} labels",
    ),
    "head-bwd-grad-shape": (
        "linear_token_logprobs_backward",
        lambda: _head_backward(grad_logprobs=torch.randn(N, 2)),
        f"grad_logprobs {SHAPE} labels",
    ),
    "head-bwd-grad-int": (
        "linear_token_logprobs_backward",
        lambda: _head_backward(grad_entropy=torch.zeros(N, dtype=torch.int64)),
        FLOAT,
    ),
    "head-bwd-weight-width": (
        "linear_token_logprobs_backward",
        lambda: _head_backward(weight=torch.randn(V, H - 1)),
        "weight must be [V, H]",
    ),
}


VALUE_CHECKS = {"group-sum-index-range", "group-sum-index-negative"}

_RUNNER = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
import torch
import ppo_fast.backends.native  # registers the fake kernels and autograd
import test_native_bad_inputs as cases
ids = list(cases.CASES)[int(sys.argv[2]):]
for case_id in ids:
    print(json.dumps({"id": case_id, "started": True}), flush=True)
    op, make_args, _ = cases.CASES[case_id]
    try:
        getattr(torch.ops.ppo_fast, op)(*make_args())
        result = {"id": case_id, "raised": None, "message": ""}
    except Exception as err:
        result = {"id": case_id, "raised": type(err).__name__, "message": str(err)}
    print(json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def isolated_results():
    """Each case's outcome from a separate interpreter: {id: {"raised", "message"}} or
    {"crashed": returncode} for the case that killed it (the run then resumes after it)."""
    tests_dir = str(Path(__file__).resolve().parent)
    repo_root = Path(__file__).resolve().parents[1]
    ids = list(CASES)
    results, start = {}, 0
    while start < len(ids):
        run = subprocess.run(
            [sys.executable, "-c", _RUNNER, tests_dir, str(start)],
            capture_output=True,
            text=True,
            cwd=repo_root,
            timeout=600,
        )
        last_started = None
        for line in run.stdout.splitlines():
            record = json.loads(line)
            if record.get("started"):
                last_started = record["id"]
            else:
                results[record["id"]] = record
        if run.returncode == 0:
            break
        assert last_started is not None, f"the case runner failed before any case:\n{run.stderr[-3000:]}"
        results[last_started] = {"crashed": run.returncode, "stderr": run.stderr[-2000:]}
        start = ids.index(last_started) + 1
    return results


@pytest.mark.parametrize("case_id", list(CASES))
def test_bad_arguments_raise_runtime_error(case_id, isolated_results):
    op, make_args, message = CASES[case_id]
    outcome = isolated_results[case_id]
    assert "crashed" not in outcome, (
        f"{op} crashed the interpreter (exit code {outcome['crashed']}): {outcome['stderr']}"
    )
    assert outcome["raised"] == "RuntimeError", f"{op}: expected RuntimeError, got {outcome}"
    assert outcome["message"].startswith(f"{op}: ") and message in outcome["message"], outcome
    # It raised without crashing there: run it here too.
    with pytest.raises(RuntimeError, match=_escape(message)):
        getattr(torch.ops.ppo_fast, op)(*make_args())


def _escape(text):
    import re

    return re.escape(text)


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("case_id", list(CASES))
def test_fake_kernels_check_the_same(case_id):
    # Meta tensors run the fake kernels: the message is the C++ kernel's.
    op, make_args, message = CASES[case_id]
    if case_id in VALUE_CHECKS:
        pytest.skip("a check of values: meta tensors have none")
    args = tuple(_to_meta(a) for a in make_args())
    with pytest.raises(RuntimeError, match=f"^{_escape(op)}: .*{_escape(message)}"):
        getattr(torch.ops.ppo_fast, op)(*args)


_GOOD = {
    "bool_mask": lambda: (torch.tensor([[0.0, 1.0], [1.0, -0.0]]), "mask"),
    "clipped_policy_loss": _policy,
    "clipped_policy_loss_backward": _policy_backward,
    "value_loss": _value,
    "value_loss_backward": _value_backward,
    "kl_estimate": _kl,
    "kl_estimate_backward": _kl_backward,
    "kl_penalized_rewards": _rewards,
    "kl_penalized_rewards_backward": _rewards_backward,
    "gae": _gae,
    "gae_backward": _gae_backward,
    "token_logprobs": _logprobs,
    "token_logprobs_backward": _logprobs_backward,
    "linear_token_logprobs": _head,
    "linear_token_logprobs_backward": _head_backward,
    "group_sum": _group_sum,
    "policy_loss_gspo": _sequence_policy,
    "policy_loss_gspo_backward": _sequence_policy_backward,
    "policy_loss_geo_mean": _sequence_policy,
    "policy_loss_geo_mean_backward": _sequence_policy_backward,
}


@pytest.mark.parametrize("op", list(_GOOD))
def test_the_unchanged_arguments_are_accepted(op):
    # Each case changes one thing in arguments that the op accepts, on CPU and meta tensors.
    getattr(torch.ops.ppo_fast, op)(*_GOOD[op]())
    getattr(torch.ops.ppo_fast, op)(*(_to_meta(a) for a in _GOOD[op]()))


def test_every_op_has_bad_input_cases():
    from ppo_fast.backends.native import OPERATORS

    assert {op for op, _, _ in CASES.values()} == set(OPERATORS) == set(_GOOD)


def test_bad_shapes_raise_under_torch_compile():
    # The fake kernel's checks fail the trace (no Python validation runs on raw ops).
    compiled = torch.compile(
        lambda r, v, m: torch.ops.ppo_fast.gae(r, v, m, 1.0, 0.95), backend="aot_eager", fullgraph=True
    )
    with pytest.raises(Exception, match="values must have the shape of rewards"):
        compiled(torch.randn(B, T), torch.randn(B, T - 1), torch.ones(B, T, dtype=torch.bool))


@pytest.mark.parametrize(
    "op", [op for op, make in _GOOD.items() if sum(isinstance(a, torch.Tensor) for a in make()) > 1]
)
def test_mixed_devices_raise(op):
    # One tensor argument on another device (meta: no GPU needed) must be refused by name.
    args = list(_GOOD[op]())
    tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i in tensor_positions:
        mixed = list(args)
        mixed[i] = mixed[i].to("meta")
        with pytest.raises(RuntimeError, match=f"^{_escape(op)}: .*all inputs must be on one device"):
            getattr(torch.ops.ppo_fast, op)(*mixed)
