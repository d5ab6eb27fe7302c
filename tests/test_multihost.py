"""Several hosts for real: each node a network namespace with its own address on a private bridge
(10.77.0.1, .2, .3), joined by veth pairs; ``torchrun --rdzv-backend c10d`` in each, gloo between
them.  One update at 2 nodes equals one process; FSDP2 checkpoints written at 2 nodes resume at 1
and at 3; a killed node or a cut link ends the survivor with one error line and keeps the last
checkpoint; ``--max-restarts`` continues the run by itself; a slow, lossy link changes no result.

Slow (a run per test), so asked for: ``PPO_FAST_MULTIHOST=1`` or ``-m multihost`` (``.ci/multihost.sh``);
needs root and iproute2 (``ip``, ``tc``), else skipped with the reason.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dist_workers
import pytest
import torch

from ppo_fast.trainer import checkpoint
from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
PORT = 29400
IFNAME = "eth0"  # the node's interface inside its namespace (GLOO_SOCKET_IFNAME)
TINY = "--batch-size 6 --num-mini-batches 1 --num-ppo-epochs 1 --sample-every 0 --sft-steps 10 --eval-size 0".split()


def _asked(config) -> bool:
    return os.environ.get("PPO_FAST_MULTIHOST") == "1" or "multihost" in (config.getoption("-m") or "")


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc): apt-get install iproute2"
    probe = f"pfprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


@pytest.fixture(autouse=True)
def _only_when_asked(request):
    if not _asked(request.config):
        pytest.skip("multi-host tests are slow: run them with PPO_FAST_MULTIHOST=1 or -m multihost")
    reason = _why_not()
    if reason:
        pytest.skip(reason)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


_made = itertools.count()


class Hosts:
    """``count`` namespaces on one bridge; node i is ``self.names[i]`` at ``10.77.0.{i+1}``, its link
    on the host side is ``self.links[i]``."""

    def __init__(self, count: int):
        tag = (
            f"{os.getpid() % 100000}{next(_made) % 100}"  # unique: a deleted namespace lingers while its processes exit
        )
        self.bridge = f"pfbr{tag}"
        self.names = [f"pf{tag}n{i}" for i in range(count)]
        self.links = [f"pf{tag}h{i}" for i in range(count)]
        self.procs: list[subprocess.Popen] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, (ns, link) in enumerate(zip(self.names, self.links)):
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", f"pf{tag}p{i}", "netns", ns)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("-n", ns, "link", "set", f"pf{tag}p{i}", "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def torchrun(
        self, node: int, nodes: int, out: Path, *args: str, restarts: int = 0, env: dict | None = None
    ) -> subprocess.Popen:
        """``torchrun`` on node ``node`` of ``nodes`` (the store on node 0), in its own process group."""
        command = [
            *f"ip netns exec {self.names[node]}".split(),
            *f"{sys.executable} -m torch.distributed.run --nnodes {nodes} --node-rank {node} --nproc-per-node 1".split(),
            *f"--rdzv-backend c10d --rdzv-endpoint 10.77.0.1:{PORT} --rdzv-id {out.name}".split(),
            *f"--local-addr 10.77.0.{node + 1}".split(),
            *(["--rdzv-conf", "is_host=1" if node == 0 else "is_host=0"]),
            *f"--max-restarts {restarts}".split(),
            *args,
        ]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
        log = open(out.parent / f"{out.name}-node{node}.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        proc.log_path = Path(log.name)
        self.procs.append(proc)
        return proc

    def train(self, nodes: int, out: Path, *args: str, restarts: int = 0, env: dict | None = None) -> list:
        """``ppo-fast train`` on every node; ``env[i]``: node i's extra environment."""
        command = ("-m", "ppo_fast", "train", "--output-dir", str(out), *args)
        return [self.torchrun(i, nodes, out, *command, restarts=restarts, env=(env or {}).get(i)) for i in range(nodes)]

    def kill(self, node: int) -> None:
        """Every process of node ``node`` (torchrun starts its workers in sessions of their own)."""
        pids = subprocess.run(["ip", "netns", "pids", self.names[node]], capture_output=True, text=True).stdout
        for pid in pids.split():
            with _quietly():
                os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        for node in range(len(self.names)):
            self.kill(node)
        for proc in self.procs:
            with _quietly():
                os.killpg(proc.pid, signal.SIGKILL)
            with _quietly():
                proc.wait(timeout=30)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class _quietly:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (OSError, subprocess.TimeoutExpired))


