"""What the native backend's op modules share: the extension, its availability, the metadata
checks of csrc/common/checks.h for the fake kernels, and the fake/autograd registration."""

from __future__ import annotations

import torch

try:
    from ... import _C
except ImportError as err:  # not built, or built against another torch
    _C = None
    IMPORT_ERROR = f"{type(err).__name__}: {err}"


def built_with_cuda() -> bool:
    """Whether the loaded extension has the CUDA loss kernels compiled in."""
    return _C is not None and _C.built_with_cuda()


def cuda_archs() -> list[str]:
    """The CUDA architectures the loaded build holds code for (``["sm_80", "sm_90", "sm_100",
    "compute_100"]``: compute_* is PTX, which the driver compiles for newer GPUs); [] without
    CUDA kernels.  From TORCH_CUDA_ARCH_LIST as setup.py's ``arch_token`` wrote it."""
    token = _C.cuda_archs() if built_with_cuda() else ""
    archs: list[str] = []
    for entry in token.split("_") if token else []:
        if entry == "PTX" and archs:
            archs.append("compute_" + archs[-1].removeprefix("sm_"))
        else:
            archs.append("sm_" + entry if entry[:1].isdigit() else entry)
    return archs


LOSS_DEVICES = {"cpu", "cuda"} if built_with_cuda() else {"cpu"}


def availability() -> tuple[bool, str]:
    if _C is None:
        return (
            False,
            f"ppo_fast._C could not be imported ({IMPORT_ERROR}); build it with `python setup.py build_ext --inplace`",
        )
    kernels = "C++ CPU kernels" + (
        f" and CUDA loss kernels ({', '.join(cuda_archs())})" if built_with_cuda() else " (built without CUDA)"
    )
    return True, kernels


# --------------------------------------------------------------------------- shared pieces

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# The checks of csrc/common/checks.h on metadata, for the fake kernels: under torch.compile a
# mismatch fails at trace time with the C++ kernels' message (RuntimeError).
def check_float(op, name, x):
    torch._check(
        x.dtype in FLOATS, lambda: f"{op}: {name} must be float32, float64, float16 or bfloat16, got {x.dtype}"
    )


def check_dtype_arg(op, name, dtype):
    torch._check(dtype in FLOATS, lambda: f"{op}: {name} must be a floating dtype, got {dtype}")


def check_dim(op, name, x, dim):
    torch._check(x.dim() == dim, lambda: f"{op}: {name} must be {dim}-D, got shape {list(x.shape)}")


def check_shape(op, name, x, shape, shape_name=None):
    what = f"the shape of {shape_name} {list(shape)}" if shape_name else f"shape {list(shape)}"
    message = lambda: f"{op}: {name} must have {what}, got {list(x.shape)}"  # noqa: E731
    torch._check(x.dim() == len(shape), message)
    for size, expected in zip(x.shape, shape):
        torch._check(size == expected, message)


def check_mask(op, mask, ref_name, ref):
    torch._check(mask.dtype == torch.bool, lambda: f"{op}: mask must be a bool tensor, got {mask.dtype}")
    check_shape(op, "mask", mask, ref.shape, ref_name)


def check_cu_seqlens(op, cu_seqlens):
    """What a fake kernel can see of ``cu_seqlens`` (its values are checked by the C++ kernel)."""
    torch._check(
        cu_seqlens.dtype in (torch.int32, torch.int64),
        lambda: f"{op}: cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}",
    )
    torch._check(
        cu_seqlens.dim() == 1, lambda: f"{op}: cu_seqlens must be 1-D [S + 1], got shape {list(cu_seqlens.shape)}"
    )


def check_same_device(op, **tensors):
    (first_name, first), *rest = tensors.items()
    for name, x in rest:
        torch._check(
            x.device == first.device,
            lambda name=name, x=x: (
                f"{op}: {name} is on {x.device} but {first_name} is on {first.device}; all inputs must be on one device"
            ),
        )


def check_choice(op, name, value, choices):
    valid = ", ".join(f"'{c}'" for c in choices)
    torch._check(value in choices, lambda: f"{op}: {name} must be one of {valid}, got '{value}'")


def grad_or_empty(x, wanted, dtype=None):
    """The fake of a backward op's output: x's shape (contiguous) when wanted, else empty."""
    dtype = x.dtype if dtype is None else dtype
    return x.new_empty(x.shape if wanted else (0,), dtype=dtype)


def needed_grads(grads, needed):
    """A backward op's outputs as autograd wants them: None where no gradient was asked for."""
    return tuple(g if need else None for g, need in zip(grads, needed))


def direct(fn, name: str):
    """``fn`` with ``direct``: the operator ``ppo_fast::<name>``, which a public op may call with
    its positional arguments instead of ``fn`` after no checks of its own (``backends.direct_op``):
    its C++ kernel refuses every input the public op's checks refuse (tests/test_direct_ops.py)."""
    if _C is not None:
        fn.direct = getattr(torch.ops.ppo_fast, name).default
    return fn


# Every torch.ops.ppo_fast operator the modules register (forward and backward ops), for the tests.
REGISTERED: list[str] = []


def cpp_autograd(name) -> bool:
    """Whether ``ppo_fast::<name>`` has its autograd kernel in C++ (``csrc/autograd/<op>.cpp``)."""
    # A C++ kernel is unboxed; torch.library's Python autograd kernel is boxed only.
    dump = torch._C._dispatch_dump(f"ppo_fast::{name}").splitlines()
    return any(line.startswith("Autograd[alias]:") and "unboxed" in line for line in dump)


def register(name, fake, backward=None, setup_context=None):
    """The fake kernel and, for an op whose autograd is not in C++ (``csrc/autograd/<op>.cpp``,
    where most ops' is: a Python autograd kernel costs tens of microseconds a call), its Python
    autograd.  A backward op registered without a backward of its own raises when differentiated
    (a second-order gradient, ``create_graph=True``), as the Triton backend's ops do: without an
    autograd kernel torch would treat its outputs as constants and return a silent zero or None."""
    REGISTERED.append(name)
    if _C is None:
        return
    torch.library.register_fake(f"ppo_fast::{name}", fake)
    if cpp_autograd(name):
        assert backward is None, f"ppo_fast::{name} has its autograd in C++ and in Python"
        return
    if backward is None and name.endswith("_backward"):
        backward = no_double_backward(name)
    if backward is not None:
        torch.library.register_autograd(f"ppo_fast::{name}", backward, setup_context=setup_context)


def no_double_backward(name):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"ppo_fast::{name} has no gradient: second-order gradients (create_graph=True) through "
            f"{name.removesuffix('_backward')} are not supported on the native backend; use "
            "pf.use_backend('reference') for them"
        )

    return backward
