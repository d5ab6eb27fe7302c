"""The public API contract: the seeds' worked example and the ops' formulas (the argument checks:
BAD_INPUTS in tests/test_conformance.py).

Run on every backend that serves CPU tensors here (reference always; native when the
extension is built; triton through the interpreter), so every backend meets the contract.
"""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ppo_fast as pf
from ppo_fast.backends import BACKENDS, serving
from ppo_fast.spec import MIN_TORCH, MIN_TRITON, older_than


def on_backends(*ops):
    """Run the test once per CPU backend that serves every one of ``ops``, inside ``use_backend``."""
    names = [name for name in serving(ops[0], "cpu") if all(name in serving(op, "cpu") for op in ops)]
    return pytest.mark.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request):
    with pf.use_backend(request.param):
        yield request.param


# --------------------------------------------------------------------------- the seeds' example


@on_backends("kl_penalized_rewards", "gae")
def test_seed_example_rewards_and_advantages(backend):
    """beta=0.1, gamma=1, lambda=0.95, r_RM=1.5, log-ratios +0.2/-0.2, V=[0.8, 1.0]."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref_logprobs = logprobs - torch.tensor([[0.2, -0.2]])
    rewards, kl = pf.kl_penalized_rewards(torch.tensor([1.5]), logprobs, ref_logprobs, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.2, -0.2]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.02, 1.52]]))

    advantages, returns = pf.gae(rewards, torch.tensor([[0.8, 1.0]]), mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(advantages, torch.tensor([[0.674, 0.52]]))
    torch.testing.assert_close(returns, torch.tensor([[1.474, 1.52]]))


@on_backends("clipped_policy_loss")
def test_seed_example_clipped_objective(backend):
    """Token 1 at ratio 1.3 with A = 0.674: the clip holds the objective at 1.2 * 0.674 = 0.809."""
    old = torch.tensor([[-1.0]])
    new = old + math.log(1.3)
    loss, stats = pf.clipped_policy_loss(new, old, torch.tensor([[0.674]]), torch.ones(1, 1), clip_eps_low=0.2)
    assert loss.item() == pytest.approx(-0.8088, abs=1e-4)
    assert round(-loss.item(), 3) == 0.809
    assert stats["clipfrac"].item() == 1.0


@on_backends("value_loss")
def test_seed_example_value_loss(backend):
    """The critic regresses toward R = [1.474, 1.52]: 0.5 * mean squared error when nothing clips."""
    values = torch.tensor([[0.8, 1.0]])
    returns = torch.tensor([[1.474, 1.52]])
    loss, stats = pf.value_loss(values, values, returns, torch.ones(1, 2), clip=10.0)
    expected = 0.5 * ((0.8 - 1.474) ** 2 + (1.0 - 1.52) ** 2) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clipfrac"].item() == 0.0


# --------------------------------------------------------------------------- GAE


def _naive_gae(rewards, values, mask, gamma, lam):
    """Per row in plain Python: the valid tokens, in order, are the episode."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_value = float(values[b, steps[i + 1]]) if i + 1 < len(steps) else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
    returns = torch.where(mask, adv + values.double(), 0.0)
    return adv, returns


@st.composite
def gae_batch(draw):
    batch = draw(st.integers(1, 5))
    length = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    keep = draw(st.floats(0.0, 1.0))
    mask = torch.rand(batch, length, generator=g) < keep
    if draw(st.booleans()):
        mask[0] = False  # an empty row
    rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    gamma = draw(st.sampled_from([1.0, 0.99, 0.5, 0.0]))
    lam = draw(st.sampled_from([1.0, 0.95, 0.3, 0.0]))
    return rewards, values, mask, gamma, lam


@pytest.mark.parametrize("backend_name", serving("gae", "cpu"))
@settings(max_examples=60, deadline=None)
@given(case=gae_batch())
def test_gae_matches_naive_loop(backend_name, case):
    rewards, values, mask, gamma, lam = case
    with pf.use_backend(backend_name):
        advantages, returns = pf.gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected_adv, expected_ret = _naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages.double(), expected_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(returns.double(), expected_ret, rtol=1e-5, atol=1e-5)
    assert (advantages[~mask] == 0).all() and (returns[~mask] == 0).all()  # exactly


