"""The optimisation phase: several PPO epochs over shuffled minibatches of one batch of rollouts."""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch

import ppo_fast as pf

from . import off_policy
from .distributed import SINGLE
from .packing import token_bins
from .rollout import Batch, LossRequest, critic_values, forward, fused_head_problem, packs, policy_loss_through_head
from .scoring import check_finite

# The update's metrics (name: meaning), means over its micro-batches (glossary: metric_glossary.py).
METRICS = {
    "loss/policy_avg": "the policy loss (the --loss-mode objective, its entropy and KL terms apart)",
    "policy/entropy_avg": "the current policy's entropy per response token",
    "policy/<stat>_avg": "the policy-loss mode's stats (spec.POLICY_LOSS_MODES; docs/ops.md): clipfrac (share of "
    "response tokens whose ratio was clipped), clipfrac_lower (clipped by the dual clip below), approxkl "
    "(approx_kl: mean of log pi_old - log pi over response tokens, k1 of KL(old || new)), approxkl_abs (its "
    "mean absolute value)",
    "loss/kl_avg": "the KL loss term, kl_coef times the aggregated KL to the reference (when the KL is in the loss)",
    "loss/value_avg": "the clipped value loss",
    "val/clipfrac_avg": "share of response tokens whose value prediction was clipped (--value-clip)",
    "packing/packed_share": "with --padding-free: the share of the update's micro-batches laid out packed (one is "
    "packed when its real tokens fill at most 75% of its padded rows, packing.PACK_BELOW)",
    "policy/ratio_dev_at_start": "max |ratio - 1| over the first micro-batch before any optimizer step: 0 exactly "
    "when the old log-probs were scored as the update scores them",
}


@dataclass(kw_only=True)
class Experience:
    """What the update needs from one batch of rollouts (all ``[B, T]`` over response tokens)."""

    batch: Batch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    old_values: torch.Tensor | None
    returns: torch.Tensor | None
    # The KL loss term (cfg.kl_in_reward False): the reference's log-probs and the coefficient.
    ref_logprobs: torch.Tensor | None = None
    kl_coef: float = 0.0
    weights: torch.Tensor | None = None  # per-token policy-loss weights (rollout correction)

    def rows(self, index: torch.Tensor) -> Experience:
        def pick(x):
            return None if x is None else x[index]

        return Experience(
            batch=self.batch.rows(index),
            old_logprobs=self.old_logprobs[index],
            advantages=self.advantages[index],
            old_values=pick(self.old_values),
            returns=pick(self.returns),
            ref_logprobs=pick(self.ref_logprobs),
            kl_coef=self.kl_coef,
            weights=pick(self.weights),
        )


@dataclass(frozen=True, kw_only=True)
class LossPath:
    """How the update gets its policy objective, decided once per run (``loss_path``).  ``fused``: in one
    pass through the LM head (``pf.linear_policy_loss``: the policy loss, the KL loss term and the entropy
    bonus inside the policy's forward, so under DDP too) in every micro-batch but the first of an update,
    whose log-probs the ratio check reads; else in two passes (log-probs and entropy, then
    ``pf.policy_objective``).  ``why``: the reason, for the run's log."""

    fused: bool
    why: str

    def __str__(self) -> str:
        return f"policy loss {'in one pass through the LM head' if self.fused else 'in two passes'}: {self.why}"


