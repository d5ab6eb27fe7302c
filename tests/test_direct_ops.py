"""The public ops' direct calls (``backends.direct_op``): in eager mode, with a bool mask, a public
loss calls the native operator without its own checks, and runs them only when the operator
refuses the arguments.  So every refused input must still raise the public op's own error (the
reference backend's, whose path always runs the checks), and an accepted call must give what the
checked path gives, bit for bit, in values and gradients."""

from __future__ import annotations

import importlib

import pytest
import torch

import ppo_fast as pf
from ppo_fast import backends

pytestmark = pytest.mark.skipif(
    "native" not in backends.serving("clipped_policy_loss", "cpu"), reason="the native backend is not built"
)

B, T = 3, 7


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {k: torch.randn(B, T, generator=g, dtype=torch.float64) for k in ("lp", "old", "adv")}
    x["mask"] = torch.rand(B, T, generator=g) > 0.3
    x["scores"] = torch.randn(B, generator=g, dtype=torch.float64)
    return x


# Each public call with a direct path: the call, the backend op whose native function has the
# direct operator, the inputs it differentiates, its keywords in the equality test.
CALLS = {
    "clipped_policy_loss": lambda x, **kw: pf.clipped_policy_loss(x["lp"], x["old"], x["adv"], x["mask"], **kw),
    "policy_loss vanilla": lambda x, **kw: pf.policy_loss(x["lp"], x["old"], x["adv"], x["mask"], **kw),
    "policy_loss gspo": lambda x, **kw: pf.policy_loss(x["lp"], x["old"], x["adv"], x["mask"], loss_mode="gspo", **kw),
    "policy_loss geo_mean": lambda x, **kw: pf.policy_loss(
        x["lp"], x["old"], x["adv"], x["mask"], loss_mode="geo_mean", **kw
    ),
    "value_loss": lambda x, **kw: pf.value_loss(x["lp"], x["old"], x["adv"], x["mask"], **kw),
    "gae": lambda x, **kw: pf.gae(x["lp"], x["old"], x["mask"], **kw),
    "kl_estimate": lambda x, **kw: pf.kl_estimate(x["lp"], x["old"], **kw),
    "kl_penalized_rewards": lambda x, **kw: pf.kl_penalized_rewards(
        x["scores"], x["lp"], x["old"], x["mask"], **{"kl_coef": 0.1, **kw}
    ),
}
OPS = {
    "clipped_policy_loss": "clipped_policy_loss",
    "policy_loss vanilla": "clipped_policy_loss",
    "policy_loss gspo": "policy_loss_gspo",
    "policy_loss geo_mean": "policy_loss_geo_mean",
    "value_loss": "value_loss",
    "gae": "gae",
    "kl_estimate": "kl_estimate",
    "kl_penalized_rewards": "kl_penalized_rewards",
}
LOSSES = ("clipped_policy_loss", "policy_loss vanilla", "policy_loss gspo", "policy_loss geo_mean")
GOOD = {
    **dict.fromkeys(LOSSES, {"clip_eps_low": 0.1, "clip_eps_high": 0.3, "agg": "seq-mean-token-mean"}),
    "value_loss": {"clip": 0.3},
    "gae": {"gamma": 0.9, "lam": 0.8},
    "kl_estimate": {"kl_estimator": "k3"},
    "kl_penalized_rewards": {"kl_coef": 0.2, "kl_estimator": "k2"},
}

