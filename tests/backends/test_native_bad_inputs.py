"""Every torch.ops.ppo_fast operator, forward and backward, called directly with bad arguments
(mismatched shapes, wrong ranks, dtypes, unknown names): each must raise RuntimeError with a
message naming the op and the argument, never crash.

``good_args(op)`` makes arguments that the op accepts (by the names in its schema); each row
of ``TABLE`` changes some of them.
The C++ kernels are run first in a separate interpreter (one for all cases, restarted after a
case that kills it), so that a regression that segfaults shows up as a failure of that case
instead of killing pytest; a case that raised there is then run again in-process.  The same
cases on meta tensors check the fake kernels' checks (what torch.compile sees)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_native_common import NATIVE, requires_native

pytestmark = requires_native

B, T, N, V, H = 3, 5, 4, 11, 6  # H: the fused head's hidden size
BOOL = torch.bool


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def ones(*shape, dtype=BOOL):
    return torch.ones(*shape, dtype=dtype)


def _floats(names, *shape):
    return {name: randn(*shape) for name in names}


# A value every operator accepts for the argument of that name in its schema (a callable: made
# where it is used); an operator's own in OWN.  output_mask: True for each of the op's results.
BT = ("logprobs", "old_logprobs", "advantages", "values", "old_values", "returns", "ref_logprobs", "rewards")
PER_TOKEN = ("grad_logprobs", "grad_entropy", "entropy")
ARGUMENTS = {
    **dict.fromkeys(BT + ("grad_kl", "grad_rewards", "grad_advantages", "grad_returns"), lambda: randn(B, T)),
    **dict.fromkeys(PER_TOKEN, lambda: randn(N)),
    "stats": lambda: randn(N, 2),  # a log-prob row's (max, log_sum)
    "weights": lambda: torch.rand(B, T),
    "mask": lambda: ones(B, T),
    "grad_loss": lambda: torch.tensor(1.0),
    "row_scale": lambda: torch.ones(B),
    "row_state": lambda: torch.zeros(B, 2),
    "scores": lambda: randn(B),
    "group_index": lambda: torch.tensor([0, 2, 0]),
    "logits": lambda: randn(N, V),
    "labels": lambda: torch.randint(0, V, (N,)),
    "hidden": lambda: randn(N, H),
    "weight": lambda: randn(V, H),
    "bias": lambda: randn(V),
    **dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0, agg="token-mean", clip=0.2, kl_estimator="k3"),
    **dict(kl_coef=0.1, gamma=1.0, lam=0.95, temperature=1.0, logit_scale=1.0, logit_softcap=30.0),
    **dict(return_entropy=True, ignore_index=-100, name="mask"),
    **dict(top_k=0, top_p=1.0, min_p=0.0),  # the sampler's truncations: off
    **dict.fromkeys(("rewards_dtype", "values_dtype", "scores_dtype"), torch.float32),
}
# The packed layout's ops (``*_varlen``): NP tokens in S segments, one of them empty.
NP, CU = 7, (0, 2, 2, 7)
S = len(CU) - 1
PACKED = {
    **dict.fromkeys(BT + ("grad_advantages", "grad_returns"), lambda: randn(NP)),
    "weights": lambda: torch.rand(NP),
    "mask": lambda: ones(NP),
    "cu_seqlens": lambda: torch.tensor(CU),
    "row_scale": lambda: torch.ones(S),
    "row_state": lambda: torch.zeros(S, 2),
}
VARLEN_OPS = [
    f"{op}_varlen{bwd}"
    for op in ("gae", "policy_loss_gspo", "policy_loss_geo_mean", "value_loss")
    for bwd in ("", "_backward")
]
OWN = {
    **dict.fromkeys(VARLEN_OPS, PACKED),
    "bool_mask": {"mask": lambda: torch.tensor([[0.0, 1.0], [1.0, -0.0]])},
    # The policy loss through the head: hidden [B, T, H] and labels [B, T], vanilla's two clips.
    "linear_policy_loss": {
        "hidden": lambda: randn(B, T, H),
        "labels": lambda: torch.randint(0, V, (B, T)),
        "loss_mode": "vanilla",
        "params": [0.2, 0.28],
        "entropy_coef": 0.01,
        "output_mask": [True, True, True],  # d hidden, d weight, d bias
        "cu_seqlens": lambda: None,  # the padded layout
    },
}


def good_args(op):
    """The arguments of ``op`` by name, in its schema's order: ones it accepts."""
    schema = getattr(torch.ops.ppo_fast, op).default._schema
    made = {}
    for a in schema.arguments:
        value = OWN.get(op, {}).get(a.name)
        value = [True] * len(schema.returns) if value is None and a.name == "output_mask" else value
        value = ARGUMENTS[a.name] if value is None else value
        made[a.name] = value() if callable(value) else value
    return made


