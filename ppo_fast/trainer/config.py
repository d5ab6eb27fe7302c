"""The trainer's configuration: one dataclass whose fields document themselves.

Every field becomes a command-line flag (``--kl-coef 0.05``), can be set in a YAML or
JSON file (``kl_coef: 0.05``) and is checked by :meth:`TrainerConfig.validate` before
anything is loaded, so a bad value fails at start with a message naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..contract import AGG_MODES, KL_ESTIMATORS

ADVANTAGE_ESTIMATORS = ("gae", "grpo", "rloo")
CRITIC_MODES = ("separate", "shared")
LR_SCHEDULES = ("constant", "linear", "cosine")
DEVICES = ("auto", "cpu", "cuda")
BACKEND_CHOICES = ("auto", "reference", "triton", "native")


def _opt(default, help_text: str, group: str):
    return field(default=default, metadata={"help": help_text, "group": group})


@dataclass
class TrainerConfig:
    # --- run
    output_dir: str = _opt("ppo_fast_run", "Directory for metrics, plots, checkpoints and the warm-up cache.", "run")
    steps: int = _opt(150, "Number of PPO iterations (rollout, score, estimate, optimize).", "run")
    seed: int = _opt(0, "Random seed (sampling, shuffling, initialisation).", "run")
    device: str = _opt("auto", "Device: auto (cuda if available), cpu or cuda.", "run")
    backend: str = _opt("auto", "ppo_fast kernel backend: auto, reference, triton or native.", "run")
    cpu_threads: int = _opt(
        1, "PyTorch CPU threads when training on CPU (0: PyTorch's default). Small models run fastest on one; "
        "more threads on a busy machine slow everything down.", "run"
    )
    resume: bool = _opt(False, "Continue from the latest checkpoint in output_dir.", "run")
    save_every: int = _opt(50, "Save a checkpoint every this many steps (0: only at the end).", "run")
    sample_every: int = _opt(25, "Print a few sample completions every this many steps (0: never).", "run")
    num_samples_to_print: int = _opt(3, "How many sample completions to print each time.", "run")
    eval_every: int = _opt(25, "Evaluate held-out greedy reward every this many steps (0: only before and after).", "run")

    # --- models and rewards
    model_name_or_path: str | None = _opt(
        None, "Policy: a local AutoModelForCausalLM path/name. Unset: the built-in addition task's small GPT-2.", "model"
    )
    critic: str = _opt("separate", "Value head on a separate copy of the backbone, or 'shared' with the policy.", "model")
    reward_fn: str | None = _opt(None, "Reward function 'module:function' called as fn(prompts, responses) -> scores.", "model")
    reward_model: str | None = _opt(None, "Path of an AutoModelForSequenceClassification reward model (logit 0 is the score).", "model")
    prompts_file: str | None = _opt(
        None, "Prompts for a custom model: a .txt file (one per line) or .jsonl with a 'prompt' field.", "model"
    )
    gradient_checkpointing: bool = _opt(False, "Recompute activations in backward to save memory.", "model")
    bf16: bool = _opt(True, "bfloat16 autocast on CUDA (ignored on CPU).", "model")
    disable_dropout: bool = _opt(True, "Set dropout to 0 so that old and new log-probs agree before the first update.", "model")

    # --- rollout
    batch_size: int = _opt(64, "Prompts per PPO iteration.", "rollout")
    num_samples_per_prompt: int = _opt(1, "Responses sampled per prompt (>= 2 for grpo and rloo).", "rollout")
    response_length: int = _opt(4, "Maximum new tokens per response (generation stops at EOS).", "rollout")
    temperature: float = _opt(1.0, "Sampling temperature; log-probs use the same temperature.", "rollout")
    top_p: float = _opt(1.0, "Nucleus sampling threshold in (0, 1].", "rollout")

    # --- estimate
    advantage_estimator: str = _opt("gae", "gae (with the critic), or critic-free grpo or rloo.", "estimate")
    kl_coef: float = _opt(0.05, "KL penalty coefficient (initial value when adaptive_kl).", "estimate")
    kl_estimator: str = _opt("k1", "Per-token KL estimator: k1, k2, k3 or abs.", "estimate")
    adaptive_kl: bool = _opt(False, "Adapt kl_coef so that the KL tracks target_kl (Ziegler et al.).", "estimate")
    target_kl: float = _opt(6.0, "Target KL (summed over a response) for adaptive_kl.", "estimate")
    kl_horizon: float = _opt(10000.0, "Horizon (in samples) of the adaptive KL controller.", "estimate")
    gamma: float = _opt(1.0, "Discount factor.", "estimate")
    lam: float = _opt(0.95, "GAE lambda.", "estimate")
    whiten_advantages: bool = _opt(True, "Whiten advantages over the batch (gae and rloo; grpo is already normalised).", "estimate")

    # --- optimize
    num_ppo_epochs: int = _opt(4, "Passes over each batch of rollouts.", "optimize")
    num_mini_batches: int = _opt(2, "Minibatches per epoch (one optimizer step each).", "optimize")
    gradient_accumulation_steps: int = _opt(1, "Micro-batches per minibatch (gradient accumulation).", "optimize")
    learning_rate: float = _opt(1e-4, "AdamW learning rate (policy and critic).", "optimize")
    lr_scheduler_type: str = _opt("constant", "Learning-rate schedule: constant, linear or cosine decay.", "optimize")
    warmup_steps: int = _opt(0, "Optimizer steps of linear learning-rate warm-up.", "optimize")
    weight_decay: float = _opt(0.0, "AdamW weight decay.", "optimize")
    max_grad_norm: float = _opt(1.0, "Gradient clipping norm (0: no clipping).", "optimize")
    cliprange: float = _opt(0.2, "PPO policy ratio clip epsilon.", "optimize")
    cliprange_value: float = _opt(0.2, "Value clip range around the rollout values.", "optimize")
    vf_coef: float = _opt(0.1, "Value loss coefficient.", "optimize")
    ent_coef: float = _opt(0.0, "Entropy bonus coefficient.", "optimize")
    loss_agg: str = _opt("token-mean", f"Loss aggregation: {', '.join(AGG_MODES)}.", "optimize")

    # --- built-in task (used when model_name_or_path is unset)
    sft_steps: int = _opt(400, "Supervised warm-up steps of the built-in model (cached in output_dir/warmup).", "builtin")
    sft_batch_size: int = _opt(128, "Warm-up batch size.", "builtin")
    sft_learning_rate: float = _opt(3e-3, "Warm-up learning rate.", "builtin")
    demo_carry_error_rate: float = _opt(
        0.7, "Fraction of warm-up demonstrations needing a carry whose teacher forgot it (a wrong digit).", "builtin"
    )
    eval_size: int = _opt(400, "Held-out problems for greedy accuracy before and after PPO.", "builtin")

    # ------------------------------------------------------------------ checks

    def validate(self) -> TrainerConfig:
        """Raise ``ValueError`` naming the first bad field; return ``self``."""
        positive = ("steps", "batch_size", "num_samples_per_prompt", "response_length", "num_ppo_epochs",
                    "num_mini_batches", "gradient_accumulation_steps", "sft_batch_size", "num_samples_to_print")
        non_negative = ("cpu_threads", "save_every", "sample_every", "eval_every", "warmup_steps", "sft_steps", "eval_size", "seed")
        for name in positive:
            _require(name, getattr(self, name) >= 1, "must be >= 1")
        for name in non_negative:
            _require(name, getattr(self, name) >= 0, "must be >= 0")
        for name in ("temperature", "learning_rate", "cliprange_value", "target_kl", "kl_horizon", "sft_learning_rate"):
            _require(name, getattr(self, name) > 0, "must be > 0")
        for name in ("kl_coef", "vf_coef", "ent_coef", "weight_decay", "max_grad_norm"):
            _require(name, getattr(self, name) >= 0, "must be >= 0")
        for name in ("gamma", "lam", "demo_carry_error_rate"):
            _require(name, 0 <= getattr(self, name) <= 1, "must lie in [0, 1]")
        _require("top_p", 0 < self.top_p <= 1, "must lie in (0, 1]")
        _require("cliprange", 0 < self.cliprange < 1, "must lie in (0, 1)")
        for name, choices in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("critic", CRITIC_MODES),
                              ("kl_estimator", KL_ESTIMATORS), ("loss_agg", AGG_MODES),
                              ("lr_scheduler_type", LR_SCHEDULES), ("device", DEVICES), ("backend", BACKEND_CHOICES)):
            _require(name, getattr(self, name) in choices, f"must be one of {', '.join(choices)}")
        rows = self.batch_size * self.num_samples_per_prompt
        _require("num_mini_batches", rows % self.num_mini_batches == 0,
                 f"must divide batch_size * num_samples_per_prompt = {rows}")
        _require("gradient_accumulation_steps", (rows // self.num_mini_batches) % self.gradient_accumulation_steps == 0,
                 f"must divide the minibatch size {rows // self.num_mini_batches}")
        if self.advantage_estimator in ("grpo", "rloo"):
            _require("num_samples_per_prompt", self.num_samples_per_prompt >= 2,
                     f"must be >= 2 for advantage_estimator={self.advantage_estimator}")
        _require("reward_model", not (self.reward_fn and self.reward_model), "cannot be combined with reward_fn; choose one")
        if self.model_name_or_path is not None:
            _require("prompts_file", self.prompts_file is not None, "is required with model_name_or_path")
            _require("reward_fn", bool(self.reward_fn or self.reward_model),
                     "(or reward_model) is required with model_name_or_path")
        if self.reward_fn is not None:
            _require("reward_fn", ":" in self.reward_fn, "must look like 'module:function'")
        return self

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> TrainerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown option(s) {', '.join(unknown)}")
        hints = typing.get_type_hints(cls)
        for name, value in values.items():
            _check_type(name, value, hints[name], source)
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainerConfig:
        """Read a YAML (``.yaml``/``.yml``) or JSON file of ``field: value`` pairs."""
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        else:
            values = json.loads(text)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of option names to values")
        return cls.from_dict(values, source=str(path))


def _require(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"invalid config: {name} {message}")


def _base_type(hint):
    """``int`` for ``int``, ``str`` for ``str | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _check_type(name: str, value, hint, source: str) -> None:
    base = _base_type(hint)
    if value is None and base is not hint:
        return
    ok = isinstance(value, base) and not (base is not bool and isinstance(value, bool))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ValueError(f"{source}: {name} must be {base.__name__}, got {value!r}")


# ---------------------------------------------------------------------- command line


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field, grouped, defaulting to None so that only given flags override."""
    hints = typing.get_type_hints(TrainerConfig)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(TrainerConfig):
        group_name = f.metadata["group"]
        group = groups.setdefault(group_name, parser.add_argument_group(f"{group_name} options"))
        base = _base_type(hints[f.name])
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if base is bool:
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            group.add_argument(_flag(f.name), type=base, default=None, metavar=base.__name__.upper(), help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """File values (``--config``) first, then every flag given on the command line."""
    values = TrainerConfig.from_file(args.config).to_dict() if getattr(args, "config", None) else {}
    for f in dataclasses.fields(TrainerConfig):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    return TrainerConfig.from_dict(values).validate()


def options_markdown() -> str:
    """The options as a Markdown table (for the README), generated from the dataclass."""
    lines = ["| Option | Default | Description |", "| --- | --- | --- |"]
    for f in dataclasses.fields(TrainerConfig):
        lines.append(f"| `{_flag(f.name)}` | `{f.default}` | {f.metadata['help']} |")
    return "\n".join(lines)
