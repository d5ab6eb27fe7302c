"""Public op: the policy loss straight from the last hidden states and the LM head, its
gradients taken in one pass over chunks of whole sequences or of tokens (a fused LM head and loss)."""

from __future__ import annotations

import torch

from .. import _validation as check
from .._dtypes import result_dtype
from .._sampling import truncation as checked_truncation
from .._varlen import Segments, backend_of, varlen
from ..backends import reference, resolve
from ..backends._head_plan import token_slices
from ..backends._one_pass import Head, PerToken, Terms
from ..spec import AGG_MODES, KL_ESTIMATORS, policy_loss_mode
from .aggregate import aggregate, masked_mean
from .kl_penalized_rewards import kl_estimate
from .linear_token_logprobs import _check_head, linear_token_logprobs
from .policy_loss import policy_loss
from .token_logprobs import MIN_TEMPERATURE

__all__ = ["linear_policy_loss", "policy_objective"]


def _linear_policy_loss_packed(segments, *inputs, **options):
    """``linear_policy_loss`` on packed tokens (``hidden [N, H]``, the per-token tensors ``[N]``), as one
    row ``[1, N]`` without their padded layout (``_loss``)."""
    hidden, weight, labels, old_logprobs, advantages, mask = inputs
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be [N, H] (the packed tokens) with cu_seqlens, got shape {shape}")
    rows = {name: options[name][None] for name in ("weights", "ref_logprobs") if options.get(name) is not None}
    old, adv = old_logprobs[None], advantages[None]
    return _loss(hidden[None], weight, labels[None], old, adv, mask[None], packed=segments, **(options | rows))


@varlen(
    "hidden",
    "labels",
    "old_logprobs",
    "advantages",
    "mask",
    "weights",
    "ref_logprobs",
    packed=_linear_policy_loss_packed,
)
def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    agg: str | None = None,
    weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    ignore_index: int = -100,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    **mode_params: float | None,
):
    """The policy loss of ``loss_mode`` on the LM head's log-probs, plus the KL and entropy terms, no logits.

    The value and gradients of ``policy_loss(logp, old_logprobs, advantages, mask, ...) - entropy_coef *
    masked_mean(entropy, mask) + kl_coef * aggregate(kl_estimate(logp, ref_logprobs, kl_estimator), mask,
    agg)`` with ``logp, entropy = linear_token_logprobs(hidden, weight, labels, ...)``, in one pass: each
    chunk of whole sequences gets its logits, log-probs, entropy and loss gradient, and at once its share
    of ``d_hidden``, ``d_weight``, ``d_bias`` (three products, no recompute); the backward scales them.
    The normalisers (valid tokens, responses) come from ``mask`` first.  Modes whose token selection spans
    the batch (``fused_head=False``: ``clip_cov``, ``kl_cov``) take ``linear_token_logprobs`` then ``policy_loss``.

    Packed (``cu_seqlens``, ``hidden [N, H]``): a token-level mode's chunks are any ``N``-token slices (each
    token's factor of ``agg`` is computed on the device first).  A sequence-level mode (``gspo``,
    ``geo_mean``) needs each sequence's mean before any of its tokens' gradients, so its chunks are whole
    sequences, cut at sequence ends read from ``cu_seqlens`` (a sequence longer than a chunk is one chunk,
    as a padded row of that length would be): it takes the one pass where that read is free, a
    ``cu_seqlens`` on the host in eager mode, whatever the tokens' device (beside CUDA tokens it is
    checked on the host and copied without a sync), and ``linear_token_logprobs`` then its packed terms
    where it is not (a ``cu_seqlens`` on CUDA, whose read would sync the host, and torch.compile), with
    the same results.  A token-level mode's padded call of
    sequences longer than the chunk plan's step (128 tokens) is chunked as the packed layout's token
    slices, so that its chunks' rows follow the plan rather than ``T``.

    Args:
        hidden: ``[B, T, H]`` last hidden states of whole sequences; weight ``[V, H]``, bias
            ``[V]``, temperature, logit_scale, logit_softcap, ignore_index: as in
            ``pf.linear_token_logprobs``.
        labels: ``[B, T]`` the sampled tokens; positions where ``mask`` is False are not read.
        old_logprobs: ``[B, T]`` rollout log-probs, as in ``pf.policy_loss``.
        advantages: ``[B, T]``, as in ``pf.policy_loss``.
        mask: ``[B, T]`` 1/True at valid response tokens, as in ``pf.policy_loss``.
        loss_mode: a name in ``pf.policy_loss_modes()``, as in ``pf.policy_loss``.
        agg: the aggregation (None: the mode's default), as in ``pf.policy_loss``.
        weights: optional ``[B, T]`` per-token weights, as in ``pf.policy_loss``.
        **mode_params: the mode's parameters, as in ``pf.policy_loss``.
        ref_logprobs: optional ``[B, T]`` reference log-probs of the KL loss term (``kl_coef``).
        kl_estimator: ``k1``, ``k2``, ``k3`` or ``abs`` (``pf.kl_estimate``).
        entropy_coef: weight of the entropy bonus (the token mean of the entropy, subtracted).
        top_k: the sampler's top-k, as in ``pf.linear_token_logprobs`` (the same kept sets).
        top_p: the sampler's nucleus threshold, as in ``pf.linear_token_logprobs``.
        min_p: the sampler's min-p, as in ``pf.linear_token_logprobs``.

    Returns:
        ``(loss, stats)``: the 0-dim total loss, differentiable w.r.t. ``hidden``, ``weight`` and
        ``bias`` (old_logprobs, advantages, weights and ref_logprobs are constants), and 0-dim
        detached stats: the mode's ``stats``, ``pg_loss`` (the policy loss alone), ``entropy``
        (its token mean) and, with ``ref_logprobs``, ``kl_loss``.
    """
    options = dict(loss_mode=loss_mode, agg=agg, weights=weights, bias=bias, ref_logprobs=ref_logprobs)
    head = dict(
        temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap, ignore_index=ignore_index
    )
    terms = dict(kl_coef=kl_coef, kl_estimator=kl_estimator, entropy_coef=entropy_coef, top_k=top_k, top_p=top_p)
    return _loss(
        hidden, weight, labels, old_logprobs, advantages, mask, **options, **head, **terms, min_p=min_p, **mode_params
    )


