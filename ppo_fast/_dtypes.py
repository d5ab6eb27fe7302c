"""The result-dtype rule every backend follows (``ppo_fast.spec``'s contract)."""

from __future__ import annotations

import torch


def result_dtype(*inputs: torch.Tensor | None) -> torch.dtype:
    """The dtype every backend computes and returns in: float64 if any input is float64
    (so that gradients can be checked numerically), else float32."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in inputs) else torch.float32
