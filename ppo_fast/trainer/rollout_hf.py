"""Rollouts through Hugging Face's ``generate`` on the policy itself (``--rollout-engine hf``, the default):
no weights of its own to sync, and no log-probs of its own (the trainer's are the behaviour policy's)."""

from __future__ import annotations

import torch

from ppo_fast.spec import ROLLOUT_ENGINES

from .engine import EngineSetup
from .rollout import Batch, generate


class HFEngine:
    """``policy.generate`` with the KV cache (``rollout.generate``), under the run's autocast; with
    sharded weights every rank runs the same number of forward passes (``synced_gpus``)."""

    info = ROLLOUT_ENGINES["hf"]

    def __init__(self, policy: torch.nn.Module, *, autocast, synced_gpus: bool):
        self.policy, self.autocast, self.synced_gpus = policy, autocast, synced_gpus

    def generate(
        self,
        tokenizer,
        prompts: list[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int = 0,
        min_p: float = 0.0,
        greedy: bool,
        device: torch.device,
    ) -> tuple[Batch, None]:
        """``(batch, None)`` on the policy's device (``device`` is where the policy already is)."""
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, greedy=greedy)
        with self.autocast():
            batch = generate(
                self.policy, tokenizer, prompts, max_new_tokens=max_new_tokens, synced_gpus=self.synced_gpus, **sampling
            )
        return batch, None

    def sync_weights(self, policy) -> float:
        """Nothing to do: it generates with the policy itself."""
        return 0.0

    def close(self) -> None:
        pass


def start(setup: EngineSetup) -> HFEngine:
    return HFEngine(setup.policy, autocast=setup.autocast, synced_gpus=setup.synced_gpus)
