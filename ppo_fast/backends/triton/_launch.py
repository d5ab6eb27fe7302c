"""What every launcher shares: the device guard and the shape/stride helpers for small inputs.

Launchers never sync with the host (no ``.item()``, no ``bool()`` of a tensor): they
read only shapes, strides, dtypes and devices, so they are safe under CUDA graphs and
``torch.compile``.  Every kernel takes the strides of every input it reads, so sliced,
transposed and expanded (stride-0) inputs are read in place; the kernels compute
addresses in int64 (a stride passed as a Python int reaches a kernel as int32 when it
fits, so the kernels widen their indices before multiplying).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

# Where the Triton kernels run: CUDA tensors, and CPU tensors under the interpreter (tests).
DEVICES = frozenset({"cuda", "cpu"} if os.environ.get("TRITON_INTERPRET") == "1" else {"cuda"})


def device_guard(x: torch.Tensor):
    """A context making ``x``'s CUDA device current (Triton launches on the current
    device), so that tensors on ``cuda:1`` work while device 0 is current."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_shape(name: str, x: torch.Tensor | None, shape) -> None:
    """Shapes are checked in every launcher (no host sync): a wrong one would read out of bounds."""
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, cols]`` tensor: a view with ``x``'s own strides when one
    exists (any 2-D tensor, an expanded one included), else a copy (the inputs this is
    used for are ``[B, T]``-sized, never ``[N, V]``)."""
    if x.dim() == 2:
        return x
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.unsqueeze(0)
    return x.reshape(-1, x.shape[-1])


def lead_view(name: str, x: torch.Tensor, lead_shape: tuple[int, ...]) -> tuple[torch.Tensor, int, int]:
    """``x`` (``[N]``-sized: labels or a per-row gradient) with the logits' leading shape
    ``(N,)`` or ``(B, T)``, and its ``(outer, inner)`` strides (inner 0 for ``(N,)``).

    A view when one exists (strided and expanded inputs included), else a copy of ``N`` elements.
    """
    if x.numel() != math.prod(lead_shape):
        raise ValueError(
            f"{name} must have {math.prod(lead_shape)} elements (the logits' rows), got shape {tuple(x.shape)}"
        )
    x = x.reshape(lead_shape)
    return (x, x.stride(0), 0) if len(lead_shape) == 1 else (x, x.stride(0), x.stride(1))


def is_non_overlapping_and_dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements occupy distinct addresses filling a contiguous block (any
    dim order): then writing a result of ``x``'s shape into it in place is safe.
    False for expanded (stride-0) or otherwise overlapping tensors and for slices with gaps."""
    dims = sorted((stride, size) for size, stride in zip(x.shape, x.stride()) if size != 1)
    if any(size == 0 for _, size in dims):
        return True
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def not_differentiable(ctx, **indices: int) -> None:
    """Raise for a tensor input that requires grad although the op has no gradient for it
    (returning None for it would silently drop that gradient)."""
    for name, index in indices.items():
        if ctx.needs_input_grad[index]:
            raise RuntimeError(f"the Triton backend is not differentiable w.r.t. {name} (as the reference is not)")
