"""What the reference implementations share: the common compute dtype and the masking rule."""

from __future__ import annotations

import torch

from ..._dtypes import result_dtype

DEVICES = frozenset({"cpu", "cuda"})  # plain PyTorch runs everywhere

# Rows per chunk in token_logprobs: at most this many float32 logits live at once,
# so a bf16 [N, V] input never gets a float32 [N, V] copy.
CHUNK_ELEMENTS = 1 << 24


def in_common_dtype(*inputs: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The inputs in their common compute dtype (one dtype for all, so mixed float32 and
    float64 inputs are all computed in float64)."""
    dtype = result_dtype(*inputs)
    return [None if x is None else x.to(dtype) for x in inputs]


def masked_inputs(mask: torch.Tensor, *inputs: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The inputs in their common compute dtype with 0 at masked positions: whatever a
    masked position holds (NaN, inf) reaches no result and no gradient."""
    return [None if x is None else torch.where(mask, x, 0.0) for x in in_common_dtype(*inputs)]


def clamp(x: torch.Tensor, low: float | None = None, high: float | None = None) -> torch.Tensor:
    """``torch.clamp`` whose gradient passes on the closed range ``[low, high]``, the rule of every
    backend (the native kernels' ``clamp_grad``); torch 2.14 passes none at a scalar bound.  A
    ratio exactly on a clip bound is then inside the bounds: it gets the unclipped derivative,
    where the surrogate is smooth (the lower bound with A > 0) and where it has a kink alike."""
    clamped = torch.clamp(x, low, high)
    return torch.where(clamped == x, x, clamped.detach())  # NaN: clamped != x, no gradient
