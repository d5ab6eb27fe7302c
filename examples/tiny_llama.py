"""A tiny Llama (random weights, two layers) with a character-level tokenizer for sums like
``12+34=``, saved to a folder as ``save_pretrained`` writes it: the model the examples train.
Your own model is a folder or hub id like this one."""

from __future__ import annotations

import tempfile

from transformers import LlamaConfig, LlamaForCausalLM

from ppo_fast.trainer.default_task import build_tokenizer


def tiny_llama(seed: int = 0) -> str:
    """The folder of a fresh tiny Llama and its tokenizer."""
    import torch

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    folder = tempfile.mkdtemp(prefix="tiny-llama-")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
