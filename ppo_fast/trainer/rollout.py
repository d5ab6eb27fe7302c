"""Rollouts: batched sampling with the KV cache, then the forward passes PPO needs."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

import ppo_fast as pf

from . import packing
from .models import Critic


@dataclass
class Batch:
    """Prompt + response token ids of a set of rollouts; the prompt is left-padded to ``prompt_width``."""

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R], 0 at prompt padding and after the response's EOS
    prompt_width: int

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width :]

    @property
    def response_mask(self) -> torch.Tensor:
        return self.attention_mask[:, self.prompt_width :].bool()

    @property
    def position_ids(self) -> torch.Tensor:
        # As generate() counts them with left padding: from 0 at the first real token.
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)

    def rows(self, index: torch.Tensor) -> Batch:
        return Batch(self.input_ids[index], self.attention_mask[index], self.prompt_width)


@dataclass(kw_only=True)
class Rollouts:
    """One step's rollouts, filled in as the loop goes: the prompts drawn (one row per response),
    the responses and the log-probs they were sampled with by the engine (None: sampled by the
    policy itself), the first epoch's shuffle, the policy's, reference's and critic's scores in it,
    the rollout-correction weights (``off_policy.loss_inputs``: in bypass mode the old log-probs are the
    engine's), then the responses' text and rewards."""

    prompts: list[str]
    answers: list[str | None]
    batch: Batch
    engine_logprobs: torch.Tensor | None
    first_order: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor | None
    loss_weights: torch.Tensor | None = None
    off_policy_metrics: dict | None = None  # the engine/trainer mismatch (off_policy.mismatch_metrics)
    responses: list[str] | None = None
    scores: torch.Tensor | None = None
    columns: dict[str, list] | None = None  # the prompts' rows' other columns, for the reward functions

    @property
    def mask(self) -> torch.Tensor:
        return self.batch.response_mask


def response_mask_until_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """True up to and including each row's first EOS (everything if there is none)."""
    is_eos = response_ids == eos_token_id
    eos_before = is_eos.long().cumsum(-1) - is_eos.long()
    return eos_before == 0


def encode_prompts(tokenizer, prompts: list[str], device) -> dict:
    """The prompts' token ids, left-padded (``input_ids``, ``attention_mask``): the same for every rollout engine."""
    return tokenizer(prompts, padding=True, return_tensors="pt", padding_side="left").to(device)


def encode_continuations(tokenizer, prompts: list[str], prefixes: list[list[int]], device) -> dict:
    """Each prompt's token ids (as ``encode_prompts`` encodes them) followed by its response's ``prefix``, the
    rows left-padded: the input that continues those responses."""
    enc = encode_prompts(tokenizer, prompts, "cpu")
    rows = [
        ids[mask.bool()].tolist() + list(prefix)
        for ids, mask, prefix in zip(enc["input_ids"], enc["attention_mask"], prefixes)
    ]
    width = max(map(len, rows))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows], dtype=torch.long)
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def batch_from_responses(enc, response: torch.Tensor, mask: torch.Tensor, pad_token_id: int) -> Batch:
    """Encoded prompts + ``[B, R]`` responses whose tokens outside ``mask`` become padding."""
    response = response.masked_fill(~mask, pad_token_id)
    input_ids = torch.cat([enc["input_ids"], response], dim=1)
    attention_mask = torch.cat([enc["attention_mask"].bool(), mask], dim=1)
    return Batch(input_ids, attention_mask, enc["input_ids"].shape[1])


@torch.no_grad()
def generate(
    policy,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
    top_k: int = 0,
    min_p: float = 0.0,
    synced_gpus: bool = False,
    logits_processor=None,
    stop=None,
    extra: dict | None = None,
    prefixes: list[list[int]] | None = None,
    criteria: list | None = None,
) -> Batch:
    """Sample (or greedily decode) responses; tokens after the first EOS become padding.
    ``synced_gpus``: every rank runs the same number of forward passes (sharded weights);
    ``logits_processor``: a ``LogitsProcessorList`` for ``generate`` (run before its temperature and truncation);
    ``stop``: ``rollout_hf.StopStrings`` (tokens after a stop string become padding too); ``extra``: more of
    ``generate``'s keywords (``--repetition-penalty``, ``--generation-kwargs``); ``prefixes``: each row's response so
    far (token ids), continued (``--partial-rollouts``): the batch's prompts then hold them, its responses the new tokens;
    ``criteria``: more stopping criteria for ``generate`` (``rollout_hf.TimeUp``)."""
    if prefixes is None:
        enc = encode_prompts(tokenizer, prompts, policy.device)
    else:
        enc = encode_continuations(tokenizer, prompts, prefixes, policy.device)
    sampling = (
        dict(do_sample=False)
        if greedy
        else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p or None)
    )
    if logits_processor is not None:
        sampling["logits_processor"] = logits_processor
    if stop is not None or criteria:
        own = [] if stop is None else list(stop.criteria(enc["input_ids"].shape[1]))
        sampling["stopping_criteria"] = own + list(criteria or ())
    out = policy.generate(
        **enc,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        synced_gpus=synced_gpus,
        **sampling,
        **(extra or {}),
    )
    response = out[:, enc["input_ids"].shape[1] :]
    mask = response_mask_until_eos(response, tokenizer.eos_token_id)
    if stop is not None:
        mask &= stop.mask(response)
    return batch_from_responses(enc, response, mask, tokenizer.pad_token_id)


