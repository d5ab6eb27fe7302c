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
