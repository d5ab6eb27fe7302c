"""Policy, frozen reference and critic (a value head on a backbone)."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from . import model_folder
from .config import ConfigError


def check_pretrained(option: str, name: str) -> None:
    """Fail early (before any model is loaded) when ``name`` is neither a saved model
    folder nor a Hugging Face hub id that can be resolved (cached or downloadable)."""
    refused = model_folder.problem(option, name)
    if refused:
        raise ConfigError(refused)
    if Path(name).expanduser().exists():
        return
    from transformers import AutoConfig

    try:  # a hub id already in the local cache
        AutoConfig.from_pretrained(name, local_files_only=True)
        return
    except (OSError, ValueError):
        pass
    if not _hub_reachable():  # not a folder, not cached, no hub: say so now (not after minutes of retries)
        raise ConfigError(
            f"{option} {name}: no such directory (relative paths start from {os.getcwd()}), and no "
            "Hugging Face hub model of that name in the local cache (the hub cannot be reached from here)"
        )
    load_pretrained(option, name, AutoConfig)  # a hub id: resolving its config.json is cheap


def _hub_reachable() -> bool:
    """False when offline mode is set or the hub's host name does not resolve."""
    if any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def load_pretrained(option: str, name: str, loader, **kwargs):
    """``loader.from_pretrained(name)`` with a failure to find or read the model as ``ConfigError``."""
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())
        if len(reason) > 300:
            reason = reason[:300] + "..."
        local = Path(name).expanduser().exists()
        where = "" if local else f"no local folder {name!r} (relative to {os.getcwd()}), and as a Hugging Face hub id: "
        raise ConfigError(f"{option} {name}: cannot load it: {where}{reason}") from err


def third_party_output(verbose: bool) -> None:
    """transformers' warnings (``loss_type=None``, ``attention_mask``, ...) and its progress bars
    ("Loading weights", "Writing model shards") shown with ``verbose``, else hidden: the trainer
    reports loading and saving itself.  Errors are always shown."""
    from transformers.utils import logging as hf_logging

    if verbose:
        hf_logging.set_verbosity_warning()
        hf_logging.enable_progress_bar()
    else:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


class ValueHead(nn.Module):
    """A linear layer from the last hidden state to one scalar per position (zero-initialised)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)


class Critic(nn.Module):
    """A value head on its own backbone, or (``backbone=None``) on the policy's last hidden state."""

    def __init__(self, hidden_size: int, backbone: nn.Module | None):
        super().__init__()
        self.backbone = backbone
        self.head = ValueHead(hidden_size)

    @property
    def shared(self) -> bool:
        return self.backbone is None

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        # No cache: with no mask, transformers then finds packed sequences from position_ids (packing).
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden)


def hidden_size(model: nn.Module) -> int:
    config = model.config
    return getattr(config, "hidden_size", None) or config.n_embd


def frozen_reference(policy: nn.Module) -> nn.Module:
    """A frozen copy of the initial policy (eval mode, no gradients)."""
    reference = copy.deepcopy(policy).eval()
    reference.requires_grad_(False)
    return reference


def build_critic(policy: nn.Module, mode: str) -> Critic:
    """``separate``: value head on a copy of the policy's backbone; ``shared``: head only."""
    backbone = None if mode == "shared" else copy.deepcopy(policy.base_model)
    return Critic(hidden_size(policy), backbone).to(next(policy.parameters()).device)


def disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def enable_activation_checkpointing(model: nn.Module, frozen_inputs: bool = False) -> None:
    """Recompute activations in backward (named ``activation_checkpointing_enable`` since transformers 5.x).
    ``frozen_inputs`` (LoRA: the embeddings are frozen): the embeddings' output requires grad, so that a
    checkpointed block's backward still reaches the adapters inside it."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    if frozen_inputs:
        model.enable_input_require_grads()


def activation_checkpointing_on(model: nn.Module) -> bool:
    flag = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(model, flag))
