"""Drop-in ppo_fast ops for TRL 1.x: ``patch()`` replaces TRL's log-prob functions in place.

::

    import ppo_fast.integrations.trl as pf_trl
    pf_trl.patch()                       # before building the trainer
    trainer = GRPOTrainer(...); trainer.train()

Replaced in ``trl.trainer.utils`` (and every alias in TRL's loaded modules):

* ``selective_log_softmax``, ``entropy_from_logits``, ``selective_log_softmax_and_entropy``
  -> ``pf.token_logprobs`` (``return_entropy=True``), in the dtype TRL returns (the logits'
  dtype on TRL's PyTorch path, float32 where TRL would run its own Triton kernel);
* the fused LM head's ``ChunkedLogProbFunction`` (what ``add_fused_lm_head`` calls: the
  log-probs and entropy of ``hidden @ weight.T`` that GRPOTrainer and RLOOTrainer use)
  -> ``pf.linear_token_logprobs``; calls that also ask for TRL's gradient-free statistics
  (SFT, DPO, KTO: ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``) run TRL's own.

TRL 1.16 exposes no GRPO/PPO loss helper as a function (GRPOTrainer's loss is inline in
``_compute_loss``), so no loss is replaced.  What still differs is listed in
docs/integrations.md.
"""

from __future__ import annotations

from typing import Any

import torch

import ppo_fast as pf

from . import _patching
from ._patching import PatchHandle, Target

PEER = "trl"
DISTRIBUTION = "trl"
SUPPORTED_VERSIONS = ("1",)

_NO_IGNORE = -(2**63)
_MIN_TEMPERATURE = 1e-5
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_ORIG: dict[str, Any] = {}


def _utils():
    import trl.trainer.utils as trl_utils

    return trl_utils


def _original(name: str):
    return _ORIG[name] if name in _ORIG else getattr(_utils(), name)


def _count(name: str) -> None:
    _patching.count(f"{PEER}.{name}")


def _fallback(name: str, *args, **kwargs):
    _patching.count(f"{PEER}.{name}:fallback")
    return _original(name)(*args, **kwargs)


def _backend(tensor: torch.Tensor, op: str = "token_logprobs"):
    return _patching.backend_for(PEER, op, tensor.device.type)


def _trl_dtype(logits, index=None, row_mask=None) -> torch.dtype:
    """The dtype TRL's own function returns here: float32 from its Triton kernel (CUDA/XPU
    with Triton), else the logits' dtype (its PyTorch path).  Uses TRL's own predicate."""
    utils = _utils()
    try:
        kernel = utils.is_triton_available() and utils._supports_trl_loss_kernel(logits, index, row_mask)
    except Exception:  # a TRL without the predicate: its PyTorch path
        kernel = False
    return torch.float32 if kernel else logits.dtype


def _ours_can(logits, index, temperature, row_mask) -> bool:
    return (
        isinstance(logits, torch.Tensor)
        and logits.dtype in _LOGIT_DTYPES
        and logits.dim() >= 1
        and logits.shape[-1] > 0
        and isinstance(index, torch.Tensor)
        and not index.dtype.is_floating_point
        and index.shape == logits.shape[:-1]
        and float(temperature) >= _MIN_TEMPERATURE
        and (row_mask is None or (isinstance(row_mask, torch.Tensor) and row_mask.shape == index.shape))
    )


def _labels(index: torch.Tensor, row_mask) -> torch.Tensor:
    """TRL's skipped rows (``row_mask == 0``) as ignored labels; no other label is ignored."""
    index = index.long()
    return index if row_mask is None else torch.where(row_mask == 0, _NO_IGNORE, index)


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, row_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """TRL's ``selective_log_softmax`` on ``pf.token_logprobs`` (temperature folded into the
    softmax in float32; rows with ``row_mask == 0`` give 0).  A ``(..., K)`` index (K
    log-probs per row) runs TRL's own function."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if not _ours_can(logits, index, temperature, row_mask):
        return _fallback("selective_log_softmax", logits, index, temperature=temperature, row_mask=row_mask)
    _count("selective_log_softmax")
    with _backend(logits):
        logp = pf.token_logprobs(
            logits, _labels(index, row_mask), temperature=float(temperature), ignore_index=_NO_IGNORE
        )
    return logp.to(_trl_dtype(logits, index, row_mask))


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    """TRL's ``entropy_from_logits`` on ``pf.token_logprobs(..., return_entropy=True)``
    (``chunk_size`` is not needed: no ``[N, V]`` intermediate)."""
    if (
        not isinstance(logits, torch.Tensor)
        or logits.dtype not in _LOGIT_DTYPES
        or logits.dim() < 1
        or logits.shape[-1] == 0
    ):
        return _fallback("entropy_from_logits", logits, chunk_size)
    _count("entropy_from_logits")
    labels = torch.zeros((), dtype=torch.long, device=logits.device).expand(logits.shape[:-1])
    with _backend(logits):
        _, entropy = pf.token_logprobs(logits, labels, return_entropy=True)
    return entropy.to(_trl_dtype(logits))


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    index: torch.Tensor,
    entropy_requires_grad: bool = True,
    temperature: float = 1.0,
    row_mask: torch.Tensor | None = None,
):
    """TRL's ``selective_log_softmax_and_entropy``: both from one ``pf.token_logprobs`` call."""
    if temperature <= 0:
        raise ValueError("temperature must be positive")
    if not _ours_can(logits, index, temperature, row_mask):
        return _fallback(
            "selective_log_softmax_and_entropy",
            logits,
            index,
            entropy_requires_grad=entropy_requires_grad,
            temperature=temperature,
            row_mask=row_mask,
        )
    _count("selective_log_softmax_and_entropy")
    with _backend(logits):
        logp, entropy = pf.token_logprobs(
            logits,
            _labels(index, row_mask),
            temperature=float(temperature),
            return_entropy=True,
            ignore_index=_NO_IGNORE,
        )
    dtype = _trl_dtype(logits, index, row_mask)
    entropy = entropy.to(dtype)
    return logp.to(dtype), entropy if entropy_requires_grad else entropy.detach()