# Inputs each check refuses: (name, change to the inputs, keywords).
TENSORS = [
    ("old is None", {"old": None}, {}),
    ("old's shape", {"old": torch.zeros(B, T + 1, dtype=torch.float64)}, {}),
    ("lp is int", {"lp": torch.zeros(B, T, dtype=torch.int64)}, {}),
    ("old on meta", {"old": torch.zeros(B, T, dtype=torch.float64, device="meta")}, {}),
]
ROWS = [
    ("lp is 1-D", {"lp": torch.zeros(B * T, dtype=torch.float64)}, {}),
    ("lp is 3-D", {"lp": torch.zeros(B, T, 1, dtype=torch.float64)}, {}),
    ("mask's shape", {"mask": torch.ones(B, T + 1, dtype=torch.bool)}, {}),
    ("mask holds 2", {"mask": torch.full((B, T), 2.0)}, {}),
    ("mask is a list", {"mask": [[True] * T] * B}, {}),
]
LOSS = [
    ("adv is int", {"adv": torch.zeros(B, T, dtype=torch.int64)}, {}),
    ("agg unknown", {}, {"agg": "nope"}),
    ("agg not a str", {}, {"agg": 3}),
]
BAD = {
    **dict.fromkeys(
        LOSSES,
        TENSORS
        + ROWS
        + LOSS
        + [
            ("clip_eps_low < 0", {}, {"clip_eps_low": -0.5}),
            ("clip_eps_low a str", {}, {"clip_eps_low": "0.2"}),
            ("weights' shape", {}, {"weights": torch.ones(B, 1, dtype=torch.float64)}),
            ("weights are int", {}, {"weights": torch.ones(B, T, dtype=torch.int64)}),
        ],
    ),
    "value_loss": TENSORS + ROWS + LOSS + [("clip <= 0", {}, {"clip": 0.0}), ("clip a bool", {}, {"clip": True})],
    "gae": TENSORS
    + ROWS
    + [("gamma > 1", {}, {"gamma": 1.5}), ("gamma a str", {}, {"gamma": "1"}), ("lam < 0", {}, {"lam": -0.1})],
    "kl_estimate": TENSORS
    + [("kl_estimator unknown", {}, {"kl_estimator": "k9"}), ("kl_estimator not a str", {}, {"kl_estimator": 3})],
    "kl_penalized_rewards": TENSORS
    + ROWS
    + [
        ("scores' shape", {"scores": torch.zeros(B + 1)}, {}),
        ("scores 2-D", {"scores": torch.zeros(B, 1)}, {}),
        ("scores int", {"scores": torch.zeros(B, dtype=torch.int64)}, {}),
        ("kl_coef < 0", {}, {"kl_coef": -1.0}),
        ("kl_estimator unknown", {}, {"kl_estimator": "k9"}),
    ],
}


def _cases():
    for call, bad in BAD.items():
        for name, change, kw in bad:
            yield pytest.param(call, change, kw, id=f"{call}-{name}")


def _error(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("call, change, kw", list(_cases()))
def test_a_refused_input_raises_the_public_error(call, change, kw):
    x = {**_inputs(), **change}
    got = _error(lambda: CALLS[call](x, **kw))
    with pf.use_backend("reference"):
        want = _error(lambda: CALLS[call](x, **kw))
    assert got == want


def _counted(monkeypatch, op):
    """Count the calls of the native function's direct operator."""
    fn = backends.backend_info("native").module.FUNCTIONS[op]
    calls = []
    original = fn.direct

    def counted(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(fn, "direct", counted)
    return calls


def _values_and_grads(call, x, **kw):
    x = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in x.items()}
    out = CALLS[call](x, **kw)
    values = [out[0], *out[1].values()] if isinstance(out[1], dict) else list(out)
    sum(v.sum() for v in values if v.requires_grad).backward()
    return values + [x[k].grad for k in ("lp", "old", "adv", "scores")]


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("mask", ["bool", "float", "float64 scores"])
def test_the_direct_call_equals_the_checked_call(call, mask, monkeypatch):
    """The direct call (taken: counted) equals the checked path (direct_op off), bit for bit; a
    float mask and kl_penalized_rewards' float64 scores with float32 log-probs take the checked path."""
    x = _inputs(seed=1)
    if mask == "float":
        x["mask"] = x["mask"].double()
    if mask == "float64 scores":
        x["lp"], x["old"] = x["lp"].float(), x["old"].float()
    calls = _counted(monkeypatch, OPS[call])
    got = _values_and_grads(call, x, **GOOD[call])
    direct = {"bool": True, "float": call == "kl_estimate", "float64 scores": call != "kl_penalized_rewards"}[mask]
    assert len(calls) == int(direct)
    module = importlib.import_module(f"ppo_fast.ops.{MODULES.get(call, call)}")
    monkeypatch.setattr(module, "direct_op", lambda *args: None)
    want = _values_and_grads(call, x, **GOOD[call])
    assert len(calls) == int(direct)
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


MODULES = {**dict.fromkeys(LOSSES, "policy_loss"), "kl_estimate": "kl_penalized_rewards"}


def test_a_backend_chosen_by_use_backend_or_the_environment_is_called_directly_only_if_native(monkeypatch):
    x = _inputs()
    calls = _counted(monkeypatch, "clipped_policy_loss")
    with pf.use_backend("reference"):
        CALLS["clipped_policy_loss"](x)
    monkeypatch.setenv("PPO_FAST_BACKEND", "reference")
    CALLS["clipped_policy_loss"](x)
    assert calls == []
    monkeypatch.setenv("PPO_FAST_BACKEND", "native")
    CALLS["clipped_policy_loss"](x)
    assert calls == [1]
