"""Asynchronous rollouts (``--max-staleness K``, K > 0; docs/async.md): a producer process generates and
rewards the next batches while the trainer trains on the current one.

- The producer (``produce``, a ``torch.multiprocessing`` spawn) holds a shadow copy of the policy and runs
  the run's engine from the registry on it; it draws the prompts, generates, decodes and rewards (so a
  slow Python reward runs off the trainer's thread), and puts each batch, tagged with the weights that
  generated it, in a queue of at most K batches: with the one it is generating, at most K + 1 in flight.
- Weights go to it after each update (``AsyncSource.publish``; ``weight_transfer``, ``--weight-transfer``):
  into a staging copy (shared memory on the CPU; on the trainer's GPU CUDA IPC handles) or by a broadcast to
  the producer's receive buffer (a producer on another GPU, ``--rollout-device``); the producer copies them
  into its shadow policy under a lock, between generations only, so a generation never sees half-updated
  weights.
- A batch's age is the trainer steps (weight updates) between the weights that generated it and those
  that train on it.  ``--staleness-policy wait``: the producer starts batch n only once the weights of
  step n - K are published, so no batch is older than K.  ``drop``: the producer never waits for weights;
  the trainer drops a batch older than K and takes the next.
- A producer's failure reaches the trainer as ``ProducerError`` with the producer's traceback (the
  trainer's queue reads time out and check that the producer lives).  The producer ignores Ctrl-C and
  SIGTERM: the trainer stops it (``close``), after the step it finishes, and says what it dropped.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ppo_fast.spec import ROLLOUT_ENGINES, RolloutEngine

from . import partial_rollouts, weight_transfer
from .config import ConfigError
from .models import third_party_output
from .rollout_source import Generated, draw, generate_and_reward, sampling

# The producer's metrics, with --max-staleness > 0 (ProducerSource.metrics; glossary: metric_glossary.py).
METRICS = {
    "async/age": "the age of the batch this step trained on, in updates (at most --max-staleness; with "
    "--partial-rollouts, of its oldest token)",
    "async/staleness/<a>": "the groups (prompts) trained at age a, for a = 0 .. K (with --partial-rollouts, each "
    "group's age from its oldest token): the step's staleness histogram",
    "async/version": "the policy version (optimizer steps) that generated the batch (its oldest token's)",
    "async/groups_dropped": "groups dropped this step as older than K (--staleness-policy drop)",
    "async/producer_waits": "the producer's polls while it waited for fresh enough weights before this batch (wait)",
    "async/producer_idle_frac": "the producer's time waiting (for weights, or for room in the queue) over its time "
    "for this batch",
    "async/trainer_idle_frac": "the trainer's time waiting for a batch over its time since the last step",
    "async/queue_depth": "the batches left in the queue when the trainer took this one",
}

POLL_SECONDS = 1.0  # how often a trainer waiting for a batch checks that the producer lives
SAY_WAITING_SECONDS = 120.0  # a trainer waiting this long for a batch says so (and again as often)


class ProducerError(RuntimeError):
    """The rollout producer failed; the message holds its traceback."""


@dataclass(kw_only=True)
class ProducerSpec:
    """What the producer process is started with (pickled into it): the options, the engine's registry entry,
    the policy's copy it generates with, the tokenizer, the training prompts, the reward, the response length,
    the weights' transfer (and the producer's device), the run folder, the step, version and seed it starts at,
    and the trainer's pid."""

    cfg: object
    engine: RolloutEngine
    policy: torch.nn.Module
    tokenizer: object
    train_set: object
    scorer: object
    response_length: int
    transfer: weight_transfer.Transfer
    output_dir: Path
    first_step: int
    first_version: int
    seed: int
    parent: int

    @property
    def device(self) -> torch.device:
        return self.transfer.producer_device()


@dataclass(kw_only=True)
class Channel:
    """The producer's and the trainer's shared state: the staging weights (or, broadcast, the buckets of those
    sent, and the offer and join of each transfer), the step and version they hold, the lock around both, the
    batches' queue and the stop request."""

    staging: dict
    plan: list  # broadcast: weight_transfer.buckets of the tensors sent
    offer: object  # mp.Event: the trainer offers a broadcast
    joined: object  # mp.Value: the broadcasts the producer has joined
    weights_step: object  # mp.Value
    version: object  # mp.Value
    produced: object  # mp.Value: the batches generated so far
    partial: object = None  # mp.Value: --partial-rollouts' groups with generated tokens not yet sent
    lock: object
    batches: object  # mp.Queue
    stop: object  # mp.Event
    receiver: object = None  # the producer's weight_transfer.Receiver (broadcast), made there


