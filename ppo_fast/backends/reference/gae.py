"""Reference GAE: a reverse scan over each row's valid tokens."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ._common import DEVICES, masked_inputs

SUPPORTED = {"gae": DEVICES}


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation, one reverse step per token over the batch.

    The valid tokens of a row form its episode: a masked token is skipped (the next
    valid value and the running advantage pass through it) and the value after the
    last valid token is 0.  Outputs are 0 at masked positions.
    """
    rewards, values = masked_inputs(mask, rewards, values)
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    running = rewards.new_zeros(batch)
    # (a clone of the empty rewards when T = 0: no token to write, still in the autograd graph)
    advantages = torch.zeros_like(rewards) if length else rewards.clone()
    for t in range(length - 1, -1, -1):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = torch.where(valid, step, running)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = torch.where(valid, step, 0.0)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def gae_packed(segments, rewards, values, mask, gamma: float, lam: float):
    """``gae`` on packed ``[N]`` tokens: the same reverse steps, step ``j`` at each segment's
    ``j``-th token from its end (the padded rows' columns right-aligned), so each segment's result
    is its padded row's, bit for bit.  Memory O(N + S); ``max_seqlen`` steps of O(S) each (the
    bound is read from the device when ``max_seqlen`` is not given: a sync on CUDA)."""
    rewards, values = masked_inputs(mask, rewards, values)
    tokens, sequences = rewards.shape[0], segments.sequences
    ends, lengths = segments.cu_seqlens[1:], segments.lengths
    # One slot past the tokens takes the steps of the segments already finished.
    rewards_x, values_x = (torch.cat([x, x.new_zeros(1)]) for x in (rewards, values))
    mask_x = torch.cat([mask, mask.new_zeros(1)])
    steps = segments.host_max_seqlen("gae")
    # (a clone of the rewards when no sequence has a token: nothing to write, still in the autograd graph)
    advantages = torch.zeros_like(rewards_x) if steps else rewards_x.clone()
    next_value = rewards.new_zeros(sequences)
    running = rewards.new_zeros(sequences)
    for j in range(steps):
        at = torch.where(lengths > j, ends - 1 - j, tokens)
        valid = mask_x[at]
        delta = rewards_x[at] + gamma * next_value - values_x[at]
        step = delta + gamma * lam * running
        running = torch.where(valid, step, running)
        next_value = torch.where(valid, values_x[at], next_value)
        advantages.index_put_((at,), torch.where(valid, step, 0.0))
    advantages = advantages[:tokens]
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns
