"""Test setup: Triton kernels run on the CPU through the interpreter unless a GPU is present."""

import os
import zlib

import torch

# Must be set before triton is imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        metavar="N",
        help="tests/test_fuzz.py: N random examples per fuzz test (a nightly budget, e.g. 2000) instead of "
        "the fixed, derandomized CI budget (same as PPO_FAST_FUZZ_EXAMPLES=N)",
    )


def pytest_configure(config):
    examples = config.getoption("--fuzz-examples", default=None)
    if examples:  # read by tests/test_fuzz.py when it is imported (after this hook)
        os.environ["PPO_FAST_FUZZ_EXAMPLES"] = str(examples)


def pytest_collection_modifyitems(config, items):
    """The Triton tests (files named test_triton_*, in any folder: tests/backends/) run on CUDA
    tensors when a GPU is present (else in the interpreter): mark them so that the GPU check
    (bench/gpu_check.sh) selects them with the CUDA tests."""
    for item in items:
        if item.path.name.startswith("test_triton_"):
            item.add_marker(pytest.mark.triton_on_gpu)


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """A fresh but reproducible seed per test (printed on failure through the test id)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield


def pytest_terminal_summary(terminalreporter):
    """One line per reason why tests skipped (no GPU, a peer or vLLM not installed, ...), with its count."""
    reasons: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        terminalreporter.write_sep("-", "why tests skipped")
        for reason, count in sorted(reasons.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f"{count:5d}  {reason}")