SHAPE = "must have the shape of"
FLOAT = "must be float32, float64, float16 or bfloat16"
BOOL_MASK = "mask must be a bool tensor"
I32, I64, F16, F32, F64 = torch.int32, torch.int64, torch.float16, torch.float32, torch.float64
POLICY_FLOATS = ("logprobs", "old_logprobs", "advantages", "weights")
POLICY_1D = {**_floats(POLICY_FLOATS, T), "mask": ones(T)}
LABELS_SHAPE = f"labels {SHAPE} logits.shape[:-1]"
LOGITS_RANK, HEAD_DTYPE = "logits must be [N, V] or [B, T, V]", "weight must have hidden's dtype"


def _sequence_policy(p):
    """The cases of policy_loss_gspo and policy_loss_geo_mean, their ids prefixed ``p``."""
    return [
        (f"{p}-old-shape", dict(old_logprobs=randn(B, T - 1)), f"old_logprobs {SHAPE} logprobs"),
        (f"{p}-mask-dtype", dict(mask=ones(B, T, dtype=F32)), BOOL_MASK),
        (f"{p}-weights-shape", dict(weights=torch.rand(1, T)), f"weights {SHAPE} logprobs"),
        (f"{p}-1d", POLICY_1D, "logprobs must be 2-D"),
        (f"{p}-int-advantages", dict(advantages=ones(B, T, dtype=I64)), FLOAT),
        (f"{p}-agg", dict(agg="tokens"), "agg must be one of"),
    ]


def _sequence_policy_backward(p):
    return [
        (f"{p}-bwd-grad-numel", dict(grad_loss=randn(2)), "grad_loss must have one element"),
        (f"{p}-bwd-row-scale", dict(row_scale=randn(B + 1)), "row_scale must have shape [3]"),
        (f"{p}-bwd-row-state", dict(row_state=randn(B + 1, 2)), "row_state must have shape [3, 2]"),
        (f"{p}-bwd-old-shape", dict(old_logprobs=randn(T, B)), f"old_logprobs {SHAPE} logprobs"),
        (f"{p}-bwd-mask", dict(mask=ones(B, T, dtype=torch.uint8)), BOOL_MASK),
    ]


def _varlen(op):
    """A packed op's cases: cu_seqlens that would read past the tensors, or is no offsets table."""
    return [
        (f"{op}-cu-start", dict(cu_seqlens=torch.tensor([1, 2, 2, NP])), "cu_seqlens must start at 0"),
        (f"{op}-cu-order", dict(cu_seqlens=torch.tensor([0, 5, 2, NP])), "cu_seqlens must be non-decreasing"),
        (f"{op}-cu-end", dict(cu_seqlens=torch.tensor([0, 2, NP + 3])), "cu_seqlens must end at the number of packed"),
        (f"{op}-cu-dtype", dict(cu_seqlens=torch.tensor([0.0, 2.0, NP])), "cu_seqlens must have dtype int32 or int64"),
        (f"{op}-cu-2d", dict(cu_seqlens=torch.tensor([[0, NP]])), "cu_seqlens must be 1-D"),
    ]


