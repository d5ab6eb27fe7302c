"""Test setup: Triton kernels run on the CPU through the interpreter unless a GPU is present."""

import os
import zlib

import torch

# Must be set before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """A fresh but reproducible seed per test (printed on failure through the test id)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield
