"""TRL's own GRPOTrainer with its log-probs computed by ppo_fast (``ppo_fast.integrations.trl``).

    pip install trl==1.16.0 datasets
    python examples/trl_grpo.py

``patch()`` replaces TRL's per-token log-prob and entropy functions (and its fused LM head) by
ppo_fast's kernels; everything else is TRL's.  Two steps on a tiny Llama, on the CPU.
"""

from __future__ import annotations

import tempfile

import datasets
from tiny_llama import tiny_llama
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

import ppo_fast.integrations
import ppo_fast.integrations.trl as pf_trl


def digits(completions, **kwargs) -> list[float]:
    return [float(sum(c.isdigit() for c in completion)) for completion in completions]


def main():
    folder = tiny_llama()
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    prompts = datasets.Dataset.from_dict({"prompt": ["12+34=", "50+6=", "70+18=", "99+9="] * 2})
    with pf_trl.patch():  # TRL's functions are ppo_fast's inside the block
        trainer = GRPOTrainer(
            model=folder,
            reward_funcs=digits,
            args=args,
            train_dataset=prompts,
            processing_class=AutoTokenizer.from_pretrained(folder),
        )
        result = trainer.train()
    served = ppo_fast.integrations.counts("trl")
    print(f"{result.global_step} GRPO steps; calls served by ppo_fast: {served}")
    return result, served


if __name__ == "__main__":
    result, served = main()
    assert result.global_step == 2 and sum(served.values()) > 0
