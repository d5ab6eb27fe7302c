"""The ``native`` backend: the C++/CUDA extension ``ppo_fast._C``.

The extension registers the operators ``torch.ops.ppo_fast.*`` (schemas in
``csrc/ops.cpp``; C++ CPU kernels for every op, CUDA kernels for the losses when the
build had CUDA).  This module adds what torch needs around them, grouped by op: a fake
kernel (for ``torch.compile`` and meta tensors) that checks the shape relations as the
C++ kernels do, the autograd formula that calls the op's backward operator, and one
function per op with the reference's signature.

Every op is differentiable as the reference is: ``token_logprobs`` w.r.t. the logits,
``linear_token_logprobs`` w.r.t. the hidden states, the head's weight and its bias,
``kl_estimate`` w.r.t. both log-probs, ``kl_penalized_rewards`` w.r.t. the scores and
both log-probs, ``gae`` w.r.t. rewards and values, ``clipped_policy_loss`` w.r.t.
logprobs, old_logprobs, advantages and weights, ``value_loss`` w.r.t. values,
old_values and returns.  A backward operator computes only the gradients that autograd
asks for (its ``output_mask``) and returns an empty tensor for the others.

The estimator and ``agg`` names pass straight through to the C++ ops, which parse them.
"""

from __future__ import annotations

import math

import torch

from ..contract import AGG_MODES, KL_ESTIMATORS, result_dtype

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
    "policy_loss_gspo": _LOSS_DEVICES,
    "policy_loss_geo_mean": _LOSS_DEVICES,
    "value_loss": _LOSS_DEVICES,
    "gae": {"cpu"},
    "kl_estimate": {"cpu"},
    "kl_penalized_rewards": {"cpu"},
    "token_logprobs": {"cpu"},
    "linear_token_logprobs": {"cpu"},
    "group_sum": {"cpu"},
}


def availability() -> tuple[bool, str]:
    if _C is None:
        return False, f"ppo_fast._C could not be imported ({_IMPORT_ERROR}); build it with `python setup.py build_ext --inplace`"
    kernels = "C++ CPU kernels" + (" and CUDA loss kernels" if built_with_cuda() else " (built without CUDA)")
    return True, kernels


# --------------------------------------------------------------------------- shared pieces

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# The checks of csrc/checks.h on metadata, for the fake kernels: under torch.compile a
# mismatch fails at trace time with the C++ kernels' message (RuntimeError).
def _check_float(op, name, x):
    torch._check(x.dtype in _FLOATS, lambda: f"{op}: {name} must be float32, float64, float16 or bfloat16, got {x.dtype}")


def _check_dtype_arg(op, name, dtype):
    torch._check(dtype in _FLOATS, lambda: f"{op}: {name} must be a floating dtype, got {dtype}")


def _check_dim(op, name, x, dim):
    torch._check(x.dim() == dim, lambda: f"{op}: {name} must be {dim}-D, got shape {list(x.shape)}")


def _check_shape(op, name, x, shape, shape_name=None):
    what = f"the shape of {shape_name} {list(shape)}" if shape_name else f"shape {list(shape)}"
    message = lambda: f"{op}: {name} must have {what}, got {list(x.shape)}"  # noqa: E731
    torch._check(x.dim() == len(shape), message)
    for size, expected in zip(x.shape, shape):
        torch._check(size == expected, message)


def _check_mask(op, mask, ref_name, ref):
    torch._check(mask.dtype == torch.bool, lambda: f"{op}: mask must be a bool tensor, got {mask.dtype}")
    _check_shape(op, "mask", mask, ref.shape, ref_name)


def _check_same_device(op, **tensors):
    (first_name, first), *rest = tensors.items()
    for name, x in rest:
        torch._check(
            x.device == first.device,
            lambda: f"{op}: {name} is on {x.device} but {first_name} is on {first.device}; all inputs must be on one device",
        )


def _check_choice(op, name, value, choices):
    valid = ", ".join(f"'{c}'" for c in choices)
    torch._check(value in choices, lambda: f"{op}: {name} must be one of {valid}, got '{value}'")


def _grad_or_empty(x, wanted, dtype=None):
    """The fake of a backward op's output: x's shape (contiguous) when wanted, else empty."""
    dtype = x.dtype if dtype is None else dtype
    return x.new_empty(x.shape if wanted else (0,), dtype=dtype)


def _wanted(grads, needed):
    """A backward op's outputs as autograd wants them: None where no gradient was asked for."""
    return tuple(g if need else None for g, need in zip(grads, needed))