def decode_responses(tokenizer, batch: Batch) -> list[str]:
    return tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)


# Config fields of causal-LM heads that transform the logits in ways linear_token_logprobs
# does not take: such a model is scored from its logits.
_OTHER_LOGIT_TRANSFORMS = ("logits_scaling", "lm_head_multiplier", "output_multiplier")
_fallbacks_logged: set[str] = set()


def _is_fsdp(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _fused_head(model, device: torch.device):
    """``(backbone, head kwargs for linear_token_logprobs)`` when ``model`` is a causal LM whose
    logits are ``softcap(logit_scale * head(backbone(...).last_hidden_state))`` with a linear
    head (``get_output_embeddings()``, tied or not), else ``(None, why not)``."""
    if _is_fsdp(model):
        # FSDP2 gathers the root's weights (embeddings, head) only around the model's own forward.
        return None, f"{type(model).__name__} is sharded with FSDP2"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    backbone = getattr(model, "base_model", None)
    config = getattr(model, "config", None)
    # PEFT's modules_to_save (--lora-modules-to-save lm_head) wraps the head: its weight and bias are the
    # trained copy's, or the base's with the adapters off (the reference), read at each call.
    linear = getattr(head, "original_module", head)
    if type(linear) is not torch.nn.Linear or backbone is None or backbone is model or config is None:
        return None, f"{type(model).__name__} has no plain linear output embedding on a backbone"
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    other = [name for name in _OTHER_LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1, 1.0)]
    if other:
        return None, f"{type(model).__name__} transforms its logits ({', '.join(other)})"
    try:
        pf.backend_for("linear_token_logprobs", device)
    except pf.BackendUnavailableError as err:
        return None, str(err)
    return backbone, {
        "weight": head.weight,
        "bias": head.bias,
        "logit_scale": float(getattr(config, "logit_scale", None) or 1.0),
        "logit_softcap": getattr(config, "final_logit_softcapping", None),
    }


@dataclass(frozen=True, kw_only=True)
class ScoreRequest:
    """Score the response tokens: the scorer returns ``(logprobs, entropy or None, hidden states or None)``,
    at ``temperature`` with the sampler's ``truncation`` (``TrainerConfig.logprob_truncation``)."""

    temperature: float
    entropy: bool
    hidden_states: bool
    truncation: dict | None = None
    packed: bool = False


@dataclass(frozen=True, kw_only=True)
class LossRequest:
    """The update's policy objective in one pass through the fused LM head (``pf.linear_policy_loss``):
    the scorer returns ``(loss, stats)``.  ``terms``: ``update.loss_terms`` (the mode, its parameters,
    the aggregation, the weights, the entropy bonus and the KL loss term).  Its ``[B, R]`` tensors (and the
    terms' ``weights`` and ``ref_logprobs``) are read at the response tokens only when ``packed``: ``mask``
    must lie within the batch's response mask, the tokens the packed layout scores."""

    temperature: float
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    terms: dict
    packed: bool = False


