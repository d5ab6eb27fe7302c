"""``linear_token_logprobs`` (the fused LM head) on every CPU backend against the plain
formula ``token_logprobs(transform(hidden @ weight.T + bias), labels)`` computed with the
whole logits in float32 (float64 for float64 inputs), forward and backward w.r.t.
hidden, weight and bias.  The backends' agreement with the reference over layouts and
poisons is in test_conformance.py; this file checks the op's meaning, its chunking
(several chunks on every backend) and its memory bound."""

from __future__ import annotations

import importlib
import math
import pathlib

import pytest
import torch

import ppo_fast as pf
from ppo_fast.backends import serving

IGNORE = -100


on_backends = pytest.mark.parametrize("backend", serving("linear_token_logprobs", "cpu"))

# forward (rtol, atol) on the float32 outputs; gradient (rtol, atol) in the input dtype,
# atol relative to the gradient's largest entry: a kernel may round d_logits to the
# input dtype before its products with the head or the hidden states (as tensor cores
# need), an error of that dtype's precision times the gradient's scale.
TOLERANCES = {
    torch.float64: ((1e-10, 1e-10), (1e-9, 1e-10)),
    torch.float32: ((2e-5, 2e-5), (2e-5, 2e-5)),
    torch.bfloat16: ((2e-5, 2e-5), (1.6e-2, 1e-2)),
    torch.float16: ((2e-5, 2e-5), (2e-3, 2e-3)),
}


def plain(hidden, weight, labels, bias=None, *, logit_scale=1.0, logit_softcap=None, **kwargs):
    """The unfused formula: the whole [N, V] logits, then token_logprobs (``kwargs``) on the reference."""
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    z = hidden.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    z = z * logit_scale
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    with pf.use_backend("reference"):
        out = pf.token_logprobs(z, labels, **kwargs)
    return out if kwargs.get("return_entropy") else (out,)


def make(gen, n, h, v, dtype, *, bias=True, ignored=0.2):
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=gen) / h**0.25).to(dtype).requires_grad_(True)
    b = torch.randn(v, generator=gen).to(dtype).requires_grad_(True) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    labels = torch.where(torch.rand(n, generator=gen) < ignored, IGNORE, labels)
    return hidden, weight, b, labels


def outputs_and_grads(fn, leaves, seed):
    outs = fn()
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(total, [x for x in leaves if x is not None])
    return [o.detach() for o in outs], grads


def assert_matches_plain(backend, hidden, weight, b, labels, seed, **kwargs):
    leaves = [hidden, weight, b]
    with pf.use_backend(backend):
        got, got_grads = outputs_and_grads(
            lambda: pf.linear_token_logprobs(hidden, weight, labels, bias=b, **kwargs), leaves, seed
        )
    want, want_grads = outputs_and_grads(lambda: plain(hidden, weight, labels, b, **kwargs), leaves, seed)
    (fwd_rtol, fwd_atol), (grad_rtol, grad_atol) = TOLERANCES[hidden.dtype]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=fwd_rtol, atol=fwd_atol, equal_nan=True)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert g.dtype == w.dtype, name
        atol = grad_atol * float(w.abs().max()) if w.numel() else 0.0
        torch.testing.assert_close(
            g, w, rtol=grad_rtol, atol=atol, equal_nan=True, msg=lambda m: f"grad of {name}: {m}"
        )


@on_backends
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.7, "return_entropy": True},
        {"logit_softcap": 3.0, "logit_scale": 0.5, "return_entropy": True, "temperature": 1.3},  # Gemma/Cohere-style
        {"bias": False, "return_entropy": True},
    ],
    ids=["plain", "temperature-entropy", "scale-softcap", "no-bias"],
)
def test_matches_the_plain_formula(backend, dtype, kwargs):
    gen = torch.Generator().manual_seed(hash((backend, str(dtype), tuple(kwargs))) % 2**31)
    kwargs = dict(kwargs)
    hidden, weight, b, labels = make(gen, 29, 13, 203, dtype, bias=kwargs.pop("bias", True))  # odd H and V
    assert_matches_plain(backend, hidden, weight, b, labels, 1, **kwargs)


