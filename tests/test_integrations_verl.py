"""ppo_fast.integrations.verl against verl's own functions (the oracle), on each backend.

Skipped when verl is not installed (.ci/peers.sh installs it; verl's own tests run patched there too).
"""

import importlib.metadata
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from harness import assert_same_results

core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed")
verl_F = pytest.importorskip("verl.utils.torch_functional", reason="verl is not installed")

import ppo_fast.integrations.verl as pv  # noqa: E402
from ppo_fast.integrations import counts  # noqa: E402
from ppo_fast.spec import AGG_MODES  # noqa: E402

BACKENDS = ["native", "triton"]
AGG = list(AGG_MODES)


@pytest.fixture(autouse=True)
def _clean():
    pv.unpatch()
    yield
    pv.unpatch()


def _originals():
    """verl's own functions, taken while nothing is patched."""
    assert not pv.is_patched()
    return {
        **{n: getattr(core, n) for n in pv._CORE_FUNCTIONS},
        **{n: getattr(verl_F, n) for n in pv._FUNCTIONAL_FUNCTIONS},
    }


def _mask(b, t, gaps=True):
    """0/1 float masks with right padding, gaps inside rows (observation tokens) and an empty row."""
    lengths = torch.randint(2, t + 1, (b, 1))
    m = (torch.arange(t) < lengths).float()
    if gaps:
        m = m * (torch.rand(b, t) > 0.2).float()
        m[:, 0] = 1.0
    m[-1] = 0.0
    return m


def _config(global_info=None, loss_mode="vanilla", **clip):
    """verl's actor config; clip ratios 0.2 / 0.28 and dual clip 3.0 unless ``clip`` names others."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    clip = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, **clip}
    policy_loss = PolicyLossConfig(loss_mode=loss_mode)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss, **clip)
    cfg.global_batch_info.update(global_info or {})
    return cfg


def versus(name, call, backend="auto", wrt=None, ours=None, **tol):
    """``call`` on verl's own ``name`` and on ours, patched in on ``backend`` (``ours()`` fetches it; by default
    verl's module attribute): the same tensors and gradients with respect to ``wrt``
    (harness.assert_same_results; what is not a tensor the caller compares).  Returns both results."""
    want = call(_originals()[name])
    with pv.patch(backend=backend):
        got = call(ours() if ours else getattr(verl_F if name in pv._FUNCTIONAL_FUNCTIONS else core, name))
    assert_same_results(got, want, wrt, **tol)
    return got, want


# --------------------------------------------------------------------------- the handle


def test_patch_replaces_everything_listed_and_unpatch_restores():
    orig = _originals()
    vanilla, estimators = core.POLICY_LOSS_REGISTRY["vanilla"], dict(core.ADV_ESTIMATOR_REGISTRY)
    handle = pv.patch()
    for name in pv._CORE_FUNCTIONS:
        assert getattr(core, name) is getattr(pv, name), name
    for name in pv._FUNCTIONAL_FUNCTIONS:
        assert getattr(verl_F, name) is getattr(pv, name), name
    assert core.get_policy_loss_fn("vanilla") is pv.compute_policy_loss_vanilla
    assert core.get_policy_loss_fn(pv.POLICY_LOSS_NAME) is pv.compute_policy_loss_vanilla
    assert core.get_adv_estimator_fn("gae") is pv.compute_gae_advantage_return
    assert core.get_adv_estimator_fn("grpo") is pv.compute_grpo_outcome_advantage
    assert core.get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.1)).__class__ is pv.FixedKLController
    handle.unpatch()
    assert all(getattr(core, n) is orig[n] for n in pv._CORE_FUNCTIONS)
    assert all(getattr(verl_F, n) is orig[n] for n in pv._FUNCTIONAL_FUNCTIONS)
    assert core.POLICY_LOSS_REGISTRY["vanilla"] is vanilla and pv.POLICY_LOSS_NAME not in core.POLICY_LOSS_REGISTRY
    assert dict(core.ADV_ESTIMATOR_REGISTRY) == estimators


def test_patch_twice_is_harmless_and_handles_nest():
    orig = _originals()
    with pv.patch(backend="native") as outer:
        with pv.patch(backend="triton") as inner:
            assert core.agg_loss is pv.agg_loss and inner.backend == "triton"
        assert core.agg_loss is pv.agg_loss, "closing the inner handle keeps the outer patch"
        assert outer.active and not inner.active
    assert core.agg_loss is orig["agg_loss"]
    pv.patch()
    pv.patch()
    pv.unpatch()  # the module-level unpatch restores whatever is open
    assert core.agg_loss is orig["agg_loss"] and not pv.is_patched()


def test_aliases_in_loaded_verl_modules_are_patched_and_restored():
    import verl.workers.utils.losses as losses  # a module that did `from ... import`: its own bindings

    names = [n for n in ("agg_loss", "kl_penalty", "compute_value_loss") if hasattr(losses, n)]
    assert names, "verl.workers.utils.losses imports core_algos names directly"
    before = {n: getattr(losses, n) for n in names}
    with pv.patch():
        for n in names:
            assert getattr(losses, n) is getattr(pv, n)
    assert {n: getattr(losses, n) for n in names} == before


def test_unsupported_version_and_bad_backend_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        pv.patch(backend="cuda")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.8.5" if d == "verl" else real(d))
    with pytest.raises(pv.UnsupportedPeerVersion, match=r"supports verl 0\.9\.x; the installed verl is 0\.8\.5"):
        pv.patch()
    assert not pv.is_patched()


def test_errors_are_verls():
    """Where verl raises (inputs it refuses, a missing global batch size), so does the patch, with verl's message."""
    x, ones, one_valid = torch.randn(2, 3), torch.ones(2, 3), torch.tensor([[1.0, 0, 0], [0, 0, 0]])
    with pv.patch():
        loss, value_loss = core.compute_policy_loss_vanilla, core.compute_value_loss
        cases = {
            "sum of the mask is one": lambda: verl_F.masked_whiten(x, one_valid),
            "At least one element": lambda: core.compute_gae_advantage_return(x, x, 0 * ones, 1.0, 0.95),
            "clip_ratio_c": lambda: loss(x, x, x, ones, "token-mean", _config(clip_ratio_c=1.0)),
            "Invalid loss_agg_mode": lambda: loss(x, x, x, ones, "sum", _config()),
            "batch_num_tokens is required": lambda: core.agg_loss(x, ones, "token-mean", dp_size=2),
            "global_batch_size is required": lambda: value_loss(x, x, x, ones, 0.2, "seq-mean-token-mean", dp_size=2),
        }
        for match, call in cases.items():
            with pytest.raises(AssertionError if match == "clip_ratio_c" else ValueError, match=match):
                call()