def _register(name, fake, backward=None, setup_context=None):
    """The fake kernel and autograd of ``ppo_fast::<name>``.  A backward op registered
    without a backward of its own raises when differentiated (a second-order gradient,
    ``create_graph=True``), as the Triton backend's ops do: without an autograd kernel
    torch would treat its outputs as constants and return a silent zero or None."""
    if _C is None:
        return
    torch.library.register_fake(f"ppo_fast::{name}", fake)
    if backward is None and name.endswith("_backward"):
        backward = _no_double_backward(name)
    if backward is not None:
        torch.library.register_autograd(f"ppo_fast::{name}", backward, setup_context=setup_context)


def _no_double_backward(name):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"ppo_fast::{name} has no gradient: second-order gradients (create_graph=True) through "
            f"{name.removesuffix('_backward')} are not supported on the native backend; use "
            "pf.use_backend('reference') for them"
        )

    return backward


# --------------------------------------------------------------------------- token_logprobs


def _check_logits(op, logits, labels, temperature):
    _check_float(op, "logits", logits)
    torch._check(logits.dim() in (2, 3), lambda: f"{op}: logits must be [N, V] or [B, T, V], got shape {list(logits.shape)}")
    torch._check(
        not labels.dtype.is_floating_point and not labels.dtype.is_complex and labels.dtype != torch.bool,
        lambda: f"{op}: labels must be an integer tensor, got {labels.dtype}",
    )
    _check_shape(op, "labels", labels, logits.shape[:-1], "logits.shape[:-1]")
    _check_same_device(op, logits=logits, labels=labels)
    torch._check(0 < temperature < math.inf, lambda: f"{op}: temperature must be finite and > 0, got {temperature}")


def _fake_token_logprobs(logits, labels, temperature, return_entropy, ignore_index):
    _check_logits("token_logprobs", logits, labels, temperature)
    dtype = result_dtype(logits)
    entropy = logits.new_empty(labels.shape if return_entropy else (0,), dtype=dtype)
    return logits.new_empty(labels.shape, dtype=dtype), entropy, logits.new_empty(labels.shape, dtype=dtype)


def _check_saved_row_stats(op, forward_op, input_name, x, labels, lse, entropy, grad_logprobs, grad_entropy):
    """A log-prob backward's per-row inputs: the forward's lse (and entropy when its gradient
    is given) in the result dtype of ``x``, the incoming gradients, all of ``labels``' shape."""
    dtype = result_dtype(x)
    torch._check(lse.dtype == dtype, lambda: f"{op}: lse must have dtype {dtype} (as {forward_op} returns it), got {lse.dtype}")
    _check_shape(op, "lse", lse, labels.shape, "labels")
    _check_same_device(op, **{input_name: x, "lse": lse})
    for name, grad in (("grad_logprobs", grad_logprobs), ("grad_entropy", grad_entropy)):
        if grad is not None:
            _check_float(op, name, grad)
            _check_shape(op, name, grad, labels.shape, "labels")
            _check_same_device(op, **{input_name: x, name: grad})
    if grad_entropy is not None:
        torch._check(entropy.dtype == dtype, lambda: f"{op}: entropy must have dtype {dtype}, got {entropy.dtype}")
        _check_shape(op, "entropy", entropy, labels.shape, "labels")
        _check_same_device(op, **{input_name: x, "entropy": entropy})


def _fake_token_logprobs_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy, temperature, ignore_index):
    op = "token_logprobs_backward"
    _check_logits(op, logits, labels, temperature)
    _check_saved_row_stats(op, "token_logprobs", "logits", logits, labels, lse, entropy, grad_logprobs, grad_entropy)
    return logits.new_empty(logits.shape)


def _setup_token_logprobs(ctx, inputs, output):
    logits, labels, temperature, return_entropy, ignore_index = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(logits, labels, lse, entropy)
    ctx.args = (temperature, ignore_index)
    ctx.return_entropy = return_entropy
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # an unused output needs no term in the backward


def _backward_token_logprobs(ctx, grad_logprobs, grad_entropy, _grad_lse):
    grad_entropy = grad_entropy if ctx.return_entropy else None
    if grad_logprobs is None and grad_entropy is None:
        return None, None, None, None, None
    logits, labels, lse, entropy = ctx.saved_tensors
    grad = torch.ops.ppo_fast.token_logprobs_backward(grad_logprobs, grad_entropy, logits, labels, lse, entropy, *ctx.args)
    return grad, None, None, None, None


