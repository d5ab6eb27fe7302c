"""A run's start (``build_run``): every option checked before a model is loaded, then the run folder
claimed, the data, the reward, the models, their optimiser, the rollout engine and the loss path,
into one ``Run`` record."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

import ppo_fast as pf
from ppo_fast.spec import ROLLOUT_ENGINES

from . import (
    async_ranks,
    async_rollouts,
    checkpoint,
    default_task,
    distributed,
    engine,
    lora,
    model_folder,
    packing,
    report,
    rollout_source,
    run_folder,
    trackers,
    weight_transfer,
)
from .config import BUILTIN_RESPONSE_LENGTH, CUSTOM_RESPONSE_LENGTH, ConfigError, TrainerConfig
from .metrics import PhaseTimer
from .models import (
    build_critic,
    check_pretrained,
    disable_dropout,
    enable_activation_checkpointing,
    frozen_reference,
    load_pretrained,
    third_party_output,
)
from .prompts import Columns, Prompts, read_prompts, render_chats
from .run_state import Run
from .scoring import FunctionScorer, RewardModelScorer, Rewards, load_reward_fn
from .update import loss_path

# The ops one PPO iteration calls (through pf.*), checked against --backend before loading.
TRAINER_OPS = ("token_logprobs", "kl_penalized_rewards", "gae", "clipped_policy_loss", "value_loss")


@dataclass(kw_only=True)
class Given:
    """What a Python caller passes instead of the config's paths and names (None: from the config)."""

    policy: object = None
    tokenizer: object = None
    reward_fn: Callable | list[Callable] | None = None
    prompts: list[str] | None = None
    eval_prompts: list[str] | None = None
    answers: list[str | None] | None = None
    eval_answers: list[str | None] | None = None


@dataclass(kw_only=True)
class Models:
    """The policy, its frozen reference, the critic (or None), what the update calls (the models or
    their DDP wrappers), the optimiser, its schedule and the KL controller."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module | None
    train_policy: torch.nn.Module
    train_critic: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    kl_control: object
    # With LoRA: the policy's PeftModel (its adapters' switch and folder); the reference is then
    # the policy itself, scored inside ``reference_scope()`` (its adapters off).
    adapters: object = None
    reference_scope: Callable = contextlib.nullcontext


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch; use --device cpu (or auto)")
    return torch.device(name)


def check_backend(name: str, device: torch.device, ops=TRAINER_OPS, advantage_method: str | None = None) -> None:
    """``ConfigError`` unless backend ``name`` serves every op the trainer uses on ``device``
    (and implements the critic-free ``advantage_method``, if given)."""
    if name == "auto":
        return
    method = pf.advantage_methods().get(advantage_method)
    wanted = [(op, None, None) for op in ops]
    if method is not None and method.fn is not None:
        wanted.append(("group_sum", method.backends, f"--advantage-method {advantage_method}"))
    with pf.use_backend(name):
        for op, implemented_by, label in wanted:
            try:
                pf.backend_for(op, device, implemented_by=implemented_by, label=label)
            except pf.BackendUnavailableError as err:
                raise ConfigError(
                    f"--backend {name} cannot run this job on {device.type}: {err}; "
                    "use --backend auto (the fastest available backend per op)"
                ) from None


def check_options(cfg: TrainerConfig, device: torch.device) -> None:
    """What the options can get wrong beyond their own values: the backends' ops, vLLM."""
    ops = TRAINER_OPS if cfg.uses_critic else tuple(op for op in TRAINER_OPS if op not in ("gae", "value_loss"))
    policy_op = pf.policy_loss_modes()[cfg.loss_mode].op  # the registry's op of this loss mode
    check_backend(
        cfg.backend,
        device,
        tuple(policy_op if op == "clipped_policy_loss" else op for op in ops),
        cfg.advantage_method,
    )
    if untracked := trackers.missing(cfg.report_to):
        raise ConfigError(untracked)
    if cfg.lora_r is not None:
        lora.check_installed()
    engine = ROLLOUT_ENGINES[cfg.rollout_engine]
    if engine.requires is not None and importlib.util.find_spec(engine.requires) is None:
        raise ConfigError(f"--rollout-engine {engine.name}: {engine.requires} is not installed ({engine.install_hint})")
    if cfg.vllm_sleep and device.type not in engine.sleep_on:
        raise ConfigError(f"--vllm-sleep: the {engine.name} engine sleeps on {', '.join(engine.sleep_on)} only")