def _loss(
    hidden,
    weight,
    labels,
    old_logprobs,
    advantages,
    mask,
    *,
    loss_mode="vanilla",
    agg=None,
    weights=None,
    bias=None,
    ref_logprobs=None,
    temperature=1.0,
    logit_scale=1.0,
    logit_softcap=None,
    ignore_index=-100,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy_coef=0.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    packed=None,
    **mode_params,
):
    """``linear_policy_loss``'s body; ``packed``: the packed layout's segments, of ``[1, N]`` tensors
    (``_packed_one_pass``)."""
    mode = policy_loss_mode(loss_mode)
    params = mode.bind(mode_params)
    x, labels = _check_tensors(
        hidden, weight, labels, bias, PerToken(old_logprobs, advantages, mask, weights, ref_logprobs)
    )
    agg = check.choice("agg", mode.default_agg if agg is None else agg, AGG_MODES)
    head = _checked_head(temperature, logit_scale, logit_softcap, ignore_index)
    terms = Terms(*_checked_terms(kl_coef, kl_estimator, entropy_coef, ref_logprobs))
    truncation = checked_truncation(top_k, top_p, min_p, weight.shape[0])
    labels = torch.where(x.mask, labels, head.ignore_index)  # masked tokens: ignored rows of the head
    if labels.numel() and check.host_checks_free(labels):
        check.labels_in_range(labels, weight.shape[0], head.ignore_index)
    long_rows = hidden.shape[0] > 0 and token_slices(hidden.shape[1])  # an empty batch: nothing to chunk
    if packed is None and mode.fused_head and not mode.sequence_level and long_rows:
        hidden, labels, x, packed = _padded_as_packed(hidden, labels, x)
    on_host = packed is not None and mode.sequence_level and _host_bounds(packed)
    if not mode.fused_head or (packed is not None and mode.sequence_level and not on_host):
        two_pass = dict(bias=bias, head=(head, truncation), terms=terms, objective=(mode, params, agg))
        if packed is not None:  # the packed tokens as [N] again (``_objective`` takes them so)
            return _two_pass(hidden[0], weight, labels[0], x.rows(0), **two_pass, packed=packed)
        return _two_pass(hidden, weight, labels, x, **two_pass)
    one_pass = agg
    if packed is not None:
        if on_host:  # a sequence-level mode: chunks of whole sequences, its terms on them (``PerToken.bounds``)
            x = x._replace(bounds=packed.host)
        else:
            x, one_pass = _packed_one_pass(packed, x, agg, result_dtype(hidden, x.old, x.adv, x.weights))
    loss, pg_loss, entropy, kl_loss, *stats = resolve(mode.linear_op, hidden.device.type)(
        hidden, weight, labels, x, bias=bias, head=head, terms=terms, params=params, agg=one_pass, truncation=truncation
    )
    return loss, _stats(mode, stats, pg_loss, entropy, kl_loss if ref_logprobs is not None else None)