class ResponseScorer(torch.nn.Module):
    """A causal LM's per-response-token ``(logprobs, entropy or None, the hidden states that score
    them or None)`` as a module's forward, the rows padded or packed (``packing.layout``): from the backbone's last hidden states through
    ``linear_token_logprobs`` (no [B, T, V] logits), or, for a non-standard head, from the
    model's logits (said once in a log line).

    DDP wraps this module, not the model (``Parallel.prepare``): DDP synchronises the
    gradients of what runs inside its own forward, and the fused head calls the backbone and
    the head weight apart, not the model's forward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, response_ids, request: ScoreRequest | LossRequest):
        """What ``request`` asks: a ``ScoreRequest``'s scores, or a ``LossRequest``'s ``(loss, stats)`` (the
        fused head only: the run decides that once, ``update.loss_path``).  ``request.packed``: the rows'
        real tokens packed into fewer rows (``packing``).  The hidden states returned are those that
        score the response tokens, ``[B, R, H]``."""
        rows = packing.layout(input_ids, attention_mask, position_ids, response_ids, request.packed)
        backbone, head = _fused_head(self.model, input_ids.device)
        if isinstance(request, LossRequest):
            if backbone is None:
                raise RuntimeError(f"ResponseScorer: a LossRequest needs the fused LM head: {head}")
            hidden = rows.pick(backbone(**rows.inputs).last_hidden_state)
            head = _in_head_dtype(hidden, head)
            return _policy_loss(rows, hidden.to(head["weight"].dtype), head, request)
        truncation = request.truncation or {}
        if backbone is not None:
            hidden = rows.pick(backbone(**rows.inputs).last_hidden_state)
            head = _in_head_dtype(hidden, head)
            result = pf.linear_token_logprobs(
                hidden.to(head["weight"].dtype),
                labels=rows.labels,
                temperature=request.temperature,
                return_entropy=request.entropy,
                **truncation,
                **head,
            )
        else:
            _say_logits_fallback(head)
            out = self.model(**rows.inputs, output_hidden_states=request.hidden_states)
            hidden = rows.pick(out.hidden_states[-1]) if request.hidden_states else None
            result = pf.token_logprobs(
                rows.pick(out.logits),
                rows.labels,
                temperature=request.temperature,
                return_entropy=request.entropy,
                **truncation,
            )
        logprobs, token_entropy = result if request.entropy else (result, None)
        spread = rows.spread
        return (
            spread(logprobs),
            None if token_entropy is None else spread(token_entropy),
            spread(hidden) if request.hidden_states else None,
        )


# The LossRequest's per-token tensors among its terms (the rest are the mode's and the aggregation's settings).
_PER_TOKEN_TERMS = ("weights", "ref_logprobs")


def _policy_loss(rows, hidden: torch.Tensor, head: dict, request: LossRequest):
    """``pf.linear_policy_loss`` of ``request`` on ``hidden``, the states that score the response tokens in
    ``rows``' layout (``packing.layout``): padded ``[B, R, H]``, or packed ``[M, H]``, each response one
    sequence (``cu_seqlens``) and the ``[B, R]`` inputs gathered to its tokens, so that no padded copy is made."""
    terms = dict(request.terms)
    per_token = {"old_logprobs": request.old_logprobs, "advantages": request.advantages, "mask": request.mask}
    per_token |= {name: terms.pop(name) for name in _PER_TOKEN_TERMS if terms.get(name) is not None}
    width = None
    if rows.cu_seqlens is not None and terms["agg"] == "seq-mean-token-sum-norm":  # update.loss_terms sets agg
        # Its T is the padded response width R, which the packed responses do not carry (theirs is the
        # longest response): seq-mean-token-sum / R, the entropy bonus (a token mean) scaled to stay as it is.
        width = rows.shape[1]
        terms |= {"agg": "seq-mean-token-sum", "entropy_coef": terms.get("entropy_coef", 0.0) * width}
    loss, stats = pf.linear_policy_loss(
        hidden,
        labels=rows.labels,
        temperature=request.temperature,
        cu_seqlens=rows.cu_seqlens,
        **head,
        **{name: rows.gather(x) for name, x in per_token.items()},
        **terms,
    )
    if width is None:
        return loss, stats
    return loss / width, {name: s / width if name in ("pg_loss", "kl_loss") else s for name, s in stats.items()}


def _in_head_dtype(hidden: torch.Tensor, head: dict) -> dict:
    """The head's tensors in the dtype the head runs in (``_head_dtype``)."""
    dtype = _head_dtype(hidden, head)
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in head.items()}


def _head_dtype(hidden: torch.Tensor, head: dict) -> torch.dtype:
    """The dtype the head would run in: autocast's (bf16 on CUDA) or its own."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else head["weight"].dtype


def _say_logits_fallback(why: str) -> None:
    if why not in _fallbacks_logged:
        _fallbacks_logged.add(why)
        print(f"ppo-fast: log-probs from the full logits, not the fused LM head: {why}", file=sys.stderr)


def fused_head_problem(policy, device: torch.device) -> str | None:
    """Why ``policy`` (a causal LM or a (DDP-wrapped) ``ResponseScorer`` of one) does not score its
    responses through the fused LM head, or None when it does."""
    scorer = getattr(policy, "module", policy)
    model = scorer.model if isinstance(scorer, ResponseScorer) else scorer
    backbone, why = _fused_head(model, device)
    return None if backbone is not None else why


def scores_through_fused_head(policy, device: torch.device) -> bool:
    """Whether ``policy`` (a causal LM or a (DDP-wrapped) ``ResponseScorer`` of one) scores its
    responses through the fused LM head."""
    return fused_head_problem(policy, device) is None


def _scorer(model):
    """``model`` as a ``ResponseScorer`` (a causal LM gets one; a (DDP-wrapped) scorer is itself)."""
    return model if isinstance(getattr(model, "module", model), ResponseScorer) else ResponseScorer(model)


def _response_scores(
    model,
    batch: Batch,
    *,
    temperature: float,
    entropy: bool,
    hidden_states: bool,
    truncation: dict | None = None,
    packed: bool = False,
):
    """``ResponseScorer``'s scores for ``batch``; ``model`` is a causal LM or a (DDP-wrapped) scorer."""
    request = ScoreRequest(
        temperature=temperature, entropy=entropy, hidden_states=hidden_states, truncation=truncation, packed=packed
    )
    return _scorer(model)(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids, request)


