"""The dtypes a kernel computes and writes in, following ``ppo_fast.reference``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import result_dtype  # noqa: F401  (re-exported for the launchers)


def compute_dtype(dtype: torch.dtype):
    """The Triton compute type for a result dtype."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@triton.jit
def cast_for_store(x, ptr):
    """``x`` in ``ptr``'s element type, through float32 unless that is float64
    (the Triton interpreter converts float64 -> bfloat16 wrongly)."""
    if ptr.dtype.element_ty != tl.float64:
        x = x.to(tl.float32)
    return x.to(ptr.dtype.element_ty)