def _padded_as_packed(hidden, labels, x: PerToken) -> tuple:
    """``(hidden, labels, x, segments)``: a padded call's ``[B, T]`` tokens as the packed layout's one row
    ``[1, B T]`` (views where contiguous; the gradient reaches ``[B, T, H]`` through the reshape), a
    sequence every ``T`` tokens and ``max_seqlen`` ``T`` (``seq-mean-token-sum-norm``'s ``T``).  Its chunks
    are then token slices of the plan's rows, where whole sequences of ``T`` rows would not be
    (``_head_plan.token_slices``).  The ends are made on the tokens' device: no host sync."""
    batch, length = labels.shape
    tokens = batch * length
    ends = torch.arange(0, tokens + 1, length, device=hidden.device)
    segments = Segments.of(ends, tokens, hidden.device, max_seqlen=length)
    row = PerToken(*(None if t is None else t.reshape(1, tokens) for t in x))
    return hidden.reshape(1, tokens, hidden.shape[-1]), labels.reshape(1, tokens), row, segments


def _packed_one_pass(segments, x: PerToken, agg: str, dtype: torch.dtype) -> tuple[PerToken, str]:
    """``(x, agg)`` of the one pass on the packed ``[1, N]`` row: each token's factor of ``agg`` (1 for
    ``token-mean`` and ``token-sum``, a ``seq-mean-*`` one's ``token-sum`` weight of it from each segment's
    valid tokens and the responses, ``reference.segment_scale``), computed on the device from
    ``cu_seqlens``: every term of a token-level mode is then local to its token, and the backends'
    chunks split the row (``_loss_terms.PerToken.scale``)."""
    scale = reference.segment_scale(segments, x.mask[0], agg, dtype)
    if scale is None:
        return x._replace(scale=x.mask.new_ones(x.mask.shape, dtype=dtype)), agg
    return x._replace(scale=scale[None]), "token-sum"


def _host_bounds(segments) -> bool:
    """Whether a sequence-level mode's packed one pass can plan its chunks at sequence ends: ``cu_seqlens``
    given on the host, in eager mode (``Segments.host``: reading it is free, whatever the tokens' device).
    Given on CUDA, reading it would sync the host, and under torch.compile it would break the graph:
    those calls take the two passes."""
    return segments.host is not None and not torch.compiler.is_compiling()


def _checked_head(temperature, logit_scale, logit_softcap, ignore_index) -> Head:
    return Head(
        check.real("temperature", temperature, low=MIN_TEMPERATURE),
        check.real("logit_scale", logit_scale, low=0.0, low_open=True),
        None if logit_softcap is None else check.real("logit_softcap", logit_softcap, low=0.0, low_open=True),
        check.integer("ignore_index", ignore_index),
    )


def _checked_terms(kl_coef, kl_estimator, entropy_coef, ref_logprobs) -> tuple:
    """``(kl_coef, kl_estimator, entropy_coef)`` of the KL loss term and the entropy bonus, checked."""
    kl_coef = check.real("kl_coef", kl_coef, low=0.0)
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs ([B, T] reference log-probs), got None")
    return kl_coef, check.choice("kl_estimator", kl_estimator, KL_ESTIMATORS), check.real("entropy_coef", entropy_coef)


def _check_tensors(hidden, weight, labels, bias, x: PerToken) -> tuple[PerToken, torch.Tensor]:
    """The tensors' dtypes, shapes and devices; returns ``(x with its mask as bool, labels as int64)``."""
    check.tensor("hidden", hidden, dtypes=None)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [B, T, H] (whole sequences), got shape {tuple(hidden.shape)}")
    _check_head(hidden, weight, labels, bias)
    mask = check.loss_inputs(
        {"old_logprobs": x.old, "advantages": x.adv, "weights": x.weights, "ref_logprobs": x.ref},
        x.mask,
        optional=("weights", "ref_logprobs"),
    )
    check.same_shape("labels", labels, old_logprobs=x.old)
    check.same_device(hidden=hidden, weight=weight, labels=labels, bias=bias, old_logprobs=x.old)
    return x._replace(mask=mask), labels.long()


def _stats(mode, stats, pg_loss, entropy, kl_loss) -> dict:
    out = {**dict(zip(mode.stats, stats)), "pg_loss": pg_loss, "entropy": entropy}
    if kl_loss is not None:
        out["kl_loss"] = kl_loss
    return out


def _two_pass(hidden, weight, labels, x: PerToken, *, bias, head: tuple, terms: Terms, objective, packed=None):
    """``linear_token_logprobs`` then ``policy_objective`` (modes whose token selection spans the batch, and
    the sequence-level modes on packed tokens, ``[N]`` then, with their ``packed`` segments); ``head =
    (Head, Truncation)``."""
    mode, params, agg = objective
    head, truncation = head
    logp, entropy = linear_token_logprobs(
        hidden,
        weight,
        labels,
        bias=bias,
        temperature=head.temperature,
        logit_scale=head.logit_scale,
        logit_softcap=head.logit_softcap,
        return_entropy=True,
        ignore_index=head.ignore_index,
        top_k=truncation.top_k,
        top_p=truncation.top_p,
        min_p=truncation.min_p,
    )
    if packed is not None and mode.fused_head:
        return _sequence_level_packed(packed, logp, entropy, x, objective, terms)
    mode_params = mode.named(params)
    return _objective(
        logp,
        entropy,
        x.old,
        x.adv,
        x.mask,
        loss_mode=mode.name,
        agg=agg,
        weights=x.weights,
        ref_logprobs=x.ref,
        **terms._asdict(),
        packed=packed,
        **mode_params,
    )


