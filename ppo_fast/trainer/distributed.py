"""Data-parallel PPO on ``torch.distributed``: one process per device, started by ``torchrun``.

Each rank samples its share of the prompts (``--batch-size`` is the global number, split
evenly) from its own shard of the prompt list, generates, scores and estimates them; the
advantage whitening statistics, the loss normaliser and the metrics are all-reduced, so a
run means the same at any world size.  Gradients are synchronised by DDP (replicated
weights and optimizer) or FSDP2 (``fully_shard``: weights, gradients and optimizer state
sharded), ``--parallel``; the frozen reference is a full copy per rank or sharded
(``--shard-reference``).  Rank 0 logs, shows the progress bar and writes the metrics.

Without ``torchrun`` (no ``WORLD_SIZE`` above 1 in the environment) :data:`SINGLE` stands in:
every method is then the single-process identity, so the trainer has one code path.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ppo_fast as pf

from . import run_folder
from .config import ConfigError, TrainerConfig
from .rollout import ResponseScorer


class RankLost(RuntimeError):
    """Another rank died or stopped answering (the collective failed or timed out)."""


@dataclass
class Parallel:
    """This process's place in the run and the collectives the trainer needs."""

    rank: int = 0
    world_size: int = 1
    mode: str = "single"  # single, ddp or fsdp
    shard_reference: bool = False
    _wrapped: list = field(default_factory=list)  # the DDP wrappers (for no_sync)
    _sharded: list = field(default_factory=list)  # the fully_shard roots (for gradient sync)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ collectives

    def barrier(self) -> None:
        if self.active:
            _collective(dist.barrier)

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (a new tensor; ``tensor`` itself when single)."""
        if not self.active:
            return tensor
        total = tensor.detach().clone()
        _collective(dist.all_reduce, total)
        return total

    @contextlib.contextmanager
    def guard(self):
        """Around the run: a failed collective inside DDP's or FSDP's own forward, backward or
        all-gather (a rank died) becomes ``RankLost`` with one line, as in our own collectives."""
        try:
            yield
        except (RuntimeError, dist.DistError) as err:
            if isinstance(err, RankLost) or not self.active or not _from_the_backend(err):
                raise
            raise _rank_lost(err, self.rank, self.world_size) from err

    def sums(self, values: list[float]) -> list[float]:
        """Each value summed over ranks (in float64)."""
        if not self.active:
            return values
        return self.all_sum(torch.tensor(values, dtype=torch.float64, device=_collective_device())).tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (a stop request from rank 0's Ctrl-C)."""
        if not self.active:
            return flag
        return bool(self.all_sum(torch.tensor([float(flag)], device=_collective_device())).item() > 0)

    def most(self, count: int) -> int:
        """The largest ``count`` over ranks (every rank runs that many micro-batches)."""
        if not self.active:
            return count
        counts = torch.zeros(self.world_size, device=_collective_device())
        counts[self.rank] = count
        return int(self.all_sum(counts).max().item())

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj``, by rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        _collective(dist.all_gather_object, out, obj)
        return out

    def from_main(self, obj):
        """Rank 0's ``obj`` on every rank (a decision rank 0 made alone, that every rank must follow)."""
        return self.gather_objects(obj if self.main else None)[0]

    def scatter_from_main(self, objs: list | None):
        """Rank 0's ``objs[r]`` on rank ``r`` (``objs``: one object per rank on rank 0, None elsewhere)."""
        if not self.active:
            return objs[0]
        out = [None]
        _collective(dist.scatter_object_list, out, objs if self.main else None, 0)
        return out[0]

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block (a warm-up that writes a cache) before the others do."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    # ------------------------------------------------------------------ data

    def shard(self, count: int) -> range:
        """This rank's indices of a list of ``count`` prompts."""
        return range(self.rank, count, self.world_size)

    def per_rank(self, count: int) -> int:
        return count // self.world_size

    def masked_whiten(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``pf.masked_whiten`` with the mean and (Bessel-corrected) variance over all ranks' tokens."""
        if not self.active:
            return pf.masked_whiten(x, mask)
        valid = mask.to(x.dtype)
        sums = self.all_sum(torch.stack([(x * valid).sum(), valid.sum()]))
        mean = sums[0] / sums[1].clamp_min(1.0)
        square = self.all_sum(torch.where(mask, (x - mean).square(), 0.0).sum())
        var = square / (sums[1] - 1.0).clamp_min(1.0)
        return torch.where(mask, (x - mean) * torch.rsqrt(var + 1e-8), 0.0)

    def mean(self, value: torch.Tensor) -> float:
        """The mean over ranks of a per-rank scalar (ranks hold equal numbers of rollouts)."""
        return (self.all_sum(value.detach().float()) / self.world_size).item()

    def micro_batch_weights(self, masks: list[torch.Tensor], agg: str) -> list[torch.Tensor]:
        """What each micro-batch's loss is multiplied by before ``backward`` so that the
        accumulated gradient, averaged over ranks by DDP/FSDP, is the gradient of the loss
        aggregated over the whole minibatch of every rank: ``token-mean`` divides by the
        global number of tokens, the ``seq-mean-*`` modes by the global number of responses,
        ``token-sum`` sums.  Single process with one micro-batch: exactly 1."""
        if agg == "token-sum":
            return [torch.tensor(float(self.world_size))] * len(masks)
        if agg == "token-mean":
            counts = torch.stack([m.sum() for m in masks]).float()
        else:
            counts = torch.stack([m.any(-1).sum() for m in masks]).float()
        total = self.all_sum(counts.sum())
        return list(counts * self.world_size / total.clamp_min(1.0))

    def reduce_row(self, row: dict) -> dict:
        """A metrics row's per-rank measurements averaged over ranks (throughput summed); integers
        (the step, the episode count) are already global."""
        if not self.active:
            return row
        names = [k for k, v in row.items() if isinstance(v, float)]
        values = (
            self.all_sum(torch.tensor([float(row[k]) for k in names], dtype=torch.float64, device=_collective_device()))
            / self.world_size
        )
        out = dict(row)
        for name, value in zip(names, values.tolist()):
            out[name] = value * self.world_size if name.startswith("throughput/") else value
        return out

    # ------------------------------------------------------------------ models

    def prepare(self, policy: nn.Module, critic: nn.Module | None, reference: nn.Module):
        """Shard (FSDP2, in place) or wrap (DDP) the models; returns the ``(policy, critic)``
        the update calls (their gradients are synchronised): under DDP the policy's
        ``ResponseScorer``.  Build the optimizer after this."""
        if not self.active:
            return policy, critic
        if self.shard_reference:
            _fully_shard_model(reference)
        if self.mode == "fsdp":
            _fully_shard_model(policy)
            self._sharded.append(policy)
            if critic is not None:
                if critic.backbone is not None:
                    _fully_shard_model(critic.backbone)
                    self._sharded.append(critic.backbone)
                from torch.distributed.fsdp import fully_shard

                fully_shard(critic.head)
                self._sharded.append(critic.head)
            return policy, critic
        from torch.nn.parallel import DistributedDataParallel as DDP

        def ddp(module):
            wrapped = DDP(
                module, device_ids=[module_device(module).index] if module_device(module).type == "cuda" else None
            )
            self._wrapped.append(wrapped)
            return wrapped

        # The policy's update forward is its ResponseScorer's (the fused head runs inside DDP's forward).
        scorer = ResponseScorer(policy)
        if critic is None:
            return ddp(scorer), None
        # The critic's parts are wrapped where Critic.forward (and the shared head) call them.
        view = copy.copy(critic)
        view._modules = dict(critic._modules, head=ddp(critic.head))
        if critic.backbone is not None:
            view._modules["backbone"] = ddp(critic.backbone)
        return ddp(scorer), view

    @contextlib.contextmanager
    def accumulating(self, sync: bool):
        """Around one micro-batch's forward and backward: gradients are synchronised only when
        ``sync`` (the minibatch's last micro-batch); before that they accumulate locally."""
        with contextlib.ExitStack() as stack:
            if not sync:
                for wrapped in self._wrapped:
                    stack.enter_context(wrapped.no_sync())
            for module in self._sharded:
                module.set_requires_gradient_sync(sync)
            yield

    @property
    def synced_generation(self) -> bool:
        """Sharded weights are gathered by every rank together: generation must run the same
        number of forward passes everywhere (``generate(synced_gpus=True)``)."""
        return self.active and (self.mode == "fsdp" or self.shard_reference)


SINGLE = Parallel()


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _fully_shard_model(model: nn.Module) -> None:
    """FSDP2 on each transformer block (HF's ``_no_split_modules``), then on the whole model."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in blocks:
            fully_shard(module)
    fully_shard(model)


def _collective(fn, *args):
    """Run a collective; another rank's death or a timeout becomes ``RankLost`` with one line."""
    try:
        return fn(*args)
    except (RuntimeError, dist.DistError) as err:
        raise _rank_lost(err) from err


# Each rank's address on the network the process group uses, by rank (gathered by ``init``):
# a backend error names the peer's address, the error line names the rank.
_addresses: list[str] = []


def _rank_lost(err: Exception, rank: int | None = None, world_size: int | None = None) -> RankLost:
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    reason = " ".join(str(err).split())[:200]
    return RankLost(
        f"rank {rank}: another rank stopped answering: {_lost_ranks(str(err), rank, world_size)} "
        f"({reason}); stopping. Its own log says why; the last complete checkpoint is kept"
    )


def _lost_ranks(message: str, rank: int, world_size: int) -> str:
    """Which rank is lost: the ranks at the address the backend's error names (not this rank's
    own), else the only other rank of two; else unknown (a timeout names no peer)."""
    others = [r for r in range(world_size) if r != rank]
    named = [r for r in others if r < len(_addresses) and f"[{_addresses[r]}]" in message]
    if named and len({_addresses[r] for r in named}) == 1 and _addresses[named[0]] != _addresses[rank]:
        return " or ".join(f"rank {r}" for r in named) + f" at {_addresses[named[0]]} is lost"
    if len(others) == 1:
        where = f" at {_addresses[others[0]]}" if len(_addresses) == world_size else ""
        return f"rank {others[0]}{where} is lost"
    return "which rank is lost is not known (a timeout; each rank's log says whether it is alive)"


def _own_address() -> str:
    """The local address on the route to the rendezvous host (``MASTER_ADDR``)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))))
            return probe.getsockname()[0]
    except OSError:
        return "unknown"


def _from_the_backend(err: Exception) -> bool:
    """An error raised by the communication backend (a peer gone, a timeout), not by the model."""
    return isinstance(err, dist.DistError) or any(
        name in str(err)
        for name in ("gloo", "NCCL", "Connection reset by peer", "Application timeout caused pair closure")
    )


def _restartable_shared_store() -> bool:
    """``torchrun --max-restarts`` with the agents' store shared with the workers (torch's default)."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
    )