def check_writable(output_dir: Path) -> None:
    """Create ``output_dir`` and make sure a file can be written there (``ConfigError`` if not),
    before any model is loaded; leftovers of an unfinished checkpoint are removed."""
    probe = output_dir / f".ppo-fast-write-test-{os.getpid()}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"--output-dir {output_dir}: cannot write there ({err.strerror or err}); choose a writable --output-dir"
        ) from None
    checkpoint.remove_stale(output_dir)


def builtin_model_notice(cfg: TrainerConfig, given: Given) -> str | None:
    """One line when the built-in task's model would train on the user's own prompts or reward
    (a forgotten ``--model-name-or-path``); None otherwise."""
    if given.policy is not None or cfg.model_name_or_path is not None:
        return None
    yours = [
        what
        for what, set_ in (
            ("--prompts-file", cfg.prompts_file is not None or given.prompts is not None),
            ("--reward-fn", cfg.reward_fn is not None or given.reward_fn is not None),
            ("--reward-model", cfg.reward_model is not None),
        )
        if set_
    ]
    if not yours:
        return None
    return (
        f"note: no --model-name-or-path: the built-in addition task's small GPT-2 is the policy, trained with your "
        f"{' and '.join(yours)}; pass --model-name-or-path to train your own model"
    )


def datasets_and_reward(cfg: TrainerConfig, given: Given, builtin: bool) -> tuple:
    """``(training prompts, held-out prompts, reward functions)``; the prompts None where the
    built-in task's are used; no function where a reward model alone is the reward."""
    columns = Columns(cfg.prompt_column, cfg.answer_column)
    if given.prompts is not None:
        train_set = Prompts(list(given.prompts), list(given.answers) if given.answers is not None else [])
    elif cfg.prompts_file is not None:
        train_set = read_prompts(cfg.prompts_file, "--prompts-file", columns)
    elif builtin:
        train_set = None  # the built-in task's, once its warm-up model is loaded
    else:
        raise ConfigError("--prompts-file is required with a custom model (or pass prompts= from Python)")
    if given.eval_prompts is not None:
        answers = list(given.eval_answers) if given.eval_answers is not None else []
        eval_set = Prompts(list(given.eval_prompts), answers)
    elif cfg.eval_prompts_file is not None:
        eval_set = read_prompts(cfg.eval_prompts_file, "--eval-prompts-file", columns)
    else:
        eval_set = None
    reward_fns = given.reward_fn if isinstance(given.reward_fn, (list, tuple)) else [given.reward_fn]
    reward_fns = [fn for fn in reward_fns if fn is not None] or [load_reward_fn(spec) for spec in cfg.reward_fns()]
    if not reward_fns and cfg.reward_model is None:
        if not builtin:
            raise ConfigError("a reward is required: --reward-fn or --reward-model (or reward_fn= from Python)")
        reward_fns = [default_task.addition_reward]
    return train_set, eval_set, reward_fns


def scorer(cfg: TrainerConfig, reward_fns: list[Callable], device: torch.device) -> Rewards:
    """The run's reward: its reward functions (from ``datasets_and_reward``) and its reward model,
    weighted by ``--reward-weights``."""
    scorers = [FunctionScorer(fn, cfg.answer_column) for fn in reward_fns]
    if cfg.reward_model is not None:
        scorers.append(RewardModelScorer(cfg.reward_model, device))
    weights = cfg.reward_weight_values() if cfg.reward_weights is not None else [1.0] * len(scorers)
    if len(weights) != len(scorers):  # reward functions given from Python, weights from the command line
        raise ConfigError(f"--reward-weights: gives {len(weights)} weights for {len(scorers)} rewards")
    return Rewards(scorers, weights)


