"""Minimal reproducer for upstream Triton: the interpreter (``TRITON_INTERPRET=1``) converts bfloat16
subnormals to float32 wrongly.  A kernel that loads bfloat16 values and stores them as float32 should
copy them exactly (every bfloat16 is a float32); under the interpreter the subnormal ones come out
wrong, while a GPU converts them exactly.  Run: ``python tools/triton_interpreter_bf16_subnormal.py``
(exit status 1 when the bug is present).  Not filed upstream from this project's sessions (no network
access there); the report to file is this script and its output."""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _widen(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, x.to(tl.float32), mask=offs < n)


def main() -> int:
    tiny = torch.finfo(torch.bfloat16).tiny  # the smallest normal bfloat16, 2**-126
    values = [tiny, tiny / 2, tiny / 4, tiny / 128, -tiny / 2, 1.0, -3.5]  # subnormals between the normals
    x = torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)
    out = torch.empty(len(values), dtype=torch.float32)
    _widen[(1,)](x, out, len(values), BLOCK=8)
    want = x.float()
    print(f"triton {triton.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")
    for w, g in zip(want.tolist(), out.tolist()):
        print(f"bfloat16 {w!r:>26} -> float32 {g!r:>26} {'ok' if w == g else 'WRONG'}")
    return 0 if torch.equal(out, want) else 1


if __name__ == "__main__":
    sys.exit(main())