_NONCE_KEY = "ppo_fast/attempt_nonce"


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """A store of this attempt's own for the process group, under ``torchrun --max-restarts``.

    The agents' shared store outlives a restart, and with it the keys the previous attempt's
    workers wrote, gloo's peer addresses among them: a restarted rank that reads its peer's
    old address before the peer has written its new one connects to a closed port and fails.
    So rank 0 serves a new store and advertises it (address, port, nonce) in the shared one;
    the others take an advert only when they reach a store holding its nonce (the previous
    attempt's store died with its workers, and a reused port holds another nonce)."""
    import secrets
    import time

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    shared = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    advert = f"ppo_fast/attempt_store/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if rank == 0:
        own = dist.TCPStore(addr, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = secrets.token_hex(16)
        own.set(_NONCE_KEY, nonce)
        shared.set(advert, f"{addr} {own.port} {nonce}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        host, own_port, nonce = shared.get(advert).decode().split()
        with contextlib.suppress(RuntimeError):  # the previous attempt's store: gone, or another nonce
            own = dist.TCPStore(host, int(own_port), is_master=False, timeout=datetime.timedelta(seconds=2))
            if own.get(_NONCE_KEY).decode() == nonce:
                own.set_timeout(timeout)
                return own
        if time.monotonic() > deadline:
            raise RankLost(f"rank {rank}: rank 0's store for this attempt never answered (--dist-timeout)")
        time.sleep(0.2)


def init(cfg: TrainerConfig, device: torch.device) -> tuple[Parallel, torch.device]:
    """Join the process group when started by ``torchrun`` with more than one process;
    returns this rank's :class:`Parallel` and device (``cuda:LOCAL_RANK`` on GPUs)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return SINGLE, device
    rank = int(os.environ["RANK"])
    per_rank = cfg.batch_size // world_size
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"--batch-size {cfg.batch_size} must be a multiple of the world size {world_size} "
            "(each rank samples batch_size / world_size prompts)"
        )
    rows = per_rank * cfg.group_size
    if rows % (cfg.num_mini_batches * cfg.gradient_accumulation_steps):
        raise ConfigError(
            f"each of the {world_size} ranks has {rows} rollouts per step (--batch-size {cfg.batch_size} / "
            f"{world_size} x --group-size {cfg.group_size}), which --num-mini-batches "
            f"{cfg.num_mini_batches} x --gradient-accumulation-steps {cfg.gradient_accumulation_steps} must divide"
        )
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.dist_timeout)
        group = {}
        if _restartable_shared_store():
            group = {"store": _attempt_store(rank, world_size, timeout), "rank": rank, "world_size": world_size}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout, **group)
    parallel = Parallel(rank=rank, world_size=world_size, mode=cfg.parallel, shard_reference=cfg.shard_reference)
    _addresses[:] = parallel.gather_objects(_own_address())
    return parallel, device


class _NoMetrics:
    """The metrics writer of ranks other than 0."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


NO_METRICS = _NoMetrics()


# ---------------------------------------------------------------------- sharded checkpoints


def save_pretrained(model: nn.Module, folder, state_dict: dict | None) -> None:
    """``model.save_pretrained`` (with the gathered ``state_dict`` of a sharded model); FSDP2 renames
    the class ``FSDP<Name>``, which ``config.json`` would otherwise record as the architecture."""
    from torch.distributed.fsdp import FSDPModule

    model.save_pretrained(folder, state_dict=state_dict)
    if isinstance(model, FSDPModule):
        config = Path(folder) / "config.json"
        values = json.loads(config.read_text())
        values["architectures"] = [name.removeprefix("FSDP") for name in values.get("architectures") or []]
        config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def full_state_dict(model: nn.Module) -> dict:
    """The whole (unsharded) state dict on rank 0's CPU; every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _models(policy: nn.Module, critic: nn.Module | None) -> nn.Module:
    return nn.ModuleDict({"policy": policy} | ({"critic": critic} if critic is not None else {}))


def _state_options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: the frozen base is the run's model, not the checkpoint's (strict=False: it is left out).
    return StateDictOptions(ignore_frozen_params=True, strict=False) if trainable_only else None


def _sharded_state(policy, critic, optimizer, trainable_only: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    options = _state_options(trainable_only)
    model_state, optimizer_state = get_state_dict(_models(policy, critic), optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def save_sharded(folder, policy, critic, optimizer, trainable_only: bool = False) -> None:
    """Policy, critic and optimizer, each rank writing its shards (``torch.distributed.checkpoint``);
    ``trainable_only`` (LoRA): the adapters and heads, not the frozen base."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(policy, critic, optimizer, trainable_only), checkpoint_id=folder)


def load_sharded(folder, policy, critic, optimizer, trainable_only: bool = False) -> None:
    """The inverse of :func:`save_sharded`, at any world size (the shards are redistributed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _sharded_state(policy, critic, optimizer, trainable_only)
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        _models(policy, critic),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_state_options(trainable_only),
    )


# ---------------------------------------------------------------------- elastic restarts

ELASTIC_FILE = run_folder.ELASTIC_FILE
_agent_identity = run_folder.agent_identity


def elastic_restart_count() -> int:
    """How many times ``torchrun --max-restarts`` has restarted this agent's workers (0: the first start,
    and also a restart of a healthy node's workers after another node's failed)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def claim_for_elastic_restarts(parallel: Parallel, output_dir: Path) -> None:
    """On the first start under torchrun (every rank calls it, after the folder was claimed): rank 0
    records the job (its run id and every rank's agent) in ``output_dir``, so that a restart of this
    job, and only of this job, continues the run there."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or elastic_restart_count() > 0:
        return
    if (output_dir / ELASTIC_FILE).exists() and run_folder.elastic_restart(output_dir):
        return  # a healthy node's workers restarted (count 0): the job's record stands
    agents = parallel.gather_objects(_agent_identity())
    if parallel.main:
        record = {"run_id": os.environ["TORCHELASTIC_RUN_ID"], "agents": sorted(set(agents))}
        (output_dir / ELASTIC_FILE).write_text(json.dumps(record, indent=2) + "\n")


def restart_of_this_job(parallel: Parallel, output_dir: Path) -> bool:
    """True on every rank when this is a torchrun restart of the job that started the run in
    ``output_dir``: the same run id, and every rank's agent one of those that started it (a new
    torchrun command has new agents, so a user's run is never continued unasked)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    agents = set(parallel.gather_objects(_agent_identity()))
    verdict = False
    if parallel.main:
        try:
            record = json.loads((output_dir / ELASTIC_FILE).read_text())
            verdict = record.get("run_id") == os.environ.get("TORCHELASTIC_RUN_ID") and agents <= set(
                record.get("agents", [])
            )
        except (OSError, ValueError, AttributeError):
            verdict = False
    return bool(parallel.from_main(verdict))


def shutdown() -> None:
    """Leave the process group (if this process joined one), the trainer's DDP and FSDP modules freed
    first where nothing holds them: one that outlives the group (a trainer left in a reference cycle)
    holds it until the interpreter exits, where tearing gloo down then aborts some runs in C++
    ("terminate called without an active exception", SIGABRT).  A caller that holds its trainer drops it
    before calling this."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def leave_on_error(status: int) -> int:
    """``status`` (an error's exit status, already reported); a rank of a multi-process run ends here
    instead, its output flushed, with no teardown: the trainer's DDP or FSDP modules, alive in the
    error's traceback, hold the process group past ``shutdown``, and tearing gloo down at exit then can
    abort in C++ ("terminate called without an active exception", SIGABRT), which turns the error's
    status into -6 after the error line."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