def loss_path(policy, critic, cfg, device: torch.device) -> LossPath:
    """The ``LossPath`` of a run, from what it fixes: the loss mode, the critic (a shared one reads the
    policy's hidden states), the backend
    (``--backend``: the reference's chunked one-pass loop is the oracle, slower than the two-pass kernels)
    and the policy's head (``rollout.fused_head_problem``)."""
    op = pf.policy_loss_modes()[cfg.loss_mode].linear_op
    if op is None:
        return LossPath(fused=False, why=f"--loss-mode {cfg.loss_mode} has no one-pass form")
    if off_policy.weighs_each_micro_batch(cfg):
        return LossPath(fused=False, why="--off-policy-loss bypass weighs each micro-batch by its own log-probs")
    if cfg.uses_critic and critic is not None and critic.shared:
        return LossPath(fused=False, why="the shared critic reads the policy's hidden states")
    try:
        with pf.use_backend(cfg.backend):
            backend = pf.backend_for(op, device)
    except pf.BackendUnavailableError as err:
        return LossPath(fused=False, why=str(err))
    if backend == "reference":
        return LossPath(fused=False, why=f"no fast backend serves {op} on {device.type}")
    problem = fused_head_problem(policy, device)
    if problem is not None:
        return LossPath(fused=False, why=problem)
    return LossPath(fused=True, why=f"{op} on the {backend} backend")


# The policy-loss stats under the trainer's metric names (the others keep their own).
_STAT_NAMES = {"approx_kl": "approxkl", "approx_kl_abs": "approxkl_abs"}


def loss_terms(exp: Experience, cfg) -> dict:
    """The policy objective's keyword arguments (``pf.policy_objective``, ``pf.linear_policy_loss``), the
    same for both paths: the mode and its parameters, the aggregation, the rollout-correction weights,
    the entropy bonus and, when the KL is not in the reward, the KL loss term."""
    terms = {"loss_mode": cfg.loss_mode, "agg": cfg.agg, "weights": exp.weights, "entropy_coef": cfg.entropy_coef}
    if exp.ref_logprobs is not None:
        terms.update(ref_logprobs=exp.ref_logprobs, kl_coef=exp.kl_coef, kl_estimator=cfg.kl_estimator_used)
    return {**terms, **cfg.loss_mode_kwargs()}


def training_loss(
    policy_loss, policy_stats: dict, values, exp: Experience, cfg, packed: bool = False
) -> tuple[torch.Tensor, dict]:
    """The one composition of the update's loss: the policy objective (the policy loss with its
    entropy bonus and KL loss term, from either path) + vf_coef * the value loss, and every metric's name
    (``packed``: whether the micro-batch ran packed, a metric with --padding-free)."""
    policy_stats = dict(policy_stats)
    stats = {"loss/policy_avg": policy_stats.pop("pg_loss"), "policy/entropy_avg": policy_stats.pop("entropy")}
    kl_loss = policy_stats.pop("kl_loss", None)
    stats.update({f"policy/{_STAT_NAMES.get(name, name)}_avg": value for name, value in policy_stats.items()})
    if kl_loss is not None:
        stats["loss/kl_avg"] = kl_loss
    loss = policy_loss
    if values is not None:
        mask = exp.batch.response_mask
        v_loss, v_stats = pf.value_loss(values, exp.old_values, exp.returns, mask, clip=cfg.value_clip, agg=cfg.agg)
        loss = loss + cfg.vf_coef * v_loss
        stats["loss/value_avg"] = v_loss.detach()
        stats["val/clipfrac_avg"] = v_stats["clipfrac"]
    if cfg.padding_free:
        stats["packing/packed_share"] = torch.tensor(float(packed))
    return loss, stats


def fused_objective(policy, critic, exp: Experience, cfg, terms: dict, *, packed: bool) -> tuple:
    """``(policy objective, its stats, values or None)`` for ``training_loss`` from one micro-batch in one
    pass through the fused LM head (``terms``: ``loss_terms``; ``packed``: the micro-batch's ``packs``)."""
    batch = exp.batch
    x = dict(old_logprobs=exp.old_logprobs, advantages=exp.advantages, mask=batch.response_mask)
    # The one pass scores under the sampler's truncation, as the two passes' log-probs do.
    request = LossRequest(temperature=cfg.temperature, terms={**terms, **cfg.logprob_truncation()}, packed=packed, **x)
    objective, stats = policy_loss_through_head(policy, batch, request)
    values = critic_values(critic, batch, packed).float() if exp.old_values is not None else None
    return objective, stats, values


