"""The PPO loop: rollout, score, estimate, optimize; with logging, checkpoints and clean stops."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

import ppo_fast as pf

from . import checkpoint, default_task, distributed, resume, run_folder
from .config import BUILTIN_RESPONSE_LENGTH, CUSTOM_RESPONSE_LENGTH, GROUP_METHODS, ConfigError, TrainerConfig
from .estimate import estimate
from .metrics import ACCURACY, EVAL_KEYS, MetricsWriter, PhaseTimer, plot_curves
from .models import (
    build_critic,
    check_pretrained,
    disable_dropout,
    enable_activation_checkpointing,
    frozen_reference,
    load_pretrained,
    third_party_output,
)
from .prompts import Prompts, exact_match
from .prompts import read_prompts as _read_prompt_file
from .rollout import decode_responses, generate, score_old_and_ref
from .rollout_vllm import VLLMEngine, check_installed, mismatch_metrics
from .scoring import FunctionScorer, RewardModelScorer, check_finite, load_reward_fn
from .update import Experience, policy_loss_params, ppo_update

SUMMARY_FILE = run_folder.SUMMARY_FILE


# The ops one PPO iteration calls (through pf.*), checked against --backend before loading.
TRAINER_OPS = ("token_logprobs", "kl_penalized_rewards", "gae", "clipped_policy_loss", "value_loss")


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
    from ppo_fast.backends import resolve

    method = pf.advantage_methods().get(advantage_method)
    wanted = [(op, None, None) for op in ops]
    if method is not None and method.fn is not None:
        wanted.append(("group_sum", method.backends, f"--advantage-method {advantage_method}"))
    with pf.use_backend(name):
        for op, implemented_by, label in wanted:
            try:
                resolve(op, device.type, implemented_by, label)
            except pf.BackendUnavailableError as err:
                raise ConfigError(
                    f"--backend {name} cannot run this job on {device.type}: {err}; "
                    "use --backend auto (the fastest available backend per op)"
                ) from None


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


def _hold_for_a_test(step: int) -> None:
    """Test-only: ``PPO_FAST_TEST_HOLD=STEP:PATH`` holds this process once it has saved step STEP's
    checkpoint, until it is killed, once per PATH (created here), so that a multi-host test kills a
    rank mid-run without a long run (tests/test_multihost.py)."""
    held = os.environ.get("PPO_FAST_TEST_HOLD")
    if held:
        at, path = held.split(":", 1)
        if step == int(at) and not os.path.exists(path):
            Path(path).touch()
            while True:
                time.sleep(1)


def _silent(_message: str) -> None:
    pass


def read_prompts(path: str, option: str = "--prompts-file") -> list[str]:
    """The prompts of a ``.txt``, ``.jsonl`` or ``.json`` file (see ``ppo_fast.trainer.prompts``)."""
    return _read_prompt_file(path, option).texts


def _masked_variance(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return pf.masked_mean((x - pf.masked_mean(x, mask)).square(), mask)


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


def _eval_text(first: dict, second: dict | None = None) -> str:
    """``score 0.605 -> 0.913, exact match 0.600 -> 0.910`` (or one value each without ``second``)."""
    parts = []
    for key, name in (("eval/score", "score"), ("eval/exact_match", "exact match")):
        if key in first:
            value = f"{first[key]:.3f}" + (f" -> {second[key]:.3f}" if second and key in second else "")
            parts.append(f"{name} {value}")
    return ", ".join(parts)


class StopNow(KeyboardInterrupt):
    """A second Ctrl-C (or SIGTERM): the run stops at once, nothing more is saved or evaluated."""


class _DeferredInterrupt:
    """Turns the first Ctrl-C (SIGINT) or SIGTERM (what schedulers send) into a request to stop
    after the current step; a second one interrupts at once."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, log):
        self.requested = False
        self.log = log
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise StopNow
        self.requested = True
        self.log(f"{self.SIGNALS[signum]}: stopping after this step (again to stop at once)")

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)


