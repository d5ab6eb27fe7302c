"""The ``native`` backend: the C++/CUDA extension ``ppo_fast._C``.

The extension registers the operators ``torch.ops.ppo_fast.*`` (schemas in
``csrc/ops.cpp``; C++ CPU kernels for every op, CUDA kernels for the losses when the
build had CUDA).  This module adds what torch needs around them -- fake kernels (for
``torch.compile`` and meta tensors) and autograd formulas that call the backward
operators -- and exposes one function per op with the reference's signature.
"""

from __future__ import annotations

import torch

from ..reference import AGG_MODES, KL_ESTIMATORS, result_dtype

try:
    from .. import _C
except ImportError as err:  # not built, or built against another torch
    _C = None
    _IMPORT_ERROR = f"{type(err).__name__}: {err}"


def built_with_cuda() -> bool:
    """Whether the loaded extension has the CUDA loss kernels compiled in."""
    return _C is not None and _C.built_with_cuda()


_LOSS_DEVICES = {"cpu", "cuda"} if built_with_cuda() else {"cpu"}
SUPPORTED = {
    "clipped_policy_loss": _LOSS_DEVICES,
    "value_loss": _LOSS_DEVICES,
    "gae": {"cpu"},
    "kl_estimate": {"cpu"},
    "kl_penalized_rewards": {"cpu"},
    "token_logprobs": {"cpu"},
}


def availability() -> tuple[bool, str]:
    if _C is None:
        return False, f"ppo_fast._C could not be imported ({_IMPORT_ERROR}); build it with `python setup.py build_ext --inplace`"
    kernels = "C++ CPU kernels" + (" and CUDA loss kernels" if built_with_cuda() else " (built without CUDA)")
    return True, kernels


# --------------------------------------------------------------------------- fake kernels


def _fake_clipped_policy_loss(logprobs, old_logprobs, advantages, mask, weights, clip_low, clip_high, dual_clip, agg):
    dtype = result_dtype(logprobs, old_logprobs, advantages, weights)
    # As in the reference, the clip fractions are float32 and approx_kl has the compute dtype.
    loss, clipfrac, clipfrac_lower, approx_kl = (logprobs.new_empty((), dtype=d) for d in (dtype, torch.float32, torch.float32, dtype))
    return loss, clipfrac, clipfrac_lower, approx_kl, logprobs.new_empty((logprobs.shape[0],), dtype=dtype)


def _fake_clipped_policy_loss_backward(grad_loss, logprobs, *rest):
    return torch.empty_like(logprobs, memory_format=torch.contiguous_format)


def _fake_value_loss(values, old_values, returns, mask, clip, agg):
    dtype = result_dtype(values, old_values, returns)
    return values.new_empty((), dtype=dtype), values.new_empty((), dtype=torch.float32), values.new_empty((values.shape[0],), dtype=dtype)


def _fake_value_loss_backward(grad_loss, values, *rest):
    return torch.empty_like(values, memory_format=torch.contiguous_format)


def _fake_kl_estimate(logprobs, ref_logprobs, estimator):
    return logprobs.new_empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs))


def _fake_kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, estimator):
    dtype = result_dtype(logprobs, ref_logprobs)
    return logprobs.new_empty(logprobs.shape, dtype=dtype), logprobs.new_empty(logprobs.shape, dtype=dtype)


def _fake_gae(rewards, values, mask, gamma, lam):
    dtype = result_dtype(rewards, values)
    return rewards.new_empty(rewards.shape, dtype=dtype), rewards.new_empty(rewards.shape, dtype=dtype)


def _fake_token_logprobs(logits, labels, temperature, return_entropy, ignore_index):
    dtype = result_dtype(logits)
    entropy = logits.new_empty(labels.shape if return_entropy else (0,), dtype=dtype)
    return logits.new_empty(labels.shape, dtype=dtype), entropy, logits.new_empty(labels.shape, dtype=dtype)


def _fake_token_logprobs_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
    return logits.new_empty(logits.shape)


# --------------------------------------------------------------------------- autograd


def _setup_policy(ctx, inputs, output):
    logprobs, old_logprobs, advantages, mask, weights, clip_low, clip_high, dual_clip, _agg = inputs
    ctx.save_for_backward(logprobs, old_logprobs, advantages, mask, weights, output[4])
    ctx.clip = (clip_low, clip_high, dual_clip)


