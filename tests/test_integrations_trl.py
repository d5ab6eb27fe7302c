"""ppo_fast.integrations.trl against TRL's own functions (the oracle), and TRL's GRPOTrainer on our ops.

Skipped when TRL is not installed (.ci/peers.sh installs it).
"""

import contextlib
import importlib.metadata
import tempfile

import pytest
import torch
from harness import assert_same_results

U = pytest.importorskip("trl.trainer.utils", reason="trl is not installed")

import ppo_fast.integrations.trl as pt  # noqa: E402
from ppo_fast.integrations import counts  # noqa: E402

BACKENDS = ["native", "triton"]


@pytest.fixture(autouse=True)
def _clean():
    pt.unpatch()
    yield
    pt.unpatch()


def _originals():
    assert not pt.is_patched()
    return {n: getattr(U, n) for n in pt._FUNCTIONS + ("_ChunkedLogProbFunction",)}


def _exact(logits, index, temperature):
    """float64 log-probs and entropy: what both implementations approximate."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp_all.gather(-1, index.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _no_less_exact(ours, theirs, exact):
    """Ours keeps TRL's dtypes and is, output by output, at least as close to ``exact`` as TRL's."""
    for o, t, w in zip(ours, theirs, exact, strict=True):
        assert o.dtype == t.dtype
        assert (o.double() - w).abs().max().item() <= (t.double() - w).abs().max().item() + 1e-6


def versus(name, call, backend, wrt=None, **tol):
    """``call`` on TRL's own ``name`` and on ours, patched in on ``backend``: the same results and gradients with
    respect to ``wrt`` (harness.assert_same_results)."""
    want = call(_originals()[name])
    with pt.patch(backend=backend):
        got = call(getattr(U, name))
    assert_same_results(got, want, wrt, **tol)


def test_patch_replaces_and_restores():
    orig = _originals()
    with pt.patch() as handle:
        assert all(getattr(U, n) is getattr(pt, n) for n in pt._FUNCTIONS)
        assert U._ChunkedLogProbFunction is pt.ChunkedLogProbFunction
        second = pt.patch()
        assert second is not handle and U.selective_log_softmax is pt.selective_log_softmax
        second.unpatch()
        assert U.selective_log_softmax is pt.selective_log_softmax, "the first handle is still open"
    assert all(getattr(U, n) is f for n, f in orig.items())


def test_unsupported_version(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.29.0" if d == "trl" else real(d))
    with pytest.raises(pt.UnsupportedPeerVersion, match=r"supports trl 1\.x; the installed trl is 0\.29\.0"):
        pt.patch()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("row_mask", [False, True])
def test_float32_matches_trl(backend, temperature, row_mask):
    logits = (torch.randn(3, 6, 57) * 3).requires_grad_(True)
    index = torch.randint(0, 57, (3, 6))
    rm = (torch.rand(3, 6) > 0.3) if row_mask else None
    tol = {"atol": 2e-5, "rtol": 2e-5}
    versus(
        "selective_log_softmax_and_entropy", lambda f: f(logits, index, True, temperature, rm), backend, logits, **tol
    )
    versus("selective_log_softmax", lambda f: f(logits, index, temperature, rm), backend, logits, **tol)
    versus("entropy_from_logits", lambda f: f(logits / temperature), backend, logits, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_keeps_trls_dtype_and_is_at_least_as_exact(backend):
    orig = _originals()
    logits = (torch.randn(4, 5, 300) * 4).to(torch.bfloat16)
    index = torch.randint(0, 300, (4, 5))
    theirs = orig["selective_log_softmax_and_entropy"](logits, index, True, 0.7)
    with pt.patch(backend=backend):
        ours = U.selective_log_softmax_and_entropy(logits, index, True, 0.7)
        ours_lp = U.selective_log_softmax(logits, index, temperature=0.7)
        ours_ent = U.entropy_from_logits(logits)
    assert ours[0].dtype == ours[1].dtype == ours_lp.dtype == ours_ent.dtype == torch.bfloat16  # TRL's contract
    _no_less_exact(ours, theirs, _exact(logits, index, 0.7))


def test_entropy_without_grad_and_top_k_index_falls_back():
    orig = _originals()
    logits = torch.randn(2, 3, 11, requires_grad=True)
    with pt.patch():
        lp, ent = U.selective_log_softmax_and_entropy(logits, torch.randint(0, 11, (2, 3)), entropy_requires_grad=False)
        assert lp.requires_grad and not ent.requires_grad
        topk = torch.randint(0, 11, (2, 3, 4))  # K log-probs per row: TRL's own code
        got = U.selective_log_softmax(logits, topk)
        with pytest.raises(ValueError, match="temperature must be positive"):
            U.selective_log_softmax(logits, topk[..., 0], temperature=0.0)
    torch.testing.assert_close(got, orig["selective_log_softmax"](logits, topk))
    assert counts("trl")["trl.selective_log_softmax:fallback"] >= 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap,scale,bias", [(None, 1.0, False), (30.0, 0.5, True)])
def test_fused_lm_head_matches_trls(backend, softcap, scale, bias):
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = (torch.randn(53, 16) * 0.3).requires_grad_(True)
    b = torch.randn(53, requires_grad=True) if bias else None
    targets = torch.randint(0, 53, (37,))
    params = [hidden, weight] + ([b] if bias else [])
    args = (hidden, weight, b, targets, 0.8, 16, softcap, scale)
    every = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # what SFT/DPO/KTO ask for
    for outputs, wrt, rtol in ((every[:2], None, 1e-5), (every[:2], params, 1e-4), (every, None, 1e-5)):
        versus("_ChunkedLogProbFunction", lambda f: f.apply(*args, outputs), backend, wrt, atol=1e-5, rtol=rtol)


def test_fused_lm_head_is_linear_token_logprobs(monkeypatch):
    """The fused head is ``pf.linear_token_logprobs`` (the op the conformance matrix covers),
    TRL's arguments mapped onto it; statistics it does not give run TRL's own function."""
    import ppo_fast as pf

    calls = []
    real = pf.linear_token_logprobs
    monkeypatch.setattr(pf, "linear_token_logprobs", lambda *a, **k: calls.append(k) or real(*a, **k))
    hidden, weight, targets = torch.randn(29, 8), torch.randn(40, 8), torch.randint(0, 40, (29,))
    with pt.patch():
        got = U._ChunkedLogProbFunction.apply(
            hidden, weight, None, targets, 0.9, 8, 20.0, 0.5, ("log_probs", "entropy")
        )
        before = counts("trl").get("trl.fused_lm_head:fallback", 0)
        U._ChunkedLogProbFunction.apply(hidden, weight, None, targets, 0.9, 8, None, 1.0, ("log_probs", "is_top1"))
        assert counts("trl")["trl.fused_lm_head:fallback"] == before + 1
    assert len(calls) == 1
    assert calls[0] == dict(
        bias=None, temperature=0.9, logit_scale=0.5, logit_softcap=20.0, return_entropy=True, ignore_index=pt._NO_IGNORE
    )
    want = real(hidden, weight, targets, temperature=0.9, logit_scale=0.5, logit_softcap=20.0, return_entropy=True)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_fused_lm_head_autocast_projects_in_trls_dtype():
    """Under autocast TRL projects in the autocast dtype: so does the shim (float32 results)."""
    orig = _originals()["_ChunkedLogProbFunction"]
    hidden, weight, targets = torch.randn(13, 16), torch.randn(30, 16) * 0.3, torch.randint(0, 30, (13,))
    args = (hidden, weight, None, targets, 1.0, 8, None, 1.0, ("log_probs", "entropy"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = orig.apply(*args)
        with pt.patch():
            ours = U._ChunkedLogProbFunction.apply(*args)
    assert ours[0].dtype == ours[1].dtype == torch.float32
    _no_less_exact(
        ours[:2], theirs[:2], _exact(hidden.bfloat16().double() @ weight.bfloat16().double().T, targets, 1.0)
    )


# --------------------------------------------------------------------------- TRL's own GRPOTrainer on our ops


def _grpo_run(patched: bool):
    datasets = pytest.importorskip("datasets")
    from trl import GRPOConfig, GRPOTrainer

    from ppo_fast.trainer.default_task import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = tempfile.mkdtemp(prefix="grpo-model-")
    build_model(tokenizer, seed=0).save_pretrained(model_dir)  # a path, so that TRL can build its reference model
    tokenizer.save_pretrained(model_dir)
    prompts = datasets.Dataset.from_dict({"prompt": ["12+34=", "50+6=", "70+18=", "99+9="] * 2})

    def reward(completions, **kwargs):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-out-"),
        use_cpu=True,
        bf16=False,
        use_vllm=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        beta=0.04,
        learning_rate=1e-3,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    with pt.patch(backend="native") if patched else contextlib.nullcontext():
        trainer = GRPOTrainer(
            model=model_dir, reward_funcs=reward, args=args, train_dataset=prompts, processing_class=tokenizer
        )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return result, logs, {e.name for e in prof.events() if e.name.startswith("ppo_fast::")}


def test_grpo_trainer_runs_two_steps_on_our_ops():
    before = counts("trl").get("trl.fused_lm_head", 0)
    result, logs, ops = _grpo_run(patched=True)
    assert result.global_step == 2 and len(logs) == 2
    served = counts("trl").get("trl.fused_lm_head", 0) - before
    assert served >= 4, "policy and reference log-probs of both steps go through ppo_fast"
    assert any("token_logprobs" in name for name in ops), f"no ppo_fast::token_logprobs in the profile: {ops}"
    _, reference_logs, _ = _grpo_run(patched=False)
    for ours, theirs in zip(logs, reference_logs):  # same seed, same samples: TRL's numbers within float error
        for key in ("loss", "grad_norm", "entropy", "kl", "reward"):
            assert float(ours[key]) == pytest.approx(float(theirs[key]), rel=1e-3, abs=1e-5), key