_register("token_logprobs", _fake_token_logprobs, _backward_token_logprobs, _setup_token_logprobs)
_register("token_logprobs_backward", _fake_token_logprobs_backward)


def token_logprobs(logits, labels, temperature: float, return_entropy: bool, ignore_index: int, inplace_backward: bool = False):
    # inplace_backward is a memory hint this backend does not take: its backward allocates the gradient.
    logp, entropy, _lse = torch.ops.ppo_fast.token_logprobs(logits, labels, temperature, return_entropy, ignore_index)
    return logp, (entropy if return_entropy else None)


# --------------------------------------------------------------------------- linear_token_logprobs


def _check_head(op, hidden, weight, labels, bias, temperature, logit_scale, logit_softcap):
    _check_float(op, "hidden", hidden)
    _check_dim(op, "hidden", hidden, 2)
    _check_float(op, "weight", weight)
    _check_dim(op, "weight", weight, 2)
    torch._check(
        weight.shape[1] == hidden.shape[1], lambda: f"{op}: weight must be [V, H] with H = hidden.size(1) = {hidden.shape[1]}, got shape {list(weight.shape)}"
    )
    torch._check(weight.shape[0] > 0, lambda: f"{op}: weight must have a non-empty vocabulary dim, got shape {list(weight.shape)}")
    torch._check(weight.dtype == hidden.dtype, lambda: f"{op}: weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    torch._check(
        not labels.dtype.is_floating_point and not labels.dtype.is_complex and labels.dtype != torch.bool,
        lambda: f"{op}: labels must be an integer tensor, got {labels.dtype}",
    )
    _check_shape(op, "labels", labels, hidden.shape[:1])
    _check_same_device(op, hidden=hidden, weight=weight, labels=labels)
    if bias is not None:
        torch._check(bias.dtype == hidden.dtype, lambda: f"{op}: bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
        _check_shape(op, "bias", bias, weight.shape[:1])
        _check_same_device(op, hidden=hidden, bias=bias)
    torch._check(0 < temperature < math.inf, lambda: f"{op}: temperature must be finite and > 0, got {temperature}")
    torch._check(0 < logit_scale < math.inf, lambda: f"{op}: logit_scale must be finite and > 0, got {logit_scale}")
    torch._check(
        logit_softcap is None or 0 < logit_softcap < math.inf, lambda: f"{op}: logit_softcap must be None or finite and > 0, got {logit_softcap}"
    )


def _fake_linear_token_logprobs(hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index):
    _check_head("linear_token_logprobs", hidden, weight, labels, bias, temperature, logit_scale, logit_softcap)
    dtype = result_dtype(hidden)
    entropy = hidden.new_empty(labels.shape if return_entropy else (0,), dtype=dtype)
    return hidden.new_empty(labels.shape, dtype=dtype), entropy, hidden.new_empty(labels.shape, dtype=dtype)


def _fake_linear_token_logprobs_backward(
    grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse, entropy, temperature, logit_scale, logit_softcap, ignore_index, output_mask
):
    op = "linear_token_logprobs_backward"
    _check_head(op, hidden, weight, labels, bias, temperature, logit_scale, logit_softcap)
    _check_saved_row_stats(op, "linear_token_logprobs", "hidden", hidden, labels, lse, entropy, grad_logprobs, grad_entropy)
    grad_bias = _grad_or_empty(bias, output_mask[2]) if bias is not None else hidden.new_empty((0,))
    return _grad_or_empty(hidden, output_mask[0]), _grad_or_empty(weight, output_mask[1]), grad_bias


def _setup_linear_token_logprobs(ctx, inputs, output):
    hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(hidden, weight, labels, bias, lse, entropy)
    ctx.args = (temperature, logit_scale, logit_softcap, ignore_index)
    ctx.return_entropy = return_entropy
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # an unused output needs no term in the backward


def _backward_linear_token_logprobs(ctx, grad_logprobs, grad_entropy, _grad_lse):
    grad_entropy = grad_entropy if ctx.return_entropy else None
    hidden, weight, labels, bias, lse, entropy = ctx.saved_tensors
    needed = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]]
    if grad_logprobs is None and grad_entropy is None:
        return (None,) * 9
    grads = torch.ops.ppo_fast.linear_token_logprobs_backward(
        grad_logprobs, grad_entropy, hidden, weight, labels, bias, lse, entropy, *ctx.args, needed
    )
    grad_hidden, grad_weight, grad_bias = _wanted(grads, needed)
    return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None


