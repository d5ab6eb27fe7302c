"""The update's policy objective through the fused LM head: ``pf.linear_policy_loss`` (the policy
loss, the KL loss term and the entropy bonus in one pass over the head, inside the policy's forward,
so under DDP too); ``update.training_loss`` adds the value loss as for the two-pass path."""

from __future__ import annotations

import ppo_fast as pf

from .rollout import _response_scores, critic_values, packs, scores_through_fused_head


def has_fast_backend(loss_mode: str, device_type: str) -> bool:
    """Whether a fast backend serves the mode's one-pass op there: the reference's chunked
    ``autograd.grad`` loop is the oracle, slower than the two-pass path's kernels."""
    op = pf.policy_loss_modes()[loss_mode].linear_op
    return op is not None and pf.backend_for(op, device_type) != "reference"


def linear_policy_objective(policy, critic, exp, cfg, terms: dict):
    """``(policy objective, its stats, values or None)`` for ``update.training_loss`` from one micro-batch
    through ``pf.linear_policy_loss`` (``terms``: ``update.loss_terms``), or None when the policy is not
    scored through the fused head, no fast backend serves the mode's one-pass op, or a shared critic
    reads the policy's hidden states."""
    batch = exp.batch
    needs_values = exp.old_values is not None
    device = batch.input_ids.device
    if (needs_values and critic.shared) or not has_fast_backend(cfg.loss_mode, device.type):
        return None
    if not scores_through_fused_head(policy, device):
        return None
    mask = batch.response_mask
    packed = packs(batch, bool(cfg.padding_free))
    objective, stats = _response_scores(
        policy,
        batch,
        temperature=cfg.temperature,
        entropy=True,
        hidden_states=False,
        policy_loss={"old_logprobs": exp.old_logprobs, "advantages": exp.advantages, "mask": mask, **terms},
        packed=packed,
    )
    values = critic_values(critic, batch, packed).float() if needs_values else None
    return objective, stats, values
