"""group_sum: each row of ``values [B, C]`` replaced by the sum of its group's rows.

The reduction behind the group advantage estimators.  Deterministic without atomics: the
launcher orders the rows by group (a stable sort of the dense ids, done by torch on the
device, no host sync) and one program per group slot sums its rows in that order, in
blocks of ``BLOCK_R`` rows, then writes the total to each of them.  Slots without rows
(dense ids leave them empty) return at once.  ``values`` is read through its strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dtypes import compute_dtype, result_dtype
from ._eager import custom_op, with_autograd
from ._launch import DEVICES, check_same_device, check_shape, device_guard

SUPPORTED = {"group_sum": DEVICES}

BLOCK_R = 128


@triton.jit
def _group_sum_kernel(
    values_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    out_ptr,
    cols,
    values_stride0,
    values_stride1,
    ACC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + slot)
    start = tl.load(starts_ptr + slot)
    col = tl.arange(0, BLOCK_C).to(tl.int64)
    col_ok = col < cols
    total = tl.zeros([BLOCK_C], ACC)
    for block in range(0, tl.cdiv(count, BLOCK_R)):
        k = block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        ok = k < count
        row = tl.load(order_ptr + start + k, mask=ok, other=0)
        both = ok[:, None] & col_ok[None, :]
        v = tl.load(values_ptr + row[:, None] * values_stride0 + col[None, :] * values_stride1, mask=both, other=0.0)
        total += tl.sum(v.to(ACC), axis=0)
    for block in range(0, tl.cdiv(count, BLOCK_R)):
        k = block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        ok = k < count
        row = tl.load(order_ptr + start + k, mask=ok, other=0)
        both = ok[:, None] & col_ok[None, :]
        tl.store(
            out_ptr + row[:, None] * cols + col[None, :],
            (total[None, :] + tl.zeros([BLOCK_R, BLOCK_C], ACC)),
            mask=both,
        )


def group_sum_forward(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """``values [B, C]`` float32/float64, ``group_index [B]`` int64 in ``[0, B)`` -> ``[B, C]``."""
    if values.dim() != 2 or values.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"values must be a 2-D float32 or float64 tensor, got {values.dtype} {tuple(values.shape)}")
    if group_index.dtype != torch.int64:
        raise ValueError(f"group_index must be int64, got {group_index.dtype}")
    check_shape("group_index", group_index, values.shape[:1])
    check_same_device(values=values, group_index=group_index)
    rows, cols = values.shape
    out = torch.empty((rows, cols), dtype=values.dtype, device=values.device)
    if rows == 0 or cols == 0:
        return out
    order = torch.argsort(group_index, stable=True)
    counts = torch.zeros(rows, dtype=torch.int64, device=values.device).index_add_(
        0, group_index, torch.ones_like(group_index)
    )
    starts = counts.cumsum(0) - counts
    with device_guard(values):
        _group_sum_kernel[(rows,)](
            values,
            order,
            starts,
            counts,
            out,
            cols,
            values.stride(0),
            values.stride(1),
            ACC=compute_dtype(values.dtype),
            BLOCK_R=BLOCK_R,
            BLOCK_C=triton.next_power_of_2(cols),
        )
    return out


# --------------------------------------------------------------------------- torch custom op and autograd


@custom_op("ppo_fast_triton::group_sum", mutates_args=())
def _group_sum_op(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    return group_sum_forward(values, group_index)


@_group_sum_op.register_fake
def _(values, group_index):
    return values.new_empty(values.shape)


def _group_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _group_sum_backward(ctx, grad):
    (group_index,) = ctx.saved_tensors
    return _group_sum(grad, group_index), None  # linear and symmetric: its own adjoint


_group_sum = with_autograd(_group_sum_op, _group_sum_backward, _group_sum_setup)


def group_sum(values, group_index):
    return _group_sum(values.to(result_dtype(values)), group_index)


def static_variants(batch: int = 64, group: int = 8) -> list[dict]:
    """This op's kernel launches for ``bench.static`` (sm_90 code compiled without a GPU), on meta tensors.

    One dict per variant: ``name``, ``run`` (calls a launcher), ``budget_key`` and
    ``bytes_per_element`` (None: neither), ``block`` (None: no per-element figure).
    """

    def meta(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    return [
        dict(
            name=f"group_sum {str(dtype).replace('torch.', '')} [{batch}, {group}]",
            budget_key=None,
            bytes_per_element=None,
            run=lambda dtype=dtype: group_sum_forward(meta((batch, group), dtype), meta((batch,), torch.int64)),
            block=None,
        )
        for dtype in (torch.float32, torch.float64)
    ]