_register("linear_token_logprobs", _fake_linear_token_logprobs, _backward_linear_token_logprobs, _setup_linear_token_logprobs)
_register("linear_token_logprobs_backward", _fake_linear_token_logprobs_backward)


def linear_token_logprobs(
    hidden, weight, labels, *, bias=None, temperature=1.0, logit_scale=1.0, logit_softcap=None, return_entropy=False, ignore_index=-100
):
    logp, entropy, _lse = torch.ops.ppo_fast.linear_token_logprobs(
        hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index
    )
    return logp, (entropy if return_entropy else None)


# --------------------------------------------------------------------------- kl_estimate


def _check_kl_inputs(op, logprobs, ref_logprobs, estimator):
    _check_float(op, "logprobs", logprobs)
    _check_float(op, "ref_logprobs", ref_logprobs)
    _check_shape(op, "ref_logprobs", ref_logprobs, logprobs.shape, "logprobs")
    _check_same_device(op, logprobs=logprobs, ref_logprobs=ref_logprobs)
    _check_choice(op, "estimator", estimator, KL_ESTIMATORS)


def _fake_kl_estimate(logprobs, ref_logprobs, estimator):
    _check_kl_inputs("kl_estimate", logprobs, ref_logprobs, estimator)
    return logprobs.new_empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs))


def _fake_kl_estimate_backward(grad_kl, logprobs, ref_logprobs, estimator, output_mask):
    op = "kl_estimate_backward"
    _check_kl_inputs(op, logprobs, ref_logprobs, estimator)
    _check_float(op, "grad_kl", grad_kl)
    _check_shape(op, "grad_kl", grad_kl, logprobs.shape, "logprobs")
    _check_same_device(op, logprobs=logprobs, grad_kl=grad_kl)
    return _grad_or_empty(logprobs, output_mask[0]), _grad_or_empty(ref_logprobs, output_mask[1])


def _setup_kl_estimate(ctx, inputs, output):
    logprobs, ref_logprobs, ctx.estimator = inputs
    ctx.save_for_backward(logprobs, ref_logprobs)


def _backward_kl_estimate(ctx, grad_kl):
    logprobs, ref_logprobs = ctx.saved_tensors
    needed = list(ctx.needs_input_grad[:2])
    grads = torch.ops.ppo_fast.kl_estimate_backward(grad_kl, logprobs, ref_logprobs, ctx.estimator, needed)
    return *_wanted(grads, needed), None


_register("kl_estimate", _fake_kl_estimate, _backward_kl_estimate, _setup_kl_estimate)
_register("kl_estimate_backward", _fake_kl_estimate_backward)


def kl_estimate(logprobs, ref_logprobs, estimator: str):
    return torch.ops.ppo_fast.kl_estimate(logprobs, ref_logprobs, estimator)


# --------------------------------------------------------------------------- kl_penalized_rewards


def _check_penalized_inputs(op, logprobs, ref_logprobs, mask, estimator):
    _check_float(op, "logprobs", logprobs)
    _check_dim(op, "logprobs", logprobs, 2)
    _check_float(op, "ref_logprobs", ref_logprobs)
    _check_shape(op, "ref_logprobs", ref_logprobs, logprobs.shape, "logprobs")
    _check_mask(op, mask, "logprobs", logprobs)
    _check_same_device(op, logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    _check_choice(op, "estimator", estimator, KL_ESTIMATORS)


def _fake_kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, estimator):
    op = "kl_penalized_rewards"
    _check_penalized_inputs(op, logprobs, ref_logprobs, mask, estimator)
    _check_float(op, "scores", scores)
    _check_shape(op, "scores", scores, logprobs.shape[:1])
    _check_same_device(op, logprobs=logprobs, scores=scores)
    dtype = result_dtype(logprobs, ref_logprobs)
    return logprobs.new_empty(logprobs.shape, dtype=dtype), logprobs.new_empty(logprobs.shape, dtype=dtype)