def _sequence_level_packed(segments, logp, entropy, x: PerToken, objective, terms: Terms):
    """A sequence-level mode's (GSPO, GMPO) terms on packed ``[N]`` log-probs: its reference function on the
    segments (``reference.sequence_level_packed``), as the one pass takes a mode's per-token terms from its
    reference function (on whatever backend serves the head), and the entropy and KL terms; the rollout's
    tensors are constants where the backend's one pass takes them so (all but the reference's)."""
    mode, params, agg = objective
    if backend_of(mode.linear_op, logp.device.type) != "reference":
        x = PerToken(*(None if t is None else t.detach() for t in x))
    pg, *stats = reference.sequence_level_packed(
        mode.op, segments, logp, x.old, x.adv, x.mask, x.weights, agg=agg, **mode.named(params)
    )
    entropy_mean = reference.masked_mean(entropy, x.mask)
    loss = pg - terms.entropy_coef * entropy_mean
    kl_loss = None
    if x.ref is not None:
        kl = reference.kl_estimate(logp, x.ref, terms.kl_estimator)
        kl_loss = reference.aggregate_packed(segments, kl, x.mask, agg)
        loss = loss + terms.kl_coef * kl_loss
        kl_loss = kl_loss.detach()
    return loss, _stats(mode, [s.detach() for s in stats], pg.detach(), entropy_mean.detach(), kl_loss)


def _objective_packed(segments, *args, **kwargs):
    return _objective(*args, packed=segments, **kwargs)


@varlen(
    "logprobs", "entropy", "old_logprobs", "advantages", "mask", "weights", "ref_logprobs", packed=_objective_packed
)
def policy_objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_mode: str = "vanilla",
    agg: str | None = None,
    weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    **mode_params: float | None,
):
    """The loss ``linear_policy_loss`` takes in one pass, from log-probs and entropy already scored:
    ``policy_loss(logprobs, ...) - entropy_coef * masked_mean(entropy, mask) + kl_coef *
    aggregate(kl_estimate(logprobs, ref_logprobs, kl_estimator), mask, agg)``.

    Returns ``(loss, stats)`` with ``linear_policy_loss``'s stats: the mode's, ``pg_loss``,
    ``entropy`` (its token mean) and, with ``ref_logprobs``, ``kl_loss``; differentiable wherever
    its inputs are.
    """
    return _objective(
        logprobs,
        entropy,
        old_logprobs,
        advantages,
        mask,
        loss_mode=loss_mode,
        agg=agg,
        weights=weights,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        **mode_params,
    )


def _objective(
    logprobs,
    entropy,
    old_logprobs,
    advantages,
    mask,
    *,
    loss_mode="vanilla",
    agg=None,
    weights=None,
    ref_logprobs=None,
    kl_coef=0.0,
    kl_estimator="k3",
    entropy_coef=0.0,
    packed=None,
    **mode_params,
):
    """``policy_objective``'s terms; ``packed``: the packed layout's segments, passed on to each term."""
    mode = policy_loss_mode(loss_mode)
    agg = mode.default_agg if agg is None else agg
    kl_coef, kl_estimator, entropy_coef = _checked_terms(kl_coef, kl_estimator, entropy_coef, ref_logprobs)
    layout = {}
    if packed is not None:
        known = packed.max_seqlen if isinstance(packed.max_seqlen, int) else None
        layout = {"cu_seqlens": packed.cu_seqlens, "max_seqlen": known}
    pg_loss, stats = policy_loss(
        logprobs, old_logprobs, advantages, mask, loss_mode=mode.name, agg=agg, weights=weights, **mode_params, **layout
    )
    entropy_mean = masked_mean(entropy, mask, **layout)
    loss = pg_loss - entropy_coef * entropy_mean
    kl_loss = None
    if ref_logprobs is not None:
        kl_loss = aggregate(kl_estimate(logprobs, ref_logprobs, kl_estimator), mask, agg, **layout)
        loss = loss + kl_coef * kl_loss
        kl_loss = kl_loss.detach()
    return loss, _stats(mode, list(stats.values()), pg_loss.detach(), entropy_mean.detach(), kl_loss)
