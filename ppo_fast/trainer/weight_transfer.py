"""How the rollout producer (``async_rollouts``) gets each update's weights: ``--weight-transfer``, decided once
from ``--rollout-device`` and the trainer's device (``resolve``).

- ``staging``: a staging copy the producer reads under a lock; shared memory on the CPU, on a GPU the trainer's
  own memory sent as CUDA IPC handles.  No copy crosses a device, but the producer must sit on the trainer's.
- ``broadcast``: a two-process group (gloo on the CPU, NCCL on GPUs) of the trainer and the producer, its own
  store and group, beside any torchrun group.  A producer on another GPU needs it.  The producer only adopts
  weights between generations, so a plain broadcast would make the trainer wait for the producer's generation
  to end; instead a receiving thread in the producer joins each broadcast when the trainer offers one
  (``Sender.send``: offer, wait for the join while checking the producer lives, broadcast), into a receive
  buffer on the producer's device (one more copy of the weights there), and the producer copies that buffer
  into its policy between generations under the receiver's lock (``Receiver.adopt``).  The trainer waits
  for the transfer itself and at most one such copy, never a generation.  The tensors go in buckets of
  consecutive tensors of one dtype (``buckets``): one broadcast a bucket, not one a tensor (each call a
  rendezvous and, in the producer, a thread that must win the GIL back from generation), at the cost of
  one bucket's copy on the trainer's side.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError

BUCKET_BYTES = 256 * 2**20  # a tensor larger than this goes alone, in place
TIMEOUT = datetime.timedelta(seconds=300)  # a transfer, or the group's start, that takes longer is an error
_HOST = "127.0.0.1"  # the producer is the trainer's child, on its machine


@dataclass(frozen=True)
class Transfer:
    """``kind``: staging or broadcast; ``device``: the producer's device as the trainer names it;
    ``visible``: the producer's ``CUDA_VISIBLE_DEVICES`` when it sits on another GPU (it then names its GPU
    cuda:0, as vLLM's engine expects), else None; ``port``: the broadcast group's store (the trainer's)."""

    kind: str
    device: torch.device
    visible: str | None = None
    port: int = 0

    def producer_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.visible is not None else self.device

    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def resolve(cfg, trainer_device: torch.device) -> Transfer:
    """The producer's device and how its weights travel (``ConfigError`` for a combination that cannot work)."""
    device = trainer_device
    if cfg.rollout_device != "auto":
        if trainer_device.type != "cuda":
            raise ConfigError(f"--rollout-device {cfg.rollout_device}: needs the trainer on a GPU (it is on the CPU)")
        device = torch.device(cfg.rollout_device)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--rollout-device {cfg.rollout_device}: this process sees {torch.cuda.device_count()} GPU(s)"
            )
    same = device.type == trainer_device.type and (device.index or 0) == (trainer_device.index or 0)
    kind = cfg.weight_transfer if cfg.weight_transfer != "auto" else ("staging" if same else "broadcast")
    if kind == "staging" and not same:
        raise ConfigError(
            f"--weight-transfer staging: needs the producer on the trainer's device ({trainer_device}); "
            f"--rollout-device {cfg.rollout_device} puts it on {device}: use broadcast"
        )
    if kind == "broadcast" and same and device.type == "cuda":  # NCCL refuses two ranks on one GPU
        raise ConfigError(
            f"--weight-transfer broadcast: on a GPU needs the producer on another GPU (--rollout-device cuda:N); "
            f"on the trainer's ({device}) use staging"
        )
    return Transfer(kind, device, None if same else _visible(device.index))


def _visible(index: int) -> str:
    """The physical GPU of this process's ``cuda:index`` (through its own ``CUDA_VISIBLE_DEVICES``)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return seen.split(",")[index].strip() if seen else str(index)


def store(transfer: Transfer) -> tuple[Transfer, dist.TCPStore | None]:
    """The broadcast group's store, the trainer's (a free port), and ``transfer`` naming its port."""
    if transfer.kind != "broadcast":
        return transfer, None
    server = dist.TCPStore(_HOST, 0, 2, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    return Transfer(transfer.kind, transfer.device, transfer.visible, server.port), server


def _group(transfer: Transfer, rank: int, server: dist.TCPStore | None = None):
    """The trainer's (rank 0) and the producer's (rank 1) group; a rendezvous, so both make it at once."""
    prefixed = dist.PrefixStore("weights", server or dist.TCPStore(_HOST, transfer.port, 2, False, timeout=TIMEOUT))
    if transfer.backend() == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, TIMEOUT)
    return dist.ProcessGroupNCCL(prefixed, rank, 2, TIMEOUT)


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of one dtype sent as one flat tensor: their names, dtype and element counts."""

    names: tuple[str, ...]
    dtype: torch.dtype
    numels: tuple[int, ...]