@on_backends("gae")
def test_gae_length_one_row(backend):
    advantages, returns = pf.gae(torch.tensor([[2.0]]), torch.tensor([[0.5]]), torch.ones(1, 1), gamma=0.9, lam=0.9)
    torch.testing.assert_close(advantages, torch.tensor([[1.5]]))
    torch.testing.assert_close(returns, torch.tensor([[2.0]]))


# --------------------------------------------------------------------------- KL and rewards


@on_backends("kl_penalized_rewards")
def test_kl_penalized_rewards_place_score_at_last_valid_token(backend):
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    logp = torch.randn(3, 6)
    ref = torch.randn(3, 6)
    scores = torch.tensor([2.0, 3.0, -1.0])
    rewards, kl = pf.kl_penalized_rewards(scores, logp, ref, mask, kl_coef=0.05, kl_estimator="k2")
    expected_kl = torch.where(mask, 0.5 * (logp - ref) ** 2, 0.0)
    torch.testing.assert_close(kl, expected_kl)
    expected = -0.05 * expected_kl
    expected[0, 3] += 2.0
    expected[2, 0] += -1.0
    torch.testing.assert_close(rewards, expected)


# --------------------------------------------------------------------------- log-probs


@on_backends("token_logprobs")
def test_logprobs_and_entropy_match_log_softmax(backend):
    logits = torch.randn(3, 4, 11)
    labels = torch.randint(0, 11, (3, 4))
    logp, ent = pf.token_logprobs(logits, labels, temperature=1.3, return_entropy=True)
    full = torch.log_softmax(logits.double() / 1.3, -1)
    torch.testing.assert_close(logp.double(), full.gather(-1, labels.unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), -(full.exp() * full).sum(-1), atol=1e-5, rtol=1e-5)


@on_backends("token_logprobs")
def test_logprobs_ignore_index_gives_zero_and_no_gradient(backend):
    logits = torch.randn(6, 9, requires_grad=True)
    labels = torch.tensor([1, -100, 3, -100, 8, 0])
    logp, ent = pf.token_logprobs(logits, labels, return_entropy=True)
    assert (logp[labels == -100] == 0).all() and (ent[labels == -100] == 0).all()
    (logp.sum() + ent.sum()).backward()
    assert (logits.grad[labels == -100] == 0).all()
    assert (logits.grad[labels != -100] != 0).any()


@on_backends("token_logprobs")
def test_logprobs_extreme_rows(backend):
    """-inf elsewhere in a row is harmless; a -inf chosen logit gives -inf; NaN stays in its row."""
    logits = torch.randn(4, 6)
    labels = torch.tensor([0, 1, 2, 3])
    logits[0, 3] = float("-inf")
    logits[1, 1] = float("-inf")
    logits[2, 5] = float("nan")
    logits[3] *= 1e4
    logp, ent = pf.token_logprobs(logits, labels, return_entropy=True)
    assert torch.isfinite(logp[0]) and torch.isfinite(ent[0])
    assert logp[1].item() == float("-inf") and torch.isfinite(ent[1])
    assert torch.isnan(logp[2]) and torch.isnan(ent[2])
    assert torch.isfinite(logp[3]) and torch.isfinite(ent[3])


# --------------------------------------------------------------------------- losses


@on_backends("value_loss")
def test_value_loss_clip(backend):
    values, old, mask = torch.tensor([[1.0, 0.0, 2.0]]), torch.zeros(1, 3), torch.ones(1, 3)
    loss, stats = pf.value_loss(values, old, torch.tensor([[0.0, 1.0, 0.0]]), mask, clip=0.5, agg="token-sum")
    # token 0: max(1, 0.25) = 1; token 1: max(1, 1) = 1; token 2: max(4, 0.25) = 4
    assert loss.item() == pytest.approx(0.5 * (1 + 1 + 4))
    assert stats["clipfrac"].item() == 0.0
    loss, stats = pf.value_loss(values, old, torch.tensor([[3.0, 1.0, 3.0]]), mask, clip=0.5, agg="token-sum")
    # token 0: max(4, 6.25); token 1: max(1, 1); token 2: max(1, 6.25)
    assert loss.item() == pytest.approx(0.5 * (6.25 + 1 + 6.25))
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- whitening and means


