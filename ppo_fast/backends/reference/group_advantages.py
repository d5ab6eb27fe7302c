"""Reference group_sum: the one reduction of the group advantage methods."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import DEVICES, in_common_dtype

SUPPORTED = {"group_sum": DEVICES}


def group_sum(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of ``values [B, C]`` replaced by the sum of the rows of its group
    (``group_index [B]`` int64 in ``[0, B)``): the group advantages' one reduction.  Linear
    and symmetric, so its gradient is itself applied to the output's gradient."""
    (values,) = in_common_dtype(values)
    return values.new_zeros(values.shape).index_add(0, group_index, values)[group_index]