# The interpreter is too slow here; Triton's tiles: tests/backends/test_triton_kernels.py.
@pytest.mark.parametrize("backend", [b for b in serving("linear_token_logprobs", "cpu") if b != "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_chunks(backend, dtype, monkeypatch):
    """Enough rows for several chunks on every backend (the reference's chunk made small;
    the native kernel's is 2**23 logits, 2046 used rows here), a vocabulary past its
    1024-logit blocks."""
    monkeypatch.setattr(
        importlib.import_module("ppo_fast.backends.reference.linear_token_logprobs"), "CHUNK_ELEMENTS", 370 * 4099
    )
    gen = torch.Generator().manual_seed(4)
    hidden, weight, b, labels = make(gen, 2700, 8, 4099, dtype, ignored=0.1)
    assert_matches_plain(backend, hidden, weight, b, labels, 3, return_entropy=True, temperature=0.9)


@on_backends
def test_strided_and_batched_hidden(backend):
    """hidden [B, T, H] sliced along T (no [N, H] view exists) and with a non-unit last stride."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(3, 10, 2 * 9, generator=gen, requires_grad=True)
    weight = torch.randn(31, 9, generator=gen, requires_grad=True)
    labels = torch.randint(0, 31, (3, 5), generator=gen)
    hidden = base[:, ::2, ::2]
    with pf.use_backend(backend):
        got, got_grads = outputs_and_grads(
            lambda: pf.linear_token_logprobs(hidden, weight, labels, return_entropy=True), [base, weight], 4
        )
    want, want_grads = outputs_and_grads(
        lambda: plain(hidden.reshape(-1, 9), weight, labels.reshape(-1), return_entropy=True), [base, weight], 4
    )
    for g, w in zip(got, want):
        assert g.shape == (3, 5)
        torch.testing.assert_close(g.reshape(-1), w)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@on_backends
def test_tied_weights_accumulate_both_gradients(backend):
    """The head is the input embedding (tied): its gradient is the lookup's plus the head's."""
    gen = torch.Generator().manual_seed(6)
    embedding = torch.nn.Embedding(41, 12)
    with torch.no_grad():
        embedding.weight.copy_(torch.randn(41, 12, generator=gen))
    ids = torch.randint(0, 41, (2, 9), generator=gen)
    labels = torch.roll(ids, -1, dims=1)

    def weight_grad(head):
        embedding.weight.grad = None
        head(torch.tanh(embedding(ids)), embedding.weight).sum().backward()
        return embedding.weight.grad.clone()

    with pf.use_backend(backend):
        got = weight_grad(lambda h, w: pf.linear_token_logprobs(h, w, labels))
    torch.testing.assert_close(got, weight_grad(lambda h, w: plain(h, w, labels)[0]))


@on_backends
def test_a_nan_in_the_head_reaches_every_valid_row(backend):
    """(A NaN in a valid row is that row's only: test_sampling_truncation.py's test_nan_rows_stay_nan_and_alone;
    NaN/inf in ignored rows: the conformance matrix's masked poison.)"""
    hidden, head = torch.randn(2, 5), torch.randn(23, 5)
    head[9, 0] = math.nan
    with pf.use_backend(backend):
        assert torch.isnan(pf.linear_token_logprobs(hidden, head, torch.tensor([3, 9]))).all()


@on_backends
def test_shapes_empty_and_one_row(backend):
    weight = torch.randn(9, 4, requires_grad=True)
    with pf.use_backend(backend):
        logp, ent = pf.linear_token_logprobs(
            torch.randn(0, 4), weight, torch.zeros(0, dtype=torch.long), return_entropy=True
        )
        assert logp.shape == ent.shape == (0,) and logp.dtype == torch.float32
        one = pf.linear_token_logprobs(torch.randn(4), weight, torch.tensor(3))
        assert one.shape == ()
        batched = pf.linear_token_logprobs(torch.randn(2, 0, 4), weight, torch.zeros(2, 0, dtype=torch.long))
        assert batched.shape == (2, 0)


def test_reference_never_keeps_the_logits_for_backward():
    """Under autograd the reference saves no tensor of the logits' size (each chunk is
    recomputed in the backward): the [N, V] logits never all live at once."""
    n, h, v = 64, 8, 5000
    gen = torch.Generator().manual_seed(10)
    hidden, weight, b, labels = make(gen, n, h, v, torch.float32)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), pf.use_backend("reference"):
        logp, ent = pf.linear_token_logprobs(hidden, weight, labels, bias=b, return_entropy=True)
    assert max(sizes) <= v * h, f"a saved tensor of {max(sizes)} elements (logits: {n * v})"
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(weight.grad).all()


# --------------------------------------------------------------------------- the trainer's fused head


def _tiny_models():
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
    )

    small = {
        "vocab_size": 97,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": 32,
        "head_dim": 8,
    }
    return {
        "gpt2-tied": lambda: GPT2LMHeadModel(
            GPT2Config(vocab_size=97, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0)
        ),
        "gemma2-softcap": lambda: Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=2.0)),
        "cohere-scale": lambda: CohereForCausalLM(CohereConfig(**small, logit_scale=0.5)),
    }


