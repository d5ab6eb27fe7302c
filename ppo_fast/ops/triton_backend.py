"""The Triton backend: ``ppo_fast.kernels`` wrapped as torch.library custom ops with autograd.

Each op is a ``torch.library.custom_op`` (with a fake implementation), so that
``torch.compile(fullgraph=True)`` treats it as one opaque node without graph
breaks.  All are differentiable as the reference is: ``token_logprobs`` w.r.t. the
logits, ``linear_token_logprobs`` w.r.t. the hidden states and the head's weight and
bias, ``kl_estimate`` w.r.t. both log-probs, ``kl_penalized_rewards`` w.r.t. the
scores and both log-probs, ``gae`` w.r.t. rewards and values; each gradient in its
input's dtype, whichever outputs are used.  A tensor input they are not
differentiable in (labels, mask) raises in the backward if it requires grad,
rather than getting a silent ``None``.  The backward ops themselves have no
autograd (no double backward).

The kernels read any strides, check shapes, run on the inputs' device and never
sync with the host, so these ops behave the same whether or not the public ops'
value checks ran (they are skipped under ``torch.compile``).

Served on CUDA tensors; on CPU tensors only under ``TRITON_INTERPRET=1`` (the
interpreter, for tests).
"""

from __future__ import annotations

import os

import torch

OPS = ("token_logprobs", "linear_token_logprobs", "kl_estimate", "kl_penalized_rewards", "gae", "group_sum")  # of contract.OPS
_DEVICES = {"cuda", "cpu"} if os.environ.get("TRITON_INTERPRET") == "1" else {"cuda"}
SUPPORTED = {op: set(_DEVICES) for op in OPS}
# Ops whose results may differ in their last bits from run to run, and why: under
# torch.use_deterministic_algorithms(True) ``auto`` passes them over and an explicit choice raises.
NONDETERMINISTIC = {"linear_token_logprobs": "its backward adds the gradients of hidden and weight with float32 atomics"}

try:
    from .. import kernels
    from ..kernels._dtypes import result_dtype
    from ..kernels._launch import is_non_overlapping_and_dense
except ImportError as err:  # triton missing or broken: availability() says so
    kernels = None
    _IMPORT_ERROR = f"{type(err).__name__}: {err}"


def availability() -> tuple[bool, str]:
    if kernels is None:
        return False, f"triton cannot be imported ({_IMPORT_ERROR})"
    if "cpu" in _DEVICES:
        return True, "Triton interpreter (TRITON_INTERPRET=1): CPU tensors, for testing"
    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU)"
    return True, "Triton kernels on CUDA"


# --------------------------------------------------------------------------- log-probs