# op -> [(case id, the arguments that change, the message the RuntimeError must contain)].
# The replacements are made at import, in each interpreter that runs the cases.
TABLE = {
    "clipped_policy_loss": [
        ("policy-old-shape", dict(old_logprobs=randn(B, T - 1)), f"old_logprobs {SHAPE} logprobs"),
        ("policy-adv-rows", dict(advantages=randn(B + 1, T)), f"advantages {SHAPE} logprobs"),
        ("policy-adv-flat", dict(advantages=randn(B * T)), f"advantages {SHAPE} logprobs"),
        ("policy-mask-shape", dict(mask=ones(B, 2 * T)), f"mask {SHAPE} logprobs"),
        ("policy-mask-dtype", dict(mask=ones(B, T, dtype=F32)), BOOL_MASK),
        ("policy-weights-shape", dict(weights=torch.rand(1, T)), f"weights {SHAPE} logprobs"),
        ("policy-weights-dtype", dict(weights=ones(B, T, dtype=I64)), FLOAT),
        ("policy-1d", POLICY_1D, "logprobs must be 2-D"),
        ("policy-3d", {**_floats(POLICY_FLOATS, B, T, 2), "mask": ones(B, T, 2)}, "logprobs must be 2-D"),
        ("policy-int-logprobs", dict(logprobs=torch.zeros(B, T, dtype=I32)), FLOAT),
        ("policy-agg", dict(agg="tokens-mean"), "agg must be one of"),
    ],
    "clipped_policy_loss_backward": [
        ("policy-bwd-grad-numel", dict(grad_loss=randn(2)), "grad_loss must have one element"),
        ("policy-bwd-grad-empty", dict(grad_loss=randn(0)), "grad_loss must have one element"),
        ("policy-bwd-grad-int", dict(grad_loss=torch.tensor(1)), FLOAT),
        ("policy-bwd-row-scale", dict(row_scale=randn(B - 1)), "row_scale must have shape"),
        ("policy-bwd-row-scale-2d", dict(row_scale=randn(B, 1)), "row_scale must have shape"),
        ("policy-bwd-old-shape", dict(old_logprobs=randn(T, B)), f"old_logprobs {SHAPE} logprobs"),
        ("policy-bwd-weights", dict(weights=randn(B, T + 3)), f"weights {SHAPE} logprobs"),
        ("policy-bwd-mask", dict(mask=ones(B, T, dtype=torch.uint8)), BOOL_MASK),
    ],
    "group_sum": [
        ("group-sum-index-rows", dict(group_index=torch.tensor([0, 1])), "group_index must have shape [3]"),
        ("group-sum-index-2d", dict(group_index=torch.tensor([[0, 1, 0]])), "group_index must have shape [3]"),
        ("group-sum-index-int32", dict(group_index=torch.tensor([0, 1, 0], dtype=I32)), "group_index must be int64"),
        ("group-sum-index-float", dict(group_index=torch.tensor([0.0, 1.0, 0.0])), "group_index must be int64"),
        ("group-sum-values-1d", dict(values=randn(B)), "values must be 2-D"),
        ("group-sum-values-3d", dict(values=randn(B, T, 2)), "values must be 2-D"),
        ("group-sum-values-half", dict(values=randn(B, T, dtype=F16)), "values must be float32 or float64"),
        # Value checks (VALUE_CHECKS): the C++ kernel's only (the fake kernel sees no values).
        ("group-sum-index-range", dict(group_index=torch.tensor([0, 3, 0])), "group_index must lie in [0, 3)"),
        ("group-sum-index-negative", dict(group_index=torch.tensor([0, -1, 0])), "group_index must lie in [0, 3)"),
    ],
    "policy_loss_gspo": _sequence_policy("gspo"),
    "policy_loss_gspo_backward": _sequence_policy_backward("gspo"),
    "policy_loss_geo_mean": _sequence_policy("geo-mean"),
    "policy_loss_geo_mean_backward": _sequence_policy_backward("geo-mean"),
    "value_loss": [
        ("value-old-shape", dict(old_values=randn(B, T + 1)), f"old_values {SHAPE} values"),
        ("value-returns-shape", dict(returns=randn(1, 1)), f"returns {SHAPE} values"),
        ("value-mask-shape", dict(mask=ones(B - 1, T)), f"mask {SHAPE} values"),
        ("value-mask-dtype", dict(mask=ones(B, T, dtype=I64)), BOOL_MASK),
        ("value-1d", {**_floats(("values", "old_values", "returns"), T), "mask": ones(T)}, "values must be 2-D"),
        ("value-int-returns", dict(returns=ones(B, T, dtype=I64)), FLOAT),
        ("value-agg", dict(agg=""), "agg must be one of"),
    ],
    "value_loss_backward": [
        ("value-bwd-grad-numel", dict(grad_loss=randn(B, T)), "grad_loss must have one element"),
        ("value-bwd-row-scale", dict(row_scale=randn(B + 5)), "row_scale must have shape"),
        ("value-bwd-returns", dict(returns=randn(B)), f"returns {SHAPE} values"),
        ("value-bwd-mask", dict(mask=ones(B, 1)), f"mask {SHAPE} values"),
    ],
    "kl_estimate": [
        ("kl-ref-shape", dict(ref_logprobs=randn(B, T - 1)), f"ref_logprobs {SHAPE} logprobs"),
        ("kl-ref-same-numel", dict(ref_logprobs=randn(B * T)), f"ref_logprobs {SHAPE} logprobs"),
        ("kl-int", dict(logprobs=torch.zeros(B, T, dtype=I64)), FLOAT),
        ("kl-bool-ref", dict(ref_logprobs=torch.zeros(B, T, dtype=BOOL)), FLOAT),
        ("kl-estimator", dict(kl_estimator="k4"), "estimator must be one of"),
    ],
    "kl_estimate_backward": [
        ("kl-bwd-grad-shape", dict(grad_kl=randn(B, T + 1)), f"grad_kl {SHAPE} logprobs"),
        ("kl-bwd-ref-shape", dict(ref_logprobs=randn(1)), f"ref_logprobs {SHAPE} logprobs"),
        ("kl-bwd-grad-int", dict(grad_kl=ones(B, T, dtype=I32)), FLOAT),
        ("kl-bwd-estimator", dict(kl_estimator="KL"), "estimator must be one of"),
    ],
    "kl_penalized_rewards": [
        ("rewards-scores-long", dict(scores=randn(B + 1)), "scores must have shape"),
        ("rewards-scores-short", dict(scores=randn(1)), "scores must have shape"),
        ("rewards-scores-2d", dict(scores=randn(B, 1)), "scores must have shape"),
        ("rewards-scores-int", dict(scores=ones(B, dtype=I64)), FLOAT),
        ("rewards-ref-shape", dict(ref_logprobs=randn(B, 1)), f"ref_logprobs {SHAPE} logprobs"),
        ("rewards-mask-shape", dict(mask=ones(B, T + 7)), f"mask {SHAPE} logprobs"),
        ("rewards-mask-dtype", dict(mask=ones(B, T, dtype=F32)), BOOL_MASK),
        ("rewards-1d", {**_floats(("logprobs", "ref_logprobs"), T), "mask": ones(T)}, "logprobs must be 2-D"),
        ("rewards-estimator", dict(kl_estimator="k 1"), "estimator must be one of"),
    ],
    "kl_penalized_rewards_backward": [
        ("rewards-bwd-grad-rewards", dict(grad_rewards=randn(B, T - 1)), f"grad_rewards {SHAPE} logprobs"),
        ("rewards-bwd-grad-kl", dict(grad_kl=randn(B + 1, T)), f"grad_kl {SHAPE} logprobs"),
        ("rewards-bwd-mask", dict(mask=ones(1, T)), f"mask {SHAPE} logprobs"),
        ("rewards-bwd-ref", dict(ref_logprobs=randn(T, B)), f"ref_logprobs {SHAPE} logprobs"),
        ("rewards-bwd-scores-dtype", dict(scores_dtype=I64), "scores_dtype must be a floating dtype"),
    ],
    # bool_mask: the public ops' host check of 0/1 masks
    "bool_mask": [
        ("bool-mask-bool", dict(mask=ones(B, T)), "mask is already bool"),
        ("bool-mask-complex", dict(mask=ones(B, T, dtype=torch.complex64)), "mask must be a float or integer"),
    ],
    "gae": [
        ("gae-values-shape", dict(values=randn(B, T - 1)), f"values {SHAPE} rewards"),
        ("gae-values-rows", dict(values=randn(1, T)), f"values {SHAPE} rewards"),
        ("gae-mask-shape", dict(mask=ones(B, T + 100)), f"mask {SHAPE} rewards"),
        ("gae-mask-dtype", dict(mask=ones(B, T, dtype=F64)), BOOL_MASK),
        ("gae-1d", {**_floats(("rewards", "values"), T), "mask": ones(T)}, "rewards must be 2-D"),
        ("gae-int-values", dict(values=ones(B, T, dtype=I64)), FLOAT),
    ],
    "gae_backward": [
        ("gae-bwd-grad-adv", dict(grad_advantages=randn(B, T + 1)), f"grad_advantages {SHAPE} mask"),
        ("gae-bwd-grad-ret", dict(grad_returns=randn(B * T)), f"grad_returns {SHAPE} mask"),
        ("gae-bwd-mask-1d", dict(grad_advantages=None, grad_returns=None, mask=ones(T)), "mask must be 2-D"),
        ("gae-bwd-mask-dtype", dict(mask=ones(B, T, dtype=F32)), BOOL_MASK),
        ("gae-bwd-dtype", dict(values_dtype=I32), "values_dtype must be a floating dtype"),
    ],
    "token_logprobs": [
        ("logprobs-labels-long", dict(labels=torch.zeros(N + 1, dtype=I64)), LABELS_SHAPE),
        ("logprobs-labels-2d", dict(labels=torch.zeros(N, 1, dtype=I64)), LABELS_SHAPE),
        ("logprobs-labels-float", dict(labels=torch.zeros(N)), "labels must be an integer tensor"),
        ("logprobs-labels-bool", dict(labels=torch.zeros(N, dtype=BOOL)), "labels must be an integer tensor"),
        ("logprobs-logits-1d", dict(logits=randn(V), labels=torch.zeros((), dtype=I64)), LOGITS_RANK),
        ("logprobs-logits-4d", dict(logits=randn(1, 1, N, V), labels=torch.zeros(1, 1, N, dtype=I64)), LOGITS_RANK),
        ("logprobs-logits-int", dict(logits=torch.zeros(N, V, dtype=I64)), FLOAT),
        ("logprobs-temperature", dict(temperature=0.0), "temperature must be finite and > 0"),
        ("logprobs-top-k", dict(top_k=-2), "top_k must be >= 0"),
        ("logprobs-top-p-zero", dict(top_p=0.0), "top_p must lie in (0, 1]"),
        ("logprobs-top-p-nan", dict(top_p=float("nan")), "top_p must lie in (0, 1]"),
        ("logprobs-min-p", dict(min_p=1.5), "min_p must lie in [0, 1]"),
    ],
    "token_logprobs_backward": [
        ("logprobs-bwd-stats-shape", dict(stats=randn(N - 1, 2)), f"stats must have shape [{N}, 2]"),
        ("logprobs-bwd-stats-width", dict(stats=randn(N, 4)), f"stats must have shape [{N}, 2]"),
        ("logprobs-bwd-stats-kept-rows", dict(stats=randn(N + 1, 3)), f"stats must have shape [{N}, 3]"),
        ("logprobs-bwd-stats-dtype", dict(stats=randn(N, 2, dtype=F16)), "stats must have dtype"),
        ("logprobs-bwd-entropy-shape", dict(entropy=randn(0)), f"entropy {SHAPE} labels"),
        ("logprobs-bwd-grad-shape", dict(grad_logprobs=randn(N, 2)), f"grad_logprobs {SHAPE} labels"),
        ("logprobs-bwd-grad-entropy-shape", dict(grad_entropy=randn(2 * N)), f"grad_entropy {SHAPE} labels"),
        ("logprobs-bwd-labels", dict(labels=torch.zeros(N + 2, dtype=I64)), LABELS_SHAPE),
        ("logprobs-bwd-logits-3d", dict(logits=randn(2, N, V)), LABELS_SHAPE),
    ],
    # linear_token_logprobs: the fused LM head
    "linear_policy_loss": [
        ("linear-policy-hidden-2d", dict(hidden=randn(B, H)), "hidden must be 3-D"),
        ("linear-policy-hidden-int", dict(hidden=torch.zeros(B, T, H, dtype=I64)), FLOAT),
        ("linear-policy-weight-width", dict(weight=randn(V, H + 1)), "weight"),
        ("linear-policy-weight-dtype", dict(weight=randn(V, H, dtype=F64)), HEAD_DTYPE),
        ("linear-policy-labels-int32", dict(labels=torch.zeros(B, T, dtype=I32)), "labels must be int64"),
        ("linear-policy-labels-shape", dict(labels=torch.zeros(B, T + 1, dtype=I64)), "labels must have shape"),
        ("linear-policy-old-shape", dict(old_logprobs=randn(B, T - 1)), "old_logprobs"),
        ("linear-policy-mask-dtype", dict(mask=ones(B, T, dtype=F32)), BOOL_MASK),
        ("linear-policy-bias-shape", dict(bias=randn(V + 1)), "bias must have shape"),
        ("linear-policy-ref-shape", dict(ref_logprobs=randn(B, T + 1)), "ref_logprobs"),
        ("linear-policy-mode", dict(loss_mode="cispo"), "loss_mode must be 'vanilla' or 'gspo'"),
        ("linear-policy-params", dict(params=[0.2]), "loss_mode 'vanilla'"),
        ("linear-policy-temperature", dict(temperature=0.0), "temperature must be finite and > 0"),
        ("linear-policy-agg", dict(agg="tokens-mean"), "agg must be one of"),
        ("linear-policy-cu-dtype", dict(cu_seqlens=torch.tensor([0, T], dtype=I32)), "cu_seqlens must be a 1-D int64"),
        ("linear-policy-cu-rows", dict(cu_seqlens=torch.tensor([0, T])), "with cu_seqlens, hidden must be [1, N, H]"),
    ],
    "linear_token_logprobs": [
        ("head-hidden-3d", dict(hidden=randn(1, N, H)), "hidden must be 2-D"),
        ("head-hidden-int", dict(hidden=torch.zeros(N, H, dtype=I64)), FLOAT),
        ("head-weight-1d", dict(weight=randn(V)), "weight must be 2-D"),
        ("head-weight-width", dict(weight=randn(V, H + 1)), "weight must be [V, H] with H = hidden.size(1)"),
        ("head-weight-empty", dict(weight=randn(0, H), bias=None), "weight must have a non-empty vocabulary dim"),
        ("head-weight-dtype", dict(weight=randn(V, H, dtype=F64)), HEAD_DTYPE),
        ("head-labels-float", dict(labels=torch.zeros(N)), "labels must be an integer tensor"),
        ("head-labels-shape", dict(labels=torch.zeros(N + 1, dtype=I64)), "labels must have shape"),
        ("head-bias-shape", dict(bias=randn(V + 1)), "bias must have shape"),
        ("head-bias-dtype", dict(bias=randn(V, dtype=F16)), "bias must have hidden's dtype"),
        ("head-temperature", dict(temperature=0.0), "temperature must be finite and > 0"),
        ("head-logit-scale", dict(logit_scale=float("inf")), "logit_scale must be finite and > 0"),
        ("head-softcap", dict(logit_softcap=-1.0), "logit_softcap"),
        ("head-top-k", dict(top_k=-5), "top_k must be >= 0"),
        ("head-top-p", dict(top_p=1.01), "top_p must lie in (0, 1]"),
        ("head-min-p", dict(min_p=-0.5), "min_p must lie in [0, 1]"),
    ],
    "linear_token_logprobs_backward": [
        ("head-bwd-stats-shape", dict(stats=randn(N - 1, 2)), f"stats must have shape [{N}, 2]"),
        ("head-bwd-stats-kept-rows", dict(stats=randn(N - 1, 3)), f"stats must have shape [{N}, 3]"),
        ("head-bwd-stats-dtype", dict(stats=randn(N, 2, dtype=F16)), "stats must have dtype"),
        ("head-bwd-entropy-shape", dict(entropy=randn(0)), f"entropy {SHAPE} labels"),
        ("head-bwd-grad-shape", dict(grad_logprobs=randn(N, 2)), f"grad_logprobs {SHAPE} labels"),
        ("head-bwd-grad-int", dict(grad_entropy=torch.zeros(N, dtype=I64)), FLOAT),
        ("head-bwd-weight-width", dict(weight=randn(V, H - 1)), "weight must be [V, H]"),
    ],
}
TABLE |= {op: _varlen(op) for op in VARLEN_OPS}
CASES = {case_id: (op, changes, message) for op, rows in TABLE.items() for case_id, changes, message in rows}
assert len(CASES) == sum(map(len, TABLE.values())), "case ids are unique"
# Checks of values the fake kernel cannot see (meta tensors): the C++ kernel's only.
VALUE_CHECKS = {"group-sum-index-range", "group-sum-index-negative"} | {
    f"{op}-cu-{kind}" for op in VARLEN_OPS for kind in ("start", "order", "end")
}


