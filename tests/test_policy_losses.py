"""Every registered policy-loss mode (``pf.policy_loss_modes()``) against a plain formula
written from its paper / verl definition and against verl 0.9.1's own function
(``get_policy_loss_fn``; skipped where verl is not installed): loss, gradients and stats,
with every ``agg`` mode, with and without per-token weights.

Adding a mode: one entry in ``CASES`` (its parameters for the test, and its formula).
The conformance matrix (tests/test_conformance.py) compares every backend serving a mode
with the reference on its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from test_native_common import requires_native

import ppo_fast as pf
from ppo_fast.backends import serving
from ppo_fast.spec import AGG_MODES

# --------------------------------------------------------------------------- plain formulas
# Per-token losses ``[B, T]`` (or per-row ``[B]`` for geo_mean), written from the definitions
# without the library's helpers; ``sg`` is stop-gradient.


def sg(x):
    return x.detach()


def row_mean(x, mask):
    return torch.stack([x[i][mask[i]].mean() if mask[i].any() else x.new_zeros(()) for i in range(x.shape[0])])


def vanilla(lp, old, adv, mask, *, clip_eps_low, clip_eps_high, dual_clip):
    r = torch.exp(lp - old)
    pg = torch.maximum(-adv * r, -adv * r.clamp(1 - clip_eps_low, 1 + clip_eps_high))
    return torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg) if dual_clip else pg


def gspo(lp, old, adv, mask, *, clip_eps_low, clip_eps_high):
    s = torch.exp(sg(row_mean(lp - old, mask)).unsqueeze(-1) + lp - sg(lp))  # = s_i, gradient of pi / sg(pi)
    return torch.maximum(-adv * s, -adv * s.clamp(1 - clip_eps_low, 1 + clip_eps_high))


def geo_mean(lp, old, adv, mask, *, clip_eps_low, clip_eps_high, weights=None):
    log_r = lp - old
    clipped = torch.where(
        adv > 0,
        torch.minimum(log_r, log_r.clamp(max=clip_eps_high)),
        torch.where(adv < 0, torch.maximum(log_r, log_r.clamp(min=-clip_eps_low)), 0.0 * log_r),
    )
    row = -row_mean(adv, mask) * torch.exp(row_mean(clipped, mask))
    if weights is not None:
        row = row * torch.exp(row_mean(torch.log(weights + 1e-10), mask))
    return row


def sapo(lp, old, adv, mask, *, tau_pos, tau_neg):
    r = torch.exp(lp - old)
    tau = torch.where(adv > 0, adv.new_full(adv.shape, tau_pos), adv.new_full(adv.shape, tau_neg))
    return -adv * torch.sigmoid(tau * (r - 1)) * 4 / tau


def cispo(lp, old, adv, mask, *, clip_eps_low, clip_eps_high):
    return -sg(torch.exp(lp - old).clamp(1 - clip_eps_low, 1 + clip_eps_high)) * adv * lp


def gpg(lp, old, adv, mask):
    return -adv * lp


def dro(lp, old, adv, mask, *, dro_beta):
    return -adv * lp + dro_beta / 2 * (lp - old) ** 2


def dppo(lp, old, adv, mask, *, ratio_cap, trusted):
    r = torch.exp(lp - old)
    return -adv * sg(r.clamp(max=ratio_cap)) * lp * trusted.to(lp.dtype)


def dppo_tv(lp, old, adv, mask, *, clip_eps_low, clip_eps_high, ratio_cap):
    dp = sg(lp.exp() - old.exp())
    trusted = torch.where(adv > 0, dp <= clip_eps_high, dp >= -clip_eps_low)
    return dppo(lp, old, adv, mask, ratio_cap=ratio_cap, trusted=trusted)


def dppo_kl(lp, old, adv, mask, *, clip_eps_low, clip_eps_high, ratio_cap):
    p, q = sg(lp.exp()), sg(old.exp())
    kl = q * (old - sg(lp)) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    trusted = torch.where(adv > 0, (kl <= clip_eps_high) | (p <= q), (kl <= clip_eps_low) | (p >= q))
    return dppo(lp, old, adv, mask, ratio_cap=ratio_cap, trusted=trusted)


def covariance(adv, lp, mask):
    a, l = sg(adv)[mask], sg(lp)[mask]
    cov = torch.full_like(lp, -math.inf)
    cov[mask] = (a - a.mean()) * (l - l.mean())
    return cov


def clip_cov(lp, old, adv, mask, *, clip_eps_low, clip_eps_high, clip_cov_ratio, clip_cov_lb, clip_cov_ub):
    r = torch.exp(lp - old)
    unclipped, clipped = -adv * r, -adv * r.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    cov = covariance(adv, lp, mask)
    candidates = (mask & (clipped <= unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)).nonzero()
    chosen = candidates[torch.randperm(len(candidates))[: max(1, int(clip_cov_ratio * int(mask.sum())))]]
    keep = torch.ones_like(lp)
    keep[chosen[:, 0], chosen[:, 1]] = 0
    return torch.maximum(unclipped, clipped) * keep


def clip_cov_stats(lp, old, adv, mask, params):
    """The fraction of valid tokens whose gradient was cut."""
    torch.manual_seed(1234)
    cut = clip_cov(lp, old, adv, mask, **params) == 0
    return {"clipfrac": (cut & mask & (adv != 0)).sum() / mask.sum()}


def kl_cov(lp, old, adv, mask, *, kl_cov_ratio, ppo_kl_coef):
    cov = covariance(adv, lp, mask).flatten()
    top = torch.topk(cov, max(1, int(int(mask.sum()) * kl_cov_ratio))).indices
    penalised = torch.zeros_like(cov, dtype=torch.bool)
    penalised[top] = True
    return -adv * torch.exp(lp - old) + ppo_kl_coef * (lp - old).abs() * penalised.view_as(lp)


def aggregate(loss, mask, agg):
    """verl's agg_loss, token by token; a per-row loss ``[B]`` counts once per valid token."""
    per_token = loss.unsqueeze(-1).expand(mask.shape) if loss.dim() == 1 else loss
    rows = [per_token[i][mask[i]] for i in range(mask.shape[0]) if mask[i].any()]
    if agg == "token-mean":
        return torch.cat(rows).mean()
    if agg == "token-sum":
        return torch.cat(rows).sum()
    if agg == "seq-mean-token-mean":
        return torch.stack([r.mean() for r in rows]).mean()
    total = torch.stack([r.sum() for r in rows]).mean()
    return total / mask.shape[-1] if agg == "seq-mean-token-sum-norm" else total


