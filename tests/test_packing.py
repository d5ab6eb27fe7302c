"""Padding-free forward passes (--padding-free): a micro-batch's real tokens packed into one sequence
score every response token as the padded layout does, in value and gradient; a model whose attention
crosses the packed sequences is refused."""

from __future__ import annotations

import importlib

import pytest
import tiers
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ppo_fast as pf
from ppo_fast import _varlen, spec
from ppo_fast.trainer import ConfigError, TrainerConfig, default_task, packing, rollout, startup, update
from ppo_fast.trainer.models import build_critic
from ppo_fast.trainer.rollout import Batch, forward, score_old_and_ref


def _llama(vocab: int):
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).float().eval()


def _batch(vocab: int, seed: int, responses=(6, 2, 1, 4), width: int = 6) -> Batch:
    """Prompts left-padded to 7 (real lengths 7, 3, 1, 5), responses of ``width`` ending early (``responses`` tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (4, 7 + width), generator=generator)
    mask = torch.zeros(4, 7 + width, dtype=torch.bool)
    for row, (prompt, response) in enumerate(zip((7, 3, 1, 5), responses)):
        mask[row, 7 - prompt : 7 + response] = True
    return Batch(ids, mask, 7)


@pytest.mark.parametrize("model_name", ["gpt2", "llama"])
@pytest.mark.parametrize("critic_mode", ["separate", "shared"])
def test_packed_scores_and_gradients_equal_the_padded_ones_at_every_response_token(model_name, critic_mode):
    _compare_layouts(model_name, critic_mode)


def test_packed_equals_padded_on_the_logits_path(monkeypatch):
    monkeypatch.setattr(rollout, "_fused_head", lambda model, device: (None, "the test scores from the logits"))
    _compare_layouts("gpt2", "shared")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_equals_padded_on_a_gpu():
    """The GPU's attention kernels (SDPA, with the fused head on Triton) keep packed sequences apart too."""
    _compare_layouts("llama", "shared", "cuda", tol=1e-4)


