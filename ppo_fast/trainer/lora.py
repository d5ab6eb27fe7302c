"""LoRA (PEFT): low-rank adapters trained on a frozen base, for the policy and the critic.

The adapters are injected into the policy's own modules (``peft.get_peft_model``), so the
trainer keeps calling the transformers model: its backbone and its LM head (never adapted) feed
the fused head as before.  The KL reference is the same model with its adapters switched off
(``PeftModel.disable_adapter``): no copy, and bitwise the base model's forward.  A checkpoint's
``policy/`` is a PEFT adapter folder (``PeftModel.from_pretrained`` loads it onto its base),
and the optimizer holds only the trainable parameters' state.

The critic (``--critic separate``) is its own frozen copy of the base with its own adapter and
value head: the policy's and the critic's forwards share no activations either way, and two
adapters on one module tree would be switched in place between the two forwards (a state that
DDP's and FSDP2's wrappers do not see); the copy costs the base's parameters, without gradients
or optimizer state.  ``--critic shared`` puts the value head on the policy's adapted backbone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from pathlib import Path

import torch
from torch import nn

from .config import LORA_HEAD_NAMES, ConfigError, TrainerConfig

ADAPTER_CONFIG = "adapter_config.json"  # what marks a PEFT adapter folder
ADAPTER_NAME = "default"


def check_installed() -> None:
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("--lora-r: PEFT is not installed; pip install peft")


def attach(cfg: TrainerConfig, model: nn.Module):
    """Inject ``cfg``'s adapters into ``model`` in place and freeze everything else; returns the
    ``PeftModel`` around it (for the reference's switch and the adapter folder).  ``ConfigError``
    for a target that names no module, or one that is not a linear layer or is the LM head."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_targets(),
        modules_to_save=[name.strip() for name in cfg.lora_modules_to_save.split(",") if name.strip()] or None,
        bias="none",
    )
    option = f"--lora-target-modules {cfg.lora_target_modules}"
    try:
        with _peft_notices_hidden():
            adapted = get_peft_model(model, config)
    except ValueError as err:  # peft's NoMatchingPeftModuleError and its kin
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(
            f"{option}: {reason}; this model's linear layers are named {', '.join(linear_layer_names(model))}"
        ) from None
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            raise ConfigError(
                f"{option}: {name} is a {type(module.base_layer).__name__}; only linear layers are adapted"
            )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if hasattr(head, "modules_to_save") and getattr(model.config, "tie_word_embeddings", False):
        # The trained head is a copy of its own now: a merged export must not tie it back to the embeddings.
        model.config.tie_word_embeddings = False
    if isinstance(head, LoraLayer):
        raise ConfigError(f"{option}: adapts the LM head, which the fused head reads from the base; leave it out")
    return adapted


@contextlib.contextmanager
def _peft_notices_hidden():
    """What PEFT says of GPT-2's Conv1D layers (it sets fan_in_fan_out itself) and of transformers' renames."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (``c_attn``, ``q_proj``, ...), the LM head's aside."""
    from transformers.pytorch_utils import Conv1D

    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and name.rsplit(".", 1)[-1] not in LORA_HEAD_NAMES
    }
    return sorted(names)


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``module`` by their state-dict names (the adapters and the head)."""
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


def load_trainable(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``trainable_state``'s dict back; ``RuntimeError`` naming a trainable parameter it lacks
    or a name it has that is not one (the frozen base comes from the run's model, not the checkpoint)."""
    wanted = set(trainable_state(module))
    missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or unexpected:
        raise RuntimeError(f"trainable parameters: missing {missing[:3]}, unexpected {unexpected[:3]}")
    module.load_state_dict(state, strict=False)