def _backward_policy(ctx, grad_loss, *_stats_grads):
    logprobs, old_logprobs, advantages, mask, weights, row_scale = ctx.saved_tensors
    grad = torch.ops.ppo_fast.clipped_policy_loss_backward(
        grad_loss, logprobs, old_logprobs, advantages, mask, weights, row_scale, *ctx.clip
    )
    return (grad,) + (None,) * 8


def _setup_value(ctx, inputs, output):
    values, old_values, returns, mask, clip, _agg = inputs
    ctx.save_for_backward(values, old_values, returns, mask, output[2])
    ctx.clip = clip


def _backward_value(ctx, grad_loss, *_stats_grads):
    values, old_values, returns, mask, row_scale = ctx.saved_tensors
    grad = torch.ops.ppo_fast.value_loss_backward(grad_loss, values, old_values, returns, mask, row_scale, ctx.clip)
    return (grad,) + (None,) * 5


def _setup_logprobs(ctx, inputs, output):
    logits, labels, temperature, return_entropy, ignore_index = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(logits, labels, lse, entropy)
    ctx.args = (temperature, ignore_index)
    ctx.return_entropy = return_entropy


def _backward_logprobs(ctx, grad_logprobs, grad_entropy, _grad_lse):
    logits, labels, lse, entropy = ctx.saved_tensors
    grad_entropy = grad_entropy if ctx.return_entropy else None
    grad = torch.ops.ppo_fast.token_logprobs_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy, *ctx.args)
    return grad, None, None, None, None


def _register() -> None:
    fakes = {
        "clipped_policy_loss": _fake_clipped_policy_loss,
        "clipped_policy_loss_backward": _fake_clipped_policy_loss_backward,
        "value_loss": _fake_value_loss,
        "value_loss_backward": _fake_value_loss_backward,
        "kl_estimate": _fake_kl_estimate,
        "kl_penalized_rewards": _fake_kl_penalized_rewards,
        "gae": _fake_gae,
        "token_logprobs": _fake_token_logprobs,
        "token_logprobs_backward": _fake_token_logprobs_backward,
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"ppo_fast::{name}", fake)
    torch.library.register_autograd("ppo_fast::clipped_policy_loss", _backward_policy, setup_context=_setup_policy)
    torch.library.register_autograd("ppo_fast::value_loss", _backward_value, setup_context=_setup_value)
    torch.library.register_autograd("ppo_fast::token_logprobs", _backward_logprobs, setup_context=_setup_logprobs)


if _C is not None:
    _register()


# --------------------------------------------------------------------------- the ops (reference signatures)


def token_logprobs(logits, labels, temperature: float, return_entropy: bool, ignore_index: int, inplace_backward: bool = False):
    # inplace_backward is a memory hint this backend does not take: its backward allocates the gradient.
    logp, entropy, _lse = torch.ops.ppo_fast.token_logprobs(logits, labels, temperature, return_entropy, ignore_index)
    return logp, (entropy if return_entropy else None)


def kl_estimate(logprobs, ref_logprobs, estimator: str):
    return torch.ops.ppo_fast.kl_estimate(logprobs, ref_logprobs, KL_ESTIMATORS.index(estimator))


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, estimator: str):
    return torch.ops.ppo_fast.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, KL_ESTIMATORS.index(estimator))


def gae(rewards, values, mask, gamma: float, lam: float):
    return torch.ops.ppo_fast.gae(rewards, values, mask, gamma, lam)


def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, weights, clip_low: float, clip_high: float, dual_clip, agg: str):
    loss, clipfrac, clipfrac_lower, approx_kl, _row_scale = torch.ops.ppo_fast.clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, weights, clip_low, clip_high, dual_clip, AGG_MODES.index(agg)
    )
    return loss, clipfrac.detach(), clipfrac_lower.detach(), approx_kl.detach()


def value_loss(values, old_values, returns, mask, clip: float, agg: str):
    loss, clipfrac, _row_scale = torch.ops.ppo_fast.value_loss(values, old_values, returns, mask, clip, AGG_MODES.index(agg))
    return loss, clipfrac.detach()
