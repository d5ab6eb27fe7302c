"""The rollout-engine protocol: what the trainer asks of whatever generates its rollouts.

An engine is named in ``ppo_fast.spec.ROLLOUT_ENGINES`` (its module and what it can do, read by the
option checks before torch loads) and lives in that module, which has ``start(setup) -> Engine``.
A new engine is one module and one entry there; ``--rollout-engine``'s choices come from the registry.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from ppo_fast.spec import ROLLOUT_ENGINES, RolloutEngine

from .rollout import Batch


@runtime_checkable
class Engine(Protocol):
    """Generates rollouts from the policy's weights.  ``info``: its registry entry (its capabilities)."""

    info: RolloutEngine

    def generate(
        self,
        tokenizer,
        prompts: list[str],
        *,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        min_p: float,
        greedy: bool,
        device: torch.device,
    ) -> tuple[Batch, torch.Tensor | None]:
        """``(batch, the engine's log-probs [B, R] of the response tokens, or None where it has none
        (``info.logprobs``))``: left-padded prompts, responses up to and including their EOS, padding after.
        An engine whose entry ``continues`` also takes ``prefixes=`` (``--partial-rollouts``): each row's
        response so far (token ids), which it continues; its batch's responses are then the new tokens.  One
        whose entry has ``round_seconds`` also takes ``time_up=`` (``--partial-rollout-seconds``): a callable
        read after each token sampled, whose True ends every row there."""

    def sync_weights(self, policy) -> float:
        """Follow the policy's current weights (a no-op where ``not info.own_weights``); the seconds it took."""

    def close(self) -> None:
        """Release what the engine holds; it cannot generate afterwards."""


@dataclass(frozen=True, kw_only=True)
class EngineSetup:
    """What an engine may need to start: the policy and its tokenizer, the training prompts (their longest
    sizes the engine's context), the response length, the rows per generation, the device, the run's
    options and folder, how generation runs here (autocast, ranks in step) and the run's log."""

    policy: torch.nn.Module
    tokenizer: object
    prompts: list[str]
    response_length: int
    rows: int
    device: torch.device
    cfg: object  # TrainerConfig
    output_dir: Path
    autocast: Callable
    synced_gpus: bool
    log: Callable[[str], None]


def autocast(device: torch.device, bf16: bool):
    """Generation's (and the run's) autocast: bf16 on CUDA with ``--bf16``, else none."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and bf16 else contextlib.nullcontext()


def start(name: str, setup: EngineSetup) -> Engine:
    """The engine ``name`` (``--rollout-engine``), started from its registry entry's module."""
    engine = importlib.import_module(ROLLOUT_ENGINES[name].module).start(setup)
    assert isinstance(engine, Engine) and engine.info is ROLLOUT_ENGINES[name], f"{name}: not an Engine"
    return engine


def engine_keywords(
    cfg, *, own: dict, known: Callable[[str], bool], build: Callable[[dict], object], kind: str
) -> dict:
    """``--repetition-penalty`` and ``--generation-kwargs`` as an engine's sampling keywords, checked before
    the run starts: a keyword the trainer sets (``own``: it and the option that sets it, or None) or one
    the engine does not know (``known``; ``kind`` names what it takes) is refused naming the option, and
    ``build(keywords)`` (the engine's own check) raising ``TypeError``/``ValueError`` is too."""
    from .config import ConfigError

    extra = cfg.generation_kwargs_dict()
    where = "invalid config: generation_kwargs (--generation-kwargs)"
    for key in extra:
        if key in own:
            raise ConfigError(f"{where} sets {key}, which the trainer sets" + (f": use {own[key]}" if own[key] else ""))
        if not known(key):
            raise ConfigError(f"{where}: {key} is not {kind}")
    try:
        build(extra)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from None
    return {"repetition_penalty": cfg.repetition_penalty, **extra} if cfg.repetition_penalty != 1.0 else extra
