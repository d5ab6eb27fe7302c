"""The PPO loop: rollout, score, estimate, optimize; with logging, checkpoints and clean stops."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

import ppo_fast as pf

from . import checkpoint, default_task
from .config import TrainerConfig
from .estimate import estimate
from .metrics import MetricsWriter, PhaseTimer, plot_curves
from .models import build_critic, disable_dropout, enable_activation_checkpointing, frozen_reference
from .rollout import decode_responses, generate, score_old_and_ref
from .scoring import FunctionScorer, RewardModelScorer, check_finite, load_reward_fn
from .update import Experience, ppo_update

SUMMARY_FILE = "summary.json"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("invalid config: device cuda was asked for but no CUDA GPU is available")
    return torch.device(name)


def read_prompts(path: str) -> list[str]:
    """Prompts from a ``.txt`` file (one per line) or a ``.jsonl`` file with a ``prompt`` field."""
    text = Path(path).read_text()
    if path.endswith(".jsonl"):
        prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts_file {path} holds no prompts")
    return prompts


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


class _DeferredInterrupt:
    """Turns the first Ctrl-C into a request to stop after the current step; a second one interrupts at once."""

    def __init__(self, log):
        self.requested = False
        self.log = log
        self.previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.log("Ctrl-C: stopping after this step (press again to stop at once)")

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class PPOTrainer:
    """PPO for a causal LM with a frozen reference, an optional critic and a sequence-level reward.

    With no model given (and ``cfg.model_name_or_path`` unset) it runs the built-in
    addition task.  ``policy``/``tokenizer``/``reward_fn``/``prompts`` may be passed as
    objects from Python instead of through the config.
    """

    def __init__(self, cfg: TrainerConfig, *, policy=None, tokenizer=None, reward_fn: Callable | None = None,
                 prompts: list[str] | None = None, eval_prompts: list[str] | None = None, log: Callable[[str], None] | None = None):
        self.created = time.perf_counter()
        self.cfg = cfg.validate()
        self.log = log or tqdm.write
        self.output_dir = Path(cfg.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.device = resolve_device(cfg.device)
        if self.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        torch.manual_seed(cfg.seed)

        builtin = policy is None and cfg.model_name_or_path is None
        if builtin:
            policy, tokenizer = default_task.load_or_warm_up(cfg, self.device, self.log)
            builtin_train, builtin_eval = default_task.prompts(cfg)
            prompts = prompts or builtin_train
            eval_prompts = builtin_eval if eval_prompts is None else eval_prompts
            if reward_fn is None and cfg.reward_fn is None and cfg.reward_model is None:
                reward_fn = default_task.addition_reward
        elif policy is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            policy = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path).to(self.device)
            tokenizer = AutoTokenizer.from_pretrained(cfg.model_name_or_path)
        if tokenizer is None:
            raise ValueError("tokenizer is required when a policy model object is passed")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if prompts is None:
            if cfg.prompts_file is None:
                raise ValueError("prompts (or prompts_file) are required for a custom policy")
            prompts = read_prompts(cfg.prompts_file)
        self.prompts, self.eval_prompts = list(prompts), list(eval_prompts or [])
        self.tokenizer = tokenizer

        if reward_fn is None and cfg.reward_fn is not None:
            reward_fn = load_reward_fn(cfg.reward_fn)
        if reward_fn is not None:
            self.scorer = FunctionScorer(reward_fn)
        elif cfg.reward_model is not None:
            self.scorer = RewardModelScorer(cfg.reward_model, self.device)
        else:
            raise ValueError("a reward is required: pass reward_fn, or set reward_fn or reward_model in the config")

        self.policy = policy.to(self.device).eval()
        if cfg.disable_dropout:
            disable_dropout(self.policy)
        self.reference = frozen_reference(self.policy)
        self.critic = build_critic(self.policy, cfg.critic) if cfg.advantage_estimator == "gae" else None
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.policy)
            if self.critic is not None and not self.critic.shared:
                enable_activation_checkpointing(self.critic.backbone)
        params = list(self.policy.parameters()) + (list(self.critic.parameters()) if self.critic is not None else [])
        self.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
        total_updates = cfg.steps * cfg.num_ppo_epochs * cfg.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, total_updates))
        self.kl_control = (
            pf.AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon) if cfg.adaptive_kl else pf.FixedKLController(cfg.kl_coef)
        )
        self.step = 0
        self.resumed_from = None
        self._in_update = False
        self.timer = PhaseTimer()
        # The PPO phase's random streams start from the seed, whether or not the
        # warm-up above was trained (consuming random numbers) or loaded from cache.
        checkpoint.seed_all(cfg.seed)
        if cfg.resume:
            self._resume()

    # ------------------------------------------------------------------ checkpoints

    def _resume(self) -> None:
        found = checkpoint.latest(self.output_dir)
        if found is None:
            self.log(f"--resume: no checkpoint in {self.output_dir / checkpoint.CHECKPOINTS}, starting from scratch")
            return
        state = checkpoint.load_state(found)
        changed = [f"{name} {old!r} -> {getattr(self.cfg, name)!r}" for name, old in state.config.items()
                   if name not in ("steps", "resume") and getattr(self.cfg, name, old) != old]
        if changed:
            self.log("resuming with changed options: " + ", ".join(changed))
        checkpoint.load_weights(found, self.policy, self.critic)
        self.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.kl_control.value = state.kl_coef
        checkpoint.set_rng_state(state.rng)
        self.step = self.resumed_from = state.step
        self.log(f"resumed from {found} (step {state.step})")

    def save_checkpoint(self, rng: dict | None = None) -> Path:
        state = checkpoint.TrainerState(
            step=self.step, optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
            kl_coef=self.kl_control.value, rng=rng or checkpoint.rng_state(), config=self.cfg.to_dict(),
        )
        return checkpoint.save(self.output_dir, self.policy, self.tokenizer, self.critic, state)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, model) -> float | None:
        """Mean reward of greedy responses on the held-out prompts (the accuracy for the built-in task)."""
        if not self.eval_prompts:
            return None
        chunk = 256
        scores = []
        for i in range(0, len(self.eval_prompts), chunk):
            part = self.eval_prompts[i : i + chunk]
            batch = generate(model, self.tokenizer, part, max_new_tokens=self.cfg.response_length,
                             temperature=1.0, top_p=1.0, greedy=True)
            scores.append(self.scorer(part, decode_responses(self.tokenizer, batch), self.device))
        return torch.cat(scores).mean().item()

    # ------------------------------------------------------------------ one iteration

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _sample_prompts(self) -> list[str]:
        picks = torch.randint(len(self.prompts), (self.cfg.batch_size,)).tolist()
        return [self.prompts[i] for i in picks for _ in range(self.cfg.num_samples_per_prompt)]

    def train_step(self) -> dict:
        """One PPO iteration; returns its metrics row.  ``self.step`` counts completed iterations."""
        cfg, timer = self.cfg, self.timer
        step = self.step + 1
        rows = cfg.batch_size * cfg.num_samples_per_prompt
        micro = rows // cfg.num_mini_batches // cfg.gradient_accumulation_steps
        start = time.perf_counter()
        with timer.phase("rollout"), self._autocast():
            prompts = self._sample_prompts()
            batch = generate(self.policy, self.tokenizer, prompts, max_new_tokens=cfg.response_length,
                             temperature=cfg.temperature, top_p=cfg.top_p, greedy=False)
            old_logprobs, ref_logprobs, values = score_old_and_ref(
                self.policy, self.reference, self.critic, batch, temperature=cfg.temperature, chunk=micro
            )
        mask = batch.response_mask
        with timer.phase("score"):
            responses = decode_responses(self.tokenizer, batch)
            scores = self.scorer(prompts, responses, self.device)
            check_finite(f"reward ({self.scorer.name})", scores, step)
        with timer.phase("estimate"):
            est = estimate(
                scores, old_logprobs, ref_logprobs, values, mask, estimator=cfg.advantage_estimator,
                kl_coef=self.kl_control.value, kl_estimator=cfg.kl_estimator, gamma=cfg.gamma, lam=cfg.lam,
                whiten=cfg.whiten_advantages, group_size=cfg.num_samples_per_prompt,
            )
        self._in_update = True
        with timer.phase("optimize"):
            stats = ppo_update(self.policy, self.critic, self.optimizer, self.scheduler,
                               Experience(batch, old_logprobs, est.advantages, values, est.returns), cfg, step, self._autocast)
        self._in_update = False
        sequence_kl = est.kl.sum(-1).mean().item()
        kl_coef_used = self.kl_control.value
        self.kl_control.update(sequence_kl, rows)
        self.step = step

        times = timer.pop_step()
        elapsed = time.perf_counter() - start
        response_tokens = int(mask.sum())
        non_score = (-kl_coef_used * est.kl).sum(-1).mean().item()
        row = {
            "step": step,
            "episode": step * rows,
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
        if values is not None:
            explained = 1.0 - _masked_variance(est.returns - values, mask) / _masked_variance(est.returns, mask).clamp_min(1e-8)
            row["val/explained_variance"] = explained.item()
            row["val/mean"] = pf.masked_mean(values, mask).item()
        row.update({f"time/{name}": secs for name, secs in times.items()})
        row["time/step"] = elapsed
        row["throughput/tokens_per_s"] = response_tokens / elapsed
        self._last_samples = list(zip(prompts, responses, scores.tolist()))
        return row

    # ------------------------------------------------------------------ the run

    def train(self) -> dict:
        """Run up to ``cfg.steps`` iterations; return a summary (also written to ``summary.json``).

        The summary's wall time counts from the trainer's creation, so it includes the warm-up.
        """
        cfg = self.cfg
        with pf.use_backend(cfg.backend):
            before = self.evaluate(self.reference)
            if before is not None:
                self.log(f"held-out greedy score before PPO (warm-up/reference model): {before:.3f}")
            writer = MetricsWriter(self.output_dir, self.resumed_from, self.log)
            bar = tqdm(total=cfg.steps, initial=self.step, desc="PPO", dynamic_ncols=True)
            stop_reason = "done"
            try:
                with _DeferredInterrupt(self.log) as interrupt:
                    while self.step < cfg.steps:
                        rng_at_step_start = checkpoint.rng_state()
                        try:
                            row = self.train_step()
                        except KeyboardInterrupt:
                            stop_reason = "interrupted"
                            self._save_after_interrupt(rng_at_step_start)
                            break
                        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                            row["eval/score"] = self.evaluate(self.policy)
                            self.log(f"step {self.step}: held-out greedy score {row['eval/score']:.3f}")
                        writer.write(row)
                        self._report(bar, row)
                        if interrupt.requested:
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
            after = self.evaluate(self.policy)
        plot = plot_curves(self.output_dir)
        summary = {
            "stop_reason": stop_reason,
            "steps_done": self.step,
            "eval_before": before,
            "eval_after": after,
            "wall_time_s": time.perf_counter() - self.created,  # warm-up and loading included
            "phase_time_s": dict(self.timer.total),
            "plot": str(plot) if plot else None,
        }
        (self.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        self.log(self.timer.breakdown())
        if after is not None:
            self.log(f"held-out greedy score: before {before:.3f} -> after {after:.3f} (wall time {summary['wall_time_s']:.0f}s)")
        return summary

    def _save_after_interrupt(self, rng_at_step_start: dict) -> None:
        """Ctrl-C inside a step: the partial step is dropped and the last completed one saved.

        Before the update phase the weights are still those of the last completed step,
        so with the RNG state from the start of the step the checkpoint resumes exactly.
        Inside the update phase they are half-updated; then only the last checkpoint is kept.
        """
        self.timer.pop_step()
        if self._in_update:
            self.log(f"interrupted during the update of step {self.step + 1}: keeping the last saved checkpoint")
            return
        self.log(f"interrupted during step {self.step + 1}: saved {self.save_checkpoint(rng_at_step_start)}")

    def _report(self, bar, row: dict) -> None:
        bar.update(1)
        bar.set_postfix(reward=f"{row['objective/scores']:.3f}", kl=f"{row['objective/kl']:.3f}",
                        tok_s=f"{row['throughput/tokens_per_s']:.0f}")
        if self.cfg.sample_every and (row["step"] % self.cfg.sample_every == 0 or row["step"] == 1):
            lines = [f"step {row['step']} samples:"]
            for prompt, response, score in self._last_samples[: self.cfg.num_samples_to_print]:
                lines.append(f"  {prompt!r} -> {response!r}  (score {score:.2f})")
            self.log("\n".join(lines))