def test_masked_mean_and_whiten():
    x = torch.randn(4, 6)
    mask = torch.rand(4, 6) < 0.6
    mask[0, 0] = mask[0, 1] = True
    valid = x[mask].double()
    assert pf.masked_mean(x, mask).item() == pytest.approx(valid.mean().item(), rel=1e-6)
    row_means = pf.masked_mean(x, mask, dim=1)
    for b in range(4):
        expected = x[b][mask[b]].mean().item() if mask[b].any() else 0.0
        assert row_means[b].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    white = pf.masked_whiten(x, mask)
    assert white[mask].double().mean().item() == pytest.approx(0.0, abs=1e-6)
    assert white[mask].double().std().item() == pytest.approx(1.0, rel=1e-4)
    assert (white[~mask] == 0).all()
    scaled = pf.masked_whiten(x, mask, shift_mean=False)
    # as in TRL and verl: whitened, then the mean added back (input mean, unit variance)
    torch.testing.assert_close(scaled[mask].double().mean(), valid.mean(), rtol=1e-4, atol=1e-6)
    assert scaled[mask].double().std().item() == pytest.approx(1.0, rel=1e-4)


# --------------------------------------------------------------------------- KL controllers


def test_kl_controllers():
    fixed = pf.FixedKLController(0.1)
    fixed.update(5.0, 100)
    assert fixed.value == 0.1
    adaptive = pf.AdaptiveKLController(0.2, target_kl=6.0, horizon=10000)
    adaptive.update(12.0, 256)  # error clipped to +0.2
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    adaptive.update(3.0, 100)  # error -0.5 clipped to -0.2
    assert adaptive.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.2 * 100 / 10000))


# --------------------------------------------------------------------------- backends


def test_backend_selection_and_errors(monkeypatch):
    report = pf.available_backends()
    assert set(report) == set(BACKENDS)
    assert report["reference"].startswith("available")
    with pytest.raises(ValueError, match="backend must be one of"):
        with pf.use_backend("cuda-magic"):
            pass
    monkeypatch.setenv("PPO_FAST_BACKEND", "reference")
    assert pf.current_backend() == "reference"
    monkeypatch.setenv("PPO_FAST_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="PPO_FAST_BACKEND"):
        pf.current_backend()


def test_backend_resolution_follows_the_choice_and_a_replaced_backend_record(monkeypatch):
    """resolve caches its answers: a later use_backend, $PPO_FAST_BACKEND, or a backend record
    replaced since (a backend made unavailable) must still change the answer."""
    from ppo_fast import backends

    op = "clipped_policy_loss"
    auto = backends.resolve(op, "cpu")
    with pf.use_backend("reference"):
        assert backends.resolve(op, "cpu") is backends.backend_info("reference").module.FUNCTIONS[op]
    monkeypatch.setenv("PPO_FAST_BACKEND", "reference")
    assert backends.resolve(op, "cpu") is backends.backend_info("reference").module.FUNCTIONS[op]
    monkeypatch.delenv("PPO_FAST_BACKEND")
    assert backends.resolve(op, "cpu") is auto
    with monkeypatch.context() as patched:  # os.environ replaced: the new one is read
        patched.setattr(os, "environ", {"PPO_FAST_BACKEND": "reference"})
        assert backends.resolve(op, "cpu") is backends.backend_info("reference").module.FUNCTIONS[op]
    assert backends.resolve(op, "cpu") is auto
    if auto is not backends.backend_info("reference").module.FUNCTIONS[op]:
        name = backends.resolved_backend_name(op, "cpu")
        monkeypatch.setitem(backends._INFO, name, backends.BackendInfo(False, "made unavailable", None))
        assert backends.resolve(op, "cpu") is not auto
        with pf.use_backend(name), pytest.raises(pf.BackendUnavailableError, match="made unavailable"):
            backends.resolve(op, "cpu")


def test_explicit_backend_that_cannot_serve_raises():
    for op, call in [
        ("token_logprobs", lambda: pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1]))),
        ("policy_loss_sapo", lambda: pf.policy_loss(*[torch.zeros(1, 2)] * 3, torch.ones(1, 2), loss_mode="sapo")),
    ]:
        for name in sorted(set(BACKENDS) - set(serving(op, "cpu"))):
            with pf.use_backend(name), pytest.raises(pf.BackendUnavailableError, match=op):
                call()
    with pf.use_backend("reference"):
        assert pf.token_logprobs(torch.randn(2, 3), torch.tensor([0, 1])).shape == (2,)


