"""Padding-free forward passes (--padding-free): a micro-batch's real tokens packed into one sequence
score every response token as the padded layout does, in value and gradient; a model whose attention
crosses the packed sequences is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

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


def _batch(vocab: int, seed: int) -> Batch:
    """Prompts left-padded to 7 (real lengths 7, 3, 1, 5), responses of 6 ending early (6, 2, 1, 4 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (4, 13), generator=generator)
    mask = torch.zeros(4, 13, dtype=torch.bool)
    for row, (prompt, response) in enumerate([(7, 6), (3, 2), (1, 1), (5, 4)]):
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


def _one_update(budget: int | None, seed: int) -> dict:
    tokenizer = default_task.build_tokenizer()
    policy = default_task.build_model(tokenizer, seed)
    critic = build_critic(policy, "separate")
    batch = _batch(len(tokenizer), seed)
    cfg = TrainerConfig(
        num_mini_batches=1, num_ppo_epochs=1, max_tokens_per_micro_batch=budget, max_grad_norm=0.0, padding_free=True
    )
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
