"""The inputs' layouts, one implementation for the conformance matrix (tests/test_conformance.py) and
the fuzzer (tests/test_fuzz.py): contiguous, sliced (every other column of a storage twice as wide,
whose gaps hold NaN or an out-of-range label, so that a kernel reading them is caught), transposed,
expanded (stride 0)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

LAYOUTS = ("contiguous", "sliced", "transposed", "expanded")


def laid_out(values: torch.Tensor, layout: str) -> tuple[torch.Tensor, Callable]:
    """``(leaf, view_of)``: ``view_of(leaf)`` holds ``values`` in ``layout`` (sliced: the gaps hold junk)."""
    if layout == "sliced":  # every other column (row, for 1-D) of a storage twice as wide
        junk = math.nan if values.is_floating_point() else (True if values.dtype == torch.bool else -(2**40))
        view_of = (lambda t: t[:, 1::2]) if values.dim() > 1 else (lambda t: t[1::2])
        shape = (
            (values.shape[0], 2 * values.shape[1], *values.shape[2:]) if values.dim() > 1 else (2 * values.shape[0],)
        )
        wide = torch.full(shape, junk, dtype=values.dtype, device=values.device)
        view_of(wide).copy_(values)
        return wide, view_of
    if layout == "transposed" and values.dim() > 1:
        return values.transpose(0, 1).contiguous(), lambda t: t.transpose(0, 1)
    if layout == "expanded" and values.dim() > 0 and values.shape[0] > 0:
        return values[:1].clone(), lambda t: t.expand(values.shape)
    return values.clone(), lambda t: t