def case_args(case_id):
    """The op's good arguments with the case's changes, positionally."""
    op, changes, _ = CASES[case_id]
    args = good_args(op)
    assert set(changes) <= set(args), (case_id, set(changes) - set(args))
    return tuple({**args, **changes}.values())


_RUNNER = """
import json, sys
sys.path[:0] = sys.argv[1:3]
import torch
import ppo_fast.backends.native  # registers the fake kernels and autograd
import test_native_bad_inputs as cases
for case_id in list(cases.CASES)[int(sys.argv[3]):]:
    print(json.dumps({"id": case_id, "started": True}), flush=True)
    try:
        getattr(torch.ops.ppo_fast, cases.CASES[case_id][0])(*cases.case_args(case_id))
        result = {"id": case_id, "raised": None, "message": ""}
    except Exception as err:
        result = {"id": case_id, "raised": type(err).__name__, "message": str(err)}
    print(json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def isolated_results():
    """Each case's outcome from a separate interpreter: {id: {"raised", "message"}} or
    {"crashed": returncode} for the case that killed it (the run then resumes after it)."""
    here = Path(__file__).resolve().parent
    ids = list(CASES)
    results, start = {}, 0
    while start < len(ids):
        run = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(here), str(here.parent), str(start)],
            capture_output=True,
            text=True,
            cwd=here.parents[1],
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
    op, _, message = CASES[case_id]
    outcome = isolated_results[case_id]
    assert "crashed" not in outcome, (
        f"{op} crashed the interpreter (exit code {outcome['crashed']}): {outcome['stderr']}"
    )
    assert outcome["raised"] == "RuntimeError", f"{op}: expected RuntimeError, got {outcome}"
    assert outcome["message"].startswith(f"{op}: ") and message in outcome["message"], outcome
    # It raised without crashing there: run it here too.
    with pytest.raises(RuntimeError, match=re.escape(message)):
        getattr(torch.ops.ppo_fast, op)(*case_args(case_id))


def _to_meta(args):
    return tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("case_id", list(CASES))
def test_fake_kernels_check_the_same(case_id):
    # Meta tensors run the fake kernels: the message is the C++ kernel's.
    op, _, message = CASES[case_id]
    if case_id in VALUE_CHECKS:
        pytest.skip("a check of values: meta tensors have none")
    with pytest.raises(RuntimeError, match=f"^{re.escape(op)}: .*{re.escape(message)}"):
        getattr(torch.ops.ppo_fast, op)(*_to_meta(case_args(case_id)))


def _has_cuda_kernel(op):
    # Registered only where the extension was built with CUDA (test_native_cpu_ops checks).
    return NATIVE.available and torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_fast::{op}", "CUDA")


def _cuda_kernel(op):
    """The op's CUDA kernel, called whatever the devices of its arguments."""
    return functools.partial(
        getattr(torch.ops.ppo_fast, op).default.redispatch, torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    )