def ppo_losses(policy, critic, exp: Experience, cfg, need_logprobs: bool = True, *, path: LossPath | None = None):
    """``(total loss, stats, new log-probs or None)`` for one micro-batch (``training_loss``).

    The two paths differ only in how they get the policy objective: ``path`` (the run's ``LossPath``;
    None: decided here).  The one pass gives no per-token log-probs, so ``need_logprobs`` (the first
    micro-batch, whose ratio is checked) takes the two passes: the one per-step choice."""
    terms = loss_terms(exp, cfg)
    path = path or loss_path(policy, critic, cfg, exp.batch.input_ids.device)
    packed = packs(exp.batch, bool(cfg.padding_free))  # decided once: it reads the mask's token count
    if path.fused and not need_logprobs and not off_policy.weighs_each_micro_batch(cfg):
        objective, stats, values = fused_objective(policy, critic, exp, cfg, terms, packed=packed)
        return (*training_loss(objective, stats, values, exp, cfg, packed), None)
    logprobs, entropy, values = forward(
        policy,
        critic,
        exp.batch,
        temperature=cfg.temperature,
        entropy=True,
        values=exp.old_values is not None,
        truncation=cfg.logprob_truncation(),
        packed=packed,
    )
    mask = exp.batch.response_mask
    if off_policy.weighs_each_micro_batch(cfg):  # bypass: the old log-probs are the engine's
        terms["weights"] = off_policy.bypass_weights(logprobs, exp.old_logprobs, mask, cfg)
    objective, stats = pf.policy_objective(logprobs, entropy, exp.old_logprobs, exp.advantages, mask, **terms)
    return (*training_loss(objective, stats, values, exp, cfg, packed), logprobs.detach())