def test_backend_for_names_the_backend_an_op_runs_on():
    """pf.backend_for: the public answer to "which backend runs this op here" (the trainer asks it)."""
    op = "token_logprobs"
    for name in BACKENDS:
        with pf.use_backend(name):
            if name in serving(op, "cpu"):
                assert pf.backend_for(op, torch.device("cpu")) == pf.backend_for(op, "cpu") == name
            else:
                with pytest.raises(pf.BackendUnavailableError, match=op):
                    pf.backend_for(op, "cpu")
    with pf.use_backend("auto"):
        assert pf.backend_for(op, "cpu") in serving(op, "cpu")
    with pytest.raises(ValueError, match="op must be one of"):
        pf.backend_for("token_logprob", "cpu")


@pytest.mark.skipif("native" not in serving("token_logprobs", "cpu"), reason="native backend not built")
def test_a_backend_that_fails_to_import_stops_a_ci_run(tmp_path):
    """CI's guard (PPO_FAST_REQUIRE_BACKENDS, tests/conftest.py): in a copy of the package whose native
    registration raises, pytest stops before any test with the import error, instead of running
    without the native tests."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "ppo_fast", tmp_path / "ppo_fast", ignore=shutil.ignore_patterns("__pycache__"))
    registration = tmp_path / "ppo_fast" / "backends" / "native" / "gae.py"
    registration.write_text(registration.read_text() + "\nraise AssertionError('a broken registration')\n")
    (tmp_path / "tests").mkdir()
    shutil.copy(root / "tests" / "conftest.py", tmp_path / "tests")
    (tmp_path / "tests" / "test_one.py").write_text("def test_one():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PPO_FAST_REQUIRE_BACKENDS": "native,triton"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    said = run.stdout + run.stderr
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, said
    assert "native: import of ppo_fast.backends.native failed: AssertionError: a broken registration" in said, said
    assert "1 passed" not in said


def test_torch_and_triton_older_than_supported_are_refused_by_name():
    """pyproject.toml asks for spec.py's floors; an older torch stops the import in one line, an
    older triton leaves the Triton backend unavailable, saying why (docs/building.md)."""
    root = Path(__file__).resolve().parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    assert pyproject.count(f'"torch>={MIN_TORCH}"') == 2  # the build's and the package's
    assert pyproject.count(f'"triton>={MIN_TRITON}"') == 2  # the triton and test extras
    assert older_than("2.10.1+cu130", "2.11") and not older_than("2.11.0a0+git", "2.11")
    assert not older_than("2.12.0.dev20260101", "2.11") and not older_than("3.10.0", "3.6")
    code = (
        "import torch, triton\n"
        "real = torch.__version__\n"
        "torch.__version__ = '2.10.0+cu130'\n"
        "try:\n    import ppo_fast\nexcept ImportError as err:\n    print(err)\n"
        "torch.__version__, triton.__version__ = real, '3.5.1'\n"
        "import ppo_fast\n"
        "print(ppo_fast.available_backends()['triton'])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    first, second = run.stdout.splitlines()
    assert first == (
        "ppo_fast needs torch >= 2.11, found torch 2.10.0+cu130; install a newer one, e.g. pip install 'torch>=2.11'"
    )
    assert second == (
        "unavailable: triton cannot be used (ImportError: triton 3.5.1 is older than 3.6, the oldest supported)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device: the Triton kernels can run")
def test_triton_is_not_imported_where_no_kernel_can_run():
    # No CUDA device and no interpreter: the backend is unavailable, and the start of every CPU
    # process (ppo-fast generate) does not pay for importing triton and compiling its modules' ASTs.
    code = "import sys, ppo_fast\nprint('triton' in sys.modules, ppo_fast.available_backends()['triton'])"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False unavailable: no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU)"
