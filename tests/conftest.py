"""Test setup: Triton kernels run on the CPU through the interpreter unless a GPU is present."""

import os

import torch

# Must be set before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """A fresh but reproducible seed per test (printed on failure through the test id)."""
    seed = abs(hash(request.node.nodeid)) % (2**31)
    torch.manual_seed(seed)
    yield
