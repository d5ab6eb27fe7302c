"""The Triton backend: per op, its ``@triton.jit`` kernels, launchers and the torch custom op
with its fake kernel and autograd, in ``ppo_fast.backends.triton.<op>``.

Each op is a ``torch.library.custom_op`` (with a fake implementation), so that
``torch.compile(fullgraph=True)`` treats it as one opaque node without graph breaks; a plain eager
call on plain tensors runs the op's same functions under a plain ``autograd.Function`` instead,
without torch.library's Python autograd wrapper (``_eager``).  All are
differentiable as the reference is, to first order, each gradient in its input's dtype; a
tensor input they are not differentiable in (labels, mask) raises in the backward if it
requires grad.  The kernels read any strides, check shapes, run on the inputs' device and
never sync with the host.  Served on CUDA tensors; on CPU tensors only under
``TRITON_INTERPRET=1`` (the interpreter, for tests).
"""

from __future__ import annotations

import torch

from ...spec import MIN_TRITON, older_than
from .. import collect, op_modules
from ._launch import DEVICES


def load_modules() -> tuple:
    """Every op module (importing triton and compiling nothing yet), or ImportError when triton is
    missing, broken or too old."""
    import triton

    if older_than(triton.__version__, MIN_TRITON):  # its language and compiler differ: see docs/building.md
        raise ImportError(f"triton {triton.__version__} is older than {MIN_TRITON}, the oldest supported")
    return op_modules(__name__, __path__)


# Where no kernel can run (no CUDA device, no interpreter), triton and the kernels' modules are not
# imported: a second of every CPU process's start (`ppo-fast generate`) for a backend it cannot use.
_RUNNABLE = "cpu" in DEVICES or torch.cuda.is_available()
MODULES, SUPPORTED, FUNCTIONS, _IMPORT_ERROR = (), {}, {}, None
if _RUNNABLE:
    try:
        MODULES = load_modules()
    except ImportError as err:  # availability() says so
        _IMPORT_ERROR = f"{type(err).__name__}: {err}"
    else:
        SUPPORTED, FUNCTIONS = collect(MODULES)


def availability() -> tuple[bool, str]:
    if not _RUNNABLE:
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU)"
    if not MODULES:
        return False, f"triton cannot be used ({_IMPORT_ERROR})"
    if "cpu" in DEVICES:
        return True, "Triton interpreter (TRITON_INTERPRET=1): CPU tensors, for testing"
    return True, "Triton kernels on CUDA"
