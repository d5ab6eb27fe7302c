"""Input checks shared by the public ops.  Errors name the argument and what was expected."""

from __future__ import annotations

import math
from numbers import Real

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def data_checks_enabled() -> bool:
    """Checks that read tensor values (one host sync) are skipped while tracing for torch.compile."""
    return not torch.compiler.is_compiling()


def tensor(name: str, x, *, dtypes=FLOAT_DTYPES, ndim: int | None = None, min_ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if dtypes is not None and x.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(x.dtype).replace('torch.', '')}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if min_ndim is not None and x.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(x.shape)}")
    return x


def same_shape(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, x in others.items():
        if x is not None and x.shape != reference.shape:
            raise ValueError(f"{name} must have the shape of {reference_name} {tuple(reference.shape)}, got {tuple(x.shape)}")


def same_device(**tensors) -> None:
    """All tensors among the arguments on one device (others, e.g. a None weight or a
    mask of the wrong type, are left to their own checks)."""
    items = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    first_name, first = items[0]
    for name, x in items[1:]:
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device} but {first_name} is on {first.device}; all inputs must be on one device")


def mask(name: str, m, shape: torch.Size) -> torch.Tensor:
    """A bool mask of ``shape``; float/int masks must hold only 0 and 1."""
    m = tensor(name, m, dtypes=(torch.bool,) + FLOAT_DTYPES + INT_DTYPES)
    if m.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(m.shape)}")
    if m.dtype == torch.bool:
        return m
    if data_checks_enabled() and m.numel() and not bool(((m == 0) | (m == 1)).all()):
        raise ValueError(f"{name} must hold only 0 and 1 (or be bool)")
    return m != 0


def real(name: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False) -> float:
    """A finite Python float within [low, high] (open ends where asked)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


def choice(name: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value