def _fake_kl_penalized_rewards_backward(grad_rewards, grad_kl, logprobs, ref_logprobs, mask, kl_coef, estimator, scores_dtype, output_mask):
    op = "kl_penalized_rewards_backward"
    _check_penalized_inputs(op, logprobs, ref_logprobs, mask, estimator)
    _check_dtype_arg(op, "scores_dtype", scores_dtype)
    for name, grad in (("grad_rewards", grad_rewards), ("grad_kl", grad_kl)):
        if grad is not None:
            _check_float(op, name, grad)
            _check_shape(op, name, grad, logprobs.shape, "logprobs")
            _check_same_device(op, logprobs=logprobs, **{name: grad})
    grad_scores = logprobs.new_empty(logprobs.shape[:1] if output_mask[0] else (0,), dtype=scores_dtype)
    return grad_scores, _grad_or_empty(logprobs, output_mask[1]), _grad_or_empty(ref_logprobs, output_mask[2])


def _setup_kl_penalized_rewards(ctx, inputs, output):
    scores, logprobs, ref_logprobs, mask, kl_coef, estimator = inputs
    ctx.save_for_backward(logprobs, ref_logprobs, mask)
    ctx.args = (kl_coef, estimator, scores.dtype)
    ctx.set_materialize_grads(False)  # kl is often only a statistic: no gradient through it


def _backward_kl_penalized_rewards(ctx, grad_rewards, grad_kl):
    logprobs, ref_logprobs, mask = ctx.saved_tensors
    needed = list(ctx.needs_input_grad[:3])
    grads = torch.ops.ppo_fast.kl_penalized_rewards_backward(grad_rewards, grad_kl, logprobs, ref_logprobs, mask, *ctx.args, needed)
    return *_wanted(grads, needed), None, None, None


_register("kl_penalized_rewards", _fake_kl_penalized_rewards, _backward_kl_penalized_rewards, _setup_kl_penalized_rewards)
_register("kl_penalized_rewards_backward", _fake_kl_penalized_rewards_backward)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef: float, estimator: str):
    return torch.ops.ppo_fast.kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, estimator)


# --------------------------------------------------------------------------- gae


def _fake_gae(rewards, values, mask, gamma, lam):
    op = "gae"
    _check_float(op, "rewards", rewards)
    _check_dim(op, "rewards", rewards, 2)
    _check_float(op, "values", values)
    _check_shape(op, "values", values, rewards.shape, "rewards")
    _check_mask(op, mask, "rewards", rewards)
    _check_same_device(op, rewards=rewards, values=values, mask=mask)
    dtype = result_dtype(rewards, values)
    return rewards.new_empty(rewards.shape, dtype=dtype), rewards.new_empty(rewards.shape, dtype=dtype)


def _fake_gae_backward(grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype, values_dtype, output_mask):
    op = "gae_backward"
    torch._check(mask.dtype == torch.bool, lambda: f"{op}: mask must be a bool tensor, got {mask.dtype}")
    _check_dim(op, "mask", mask, 2)
    _check_dtype_arg(op, "rewards_dtype", rewards_dtype)
    _check_dtype_arg(op, "values_dtype", values_dtype)
    for name, grad in (("grad_advantages", grad_advantages), ("grad_returns", grad_returns)):
        if grad is not None:
            _check_float(op, name, grad)
            _check_shape(op, name, grad, mask.shape, "mask")
            _check_same_device(op, mask=mask, **{name: grad})
    return _grad_or_empty(mask, output_mask[0], rewards_dtype), _grad_or_empty(mask, output_mask[1], values_dtype)


def _setup_gae(ctx, inputs, output):
    rewards, values, mask, gamma, lam = inputs
    ctx.save_for_backward(mask)
    ctx.args = (gamma, lam, rewards.dtype, values.dtype)
    ctx.set_materialize_grads(False)  # often only the advantages are used


def _backward_gae(ctx, grad_advantages, grad_returns):
    (mask,) = ctx.saved_tensors
    needed = list(ctx.needs_input_grad[:2])
    grads = torch.ops.ppo_fast.gae_backward(grad_advantages, grad_returns, mask, *ctx.args, needed)
    return *_wanted(grads, needed), None, None, None


def _setup_gae_backward(ctx, inputs, output):
    grad_advantages, grad_returns, mask, gamma, lam, _rewards_dtype, _values_dtype, output_mask = inputs
    ctx.save_for_backward(mask)
    ctx.args = (gamma, lam)
    ctx.grad_dtypes = tuple(None if g is None else g.dtype for g in (grad_advantages, grad_returns))
    ctx.output_mask = tuple(output_mask)


