"""Native KL estimate and KL-penalized rewards: fake kernels (their autograd is csrc/autograd/kl_penalized_rewards.cpp)."""

from __future__ import annotations

import torch

from ..._dtypes import result_dtype
from ...spec import KL_ESTIMATORS
from ._common import (
    check_choice,
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

SUPPORTED = {"kl_estimate": {"cpu"}, "kl_penalized_rewards": {"cpu"}}


def _check_kl_inputs(op, logprobs, ref_logprobs, kl_estimator):
    check_float(op, "logprobs", logprobs)
    check_float(op, "ref_logprobs", ref_logprobs)
    check_shape(op, "ref_logprobs", ref_logprobs, logprobs.shape, "logprobs")
    check_same_device(op, logprobs=logprobs, ref_logprobs=ref_logprobs)
    check_choice(op, "kl_estimator", kl_estimator, KL_ESTIMATORS)


def _fake_kl_estimate(logprobs, ref_logprobs, kl_estimator):
    _check_kl_inputs("kl_estimate", logprobs, ref_logprobs, kl_estimator)
    return logprobs.new_empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs))


def _fake_kl_estimate_backward(grad_kl, logprobs, ref_logprobs, kl_estimator, output_mask):
    op = "kl_estimate_backward"
    _check_kl_inputs(op, logprobs, ref_logprobs, kl_estimator)
    check_float(op, "grad_kl", grad_kl)
    check_shape(op, "grad_kl", grad_kl, logprobs.shape, "logprobs")
    check_same_device(op, logprobs=logprobs, grad_kl=grad_kl)
    return grad_or_empty(logprobs, output_mask[0]), grad_or_empty(ref_logprobs, output_mask[1])


register("kl_estimate", _fake_kl_estimate)
register("kl_estimate_backward", _fake_kl_estimate_backward)


def kl_estimate(logprobs, ref_logprobs, kl_estimator: str):
    return torch.ops.ppo_fast.kl_estimate.default(logprobs, ref_logprobs, kl_estimator)


direct(kl_estimate, "kl_estimate")


# --------------------------------------------------------------------------- kl_penalized_rewards


def _check_penalized_inputs(op, logprobs, ref_logprobs, mask, kl_estimator):
    check_float(op, "logprobs", logprobs)
    check_dim(op, "logprobs", logprobs, 2)
    check_float(op, "ref_logprobs", ref_logprobs)
    check_shape(op, "ref_logprobs", ref_logprobs, logprobs.shape, "logprobs")
    check_mask(op, mask, "logprobs", logprobs)
    check_same_device(op, logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    check_choice(op, "kl_estimator", kl_estimator, KL_ESTIMATORS)


def _fake_kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator):
    op = "kl_penalized_rewards"
    _check_penalized_inputs(op, logprobs, ref_logprobs, mask, kl_estimator)
    check_float(op, "scores", scores)
    check_shape(op, "scores", scores, logprobs.shape[:1])
    check_same_device(op, logprobs=logprobs, scores=scores)
    dtype = result_dtype(logprobs, ref_logprobs)
    return logprobs.new_empty(logprobs.shape, dtype=dtype), logprobs.new_empty(logprobs.shape, dtype=dtype)


def _fake_kl_penalized_rewards_backward(
    grad_rewards, grad_kl, logprobs, ref_logprobs, mask, kl_coef, kl_estimator, scores_dtype, output_mask
):
    op = "kl_penalized_rewards_backward"
    _check_penalized_inputs(op, logprobs, ref_logprobs, mask, kl_estimator)
    check_dtype_arg(op, "scores_dtype", scores_dtype)
    for name, grad in (("grad_rewards", grad_rewards), ("grad_kl", grad_kl)):
        if grad is not None:
            check_float(op, name, grad)
            check_shape(op, name, grad, logprobs.shape, "logprobs")
            check_same_device(op, logprobs=logprobs, **{name: grad})
    grad_scores = logprobs.new_empty(logprobs.shape[:1] if output_mask[0] else (0,), dtype=scores_dtype)
    return grad_scores, grad_or_empty(logprobs, output_mask[1]), grad_or_empty(ref_logprobs, output_mask[2])


register("kl_penalized_rewards", _fake_kl_penalized_rewards)
register("kl_penalized_rewards_backward", _fake_kl_penalized_rewards_backward)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, kl_estimator: str):
    return torch.ops.ppo_fast.kl_penalized_rewards.default(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator)


direct(kl_penalized_rewards, "kl_penalized_rewards")
