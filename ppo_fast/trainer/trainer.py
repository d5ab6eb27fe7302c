"""The PPO loop: rollout, score, estimate, optimize; with logging, checkpoints and clean stops.

The run's state is one record, ``run_state.Run``, built by ``startup.build_run`` (options checked,
run folder claimed, data, reward, models, engine); the rooms take it: ``checkpoint`` (what a
checkpoint holds, the run folder claimed and resumed), ``evaluation`` (held-out scores),
``metrics`` (a step's record and row), ``report`` (progress, summary, plot).  A step's rollouts
come from ``run.source``: generated in the loop (``rollout_source.SyncSource``), or by a producer
process a few updates ahead (``async_rollouts.AsyncSource``, ``--max-staleness``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

import ppo_fast as pf

from . import checkpoint, distributed, evaluation, off_policy, report, startup, trackers
from .callbacks import checked as checked_callbacks
from .callbacks import notify
from .config import GROUP_METHODS, TrainerConfig
from .estimate import EstimateOptions, estimate
from .metrics import MetricsWriter, StepRecord, step_row
from .rollout import Rollouts, decode_responses, generate, score_old_and_ref
from .rollout_source import Generated
from .scoring import check_finite
from .stops import DeferredInterrupt, StopNow
from .update import Experience, first_epoch_micro_batches, ppo_update


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
        callbacks: Sequence = (),
    ):
        given = startup.Given(
            policy=policy,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            prompts=prompts,
            eval_prompts=eval_prompts,
            answers=answers,
            eval_answers=eval_answers,
        )
        self.callbacks = checked_callbacks(callbacks)  # before the run starts: a bad one writes nothing
        self.run = startup.build_run(cfg, given, log)
        self._in_update = False
        self._warned_no_signal = False

    def __getattr__(self, name: str):
        """The run's state read through the trainer (``trainer.policy`` is ``trainer.run.policy``)."""
        if name == "run":  # not built yet
            raise AttributeError(name)
        return getattr(self.run, name)

    @property
    def step(self) -> int:
        """Completed iterations."""
        return self.run.step

    @step.setter
    def step(self, value: int) -> None:
        self.run.step = value

    def save_checkpoint(self, rng: dict | None = None, final: bool = False) -> Path:
        """Checkpoint the run at this step; every rank calls this (see ``checkpoint.save_run``)."""
        path = checkpoint.save_run(self.run, rng, final)
        notify(self.callbacks, "on_save", self, path)
        return path

    def evaluate_all(self, model) -> dict[str, float]:
        """``model``'s held-out greedy scores (see ``evaluation.held_out``)."""
        scores = evaluation.held_out(self.run, model)
        notify(self.callbacks, "on_evaluate", self, scores)
        return scores

    # ------------------------------------------------------------------ one iteration

    def train_step(self) -> dict:
        """One PPO iteration; returns its metrics row.  ``self.run.step`` counts completed iterations."""
        cfg, timer = self.run.cfg, self.run.timer
        step = self.run.step + 1
        rows = self.run.parallel.per_rank(cfg.batch_size) * cfg.group_size
        start = time.perf_counter()
        with timer.phase("rollout"):  # the generation side: prompts, responses, rewards (a producer's, when async)
            g = self.run.source.next()
            check_finite(f"reward ({self.run.scorer.name})", g.scores, step)
            self._warn_if_no_signal(g.scores, step)
        with timer.phase("score"):  # the trainer's side: scored with the current weights
            r = self._rollout(g, rows)
        with timer.phase("estimate"):
            kl_coef = self.run.kl_control.value
            baselines = self._greedy_scores(r) if self._needs_baselines() else None
            est = estimate(
                r.scores,
                r.old_logprobs,
                r.ref_logprobs,
                r.values,
                r.mask,
                EstimateOptions.of(cfg, kl_coef),
                baselines=baselines,
                whitener=self.run.parallel.masked_whiten,
            )
        self._in_update = True
        with timer.phase("optimize"):
            # The KL goes into the loss when it is not in the reward.
            ref = None if cfg.kl_in_reward else r.ref_logprobs
            exp = Experience(
                batch=r.batch,
                old_logprobs=r.old_logprobs,
                advantages=est.advantages,
                old_values=r.values,
                returns=est.returns,
                ref_logprobs=ref,
                kl_coef=kl_coef,
                weights=r.loss_weights,
            )
            update_stats = ppo_update(
                self.run.train_policy,
                self.run.train_critic,
                self.run.optimizer,
                self.run.scheduler,
                exp,
                cfg,
                step=step,
                autocast=self._autocast,
                parallel=self.run.parallel,
                first_order=r.first_order,
                path=self.run.loss_path,
            )
        self._in_update = False
        sequence_kl = self.run.parallel.mean(est.kl.sum(-1).mean())
        self.run.kl_control.update(sequence_kl, rows * self.run.parallel.world_size)
        self.run.step = step
        self.run.policy_version += cfg.num_ppo_epochs * cfg.num_mini_batches  # one version per optimizer step
        if self.run.source.syncs_weights:  # an engine with its own copy, or a producer process
            with timer.phase("weight_sync"):
                self.run.source.publish()

        self.run.last_samples = list(zip(r.prompts, r.responses, r.scores.tolist()))
        seconds = time.perf_counter() - start
        lr = self.run.scheduler.get_last_lr()[0]
        record = StepRecord(
            step=step,
            rows=rows,
            seconds=seconds,
            lr=lr,
            rollouts=r,
            est=est,
            update_stats=update_stats,
            sequence_kl=sequence_kl,
            kl_coef=kl_coef,
            phase_seconds=timer.pop_step(),
        )
        row = step_row(record, cfg.kl_in_reward, self.run.parallel.world_size) | g.reward_metrics
        return self.run.parallel.reduce_row(row | self.run.source.metrics(g))

    def _rollout(self, g: Generated, rows: int) -> Rollouts:
        """The generated batch ``g`` scored with the policy's current weights, the reference and the
        critic.  The first epoch's shuffle is drawn first and the old log-probs are scored in its
        micro-batches, as the update will see them: the first micro-batch's ratio is then exactly 1."""
        cfg = self.run.cfg
        batch, engine_logprobs = g.batch, g.engine_logprobs
        first_order = torch.randperm(rows, device=self.run.device)
        with self._autocast():
            old, ref, values = score_old_and_ref(
                self.run.policy,
                self.run.reference,
                self.run.critic,
                batch,
                temperature=cfg.temperature,
                groups=first_epoch_micro_batches(first_order, batch.attention_mask.sum(-1), cfg, self.run.parallel),
                truncation=cfg.logprob_truncation(),
                reference_scope=self.run.reference_scope,
                packed=cfg.padding_free,
                old=off_policy.recomputes_old(cfg),  # bypass: the engine's log-probs are pi_old
            )
        inputs = off_policy.loss_inputs(old, engine_logprobs, batch.response_mask, cfg)
        return Rollouts(
            prompts=g.prompts,
            answers=g.answers,
            batch=batch,
            engine_logprobs=engine_logprobs,
            first_order=first_order,
            old_logprobs=inputs.old_logprobs,
            ref_logprobs=ref,
            values=values,
            responses=g.responses,
            scores=g.scores,
            columns=g.columns,
            loss_weights=inputs.weights,
            off_policy_metrics=inputs.metrics,
        )

    def _autocast(self):
        return startup.run_autocast(self.run)()

    def _needs_baselines(self) -> bool:
        return "baselines" in pf.advantage_methods()[self.run.cfg.advantage_method].params

    @torch.no_grad()
    def _greedy_scores(self, r: Rollouts) -> torch.Tensor:
        """remax's baselines: the reward of the policy's greedy response to each row's prompt."""
        with self._autocast():
            batch = generate(
                self.run.policy,
                self.run.tokenizer,
                r.prompts,
                max_new_tokens=self.run.response_length,
                temperature=1.0,
                top_p=1.0,
                greedy=True,
            )
        return self.run.scorer(
            r.prompts, decode_responses(self.run.tokenizer, batch), self.run.device, r.answers, r.columns
        )

    def _warn_if_no_signal(self, scores: torch.Tensor, step: int) -> None:
        """Warn once when a step's rewards cannot teach anything: equal within every group for
        the group estimators (every advantage is 0), equal over the whole batch otherwise."""
        if self._warned_no_signal:
            return
        cfg = self.run.cfg
        if cfg.advantage_method in GROUP_METHODS:
            groups = scores.view(-1, cfg.group_size)
            if bool((groups == groups[:, :1]).all()):
                self._warned_no_signal = True
                self.run.log(
                    f"warning: step {step}: the {cfg.group_size} responses to each prompt got the same "
                    f"reward, so every {cfg.advantage_method} advantage is 0 and this step teaches nothing; check "
                    "that the reward tells responses apart (or raise --temperature)"
                )
        elif bool((scores == scores[0]).all()):
            self._warned_no_signal = True
            self.run.log(
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
            self.run.source.close()  # its engine before the process group goes: vLLM's groups are built on it

    def _train(self) -> dict:
        cfg = self.run.cfg
        if self.run.step >= cfg.steps:  # --resume of a run that already did its steps
            return report.nothing_to_do(self.run)
        self.run.source.start()  # an async source's producer process (generating while the evaluation runs)
        with pf.use_backend(cfg.backend), self.run.parallel.guard():
            before, start = evaluation.at_start(self.run)
            if start:
                notify(self.callbacks, "on_evaluate", self, start)
            stop_reason = self._loop()
            if stop_reason in ("done", "callback"):
                self.run.log(f"saved {self.save_checkpoint(final=True)}")
                after = self.evaluate_all(self.run.policy)
                checkpoint.keep_if_best(self.run, after)
            else:  # stopped early: the user wants out, not a final evaluation (--resume finishes the run)
                after = {}
                if self.run.eval_prompts:
                    self.run.log("stopped early: no final held-out evaluation (--resume continues the run)")
        if not self.run.parallel.main:
            return {"stop_reason": stop_reason, "steps_done": self.run.step}
        return report.summary(self.run, stop_reason, (before, start, after))

    def _loop(self) -> str:
        """The iterations up to ``cfg.steps``, each logged, evaluated and saved at its period;
        ``"done"``, ``"callback"`` when a callback stopped it, or ``"interrupted"`` after a Ctrl-C (the
        last complete step saved)."""
        cfg, main = self.run.cfg, self.run.parallel.main
        if main:
            tracked = trackers.start(
                cfg.report_to, self.run.output_dir, cfg.to_dict(), self.run.resumed_from is not None
            )
        writer = MetricsWriter(self.run.output_dir, self.run.resumed_from, tracked) if main else distributed.NO_METRICS
        bar = tqdm(total=cfg.steps, initial=self.run.step, desc="PPO", dynamic_ncols=True, disable=not main)
        try:
            with DeferredInterrupt(self.run.log) as interrupt:
                while self.run.step < cfg.steps:
                    rng_at_step_start = checkpoint.rng_state()
                    try:
                        row = self.train_step()
                    except StopNow:
                        raise
                    except KeyboardInterrupt:
                        self._save_after_interrupt(rng_at_step_start)
                        return "interrupted"
                    more = self.run.step < cfg.steps
                    if cfg.eval_every and self.run.step % cfg.eval_every == 0 and more and self.run.eval_prompts:
                        row.update(self.evaluate_all(self.run.policy))
                        checkpoint.keep_if_best(self.run, row)
                        self.run.log(f"step {self.run.step}: held-out greedy {evaluation.in_words(row)}")
                    writer.write(row)
                    report.progress(self.run, bar, row)
                    if self.run.parallel.any(notify(self.callbacks, "on_step_end", self, row)):
                        self.run.log(f"step {self.run.step}: a callback stopped the run")
                        return "callback"
                    if self.run.parallel.any(interrupt.requested):  # a Ctrl-C on rank 0 stops every rank
                        self.run.log(f"saved {self.save_checkpoint()}")
                        return "interrupted"
                    if cfg.save_every and self.run.step % cfg.save_every == 0 and more:
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
        self.run.timer.pop_step()
        if self.run.parallel.active:  # the other ranks are inside the step: no collective save is possible
            self.run.log(f"interrupted during step {self.run.step + 1}: keeping the last saved checkpoint")
            return
        if self._in_update:
            self.run.log(
                f"interrupted during the update of step {self.run.step + 1}: keeping the last saved checkpoint"
            )
            return
        self.run.log(f"interrupted during step {self.run.step + 1}: saved {self.save_checkpoint(rng_at_step_start)}")
