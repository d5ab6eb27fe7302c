"""The built-in offline job: two-digit addition with a verifiable reward.

A character-level tokenizer and a small GPT-2 are built in code (no downloads).  A
short supervised warm-up imitates a sloppy teacher that often forgets the carry, so
the warm-up model answers most carry problems wrongly under greedy decoding while
still giving the right answer some probability.  PPO with an exact-match reward then
has something real to learn.  The warm-up model is cached in ``output_dir/warmup``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from .config import TrainerConfig

PAD, EOS = "<pad>", "<eos>"
CHARS = "0123456789+="
LOW, HIGH = 10, 99  # both operands have two digits, so every prompt has the same length
MODEL_SHAPE = dict(n_embd=64, n_layer=2, n_head=4, n_positions=16)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (a BPE with no merges), left padding for generation."""
    vocab = {PAD: 0, EOS: 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, padding_side="left")


def build_model(tokenizer, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **MODEL_SHAPE,
    )
    return GPT2LMHeadModel(config)


def prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def split_problems(eval_size: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All operand pairs, shuffled with ``seed``: (train, held-out of ``eval_size``)."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[eval_size:], pairs[:eval_size]


def sloppy_answer(a: int, b: int, rng: random.Random, carry_error_rate: float) -> str:
    """The teacher's answer: with probability ``carry_error_rate`` it drops the units carry."""
    total = a + b
    if (a % 10) + (b % 10) >= 10 and rng.random() < carry_error_rate:
        total -= 10
    return str(total)


def addition_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when the response is exactly the sum, else 0.0."""
    scores = []
    for p, r in zip(prompts, responses):
        a, b = p.rstrip("=").split("+")
        scores.append(1.0 if r.strip() == str(int(a) + int(b)) else 0.0)
    return scores


def warm_up(model, tokenizer, train_pairs, cfg: TrainerConfig, device: torch.device, log=print) -> None:
    """Supervised training on the sloppy teacher's demonstrations (loss on the answer only)."""
    rng = random.Random(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - i / max(cfg.sft_steps, 1))
    model.train()
    prompt_len = len(prompt(LOW, LOW))
    for step in range(cfg.sft_steps):
        batch = rng.sample(train_pairs, min(cfg.sft_batch_size, len(train_pairs)))
        texts = [prompt(a, b) + sloppy_answer(a, b, rng, cfg.demo_carry_error_rate) + EOS for a, b in batch]
        enc = tokenizer(texts, padding=True, return_tensors="pt", padding_side="right").to(device)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        labels[:, :prompt_len] = -100
        loss = model(**enc, labels=labels, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 200 == 0 or step == cfg.sft_steps - 1:
            log(f"warm-up step {step + 1}/{cfg.sft_steps}: loss {loss.item():.3f}")
    model.eval()


def warm_up_settings(cfg: TrainerConfig) -> dict:
    """Everything the cached warm-up model depends on (the held-out split included)."""
    names = ("seed", "sft_steps", "sft_batch_size", "sft_learning_rate", "demo_carry_error_rate", "eval_size")
    return {**{name: getattr(cfg, name) for name in names}, "model_shape": MODEL_SHAPE}


def load_or_warm_up(cfg: TrainerConfig, device: torch.device, log=print):
    """The warm-up policy and tokenizer, trained once and reused from ``output_dir/warmup``.

    The cache is reused only if it was made with the same warm-up settings.
    """
    cache = Path(cfg.output_dir) / "warmup"
    settings_file = cache / "warmup_settings.json"
    settings = warm_up_settings(cfg)
    if settings_file.exists():
        if json.loads(settings_file.read_text()) == settings:
            log(f"reusing the warm-up model in {cache}")
            return AutoModelForCausalLM.from_pretrained(cache).to(device), AutoTokenizer.from_pretrained(cache)
        log(f"the warm-up model in {cache} was made with other settings: training it again")
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, cfg.seed).to(device)
    train_pairs, _ = split_problems(cfg.eval_size, cfg.seed)
    start = time.perf_counter()
    warm_up(model, tokenizer, train_pairs, cfg, device, log)
    log(f"warm-up took {time.perf_counter() - start:.1f}s")
    model.save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    settings_file.write_text(json.dumps(settings))
    return model, tokenizer


def prompts(cfg: TrainerConfig) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts)."""
    train_pairs, eval_pairs = split_problems(cfg.eval_size, cfg.seed)
    return [prompt(a, b) for a, b in train_pairs], [prompt(a, b) for a, b in eval_pairs]