def _backward_gae_backward(ctx, grad_grad_rewards, grad_grad_values):
    # GAE is linear, (advantages, returns) = F(rewards, values), and its backward is F's
    # transpose, so the backward's own vector-Jacobian product is F itself.
    (mask,) = ctx.saved_tensors
    cotangents = []
    for grad, wanted in ((grad_grad_rewards, ctx.output_mask[0]), (grad_grad_values, ctx.output_mask[1])):
        cotangents.append(grad if wanted and grad is not None else torch.zeros(mask.shape, device=mask.device))
    advantages, returns = torch.ops.ppo_fast.gae(*cotangents, mask, *ctx.args)
    grads = [None if dtype is None else g.to(dtype) for g, dtype in zip((advantages, returns), ctx.grad_dtypes)]
    return *grads, None, None, None, None, None, None


def _fake_bool_mask(mask, name):  # the public ops' host check of 0/1 masks (csrc/cpu/bool_mask.cpp)
    torch._check(mask.dtype != torch.bool, lambda: f"bool_mask: {name} is already bool")
    torch._check(not mask.dtype.is_complex, lambda: f"bool_mask: {name} must be a float or integer tensor, got {mask.dtype}")
    return mask.new_empty(mask.shape, dtype=torch.bool)


_register("bool_mask", _fake_bool_mask)
_register("gae", _fake_gae, _backward_gae, _setup_gae)
_register("gae_backward", _fake_gae_backward, _backward_gae_backward, _setup_gae_backward)


def gae(rewards, values, mask, gamma: float, lam: float):
    return torch.ops.ppo_fast.gae(rewards, values, mask, gamma, lam)


# --------------------------------------------------------------------------- clipped_policy_loss


def _check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights):
    _check_float(op, "logprobs", logprobs)
    _check_dim(op, "logprobs", logprobs, 2)
    for name, x in (("old_logprobs", old_logprobs), ("advantages", advantages), ("weights", weights)):
        if x is not None:
            _check_float(op, name, x)
            _check_shape(op, name, x, logprobs.shape, "logprobs")
            _check_same_device(op, logprobs=logprobs, **{name: x})
    _check_mask(op, mask, "logprobs", logprobs)
    _check_same_device(op, logprobs=logprobs, mask=mask)


def _check_loss_backward_inputs(op, grad_loss, row_scale, like):
    _check_float(op, "grad_loss", grad_loss)
    torch._check(grad_loss.numel() == 1, lambda: f"{op}: grad_loss must have one element, got shape {list(grad_loss.shape)}")
    _check_float(op, "row_scale", row_scale)
    _check_shape(op, "row_scale", row_scale, like.shape[:1])
    _check_same_device(op, inputs=like, grad_loss=grad_loss, row_scale=row_scale)


def _fake_clipped_policy_loss(logprobs, old_logprobs, advantages, mask, weights, clip_low, clip_high, dual_clip, agg):
    _check_policy_inputs("clipped_policy_loss", logprobs, old_logprobs, advantages, mask, weights)
    _check_choice("clipped_policy_loss", "agg", agg, AGG_MODES)
    dtype = result_dtype(logprobs, old_logprobs, advantages, weights)
    # As in the reference, the clip fractions are float32 and approx_kl has the compute dtype.
    loss, clipfrac, clipfrac_lower, approx_kl = (logprobs.new_empty((), dtype=d) for d in (dtype, torch.float32, torch.float32, dtype))
    return loss, clipfrac, clipfrac_lower, approx_kl, logprobs.new_empty((logprobs.shape[0],), dtype=dtype)


def _fake_clipped_policy_loss_backward(
    grad_loss, logprobs, old_logprobs, advantages, mask, weights, row_scale, clip_low, clip_high, dual_clip, output_mask
):
    op = "clipped_policy_loss_backward"
    _check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights)
    _check_loss_backward_inputs(op, grad_loss, row_scale, logprobs)
    grad_weights = _grad_or_empty(weights, output_mask[3]) if weights is not None else logprobs.new_empty((0,))
    return (
        _grad_or_empty(logprobs, output_mask[0]),
        _grad_or_empty(old_logprobs, output_mask[1]),
        _grad_or_empty(advantages, output_mask[2]),
        grad_weights,
    )


def _setup_clipped_policy_loss(ctx, inputs, output):
    logprobs, old_logprobs, advantages, mask, weights, clip_low, clip_high, dual_clip, _agg = inputs
    _loss, clipfrac, clipfrac_lower, approx_kl, row_scale = output
    ctx.save_for_backward(logprobs, old_logprobs, advantages, mask, weights, row_scale)
    ctx.clip = (clip_low, clip_high, dual_clip)
    ctx.mark_non_differentiable(clipfrac, clipfrac_lower, approx_kl, row_scale)  # detached in the reference