class PPOTrainer:
    """PPO for a causal LM with a frozen reference, an optional critic and a sequence-level reward.

    With no model given (and ``cfg.model_name_or_path`` unset) it runs the built-in
    addition task.  ``policy``/``tokenizer``/``reward_fn``/``prompts`` may be passed as
    objects from Python instead of through the config.
    """

    def __init__(
        self,
        cfg: TrainerConfig,
        *,
        policy=None,
        tokenizer=None,
        reward_fn: Callable | None = None,
        prompts: list[str] | None = None,
        eval_prompts: list[str] | None = None,
        answers: list[str | None] | None = None,
        eval_answers: list[str | None] | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.created = time.perf_counter()
        self.cfg = cfg.validate()
        self.log = log or tqdm.write
        third_party_output(cfg.verbose)
        self.output_dir = Path(cfg.output_dir)

        # Everything a user can get wrong is checked here, before any model is loaded.
        self.parallel, self.device = distributed.init(cfg, resolve_device(cfg.device))
        if not self.parallel.main:  # rank 0 speaks for the run
            self.log = _silent
        self._check_options()
        if distributed.restart_of_this_job(self.parallel, self.output_dir):  # torchrun --max-restarts
            cfg = self.cfg = dataclasses.replace(cfg, resume=True, overwrite=False)
            self.log(f"torchrun restart: continuing the run this job started in {self.output_dir}")
        builtin = policy is None and cfg.model_name_or_path is None
        self.builtin = builtin
        self.response_length = cfg.response_length or (BUILTIN_RESPONSE_LENGTH if builtin else CUSTOM_RESPONSE_LENGTH)
        if policy is None and not builtin:
            check_pretrained("--model-name-or-path", cfg.model_name_or_path)
        if reward_fn is None and cfg.reward_model is not None:
            check_pretrained("--reward-model", cfg.reward_model)
        train_set, eval_set, reward_fn = self._datasets_and_reward(
            builtin, prompts, answers, eval_prompts, eval_answers, reward_fn
        )
        resume_from = self._check_resume(builtin) if cfg.resume else None
        self._claim_output_dir()  # nothing is written to output_dir before this

        check_writable(self.output_dir)
        distributed.claim_for_elastic_restarts(self.parallel, self.output_dir)
        if self.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        torch.manual_seed(cfg.seed)
        policy, tokenizer, train_set, eval_set = self._load_policy(builtin, policy, tokenizer, train_set, eval_set)
        if tokenizer is None:
            raise ConfigError("tokenizer= is required when a policy model object is passed")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.train_set, self.eval_set = train_set, eval_set or Prompts([])
        self.prompts, self.eval_prompts = self.train_set.texts, self.eval_set.texts
        self.tokenizer = tokenizer
        if not builtin:
            self._fit_response_length(policy)
        if not self.eval_prompts:
            self.log("no held-out prompts (--eval-prompts-file): no evaluation before, during or after PPO")

        if reward_fn is not None:
            self.scorer = FunctionScorer(reward_fn)
        else:
            self.scorer = RewardModelScorer(cfg.reward_model, self.device)

        self._build_models(policy)
        self.step = 0
        self.resumed_from = None
        self._in_update = False
        self._warned_no_signal = False
        self.timer = PhaseTimer()
        self.engine = self._start_engine() if cfg.rollout_engine == "vllm" else None
        # The PPO phase's random streams start from the seed, whether or not the
        # warm-up above was trained (consuming random numbers) or loaded from cache; each rank its own.
        checkpoint.seed_all(cfg.seed + self.parallel.rank)
        if resume_from is not None:
            self._resume(resume_from)
            if self.engine is not None:
                self.engine.sync_weights(self.policy)

    def _load_policy(self, builtin, policy, tokenizer, train_set, eval_set):
        """The policy and tokenizer (the built-in task's warm-up model, or a pretrained one) and the prompts."""
        cfg = self.cfg
        if builtin:
            with self.parallel.main_first():  # one rank trains and caches the warm-up model, the others load it
                policy, tokenizer = default_task.load_or_warm_up(cfg, self.device, self.log)
            builtin_train, builtin_eval = default_task.prompts(cfg)
            train_set = train_set or Prompts(builtin_train)
            eval_set = Prompts(builtin_eval) if eval_set is None else eval_set
        elif policy is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            policy = load_pretrained("--model-name-or-path", cfg.model_name_or_path, AutoModelForCausalLM).to(
                self.device
            )
            tokenizer = load_pretrained("--model-name-or-path", cfg.model_name_or_path, AutoTokenizer)
        return policy, tokenizer, train_set, eval_set

    def _check_options(self) -> None:
        """What the options can get wrong beyond their own values: the backends' ops, vLLM."""
        cfg = self.cfg
        policy_loss_params(cfg)
        ops = TRAINER_OPS if cfg.uses_critic else tuple(op for op in TRAINER_OPS if op not in ("gae", "value_loss"))
        policy_op = pf.policy_loss_modes()[cfg.policy_loss].op  # the registry's op of this loss mode
        check_backend(
            cfg.backend,
            self.device,
            tuple(policy_op if op == "clipped_policy_loss" else op for op in ops),
            cfg.advantage_method,
        )
        if cfg.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("--report-to tensorboard: tensorboard is not installed (pip install tensorboard)")
        if cfg.rollout_engine == "vllm":
            check_installed()
            if cfg.vllm_sleep and self.device.type != "cuda":
                raise ConfigError("--vllm-sleep: vLLM's sleep mode needs a CUDA GPU")

    def _datasets_and_reward(self, builtin, prompts, answers, eval_prompts, eval_answers, reward_fn):
        """The training and held-out prompts (None: the built-in task's) and the reward function."""
        cfg = self.cfg
        if prompts is not None:
            train_set = Prompts(list(prompts), list(answers) if answers is not None else [])
        elif cfg.prompts_file is not None:
            train_set = _read_prompt_file(cfg.prompts_file, "--prompts-file")
        elif builtin:
            train_set = None  # the built-in task's, below
        else:
            raise ConfigError("--prompts-file is required with a custom model (or pass prompts= from Python)")
        if eval_prompts is not None:
            eval_set = Prompts(list(eval_prompts), list(eval_answers) if eval_answers is not None else [])
        elif cfg.eval_prompts_file is not None:
            eval_set = _read_prompt_file(cfg.eval_prompts_file, "--eval-prompts-file")
        else:
            eval_set = None
        if reward_fn is None and cfg.reward_fn is not None:
            reward_fn = load_reward_fn(cfg.reward_fn)
        if reward_fn is None and cfg.reward_model is None:
            if not builtin:
                raise ConfigError("a reward is required: --reward-fn or --reward-model (or reward_fn= from Python)")
            reward_fn = default_task.addition_reward
        return train_set, eval_set, reward_fn

    def _build_models(self, policy) -> None:
        """The policy, its frozen reference, the critic, their wrappers, the optimiser and the KL control."""
        cfg = self.cfg
        self.policy = policy.to(self.device).eval()
        if cfg.disable_dropout:
            disable_dropout(self.policy)
        self.reference = frozen_reference(self.policy)
        self.critic = build_critic(self.policy, cfg.critic) if cfg.uses_critic else None
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.policy)
            if self.critic is not None and not self.critic.shared:
                enable_activation_checkpointing(self.critic.backbone)
        # What the update calls: the models themselves, or their DDP wrappers (FSDP2 shards in place).
        self.train_policy, self.train_critic = self.parallel.prepare(self.policy, self.critic, self.reference)
        params = list(self.policy.parameters()) + (list(self.critic.parameters()) if self.critic is not None else [])
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        total_updates = cfg.steps * cfg.num_ppo_epochs * cfg.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_updates))
        self.kl_control = (
            pf.AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
            if cfg.adaptive_kl
            else pf.FixedKLController(cfg.kl_coef)
        )

    def _start_engine(self) -> VLLMEngine:
        """The vLLM engine, holding the policy's weights (started before the PPO phase is seeded:
        vLLM seeds torch's generator when it starts)."""
        cfg = self.cfg
        longest = max(len(ids) for ids in self.tokenizer(self.prompts).input_ids)
        dtype = torch.bfloat16 if self.device.type == "cuda" and cfg.bf16 else next(self.policy.parameters()).dtype
        engine = VLLMEngine(
            self.policy,
            model_dir=self.output_dir / run_folder.VLLM_MODEL_DIR,
            max_model_len=longest + self.response_length,
            max_num_seqs=self.parallel.per_rank(cfg.batch_size) * cfg.num_samples_per_prompt,
            dtype=dtype,
            seed=cfg.seed,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            sleep=cfg.vllm_sleep,
        )
        self.log(f"vLLM engine ({dtype}) started in {engine.start_s:.1f}s")
        return engine

    def _fit_response_length(self, policy) -> None:
        """Keep prompt + response within the model's positions: the default response length
        is shortened to fit; a given one that does not fit is reported."""
        config = getattr(policy, "config", None)
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if not positions:
            return
        longest = max(len(ids) for ids in self.tokenizer(self.prompts + self.eval_prompts).input_ids)
        room = positions - longest
        if self.cfg.response_length is None:
            if room < 1:
                raise ConfigError(
                    f"the longest prompt has {longest} tokens, the model only {positions} positions; "
                    "shorten the prompts"
                )
            if room < self.response_length:
                self.log(
                    f"response length {room}: the model has {positions} positions, the longest prompt {longest} tokens"
                )
                self.response_length = room
        elif self.response_length > room:
            raise ConfigError(
                f"--response-length {self.response_length} does not fit: the longest prompt has {longest} tokens "
                f"and the model {positions} positions; use --response-length {max(room, 1)} or less"
            )

    # ------------------------------------------------------------------ checkpoints

    def _claim_output_dir(self) -> None:
        """A new run (no ``--resume``) in a folder that holds a run: ``ConfigError`` in one line,
        nothing touched; with ``--overwrite`` the old run's artifacts are removed first (see
        ``run_folder``).  Rank 0 looks and removes, alone; every rank follows its verdict."""
        cfg = self.cfg
        if cfg.resume:
            return
        verdict = None
        if self.parallel.main:
            verdict = run_folder.refusal(self.output_dir, resume=False, overwrite=cfg.overwrite)
            found = run_folder.artifacts(self.output_dir) if verdict is None and cfg.overwrite else []
            if found:
                what = run_folder.describe(found, self.output_dir)
                try:
                    run_folder.remove_run(self.output_dir)
                except OSError as err:
                    verdict = (
                        f"--overwrite: cannot remove {err.filename or self.output_dir} "
                        f"({err.strerror or err}); remove the old run in {self.output_dir} yourself, or choose "
                        "another --output-dir"
                    )
                else:
                    self.log(f"--overwrite: removed the previous run in {self.output_dir} ({what})")
        verdict = self.parallel.from_main(verdict)
        if verdict is not None:
            raise ConfigError(verdict)

    def _check_resume(self, builtin: bool) -> checkpoint.Loaded | None:
        """The newest usable checkpoint, read whole; ``ConfigError`` if this run's options
        cannot continue it (checked before any model is loaded)."""
        cfg = self.cfg

        def check_state(path: Path, state: checkpoint.TrainerState) -> None:
            resume.check(state.config, cfg, builtin, f"--resume: the checkpoint {path}")

        loaded = checkpoint.load_latest_usable(
            self.output_dir, self.log, sharded=self.sharded_checkpoints, check_state=check_state
        )
        if loaded is None:
            self.log(f"--resume: no checkpoint in {self.output_dir / checkpoint.CHECKPOINTS}, starting from scratch")
        return loaded

    def _resume(self, loaded: checkpoint.Loaded) -> None:
        state = loaded.state
        changed = resume.check(state.config, self.cfg, self.builtin, f"--resume: the checkpoint {loaded.path}")
        if changed:
            self.log("resuming with changed options: " + ", ".join(changed))
        try:
            if self.sharded_checkpoints:  # resharded to this world size by torch.distributed.checkpoint
                distributed.load_sharded(loaded.path / checkpoint.SHARDED_DIR, self.policy, self.critic, self.optimizer)
            else:
                self.policy.load_state_dict(loaded.policy)
                if self.critic is not None:
                    self.critic.load_state_dict(loaded.critic)
                self.optimizer.load_state_dict(state.optimizer)
        except (
            RuntimeError,
            ValueError,
            KeyError,
        ) as err:  # load_state_dict: missing/unexpected keys, shapes, param groups
            reason = " ".join(str(err).split())[:300]
            raise ConfigError(
                f"--resume: the checkpoint {loaded.path} does not fit this run's model ({reason}); "
                "resume with the options the run was started with, or use another --output-dir"
            ) from err
        self.scheduler.load_state_dict(state.scheduler)
        total_updates = self.cfg.steps * self.cfg.num_ppo_epochs * self.cfg.num_mini_batches
        resume.apply_optimizer_options(self.optimizer, self.scheduler, self.cfg, lr_lambda(self.cfg, total_updates))
        # A --kl-coef given anew replaces the current (possibly adapted) coefficient.
        kl_changed = state.config.get("kl_coef", self.cfg.kl_coef) != self.cfg.kl_coef
        self.kl_control.value = self.cfg.kl_coef if kl_changed else state.kl_coef
        rngs = state.rng_per_rank or [state.rng]
        if len(rngs) == self.parallel.world_size:
            checkpoint.set_rng_state(rngs[self.parallel.rank])
        else:  # weights, optimizer, schedule and KL continue exactly; the random streams start anew
            checkpoint.seed_all(self.cfg.seed + self.parallel.rank + self.parallel.world_size * state.step)
            self.log(
                f"--resume: the checkpoint was saved by {len(rngs)} process(es), this run has "
                f"{self.parallel.world_size}: the random streams are seeded anew (the run continues, not bit for bit)"
            )
        self.step = self.resumed_from = state.step
        self.log(f"resumed from {loaded.path} (step {state.step})")

    @property
    def sharded_checkpoints(self) -> bool:
        return self.cfg.parallel == "fsdp"

    def save_checkpoint(self, rng: dict | None = None) -> Path:
        """Every rank calls this (the sharded state and the RNG states are gathered)."""
        parallel, sharded = self.parallel, self.sharded_checkpoints
        rng = rng or checkpoint.rng_state()
        state = checkpoint.TrainerState(
            step=self.step,
            optimizer={} if sharded else self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(),
            kl_coef=self.kl_control.value,
            rng=rng,
            config=self.cfg.to_dict(),
            world_size=parallel.world_size,
            rng_per_rank=parallel.gather_objects(rng) if parallel.active else None,
        )

        def write(folder: Path) -> None:
            full_policy = distributed.full_state_dict(self.policy) if sharded else None  # gathered on rank 0
            if sharded:
                distributed.save_sharded(folder / checkpoint.SHARDED_DIR, self.policy, self.critic, self.optimizer)
            if not parallel.main:
                return
            distributed.save_pretrained(self.policy, folder / checkpoint.POLICY_DIR, full_policy)
            self.tokenizer.save_pretrained(folder / checkpoint.POLICY_DIR)
            if self.critic is not None and not sharded:
                torch.save(self.critic.state_dict(), folder / checkpoint.CRITIC_FILE)
            torch.save(vars(state), folder / checkpoint.STATE_FILE)

        path = checkpoint.save(
            self.output_dir,
            self.step,
            write,
            keep=self.cfg.keep_checkpoints,
            main=parallel.main,
            barrier=parallel.barrier,
        )
        _hold_for_a_test(self.step)
        return path

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, model) -> float | None:
        """Mean reward of greedy responses on the held-out prompts (the accuracy for the built-in task)."""
        return self.evaluate_all(model).get("eval/score")

    @torch.no_grad()
    def evaluate_all(self, model) -> dict[str, float]:
        """Greedy responses to the held-out prompts: ``eval/score`` (the run's reward), and
        ``eval/exact_match`` when every held-out prompt has a reference answer.  Empty without held-out prompts.

        Each rank decodes its share of the prompts and the sums are all-reduced, unless the
        weights are sharded (every rank must then run the same forward passes: each decodes all)."""
        if not self.eval_prompts:
            return {}
        count = len(self.eval_prompts)
        split = not self.parallel.synced_generation
        mine = self.parallel.shard(count) if split else range(count)
        texts, answers = self.eval_set.texts, self.eval_set.answers
        chunk = 256
        score_sum = match_sum = 0.0
        for i in range(0, len(mine), chunk):
            indices = mine[i : i + chunk]
            part = [texts[j] for j in indices]
            part_answers = [answers[j] for j in indices] if answers else []
            batch = generate(
                model,
                self.tokenizer,
                part,
                max_new_tokens=self.response_length,
                temperature=1.0,
                top_p=1.0,
                greedy=True,
                synced_gpus=self.parallel.synced_generation,
            )
            responses = decode_responses(self.tokenizer, batch)
            score_sum += self.scorer(part, responses, self.device, part_answers).double().sum().item()
            match_sum += sum(exact_match(responses, part_answers))
        if split:
            score_sum, match_sum = self.parallel.sums([score_sum, match_sum])
        result = {"eval/score": score_sum / count}
        if self.eval_set.all_answered:
            result["eval/exact_match"] = match_sum / count
        return result

    # ------------------------------------------------------------------ one iteration

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _generate(self, prompts: list[str]):
        """``(batch, the engine's log-probs of the response tokens, or None for hf)``."""
        cfg = self.cfg
        sampling = dict(
            max_new_tokens=self.response_length,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            greedy=False,
        )
        if self.engine is not None:
            return self.engine.generate(self.tokenizer, prompts, device=self.device, **sampling)
        with self._autocast():
            return generate(
                self.policy, self.tokenizer, prompts, synced_gpus=self.parallel.synced_generation, **sampling
            ), None

    @torch.no_grad()
    def _greedy_scores(self, prompts: list[str], answers: list[str | None]) -> torch.Tensor:
        """remax's baselines: the reward of the policy's greedy response to each row's prompt."""
        with self._autocast():
            batch = generate(
                self.policy,
                self.tokenizer,
                prompts,
                max_new_tokens=self.response_length,
                temperature=1.0,
                top_p=1.0,
                greedy=True,
            )
        return self.scorer(prompts, decode_responses(self.tokenizer, batch), self.device, answers)

    def _sample_prompts(self) -> tuple[list[str], list[str | None]]:
        shard = self.parallel.shard(len(self.prompts))
        picks = [shard[i] for i in torch.randint(len(shard), (self.parallel.per_rank(self.cfg.batch_size),)).tolist()]
        rows = [i for i in picks for _ in range(self.cfg.num_samples_per_prompt)]
        return [self.train_set.texts[i] for i in rows], [self.train_set.answers[i] for i in rows]

    def _score_old_and_ref(self, batch, rows: int, micro: int):
        """``(first epoch's shuffle, old log-probs, reference log-probs, values)``.  The shuffle is
        drawn first and the old log-probs are scored in its micro-batches, as the update will
        see them: the first micro-batch's ratio is then exactly 1."""
        first_order = torch.randperm(rows, device=self.device)
        with self._autocast():
            scored = score_old_and_ref(
                self.policy,
                self.reference,
                self.critic,
                batch,
                temperature=self.cfg.temperature,
                chunk=micro,
                order=first_order,
                truncation=self.cfg.logprob_truncation(),
            )
        return (first_order, *scored)

    def train_step(self) -> dict:
        """One PPO iteration; returns its metrics row.  ``self.step`` counts completed iterations."""
        cfg, timer = self.cfg, self.timer
        step = self.step + 1
        rows = self.parallel.per_rank(cfg.batch_size) * cfg.num_samples_per_prompt
        micro = rows // cfg.num_mini_batches // cfg.gradient_accumulation_steps
        start = time.perf_counter()
        with timer.phase("rollout"):
            prompts, answers = self._sample_prompts()
            batch, rollout_logprobs = self._generate(prompts)
            first_order, old_logprobs, ref_logprobs, values = self._score_old_and_ref(batch, rows, micro)
        mask = batch.response_mask
        loss_weights = None
        if cfg.rollout_correction != "none":
            loss_weights = pf.rollout_correction_weights(
                old_logprobs,
                rollout_logprobs,
                mask,
                mode=cfg.rollout_correction,
                threshold=cfg.rollout_correction_threshold,
            )
        with timer.phase("score"):
            responses = decode_responses(self.tokenizer, batch)
            scores = self.scorer(prompts, responses, self.device, answers)
            check_finite(f"reward ({self.scorer.name})", scores, step)
            self._warn_if_no_signal(scores, step)
        with timer.phase("estimate"):
            est = self._estimate(scores, old_logprobs, ref_logprobs, values, mask, prompts, answers)
        self._in_update = True
        with timer.phase("optimize"):
            stats = ppo_update(
                self.train_policy,
                self.train_critic,
                self.optimizer,
                self.scheduler,
                Experience(
                    batch,
                    old_logprobs,
                    est.advantages,
                    values,
                    est.returns,
                    None if cfg.kl_in_reward else ref_logprobs,
                    self.kl_control.value,
                    loss_weights,
                ),
                cfg,
                step,
                self._autocast,
                self.parallel,
                first_order,
            )
        self._in_update = False
        if self.engine is not None:
            with timer.phase("weight_sync"):
                self.engine.sync_weights(self.policy)
        sequence_kl = self.parallel.mean(est.kl.sum(-1).mean())
        kl_coef_used = self.kl_control.value
        self.kl_control.update(sequence_kl, rows * self.parallel.world_size)
        self.step = step

        self._last_samples = list(zip(prompts, responses, scores.tolist()))
        return self._metrics_row(
            step,
            rows,
            start,
            scores,
            sequence_kl,
            kl_coef_used,
            old_logprobs,
            mask,
            est,
            stats,
            rollout_logprobs,
            loss_weights,
            values,
        )

    def _warn_if_no_signal(self, scores: torch.Tensor, step: int) -> None:
        """Warn once when a step's rewards cannot teach anything: equal within every group for
        the group estimators (every advantage is 0), equal over the whole batch otherwise."""
        if self._warned_no_signal:
            return
        cfg = self.cfg
        if cfg.advantage_method in GROUP_METHODS:
            groups = scores.view(-1, cfg.num_samples_per_prompt)
            if bool((groups == groups[:, :1]).all()):
                self._warned_no_signal = True
                self.log(
                    f"warning: step {step}: the {cfg.num_samples_per_prompt} responses to each prompt got the same "
                    f"reward, so every {cfg.advantage_method} advantage is 0 and this step teaches nothing; check "
                    "that the reward tells responses apart (or raise --temperature)"
                )
        elif bool((scores == scores[0]).all()):
            self._warned_no_signal = True
            self.log(
                f"warning: step {step}: every response got the reward {scores[0].item():g}, so the reward carries "
                f"no learning signal ({cfg.advantage_method} learns only from the KL penalty); check the reward function"
            )

    def _estimate(self, scores, old_logprobs, ref_logprobs, values, mask, prompts, answers):
        """The advantages and returns of a batch (the KL in the reward or not, the whitening)."""
        cfg = self.cfg
        needs_baselines = "baselines" in pf.advantage_methods()[cfg.advantage_method].params
        baselines = self._greedy_scores(prompts, answers) if needs_baselines else None
        return estimate(
            scores,
            old_logprobs,
            ref_logprobs,
            values,
            mask,
            advantage_method=cfg.advantage_method,
            kl_coef=self.kl_control.value,
            kl_estimator=cfg.kl_estimator_used,
            kl_in_reward=cfg.kl_in_reward,
            gamma=cfg.gamma,
            lam=cfg.lam,
            whiten=cfg.whiten_advantages,
            group_size=cfg.num_samples_per_prompt,
            grpo_norm_by_std=cfg.grpo_norm_by_std,
            baselines=baselines,
            whitener=self.parallel.masked_whiten,
        )

    def _metrics_row(
        self,
        step,
        rows,
        start,
        scores,
        sequence_kl,
        kl_coef_used,
        old_logprobs,
        mask,
        est,
        stats,
        rollout_logprobs,
        loss_weights,
        values,
    ) -> dict:
        """The step's metrics row (reduced over the ranks)."""
        cfg = self.cfg
        times = self.timer.pop_step()
        elapsed = time.perf_counter() - start
        response_tokens = int(mask.sum())
        non_score = (-kl_coef_used * est.kl).sum(-1).mean().item() if cfg.kl_in_reward else 0.0
        row = {
            "step": step,
            "episode": step * rows * self.parallel.world_size,
            "lr": self.scheduler.get_last_lr()[0],
            "objective/scores": scores.mean().item(),
            "objective/kl": sequence_kl,
            "objective/kl_coef": kl_coef_used,
            "objective/entropy": (-old_logprobs * mask).sum(-1).mean().item(),
            "objective/non_score_reward": non_score,
            "objective/rlhf_reward": scores.mean().item() + non_score,
            "objective/response_length": mask.sum(-1).float().mean().item(),
            **stats,
        }
        if rollout_logprobs is not None:
            row.update(mismatch_metrics(old_logprobs, rollout_logprobs, mask))
        if loss_weights is not None:
            row["rollout/correction_weight_mean"] = pf.masked_mean(loss_weights, mask).item()
        if values is not None:
            explained = 1.0 - _masked_variance(est.returns - values, mask) / _masked_variance(
                est.returns, mask
            ).clamp_min(1e-8)
            row["val/explained_variance"] = explained.item()
            row["val/mean"] = pf.masked_mean(values, mask).item()
        row.update({f"time/{name}": secs for name, secs in times.items()})
        row["time/step"] = elapsed
        row["throughput/tokens_per_s"] = response_tokens / elapsed
        return self.parallel.reduce_row(row)

    # ------------------------------------------------------------------ the run

    def train(self) -> dict:
        """Run up to ``cfg.steps`` iterations; return a summary (also written to ``summary.json``).

        The summary's wall time counts from the trainer's creation, so it includes the warm-up.
        """
        try:
            return self._train()
        finally:
            if self.engine is not None:  # before the process group goes: vLLM's groups are built on it
                self.engine.close()

    def _train(self) -> dict:
        cfg = self.cfg
        if self.step >= cfg.steps:  # --resume of a run that already did its steps
            return self._nothing_to_do()
        with pf.use_backend(cfg.backend), self.parallel.guard():
            before, start = self._evaluate_start()
            main = self.parallel.main
            writer = (
                MetricsWriter(self.output_dir, self.resumed_from, cfg.report_to) if main else distributed.NO_METRICS
            )
            bar = tqdm(total=cfg.steps, initial=self.step, desc="PPO", dynamic_ncols=True, disable=not main)
            stop_reason = "done"
            try:
                with _DeferredInterrupt(self.log) as interrupt:
                    while self.step < cfg.steps:
                        rng_at_step_start = checkpoint.rng_state()
                        try:
                            row = self.train_step()
                        except StopNow:
                            raise
                        except KeyboardInterrupt:
                            stop_reason = "interrupted"
                            self._save_after_interrupt(rng_at_step_start)
                            break
                        if (
                            cfg.eval_every
                            and self.step % cfg.eval_every == 0
                            and self.step < cfg.steps
                            and self.eval_prompts
                        ):
                            row.update(self.evaluate_all(self.policy))
                            self.log(f"step {self.step}: held-out greedy {_eval_text(row)}")
                        writer.write(row)
                        self._report(bar, row)
                        if self.parallel.any(interrupt.requested):  # a Ctrl-C on rank 0 stops every rank
                            stop_reason = "interrupted"
                            self.log(f"saved {self.save_checkpoint()}")
                            break
                        if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                            self.save_checkpoint()
            finally:
                bar.close()
                writer.close()
            if stop_reason == "done":
                path = self.save_checkpoint()
                self.log(f"saved {path}")
                after = self.evaluate_all(self.policy)
            else:  # stopped early: the user wants out, not a final evaluation (--resume finishes the run)
                after = {}
                if self.eval_prompts:
                    self.log("stopped early: no final held-out evaluation (--resume continues the run)")
        if not self.parallel.main:
            return {"stop_reason": stop_reason, "steps_done": self.step}
        plot = plot_curves(
            self.output_dir,
            before=before,
            after=after,
            after_step=self.step,
            title=self._plot_title(),
            score_name=self._score_name(),
        )
        summary = {
            "stop_reason": stop_reason,
            "steps_done": self.step,
            "eval_before": before.get("eval/score"),
            "eval_after": after.get("eval/score"),
            "wall_time_s": time.perf_counter() - self.created,  # warm-up and loading included
            "phase_time_s": dict(self.timer.total),
            "plot": str(plot) if plot else None,
        }
        if "eval/exact_match" in before:
            summary["exact_match_before"] = before["eval/exact_match"]
            summary["exact_match_after"] = after.get("eval/exact_match")
        (self.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if self.timer.total:
            self.log(self.timer.breakdown())
        if after:
            since = f", from step {self.resumed_from}" if self.resumed_from is not None else ""
            self.log(f"held-out greedy {_eval_text(start, after)} (wall time {summary['wall_time_s']:.0f}s{since})")
        return summary

    def _evaluate_start(self) -> tuple[dict, dict]:
        """``(the run's start, where this process starts)``: the reference's held-out scores for a
        new run; for ``--resume``, the policy's at the resumed step, with the run's start as
        its summary.json recorded it (empty if it did not)."""
        if self.resumed_from is None:
            before = self.evaluate_all(self.reference)
            if before:
                self.log(f"held-out greedy {_eval_text(before)} before PPO ({len(self.eval_prompts)} prompts)")
            return before, before
        start = self.evaluate_all(self.policy)
        self.log(f"resumed at step {self.step}" + (f": held-out greedy {_eval_text(start)}" if start else ""))
        summary_file = self.output_dir / SUMMARY_FILE
        earlier = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        before = {
            key: earlier[name]
            for key, name in (("eval/score", "eval_before"), ("eval/exact_match", "exact_match_before"))
            if isinstance(earlier.get(name), (int, float))
        }
        return before, start

    def _nothing_to_do(self) -> dict:
        """The run in output_dir already did ``cfg.steps`` steps: report it, change nothing."""
        self.log(
            f"--resume: the run in {self.output_dir} already did {self.step} steps (--steps {self.cfg.steps}); "
            f"nothing to do. Give a larger --steps to train on, or another --output-dir for a new run."
        )
        summary_file = self.output_dir / SUMMARY_FILE
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        summary.update(stop_reason="done", steps_done=self.step)
        return summary

    def _plot_title(self) -> str:
        cfg = self.cfg
        model = self._model_in_words()
        reward = (
            f"reward {cfg.reward_fn}"
            if cfg.reward_fn
            else f"reward model {cfg.reward_model}"
            if cfg.reward_model
            else f"reward {self.scorer.name}"
        )
        kl = (
            f"KL coef {cfg.kl_coef:g}"
            + (f" adaptive (target {cfg.target_kl:g})" if cfg.adaptive_kl else "")
            + f" ({cfg.kl_estimator_used}, in the {'reward' if cfg.kl_in_reward else 'loss'})"
        )
        critic = f", critic {cfg.critic}" if cfg.uses_critic else ""
        return (
            f"{model}; {reward}\n{cfg.advantage_method}{critic}, {kl}, lr {cfg.learning_rate:g}, "
            f"batch {cfg.batch_size}x{cfg.num_samples_per_prompt}, {cfg.num_ppo_epochs} epochs, {self.step} steps, seed {cfg.seed}"
        )

    def _model_in_words(self) -> str:
        """``built-in addition task: a GPT-2 of 2 layers, width 64 (102k parameters), ...``."""
        config = self.policy.config
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
        width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
        kind = {"gpt2": "GPT-2"}.get(getattr(config, "model_type", ""), getattr(config, "model_type", "") or "model")
        shape = f" of {layers} layers, width {width}" if layers and width else ""
        count = sum(p.numel() for p in self.policy.parameters())
        size = f"a {kind}{shape} ({f'{count / 1e6:.1f}M' if count >= 1e6 else f'{count / 1e3:.0f}k'} parameters)"
        if self.builtin:
            return f"built-in addition task: {size}, warmed up on a sloppy teacher's sums"
        return f"{self.cfg.model_name_or_path or type(self.policy).__name__}: {size}"

    def _score_name(self) -> str:
        """What ``eval/score`` measures: the accuracy for the built-in task's reward, else the mean reward."""
        return ACCURACY if getattr(self.scorer, "fn", None) is default_task.addition_reward else EVAL_KEYS[0][1]

    def _save_after_interrupt(self, rng_at_step_start: dict) -> None:
        """Ctrl-C inside a step: the partial step is dropped and the last completed one saved.

        Before the update phase the weights are still those of the last completed step,
        so with the RNG state from the start of the step the checkpoint resumes exactly.
        Inside the update phase they are half-updated; then only the last checkpoint is kept.
        """
        self.timer.pop_step()
        if self.parallel.active:  # the other ranks are inside the step: no collective save is possible
            self.log(f"interrupted during step {self.step + 1}: keeping the last saved checkpoint")
            return
        if self._in_update:
            self.log(f"interrupted during the update of step {self.step + 1}: keeping the last saved checkpoint")
            return
        self.log(f"interrupted during step {self.step + 1}: saved {self.save_checkpoint(rng_at_step_start)}")

    def _report(self, bar, row: dict) -> None:
        bar.update(1)
        bar.set_postfix(
            reward=f"{row['objective/scores']:.3f}",
            kl=f"{row['objective/kl']:.3f}",
            tok_s=f"{row['throughput/tokens_per_s']:.0f}",
        )
        if self.cfg.sample_every and (row["step"] % self.cfg.sample_every == 0 or row["step"] == 1):
            lines = [f"step {row['step']} samples:"]
            for prompt, response, score in self._last_samples[: self.cfg.num_samples_to_print]:
                lines.append(f"  {prompt!r} -> {response!r}  (score {score:.2f})")
            self.log("\n".join(lines))