def load_policy(cfg: TrainerConfig, given: Given, run) -> tuple:
    """``(policy, tokenizer)``: the given ones, the built-in task's warm-up model (trained or read
    from its cache; one rank trains, the others load), or a pretrained model.  The tokenizer pads
    with its EOS token if it has no pad token."""
    policy, tokenizer = given.policy, given.tokenizer
    if policy is None and cfg.model_name_or_path is None:
        with run.parallel.main_first():
            policy, tokenizer = default_task.load_or_warm_up(cfg, run.device, run.log)
    elif policy is None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        policy = load_pretrained("--model-name-or-path", cfg.model_name_or_path, AutoModelForCausalLM)
        policy = policy.to(run.device)
        tokenizer = load_pretrained("--model-name-or-path", cfg.model_name_or_path, AutoTokenizer)
    if tokenizer is None:
        raise ConfigError("tokenizer= is required when a policy model object is passed")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy, tokenizer


def prompt_sets(
    cfg: TrainerConfig, train_set: Prompts | None, eval_set: Prompts | None, builtin: bool, tokenizer, log
) -> tuple:
    """``(training prompts, held-out prompts)``: the built-in task's where none were given; each
    conversation put through the chat template, and the prompts over ``--max-prompt-length``
    tokens left out (an empty one refused: it would be scored from another row's tokens)."""
    if builtin:
        builtin_train, builtin_eval = default_task.prompts(cfg)
        train_set = train_set or Prompts(builtin_train)
        eval_set = Prompts(builtin_eval) if eval_set is None else eval_set
    template = Path(cfg.chat_template).read_text(encoding="utf-8") if cfg.chat_template else None
    sets = (("--prompts-file", train_set), ("--eval-prompts-file", eval_set or Prompts([])))
    return tuple(
        _fitted(cfg, render_chats(p, tokenizer, template, option), tokenizer, option, log) for option, p in sets
    )


def _fitted(cfg: TrainerConfig, prompts: Prompts, tokenizer, option: str, log) -> Prompts:
    """``prompts`` without those over ``--max-prompt-length`` tokens; ``ConfigError`` for an empty one."""
    if not len(prompts):
        return prompts
    lengths = [len(ids) for ids in tokenizer(prompts.texts)["input_ids"]]
    if 0 in lengths:
        i = lengths.index(0)
        raise ConfigError(f"{option}: prompt {i} ({prompts.texts[i]!r}) is no token at all for this tokenizer")
    if cfg.max_prompt_length is None:
        return prompts
    kept = [i for i, n in enumerate(lengths) if n <= cfg.max_prompt_length]
    if not kept:
        raise ConfigError(f"{option}: every prompt is longer than --max-prompt-length {cfg.max_prompt_length}")
    if len(kept) < len(prompts):
        log(
            f"{option}: {len(prompts) - len(kept)} of {len(prompts)} prompts are longer than --max-prompt-length "
            f"{cfg.max_prompt_length} tokens: left out"
        )
    return prompts.kept(kept)


def lr_lambda(cfg: TrainerConfig, total_updates: int) -> Callable[[int], float]:
    """Linear warm-up over ``warmup_steps`` optimizer steps, then constant, linear or cosine decay."""

    def factor(update: int) -> float:
        if update < cfg.warmup_steps:
            return (update + 1) / cfg.warmup_steps
        progress = min(1.0, (update - cfg.warmup_steps) / max(1, total_updates - cfg.warmup_steps))
        if cfg.lr_scheduler_type == "linear":
            return 1.0 - progress
        if cfg.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def schedule(cfg: TrainerConfig) -> Callable[[int], float]:
    """The learning-rate factor of the run's optimizer steps (``lr_lambda`` over all of them)."""
    return lr_lambda(cfg, cfg.steps * cfg.num_ppo_epochs * cfg.num_mini_batches)


