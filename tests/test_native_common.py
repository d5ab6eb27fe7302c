"""The native backend's registration, and pieces shared by the other test_native_* files
(the skip when the extension is missing, input makers)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ppo_fast.backends import backend_info

NATIVE = backend_info("native")
requires_native = pytest.mark.skipif(not NATIVE.available, reason=f"native backend unavailable: {NATIVE.detail}")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_FLOATS = FLOAT_DTYPES + (torch.float64,)  # float64 is computed in float64 (for gradcheck)


def random_mask(shape, device="cpu"):
    """A random mask with interior holes, one all-masked row and (if there are 3+ rows) one full row."""
    mask = torch.rand(shape, device=device) < 0.7
    mask[0] = False
    if shape[0] > 2:
        mask[2] = True
    return mask


def random_holes_mask(shape, device="cpu"):
    """random_mask plus, in every row with 3+ valid tokens, one interior hole and a
    masked last position (so the last valid token is not the last position)."""
    mask = random_mask(shape, device)
    if shape[1] >= 4:
        mask[1:, shape[1] // 2] = False
        mask[1:, -1] = False
    return mask


def policy_inputs(shape, dtype, device="cpu"):
    """log-probs, old log-probs and advantages of ``dtype``; some log-ratios beyond the +-20 clamp."""
    logprobs = -torch.rand(shape, device=device) * 3
    old = logprobs + 0.4 * torch.randn(shape, device=device)
    far = torch.rand(shape, device=device) < 0.05
    old = torch.where(far, logprobs + 25.0 * torch.sign(torch.randn(shape, device=device)), old)
    advantages = torch.randn(shape, device=device)
    return logprobs.to(dtype), old.to(dtype), advantages.to(dtype)


# --------------------------------------------------------------------------- registration


def grads_of(outputs, inputs, weights):
    """d (sum_k (outputs[k] * weights[k]).sum()) / d inputs, None for an input that gets no gradient."""
    loss = sum((o.double() * w).sum() for o, w in zip(outputs, weights) if o is not None)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def leaves(*tensors):
    """Fresh leaves that require grad (floating tensors) or the tensors themselves."""
    return [t.detach().clone().requires_grad_(True) if t is not None and t.is_floating_point() else t for t in tensors]


@requires_native
def test_cpu_kernels_registered():
    assert NATIVE.module.OPERATORS
    for op in NATIVE.module.OPERATORS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_fast::{op}", "CPU"), op


@requires_native
def test_cuda_kernels_registered_iff_built_with_cuda():
    from ppo_fast.backends import native as native_backend

    built = native_backend.built_with_cuda()
    # Without CUDA no operator has a CUDA kernel; an op served on CUDA has its forward and backward there.
    for operator in native_backend.OPERATORS:
        if not built:
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_fast::{operator}", "CUDA"), operator
    for op, devices in native_backend.SUPPORTED.items():
        for operator in {op, f"{op}_backward"} & set(native_backend.OPERATORS) if "cuda" in devices else ():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ppo_fast::{operator}", "CUDA"), operator
    assert ("cuda" in native_backend.SUPPORTED["clipped_policy_loss"]) == built
    assert native_backend.SUPPORTED["gae"] == {"cpu"}


def test_unavailable_with_the_import_error_when_the_extension_is_missing():
    # A fresh interpreter in which importing ppo_fast._C fails (a None entry in sys.modules).
    script = (
        "import sys; sys.modules['ppo_fast._C'] = None\n"
        "from ppo_fast.backends import backend_info\n"
        "info = backend_info('native'); print(info.available); print(info.detail)\n"
    )
    repo_root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=repo_root)
    available, detail = run.stdout.splitlines()
    assert available == "False"
    assert "ppo_fast._C could not be imported" in detail and "None in sys.modules" in detail
