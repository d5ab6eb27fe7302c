"""A run's state in one record (``Run``), built by ``startup.build_run``: the rooms take it and read what
they use (``checkpoint.save_run(run)``, ``checkpoint.restore(run, ...)``, ``report.summary(run, ...)``,
``evaluation.held_out(run, ...)``); the loop (``trainer.PPOTrainer``) advances ``step``, ``best`` and
``last_samples``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class Run:
    """What one run holds.  Known first (before any model loads): the options, the log, the run folder,
    the processes and the device, whether it is the built-in task and the response length.  Then the
    tokenizer, the prompts, the reward, the models with their wrappers (what the update calls), the
    optimiser, its schedule, the KL controller and (LoRA) the adapters, the rollout engine, the rollout
    source and the loss path.  Then where it is: the step, the policy's version, the best held-out score
    and the step it resumed from."""

    cfg: object  # TrainerConfig (its final values: a torchrun restart resumes, packing resolved on the model)
    log: Callable[[str], None]
    output_dir: Path
    parallel: object  # distributed.Parallel
    device: object  # torch.device
    builtin: bool
    response_length: int
    created: float  # time.perf_counter() at the start: the summary's wall time counts the warm-up
    timer: object  # metrics.PhaseTimer
    transfer: object = None  # --max-staleness > 0: weight_transfer.Transfer, the producer's device and weights' path
    tokenizer: object = None
    train_set: object = None  # prompts.Prompts
    eval_set: object = None
    scorer: object = None
    policy: object = None
    reference: object = None
    critic: object = None
    train_policy: object = None
    train_critic: object = None
    optimizer: object = None
    scheduler: object = None
    kl_control: object = None
    adapters: object = None  # LoRA: the policy's PeftModel; the reference is then the policy, adapters off
    reference_scope: Callable = contextlib.nullcontext
    engine: object = None  # engine.Engine (in this process; None where a producer process holds it)
    source: object = None  # rollout_source.SyncSource or async_rollouts.AsyncSource: where the rollouts come from
    loss_path: object = None  # update.LossPath
    step: int = 0
    policy_version: int = 0  # the policy's optimizer steps so far: the version a rollout is tagged with
    best: dict | None = None
    resumed_from: int | None = None
    last_samples: list = field(default_factory=list)

    @property
    def prompts(self) -> list[str]:
        return self.train_set.texts

    @property
    def eval_prompts(self) -> list[str]:
        return self.eval_set.texts
