"""Native GAE: fake kernels (its autograd, to every order, is csrc/autograd/gae.cpp)."""

from __future__ import annotations

import torch

from ..._dtypes import result_dtype
from ._common import (
    check_cu_seqlens,
    check_dim,
    check_dtype_arg,
    check_float,
    check_mask,
    check_same_device,
    check_shape,
    direct,
    grad_or_empty,
    register,
)

SUPPORTED = {"gae": {"cpu"}}


def _fake_gae(rewards, values, mask, gamma, lam):
    op = "gae"
    check_float(op, "rewards", rewards)
    check_dim(op, "rewards", rewards, 2)
    check_float(op, "values", values)
    check_shape(op, "values", values, rewards.shape, "rewards")
    check_mask(op, mask, "rewards", rewards)
    check_same_device(op, rewards=rewards, values=values, mask=mask)
    dtype = result_dtype(rewards, values)
    return rewards.new_empty(rewards.shape, dtype=dtype), rewards.new_empty(rewards.shape, dtype=dtype)


def _fake_gae_backward(grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype, values_dtype, output_mask):
    op = "gae_backward"
    torch._check(mask.dtype == torch.bool, lambda: f"{op}: mask must be a bool tensor, got {mask.dtype}")
    check_dim(op, "mask", mask, 2)
    check_dtype_arg(op, "rewards_dtype", rewards_dtype)
    check_dtype_arg(op, "values_dtype", values_dtype)
    for name, grad in (("grad_advantages", grad_advantages), ("grad_returns", grad_returns)):
        if grad is not None:
            check_float(op, name, grad)
            check_shape(op, name, grad, mask.shape, "mask")
            check_same_device(op, mask=mask, **{name: grad})
    return grad_or_empty(mask, output_mask[0], rewards_dtype), grad_or_empty(mask, output_mask[1], values_dtype)


register("gae", _fake_gae)
register("gae_backward", _fake_gae_backward)


def gae(rewards, values, mask, gamma: float, lam: float):
    return torch.ops.ppo_fast.gae.default(rewards, values, mask, gamma, lam)


direct(gae, "gae")


# --------------------------------------------------------------------------- the packed layout
# gae_varlen (csrc/gae.cpp): the scans per cu_seqlens segment of packed [N] tokens.


def _fake_gae_varlen(rewards, values, mask, cu_seqlens, gamma, lam):
    op = "gae_varlen"
    check_float(op, "rewards", rewards)
    check_dim(op, "rewards", rewards, 1)
    check_float(op, "values", values)
    check_shape(op, "values", values, rewards.shape, "rewards")
    check_mask(op, mask, "rewards", rewards)
    check_cu_seqlens(op, cu_seqlens)
    check_same_device(op, rewards=rewards, values=values, mask=mask, cu_seqlens=cu_seqlens)
    dtype = result_dtype(rewards, values)
    return rewards.new_empty(rewards.shape, dtype=dtype), rewards.new_empty(rewards.shape, dtype=dtype)


def _fake_gae_varlen_backward(
    grad_advantages, grad_returns, mask, cu_seqlens, gamma, lam, rewards_dtype, values_dtype, output_mask
):
    op = "gae_varlen_backward"
    check_dim(op, "mask", mask, 1)
    check_cu_seqlens(op, cu_seqlens)
    grads = {"grad_advantages": grad_advantages, "grad_returns": grad_returns}
    check_same_device(op, mask=mask, cu_seqlens=cu_seqlens, **{k: g for k, g in grads.items() if g is not None})
    check_dtype_arg(op, "rewards_dtype", rewards_dtype)
    check_dtype_arg(op, "values_dtype", values_dtype)
    return grad_or_empty(mask, output_mask[0], rewards_dtype), grad_or_empty(mask, output_mask[1], values_dtype)


register("gae_varlen", _fake_gae_varlen)  # autograd: csrc/autograd/gae.cpp
register("gae_varlen_backward", _fake_gae_varlen_backward)