@torch.library.custom_op("ppo_fast_triton::token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, return_entropy: bool, ignore_index: int, inplace_backward: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, stats)``; entropy is empty without ``return_entropy``; ``stats`` are for the backward,
    which reads ``inplace_backward``."""
    logp, entropy, stats = kernels.token_logprobs_forward(logits, labels, temperature, return_entropy, ignore_index)
    return logp, (entropy if return_entropy else logp.new_empty(0)), stats


@_token_logprobs_op.register_fake
def _(logits, labels, temperature, return_entropy, ignore_index, inplace_backward):
    logp = labels.new_empty(labels.shape, dtype=result_dtype(logits))
    return logp, logp.new_empty(labels.shape if return_entropy else (0,)), logp.new_empty(labels.shape + (2,))


@torch.library.custom_op("ppo_fast_triton::token_logprobs_backward", mutates_args=())
def _token_logprobs_backward_op(
    logits: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
) -> torch.Tensor:
    return kernels.token_logprobs_backward(logits, labels, stats, entropy, grad_logp, grad_entropy, temperature, ignore_index)


@_token_logprobs_backward_op.register_fake
def _(logits, labels, stats, entropy, grad_logp, grad_entropy, temperature, ignore_index):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("ppo_fast_triton::token_logprobs_backward_inplace", mutates_args=("logits",))
def _token_logprobs_backward_inplace_op(
    logits: torch.Tensor,
    labels: torch.Tensor,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    ignore_index: int,
) -> None:
    """Writes the gradient into ``logits``; only for logits whose memory is non-overlapping and dense."""
    if not is_non_overlapping_and_dense(logits):
        raise ValueError("an in-place backward needs logits whose memory is non-overlapping and dense")
    kernels.token_logprobs_backward(logits, labels, stats, entropy, grad_logp, grad_entropy, temperature, ignore_index, out=logits)


@_token_logprobs_backward_inplace_op.register_fake
def _(logits, labels, stats, entropy, grad_logp, grad_entropy, temperature, ignore_index):
    return None


def _not_differentiable(ctx, **indices: int) -> None:
    """Raise for a tensor input that requires grad although the op has no gradient for it
    (returning None for it would silently drop that gradient)."""
    for name, index in indices.items():
        if ctx.needs_input_grad[index]:
            raise RuntimeError(f"the Triton backend is not differentiable w.r.t. {name} (as the reference is not)")


def _token_logprobs_setup(ctx, inputs, output):
    logits, labels, ctx.temperature, ctx.return_entropy, ctx.ignore_index, inplace_backward = inputs
    # In place only where every element of the logits has its own address: an expanded
    # (stride-0) or otherwise overlapping tensor would have its rows' gradients written
    # over one another.  Else the backward allocates the gradient, as without the flag.
    ctx.inplace_backward = inplace_backward and is_non_overlapping_and_dense(logits)
    _, entropy, stats = output
    ctx.save_for_backward(logits, labels, stats, entropy)
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)  # an unused output needs no term in the backward


def _token_logprobs_backward(ctx, grad_logp, grad_entropy, _grad_stats):
    _not_differentiable(ctx, labels=1)
    logits, labels, stats, entropy = ctx.saved_tensors
    if not ctx.return_entropy:
        grad_entropy = None  # the placeholder output (empty) has no gradient to pass
    args = (logits, labels, stats, entropy, grad_logp, grad_entropy, ctx.temperature, ctx.ignore_index)
    if ctx.inplace_backward:
        _token_logprobs_backward_inplace_op(*args)
        grad_logits = logits
    else:
        grad_logits = _token_logprobs_backward_op(*args)
    return grad_logits, None, None, None, None, None


_token_logprobs_op.register_autograd(_token_logprobs_backward, setup_context=_token_logprobs_setup)


def token_logprobs(logits, labels, temperature, return_entropy, ignore_index, inplace_backward=False):
    """``inplace_backward`` lets the backward write the gradient into the logits' buffer, only when
    their memory is non-overlapping and dense (else, e.g. for expanded logits, it allocates one)."""
    logp, entropy, _ = _token_logprobs_op(logits, labels, temperature, return_entropy, ignore_index, inplace_backward)
    return logp, (entropy if return_entropy else None)


# --------------------------------------------------------------------------- fused LM head


@torch.library.custom_op("ppo_fast_triton::linear_token_logprobs", mutates_args=())
def _linear_token_logprobs_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    logit_scale: float,
    logit_softcap: float | None,
    return_entropy: bool,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, entropy, stats)``; entropy is empty without ``return_entropy``; ``stats`` is for the backward."""
    logp, entropy, stats = kernels.linear_logprobs_forward(
        hidden, weight, labels, bias, temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap,
        ignore_index=ignore_index, return_entropy=return_entropy,
    )  # fmt: skip
    return logp, (entropy if return_entropy else logp.new_empty(0)), stats


@_linear_token_logprobs_op.register_fake
def _(hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index):
    logp = hidden.new_empty(hidden.shape[:1], dtype=result_dtype(hidden, weight, bias))
    return logp, logp.new_empty(logp.shape if return_entropy else (0,)), logp.new_empty(logp.shape + (2,))


@torch.library.custom_op("ppo_fast_triton::linear_token_logprobs_backward", mutates_args=())
def _linear_token_logprobs_backward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    logit_scale: float,
    logit_softcap: float | None,
    ignore_index: int,
    needs_hidden: bool,
    needs_weight: bool,
    needs_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d_hidden, d_weight, d_bias)``, each empty where not needed."""
    grads = kernels.linear_logprobs_backward(
        hidden, weight, labels, bias, stats, entropy if grad_entropy is not None else None, grad_logp, grad_entropy,
        temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap, ignore_index=ignore_index,
        needs_hidden=needs_hidden, needs_weight=needs_weight, needs_bias=needs_bias,
    )  # fmt: skip
    return tuple(stats.new_empty(0, dtype=like.dtype) if g is None else g for g, like in zip(grads, (hidden, weight, weight)))


@_linear_token_logprobs_backward_op.register_fake
def _(hidden, weight, labels, bias, stats, entropy, grad_logp, grad_entropy, temperature, logit_scale, logit_softcap, ignore_index,
      needs_hidden, needs_weight, needs_bias):  # fmt: skip
    needs_bias = needs_bias and bias is not None
    return (
        hidden.new_empty(hidden.shape if needs_hidden else (0,)),
        weight.new_empty(weight.shape if needs_weight else (0,)),
        weight.new_empty(weight.shape[:1] if needs_bias else (0,)),
    )


def _linear_token_logprobs_setup(ctx, inputs, output):
    hidden, weight, labels, bias, ctx.temperature, ctx.logit_scale, ctx.logit_softcap, ctx.return_entropy, ctx.ignore_index = inputs
    _, entropy, stats = output
    ctx.save_for_backward(hidden, weight, labels, bias, stats, entropy)
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)  # an unused output needs no term in the backward


def _linear_token_logprobs_backward(ctx, grad_logp, grad_entropy, _grad_lse):
    _not_differentiable(ctx, labels=2)
    hidden, weight, labels, bias, stats, entropy = ctx.saved_tensors
    if not ctx.return_entropy:
        grad_entropy = None  # the placeholder output (empty) has no gradient to pass
    needs_hidden, needs_weight, _, needs_bias = ctx.needs_input_grad[:4]
    if grad_logp is None and grad_entropy is None:
        return None, None, None, None, None, None, None, None, None
    d_hidden, d_weight, d_bias = _linear_token_logprobs_backward_op(
        hidden, weight, labels, bias, stats, entropy, grad_logp, grad_entropy, ctx.temperature, ctx.logit_scale,
        ctx.logit_softcap, ctx.ignore_index, needs_hidden, needs_weight, needs_bias,
    )  # fmt: skip
    pick = lambda grad, needed: grad if needed else None  # noqa: E731
    return pick(d_hidden, needs_hidden), pick(d_weight, needs_weight), None, pick(d_bias, needs_bias), None, None, None, None, None


_linear_token_logprobs_op.register_autograd(_linear_token_logprobs_backward, setup_context=_linear_token_logprobs_setup)


def linear_token_logprobs(
    hidden, weight, labels, *, bias=None, temperature=1.0, logit_scale=1.0, logit_softcap=None, return_entropy=False, ignore_index=-100
):
    """``hidden [N, H]``, ``weight [V, H]``, ``labels [N]``: ``(logp, entropy or None)`` (the fused
    kernels of ``ppo_fast.kernels.linear_logprobs``; no ``[N, V]`` tensor in either pass)."""
    logp, entropy, _ = _linear_token_logprobs_op(
        hidden, weight, labels, bias, temperature, logit_scale, logit_softcap, return_entropy, ignore_index
    )
    return logp, (entropy if return_entropy else None)


# --------------------------------------------------------------------------- KL and rewards


@torch.library.custom_op("ppo_fast_triton::kl_estimate", mutates_args=())
def _kl_estimate_op(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    return kernels.kl_estimate_forward(logprobs, ref_logprobs, estimator)


@_kl_estimate_op.register_fake
def _(logprobs, ref_logprobs, estimator):
    return logprobs.new_empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs))


@torch.library.custom_op("ppo_fast_triton::kl_backward", mutates_args=())
def _kl_backward_op(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, grad_kl: torch.Tensor, estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.kl_backward(logprobs, ref_logprobs, grad_kl, estimator)


@_kl_backward_op.register_fake
def _(logprobs, ref_logprobs, grad_kl, estimator):
    # Contiguous, as the kernels' outputs are (empty_like would keep a transposed input's strides).
    return logprobs.new_empty(logprobs.shape), ref_logprobs.new_empty(ref_logprobs.shape)


def _kl_estimate_setup(ctx, inputs, output):
    logprobs, ref_logprobs, ctx.estimator = inputs
    ctx.save_for_backward(logprobs, ref_logprobs)


def _kl_estimate_backward(ctx, grad_kl):
    logprobs, ref_logprobs = ctx.saved_tensors
    grad_logp, grad_ref = _kl_backward_op(logprobs, ref_logprobs, grad_kl, ctx.estimator)
    return grad_logp, grad_ref, None


_kl_estimate_op.register_autograd(_kl_estimate_backward, setup_context=_kl_estimate_setup)


def kl_estimate(logprobs, ref_logprobs, estimator):
    return _kl_estimate_op(logprobs, ref_logprobs, estimator)


@torch.library.custom_op("ppo_fast_triton::kl_penalized_rewards", mutates_args=())
def _kl_penalized_rewards_op(
    scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_coef: float, estimator: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards, kl, last)``: ``last [B]`` int32 is each row's last valid index (-1 if none), for the backward."""
    return kernels.kl_penalized_rewards_forward(scores, logprobs, ref_logprobs, mask, kl_coef, estimator)


