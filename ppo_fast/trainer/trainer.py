"""The PPO loop: rollout, score, estimate, optimize; with logging, checkpoints and clean stops.

The rooms around it: ``setup`` (options checked, data, reward, models), ``checkpoint`` (what a
checkpoint holds, the run folder claimed and resumed), ``evaluation`` (held-out scores),
``metrics`` (a step's record and row), ``report`` (progress, summary, plot).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

import ppo_fast as pf

from . import checkpoint, distributed, engine, evaluation, report, setup
from .config import BUILTIN_RESPONSE_LENGTH, CUSTOM_RESPONSE_LENGTH, GROUP_METHODS, TrainerConfig
from .estimate import EstimateOptions, estimate
from .metrics import MetricsWriter, PhaseTimer, StepRecord, step_row
from .models import check_pretrained, third_party_output
from .rollout import Rollouts, decode_responses, generate, score_old_and_ref
from .scoring import check_finite
from .stops import DeferredInterrupt, StopNow
from .update import Experience, first_epoch_micro_batches, loss_path, ppo_update


def _silent(_message: str) -> None:
    pass


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
        given = setup.Given(policy, tokenizer, reward_fn, prompts, eval_prompts, answers, eval_answers)
        self.created = time.perf_counter()
        self.cfg = cfg.validate()
        self.log = report.RunLog(log or tqdm.write)
        third_party_output(cfg.verbose)
        self.output_dir = Path(cfg.output_dir)

        # Everything a user can get wrong is checked here, before any model is loaded.
        self.parallel, self.device = distributed.init(cfg, setup.resolve_device(cfg.device))
        if not self.parallel.main:  # rank 0 speaks for the run
            self.log = _silent
        setup.check_options(cfg, self.device)
        if distributed.restart_of_this_job(self.parallel, self.output_dir):  # torchrun --max-restarts
            cfg = self.cfg = dataclasses.replace(cfg, resume=True, overwrite=False)
            self.log(f"torchrun restart: continuing the run this job started in {self.output_dir}")
        self.builtin = policy is None and cfg.model_name_or_path is None
        self.response_length = cfg.response_length or (
            BUILTIN_RESPONSE_LENGTH if self.builtin else CUSTOM_RESPONSE_LENGTH
        )
        if notice := setup.builtin_model_notice(cfg, given):
            self.log(notice)
        if policy is None and not self.builtin:
            check_pretrained("--model-name-or-path", cfg.model_name_or_path)
        if reward_fn is None and cfg.reward_model is not None:
            check_pretrained("--reward-model", cfg.reward_model)
        train_set, eval_set, reward_fn = setup.datasets_and_reward(cfg, given, self.builtin)
        resume_from = checkpoint.find_resumable(self) if cfg.resume else None
        checkpoint.claim_output_dir(self)  # nothing is written to output_dir before this

        setup.check_writable(self.output_dir)
        report.start_run_folder(self)  # run_config.yaml, train.log
        distributed.claim_for_elastic_restarts(self.parallel, self.output_dir)
        if self.device.type == "cpu" and cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        torch.manual_seed(cfg.seed)
        policy, self.tokenizer = setup.load_policy(cfg, given, self)
        self.train_set, self.eval_set = setup.prompt_sets(cfg, train_set, eval_set, self.builtin)
        self.prompts, self.eval_prompts = self.train_set.texts, self.eval_set.texts
        if not self.builtin:
            self.response_length = setup.fit_response_length(self, policy)
        if not self.eval_prompts:
            self.log("no held-out prompts (--eval-prompts-file): no evaluation before, during or after PPO")
        self.scorer = setup.scorer(cfg, reward_fn, self.device)
        packed = setup.padding_free(cfg, policy.to(self.device), self.device, self.log)
        cfg = self.cfg = dataclasses.replace(cfg, padding_free=packed)

        models = setup.build_models(cfg, policy, self.parallel, self.device)
        self.policy, self.reference, self.critic = models.policy, models.reference, models.critic
        self.train_policy, self.train_critic = models.train_policy, models.train_critic
        self.optimizer, self.scheduler, self.kl_control = models.optimizer, models.scheduler, models.kl_control
        self.adapters, self.reference_scope = models.adapters, models.reference_scope
        self.loss_path = loss_path(self.train_policy, self.critic, cfg, self.device)
        self.log(str(self.loss_path))
        self.step = 0
        self.resumed_from = self.best = None
        self._in_update = False
        self._warned_no_signal = False
        self.last_samples = []
        self.timer = PhaseTimer()
        self.engine = engine.start(cfg.rollout_engine, self._engine_setup())
        # The PPO phase's random streams start from the seed, whether or not the
        # warm-up above was trained (consuming random numbers) or loaded from cache; each rank its own.
        checkpoint.seed_all(cfg.seed + self.parallel.rank)
        if resume_from is not None:
            self.step = self.resumed_from = checkpoint.restore(self, resume_from, setup.schedule(cfg))
            self.engine.sync_weights(self.policy)

    def save_checkpoint(self, rng: dict | None = None, final: bool = False) -> Path:
        """Checkpoint the run at this step; every rank calls this (see ``checkpoint.save_run``)."""
        return checkpoint.save_run(self, rng, final)

    def evaluate_all(self, model) -> dict[str, float]:
        """``model``'s held-out greedy scores (see ``evaluation.held_out``)."""
        return evaluation.held_out(self, model)

    # ------------------------------------------------------------------ one iteration

    def train_step(self) -> dict:
        """One PPO iteration; returns its metrics row.  ``self.step`` counts completed iterations."""
        cfg, timer = self.cfg, self.timer
        step = self.step + 1
        rows = self.parallel.per_rank(cfg.batch_size) * cfg.group_size
        start = time.perf_counter()
        with timer.phase("rollout"):
            r = self._rollout(rows)
        with timer.phase("score"):
            r.responses = decode_responses(self.tokenizer, r.batch)
            r.scores = self.scorer(r.prompts, r.responses, self.device, r.answers)
            check_finite(f"reward ({self.scorer.name})", r.scores, step)
            self._warn_if_no_signal(r.scores, step)
        with timer.phase("estimate"):
            kl_coef = self.kl_control.value
            baselines = self._greedy_scores(r) if self._needs_baselines() else None
            est = estimate(
                r.scores,
                r.old_logprobs,
                r.ref_logprobs,
                r.values,
                r.mask,
                EstimateOptions.of(cfg, kl_coef),
                baselines=baselines,
                whitener=self.parallel.masked_whiten,
            )
        self._in_update = True
        with timer.phase("optimize"):
            # The KL goes into the loss when it is not in the reward.
            ref = None if cfg.kl_in_reward else r.ref_logprobs
            exp = Experience(
                r.batch, r.old_logprobs, est.advantages, r.values, est.returns, ref, kl_coef, r.loss_weights
            )
            update_stats = ppo_update(
                self.train_policy,
                self.train_critic,
                self.optimizer,
                self.scheduler,
                exp,
                cfg,
                step=step,
                autocast=self._autocast,
                parallel=self.parallel,
                first_order=r.first_order,
                path=self.loss_path,
            )
        self._in_update = False
        if self.engine.info.own_weights:
            with timer.phase("weight_sync"):
                self.engine.sync_weights(self.policy)
        sequence_kl = self.parallel.mean(est.kl.sum(-1).mean())
        self.kl_control.update(sequence_kl, rows * self.parallel.world_size)
        self.step = step

        self.last_samples = list(zip(r.prompts, r.responses, r.scores.tolist()))
        seconds = time.perf_counter() - start
        lr = self.scheduler.get_last_lr()[0]
        record = StepRecord(step, rows, seconds, lr, r, est, update_stats, sequence_kl, kl_coef, timer.pop_step())
        return self.parallel.reduce_row(step_row(record, cfg.kl_in_reward, self.parallel.world_size))

    def _rollout(self, rows: int) -> Rollouts:
        """Draw this rank's prompts, sample responses, and score them with the policy, the
        reference and the critic.  The first epoch's shuffle is drawn first and the old log-probs
        are scored in its micro-batches, as the update will see them: the first micro-batch's
        ratio is then exactly 1."""
        cfg = self.cfg
        shard = self.parallel.shard(len(self.prompts))
        picks = [shard[i] for i in torch.randint(len(shard), (self.parallel.per_rank(cfg.batch_size),)).tolist()]
        drawn = [i for i in picks for _ in range(cfg.group_size)]
        prompts = [self.train_set.texts[i] for i in drawn]
        answers = [self.train_set.answers[i] for i in drawn]
        batch, engine_logprobs = self._generate(prompts)
        first_order = torch.randperm(rows, device=self.device)
        with self._autocast():
            old, ref, values = score_old_and_ref(
                self.policy,
                self.reference,
                self.critic,
                batch,
                temperature=cfg.temperature,
                groups=first_epoch_micro_batches(first_order, batch.attention_mask.sum(-1), cfg, self.parallel),
                truncation=cfg.logprob_truncation(),
                reference_scope=self.reference_scope,
                packed=cfg.padding_free,
            )
        r = Rollouts(prompts, answers, batch, engine_logprobs, first_order, old, ref, values)
        if cfg.rollout_correction != "none":
            r.loss_weights = pf.rollout_correction_weights(
                old,
                engine_logprobs,
                r.mask,
                mode=cfg.rollout_correction,
                threshold=cfg.rollout_correction_threshold,
            )
        return r

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.bf16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _generate(self, prompts: list[str]):
        """``(batch, the engine's log-probs of the response tokens, or None where it has none)``."""
        cfg = self.cfg
        return self.engine.generate(
            self.tokenizer,
            prompts,
            max_new_tokens=self.response_length,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            min_p=cfg.min_p,
            greedy=False,
            device=self.device,
        )

    def _engine_setup(self) -> engine.EngineSetup:
        return engine.EngineSetup(
            policy=self.policy,
            tokenizer=self.tokenizer,
            prompts=self.prompts,
            response_length=self.response_length,
            rows=self.parallel.per_rank(self.cfg.batch_size) * self.cfg.group_size,
            device=self.device,
            cfg=self.cfg,
            output_dir=self.output_dir,
            autocast=self._autocast,
            synced_gpus=self.parallel.synced_generation,
            log=self.log,
        )

    def _needs_baselines(self) -> bool:
        return "baselines" in pf.advantage_methods()[self.cfg.advantage_method].params

    @torch.no_grad()
    def _greedy_scores(self, r: Rollouts) -> torch.Tensor:
        """remax's baselines: the reward of the policy's greedy response to each row's prompt."""
        with self._autocast():
            batch = generate(
                self.policy,
                self.tokenizer,
                r.prompts,
                max_new_tokens=self.response_length,
                temperature=1.0,
                top_p=1.0,
                greedy=True,
            )
        return self.scorer(r.prompts, decode_responses(self.tokenizer, batch), self.device, r.answers)

    def _warn_if_no_signal(self, scores: torch.Tensor, step: int) -> None:
        """Warn once when a step's rewards cannot teach anything: equal within every group for
        the group estimators (every advantage is 0), equal over the whole batch otherwise."""
        if self._warned_no_signal:
            return
        cfg = self.cfg
        if cfg.advantage_method in GROUP_METHODS:
            groups = scores.view(-1, cfg.group_size)
            if bool((groups == groups[:, :1]).all()):
                self._warned_no_signal = True
                self.log(
                    f"warning: step {step}: the {cfg.group_size} responses to each prompt got the same "
                    f"reward, so every {cfg.advantage_method} advantage is 0 and this step teaches nothing; check "
                    "that the reward tells responses apart (or raise --temperature)"
                )
        elif bool((scores == scores[0]).all()):
            self._warned_no_signal = True
            self.log(
                f"warning: step {step}: every response got the reward {scores[0].item():g}, so the reward carries "
                f"no learning signal ({cfg.advantage_method} learns only from the KL penalty); check the reward function"
            )

    # ------------------------------------------------------------------ the run

    def train(self) -> dict:
        """Run up to ``cfg.steps`` iterations; return a summary (also written to ``summary.json``).

        The summary's wall time counts from the trainer's creation, so it includes the warm-up.
        """
        try:
            return self._train()
        finally:
            self.engine.close()  # before the process group goes: vLLM's groups are built on it

    def _train(self) -> dict:
        cfg = self.cfg
        if self.step >= cfg.steps:  # --resume of a run that already did its steps
            return report.nothing_to_do(self)
        with pf.use_backend(cfg.backend), self.parallel.guard():
            before, start = evaluation.at_start(self)
            stop_reason = self._loop()
            if stop_reason == "done":
                self.log(f"saved {self.save_checkpoint(final=True)}")
                after = self.evaluate_all(self.policy)
                checkpoint.keep_if_best(self, after)
            else:  # stopped early: the user wants out, not a final evaluation (--resume finishes the run)
                after = {}
                if self.eval_prompts:
                    self.log("stopped early: no final held-out evaluation (--resume continues the run)")
        if not self.parallel.main:
            return {"stop_reason": stop_reason, "steps_done": self.step}
        return report.summary(self, stop_reason, (before, start, after))

    def _loop(self) -> str:
        """The iterations up to ``cfg.steps``, each logged, evaluated and saved at its period;
        ``"done"``, or ``"interrupted"`` after a Ctrl-C (the last complete step saved)."""
        cfg, main = self.cfg, self.parallel.main
        writer = MetricsWriter(self.output_dir, self.resumed_from, cfg.report_to) if main else distributed.NO_METRICS
        bar = tqdm(total=cfg.steps, initial=self.step, desc="PPO", dynamic_ncols=True, disable=not main)
        try:
            with DeferredInterrupt(self.log) as interrupt:
                while self.step < cfg.steps:
                    rng_at_step_start = checkpoint.rng_state()
                    try:
                        row = self.train_step()
                    except StopNow:
                        raise
                    except KeyboardInterrupt:
                        self._save_after_interrupt(rng_at_step_start)
                        return "interrupted"
                    more = self.step < cfg.steps
                    if cfg.eval_every and self.step % cfg.eval_every == 0 and more and self.eval_prompts:
                        row.update(self.evaluate_all(self.policy))
                        checkpoint.keep_if_best(self, row)
                        self.log(f"step {self.step}: held-out greedy {evaluation.in_words(row)}")
                    writer.write(row)
                    report.progress(self, bar, row)
                    if self.parallel.any(interrupt.requested):  # a Ctrl-C on rank 0 stops every rank
                        self.log(f"saved {self.save_checkpoint()}")
                        return "interrupted"
                    if cfg.save_every and self.step % cfg.save_every == 0 and more:
                        self.save_checkpoint()
        finally:
            bar.close()
            writer.close()
        return "done"

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
