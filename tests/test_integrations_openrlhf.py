"""ppo_fast.integrations.openrlhf against OpenRLHF's own functions (the oracle).

OpenRLHF installs here with ``pip install --no-deps openrlhf``, but its modules import
its GPU stack (flash-attn, DeepSpeed, vLLM; and aiohttp) at module level, none of which
the functions under test use.  Where those are missing, this file imports OpenRLHF's
real modules with stand-in modules for them (only while importing; removed after), so
that the oracle is OpenRLHF's own code, not a re-reading of it.  Skipped when OpenRLHF
is not installed.
"""

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from unittest import mock

import pytest
import torch
from harness import assert_same_results

pytest.importorskip("openrlhf", reason="openrlhf is not installed")

import ppo_fast.integrations.openrlhf as po  # noqa: E402
from ppo_fast.integrations import counts  # noqa: E402

# Imported by OpenRLHF's modules at load time, unused by the functions under test.
_GPU_STACK = ("flash_attn", "deepspeed", "vllm", "aiohttp")
BACKENDS = ["native", "triton"]


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports every module under ``roots`` as a MagicMock: any name, call or decorator goes."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return mock.MagicMock(__path__=[], __spec__=spec, __name__=spec.name)

    def exec_module(self, module):
        pass


@pytest.fixture(scope="module")
def orlhf():
    """OpenRLHF's modules under test, and its original functions."""
    missing = [r for r in _GPU_STACK if importlib.util.find_spec(r) is None]
    finder = _StandInFinder(missing)
    sys.meta_path.insert(0, finder)
    try:
        import openrlhf.models.loss as loss
        import openrlhf.models.utils as utils
        import openrlhf.trainer.ppo_utils.experience_maker as maker
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in missing]:
            del sys.modules[name]
    po.unpatch()
    places = {  # where OpenRLHF's code looks each one up, and so where the patch puts ours
        "compute_approx_kl": (utils, "compute_approx_kl"),
        "log_probs_from_logits": (utils, "log_probs_from_logits"),
        "PolicyLoss": (loss, "PolicyLoss"),
        "ValueLoss": (loss, "ValueLoss"),
        "gae": (maker.RemoteExperienceMaker, "get_advantages_and_returns"),
    }
    orig = {name: getattr(*place) for name, place in places.items()}
    yield types.SimpleNamespace(utils=utils, loss=loss, maker=maker, orig=orig, places=places)
    po.unpatch()


@pytest.fixture(autouse=True)
def _clean():
    po.unpatch()
    yield
    po.unpatch()


def _mask(b, t, gaps=True):
    lengths = torch.randint(2, t + 1, (b, 1))
    m = torch.arange(t) < lengths
    if gaps:
        m &= torch.rand(b, t) > 0.25
        m[:, 0] = True
    m[-1] = False
    return m


def versus(orlhf, name, call, backend="auto", wrt=None):
    """``call`` on OpenRLHF's own ``name`` and on ours, patched in on ``backend``: the same results and gradients
    with respect to ``wrt`` (harness.assert_same_results)."""
    want = call(orlhf.orig[name])
    with po.patch(backend=backend):
        got = call(getattr(*orlhf.places[name]))
    assert_same_results(got, want, wrt)


def test_patch_replaces_aliases_and_restores(orlhf):
    import openrlhf.models as models

    with po.patch():
        assert orlhf.utils.compute_approx_kl is po.compute_approx_kl
        assert orlhf.maker.compute_approx_kl is po.compute_approx_kl, "the experience maker's own binding"
        assert models.PolicyLoss is orlhf.loss.PolicyLoss and issubclass(models.PolicyLoss, orlhf.orig["PolicyLoss"])
        assert orlhf.maker.RemoteExperienceMaker.get_advantages_and_returns is po.get_advantages_and_returns
    assert orlhf.utils.compute_approx_kl is orlhf.orig["compute_approx_kl"]
    assert orlhf.maker.compute_approx_kl is orlhf.orig["compute_approx_kl"]
    assert models.PolicyLoss is orlhf.orig["PolicyLoss"]
    assert orlhf.maker.RemoteExperienceMaker.get_advantages_and_returns is orlhf.orig["gae"]