# --------------------------------------------------------------------------- each function against verl's


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_matches_verl(backend):
    rewards, values, mask = torch.randn(5, 17), torch.randn(5, 17), _mask(5, 17)
    mask[-1, :3] = 1.0  # verl's whitening needs two valid tokens overall; keep the last row non-empty here
    # verl leaves carried values at masked positions; ours are 0 (listed deviation)
    versus("compute_gae_advantage_return", lambda f: [x * mask for x in f(rewards, values, mask, 0.97, 0.9)], backend)
    assert counts("verl")["verl.compute_gae_advantage_return"] >= 1


@pytest.mark.parametrize(
    "key,norm",
    [(k, n) for k in ("grpo", "grpo_vectorized") for n in (True, False)] + [("rloo", None), ("rloo_vectorized", None)],
)
def test_outcome_estimators_match_verl(key, norm):
    mask = _mask(11, 6)
    rewards = torch.randn(11, 6) * mask
    index = np.array(["a", "b", "a", "c", "b", "a", "d", "c", "b", "e", "a"], dtype=object)  # d, e: groups of one
    kwargs = {"norm_adv_by_std_in_grpo": norm} if norm is not None else {}
    call = lambda f: f(token_level_rewards=rewards, response_mask=mask, index=index, **kwargs)
    versus(f"compute_{key}_outcome_advantage", call, ours=lambda: core.get_adv_estimator_fn(key), atol=2e-5, rtol=2e-5)