# --------------------------------------------------------------------------- fused LM head


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """TRL's projection dtype: autocast's where it is on, else the hidden states'."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _positive(x) -> bool:
    try:
        return float(x) > 0  # False for NaN too
    except (TypeError, ValueError):
        return False


def _head_ours_can(hidden, weight, bias, targets, *, temperature, softcap, logit_scale, outputs) -> bool:
    """Within ``pf.linear_token_logprobs``'s domain and asking only for what it returns.  TRL's
    gradient-free statistics (``log_sum_sq_probs``, ``mean_logits``, ``is_top1``) need the
    logits, which our op never exposes: TRL's own function serves such calls whole, rather
    than projecting the head a second time for them."""
    return (
        isinstance(hidden, torch.Tensor)
        and hidden.dim() == 2
        and hidden.dtype in _LOGIT_DTYPES
        and isinstance(weight, torch.Tensor)
        and weight.dtype in _LOGIT_DTYPES
        and (bias is None or (isinstance(bias, torch.Tensor) and bias.dtype in _LOGIT_DTYPES))
        and isinstance(targets, torch.Tensor)
        and not targets.dtype.is_floating_point
        and set(outputs) <= {"log_probs", "entropy"}
        and float(temperature) >= _MIN_TEMPERATURE
        # TRL keeps a 0 scale and reads a 0 soft-cap as 1: its own code serves those
        and _positive(logit_scale)
        and (softcap is None or _positive(softcap))
    )


class ChunkedLogProbFunction:
    """Stands in for TRL's ``ChunkedLogProbFunction`` (``.apply`` with its signature) on
    ``pf.linear_token_logprobs``: float32 log-probs (and entropy) of
    ``softcap(logit_scale * (hidden @ weight.T + bias)) / temperature``, projected in TRL's
    compute dtype (autocast's, else the hidden states'); the statistics it does not ask for are None."""

    @staticmethod
    def apply(
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        final_logit_softcapping=None,
        logit_scale=1.0,
        outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
    ):
        if not _head_ours_can(
            hidden,
            weight,
            bias,
            targets,
            temperature=temperature,
            softcap=final_logit_softcapping,
            logit_scale=logit_scale,
            outputs=outputs,
        ):
            original = _ORIG.get("_ChunkedLogProbFunction")
            if original is None:
                from trl.kernels import ChunkedLogProbFunction as original
            _patching.count(f"{PEER}.fused_lm_head:fallback")
            return original.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        _count("fused_lm_head")
        cd = _compute_dtype(hidden)
        want_entropy = "entropy" in outputs
        # TRL's labels are never ignored (it drops or clamps -100 before the call).
        with torch.autocast(hidden.device.type, enabled=False), _backend(hidden, "linear_token_logprobs"):
            out = pf.linear_token_logprobs(
                hidden.to(cd),
                weight.to(cd),
                targets,
                bias=None if bias is None else bias.to(cd),
                temperature=float(temperature),
                logit_scale=float(logit_scale),
                logit_softcap=None if final_logit_softcapping is None else float(final_logit_softcapping),
                return_entropy=want_entropy,
                ignore_index=_NO_IGNORE,
            )
        logp, entropy = out if want_entropy else (out, None)
        return logp.float(), (entropy.float() if want_entropy else None), None, None, None


# --------------------------------------------------------------------------- patching

_FUNCTIONS = ("selective_log_softmax", "entropy_from_logits", "selective_log_softmax_and_entropy")

#: What ``patch()`` replaces (for documentation and tests).
REPLACED = {"trl.trainer.utils": _FUNCTIONS + ("_ChunkedLogProbFunction",)}


def _targets() -> list[Target]:
    utils = _utils()
    targets = []
    for name in _FUNCTIONS:
        _ORIG[name] = getattr(utils, name)
        targets.append(Target(utils, name, globals()[name]))
    if hasattr(utils, "_ChunkedLogProbFunction"):
        _ORIG["_ChunkedLogProbFunction"] = utils._ChunkedLogProbFunction
        targets.append(Target(utils, "_ChunkedLogProbFunction", ChunkedLogProbFunction))
    return targets


def patch(backend: str = "auto") -> PatchHandle:
    """Replace TRL's log-prob functions (and its fused LM head's) by ppo_fast's, in place.

    Returns a handle (a context manager).  ``backend`` as in :func:`ppo_fast.integrations.verl.patch`.
    Patching twice is harmless; a TRL other than 1.x raises :class:`UnsupportedPeerVersion`.
    """
    version = _patching.check_version(PEER, DISTRIBUTION, SUPPORTED_VERSIONS)
    return _patching.install(PEER, "trl", backend, version, _targets)


def unpatch() -> None:
    """Restore TRL's originals (whatever handles are still open)."""
    _patching.restore_all(PEER)


def is_patched() -> bool:
    return _patching.is_patched(PEER)


UnsupportedPeerVersion = _patching.UnsupportedPeerVersion