def test_unsupported_version(orlhf, monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.10.1" if d == "openrlhf" else real(d))
    with pytest.raises(po.UnsupportedPeerVersion, match=r"supports openrlhf 0\.11\.x"):
        po.patch()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("unbiased", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compute_approx_kl_matches(orlhf, backend, estimator, unbiased, dtype):
    logp = (torch.randn(4, 9, dtype=dtype) * 6).requires_grad_(True)  # some log-ratios beyond the +-10 clamp
    base, old = torch.randn(4, 9, dtype=dtype) * 6, logp.detach() + 0.3 * torch.randn(4, 9, dtype=dtype)
    kwargs = {"kl_estimator": estimator, "unbiased_gradient": unbiased}
    versus(orlhf, "compute_approx_kl", lambda f: f(logp, base, old, **kwargs), backend, logp)
    with po.patch(backend=backend), pytest.raises(ValueError, match="Unknown kl_estimator"):
        orlhf.utils.compute_approx_kl(logp, base, kl_estimator="k4")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_from_logits_matches_including_the_in_place_temperature(orlhf, backend, dtype):
    base = (torch.randn(3, 4, 33) * 3).to(dtype)
    labels = torch.randint(0, 33, (3, 4))
    theirs_logits, ours_logits = base.clone(), base.clone()
    want = orlhf.orig["log_probs_from_logits"](theirs_logits, labels, temperature=0.5)
    with po.patch(backend=backend):
        got = orlhf.utils.log_probs_from_logits(ours_logits, labels, temperature=0.5)
    assert torch.equal(ours_logits, theirs_logits), "OpenRLHF divides the logits in place; so does the adapter"
    assert_same_results(got, want, **({} if dtype == torch.float32 else {"atol": 0.07, "rtol": 0.02}))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("global_info", [{}, {"dp_size": 2, "batch_num_tokens": 50.0, "global_batch_size": 11.0}])
def test_policy_loss_matches(orlhf, backend, token_level, dual_clip, global_info):
    mask = _mask(6, 10).float()
    old = -torch.rand(6, 10) * 3
    logp = (old + 0.5 * torch.randn(6, 10)).requires_grad_(True)
    adv = torch.randn(6, 10)
    kwargs = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": dual_clip, "token_level_loss": token_level}
    versus(orlhf, "PolicyLoss", lambda cls: cls(**kwargs)(logp, old, adv, mask, **global_info), backend, logp)
    assert counts("openrlhf")["openrlhf.PolicyLoss"] >= 1


def test_policy_loss_gspo_and_is_correction_run_openrlhfs_forward(orlhf):
    mask = _mask(3, 5).float()
    args = (-torch.rand(3, 5), -torch.rand(3, 5), torch.randn(3, 5), mask, -torch.rand(3, 5))
    for kwargs in ({"policy_loss_type": "gspo"}, {"is_correction_level": "token"}):
        versus(orlhf, "PolicyLoss", lambda cls: cls(**kwargs)(*args))
    assert counts("openrlhf")["openrlhf.PolicyLoss:fallback"] >= 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("global_info", [{}, {"dp_size": 4, "batch_num_tokens": 31.0, "global_batch_size": 9.0}])
def test_value_loss_matches(orlhf, backend, clip, token_level, global_info):
    mask = _mask(5, 8).float()
    values = torch.randn(5, 8, requires_grad=True)
    old, returns = torch.randn(5, 8), torch.randn(5, 8)
    loss = lambda cls: cls(clip, token_level_loss=token_level)(values, old, returns, mask, **global_info)
    versus(orlhf, "ValueLoss", loss, backend, values)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gaps", [False, True])
def test_gae_matches_openrlhf_including_interior_masked_steps(orlhf, backend, gaps):
    mask = _mask(5, 13, gaps=gaps).float()
    values, rewards = torch.randn(5, 13), torch.randn(5, 13)
    for args in ((mask, 0.99, 0.95), (None, 1.0, 0.9)):  # every position compared, masked ones included
        versus(orlhf, "gae", lambda f: f(None, values, rewards, *args), backend)


def test_prefix_mask():
    m = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 0, 0, 1]])
    assert po.prefix_mask(m).int().tolist() == [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
