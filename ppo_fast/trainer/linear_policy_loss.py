"""The update's losses with the policy scored through the fused LM head: ``pf.linear_policy_loss``
(the policy loss, the KL loss term and the entropy bonus in one pass over the head, inside the
policy's forward, so under DDP too), then the value loss as ``update.ppo_losses`` adds it."""

from __future__ import annotations

import ppo_fast as pf
from ppo_fast.backends import resolved_backend_name

from .rollout import _response_scores, scores_through_fused_head


def has_fast_backend(loss_mode: str, device_type: str) -> bool:
    """Whether a fast backend serves the mode's one-pass op there: the reference's chunked
    ``autograd.grad`` loop is the oracle, slower than the two-pass path's kernels."""
    op = pf.policy_loss_modes()[loss_mode].linear_op
    return op is not None and resolved_backend_name(op, device_type) != "reference"


def linear_policy_losses(policy, critic, exp, cfg, mode_params: dict, stat_names: dict):
    """``(total loss, stats)`` of ``update.ppo_losses`` for one micro-batch through
    ``pf.linear_policy_loss``, or None when the policy is not scored through the fused head, no
    fast backend serves the mode's one-pass op, or a shared critic reads the policy's hidden states."""
    batch = exp.batch
    needs_values = exp.old_values is not None
    device = batch.input_ids.device
    if (needs_values and critic.shared) or not has_fast_backend(cfg.policy_loss, device.type):
        return None
    if not scores_through_fused_head(policy, device):
        return None
    mask = batch.response_mask
    kl = {}
    if exp.ref_logprobs is not None:  # the KL to the reference as a loss term, aggregated as the policy loss
        kl = {"ref_logprobs": exp.ref_logprobs, "kl_coef": exp.kl_coef, "kl_estimator": cfg.kl_estimator_used}
    loss, pg_stats = _response_scores(
        policy,
        batch,
        temperature=cfg.temperature,
        entropy=True,
        hidden_states=False,
        policy_loss={
            "old_logprobs": exp.old_logprobs,
            "advantages": exp.advantages,
            "mask": mask,
            "loss_mode": cfg.policy_loss,
            "agg": cfg.loss_agg,
            "weights": exp.weights,
            "entropy_coef": cfg.ent_coef,
            **kl,
            **mode_params,
        },
    )
    pg_stats = dict(pg_stats)
    stats = {"loss/policy_avg": pg_stats.pop("pg_loss"), "policy/entropy_avg": pg_stats.pop("entropy")}
    kl_loss = pg_stats.pop("kl_loss", None)
    stats.update({f"policy/{stat_names.get(name, name)}_avg": value for name, value in pg_stats.items()})
    if kl_loss is not None:
        stats["loss/kl_avg"] = kl_loss
    if needs_values:
        start = batch.prompt_width - 1
        values = critic(batch.input_ids, batch.attention_mask, batch.position_ids)[:, start:-1].float()
        v_loss, v_stats = pf.value_loss(
            values, exp.old_values, exp.returns, mask, clip=cfg.cliprange_value, agg=cfg.loss_agg
        )
        loss = loss + cfg.vf_coef * v_loss
        stats["loss/value_avg"] = v_loss.detach()
        stats["val/clipfrac_avg"] = v_stats["clipfrac"]
    return loss, stats