def _backward_clipped_policy_loss(ctx, grad_loss, *_stats_grads):
    logprobs, old_logprobs, advantages, mask, weights, row_scale = ctx.saved_tensors
    need = ctx.needs_input_grad
    needed = [need[0], need[1], need[2], weights is not None and need[4]]
    grads = torch.ops.ppo_fast.clipped_policy_loss_backward(
        grad_loss, logprobs, old_logprobs, advantages, mask, weights, row_scale, *ctx.clip, needed
    )
    grad_logprobs, grad_old, grad_advantages, grad_weights = _wanted(grads, needed)
    return grad_logprobs, grad_old, grad_advantages, None, grad_weights, None, None, None, None


_register("clipped_policy_loss", _fake_clipped_policy_loss, _backward_clipped_policy_loss, _setup_clipped_policy_loss)
_register("clipped_policy_loss_backward", _fake_clipped_policy_loss_backward)


def clipped_policy_loss(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, dual_clip, agg: str):
    loss, clipfrac, clipfrac_lower, approx_kl, _row_scale = torch.ops.ppo_fast.clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, dual_clip, agg
    )
    return loss, clipfrac.detach(), clipfrac_lower.detach(), approx_kl.detach()


# --------------------------------------------------------------------------- value_loss


def _check_value_inputs(op, values, old_values, returns, mask):
    _check_float(op, "values", values)
    _check_dim(op, "values", values, 2)
    for name, x in (("old_values", old_values), ("returns", returns)):
        _check_float(op, name, x)
        _check_shape(op, name, x, values.shape, "values")
    _check_mask(op, mask, "values", values)
    _check_same_device(op, values=values, old_values=old_values, returns=returns, mask=mask)


def _fake_value_loss(values, old_values, returns, mask, clip, agg):
    _check_value_inputs("value_loss", values, old_values, returns, mask)
    _check_choice("value_loss", "agg", agg, AGG_MODES)
    dtype = result_dtype(values, old_values, returns)
    return values.new_empty((), dtype=dtype), values.new_empty((), dtype=torch.float32), values.new_empty((values.shape[0],), dtype=dtype)


def _fake_value_loss_backward(grad_loss, values, old_values, returns, mask, row_scale, clip, output_mask):
    op = "value_loss_backward"
    _check_value_inputs(op, values, old_values, returns, mask)
    _check_loss_backward_inputs(op, grad_loss, row_scale, values)
    return tuple(_grad_or_empty(x, wanted) for x, wanted in zip((values, old_values, returns), output_mask))


def _setup_value_loss(ctx, inputs, output):
    values, old_values, returns, mask, clip, _agg = inputs
    _loss, clipfrac, row_scale = output
    ctx.save_for_backward(values, old_values, returns, mask, row_scale)
    ctx.clip = clip
    ctx.mark_non_differentiable(clipfrac, row_scale)


def _backward_value_loss(ctx, grad_loss, *_stats_grads):
    values, old_values, returns, mask, row_scale = ctx.saved_tensors
    needed = list(ctx.needs_input_grad[:3])
    grads = torch.ops.ppo_fast.value_loss_backward(grad_loss, values, old_values, returns, mask, row_scale, ctx.clip, needed)
    return *_wanted(grads, needed), None, None, None


_register("value_loss", _fake_value_loss, _backward_value_loss, _setup_value_loss)
_register("value_loss_backward", _fake_value_loss_backward)


def value_loss(values, old_values, returns, mask, clip: float, agg: str):
    loss, clipfrac, _row_scale = torch.ops.ppo_fast.value_loss(values, old_values, returns, mask, clip, agg)
    return loss, clipfrac.detach()


# --------------------------------------------------------------------------- group_sum


def _fake_group_sum(values, group_index):
    op = "group_sum"
    torch._check(values.dtype in (torch.float32, torch.float64), lambda: f"{op}: values must be float32 or float64, got {values.dtype}")
    _check_dim(op, "values", values, 2)
    torch._check(group_index.dtype == torch.int64, lambda: f"{op}: group_index must be int64, got {group_index.dtype}")
    _check_shape(op, "group_index", group_index, values.shape[:1])
    _check_same_device(op, values=values, group_index=group_index)
    return values.new_empty(values.shape)