def _compare_layouts(model_name: str, critic_mode: str, device: str = "cpu", tol: float = 1e-5) -> None:
    device = torch.device(device)
    seed = torch.randint(1000, ()).item()
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed) if model_name == "gpt2" else _llama(len(tokenizer))
    policy.to(device)
    if why := packing.problem(policy, device):  # the trainer would not pack it either
        pytest.skip(why)
    critic = build_critic(policy, critic_mode).to(device)
    with torch.no_grad():  # a value head that reads its input (it starts at zero)
        critic.head.summary.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    cpu_batch = _batch(len(tokenizer), seed)
    batch = Batch(cpu_batch.input_ids.to(device), cpu_batch.attention_mask.to(device), cpu_batch.prompt_width)
    mask = batch.response_mask
    results = {}
    for packed in (False, True):
        params = [*policy.parameters(), *critic.parameters()]
        for p in params:
            p.grad = None
        logprobs, entropy, values = forward(
            policy, critic, batch, temperature=0.7, entropy=True, values=True, packed=packed
        )
        loss = (logprobs * 1.3 + entropy * 0.1 + values * values)[mask].sum()
        loss.backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        results[packed] = (logprobs.detach(), entropy.detach(), values.detach(), grads)
    (lp0, en0, v0, g0), (lp1, en1, v1, g1) = results[False], results[True]
    for name, want, got in (("logprobs", lp0, lp1), ("entropy", en0, en1), ("values", v0, v1)):
        torch.testing.assert_close(got[mask], want[mask], rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
        assert bool((got[~mask] == 0).all()), f"{name}: the packed layout leaves zeros outside the mask"
    for want, got in zip(g0, g1):
        torch.testing.assert_close(got, want, rtol=10 * tol, atol=tol)
    assert any(g.abs().sum() > 0 for g in g1)


def test_pack_fills_bins_longest_first_and_restarts_positions():
    """Rows of 13, 5, 2 and 9 real tokens in bins of the padded width 13, first fit decreasing:
    [13], [9, 2] and [5]; positions restart at each row and at each bin's unused tail."""
    batch = _batch(50, 0)
    p = packing.pack(batch.input_ids, batch.attention_mask, 6)
    real = [batch.input_ids[row][batch.attention_mask[row]].tolist() for row in range(4)]
    assert p.input_ids[0].tolist() == real[0] and p.input_ids[1, :11].tolist() == real[3] + real[2]
    assert p.input_ids[2, :5].tolist() == real[1]
    assert p.position_ids.tolist() == [list(range(13)), [*range(9), *range(2), *range(2)], [*range(5), *range(8)]]
    assert (
        p.scored.tolist()[:6] == [6, 7, 8, 9, 10, 11]
        and p.labels.tolist() == batch.response_ids[batch.response_mask].tolist()
    )


class _Crossing(torch.nn.Module):
    """A causal LM that drops position_ids: its attention runs across the packed sequences."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()

    def forward(self, input_ids, position_ids=None, **kwargs):
        return self.model(input_ids=input_ids, **kwargs)


def test_a_model_whose_attention_crosses_packed_sequences_is_refused_or_left_padded():
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, 0)
    device, said = torch.device("cpu"), []
    assert startup.padding_free(TrainerConfig(), model, device, said.append) and not said
    crossing = _Crossing(model)
    with pytest.raises(ConfigError, match=r"--padding-free: _Crossing's attention crosses .*; pass --no-padding-free"):
        startup.padding_free(TrainerConfig(padding_free=True), crossing, device, said.append)
    assert not startup.padding_free(TrainerConfig(), crossing, device, said.append)
    assert said == [said[0]] and said[0].startswith("padding-free off: _Crossing's attention crosses")
    assert not startup.padding_free(TrainerConfig(padding_free=False), crossing, device, said.append)


# ---------------------------------------------------------------------- micro-batches by a token budget


def test_token_bins_fill_first_fit_decreasing_within_the_budget():
    lengths = [5, 3, 8, 2, 7, 12]
    bins = [b.tolist() for b in packing.token_bins(lengths, 10)]
    assert bins == [[5], [2, 3], [1, 4], [0]]  # 12 alone (over the budget), 8+2, 7+3, 5
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins if len(b) > 1)


def _one_update(budget: int | None, seed: int, make_batch=_batch, kl_coef: float = 0.0, **options) -> dict:
    """One update's stats and weights (``options``: more of the config; ``kl_coef``: the KL in the loss,
    with rollout-correction weights too)."""
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed)
    critic = build_critic(policy, "separate")
    batch = make_batch(len(tokenizer), seed)
    options = dict(num_mini_batches=1, num_ppo_epochs=1, max_grad_norm=0.0, padding_free=True) | options
    cfg = TrainerConfig(max_tokens_per_micro_batch=budget, **options)
    order = torch.arange(batch.input_ids.shape[0])
    groups = update.first_epoch_micro_batches(order, batch.attention_mask.sum(-1), cfg)
    with torch.no_grad():  # scored in the update's first micro-batches, as the trainer does
        old, _, values = score_old_and_ref(
            policy, policy, critic, batch, temperature=1.0, groups=groups, packed=cfg.padding_free is not False
        )
    advantages = torch.linspace(-1, 1, batch.response_ids.numel()).view_as(old)
    exp = update.Experience(
        batch=batch, old_logprobs=old, advantages=advantages, old_values=values, returns=values + advantages
    )
    if kl_coef:
        exp.ref_logprobs, exp.kl_coef = old + 0.1 * advantages.flip(0), kl_coef
        exp.weights = torch.linspace(0.5, 1.5, advantages.numel()).view_as(old)
    params = [*policy.parameters(), *critic.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    stats = update.ppo_update(policy, critic, optimizer, scheduler, exp, cfg, step=1, first_order=order)
    return {"stats": stats, "weights": [p.detach().clone() for p in params]}


def test_a_token_budget_cuts_micro_batches_and_leaves_the_update_unchanged(monkeypatch):
    seed = torch.randint(1000, ()).item()
    cuts = []
    real = update.micro_batches
    monkeypatch.setattr(update, "micro_batches", lambda *a, **k: cuts.append(real(*a, **k)) or cuts[-1])
    whole, budgeted = _one_update(None, seed), _one_update(14, seed)
    # scoring, then the update, for each: rows of 13, 5, 2 and 9 tokens cut into [13], [9, 5], [2] by 14
    assert [len(cut[0]) for cut in cuts] == [1, 1, 3, 3]
    assert budgeted["stats"]["policy/ratio_dev_at_start"] == 0.0
    # packed where the real tokens fill at most 75% of the 13-wide rows: all four rows (29 of 4 x 13) in one
    # micro-batch; by 14, [9, 5] (14 of 2 x 13) and [2] (2 of 13), not [13]
    assert whole["stats"]["packing/packed_share"] == 1.0
    assert budgeted["stats"]["packing/packed_share"] == pytest.approx(2 / 3)
    for want, got in zip(whole["weights"], budgeted["weights"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(w, p) for w, p in zip(whole["weights"], _one_update(None, seed + 1)["weights"]))


# ---------------------------------------------------------------------- the one-pass loss on packed responses

# Each mode the trainer runs in one pass through the head: the token-level ones and the sequence-level ones.
_ONE_PASS_CASES = tiers.sampled(
    [
        (mode, agg)
        for mode in ("vanilla", "gspo", "geo_mean", "sapo", "dppo_kl")
        for agg in spec.AGG_MODES
        if pf.policy_loss_modes()[mode].linear_op is not None
    ],
    strength=1,
)


def _short_batch(vocab: int, seed: int) -> Batch:
    """``_batch`` with responses of width 7 and 5, 2, 0 and 4 tokens: none as long as the width, one empty."""
    return _batch(vocab, seed, (5, 2, 0, 4), 7)


def _no_spread(self, values):
    raise AssertionError("the one-pass loss spread packed tokens back to the padded [B, R] layout")


def _no_padding(*args, **kwargs):
    raise AssertionError("the one-pass loss took the packed op's padded detour")


@pytest.mark.parametrize("mode, agg", _ONE_PASS_CASES)
def test_the_one_pass_loss_of_packed_responses_equals_the_padded_one(mode, agg, monkeypatch):
    """Loss, every stat and every gradient equal the padded layout's (float64), the per-token inputs
    (weights, the reference's log-probs) gathered to the packed tokens; the packed call spreads
    nothing back to ``[B, R]`` and takes no padded detour."""
    seed = torch.randint(1000, ()).item()
    policy = _llama(96).double()
    if why := packing.problem(policy, torch.device("cpu")):
        pytest.skip(why)
    batch = _short_batch(96, seed)
    generator = torch.Generator().manual_seed(seed)
    shape = batch.response_ids.shape
    old, adv, weights, ref = (torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(4))
    terms = dict(
        loss_mode=mode,
        agg=agg,
        weights=weights.abs(),
        entropy_coef=0.03,
        **pf.policy_loss_modes()[mode].example_params(),
    )
    terms |= dict(ref_logprobs=old + 0.3 * ref, kl_coef=0.2, kl_estimator="k3")
    results = {}
    for packed in (False, True):
        policy.zero_grad(set_to_none=True)
        request = rollout.LossRequest(
            temperature=0.8,
            old_logprobs=old - 0.2 * adv.abs(),
            advantages=adv,
            mask=batch.response_mask,
            terms=terms,
            packed=packed,
        )
        with monkeypatch.context() as patch:
            if packed:
                patch.setattr(packing.Packed, "spread", _no_spread)
                patch.setattr(_varlen.Layout, "of", _no_padding)
            loss, stats = rollout.policy_loss_through_head(policy, batch, request)
        loss.backward()
        results[packed] = (loss.detach(), stats, [p.grad.clone() for p in policy.parameters()])
    (loss0, stats0, grads0), (loss1, stats1, grads1) = results[False], results[True]
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=1e-14)
    assert stats1.keys() == stats0.keys() and "kl_loss" in stats1
    for name in stats0:
        torch.testing.assert_close(stats1[name], stats0[name], rtol=1e-12, atol=1e-14, msg=lambda m: f"{name}: {m}")
    for want, got in zip(grads0, grads1):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert any(g.abs().sum() > 0 for g in grads1)


def test_the_packed_responses_are_one_sequence_each_in_row_order():
    batch = _short_batch(50, 0)
    p = packing.pack(batch.input_ids, batch.attention_mask, 7)
    assert p.cu_seqlens.tolist() == [0, 5, 7, 7, 11]
    values = torch.arange(28.0).view(4, 7)
    assert p.gather(values).tolist() == values[batch.response_mask].tolist()
    assert torch.equal(p.spread(p.gather(values)), torch.where(batch.response_mask, values, 0.0))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_the_packed_responses_bounds_are_on_the_host(device, monkeypatch):
    """``cu_seqlens`` is int64 on the host whatever the tokens' device, equal to the response mask's
    cumulative counts there, so that the trainer's packed GSPO loss keeps its one pass (on CUDA too: a
    device ``cu_seqlens`` would take two, ``linear_token_logprobs`` first, made to fail here)."""
    batch = _short_batch(50, 1)
    mask = batch.attention_mask.to(device)
    p = packing.pack(batch.input_ids.to(device), mask, 7)
    assert p.cu_seqlens.device.type == "cpu" and p.cu_seqlens.dtype == torch.int64
    on_device = torch.nn.functional.pad(mask[:, -7:].sum(1).cumsum(0), (1, 0))
    assert p.cu_seqlens.tolist() == on_device.tolist() and p.labels.device == mask.device
    op_module = importlib.import_module("ppo_fast.ops.linear_policy_loss")
    monkeypatch.setattr(op_module, "linear_token_logprobs", lambda *a, **k: pytest.fail("two passes"))
    generator = torch.Generator().manual_seed(1)
    old, adv = (torch.randn(mask.shape[0], 7, generator=generator).to(device) for _ in range(2))
    terms = dict(loss_mode="gspo", agg="seq-mean-token-mean", **pf.policy_loss_modes()["gspo"].example_params())
    request = rollout.LossRequest(
        temperature=1.0, old_logprobs=-old.abs(), advantages=adv, mask=mask[:, -7:], terms=terms, packed=True
    )
    hidden = torch.randn(len(p.labels), 8, generator=generator).to(device).requires_grad_()
    loss, _ = rollout._policy_loss(p, hidden, {"weight": torch.randn(50, 8, generator=generator).to(device)}, request)
    loss.backward()
    assert bool(hidden.grad.abs().sum() > 0)


@pytest.mark.parametrize("mode, agg", [("vanilla", "seq-mean-token-sum-norm"), ("gspo", "seq-mean-token-mean")])
def test_an_update_through_the_one_pass_loss_packed_equals_padded(mode, agg, monkeypatch):
    """Packing on or off, an update's micro-batches after the first (the one pass through the fused head,
    here on packed responses) give the same stats and weights."""
    seed = torch.randint(1000, ()).item()
    calls = []
    real = pf.linear_policy_loss
    monkeypatch.setattr(
        pf, "linear_policy_loss", lambda *a, **k: calls.append(k["cu_seqlens"] is not None) or real(*a, **k)
    )
    options = dict(gradient_accumulation_steps=2, num_ppo_epochs=2, loss_mode=mode, agg=agg, entropy_coef=0.01)
    padded, packed = (
        _one_update(None, seed, _short_batch, kl_coef=0.1, padding_free=padding_free, **options)
        for padding_free in (False, True)
    )
    assert calls == [False] * 3 + [True] * 3  # every micro-batch but the update's first, packed with padding-free
    assert packed["stats"].pop("packing/packed_share") == 1.0
    assert packed["stats"].keys() == padded["stats"].keys()
    for name, want in padded["stats"].items():
        assert packed["stats"][name] == pytest.approx(want, rel=1e-5, abs=1e-6), name
    for want, got in zip(padded["weights"], packed["weights"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