@pytest.mark.parametrize("name", ["gpt2-tied", "gemma2-softcap", "cohere-scale"])
def test_trainer_scores_through_the_fused_head_as_through_the_logits(name, monkeypatch):
    """The trainer's log-probs and entropy from the backbone + output embedding equal those
    from the model's own logits (its soft-cap and logit scale included), and so do the
    gradients of the model's parameters."""
    from ppo_fast.trainer import rollout

    torch.manual_seed(11)
    model = _tiny_models()[name]().float().eval()  # no dropout, as the trainer runs it
    ids = torch.randint(0, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    batch = rollout.Batch(ids, mask, prompt_width=4)
    backbone, _ = rollout._fused_head(model, ids.device)
    assert backbone is not None, name
    runs = []
    for fused in (True, False):
        model.zero_grad()
        if not fused:
            monkeypatch.setattr(rollout, "_fused_head", lambda m, d: (None, "test: the logits path"))
        logp, ent, _ = rollout._response_scores(model, batch, temperature=0.7, entropy=True, hidden_states=False)
        (logp.sum() + ent.sum()).backward()
        runs.append((logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (logp_f, ent_f, grads_f), (logp_l, ent_l, grads_l) = runs
    torch.testing.assert_close((logp_f, ent_f), (logp_l, ent_l), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads_f, grads_l, rtol=1e-4, atol=1e-5)  # as many, each equal


def test_trainer_falls_back_to_the_logits_for_a_non_standard_head(capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ppo_fast.trainer import rollout

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=50, n_embd=8, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)
    ).eval()
    model.config.logits_scaling = 4.0  # a Granite-style division the fused head does not take
    backbone, why = rollout._fused_head(model, torch.device("cpu"))
    assert backbone is None and "logits_scaling" in why
    batch = rollout.Batch(torch.randint(0, 50, (1, 6)), torch.ones(1, 6, dtype=torch.long), prompt_width=2)
    rollout._fallbacks_logged.discard(why)
    logp, _, _ = rollout._response_scores(model, batch, temperature=1.0, entropy=False, hidden_states=False)
    assert logp.shape == (1, 4)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "logits_scaling" in err


def test_docs_example_runs_and_equals_the_unfused_call():
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "fused-head.md").read_text()
    example = page.split("```python\n", 1)[1].split("```", 1)[0]
    scope = {}
    exec(compile(example, "docs/fused-head.md example", "exec"), scope)
    want = pf.token_logprobs(scope["hidden"] @ scope["lm_head"].weight.T, scope["labels"], temperature=0.7)
    torch.testing.assert_close(scope["logp"], want)


@pytest.mark.parametrize("backend", serving("linear_token_logprobs", "cpu"))
def test_float16_small_cotangents_keep_their_accuracy(backend, monkeypatch):
    """float16 with an unscaled token-mean cotangent (1e-7) at T = 0.01: the logits' gradient would sit in
    float16's subnormal range; every backend's gradients stay within 1% of float64's (the reference keeps
    that gradient in float32: about 5e-3 here, the float16 result's own rounding)."""
    gen = torch.Generator().manual_seed(53)
    hidden = torch.randn(37, 24, generator=gen).half()
    weight = (torch.randn(301, 24, generator=gen) / 24**0.5).half()
    labels = torch.randint(0, 301, (37,), generator=gen)

    def grads(dtype, name):
        leaves = [hidden.to(dtype).clone().requires_grad_(), weight.to(dtype).clone().requires_grad_()]
        with pf.use_backend(name):
            logp = pf.linear_token_logprobs(*leaves, labels, temperature=0.01)
        return torch.autograd.grad(logp.sum() * 1e-7, leaves)

    want = grads(torch.float64, "reference")
    designs = (
        importlib.import_module("ppo_fast.backends.triton.linear_token_logprobs").DESIGNS
        if backend == "triton"
        else [None]
    )
    for design in designs:  # Triton: the GEMM-first head and the tiles
        with monkeypatch.context() as patch:
            if design is not None:
                patch.setattr(
                    importlib.import_module("ppo_fast.backends.triton.linear_token_logprobs"), "DESIGN", design
                )
            got = grads(torch.float16, backend)
        for name, g, expected in zip(("hidden", "weight"), got, want):
            error = float((g.double() - expected).norm() / expected.norm())
            assert error < 1e-2, f"{design or backend}, {name}: relative error {error:.2e}"
