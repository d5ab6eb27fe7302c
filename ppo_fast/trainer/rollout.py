"""Rollouts: batched sampling with the KV cache, then the forward passes PPO needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ppo_fast as pf

from .models import Critic


@dataclass
class Batch:
    """Prompt + response token ids of a set of rollouts; the prompt is left-padded to ``prompt_width``."""

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R], 0 at prompt padding and after the response's EOS
    prompt_width: int

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width :]

    @property
    def response_mask(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompt_width :].bool()

    @property
    def position_ids(self) -> torch.Tensor:
        # As generate() counts them with left padding: from 0 at the first real token.
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def rows(self, index: torch.Tensor) -> Batch:
        return Batch(self.input_ids[index], self.attention_mask[index], self.prompt_width)


def response_mask_until_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """True up to and including each row's first EOS (everything if there is none)."""
    is_eos = response_ids == eos_token_id
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    return eos_before == 0


def encode_prompts(tokenizer, prompts: list[str], device) -> dict:
    """The prompts' token ids, left-padded (``input_ids``, ``attention_mask``): the same for every rollout engine."""
    return tokenizer(prompts, padding=True, return_tensors="pt", padding_side="left").to(device)


def batch_from_responses(enc, response: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> Batch:
    """Encoded prompts + ``[B, R]`` responses whose tokens outside ``mask`` become padding."""
    response = response.masked_fill(~mask, pad_token_id)
    input_ids = torch.cat([enc["input_ids"], response], dim=1)
    attention_mask = torch.cat([enc["attention_mask"].bool(), mask], dim=1)
    return Batch(input_ids, attention_mask, enc["input_ids"].shape[1])


@torch.no_grad()
def generate(policy, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float, top_p: float, greedy: bool,
             top_k: int = 0, synced_gpus: bool = False) -> Batch:
    """Sample (or greedily decode) responses; tokens after the first EOS become padding.
    ``synced_gpus``: every rank runs the same number of forward passes (sharded weights)."""
    enc = encode_prompts(tokenizer, prompts, policy.device)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    out = policy.generate(
        **enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced_gpus, **sampling
    )
    response = out[:, enc["input_ids"].shape[1] :]
    return batch_from_responses(enc, response, response_mask_until_eos(response, tokenizer.eos_token_id), tokenizer.pad_token_id)


def decode_responses(tokenizer, batch: Batch) -> list[str]:
    return tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)


def forward(policy, critic: Critic | None, batch: Batch, *, temperature: float, entropy: bool = False, values: bool = False):
    """Per-response-token ``(logprobs, entropy or None, values or None)`` under the current weights.

    The logits at position ``t`` predict token ``t + 1``, so the response's tokens are
    scored by the logits from ``prompt_width - 1`` to the second to last position; the
    values are read at the same positions (the state before each response token).
    """
    shared_values = values and critic is not None and critic.shared
    out = policy(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
        output_hidden_states=shared_values, use_cache=False,
    )
    start = batch.prompt_width - 1
    logits = out.logits[:, start:-1]
    result = pf.token_logprobs(logits, batch.response_ids, temperature=temperature, return_entropy=entropy)
    logprobs, token_entropy = result if entropy else (result, None)
    token_values = None
    if values:
        if shared_values:
            token_values = critic.head(out.hidden_states[-1][:, start:-1])
        else:
            token_values = critic(batch.input_ids, batch.attention_mask, batch.position_ids)[:, start:-1]
        token_values = token_values.float()
    return logprobs, token_entropy, token_values


@torch.no_grad()
def score_old_and_ref(policy, reference, critic, batch: Batch, *, temperature: float, chunk: int):
    """Old log-probs, reference log-probs and (with a critic) values, in chunks of ``chunk`` rows, dropout off."""
    old, ref, vals = [], [], []
    for start in range(0, batch.input_ids.shape[0], chunk):
        part = batch.rows(slice(start, start + chunk))
        logp, _, v = forward(policy, critic, part, temperature=temperature, values=critic is not None)
        ref_logp, _, _ = forward(reference, None, part, temperature=temperature)
        old.append(logp)
        ref.append(ref_logp)
        vals.append(v)
    values = torch.cat(vals) if critic is not None else None
    return torch.cat(old), torch.cat(ref), values