def build_models(cfg: TrainerConfig, policy, parallel, device: torch.device) -> Models:
    """The policy, its frozen reference, the critic, their wrappers, the optimiser and the KL control."""
    policy = policy.to(device).eval()
    if cfg.disable_dropout:
        disable_dropout(policy)
    adapters, reference_scope = None, contextlib.nullcontext
    # The critic copies the base before any adapter goes in (with LoRA it then gets its own).
    critic = build_critic(policy, cfg.critic) if cfg.uses_critic else None
    if cfg.lora_r is None:
        reference = frozen_reference(policy)
    else:
        adapters = lora.attach(cfg, policy)
        if critic is not None and not critic.shared:
            lora.attach(cfg, critic.backbone)
        reference, reference_scope = policy, adapters.disable_adapter
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(policy, frozen_inputs=adapters is not None)
        if critic is not None and not critic.shared:
            enable_activation_checkpointing(critic.backbone, frozen_inputs=adapters is not None)
    # What the update calls: the models themselves, or their DDP wrappers (FSDP2 shards in place).
    train_policy, train_critic = parallel.prepare(policy, critic, reference)
    models = [policy] + ([critic] if critic is not None else [])
    params = [p for model in models for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(cfg))
    if cfg.adaptive_kl:
        kl_control = pf.AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
    else:
        kl_control = pf.FixedKLController(cfg.kl_coef)
    return Models(
        policy=policy,
        reference=reference,
        critic=critic,
        train_policy=train_policy,
        train_critic=train_critic,
        optimizer=optimizer,
        scheduler=scheduler,
        kl_control=kl_control,
        adapters=adapters,
        reference_scope=reference_scope,
    )


def padding_free(cfg: TrainerConfig, policy, device: torch.device, log) -> bool:
    """``--padding-free`` resolved on the model in use: on unless ``--no-padding-free`` or, when it
    is unset, the model's attention crosses packed sequences (said in one line); asked for on such
    a model, a ``ConfigError``."""
    if cfg.padding_free is False:
        return False
    refused = packing.problem(policy, device)
    if refused is None:
        return True
    if cfg.padding_free:
        raise ConfigError(f"--padding-free: {refused}; pass --no-padding-free")
    log(f"padding-free off: {refused}")
    return False