def buckets(state: dict, names: list[str], limit: int | None = None) -> list[Bucket]:
    """``names`` (in order) in buckets of one dtype and at most ``limit`` (``BUCKET_BYTES``) bytes, or one larger
    tensor."""
    limit = BUCKET_BYTES if limit is None else limit
    groups: list[list[str]] = []
    size = 0
    for name in names:
        t = state[name]
        nbytes = t.numel() * t.element_size()
        if not groups or t.dtype != state[groups[-1][0]].dtype or size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return [Bucket(tuple(g), state[g[0]].dtype, tuple(state[n].numel() for n in g)) for g in groups]


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class Sender:
    """The trainer's end of ``broadcast``; ``channel``: the producer's channel (its ``offer`` event and
    ``joined`` count), ``server``: the group's store (``store``), ``device``: the trainer's, which its end
    of the group sends from (NCCL puts each rank on its own GPU)."""

    def __init__(self, transfer: Transfer, channel, server: dist.TCPStore, device: torch.device):
        self.transfer, self.channel, self.server, self.device = transfer, channel, server, device
        self.group, self.offers = None, 0

    def send(self, state: dict, plan: list[Bucket], step_version: tuple[int, int], alive) -> None:
        """``state``'s tensors by ``plan``'s buckets, with the step and version, to the producer; ``alive()``
        raises if the producer has died (checked while waiting for it to join)."""
        self.offers += 1
        self.channel.offer.set()
        while self.channel.joined.value < self.offers:
            alive()
            time.sleep(0.001)
        if self.group is None:
            self.group = _group(self.transfer, 0, self.server)
        try:
            self._broadcast(state, plan, step_version)
        except Exception:  # the producer's end failed: its own report, once it has ended, says why
            deadline = time.perf_counter() + 5.0
            while time.perf_counter() < deadline:
                alive()
                time.sleep(0.05)
            raise

    def _broadcast(self, state: dict, plan: list[Bucket], step_version: tuple[int, int]) -> None:
        device = self.device
        _broadcast(self.group, torch.tensor(step_version, dtype=torch.int64, device=device))
        with torch.no_grad():
            for bucket in plan:
                parts = [state[name].detach().to(device).reshape(-1) for name in bucket.names]
                _broadcast(self.group, parts[0].contiguous() if len(parts) == 1 else torch.cat(parts))

    def close(self) -> None:
        self.group = self.server = None


class Receiver:
    """The producer's end of ``broadcast``: a thread that joins each offered broadcast into ``buffer`` (one
    flat tensor a bucket of ``plan``, the trainer's, on the producer's device, and each of ``shadow``'s tensors
    a view of it).  ``failed(traceback)``: what the thread does when a transfer fails (reports it and ends the
    producer: the trainer would otherwise wait on a broken group)."""

    def __init__(self, transfer: Transfer, channel, shadow: dict, plan: list[Bucket], failed):
        self.transfer, self.channel, self.failed = transfer, channel, failed
        self.flat, self.buffer = _buffers(plan, shadow, transfer.producer_device())
        self.names = [name for bucket in plan for name in bucket.names]
        self.lock, self.received, self.group = threading.Lock(), None, None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ppo-fast-weights", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            device, stream = self.transfer.producer_device(), None
            if device.type == "cuda":  # the current GPU is the thread's own; a stream of its own, so that the
                torch.cuda.set_device(device)  # generation's kernels never queue behind a transfer's wait
                stream = torch.cuda.Stream(device)
            while not self.stopping.is_set():
                if self.channel.offer.wait(0.1):
                    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                        self._receive(stream)
        except BaseException:
            self.failed(traceback.format_exc())

    def _receive(self, stream) -> None:
        self.channel.offer.clear()
        with self.lock:
            self.channel.joined.value += 1  # the trainer broadcasts once it sees this
            if self.group is None:
                self.group = _group(self.transfer, 1)
            header = torch.empty(2, dtype=torch.int64, device=self.transfer.producer_device())
            _broadcast(self.group, header)
            for flat in self.flat:
                _broadcast(self.group, flat)
            if stream is not None:
                stream.synchronize()  # received before the lock is released (adopt reads on another stream)
            self.received = tuple(header.tolist())

    def adopt(self, shadow: dict, held: int) -> tuple[int, int] | None:
        """``(step, version)`` of the received weights, copied into ``shadow``, if newer than step ``held``."""
        with self.lock, torch.no_grad():
            if self.received is None or self.received[0] <= held:
                return None
            for name in self.names:
                shadow[name].copy_(self.buffer[name])
            if self.transfer.producer_device().type == "cuda":
                torch.cuda.synchronize()
            return self.received

    def close(self) -> None:
        self.stopping.set()


def _buffers(plan: list[Bucket], shadow: dict, device: torch.device) -> tuple[list[torch.Tensor], dict]:
    """One flat tensor a bucket, and each tensor's view of it; the trainer's plan checked against ``shadow``."""
    flats, views = [], {}
    for bucket in plan:
        for name, numel in zip(bucket.names, bucket.numels):
            own = shadow.get(name)
            if own is None or own.dtype != bucket.dtype or own.numel() != numel:
                got = "none" if own is None else f"{own.dtype}, {own.numel()} elements"
                raise RuntimeError(
                    f"asynchronous rollouts: the trainer sends {name} as {bucket.dtype}, {numel} elements; the "
                    f"producer's copy of the policy has {got}"
                )
        flat = torch.empty(sum(bucket.numels), dtype=bucket.dtype, device=device)
        for name, part in zip(bucket.names, flat.split(list(bucket.numels))):
            views[name] = part.view(shadow[name].shape)
        flats.append(flat)
    return flats, views
