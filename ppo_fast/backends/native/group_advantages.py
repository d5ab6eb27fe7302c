"""Native group_sum: fake kernel (its autograd, its gradient being itself, is csrc/autograd/group_advantages.cpp)."""

from __future__ import annotations

import torch

from ..._dtypes import result_dtype
from ._common import check_dim, check_same_device, check_shape, register

SUPPORTED = {"group_sum": {"cpu"}}


def _fake_group_sum(values, group_index):
    op = "group_sum"
    torch._check(
        values.dtype in (torch.float32, torch.float64),
        lambda: f"{op}: values must be float32 or float64, got {values.dtype}",
    )
    check_dim(op, "values", values, 2)
    torch._check(group_index.dtype == torch.int64, lambda: f"{op}: group_index must be int64, got {group_index.dtype}")
    check_shape(op, "group_index", group_index, values.shape[:1])
    check_same_device(op, values=values, group_index=group_index)
    return values.new_empty(values.shape)


register("group_sum", _fake_group_sum)


def group_sum(values, group_index):
    return torch.ops.ppo_fast.group_sum.default(values.to(result_dtype(values)), group_index)