def test_outcome_estimators_and_agg_loss_are_public_ops(monkeypatch):
    """verl's GRPO/RLOO are ``pf.group_advantages`` (verl's options as its parameters) and
    ``agg_loss`` is ``pf.aggregate``: the adapter maps arguments only."""
    import ppo_fast as pf

    calls = []
    for name in ("group_advantages", "aggregate"):
        real = getattr(pf, name)
        monkeypatch.setattr(pf, name, lambda *a, _n=name, _r=real, **k: calls.append((_n, k)) or _r(*a, **k))
    rewards, mask, index = torch.randn(4, 3), torch.ones(4, 3), np.array(["a", "a", "b", "c"])
    with pv.patch():
        core.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-3, norm_adv_by_std_in_grpo=False)
        core.compute_rloo_outcome_advantage(rewards, mask, index)
        core.compute_rloo_vectorized_outcome_advantage(rewards, mask, index)
        core.agg_loss(rewards, mask, "seq-mean-token-mean")
    assert calls == [
        ("group_advantages", dict(method="grpo", epsilon=1e-3, norm_by_std=False)),
        ("group_advantages", dict(method="rloo")),
        ("group_advantages", dict(method="rloo", zero_singletons=True)),
        ("aggregate", {}),
    ]


def test_grpo_epsilon_is_verls():
    with pv.patch():
        zero_std = torch.tensor([[1.0], [1.0], [3.0], [3.0]])  # zero-std groups: 0 / (0 + eps)
        adv, _ = core.compute_grpo_outcome_advantage(zero_std, torch.ones(4, 1), np.array([0, 0, 1, 1]), epsilon=1e-6)
        assert torch.equal(adv, torch.zeros(4, 1))
        adv, _ = core.compute_grpo_outcome_advantage(
            torch.tensor([[1.0], [1.0 + 2e-6]]), torch.ones(2, 1), np.array([0, 0])
        )
    std = 2e-6 / 2**0.5
    assert adv[1, 0].item() == pytest.approx(1e-6 / (std + 1e-6), rel=0.05)  # verl's 1e-6, not ppo_fast's 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize(
    "global_info", [None, {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 9, "loss_scale_factor": 13}]
)
def test_policy_loss_matches_verl(backend, agg, global_info):
    mask = _mask(6, 9)
    old = -torch.rand(6, 9) * 3
    logp = (old + 0.4 * torch.randn(6, 9)).requires_grad_(True)
    adv, weights, cfg = torch.randn(6, 9) * 2, torch.rand(6, 9) + 0.5, _config(global_info)
    (_, got), (_, want) = versus(
        "compute_policy_loss_vanilla", lambda f: f(old, logp, adv, mask, agg, cfg, weights), backend, wrt=logp
    )
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-6), k


def test_policy_loss_applies_verls_dual_clip_by_default():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[3.0, 0.0]])  # ratio e^3 ~ 20 on a negative advantage: verl caps the loss at 3 * |A|
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    with pv.patch():
        loss, metrics = core.compute_policy_loss_vanilla(old, logp, adv, mask, "token-sum", _config())
    assert loss.item() == pytest.approx(3.0 - 1.0)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.5)


def test_policy_loss_outside_our_domain_runs_verls_own():
    args = (torch.zeros(2, 3), -torch.rand(2, 3), torch.randn(2, 3), torch.ones(2, 3), "token-mean")
    versus("compute_policy_loss_vanilla", lambda f: f(*args, _config(clip_ratio_low=1.0))[0])
    assert counts("verl")["verl.compute_policy_loss_vanilla:fallback"] >= 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize(
    "global_info", [{}, {"dp_size": 4, "batch_num_tokens": 33, "global_batch_size": 7, "loss_scale_factor": 5}]
)
def test_value_loss_and_agg_loss_match_verl(backend, agg, global_info):
    mask = _mask(5, 8)
    vpreds = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    values, returns = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    versus("compute_value_loss", lambda f: f(vpreds, returns, values, mask, 0.3, agg, **global_info), backend, vpreds)
    loss_mat = torch.randn(5, 8, requires_grad=True)
    versus("agg_loss", lambda f: f(loss_mat, mask, agg, **global_info), backend, wrt=loss_mat)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+", "abs+"]
)
def test_kl_penalty_matches_verl_value_and_gradient(backend, name):
    logp = (torch.randn(4, 6) * 2).requires_grad_(True)
    ref = torch.randn(4, 6) * 2
    versus("kl_penalty", lambda f: f(logp, ref, name), backend, wrt=logp)
    with pv.patch(backend=backend), pytest.raises(NotImplementedError):
        core.kl_penalty_forward(logp, ref, "full")


