"""Asynchronous rollouts under ``torchrun`` (``--max-staleness K`` with several processes; docs/async.md).

- Rank 0 owns the producer process (``async_rollouts.AsyncSource``): it generates and rewards the whole
  batch, ``--batch-size`` prompts.  Each step rank 0 takes the next batch (the staleness checked and a stale
  batch dropped there, once) and scatters it: each rank gets its ``batch_size / world_size`` prompts' groups,
  and the step's ``async/*`` metrics are rank 0's, broadcast, so that every rank logs the same row.
- All ranks stay on one policy version: before the producer starts and before each publication, the ranks
  compare their (step, version), and a difference is an error on every rank.  The weights the producer gets
  are rank 0's after the synchronized update; under FSDP2 every rank joins the gather of the full weights
  into rank 0's unsharded copy of the policy (``producer_template``, made before the policy is sharded).
- A failure on rank 0 while it takes a batch (the producer's crash, with its traceback; a stale batch under
  ``wait``; a second Ctrl-C) is sent to every rank in place of its share, so every rank ends with it.  A rank
  0 that dies outright ends the others' collective with ``RankLost``, and its producer stops by itself.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from . import lora
from .async_rollouts import AsyncSource, ProducerError, check_picklable
from .rollout import Batch
from .rollout_source import Generated
from .stops import StopNow


class VersionMismatch(RuntimeError):
    """The ranks are at different policy versions (they must update in step)."""


def producer_template(cfg, policy: torch.nn.Module, parallel) -> torch.nn.Module | None:
    """Under FSDP2 with ``--max-staleness`` > 0, on rank 0: an unsharded copy of ``policy`` on the CPU (with the
    run's LoRA adapters), taken before FSDP2 shards the policy in place; the producer's policy is made from it,
    with the weights every rank gathers into it.  None elsewhere (under DDP rank 0's policy is whole)."""
    if not (cfg.max_staleness and parallel.active and parallel.mode == "fsdp" and parallel.main):
        return None
    template = copy.deepcopy(policy).to("cpu")
    if cfg.lora_r is not None:  # the same adapters as the policy gets: the same names in the state dict
        lora.attach(cfg, template)
    return template


def from_run(run, template: torch.nn.Module | None) -> RankedSource:
    check_picklable(run.scorer, run.cfg.max_staleness)  # on every rank: they all stop with the same error
    return RankedSource(run, template, run.transfer)


class _WithPolicy:
    """``run`` seen with another policy (FSDP2: rank 0's unsharded copy, which the producer follows)."""

    def __init__(self, run, policy: torch.nn.Module):
        self._run, self.policy = run, policy

    def __getattr__(self, name: str):
        return getattr(self._run, name)


class RankedSource:
    """Each rank's end of rank 0's producer (see the module's docstring); ``template``: rank 0's unsharded copy
    of the policy under FSDP2, else None; ``transfer``: how rank 0's producer gets its weights (rank 0)."""

    is_async = True
    syncs_weights = True

    def __init__(self, run, template: torch.nn.Module | None = None, transfer=None):
        self.run, self.parallel, self.template = run, run.parallel, template
        self.sharded = run.parallel.mode == "fsdp"
        self.local = None  # rank 0's producer
        if self.parallel.main:
            self.local = AsyncSource(run if template is None else _WithPolicy(run, template), transfer)
        self.started = False
        self.whole: Generated | None = None  # rank 0: the batch last taken, every rank's rows

    def start(self) -> None:
        self.started = True
        self._check_one_version("before the producer starts")
        self._gather_weights()
        if self.local is not None:
            self.local.start()

    def close(self) -> None:
        if self.local is not None:
            self.local.close()

    def in_flight(self) -> int:
        return self.local.in_flight() if self.local is not None else 0

    def partial_in_flight(self) -> int:
        return self.local.partial_in_flight() if self.local is not None else 0

    def next(self) -> Generated:
        """This rank's share of rank 0's next batch."""
        if not self.started:  # a caller of train_step without train(): train() stops it
            self.start()
        if not self.parallel.main:
            return self._receive(self.parallel.scatter_from_main(None))
        try:
            whole = self.local.next()
        except BaseException as err:  # every rank ends with it, instead of waiting for its share
            try:
                self.local.close()  # first: a producer takes seconds to exit, and torchrun ends rank 0 when others end
            finally:
                message = ("stop" if isinstance(err, KeyboardInterrupt) else "error", f"{type(err).__name__}: {err}")
                self.parallel.scatter_from_main([message] * self.parallel.world_size)
            raise
        self.whole = whole
        shares = [share.to(torch.device("cpu")) for share in split(whole, self.parallel.world_size)]
        return self._receive(self.parallel.scatter_from_main([("batch", share) for share in shares]))

    def _receive(self, message: tuple) -> Generated:
        kind, payload = message
        if kind == "stop":
            raise StopNow  # rank 0 was stopped at once (a second Ctrl-C): so is this rank
        if kind == "error":
            raise ProducerError(f"rank {self.parallel.rank}: rank 0's rollouts failed: {payload}")
        return payload.to(self.run.device)

    def publish(self) -> None:
        """Rank 0's weights after this step's update to the producer (FSDP2: gathered by every rank)."""
        self._check_one_version("after the update")
        self._gather_weights()
        if self.local is not None:
            self.local.publish()

    def metrics(self, g: Generated) -> dict:
        """Rank 0's ``async/*`` metrics of the whole batch, on every rank."""
        return self.parallel.from_main(self.local.metrics(self.whole) if self.local is not None else None)

    def _check_one_version(self, when: str) -> None:
        seen = self.parallel.gather_objects((self.run.step, self.run.policy_version))
        if len(set(seen)) > 1:
            ranks = ", ".join(f"rank {r}: step {step}, version {version}" for r, (step, version) in enumerate(seen))
            raise VersionMismatch(
                f"asynchronous rollouts: the ranks are at different policy versions {when} ({ranks}); every rank "
                "must take the same steps (the producer follows rank 0's weights)"
            )

    def _gather_weights(self) -> None:
        """FSDP2: the policy's full trainable weights into rank 0's unsharded copy (every rank gathers)."""
        if not self.sharded:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(self.run.policy, options=options)  # whole on rank 0, empty elsewhere
        if self.template is None:
            return
        own = self.template.state_dict()
        trainable = {name for name, p in self.template.named_parameters(remove_duplicate=False) if p.requires_grad}
        if wrong := sorted(set(state) - set(own)) or sorted(trainable - set(state)):  # else stale, unsaid
            raise RuntimeError(
                f"asynchronous rollouts: the gathered weights and the producer's copy of the policy differ in "
                f"{wrong[:3]}"
            )
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor)


def split(g: Generated, world_size: int) -> list[Generated]:
    """``g``'s rows in ``world_size`` equal consecutive shares (whole groups: ``--batch-size`` is a multiple of
    the world size), each with its own copy of its rows."""
    rows = len(g.prompts) // world_size

    def share(rank: int) -> Generated:
        pick = slice(rank * rows, (rank + 1) * rows)

        def own(t: torch.Tensor) -> torch.Tensor:  # not a view: a pickled view carries its whole storage
            return t[pick].clone()

        batch = g.batch
        return dataclasses.replace(
            g,
            prompts=g.prompts[pick],
            answers=g.answers[pick],
            columns={name: column[pick] for name, column in g.columns.items()},
            batch=Batch(own(batch.input_ids), own(batch.attention_mask), batch.prompt_width),
            engine_logprobs=None if g.engine_logprobs is None else own(g.engine_logprobs),
            responses=g.responses[pick],
            scores=own(g.scores),
            token_versions=None if g.token_versions is None else own(g.token_versions),
            token_steps=None if g.token_steps is None else own(g.token_steps),
        )

    return [share(rank) for rank in range(world_size)]