def policy_loss_through_head(model, batch: Batch, request: LossRequest):
    """``(loss, stats)`` of ``pf.linear_policy_loss`` for ``batch`` through ``model``'s fused head."""
    return _scorer(model)(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids, request)


def packs(batch: Batch, padding_free: bool) -> bool:
    """Whether ``batch``'s forward passes run packed: ``--padding-free`` and padded enough to pay
    (``packing.worth_packing``); decided once per micro-batch, for the policy and the critic."""
    return padding_free and packing.worth_packing(batch.attention_mask)


def critic_values(critic: Critic, batch: Batch, packed: bool = False) -> torch.Tensor:
    """A separate critic's ``[B, R]`` values at the positions that score the response tokens."""
    rows = packing.layout(batch.input_ids, batch.attention_mask, batch.position_ids, batch.response_ids, packed)
    inputs = rows.inputs
    return rows.spread(rows.pick(critic(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])))


def forward(
    policy,
    critic: Critic | None,
    batch: Batch,
    *,
    temperature: float,
    entropy: bool = False,
    values: bool = False,
    truncation: dict | None = None,
    packed: bool = False,
):
    """Per-response-token ``(logprobs, entropy or None, values or None)`` under the current weights,
    at ``temperature`` with the sampler's ``truncation`` (``TrainerConfig.logprob_truncation``).

    ``policy`` is a causal LM or a (DDP-wrapped) ``ResponseScorer`` of one.  The values are
    read at the positions whose logits score the response (the state before each token).
    ``packed``: ``--padding-free`` (``packs``); zeros outside the response mask.
    """
    packed = packs(batch, packed)
    shared_values = values and critic is not None and critic.shared
    logprobs, token_entropy, hidden = _response_scores(
        policy,
        batch,
        temperature=temperature,
        entropy=entropy,
        hidden_states=shared_values,
        truncation=truncation,
        packed=packed,
    )
    token_values = None
    if values:
        if shared_values:  # the hidden states at the scoring positions
            token_values = critic.head(hidden)
        else:
            token_values = critic_values(critic, batch, packed)
        token_values = token_values.float()
    return logprobs, token_entropy, token_values


@torch.no_grad()
def score_old_and_ref(
    policy,
    reference,
    critic,
    batch: Batch,
    *,
    temperature: float,
    groups: list[torch.Tensor] | None = None,
    truncation: dict | None = None,
    reference_scope=contextlib.nullcontext,
    packed: bool = False,
    old: bool = True,
):
    """Old log-probs (None unless ``old``: ``off_policy.recomputes_old``), reference log-probs and (with a
    critic) values, dropout off, in ``groups`` of rows (the update's first micro-batches; by default all rows
    at once).  Without ``old`` the policy's forward is skipped, unless a shared critic reads it.
    The reference is scored inside ``reference_scope()`` (LoRA: the policy with its adapters off).

    Scored in the update's first micro-batches (same rows, same layout, same kernels), the
    old log-probs equal the first micro-batch's new ones bitwise: its ratio is exactly 1."""
    rows = batch.input_ids.shape[0]
    groups = [torch.arange(rows, device=batch.input_ids.device)] if groups is None else groups
    wanted_old, old, ref, values = old, None, None, None
    scores_policy = wanted_old or (critic is not None and critic.shared)
    for index in groups:
        part = batch.rows(index)
        logp = v = None
        if scores_policy:
            logp, _, v = forward(
                policy,
                critic,
                part,
                temperature=temperature,
                values=critic is not None,
                truncation=truncation,
                packed=packed,
            )
        elif critic is not None:
            v = critic_values(critic, part, packs(part, packed)).float()
        with reference_scope():
            ref_logp, _, _ = forward(
                reference, None, part, temperature=temperature, truncation=truncation, packed=packed
            )
        if ref is None:
            ref = ref_logp.new_empty((rows, *ref_logp.shape[1:]))
            old = ref.new_empty(ref.shape) if wanted_old else None
            values = None if v is None else v.new_empty((rows, *v.shape[1:]))
        ref[index] = ref_logp
        if old is not None:
            old[index] = logp
        if values is not None:
            values[index] = v
    return old, ref, values