@_kl_penalized_rewards_op.register_fake
def _(scores, logprobs, ref_logprobs, mask, kl_coef, estimator):
    rewards = logprobs.new_empty(logprobs.shape, dtype=result_dtype(logprobs, ref_logprobs))
    return rewards, torch.empty_like(rewards), scores.new_empty(scores.shape, dtype=torch.int32)


@torch.library.custom_op("ppo_fast_triton::kl_penalized_rewards_backward", mutates_args=())
def _kl_penalized_rewards_backward_op(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    last: torch.Tensor,
    grad_rewards: torch.Tensor | None,
    grad_kl: torch.Tensor | None,
    kl_coef: float,
    estimator: str,
    scores_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_scores, grad_logprobs, grad_ref_logprobs)``; ``grad_scores`` is empty without ``grad_rewards``."""
    grad_scores, grad_logp, grad_ref = kernels.kl_penalized_rewards_backward(
        logprobs, ref_logprobs, mask, last, grad_rewards, grad_kl, kl_coef, estimator, scores_dtype
    )
    return (grad_logp.new_empty(0, dtype=scores_dtype) if grad_scores is None else grad_scores), grad_logp, grad_ref


@_kl_penalized_rewards_backward_op.register_fake
def _(logprobs, ref_logprobs, mask, last, grad_rewards, grad_kl, kl_coef, estimator, scores_dtype):
    grad_scores = last.new_empty(last.shape if grad_rewards is not None else (0,), dtype=scores_dtype)
    return grad_scores, logprobs.new_empty(logprobs.shape), ref_logprobs.new_empty(ref_logprobs.shape)


def _kl_penalized_rewards_setup(ctx, inputs, output):
    scores, logprobs, ref_logprobs, mask, ctx.kl_coef, ctx.estimator = inputs
    ctx.scores_dtype = scores.dtype
    last = output[2]
    ctx.save_for_backward(logprobs, ref_logprobs, mask, last)
    ctx.mark_non_differentiable(last)
    ctx.set_materialize_grads(False)


def _kl_penalized_rewards_backward(ctx, grad_rewards, grad_kl, _grad_last):
    _not_differentiable(ctx, mask=3)
    logprobs, ref_logprobs, mask, last = ctx.saved_tensors
    grad_scores, grad_logp, grad_ref = _kl_penalized_rewards_backward_op(
        logprobs, ref_logprobs, mask, last, grad_rewards, grad_kl, ctx.kl_coef, ctx.estimator, ctx.scores_dtype
    )
    # The scores reach only the rewards: no rewards gradient, no scores gradient.
    return (grad_scores if grad_rewards is not None else None), grad_logp, grad_ref, None, None, None


_kl_penalized_rewards_op.register_autograd(_kl_penalized_rewards_backward, setup_context=_kl_penalized_rewards_setup)


def kl_penalized_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, estimator):
    rewards, kl, _ = _kl_penalized_rewards_op(scores, logprobs, ref_logprobs, mask, kl_coef, estimator)
    return rewards, kl


# --------------------------------------------------------------------------- GAE


@torch.library.custom_op("ppo_fast_triton::gae", mutates_args=())
def _gae_op(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.gae_forward(rewards, values, mask, gamma, lam)


@_gae_op.register_fake
def _(rewards, values, mask, gamma, lam):
    advantages = rewards.new_empty(rewards.shape, dtype=result_dtype(rewards, values))
    return advantages, torch.empty_like(advantages)


@torch.library.custom_op("ppo_fast_triton::gae_backward", mutates_args=())
def _gae_backward_op(
    grad_advantages: torch.Tensor | None,
    grad_returns: torch.Tensor | None,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    rewards_dtype: torch.dtype,
    values_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.gae_backward(grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype, values_dtype)


@_gae_backward_op.register_fake
def _(grad_advantages, grad_returns, mask, gamma, lam, rewards_dtype, values_dtype):
    return mask.new_empty(mask.shape, dtype=rewards_dtype), mask.new_empty(mask.shape, dtype=values_dtype)


def _gae_setup(ctx, inputs, output):
    rewards, values, mask, ctx.gamma, ctx.lam = inputs
    ctx.rewards_dtype, ctx.values_dtype = rewards.dtype, values.dtype
    ctx.save_for_backward(mask)
    ctx.set_materialize_grads(False)


def _gae_backward(ctx, grad_advantages, grad_returns):
    _not_differentiable(ctx, mask=2)
    (mask,) = ctx.saved_tensors
    grad_rewards, grad_values = _gae_backward_op(
        grad_advantages, grad_returns, mask, ctx.gamma, ctx.lam, ctx.rewards_dtype, ctx.values_dtype
    )
    return grad_rewards, grad_values, None, None, None


_gae_op.register_autograd(_gae_backward, setup_context=_gae_setup)


def gae(rewards, values, mask, gamma, lam):
    return _gae_op(rewards, values, mask, gamma, lam)


# --------------------------------------------------------------------------- group_sum


@torch.library.custom_op("ppo_fast_triton::group_sum", mutates_args=())
def _group_sum_op(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    return kernels.group_sum_forward(values, group_index)


@_group_sum_op.register_fake
def _(values, group_index):
    return values.new_empty(values.shape)


def _group_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _group_sum_backward(ctx, grad):
    (group_index,) = ctx.saved_tensors
    return _group_sum_op(grad, group_index), None  # linear and symmetric: its own adjoint


_group_sum_op.register_autograd(_group_sum_backward, setup_context=_group_sum_setup)


def group_sum(values, group_index):
    return _group_sum_op(values.to(result_dtype(values)), group_index)
