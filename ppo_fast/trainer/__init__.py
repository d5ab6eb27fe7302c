"""A complete PPO trainer for causal LMs built on the ppo_fast ops (``ppo-fast train``).

The names below are imported on first use, so that ``ppo_fast.trainer.config`` (the
options, read by ``ppo-fast --help``) loads without transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TrainerConfig": "config",
    "ConfigError": "config",
    "NonFiniteError": "scoring",
    "RewardError": "scoring",
    "PPOTrainer": "trainer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
