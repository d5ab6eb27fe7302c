"""Checkpoints: everything needed to continue a run exactly where it stopped.

Layout of ``output_dir/checkpoints/step-000042/``: ``policy/`` (model and tokenizer via
``save_pretrained``), ``critic.pt`` (value head and, unless shared, its backbone) and
``trainer_state.pt`` (step, optimizer, scheduler, KL coefficient, RNG states, config).
A checkpoint is written to a temporary folder and renamed, so a crash never leaves a
half-written one behind.  Only the latest ``keep`` checkpoints are kept
(``--keep-checkpoints``, 2 by default; 0 keeps all).
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
KEEP_LAST = 2  # the default of --keep-checkpoints


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class TrainerState:
    step: int
    optimizer: dict
    scheduler: dict
    kl_coef: float
    rng: dict
    config: dict


def save(output_dir: Path, policy, tokenizer, critic, state: TrainerState, keep: int = KEEP_LAST) -> Path:
    root = output_dir / CHECKPOINTS
    final = root / f"step-{state.step:06d}"
    tmp = root / f".tmp-step-{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp / "policy")
    tokenizer.save_pretrained(tmp / "policy")
    if critic is not None:
        torch.save(critic.state_dict(), tmp / "critic.pt")
    torch.save(vars(state), tmp / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep > 0:
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    return final


def latest(output_dir: Path) -> Path | None:
    done = sorted(p for p in (output_dir / CHECKPOINTS).glob("step-*") if (p / STATE_FILE).exists())
    return done[-1] if done else None


def load_state(checkpoint: Path) -> TrainerState:
    # Our own file (optimizer tensors, RNG tuples): not loadable with weights_only=True.
    return TrainerState(**torch.load(checkpoint / STATE_FILE, weights_only=False))


def load_weights(checkpoint: Path, policy, critic) -> None:
    """Copy the checkpoint's policy (and critic) weights into the given modules."""
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(checkpoint / "policy")
    policy.load_state_dict(saved.state_dict())
    if critic is not None:
        critic.load_state_dict(torch.load(checkpoint / "critic.pt", map_location=next(critic.parameters()).device))