def ratio_deviation(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """``max |ratio - 1|`` over the valid tokens (0.0 for none): exactly 0.0 when the update's log-probs are
    the old ones bitwise, as they are in the first micro-batch with dropout off."""
    deviation = (torch.exp(logprobs - old_logprobs) - 1).abs()
    # A token both passes score as -inf (dropped by the sampler in both) has ratio 1 by definition.
    deviation = torch.where(logprobs == old_logprobs, 0.0, deviation)
    return deviation[mask].max().item() if bool(mask.any()) else 0.0


_warned_ratio = False


def _check_ratio_at_start(deviation: float) -> None:
    global _warned_ratio
    if deviation != 0.0 and not _warned_ratio:
        _warned_ratio = True
        print(
            f"ppo-fast: warning: the first micro-batch's importance ratio is not 1 before any update "
            f"(max |ratio - 1| = {deviation:.3g}): the old log-probs and the update's disagree (dropout on, "
            "another dtype or batch layout, or a non-deterministic kernel); logged as policy/ratio_dev_at_start",
            file=sys.stderr,
        )


def micro_batches(rows: torch.Tensor, tokens: torch.Tensor, cfg, parallel=SINGLE) -> tuple[list[torch.Tensor], int]:
    """``(micro-batches, how many are real)`` of one minibatch (``rows``: its indices into the batch;
    ``tokens``: every row's real tokens): ``gradient_accumulation_steps`` equal slices, or with
    ``max_tokens_per_micro_batch`` bins of at most that many tokens (``token_bins``).  Every rank gets
    as many: the ones a rank lacks repeat its last and weigh 0 (DDP and FSDP2 run collectives in
    each micro-batch's forward and backward)."""
    budget = cfg.max_tokens_per_micro_batch
    if budget is None:
        size = len(rows) // cfg.gradient_accumulation_steps
        return [rows[start : start + size] for start in range(0, len(rows), size)], cfg.gradient_accumulation_steps
    groups = [rows[bin_] for bin_ in token_bins(tokens[rows].tolist(), budget)]
    count = parallel.most(len(groups))
    return groups + [groups[-1]] * (count - len(groups)), len(groups)


def first_epoch_micro_batches(first_order: torch.Tensor, tokens: torch.Tensor, cfg, parallel=SINGLE):
    """The real micro-batches of the first epoch, in order (``ppo_update``'s with ``first_order``): the
    old log-probs are scored in them."""
    minibatch = len(first_order) // cfg.num_mini_batches
    groups = []
    for start in range(0, len(first_order), minibatch):
        micro, real = micro_batches(first_order[start : start + minibatch], tokens, cfg, parallel)
        groups += micro[:real]
    return groups


def ppo_update(
    policy,
    critic,
    optimizer,
    scheduler,
    exp: Experience,
    cfg,
    *,
    step: int,
    autocast=contextlib.nullcontext,
    parallel=SINGLE,
    first_order: torch.Tensor | None = None,
    path: LossPath | None = None,
) -> dict:
    """Run ``num_ppo_epochs`` over ``num_mini_batches`` shuffled minibatches; return the mean stats.

    Each minibatch is one optimizer step, accumulated over ``gradient_accumulation_steps``
    micro-batches, each weighted so that the loss is aggregated over the whole minibatch
    of every rank (``token-mean``: divided by the global token count; see
    ``Parallel.micro_batch_weights``).  A non-finite loss raises before it reaches the
    weights; the caller then keeps the last good checkpoint instead of saving these weights.

    ``first_order`` is the first epoch's shuffle, drawn before the old log-probs were scored in
    its micro-batches: ``policy/ratio_dev_at_start`` (max |ratio - 1| over the first micro-batch,
    before any optimizer step) is then exactly 0.0 with dropout off.  ``path``: the run's ``LossPath``
    (None: decided here, once).
    """
    rows = exp.old_logprobs.shape[0]
    path = path or loss_path(policy, critic, cfg, exp.old_logprobs.device)
    minibatch = rows // cfg.num_mini_batches
    tokens = exp.batch.attention_mask.sum(-1)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    totals: dict[str, list[torch.Tensor]] = defaultdict(list)
    policy.train()
    if critic is not None:
        critic.train()
    ratio_dev_at_start = None
    for epoch in range(cfg.num_ppo_epochs):
        if epoch == 0 and first_order is not None:
            order = first_order
        else:
            order = torch.randperm(rows, device=exp.old_logprobs.device)
        for mb_start in range(0, rows, minibatch):
            optimizer.zero_grad(set_to_none=True)
            micro_rows, real = micro_batches(order[mb_start : mb_start + minibatch], tokens, cfg, parallel)
            masks = [exp.batch.response_mask[index] for index in micro_rows]
            masks = masks[:real] + [torch.zeros_like(mask) for mask in masks[real:]]  # a repeat weighs 0
            weights = parallel.micro_batch_weights(masks, cfg.agg)
            weights = weights[:real] + [weight * 0 for weight in weights[real:]]
            for number, (index, weight) in enumerate(zip(micro_rows, weights), 1):
                with parallel.accumulating(sync=number == len(micro_rows)):
                    micro_exp = exp.rows(index)
                    with autocast():
                        loss, stats, new_logprobs = ppo_losses(
                            policy, critic, micro_exp, cfg, need_logprobs=ratio_dev_at_start is None, path=path
                        )
                    if ratio_dev_at_start is None:
                        mask = micro_exp.batch.response_mask
                        ratio_dev_at_start = ratio_deviation(new_logprobs, micro_exp.old_logprobs, mask)
                        if off_policy.recomputes_old(cfg):  # bypass: the ratio to the engine's is not 1
                            _check_ratio_at_start(ratio_dev_at_start)
                    check_finite("loss", loss.detach(), step)
                    (loss * weight).backward()
                if number <= real:  # a repeat's stats would count its rows twice
                    for name, value in stats.items():
                        totals[name].append(value)
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
    policy.eval()
    if critic is not None:
        critic.eval()
    means = {name: torch.stack(values).mean().item() for name, values in totals.items()}
    return {**means, "policy/ratio_dev_at_start": ratio_dev_at_start}