def check_picklable(scorer, max_staleness: int) -> None:
    """``ConfigError`` naming a reward function that cannot go to the producer process."""
    for one in getattr(scorer, "scorers", [scorer]):
        fn = getattr(one, "fn", one)
        try:
            pickle.dumps(fn)
        except Exception as err:
            name = getattr(one, "name", type(one).__name__)
            raise ConfigError(
                f"--max-staleness {max_staleness}: the reward function {name} cannot be pickled for the rollout "
                f"producer's process ({type(err).__name__}: {err}); define it at the top level of a module, or "
                "use --max-staleness 0"
            ) from None


def from_run(run) -> AsyncSource:
    check_picklable(run.scorer, run.cfg.max_staleness)
    if run.cfg.partial_rollouts:
        partial_rollouts.check(run.cfg, run.response_length)
    return AsyncSource(run, run.transfer)


class AsyncSource:
    """The trainer's end of a producer process (see the module's docstring).  ``run``: the run's record
    (its options, policy, tokenizer, prompts, reward, device, log, step and version); ``transfer``: how the
    weights go to the producer, and its device (``weight_transfer.resolve``)."""

    is_async = True
    syncs_weights = True

    def __init__(self, run, transfer: weight_transfer.Transfer):
        self.run, self.cfg, self.transfer = run, run.cfg, transfer
        self.sender = None
        self.max_staleness, self.policy_name = run.cfg.max_staleness, run.cfg.staleness_policy
        self.process = self.channel = None
        self.dropped: collections.Counter = collections.Counter()  # groups dropped by age, this step
        self.dropped_total = self.taken = 0
        self.idle = 0.0
        self.since = time.perf_counter()

    # ------------------------------------------------------------------ start and stop

    def start(self) -> None:
        run, ctx = self.run, mp.get_context("spawn")
        self.template = copy.deepcopy(run.policy).eval().requires_grad_(False)  # the producer's shadow
        # What an update can change: all but the frozen parameters (LoRA: the adapters and the buffers).
        frozen = {name for name, p in run.policy.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state = run.policy.state_dict()
        self.names = [name for name in state if name not in frozen]
        transfer, server = weight_transfer.store(self.transfer)
        if broadcast := transfer.kind == "broadcast":  # by value: a CUDA copy would start CUDA in the producer
            self.template.to("cpu")  # before it chooses its GPU
        self.staging = {} if broadcast else {name: _shared(state[name]) for name in self.names}
        self.channel = Channel(
            staging=self.staging,
            plan=weight_transfer.buckets(state, self.names) if broadcast else [],
            offer=ctx.Event(),
            joined=ctx.Value("q", 0),
            weights_step=ctx.Value("q", run.step, lock=False),
            version=ctx.Value("q", run.policy_version, lock=False),
            produced=ctx.Value("q", 0),
            partial=ctx.Value("q", 0),
            lock=ctx.Lock(),
            batches=ctx.Queue(maxsize=self.max_staleness),
            stop=ctx.Event(),
        )
        spec = ProducerSpec(
            cfg=self.cfg,
            engine=ROLLOUT_ENGINES[self.cfg.rollout_engine],
            policy=self.template,
            tokenizer=run.tokenizer,
            train_set=run.train_set,
            scorer=run.scorer,
            response_length=run.response_length,
            transfer=transfer,
            output_dir=run.output_dir,
            first_step=run.step,
            first_version=run.policy_version,
            seed=self.cfg.seed + 1_000_003 * (run.step + 1),
            parent=os.getpid(),
        )
        self.process = ctx.Process(target=produce, args=(spec, self.channel), name="ppo-fast-producer", daemon=True)
        self.process.start()
        self.sender = weight_transfer.Sender(transfer, self.channel, server, run.device) if broadcast else None
        self.since = time.perf_counter()
        run.log(
            f"asynchronous rollouts: producer process {self.process.pid} ({self.cfg.rollout_engine} engine on "
            f"{transfer.device}, weights by {transfer.kind}), at most "
            f"{self.max_staleness} step(s) stale ({self.policy_name}), from step {run.step} (version {run.policy_version})"
        )

    def close(self) -> None:
        """Stop the producer (its queued batches are dropped, and said)."""
        if self.process is None:
            return
        if self.sender is not None:
            self.sender.close()
        process, self.process = self.process, None
        self.channel.stop.set()
        dropped, deadline = 0, time.perf_counter() + 10.0
        while process.is_alive() and time.perf_counter() < deadline:
            try:  # emptied, so that the producer's queue thread can end
                kind, _ = self.channel.batches.get(timeout=0.1)
                dropped += kind == "batch"
            except queue.Empty:
                pass
        process.join(timeout=5.0)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5.0)
        if process.is_alive():
            process.kill()
            process.join()
        self.run.log(
            f"asynchronous rollouts: producer stopped; {dropped} generated batch(es) not trained on were dropped"
            + (f" ({self.dropped_total} group(s) dropped as too stale during the run)" if self.dropped_total else "")
        )

    def in_flight(self) -> int:
        """The batches generated (and the one being generated) not yet taken by the trainer."""
        if self.process is None or not self.process.is_alive():
            return 0
        return self.channel.produced.value - self.taken + 1

    def partial_in_flight(self) -> int:
        """``--partial-rollouts``: the groups the producer holds partly or wholly generated, not yet sent."""
        if self.process is None or not self.process.is_alive():
            return 0
        return self.channel.partial.value

    # ------------------------------------------------------------------ the loop's calls

    def next(self) -> Generated:
        """The next batch no older than ``--max-staleness`` steps (older ones dropped)."""
        if self.process is None:  # a caller of train_step without train(): train() stops it
            self.start()
        while True:
            g = self._take()
            age = self.run.step - g.weights_step
            if age <= self.max_staleness:
                self.age = age
                return g.to(self.run.device)
            if self.policy_name == "wait":
                raise RuntimeError(f"asynchronous rollouts: a batch {age} steps old under --staleness-policy wait")
            self.dropped[age] += len(g.prompts) // self.cfg.group_size
            self.dropped_total += len(g.prompts) // self.cfg.group_size

    def _take(self) -> Generated:
        start, said = time.perf_counter(), 0
        while True:
            try:
                kind, payload = self.channel.batches.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    kind, payload = self._last_word()
                    break
                waited = time.perf_counter() - start
                if waited >= (said + 1) * SAY_WAITING_SECONDS:
                    said += 1
                    self.run.log(f"asynchronous rollouts: waiting {waited:.0f}s for the producer's next batch")
        self.idle += time.perf_counter() - start
        if kind == "error":
            raise ProducerError(f"the rollout producer (process {self.process.pid}) failed:\n{payload}")
        self.depth, self.taken = self.channel.batches.qsize(), self.taken + 1
        return pickle.loads(payload)

    def _last_word(self) -> tuple:
        """What a dead producer left in the queue, or an error saying how it ended."""
        try:
            return self.channel.batches.get(timeout=POLL_SECONDS)
        except queue.Empty:
            code = self.process.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
            return "error", (
                f"the producer {how} before it could send a traceback (out of memory, or it failed while starting: "
                "its stderr says why; a Python script that starts training when imported needs "
                "`if __name__ == '__main__':`, as for any spawned process)"
            )

    def publish(self) -> None:
        """The policy's weights after this step's update to the producer, with their step and version."""
        channel, run = self.channel, self.run
        if self.sender is not None:
            self.sender.send(run.policy.state_dict(), channel.plan, (run.step, run.policy_version), self._alive)
            with channel.lock:
                channel.weights_step.value, channel.version.value = run.step, run.policy_version
            return
        with channel.lock:
            with torch.no_grad():
                state = run.policy.state_dict()
                for name, staged in channel.staging.items():
                    staged.copy_(state[name])
            if any(t.is_cuda for t in channel.staging.values()):
                torch.cuda.synchronize()  # the copies are done before the producer may read them
            channel.weights_step.value, channel.version.value = run.step, run.policy_version

    def _alive(self) -> None:
        """``ProducerError`` with the producer's last word if it has ended."""
        if not self.process.is_alive():
            _, payload = self._last_word()
            raise ProducerError(f"the rollout producer (process {self.process.pid}) failed:\n{payload}")

    def metrics(self, g: Generated) -> dict:
        """The step's ``async/*`` metrics (``METRICS``)."""
        now = time.perf_counter()
        groups = len(g.prompts) // self.cfg.group_size
        busy = g.timing["generate"] + g.timing["reward"] + g.timing["weights"]
        row = {
            "async/version": g.version,
            "async/age": self.age,
            **{f"async/staleness/{a}": groups * (a == self.age) for a in range(self.max_staleness + 1)},
            "async/groups_dropped": sum(self.dropped.values()),
            "async/producer_waits": g.timing["waits"],
            "async/producer_idle_frac": g.timing["idle"] / max(g.timing["idle"] + busy, 1e-9),
            "async/trainer_idle_frac": self.idle / max(now - self.since, 1e-9),
            "async/queue_depth": self.depth,
        }
        if g.token_steps is not None:  # by each group's own age, and the spans
            step = self.age + g.weights_step  # the trainer's step when it took the batch
            row |= partial_rollouts.metrics(g, step, self.max_staleness, self.cfg.group_size)
        self.dropped.clear()
        self.idle, self.since = 0.0, now
        return row


