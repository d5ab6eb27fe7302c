"""Input checks shared by the public ops.  Errors name the argument and what was expected."""

from __future__ import annotations

import functools
from numbers import Real

import torch

from .spec import real_in_range

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


INT64_RANGE = (-(2**63), 2**63 - 1)


def host_checks_free(*tensors) -> bool:
    """Whether checks that read tensor values can run on the host at no cost: eager mode and
    CPU tensors only.  On CUDA such a check would synchronise the host with the device on
    every call, and under torch.compile it would break the graph, so there the kernels'
    documented results for bad values apply instead (``ppo_fast.spec``)."""
    if torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" for t in tensors if isinstance(t, torch.Tensor))


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
            raise ValueError(
                f"{name} must have the shape of {reference_name} {tuple(reference.shape)}, got {tuple(x.shape)}"
            )


def required(**values) -> None:
    """Arguments that may not be None (a None would otherwise fail later, deep inside a backend)."""
    for name, value in values.items():
        if value is None:
            raise TypeError(f"{name} must be a torch.Tensor, got None")


def same_device(**tensors) -> None:
    """All tensors among the arguments on one device (others, e.g. a None weight or a
    mask of the wrong type, are left to their own checks)."""
    items = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor)]
    if not items:
        return
    first_name, first = items[0]
    for name, x in items[1:]:
        if x.device != first.device:
            raise ValueError(
                f"{name} is on {x.device} but {first_name} is on {first.device}; all inputs must be on one device"
            )


def mask(name: str, m, shape: torch.Size) -> torch.Tensor:
    """A bool mask of ``shape``; float/int masks must hold only 0 and 1."""
    m = tensor(name, m, dtypes=(torch.bool,) + FLOAT_DTYPES + INT_DTYPES)
    if m.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(m.shape)}")
    if m.dtype == torch.bool:
        return m
    if m.numel() and m.device.type != "meta":
        if host_checks_free(m):
            native = _native_bool_mask()
            if native is not None:  # one pass, on this thread for small masks (ValueError if not 0/1)
                return native(m, name)
            as_bool = m != 0
            if not torch.equal(as_bool.to(m.dtype), m):  # the conversion back: NaN, 0.5 fail it
                raise ValueError(f"{name} must hold only 0 and 1 (or be bool)")
            return as_bool
        # checked on the device, without a host sync
        torch._assert_async(((m == 0) | (m == 1)).all(), f"{name} must hold only 0 and 1 (or be bool)")
    return m != 0


@functools.cache
def _native_bool_mask():
    """``torch.ops.ppo_fast.bool_mask`` when the native extension is loaded, else None."""
    try:
        return torch.ops.ppo_fast.bool_mask
    except (AttributeError, RuntimeError):
        return None


def labels_in_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """``ValueError`` naming a label that lies neither in [0, vocab) nor at ignore_index."""
    bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
    if bool(bad.any()):
        raise ValueError(
            f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; got {labels[bad][0].item()}"
        )


def real(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite Python float within [low, high] (open ends where asked) and within float32's
    range, since the kernels compute in float32."""
    if isinstance(value, bool) or not isinstance(value, (Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    # A symbolic float (torch.compile(dynamic=True)) stays symbolic: the comparisons below
    # become guards, so a value that fails them recompiles and raises here.
    value = value if isinstance(value, (torch.SymFloat, torch.SymInt)) else float(value)
    return real_in_range(name, value, low=low, high=high, low_open=low_open, high_open=high_open)


def choice(name: str, value, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {choices}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def integer(name: str, value, *, low: int = INT64_RANGE[0], high: int = INT64_RANGE[1]) -> int:
    """A Python int within [low, high] (by default int64's range, as the kernels read it)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


_FLOAT_SET = frozenset(FLOAT_DTYPES)


def _plain_loss_inputs(names_and_tensors: dict, loss_mask, optional) -> bool:
    """Whether the inputs pass every check of ``loss_inputs`` as they are (plain 2-D float tensors
    of one shape and device, a bool mask of it): the common call, checked without building the
    messages' arguments (a few microseconds of a loss's host time)."""
    shape = device = None
    for name, x in names_and_tensors.items():
        if x is None:
            if name in optional:
                continue
            return False
        if type(x) is not torch.Tensor or x.dtype not in _FLOAT_SET:
            return False
        if shape is None:
            shape, device = x.shape, x.device
            if len(shape) != 2:
                return False
        elif x.shape != shape or x.device != device:
            return False
    return (
        type(loss_mask) is torch.Tensor
        and loss_mask.dtype is torch.bool
        and loss_mask.shape == shape
        and loss_mask.device == device
    )


def loss_inputs(names_and_tensors: dict, loss_mask, optional=("weights",)):
    """Validates ``[B, T]`` inputs of one shape and device (None only for the ``optional``
    names) and returns the mask as bool."""
    if _plain_loss_inputs(names_and_tensors, loss_mask, optional):
        return loss_mask
    required(**{n: x for n, x in names_and_tensors.items() if n not in optional})
    first_name, first = next(iter(names_and_tensors.items()))
    for name, x in names_and_tensors.items():
        if x is not None:
            tensor(name, x, ndim=2)
    same_shape(first_name, first, **{n: x for n, x in list(names_and_tensors.items())[1:]})
    same_device(**names_and_tensors, mask=loss_mask)
    return mask("mask", loss_mask, first.shape)
