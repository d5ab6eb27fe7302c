"""The trainer's configuration: one dataclass whose fields document themselves.

Every field becomes a command-line flag (``--kl-coef 0.05``), can be set in a YAML or
JSON file (``kl_coef: 0.05``) and is checked by :meth:`TrainerConfig.validate` before
anything is loaded, so a bad value fails at start with a message naming the field.

This module imports only the standard library (PyYAML only to read a YAML file): the
``ppo-fast`` launcher (``ppo_fast_cli.py``) loads it on its own to answer ``--help``
and to parse the command line without importing torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path


def _module(name: str, path: Path, alias: str):
    """``name`` (standard library only).  When this file is loaded alone by the ``ppo-fast`` launcher
    (for a fast --help), the module is loaded alone too, as ``alias``: importing it through the
    package would run ``ppo_fast/__init__.py``, which imports torch."""
    if __name__.startswith("ppo_fast."):
        return importlib.import_module(name)
    loaded = sys.modules.get(name) or sys.modules.get(alias)
    if loaded is None:
        module_spec = importlib.util.spec_from_file_location(alias, path)
        loaded = importlib.util.module_from_spec(module_spec)
        sys.modules[alias] = loaded  # the dataclasses look their module up
        module_spec.loader.exec_module(loaded)
    return loaded


_HERE = Path(__file__).resolve().parent
_NAMES = _module("ppo_fast.trainer.option_syntax", _HERE / "option_syntax.py", "_ppo_fast_trainer_option_syntax")
ALIASES, RENAMED, ConfigError, flag = _NAMES.ALIASES, _NAMES.RENAMED, _NAMES.ConfigError, _NAMES.flag
alias_warning, current_names, renamed_warning = _NAMES.alias_warning, _NAMES.current_names, _NAMES.renamed_warning
_base_type, _coerce, read_config_file = _NAMES.base_type, _NAMES.coerce, _NAMES.read_config_file


_SPEC = _module("ppo_fast.spec", _HERE.parent / "spec.py", "_ppo_fast_spec")
ADVANTAGE_METHODS, AGG_MODES, KL_ESTIMATORS = _SPEC.ADVANTAGE_METHODS, _SPEC.AGG_MODES, _SPEC.KL_ESTIMATORS
CRITIC_METHODS, GROUP_METHODS = _SPEC.CRITIC_METHODS, _SPEC.GROUP_METHODS
POLICY_LOSS_MODES, ROLLOUT_CORRECTION_MODES = _SPEC.POLICY_LOSS_MODES, _SPEC.ROLLOUT_CORRECTION_MODES
ADVANTAGE_METHOD_NAMES = tuple(ADVANTAGE_METHODS)
POLICY_LOSSES = tuple(POLICY_LOSS_MODES)
# "geo_mean (GMPO)": each mode with the label its summary starts with, for --help.
_POLICY_LOSS_LIST = ", ".join(
    f"{name} ({mode.summary.split(':')[0]})" if ":" in mode.summary else name
    for name, mode in POLICY_LOSS_MODES.items()
)
# Where the KL to the reference goes: subtracted from the reward, or a term of the policy loss.
KL_PLACEMENTS = ("auto", "reward", "loss")
CRITIC_MODES = ("separate", "shared")
LR_SCHEDULES = ("constant", "linear", "cosine")
DEVICES = ("auto", "cpu", "cuda")
BACKEND_CHOICES = ("auto", *_SPEC.BACKENDS)
LOGPROBS_SUPPORTS = ("sampled", "full")
PARALLEL_MODES = ("ddp", "fsdp")
ROLLOUT_ENGINES = _SPEC.ROLLOUT_ENGINES
REPORT_TO = ("auto", "none", *_SPEC.TRACKERS)
LORA_ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the output head
# The output heads' module names in transformers' causal LMs (LoRA on them is refused).
LORA_HEAD_NAMES = ("lm_head", "embed_out", "output_layer")

# --response-length when it is not given: the built-in task's answers are at most 3
# digits and an EOS; a custom model gets a length that fits a short answer.
BUILTIN_RESPONSE_LENGTH = 4
CUSTOM_RESPONSE_LENGTH = 64


# What --resume does with an option changed since the checkpoint (a field's ``resume``): applies the
# new value (the default), ignores it (where the run is, how it prints, how its tokens are laid
# out), refuses it for the built-in task (it makes another warm-up model, so another KL reference),
# or refuses it in every run (``refused(why)``).
APPLIED, IGNORED, WARM_UP = "applied", "ignored", "refused for the built-in task"


def refused(why: str) -> str:
    return f"refused: {why}"


def _opt(
    default,
    help_text: str,
    group: str,
    *,
    choices: tuple | None = None,
    bounds: str | None = None,
    values: str | None = None,
    resume: str = APPLIED,
):
    """A field with its help, its --help group, and its values: ``choices``, or ``bounds`` such as
    ``">= 1"``, ``"> 0"``, ``"[0, 1]"`` or ``"(0, 1]"`` (checked by ``validate``; None passes), or
    ``values`` (said only: checked elsewhere); and what ``--resume`` does with a change (``resume``)."""
    metadata = {"help": help_text, "group": group, "resume": resume}
    if values is not None:
        metadata["values"] = values
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if bounds is not None:
        _within(0.0, bounds)  # a malformed bound fails at import
        metadata["bounds"] = bounds
    return field(default=default, metadata=metadata)


def _within(value: float, bounds: str) -> bool:
    if bounds[0] in "[(":
        low, high = (float(x) for x in bounds[1:-1].split(","))
        above = low <= value if bounds[0] == "[" else low < value
        return above and (value <= high if bounds[-1] == "]" else value < high)
    op, bound = bounds.split()
    return {">=": value >= float(bound), ">": value > float(bound)}[op]


def _engines_with(capability: str) -> str:
    return "--rollout-engine " + " or ".join(_SPEC.engines_with(capability))


def _bounds_message(bounds: str) -> str:
    return f"must lie in {bounds}" if bounds[0] in "[(" else f"must be {bounds}"


@dataclass
class TrainerConfig:
    # --- run
    output_dir: str = _opt(
        "ppo_fast_run", "Directory for metrics, plots, checkpoints and the warm-up cache.", "run", resume=IGNORED
    )
    steps: int = _opt(
        150, "Number of PPO iterations (rollout, score, estimate, optimize).", "run", bounds=">= 1", resume=IGNORED
    )
    seed: int = _opt(
        0,
        "Random seed (sampling, shuffling, initialisation).",
        "run",
        bounds=">= 0",
        resume=refused("the run's random streams continue from the checkpoint"),
    )
    device: str = _opt("auto", "Device: auto (cuda if available), cpu or cuda.", "run", choices=DEVICES)
    backend: str = _opt(
        "auto", "ppo_fast kernel backend: auto, reference, triton or native.", "run", choices=BACKEND_CHOICES
    )
    cpu_threads: int = _opt(
        1,
        "PyTorch CPU threads when training on CPU (0: PyTorch's default). Small models run fastest on one; "
        "more threads on a busy machine slow everything down.",
        "run",
        bounds=">= 0",
    )
    resume: bool = _opt(False, "Continue from the latest checkpoint in output_dir.", "run", resume=IGNORED)
    overwrite: bool = _opt(
        False,
        "Replace the run in output_dir: its checkpoints, metrics.jsonl, summary.json, curves.png, best/, "
        "run_config.yaml, train.log, tensorboard/ and vllm_model/ are deleted first (other files and the warm-up "
        "cache are kept). Without --overwrite or --resume, "
        "an output_dir that already holds a run is refused. Not with --resume.",
        "run",
        resume=IGNORED,
    )
    save_every: int = _opt(50, "Save a checkpoint every this many steps (0: only at the end).", "run", bounds=">= 0")
    keep_checkpoints: int = _opt(
        2, "How many of the latest checkpoints to keep in output_dir/checkpoints (0: all).", "run", bounds=">= 0"
    )
    keep_best: bool = _opt(
        False,
        "Keep the policy at its best held-out score (eval/score, at every --eval-every evaluation and the last) in "
        "output_dir/best, a save_pretrained folder; summary.json names its step and score.",
        "run",
    )
    sample_every: int = _opt(
        25, "Print a few sample completions every this many steps (0: never).", "run", bounds=">= 0"
    )
    num_samples_to_print: int = _opt(3, "How many sample completions to print each time.", "run", bounds=">= 1")
    eval_every: int = _opt(
        25,
        "Evaluate the held-out prompts (the built-in task's, or --eval-prompts-file) with greedy decoding every this "
        "many steps; always before and after PPO (0: only before and after).",
        "run",
        bounds=">= 0",
    )
    report_to: str = _opt(
        "auto",
        "Where metrics go besides metrics.jsonl: auto (TensorBoard when installed), none, or trackers separated by "
        "commas (each an error when not installed), each set up by its own environment variables.",
        "run",
        values=", ".join(REPORT_TO),
        resume=IGNORED,
    )
    verbose: bool = _opt(
        False,
        "Show transformers' own warnings and progress bars (hidden by default: ppo-fast reports).",
        "run",
        resume=IGNORED,
    )
    debug: bool = _opt(
        False, "On an error, print the full traceback (a reward function's included).", "run", resume=IGNORED
    )

    # --- models and rewards
    model_name_or_path: str | None = _opt(
        None,
        "Policy: a local AutoModelForCausalLM path/name. Unset: the built-in addition task's small GPT-2.",
        "model",
    )
    critic: str = _opt(
        "separate",
        "Value head on a separate copy of the backbone, or 'shared' with the policy.",
        "model",
        choices=CRITIC_MODES,
        resume=refused("the critic's weights and optimizer state have that layout"),
    )
    reward_fn: str | None = _opt(
        None,
        "Reward function 'module:function' (found in the working directory too) or 'path/to/file.py:function', "
        "or several separated by commas (--reward-weights). Called as fn(prompts, responses), fn(prompts, responses, "
        "answers), or, taking **kwargs or 'completions', as TRL calls one: fn(prompts=, completions=, **columns).",
        "model",
    )
    reward_model: str | None = _opt(
        None, "Path of an AutoModelForSequenceClassification reward model (logit 0 is the score).", "model"
    )
    reward_weights: str | None = _opt(
        None,
        "Weights, separated by commas: one per --reward-fn function, then --reward-model's. Unset: 1 each.",
        "model",
    )
    prompts_file: str | None = _opt(
        None,
        'Training prompts for a custom model: .txt (one per line), .jsonl (one {"prompt": ..., "answer": ...} '
        "object per line; answer optional) or .json (a list of strings or of such objects).",
        "model",
    )
    eval_prompts_file: str | None = _opt(
        None,
        "Held-out prompts, same formats as --prompts-file, scored by the run's reward with greedy decoding before, "
        "during and after PPO; with an 'answer' per prompt also eval/exact_match.",
        "model",
    )
    prompt_column: str = _opt(
        "prompt",
        "The prompts' column: text, or a conversation (a list of {'role', 'content'} messages, put through the chat "
        "template); a record without it may hold a 'messages' conversation (its last assistant turns left out).",
        "model",
    )
    answer_column: str = _opt("answer", "The prompts' column that holds the reference answer (optional).", "model")
    chat_template: str | None = _opt(None, "A Jinja chat-template file. Unset: the policy tokenizer's.", "model")
    max_prompt_length: int | None = _opt(
        None, "Leave out (and count) the prompts longer than this many tokens.", "model", bounds=">= 1"
    )
    gradient_checkpointing: bool = _opt(False, "Recompute activations in backward to save memory.", "model")
    padding_free: bool | None = _opt(
        None,
        "Score and update on each micro-batch's rows packed into fewer rows of the same width (position_ids "
        "restarting per packed sequence) instead of the padded [rows, prompt + response] layout. Unset: on where "
        "the model keeps attention inside each packed sequence (checked at start), else off with a notice.",
        "model",
        resume=IGNORED,
    )
    bf16: bool = _opt(True, "bfloat16 autocast on CUDA (ignored on CPU).", "model")
    disable_dropout: bool = _opt(
        True, "Set dropout to 0 so that old and new log-probs agree before the first update.", "model"
    )

    # --- LoRA (PEFT): low-rank adapters trained on a frozen base
    lora_r: int | None = _opt(
        None,
        "LoRA rank: train low-rank adapters (PEFT) on the frozen policy and critic instead of every weight; the "
        "KL reference is then the policy with its adapters switched off (no copy). Unset: full fine-tuning.",
        "lora",
        bounds=">= 1",
        resume=refused("the checkpoint holds adapters of that shape, or the full weights"),
    )
    lora_alpha: float = _opt(
        32.0,
        "LoRA scale numerator: the adapters' update is scaled by lora_alpha / lora_r.",
        "lora",
        bounds="> 0",
        resume=refused("the adapters were trained at that scale"),
    )
    lora_dropout: float = _opt(
        0.0,
        "Dropout on the adapters' input; > 0 needs --no-disable-dropout (and the first ratio is then not exactly 1).",
        "lora",
        bounds="[0, 1)",
    )
    lora_target_modules: str = _opt(
        LORA_ALL_LINEAR,
        f"Comma-separated names (or name suffixes) of the modules to adapt; '{LORA_ALL_LINEAR}': every linear "
        "layer of the transformer blocks (the attention and MLP projections). The LM head is never adapted "
        "(train it whole: --lora-modules-to-save).",
        "lora",
        resume=refused("the checkpoint holds adapters on those modules"),
    )
    lora_modules_to_save: str = _opt(
        "",
        "Comma-separated modules (or name suffixes) trained whole beside the adapters, e.g. lm_head,norm (PEFT's "
        "modules_to_save); the KL reference keeps the base's.",
        "lora",
        resume=refused("the checkpoint holds trained copies of those modules"),
    )
    lora_save_merged: bool = _opt(
        False,
        "With --lora-r: the final checkpoint also holds the policy with its adapters merged into the weights "
        "(policy_merged/, a plain transformers folder), beside the adapter folder (policy/).",
        "lora",
    )

    # --- rollout
    batch_size: int = _opt(64, "Prompts per PPO iteration.", "rollout", bounds=">= 1")
    group_size: int = _opt(1, "Responses sampled per prompt (>= 2 for grpo and rloo).", "rollout", bounds=">= 1")
    response_length: int | None = _opt(
        None,
        f"Maximum new tokens per response (generation stops at EOS). Unset: {BUILTIN_RESPONSE_LENGTH} for the "
        f"built-in task, {CUSTOM_RESPONSE_LENGTH} for a custom model.",
        "rollout",
        bounds=">= 1",
    )
    temperature: float = _opt(1.0, "Sampling temperature; log-probs use the same temperature.", "rollout", bounds="> 0")
    top_p: float = _opt(1.0, "Nucleus sampling threshold in (0, 1].", "rollout", bounds="(0, 1]")
    top_k: int = _opt(0, "Sample from the k most likely tokens only (0: all).", "rollout", bounds=">= 0")
    min_p: float = _opt(
        0.0,
        "Drop tokens whose probability is below min_p times the most likely one's (0: none).",
        "rollout",
        bounds="[0, 1]",
    )
    stop_strings: str = _opt(
        "",
        "Strings that end a response as EOS does, comma-separated (a JSON list for ones with commas): the stop "
        "string stays in the response (the reward sees it, the policy learns it).",
        "rollout",
    )
    repetition_penalty: float = _opt(
        1.0,
        "The engine's repetition penalty (1: none). The trainer's log-probs do not replay it; the engine's "
        "behaviour log-probs include it, and --rollout-correction weighs the difference.",
        "rollout",
        bounds="> 0",
    )
    generation_kwargs: str = _opt(
        "",
        "More of the engine's sampling options, a JSON object: GenerationConfig fields (hf) or SamplingParams "
        "fields (vllm), checked against the engine before the run starts; none an option above sets.",
        "rollout",
    )
    logprobs_support: str = _opt(
        "sampled",
        "Which distribution the old, new and reference log-probs are taken under: sampled (renormalised over the "
        "tokens --top-k/--top-p/--min-p keep, the distribution the rollouts were drawn from, so the importance ratio "
        "is consistent) or full (the whole vocabulary at --temperature: the ratio then carries the kept mass).",
        "rollout",
        choices=LOGPROBS_SUPPORTS,
    )
    rollout_engine: str = _opt(
        "hf",
        "Generate rollouts with "
        + " or ".join(f"{name} ({engine.summary})" for name, engine in ROLLOUT_ENGINES.items())
        + ".",
        "rollout",
        choices=tuple(ROLLOUT_ENGINES),
    )
    vllm_gpu_memory_utilization: float = _opt(
        0.3,
        "Fraction of the GPU's memory the vLLM engine may take (weights and KV cache); the rest is the trainer's.",
        "rollout",
        bounds="(0, 1]",
    )
    vllm_sleep: bool = _opt(
        False,
        "Put the vLLM engine to sleep during the update (weights offloaded, KV cache freed), waking it for the "
        "next rollout: frees GPU memory for training (GPU only).",
        "rollout",
    )
    max_staleness: int = _opt(
        0,
        "Asynchronous rollouts (docs/async.md): a producer process generates with weights at most this many updates "
        "old while the trainer trains (0: generate, then train, in turn).",
        "rollout",
        bounds=">= 0",
    )
    staleness_policy: str = _opt(
        "wait",
        "With --max-staleness > 0: the producer waits for fresh enough weights (wait), or the trainer drops the "
        "batches older than the bound (drop).",
        "rollout",
        choices=("wait", "drop"),
    )
    rollout_device: str = _opt(
        "auto",
        "With --max-staleness > 0: the producer's device: auto (the trainer's) or cuda:N, another GPU.",
        "rollout",
    )
    weight_transfer: str = _opt(
        "auto",
        "With --max-staleness > 0: how the producer gets each update's weights (docs/async.md): staging (shared "
        "memory, or CUDA IPC on the trainer's GPU), broadcast (a gloo or NCCL group of the two processes) or auto "
        "(staging on the trainer's device, broadcast on another).",
        "rollout",
        choices=("auto", "staging", "broadcast"),
    )
    partial_rollouts: int = _opt(
        0,
        "Partial rollouts (docs/async.md; with --max-staleness > 0): generate in rounds of at most this many tokens "
        "per response, continuing an unfinished one in the next round under the newest weights (0: off).",
        "rollout",
        bounds=">= 0",
    )
    partial_rollout_seconds: float = _opt(
        0.0,
        "With --partial-rollouts: a round also ends after this many seconds, at the token then sampled (0: no limit).",
        "rollout",
        bounds=">= 0",
    )
    rollout_correction: str = _opt(
        "none",
        f"Correct the policy loss for the engine/trainer log-prob mismatch ({_engines_with('logprobs')}): none, or "
        f"pf.rollout_correction_weights's mode ({', '.join(ROLLOUT_CORRECTION_MODES)}) as the loss's weights.",
        "rollout",
        choices=("none", *ROLLOUT_CORRECTION_MODES),
    )
    off_policy_loss: str = _opt(
        "decoupled",
        "The PPO ratio's anchor: decoupled (pi_old recomputed by the trainer; --rollout-correction weighs by "
        "pi_old/mu) or bypass (the engine's log-probs mu, no recompute; --rollout-correction caps or masks pi/mu).",
        "rollout",
        choices=_SPEC.OFF_POLICY_LOSSES,
    )
    rollout_correction_threshold: float = _opt(
        2.0,
        "Upper threshold of the rollout-correction weights (truncated, or masked above it for the *_mis modes).",
        "rollout",
        bounds="> 0",
    )

    # --- estimate
    advantage_method: str = _opt(
        "gae",
        f"Advantage estimator (ppo_fast.advantage_methods()): gae uses the critic; "
        f"{', '.join(GROUP_METHODS)} compare the responses to one prompt (group_size >= 2); "
        "reinforce_plus_plus (returns whitened over the batch) and remax (minus the greedy response's reward) need neither.",
        "estimate",
        choices=ADVANTAGE_METHOD_NAMES,
    )
    norm_by_std: bool = _opt(
        True,
        "grpo and grpo_passk: divide by the group's std (--no-norm-by-std: Dr. GRPO, mean-centred only).",
        "estimate",
    )
    advantage_params: str = _opt(
        "",
        "The advantage method's other parameters as name=value pairs separated by commas, e.g. 'epsilon=1e-4' "
        "(grpo), 'zero_singletons=true' (rloo), 'f_norm=2' (gpg); see pf.advantage_methods().",
        "estimate",
    )
    kl_placement: str = _opt(
        "auto",
        "Where the KL to the reference goes: 'reward' (kl_coef * KL subtracted from the reward, as in PPO-RLHF), "
        "'loss' (kl_coef * KL aggregated like the policy loss and added to it, as GRPO, TRL's beta, verl's use_kl_loss); "
        "auto: reward for gae, loss for the critic-free estimators (where a KL in the reward would enter the group "
        "normalisation: equal scores would get advantages from KL noise).",
        "estimate",
        choices=KL_PLACEMENTS,
    )
    kl_coef: float = _opt(
        0.05, "KL coefficient, in the reward or the loss (initial value when adaptive_kl).", "estimate", bounds=">= 0"
    )
    kl_estimator: str = _opt(
        "auto",
        "Per-token KL estimator, with d = logp - ref_logp: "
        + "; ".join(f"{name} = {doc}" for name, doc in _SPEC.KL_ESTIMATOR_DOCS.items())
        + "; auto: k1 in the reward, k3 in the loss.",
        "estimate",
        choices=("auto", *KL_ESTIMATORS),
    )
    adaptive_kl: bool = _opt(False, "Adapt kl_coef so that the KL tracks target_kl (Ziegler et al.).", "estimate")
    target_kl: float = _opt(6.0, "Target KL (summed over a response) for adaptive_kl.", "estimate", bounds="> 0")
    kl_horizon: float = _opt(10000.0, "Horizon (in samples) of the adaptive KL controller.", "estimate", bounds="> 0")
    gamma: float = _opt(1.0, "Discount factor.", "estimate", bounds="[0, 1]")
    lam: float = _opt(0.95, "GAE lambda.", "estimate", bounds="[0, 1]")
    whiten_advantages: bool = _opt(
        True,
        "Whiten advantages over the batch, for the estimators that do not normalise them (gae, rloo, remax, opo, gpg).",
        "estimate",
    )

    # --- optimize
    num_ppo_epochs: int = _opt(4, "Passes over each batch of rollouts.", "optimize", bounds=">= 1")
    num_mini_batches: int = _opt(2, "Minibatches per epoch (one optimizer step each).", "optimize", bounds=">= 1")
    gradient_accumulation_steps: int = _opt(
        1, "Micro-batches per minibatch (gradient accumulation).", "optimize", bounds=">= 1"
    )
    max_tokens_per_micro_batch: int | None = _opt(
        None,
        "Cut each minibatch into micro-batches of at most this many real (prompt + response) tokens, the rows "
        "binned first-fit decreasing (a longer row alone), instead of --gradient-accumulation-steps equal slices; "
        "every rank gets as many micro-batches (as verl's ppo_max_token_len_per_gpu).",
        "optimize",
        bounds=">= 1",
    )
    learning_rate: float = _opt(1e-4, "AdamW learning rate (policy and critic).", "optimize", bounds="> 0")
    lr_scheduler_type: str = _opt(
        "constant", "Learning-rate schedule: constant, linear or cosine decay.", "optimize", choices=LR_SCHEDULES
    )
    warmup_steps: int = _opt(0, "Optimizer steps of linear learning-rate warm-up.", "optimize", bounds=">= 0")
    weight_decay: float = _opt(0.0, "AdamW weight decay.", "optimize", bounds=">= 0")
    max_grad_norm: float = _opt(1.0, "Gradient clipping norm (0: no clipping).", "optimize", bounds=">= 0")
    loss_mode: str = _opt(
        "vanilla",
        "Policy loss (pf.policy_loss_modes(); verl 0.9.1's loss_mode): "
        + _POLICY_LOSS_LIST
        + "; its parameters besides the clips via --loss-mode-params.",
        "optimize",
        choices=POLICY_LOSSES,
    )
    clip_eps_low: float = _opt(
        0.2,
        "Ratio clip below 1 (1 - clip_eps_low) of the clipping losses (geo_mean: in log space; dppo_*: the trust "
        "region's size).",
        "optimize",
        values=_SPEC.param_values("clip_eps_low"),
    )
    clip_eps_high: float | None = _opt(
        None,
        "Ratio clip above 1 (1 + clip_eps_high); unset: clip_eps_low.",
        "optimize",
        values=_SPEC.param_values("clip_eps_high"),
    )
    dual_clip: float | None = _opt(
        None,
        "Dual-clip bound c > 1 on the loss of negative advantages (vanilla; unset: off).",
        "optimize",
        values=_SPEC.param_values("dual_clip"),
    )
    loss_mode_params: str = _opt(
        "",
        "The policy loss's other parameters as name=value pairs separated by commas, e.g. 'tau_pos=1,tau_neg=1.05' "
        "(sapo) or 'dro_beta=0.1' (dro, required); see pf.policy_loss_modes().",
        "optimize",
    )
    value_clip: float = _opt(0.2, "Value clip range around the rollout values.", "optimize", bounds="> 0")
    vf_coef: float = _opt(0.1, "Value loss coefficient.", "optimize", bounds=">= 0")
    entropy_coef: float = _opt(0.0, "Entropy bonus coefficient.", "optimize", bounds=">= 0")
    agg: str = _opt("token-mean", f"Loss aggregation: {', '.join(AGG_MODES)}.", "optimize", choices=AGG_MODES)

    # --- built-in task (used when model_name_or_path is unset)
    sft_steps: int = _opt(
        400,
        "Supervised warm-up steps of the built-in model (cached in output_dir/warmup).",
        "builtin",
        bounds=">= 0",
        resume=WARM_UP,
    )
    sft_batch_size: int = _opt(128, "Warm-up batch size.", "builtin", bounds=">= 1", resume=WARM_UP)
    sft_learning_rate: float = _opt(3e-3, "Warm-up learning rate.", "builtin", bounds="> 0", resume=WARM_UP)
    demo_carry_error_rate: float = _opt(
        0.7,
        "Fraction of warm-up demonstrations needing a carry whose teacher forgot it (a wrong digit).",
        "builtin",
        bounds="[0, 1]",
        resume=WARM_UP,
    )
    eval_size: int = _opt(
        400,
        "Held-out problems of the built-in task for greedy accuracy before and after PPO.",
        "builtin",
        bounds=">= 0",
        resume=WARM_UP,
    )

    # --- several processes (torchrun --nproc-per-node N -m ppo_fast train ...)
    parallel: str = _opt(
        "ddp",
        "With several processes: ddp (a full copy of the policy, critic and optimizer per rank, gradients "
        "all-reduced) or fsdp (FSDP2 fully_shard: weights, gradients and optimizer state sharded, sharded checkpoints).",
        "distributed",
        choices=PARALLEL_MODES,
        resume=refused("fsdp checkpoints are sharded, ddp ones are not"),
    )
    shard_reference: bool = _opt(
        False,
        "With several processes: shard the frozen reference with FSDP2 (1/N of its memory per rank, an "
        "all-gather per forward) instead of a full copy per rank.",
        "distributed",
    )
    dist_timeout: int = _opt(
        600,
        "With several processes: seconds a rank waits for the others before it stops with an error (a dead or "
        "stuck rank ends the run instead of hanging it).",
        "distributed",
        bounds=">= 1",
    )

    # ------------------------------------------------------------------ checks

    def logprob_truncation(self) -> dict:
        """The truncation keywords of the log-prob ops for the old, new and reference log-probs."""
        if self.logprobs_support == "full":
            return {}
        return {"top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    def logprob_truncation_active(self) -> bool:
        return bool(self.logprob_truncation()) and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    def validate(self) -> TrainerConfig:
        """Raise ``ConfigError`` naming the first bad field; return ``self``."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and "bounds" in f.metadata:
                _require(f.name, _within(value, f.metadata["bounds"]), _bounds_message(f.metadata["bounds"]))
        self._validate_combinations()
        self._validate_engine()
        self.stop_string_list(), self.generation_kwargs_dict()
        self.loss_mode_kwargs()
        self.advantage_kwargs()
        return self

    def _validate_combinations(self) -> None:
        """The choices and the options that depend on one another."""
        for name, choices in CHOICES.items():
            _require(name, getattr(self, name) in choices, f"must be one of {', '.join(choices)}")
        rows = self.batch_size * self.group_size
        _require(
            "num_mini_batches",
            rows % self.num_mini_batches == 0,
            f"must divide batch_size * group_size = {rows}",
        )
        _require(
            "gradient_accumulation_steps",
            (rows // self.num_mini_batches) % self.gradient_accumulation_steps == 0,
            f"must divide the minibatch size {rows // self.num_mini_batches}",
        )
        _require(
            "max_tokens_per_micro_batch",
            self.max_tokens_per_micro_batch is None or self.gradient_accumulation_steps == 1,
            "replaces --gradient-accumulation-steps (the micro-batches are cut by tokens); choose one",
        )
        if self.advantage_method in GROUP_METHODS:
            _require(
                "group_size",
                self.group_size >= 2,
                f"must be >= 2 for advantage_method={self.advantage_method}",
            )
        _require(
            "overwrite",
            not (self.overwrite and self.resume),
            "cannot be combined with --resume (--resume continues the run in output_dir, --overwrite deletes it); "
            "choose one",
        )
        if self.model_name_or_path is not None:
            _require("prompts_file", self.prompts_file is not None, "is required with --model-name-or-path")
            _require(
                "reward_fn",
                bool(self.reward_fn or self.reward_model),
                "(or --reward-model) is required with --model-name-or-path",
            )
        self._validate_lora()
        _NAMES.validate_rewards_and_trackers(self, REPORT_TO)

    def reward_fns(self) -> list[str]:
        """``--reward-fn``'s functions, in order."""
        return [spec.strip() for spec in (self.reward_fn or "").split(",") if spec.strip()]

    def reward_weight_values(self) -> list[float]:
        """One weight per reward (the functions, then the reward model): ``--reward-weights``, else 1 each."""
        count = len(self.reward_fns()) + (self.reward_model is not None)
        return [float(w) for w in self.reward_weights.split(",")] if self.reward_weights else [1.0] * count

    def _validate_engine(self) -> None:
        """What the options ask of the rollout engine, against what it can do (its registry entry)."""
        engine = ROLLOUT_ENGINES[self.rollout_engine]
        if engine.truncation_order != _SPEC.TRUNCATION_ORDER:  # they agree when min-p or top-p is off
            _require(
                "min_p",
                self.min_p == 0 or self.top_p == 1,
                f"with --top-p < 1 needs {_engines_with('truncation_order')} ({engine.name} applies "
                f"{', '.join(engine.truncation_order)} in that order, the log-prob ops min_p first)",
            )
        _require(
            "rollout_correction",
            self.rollout_correction == "none" or engine.logprobs,
            f"needs {_engines_with('logprobs')} (the {engine.name} engine's log-probs are the trainer's)",
        )
        _require(
            "off_policy_loss",
            self.off_policy_loss != "bypass" or engine.logprobs,
            f"bypass needs {_engines_with('logprobs')}",
        )
        _require("vllm_sleep", not self.vllm_sleep or engine.sleep_on, f"needs {_engines_with('sleep_on')}")
        _require(
            "vllm_sleep",
            not (self.vllm_sleep and self.max_staleness),
            "sleeps the engine while the producer of --max-staleness > 0 generates; choose one",
        )
        _NAMES.validate_partial_rollouts(self, engine, _engines_with)
        _NAMES.validate_rollout_device(self)

    def _validate_lora(self) -> None:
        """The LoRA options: only with --lora-r, never on the LM head, dropout only where it is kept."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("lora_")}
        _NAMES.validate_lora(self, defaults, LORA_ALL_LINEAR, LORA_HEAD_NAMES)

    def stop_string_list(self) -> list[str]:
        """``--stop-strings`` as a list (``ConfigError`` for a malformed one)."""
        return _NAMES.string_list("stop_strings", self.stop_strings)

    def generation_kwargs_dict(self) -> dict:
        """``--generation-kwargs`` as a dict (``ConfigError`` for one that is not a JSON object)."""
        return _NAMES.json_object("generation_kwargs", self.generation_kwargs)

    def lora_targets(self) -> list[str] | str:
        """``lora_target_modules`` as PEFT takes it: ``"all-linear"`` or a list of names."""
        if self.lora_target_modules.strip() == LORA_ALL_LINEAR:
            return LORA_ALL_LINEAR
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]

    def loss_mode_kwargs(self) -> dict:
        """The keyword parameters of ``loss_mode``'s mode: the clips it takes and ``loss_mode_params``
        (bound by spec.py's registry, without torch); ``ConfigError`` for one it does not take, a
        missing one or a bad value."""
        return _NAMES.loss_mode_kwargs(self, POLICY_LOSS_MODES[self.loss_mode])

    def loss_mode_param_values(self) -> dict[str, float]:
        """``loss_mode_params`` as ``{name: value}`` (the clips have flags of their own)."""
        return _NAMES.loss_mode_param_values(self.loss_mode_params)

    def advantage_kwargs(self) -> dict:
        """``advantage_params`` as the advantage method's keyword parameters, typed by their defaults
        in the registry; ``ConfigError`` for one the method does not take or one with a flag of its own."""
        return _NAMES.advantage_kwargs(self, ADVANTAGE_METHODS[self.advantage_method].params)

    @property
    def uses_critic(self) -> bool:
        return self.advantage_method in CRITIC_METHODS

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL is subtracted from the reward (else it is a term of the policy loss)."""
        return self.kl_placement == "reward" or (self.kl_placement == "auto" and self.uses_critic)

    @property
    def kl_estimator_used(self) -> str:
        if self.kl_estimator != "auto":
            return self.kl_estimator
        return "k1" if self.kl_in_reward else "k3"

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> TrainerConfig:
        """Build a config from ``{field: value}``; numbers written as strings (YAML reads
        ``1e-4`` as a string) are converted, anything else of the wrong type is an error."""
        values = current_names(values, source)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            hint = "; `ppo-fast options` lists them" if source != "config" else ""
            raise ConfigError(f"{source}: unknown option(s) {', '.join(map(str, unknown))}{hint}")
        hints = _type_hints()
        return cls(**{name: _coerce(name, value, hints[name], source) for name, value in values.items()})

    @classmethod
    def from_file(cls, path: str | Path) -> TrainerConfig:
        """Read a YAML (``.yaml``/``.yml``) or JSON file of ``field: value`` pairs."""
        return cls.from_dict(read_config_file(path), source=str(path))


def _require(name: str, ok: bool, message: str) -> None:
    if not ok:
        raise _NAMES.invalid(name, message)


_HINTS: dict = {}


def _type_hints() -> dict:
    if not _HINTS:
        _HINTS.update(typing.get_type_hints(TrainerConfig, globalns=vars(sys.modules[__name__])))
    return _HINTS


# The fields with a fixed set of values (checked by validate, offered by --help), from the fields.
CHOICES = {f.name: f.metadata["choices"] for f in dataclasses.fields(TrainerConfig) if "choices" in f.metadata}


def resume_policy(policy: str) -> dict[str, str]:
    """The fields whose ``resume`` starts with ``policy`` (``IGNORED``, ``WARM_UP``, ``"refused"``), with it."""
    return {
        f.name: f.metadata["resume"]
        for f in dataclasses.fields(TrainerConfig)
        if f.metadata["resume"].startswith(policy)
    }