def clip_stats(lp, old, adv, mask, params):
    """The vanilla clip's stats, for the modes that report them (clipfrac_lower: the dual clip's)."""
    r = torch.exp(lp - old)
    clipped = -adv * r.clamp(1 - params["clip_eps_low"], 1 + params.get("clip_eps_high", params["clip_eps_low"]))
    dual = params.get("dual_clip") or math.inf
    lower = (adv < 0) & (-adv * dual < torch.maximum(-adv * r, clipped)) & mask
    return {"clipfrac": ((clipped > -adv * r) & mask).sum() / mask.sum(), "clipfrac_lower": lower.sum() / mask.sum()}


# --------------------------------------------------------------------------- the table


@dataclasses.dataclass
class Case:
    params: dict  # passed to pf.policy_loss (and mapped to verl's config)
    formula: Callable
    stats: Callable[..., dict] = lambda lp, old, adv, mask, params: {}  # noqa: E731  (besides approx_kl)
    verl_aggs: tuple[str, ...] = AGG_MODES  # the aggregations verl's function honours


CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
CASES = {
    "vanilla": Case({**CLIP, "dual_clip": 3.0}, vanilla, clip_stats),
    "gspo": Case({"clip_eps_low": 0.003, "clip_eps_high": 0.004}, gspo),
    "geo_mean": Case({"clip_eps_low": 0.1, "clip_eps_high": 0.15}, geo_mean, verl_aggs=("seq-mean-token-mean",)),
    "sapo": Case({"tau_pos": 1.0, "tau_neg": 1.05}, sapo, verl_aggs=("seq-mean-token-mean",)),
    "cispo": Case(CLIP, cispo),
    "gpg": Case({}, gpg),
    "clip_cov": Case({**CLIP, "clip_cov_ratio": 0.1, "clip_cov_lb": 0.0, "clip_cov_ub": 5.0}, clip_cov, clip_cov_stats),
    "kl_cov": Case({"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}, kl_cov),
    "dppo_tv": Case({"clip_eps_low": 0.05, "clip_eps_high": 0.08, "ratio_cap": 1.3}, dppo_tv),
    "dppo_kl": Case({"clip_eps_low": 0.01, "clip_eps_high": 0.02, "ratio_cap": 1.3}, dppo_kl),
    "dro": Case({"dro_beta": 0.3}, dro),
}


def test_every_registered_mode_has_a_case():
    assert set(CASES) == set(pf.policy_loss_modes())


def _inputs(seed, b=5, t=11, dtype=torch.float64, empty_row=True):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=gen, dtype=dtype) * 2 - 0.05  # log-probs < 0, as DPPO's p = exp(lp) needs
    old = lp + torch.randn(b, t, generator=gen, dtype=dtype) * 0.3
    adv = torch.randn(b, t, generator=gen, dtype=dtype)
    weights = torch.rand(b, t, generator=gen, dtype=dtype) + 0.5
    mask = torch.rand(b, t, generator=gen) < 0.75
    mask[:, 0] = True
    if empty_row:
        mask[1] = False
    return [x.requires_grad_() for x in (lp, old, adv, weights)], mask


def _grads(loss, leaves):
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


def _ours(mode, leaves, mask, agg, weighted, params=None):
    lp, old, adv, w = leaves
    torch.manual_seed(1234)  # clip_cov draws its tokens from the default generator
    loss, stats = pf.policy_loss(
        lp, old, adv, mask, loss_mode=mode, agg=agg, weights=w if weighted else None, **(params or CASES[mode].params)
    )
    return loss, stats, _grads(loss, leaves)


# (mode, its parameters, backend): every case on every backend serving the mode; the vanilla
# mode also without the asymmetric and the dual clip.
FORMULA_CASES = [
    pytest.param(mode, params, backend, id=f"{mode}{suffix}-{backend}")
    for mode, params, suffix in [(m, c.params, "") for m, c in CASES.items()]
    + [("vanilla", {"clip_eps_low": 0.2}, "-plain")]
    for backend in serving(pf.policy_loss_modes()[mode].op, "cpu")
]


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode, params, backend", FORMULA_CASES)
def test_matches_the_formula(mode, params, backend, agg, weighted):
    case = CASES[mode]
    leaves, mask = _inputs(7)
    lp, old, adv, w = leaves
    with pf.use_backend(backend):
        loss, stats, grads = _ours(mode, leaves, mask, agg, weighted, params)
    torch.manual_seed(1234)
    if mode == "geo_mean":  # weights enter per row (their geometric mean)
        per_token = case.formula(lp, old, adv, mask, **params, weights=w if weighted else None)
    else:
        full = {"clip_eps_high": params["clip_eps_low"], "dual_clip": None} if mode == "vanilla" else {}
        per_token = case.formula(lp, old, adv, mask, **{**full, **params}) * (w if weighted else 1.0)
    want = aggregate(per_token, mask, agg)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for got, expected in zip(grads, _grads(want, leaves)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    expected_stats = {"approx_kl": (old - lp)[mask].mean()} | case.stats(lp, old, adv, mask, params)
    for name, value in expected_stats.items():
        if name in stats:
            torch.testing.assert_close(stats[name].double(), value.detach().double(), rtol=1e-6, atol=1e-7)
    assert set(stats) == set(pf.policy_loss_modes()[mode].stats)
    assert all(not s.requires_grad for s in stats.values())


# verl's config names for ours (one name per concept here; verl reads the ratio cap of DPPO
# and the dual clip from the same clip_ratio_c).
_ACTOR = {"clip_eps_low": "clip_ratio_low", "clip_eps_high": "clip_ratio_high"} | {n: n for n in ("tau_pos", "tau_neg")}
_ACTOR |= dict.fromkeys(("dual_clip", "ratio_cap"), "clip_ratio_c")
# ours -> verl's metric names
_VERL_STATS = {"clipfrac": "actor/pg_clipfrac", "clipfrac_lower": "actor/pg_clipfrac_lower"}
_VERL_STATS |= dict.fromkeys(("approx_kl", "approx_kl_abs"), "actor/ppo_kl")


def _verl(core, mode, leaves, mask, agg, weighted):
    """verl's loss and metrics for ``mode`` with its parameters in ``CASES`` (as ``_ours``)."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    params = CASES[mode].params
    actor = {_ACTOR[k]: v for k, v in params.items() if k in _ACTOR}
    loss = {k: v for k, v in params.items() if k not in _ACTOR}
    fixed = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2)
    ratios = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, **actor}
    config = ActorConfig(**fixed, **ratios, policy_loss=PolicyLossConfig(**loss))
    lp, old, adv, w = leaves
    torch.manual_seed(1234)
    weights = w if weighted else None
    return core.get_policy_loss_fn(mode)(
        old, lp, adv, mask.double(), loss_agg_mode=agg, config=config, rollout_is_weights=weights
    )


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("mode, agg", [(mode, agg) for mode, case in CASES.items() for agg in case.verl_aggs])
def test_matches_verl(mode, agg, weighted):
    core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
    # verl's geo_mean averages over all rows, rows without tokens too: give every row one.
    leaves, mask = _inputs(19, empty_row=mode != "geo_mean")
    loss, stats, grads = _ours(mode, leaves, mask, agg, weighted)
    want, metrics = _verl(core, mode, leaves, mask, agg, weighted)
    # verl's means divide by (count + 1e-8): relative differences of about 1e-9.
    torch.testing.assert_close(loss, want, rtol=1e-7, atol=1e-10)
    for name, got, expected in zip(("logprobs", "old_logprobs", "advantages", "weights"), grads, _grads(want, leaves)):
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10, msg=lambda m: f"grad of {name}: {m}")
    assert {_VERL_STATS[n] for n in stats} == set(metrics), "the stats verl reports for this mode"
    for name, value in stats.items():
        assert value.item() == pytest.approx(metrics[_VERL_STATS[name]], rel=1e-6, abs=1e-9), name


@pytest.mark.parametrize("mode, params, backend", [p for p in FORMULA_CASES if not p.id.startswith("vanilla-plain")])
def test_the_loss_moves_the_right_way(mode, params, backend):
    """Not a tautology of the formulas: a step along -grad lowers the loss."""
    leaves, mask = _inputs(3, dtype=torch.float64)
    lp, old, adv, _ = leaves
    with pf.use_backend(backend):
        loss, _, grads = _ours(mode, leaves, mask, None, False)
        torch.manual_seed(1234)
        after, _ = pf.policy_loss((lp - 1e-3 * grads[0]).detach(), old, adv, mask, loss_mode=mode, **params)
    assert after < loss


def test_clipped_policy_loss_is_the_vanilla_mode():
    (lp, old, adv, w), mask = _inputs(5)
    kwargs = dict(clip_eps_low=0.1, clip_eps_high=0.3, dual_clip=2.0, weights=w, agg="token-sum")
    a = pf.clipped_policy_loss(lp, old, adv, mask, **kwargs)
    b = pf.policy_loss(lp, old, adv, mask, loss_mode="vanilla", **kwargs)
    assert torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys()
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_default_aggregation_and_parameters():
    leaves, mask = _inputs(9)
    lp, old, adv, _ = leaves
    for mode, entry in pf.policy_loss_modes().items():
        params = entry.example_params()
        torch.manual_seed(0)
        default, _ = pf.policy_loss(lp, old, adv, mask, loss_mode=mode, **params)
        torch.manual_seed(0)
        explicit, _ = pf.policy_loss(lp, old, adv, mask, loss_mode=mode, agg=entry.default_agg, **params)
        assert torch.equal(default, explicit), mode
    assert pf.policy_loss_modes()["sapo"].default_agg == "seq-mean-token-mean"


@pytest.mark.parametrize("mode", [m for m, e in pf.policy_loss_modes().items() if "native" in serving(e.op, "cpu")])
def test_native_cpu_is_deterministic_and_matches_verl(mode):
    """Bitwise the same result and gradient with 1 and 2 threads; equal to verl's function
    (the conformance matrix compares it with the reference on every dtype and layout)."""
    core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
    leaves, mask = _inputs(29, b=64, t=300, empty_row=mode != "geo_mean")
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with pf.use_backend("native"):
                loss, stats, grads = _ours(mode, leaves, mask, "seq-mean-token-mean", True)
            results.append((loss, grads))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)  # bitwise
    want, _ = _verl(core, mode, leaves, mask, "seq-mean-token-mean", True)
    torch.testing.assert_close(loss, want, rtol=1e-7, atol=1e-10)


@requires_native
def test_native_serves_a_mode_only_where_its_kernels_are_registered():
    for mode in pf.policy_loss_modes().values():
        for device in (d for d in ("cpu", "cuda") if "native" in serving(mode.op, d)):
            for op in (mode.op, f"{mode.op}_backward"):
                assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_fast::{op}", device.upper()), (op, device)


def test_every_required_parameter_has_an_example_that_binds():
    for mode in pf.policy_loss_modes().values():
        assert set(mode.bind(mode.example_params())) >= set(mode.example_params().values())