@pytest.fixture
def hosts(request):
    made = []

    def make(count: int) -> Hosts:
        made.append(Hosts(count))
        return made[-1]

    request.addfinalizer(lambda: [h.close() for h in made])
    return make


def _log(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text()


def _wait(procs: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return [_log(p) for p in procs]


def _run(procs: list[subprocess.Popen]) -> list[str]:
    logs = _wait(procs)
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(logs)
    return logs


def _wait_for_checkpoint(out: Path, step: int, procs: list[subprocess.Popen], timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout

    def reached() -> bool:
        saved = checkpoint.latest(out)
        return saved is not None and int(saved.name.removeprefix("step-")) >= step

    while not reached():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "\n".join(map(_log, procs))
        time.sleep(0.2)


def test_one_update_at_two_nodes_equals_one_process_and_the_prompt_shards_cover_the_list_once(hosts, tmp_path):
    seed = torch.randint(1000, ()).item()
    net = hosts(2)
    out = tmp_path / "two-nodes.pt"
    _run([net.torchrun(i, 2, tmp_path / "equal", "tests/dist_workers.py", str(out), str(seed)) for i in range(2)])
    saved = torch.load(out, weights_only=True)
    _assert_equal_to_one_process(saved["results"], seed)
    shards = saved["shards"]
    assert len(shards) == 2 and all(shards)
    assert sorted(i for shard in shards for i in shard) == list(range(saved["count"]))  # each prompt once


def _assert_equal_to_one_process(results: dict, seed: int) -> None:
    for (mode, agg), got in results.items():
        want = dist_workers.reference_update(seed, agg)
        where = f"{mode}, {agg}"
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), where
        torch.testing.assert_close(got["advantages"], want["advantages"], msg=lambda m: f"{where}: advantages: {m}")
        assert got["weights"].keys() == want["weights"].keys()
        for name in want["weights"]:
            for kind in ("grads", "weights"):
                torch.testing.assert_close(
                    got[kind][name],
                    want[kind][name],
                    rtol=1e-4,
                    atol=1e-6,
                    msg=lambda m: f"{where}: {kind} {name}: {m}",
                )
        assert any(g.abs().sum() > 0 for g in want["grads"].values())


def test_fsdp_checkpoints_written_at_two_nodes_resume_at_one_and_at_three(hosts, tmp_path):
    net = hosts(3)
    out = tmp_path / "fsdp"
    logs = _run(net.train(2, out, "--steps", "2", "--parallel", "fsdp", *TINY))
    rows = read_metrics(out / METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["episode"] == 2 * 6  # rank 0 alone writes the metrics
    assert "".join(logs).count("saved ") == 1  # rank 0 alone speaks and saves the whole model
    saved = checkpoint.latest(out)
    assert saved.name == "step-000002" and checkpoint.load_state(saved).world_size == 2
    assert sorted(p.name for p in (saved / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for world in (1, 3):
        again = tmp_path / f"resume-at-{world}"
        shutil.copytree(out, again)
        resume = ("--resume", "--steps", "3", "--parallel", "fsdp", *TINY)
        if world == 1:
            one = subprocess.run(
                [sys.executable, "-m", "ppo_fast", "train", "--output-dir", str(again), *resume],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=400,
            )
            assert one.returncode == 0, one.stdout + one.stderr
            said = one.stdout + one.stderr
        else:
            said = "".join(_run(net.train(3, again, *resume)))
        assert "saved by 2 process(es), this run has " + str(world) in said, said
        assert "resumed from" in said and "step 2)" in said
        assert [r["step"] for r in read_metrics(again / METRICS_FILE)] == [1, 2, 3]
        state = checkpoint.load_state(checkpoint.latest(again))
        assert state.step == 3 and state.world_size == world


def _assert_survivor_stopped(survivor: subprocess.Popen, out: Path, started: float, timeout: int) -> None:
    survivor.wait(timeout=timeout + 60)
    log = _log(survivor)
    assert survivor.returncode != 0, log
    errors = [line for line in log.splitlines() if line.startswith("ppo-fast: error: ")]
    assert len(errors) == 1, log
    named = re.search(r"error: rank (\d): another rank stopped answering: rank (\d) at 10\.77\.0\.2 is lost", errors[0])
    assert named and named[1] != named[2], errors[0]  # node 1's rank, by its address
    assert time.monotonic() - started < timeout + 60
    last = checkpoint.latest(out)  # the last complete checkpoint, whole and loadable
    state = checkpoint.load_state(last)
    assert state.step >= 1 and last.name == f"step-{state.step:06d}"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(last / "policy")


@pytest.mark.parametrize("fault", ["killed", "link cut"])
def test_a_lost_node_ends_the_survivor_with_one_line_and_keeps_the_last_checkpoint(hosts, tmp_path, fault):
    net = hosts(2)
    out = tmp_path / "run"
    timeout = 20
    procs = net.train(2, out, "--steps", "500", "--save-every", "1", "--dist-timeout", str(timeout), *TINY)
    _wait_for_checkpoint(out, 1, procs)
    started = time.monotonic()
    if fault == "killed":
        net.kill(1)
    else:
        _ip("link", "set", net.links[1], "down")
    _assert_survivor_stopped(procs[0], out, started, timeout)


def test_max_restarts_restarts_the_group_and_the_run_continues_from_its_checkpoint(hosts, tmp_path):
    net = hosts(2)
    out, held = tmp_path / "run", tmp_path / "held"
    hold = {1: {"PPO_FAST_TEST_HOLD": f"2:{held}"}}  # node 1's rank stops after step 2, until killed (once)
    procs = net.train(2, out, "--steps", "4", "--save-every", "1", "--dist-timeout", "30", *TINY, restarts=1, env=hold)
    _wait_for_checkpoint(out, 2, procs)
    deadline = time.monotonic() + 400
    while not held.exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "\n".join(map(_log, procs))
        time.sleep(0.2)
    worker = subprocess.run(["pgrep", "-P", str(procs[1].pid)], capture_output=True, text=True).stdout.split()
    assert len(worker) == 1, worker  # node 1's one training process, under its torchrun agent
    os.kill(int(worker[0]), signal.SIGKILL)
    logs = _run(procs)
    said = "".join(logs)
    assert "torchrun restart: continuing the run this job started in" in said, said
    assert "resumed from" in said
    steps = [r["step"] for r in read_metrics(out / METRICS_FILE)]
    assert steps == [1, 2, 3, 4], steps  # the resumed run continues the metrics, each step once
    assert checkpoint.load_state(checkpoint.latest(out)).step == 4


@pytest.mark.parametrize(
    "shaping", ["netem delay 50ms loss 1%", "tbf rate 8mbit burst 32kbit latency 400ms"], ids=["netem", "tbf"]
)
def test_a_slow_link_changes_no_result(hosts, tmp_path, shaping):
    """Node 1's link delayed and lossy (netem), or narrow (tbf): the same update as one process."""
    seed = torch.randint(1000, ()).item()
    net = hosts(2)
    shaped = subprocess.run(["tc", "qdisc", "add", "dev", net.links[1], "root", *shaping.split()], capture_output=True)
    if b"qdisc kind is unknown" in shaped.stderr:
        pytest.skip(f"this kernel has no {shaping.split()[0]} qdisc (sch_{shaping.split()[0]})")
    assert shaped.returncode == 0, shaped.stderr
    out = tmp_path / "slow.pt"
    _run([net.torchrun(i, 2, tmp_path / "slow", "tests/dist_workers.py", str(out), str(seed)) for i in range(2)])
    _assert_equal_to_one_process(torch.load(out, weights_only=True)["results"], seed)