@pytest.mark.parametrize("case_id", [c for c in CASES if _has_cuda_kernel(CASES[c][0]) and c not in VALUE_CHECKS])
def test_cuda_kernels_check_the_same(case_id):
    # The CUDA kernels check every argument on the host before they require CUDA tensors, so the
    # case's CPU tensors sent to the CUDA kernel meet its checks without a GPU; the unchanged
    # arguments are refused for their device, which shows the call reached the CUDA kernel.
    op, _, message = CASES[case_id]
    with pytest.raises(RuntimeError, match=f"^{re.escape(op)}: .*{re.escape(message)}"):
        _cuda_kernel(op)(*case_args(case_id))
    with pytest.raises(RuntimeError, match=f"^{re.escape(op)}: expects CUDA tensors, got one on cpu"):
        _cuda_kernel(op)(*good_args(op).values())


@pytest.mark.parametrize("op", list(TABLE))
def test_the_unchanged_arguments_are_accepted(op):
    # Each case changes some of the arguments that the op accepts, on CPU and meta tensors.
    getattr(torch.ops.ppo_fast, op)(*good_args(op).values())
    getattr(torch.ops.ppo_fast, op)(*_to_meta(good_args(op).values()))


def test_every_op_has_bad_input_cases():
    from ppo_fast.backends.native import OPERATORS

    assert set(TABLE) == {op for op, _, _ in CASES.values()} == set(OPERATORS)


@pytest.mark.parametrize(
    "op",
    [op for op in TABLE if NATIVE.available and sum(isinstance(a, torch.Tensor) for a in good_args(op).values()) > 1],
)
def test_mixed_devices_raise(op):
    # One tensor argument on another device (meta: no GPU needed) must be refused by name, by the
    # kernel the dispatcher picks and by the CUDA kernel where there is one (as above).
    calls = [getattr(torch.ops.ppo_fast, op)] + ([_cuda_kernel(op)] if _has_cuda_kernel(op) else [])
    args = list(good_args(op).values())
    for i in [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]:
        mixed = args[:i] + [args[i].to("meta")] + args[i + 1 :]
        for call in calls:
            with pytest.raises(RuntimeError, match=f"^{re.escape(op)}: .*all inputs must be on one device"):
                call(*mixed)
