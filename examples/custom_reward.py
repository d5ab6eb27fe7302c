"""The ppo_fast trainer on your own model, prompts and reward, from Python.

    python examples/custom_reward.py

Trains a tiny Llama (random weights) for a few PPO steps on sums, scored by how many digits of
the answer it has in place: a demonstration of the API, too short to learn the task.  On your
own task pass your model folder, prompts and reward function the same way, or use
``ppo-fast train --model-name-or-path ... --prompts-file ... --reward-fn file.py:fn``.
"""

from __future__ import annotations

import tempfile

from tiny_llama import tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_fast.trainer import PPOTrainer, TrainerConfig


def sum_digits(prompts: list[str], responses: list[str]) -> list[float]:
    """One score per response: the share of the right answer's digits it has in place."""
    scores = []
    for prompt, response in zip(prompts, responses):
        a, b = prompt.rstrip("=").split("+")
        answer = str(int(a) + int(b))
        scores.append(sum(x == y for x, y in zip(response.strip(), answer)) / len(answer))
    return scores


def main() -> dict:
    folder = tiny_llama()
    cfg = TrainerConfig(
        output_dir=tempfile.mkdtemp(prefix="custom-reward-run-"),
        steps=3,
        batch_size=8,
        group_size=2,
        advantage_method="grpo",  # critic-free: the responses to one prompt are compared
        response_length=4,
        num_ppo_epochs=1,
        num_mini_batches=1,
        learning_rate=1e-3,
        sample_every=0,
        eval_every=0,
    )
    prompts = [f"{a}+{b}=" for a, b in ((12, 34), (50, 6), (70, 18), (99, 9), (5, 5), (31, 40))]
    trainer = PPOTrainer(
        cfg,
        policy=AutoModelForCausalLM.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        reward_fn=sum_digits,
        prompts=prompts,
        eval_prompts=prompts[:2],
    )
    summary = trainer.train()
    print(f"{summary['steps_done']} steps; held-out score {summary['eval_before']:.3f} -> {summary['eval_after']:.3f}")
    return summary


if __name__ == "__main__":
    assert main()["stop_reason"] == "done"