def _setup_group_sum(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward_group_sum(ctx, grad):
    (group_index,) = ctx.saved_tensors
    return torch.ops.ppo_fast.group_sum(grad.contiguous(), group_index), None  # linear and symmetric: its own adjoint


_register("group_sum", _fake_group_sum, _backward_group_sum, _setup_group_sum)


def group_sum(values, group_index):
    return torch.ops.ppo_fast.group_sum(values.to(result_dtype(values)), group_index)


# --------------------------------------------------------------------------- sequence-level policy losses
# policy_loss_gspo and policy_loss_geo_mean (csrc/cpu/seq_losses.cpp, csrc/cuda/seq_losses.cu):
# clipped_policy_loss's inputs and stats, plus a per-row state [B, 2] for the backward.

_ROW_STATE = 2  # csrc/seq_loss_math.h kRowState


def _seq_loss_ops(mode):
    op = f"policy_loss_{mode}"

    def fake(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, agg):
        _check_policy_inputs(op, logprobs, old_logprobs, advantages, mask, weights)
        _check_choice(op, "agg", agg, AGG_MODES)
        dtype = result_dtype(logprobs, old_logprobs, advantages, weights)
        rows = logprobs.shape[0]
        return (logprobs.new_empty((), dtype=dtype), logprobs.new_empty((), dtype=torch.float32),
                logprobs.new_empty((), dtype=torch.float32), logprobs.new_empty((), dtype=dtype),
                logprobs.new_empty((rows,), dtype=dtype), logprobs.new_empty((rows, _ROW_STATE), dtype=dtype))

    def fake_backward(grad_loss, logprobs, old_logprobs, advantages, mask, weights, row_scale, row_state,
                      clip_eps_low, clip_eps_high, output_mask):
        name = f"{op}_backward"
        _check_policy_inputs(name, logprobs, old_logprobs, advantages, mask, weights)
        _check_loss_backward_inputs(name, grad_loss, row_scale, logprobs)
        _check_float(name, "row_state", row_state)
        _check_shape(name, "row_state", row_state, (logprobs.shape[0], _ROW_STATE))
        grad_weights = _grad_or_empty(weights, output_mask[3]) if weights is not None else logprobs.new_empty((0,))
        # GSPO's sequence ratio is detached: old_logprobs gets no gradient.
        grad_old = _grad_or_empty(old_logprobs, output_mask[1] and mode != "gspo")
        return _grad_or_empty(logprobs, output_mask[0]), grad_old, _grad_or_empty(advantages, output_mask[2]), grad_weights

    def setup(ctx, inputs, output):
        logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, _agg = inputs
        _loss, clipfrac, clipfrac_lower, approx_kl, row_scale, row_state = output
        ctx.save_for_backward(logprobs, old_logprobs, advantages, mask, weights, row_scale, row_state)
        ctx.clip = (clip_eps_low, clip_eps_high)
        ctx.mark_non_differentiable(clipfrac, clipfrac_lower, approx_kl, row_scale, row_state)

    def backward(ctx, grad_loss, *_stats_grads):
        logprobs, old_logprobs, advantages, mask, weights, row_scale, row_state = ctx.saved_tensors
        need = ctx.needs_input_grad
        needed = [need[0], need[1] and mode != "gspo", need[2], weights is not None and need[4]]
        grads = getattr(torch.ops.ppo_fast, f"{op}_backward")(
            grad_loss, logprobs, old_logprobs, advantages, mask, weights, row_scale, row_state, *ctx.clip, needed
        )
        grad_logprobs, grad_old, grad_advantages, grad_weights = _wanted(grads, needed)
        return grad_logprobs, grad_old, grad_advantages, None, grad_weights, None, None, None

    _register(op, fake, backward, setup)
    _register(f"{op}_backward", fake_backward)

    def run(logprobs, old_logprobs, advantages, mask, weights, clip_eps_low: float, clip_eps_high: float, agg: str):
        loss, clipfrac, clipfrac_lower, approx_kl, _row_scale, _row_state = getattr(torch.ops.ppo_fast, op)(
            logprobs, old_logprobs, advantages, mask, weights, clip_eps_low, clip_eps_high, agg
        )
        return loss, clipfrac.detach(), clipfrac_lower.detach(), approx_kl.detach()

    run.__name__ = run.__qualname__ = op
    return run


policy_loss_gspo = _seq_loss_ops("gspo")
policy_loss_geo_mean = _seq_loss_ops("geo_mean")