def test_kl_controllers_follow_verls():
    orig = _originals()
    theirs = orig["AdaptiveKLController"](init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    with pv.patch():
        ours = core.get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000))
    for kl, n in [(3.0, 256), (np.float32(9.5), np.int64(256)), (torch.tensor(6.5), 64)]:
        theirs.update(kl, n)
        ours.update(kl, n)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-7)  # verl: float32 arithmetic for a tensor KL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_match_verl(backend, dtype):
    logits = (torch.randn(3, 5, 41) * 3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, 41, (3, 5))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}  # verl: bf16 softmax
    versus("logprobs_from_logits", lambda f: f(logits, labels), backend, wrt=logits, **tol)
    versus("entropy_from_logits", lambda f: f(logits), backend, wrt=logits, **tol)
    with pv.patch(backend=backend), pytest.raises(ValueError, match="labels"):
        verl_F.logprobs_from_logits(logits, torch.full((3, 5), -100))  # verl ignores no label


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
@pytest.mark.parametrize("axis", [None, -1])
def test_masked_mean_and_whiten_match_verl(mask_dtype, axis):
    x, mask = torch.randn(4, 7), _mask(4, 7).to(mask_dtype)
    versus("masked_mean", lambda f: f(x, mask, axis))
    for shift in (True, False):
        versus("masked_whiten", lambda f: f(x, mask, shift_mean=shift) * mask.float())


# --------------------------------------------------------------------------- verl driving our ops


def test_verl_registry_drives_our_ops_from_a_config():
    """actor.policy_loss.loss_mode=ppo_fast selects our loss; agg_loss is ours; the profiler shows ppo_fast:: ops."""
    cfg = _config(
        loss_mode=pv.POLICY_LOSS_NAME, global_info={"dp_size": 1, "batch_num_tokens": 30, "global_batch_size": 4}
    )
    mask = _mask(4, 10, gaps=False)
    old = -torch.rand(4, 10)
    logp = (old + 0.1 * torch.randn(4, 10)).requires_grad_(True)
    adv = torch.randn(4, 10)
    before = counts("verl")
    with pv.patch(backend="native"), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_fn = core.get_policy_loss_fn(cfg.policy_loss.loss_mode)
        loss, metrics = loss_fn(old, logp, adv, mask, cfg.loss_agg_mode, cfg)
        entropy = core.agg_loss(torch.rand(4, 10), mask, cfg.loss_agg_mode, **cfg.global_batch_info)
        (loss - 0.01 * entropy).backward()
    after = counts("verl")
    assert after["verl.compute_policy_loss_vanilla"] == before.get("verl.compute_policy_loss_vanilla", 0) + 1
    assert after["verl.agg_loss"] == before.get("verl.agg_loss", 0) + 1
    assert any(e.name.startswith("ppo_fast::") for e in prof.events()), "no ppo_fast op in the profile"
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


@pytest.mark.parametrize("agg", AGG)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_low_precision_losses_have_verls_result_dtype(agg, dtype, mask_dtype):
    """verl's seq-mean modes divide by a float32 row mask: a bf16/fp16 loss comes back float32 there."""
    mask = _mask(4, 6).to(mask_dtype)
    old = (-torch.rand(4, 6) * 3).to(dtype)
    logp = (old.float() + 0.3 * torch.randn(4, 6)).to(dtype)
    adv = torch.randn(4, 6).to(dtype)
    versus("agg_loss", lambda f: f(logp, mask, agg), atol=0.05, rtol=0.05)
    versus("compute_value_loss", lambda f: f(logp, adv, old, mask, 0.3, agg)[0], atol=0.05, rtol=0.05)
    versus("compute_policy_loss_vanilla", lambda f: f(old, logp, adv, mask, agg, _config())[0], atol=0.05, rtol=0.05)
