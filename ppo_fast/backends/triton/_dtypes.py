"""The dtypes a kernel computes and writes in, following the reference backend."""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl

from ..._dtypes import result_dtype  # noqa: F401  (re-exported for the launchers)


def compute_dtype(dtype: torch.dtype):
    """The Triton compute type for a result dtype."""
    return tl.float64 if dtype == torch.float64 else tl.float32


# Under the interpreter (TRITON_INTERPRET=1, read when this module is imported) float32 ->
# bfloat16 conversions truncate, where a GPU (and torch) rounds to nearest even.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _bf16_round_to_nearest_even(x):
    """float32 ``x`` to bfloat16, rounding to nearest even by hand (the interpreter only)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))  # a carry into the exponent rounds up to the next binade / inf
    rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), rounded)  # NaN stays NaN (its mantissa must not carry)


@triton.jit
def cast_for_store(x, ptr):
    """``x`` in ``ptr``'s element type, rounded to nearest: through float32 unless that is
    float64 (the interpreter converts float64 -> bfloat16 wrongly), and under the
    interpreter rounding to bfloat16 by hand, so that its results are those of a GPU."""
    if ptr.dtype.element_ty != tl.float64:
        x = x.to(tl.float32)
    if _INTERPRETED and ptr.dtype.element_ty == tl.bfloat16:
        out = _bf16_round_to_nearest_even(x)
    else:
        out = x.to(ptr.dtype.element_ty)
    return out


def split_scalar(x: float) -> tuple[float, float]:
    """A float hyper-parameter as two kernel arguments ``(hi, lo)``: ``hi`` its nearest
    float32, ``lo = x - hi`` (exact in double, and representable in float32 to 2**-24 of
    itself).  A Python float reaches a kernel as float32 (float64 under torch.compile),
    so a float64 kernel rebuilds ``x`` as ``hi + lo`` to ~2**-48 relative; a float32
    kernel uses ``hi`` alone (see :func:`scalar`).  ``x`` must lie within float32's range."""
    hi = struct.unpack("f", struct.pack("f", x))[0]
    return hi, x - hi


@triton.jit
def scalar(hi, lo, ACC: tl.constexpr):
    """The hyper-parameter split by ``split_scalar`` in the compute type."""
    if ACC == tl.float64:
        value = tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        value = tl.cast(hi, ACC)
    return value