def base_name(cfg: TrainerConfig, policy: nn.Module, output_dir: Path) -> str:
    """Where the adapter folder's base model is found again: the model's folder (absolute) or hub id,
    the built-in task's warm-up cache, or the name the policy object was loaded from."""
    name = cfg.model_name_or_path or getattr(policy, "name_or_path", "") or ""
    if cfg.model_name_or_path is None and not name:
        name = str(output_dir / "warmup")  # the built-in task's warm-up model (default_task)
    return str(Path(name).expanduser().resolve()) if name and Path(name).expanduser().exists() else name


def save_adapter(adapters, folder: Path, base: str, state: dict | None = None) -> None:
    """The PEFT adapter folder of ``adapters`` (``adapter_config.json``, ``adapter_model.safetensors``);
    ``state``: the adapted model's full state dict (a sharded model's, gathered)."""
    config = adapters.peft_config[ADAPTER_NAME]
    config.base_model_name_or_path = base
    config.task_type = "CAUSAL_LM"  # AutoPeftModelForCausalLM.from_pretrained(folder) loads it, as TRL's
    if state is not None:  # PeftModel.save_pretrained takes the wrapper's names
        state = {f"base_model.model.{name}": value for name, value in state.items()}
    adapters.save_pretrained(folder, state_dict=state, save_embedding_layers=False)


def read_adapter(folder: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's adapter tensors (the file ``save_adapter`` writes), read locally: PEFT's
    ``load_peft_weights`` would try the hub for a folder that lacks it."""
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def load_adapter(adapters, state: dict[str, torch.Tensor]) -> None:
    """Set ``adapters``' weights from an adapter file's tensors; ``RuntimeError`` when they do not fit."""
    from peft import set_peft_model_state_dict

    ours = {name for name, p in adapters.named_parameters() if p.requires_grad}
    result = set_peft_model_state_dict(adapters, state)
    missing = sorted(ours & set(result.missing_keys))  # the frozen base is missing by design
    if missing or result.unexpected_keys:
        raise RuntimeError(f"adapter weights: missing {missing[:3]}, unexpected {sorted(result.unexpected_keys)[:3]}")


def merged_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``model``'s state dict under the base model's names, each adapted weight replaced by
    ``W + (alpha / r) * B @ A`` (summed in float32, rounded once); the model is not changed.
    ``state``: the adapted model's full state dict (a sharded model's, gathered).  From ``state``, not
    ``LoraLayer.get_delta_weight``: that reads the module's own parameters, shards under FSDP2."""
    from peft.tuners.lora import LoraLayer

    state = model.state_dict() if state is None else state
    merged = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        a = state[f"{name}.lora_A.{ADAPTER_NAME}.weight"].float()
        b = state[f"{name}.lora_B.{ADAPTER_NAME}.weight"].float()
        delta = (b @ a) * layer.scaling[ADAPTER_NAME]
        weight = state[f"{name}.base_layer.weight"]
        merged[f"{name}.weight"] = (weight.float() + (delta.T if layer.fan_in_fan_out else delta)).to(weight.dtype)
    for key, value in state.items():  # --lora-modules-to-save: the trained copy, not the base's
        if f".modules_to_save.{ADAPTER_NAME}." in key:
            merged[key.replace(f".modules_to_save.{ADAPTER_NAME}.", ".")] = value
    for key, value in state.items():
        if ".lora_" not in key and ".modules_to_save." not in key and ".original_module." not in key:
            merged.setdefault(key.replace(".base_layer.", "."), value)
    return merged


def load_merged(folder: Path):
    """The causal LM of a PEFT adapter folder: its base (``base_model_name_or_path``) with the
    adapters merged in; ``ConfigError`` when the base cannot be found."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .models import load_pretrained

    check_installed()
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""
    if not base:
        raise ConfigError(f"{folder}: the adapter folder names no base model (base_model_name_or_path)")
    model = load_pretrained(f"{folder}'s base model", base, AutoModelForCausalLM)
    with _peft_notices_hidden():
        return PeftModel.from_pretrained(model, folder).merge_and_unload()