def _shared(tensor: torch.Tensor) -> torch.Tensor:
    """A staging copy of ``tensor`` the producer can read: shared memory on the CPU, its own memory on a GPU
    (sent to the producer as a CUDA IPC handle)."""
    staged = tensor.detach().clone()
    return staged.share_memory_() if staged.device.type == "cpu" else staged


# ---------------------------------------------------------------------- the producer process


def produce(spec: ProducerSpec, channel: Channel) -> None:
    """The producer process's body: batches into ``channel.batches`` until ``channel.stop``; a failure goes
    there as ``("error", traceback)``."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # the trainer stops it, after its step
        signal.signal(signum, signal.SIG_IGN)
    _alone()
    if spec.transfer.visible is not None:  # its GPU, before anything starts CUDA here
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.transfer.visible
    try:
        _produce(spec, channel)
    except BaseException:
        _put(channel, ("error", traceback.format_exc()), spec.parent)


# What torchrun tells its ranks: a producer that rank 0 started is no rank, and its engine runs as one process
# (the vLLM engine reads WORLD_SIZE to choose its executor).
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE")


def _alone() -> None:
    for name in [name for name in os.environ if name in _RANK_VARIABLES or name.startswith("TORCHELASTIC_")]:
        del os.environ[name]


def _stopped(channel: Channel, parent: int) -> bool:
    return channel.stop.is_set() or os.getppid() != parent  # a trainer killed outright leaves no one to stop it


def _put(channel: Channel, item, parent: int) -> bool:
    """Put ``item`` in the queue, waiting for room; False if stopped first."""
    while not _stopped(channel, parent):
        try:
            channel.batches.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


def _start_engine(spec: ProducerSpec, policy: torch.nn.Module):
    from . import engine

    ROLLOUT_ENGINES.setdefault(spec.engine.name, spec.engine)  # the trainer's entry (one added at run time too)
    setup = engine.EngineSetup(
        policy=policy,
        tokenizer=spec.tokenizer,
        prompts=spec.train_set.texts,
        response_length=spec.response_length,
        rows=spec.cfg.batch_size * spec.cfg.group_size,
        device=spec.device,
        cfg=spec.cfg,
        output_dir=spec.output_dir,
        autocast=functools.partial(engine.autocast, spec.device, spec.cfg.bf16),
        synced_gpus=False,
        log=lambda message: print(f"ppo-fast producer: {message}", file=sys.stderr, flush=True),
    )
    return engine.start(spec.cfg.rollout_engine, setup)


def _adopt(channel: Channel, shadow: dict, held: int) -> tuple[int, int] | None:
    """``(step, version)`` of the staged (or received) weights, copied into ``shadow`` under the lock, if newer
    than ``held``."""
    if channel.receiver is not None:
        return channel.receiver.adopt(shadow, held)
    if channel.weights_step.value <= held:
        return None
    with channel.lock, torch.no_grad():
        for name, staged in channel.staging.items():
            shadow[name].copy_(staged)
        if any(t.is_cuda for t in shadow.values()):
            torch.cuda.synchronize()
        return channel.weights_step.value, channel.version.value


def _failed(channel: Channel, message: str) -> None:
    """A failure off the producer's main thread (the weights' receiver): reported, and the producer ended, as the
    trainer would wait on it otherwise.  On stderr too: a full queue (the trainer mid-transfer, not reading)
    may keep the report from the trainer, which then names the exit and points there."""
    print(f"ppo-fast producer: receiving the weights failed:\n{message}", file=sys.stderr, flush=True)
    with contextlib.suppress(queue.Full):
        channel.batches.put(("error", message), timeout=2.0)
        time.sleep(1.0)  # for the queue's thread to send it
    os._exit(1)


def _produce(spec: ProducerSpec, channel: Channel) -> None:
    cfg, device = spec.cfg, spec.device
    third_party_output(cfg.verbose)  # transformers as quiet as in the trainer
    if device.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    torch.manual_seed(spec.seed)
    policy = spec.policy.to(device).eval()
    engine = _start_engine(spec, policy)
    shadow = policy.state_dict()
    if spec.transfer.kind == "broadcast":
        failed = functools.partial(_failed, channel)
        channel.receiver = weight_transfer.Receiver(spec.transfer, channel, shadow, channel.plan, failed)
    step, version, index = spec.first_step, spec.first_version, spec.first_step
    keywords = sampling(cfg, spec.response_length) | {"device": device}
    shard = list(range(len(spec.train_set.texts)))
    scorer, idle = _TimedScorer(spec.scorer), 0.0
    pool = partial_rollouts.Pool(spec, shard) if cfg.partial_rollouts else None
    try:
        while not _stopped(channel, spec.parent):
            start, waits = time.perf_counter(), 0
            # Batch ``index`` trains at step index + 1 on the weights of step ``index``: under ``wait`` it is
            # generated from weights no older than step index - K.
            while cfg.staleness_policy == "wait" and channel.weights_step.value < index - cfg.max_staleness:
                if _stopped(channel, spec.parent):
                    return
                waits += 1
                time.sleep(0.002)
            idle += time.perf_counter() - start
            start = time.perf_counter()
            if (adopted := _adopt(channel, shadow, step)) is not None:
                step, version = adopted
                engine.sync_weights(policy)
            weights = time.perf_counter() - start
            start, scorer.seconds, adopting = time.perf_counter(), 0.0, 0.0
            if pool is not None:
                held = (shadow, policy, version, step)
                g, adopting, (version, step) = _partial_batch(pool, engine, scorer, channel, index, held)
            else:
                drawn, texts, answers = draw(spec.train_set, shard, cfg.batch_size, cfg.group_size)
                g = generate_and_reward(
                    engine,
                    tokenizer=spec.tokenizer,
                    scorer=scorer,
                    texts=texts,
                    answers=answers,
                    columns=spec.train_set.columns_of(drawn),
                    keywords=keywords,
                    weights=(version, step),
                )
            g.timing |= {
                "generate": time.perf_counter() - start - scorer.seconds - adopting,
                "reward": scorer.seconds,
                "weights": weights + adopting,
                "idle": idle,
                "waits": waits,
            }
            with channel.produced.get_lock():
                channel.produced.value += 1
                channel.partial.value = 0 if pool is None else pool.held()
            start = time.perf_counter()
            # By value: shared tensors would need this process alive when the trainer reads them.
            if not _put(channel, ("batch", pickle.dumps(g.to(torch.device("cpu")))), spec.parent):
                return
            idle = time.perf_counter() - start  # waiting for room counts toward the next batch
            index += 1
    finally:
        if channel.receiver is not None:
            channel.receiver.close()
        engine.close()


def _partial_batch(pool, engine, scorer, channel: Channel, index: int, held: tuple):
    """``(batch, seconds adopting weights, (version, step) held after it)`` from ``pool`` (--partial-rollouts;
    ``held``: the shadow policy's state and the policy, and the version and step it holds):
    before each round the producer adopts the newest weights, so a continued response goes on under them.
    The batch is trained on the weights of step ``index`` at the latest: under ``wait`` on those exactly,
    under ``drop`` on the trainer's published ones at the earliest; a group older than that by more than K
    steps is dropped (``partial_rollouts.Pool``)."""
    shadow, policy, version, step = held
    state = {"seconds": 0.0, "held": (version, step)}

    def refresh() -> tuple[int, int, int]:
        start = time.perf_counter()
        version, step = state["held"]
        if (adopted := _adopt(channel, shadow, step)) is not None:
            step, version = adopted
            engine.sync_weights(policy)
        state["held"], state["seconds"] = (version, step), state["seconds"] + time.perf_counter() - start
        floor = index if pool.cfg.staleness_policy == "wait" else channel.weights_step.value
        return version, step, floor

    g = pool.next_batch(engine, scorer, refresh)
    return g, state["seconds"], state["held"]


class _TimedScorer:
    """The run's reward, timed."""

    def __init__(self, scorer):
        self.scorer, self.seconds = scorer, 0.0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.scorer(*args)
        finally:
            self.seconds += time.perf_counter() - start

    def metrics(self) -> dict:
        return self.scorer.metrics()