def fit_response_length(run, policy) -> int:
    """The response length that keeps prompt + response within the model's positions: the default
    one is shortened to fit; a given one that does not fit is a ``ConfigError``."""
    length, given = run.response_length, run.cfg.response_length is not None
    config = getattr(policy, "config", None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not positions:
        return length
    longest = max(len(ids) for ids in run.tokenizer(run.prompts + run.eval_prompts).input_ids)
    room = positions - longest
    if given and length > room:
        raise ConfigError(
            f"--response-length {length} does not fit: the longest prompt has {longest} tokens "
            f"and the model {positions} positions; use --response-length {max(room, 1)} or less"
        )
    if not given and room < 1:
        raise ConfigError(
            f"the longest prompt has {longest} tokens, the model only {positions} positions; shorten the prompts"
        )
    if not given and room < length:
        run.log(f"response length {room}: the model has {positions} positions, the longest prompt {longest} tokens")
        return room
    return length


def _silent(_message: str) -> None:
    pass


def build_run(cfg: TrainerConfig, given: Given, log: Callable[[str], None] | None = None) -> Run:
    """The run, started in the order its rules need: every option checked before anything is written or
    loaded; the run folder claimed before anything is written to it; the models built; the rollout
    engine started before the PPO phase is seeded (vLLM seeds torch's generator); then the checkpoint
    restored (``--resume``)."""
    run = _checked_start(cfg, given, log)
    cfg = run.cfg
    train_set, eval_set, reward_fn = datasets_and_reward(cfg, given, run.builtin)
    resume_from = checkpoint.find_resumable(run) if cfg.resume else None
    if resume_from is not None and given.policy is None:
        refused = run_folder.base_problem(run.output_dir, cfg.model_name_or_path, model_folder.fingerprint)
        if refused:
            raise ConfigError(refused)
    checkpoint.claim_output_dir(run)  # nothing is written to output_dir before this
    check_writable(run.output_dir)
    report.start_run_folder(run)  # run_config.yaml, train.log
    distributed.claim_for_elastic_restarts(run.parallel, run.output_dir)
    if run.device.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    torch.manual_seed(cfg.seed)
    policy, run.tokenizer = load_policy(cfg, given, run)
    run.train_set, run.eval_set = prompt_sets(cfg, train_set, eval_set, run.builtin, run.tokenizer, run.log)
    if not run.builtin:
        run.response_length = fit_response_length(run, policy)
    if not run.eval_prompts:
        run.log("no held-out prompts (--eval-prompts-file): no evaluation before, during or after PPO")
    run.scorer = scorer(cfg, reward_fn, run.device)
    packed = padding_free(cfg, policy.to(run.device), run.device, run.log)
    cfg = run.cfg = dataclasses.replace(cfg, padding_free=packed)
    template = async_ranks.producer_template(cfg, policy, run.parallel)  # before FSDP2 shards the policy
    models = build_models(cfg, policy, run.parallel, run.device)
    for name in (f.name for f in dataclasses.fields(Models)):
        setattr(run, name, getattr(models, name))
    run.loss_path = loss_path(run.train_policy, run.critic, cfg, run.device)
    run.log(str(run.loss_path))
    if cfg.max_staleness == 0:  # else the engine runs in the producer process (async_rollouts)
        run.engine = engine.start(cfg.rollout_engine, _engine_setup(run))
    # The PPO phase's random streams start from the seed, whether or not the
    # warm-up above was trained (consuming random numbers) or loaded from cache; each rank its own.
    checkpoint.seed_all(cfg.seed + run.parallel.rank)
    if resume_from is not None:
        run.step = run.resumed_from = checkpoint.restore(run, resume_from, schedule(cfg))
        if run.engine is not None:
            run.engine.sync_weights(run.policy)
    # Where the rollouts come from: generated in the loop, or by a producer process (it starts from these weights),
    # under torchrun rank 0's.
    if not cfg.max_staleness:
        run.source = rollout_source.SyncSource(run)
    else:
        run.source = async_ranks.from_run(run, template) if run.parallel.active else async_rollouts.from_run(run)
    return run


def _checked_start(cfg: TrainerConfig, given: Given, log) -> Run:
    """The run before anything is loaded: its options checked (with the device and the processes), a
    torchrun restart of this job turned into a resume, the models that will be loaded checked."""
    created = time.perf_counter()
    cfg = cfg.validate()
    run_log = report.RunLog(log or tqdm.write)
    third_party_output(cfg.verbose)
    output_dir = Path(cfg.output_dir)
    parallel, device = distributed.init(cfg, resolve_device(cfg.device))
    check_options(cfg, device)
    # Rank 0's producer's device and weights' path (rank 0's device: cuda:0 under torchrun on GPUs), on every
    # rank, so that a refusal stops every rank alike, before anything is loaded.
    main_device = torch.device("cuda", 0) if parallel.active and device.type == "cuda" else device
    transfer = weight_transfer.resolve(cfg, main_device) if cfg.max_staleness else None
    if distributed.restart_of_this_job(parallel, output_dir):  # torchrun --max-restarts
        cfg = dataclasses.replace(cfg, resume=True, overwrite=False)
        run_log(f"torchrun restart: continuing the run this job started in {output_dir}")
    builtin = given.policy is None and cfg.model_name_or_path is None
    run = Run(
        cfg=cfg,
        log=run_log if parallel.main else _silent,  # rank 0 speaks for the run
        output_dir=output_dir,
        parallel=parallel,
        device=device,
        builtin=builtin,
        response_length=cfg.response_length or (BUILTIN_RESPONSE_LENGTH if builtin else CUSTOM_RESPONSE_LENGTH),
        created=created,
        timer=PhaseTimer(),
        transfer=transfer,
    )
    if notice := builtin_model_notice(cfg, given):
        run.log(notice)
    if given.policy is None and not builtin:
        check_pretrained("--model-name-or-path", cfg.model_name_or_path)
    if given.reward_fn is None and cfg.reward_model is not None:
        check_pretrained("--reward-model", cfg.reward_model)
    return run


def _engine_setup(run: Run) -> engine.EngineSetup:
    cfg = run.cfg
    return engine.EngineSetup(
        policy=run.policy,
        tokenizer=run.tokenizer,
        prompts=run.prompts,
        response_length=run.response_length,
        rows=run.parallel.per_rank(cfg.batch_size) * cfg.group_size,
        device=run.device,
        cfg=cfg,
        output_dir=run.output_dir,
        autocast=run_autocast(run),
        synced_gpus=run.parallel.synced_generation,
        log=run.log,
    )


def run_autocast(run: Run) -> Callable:
    """The run's autocast: bf16 on CUDA with ``--bf16``, else none."""

    def autocast():
        return engine.autocast(run.device, run.cfg.bf16)

    return autocast
