"""``python -m bench peers``: each peer's own installed function against the same function patched
by ``ppo_fast.integrations.<peer>.patch()``, in one run, on the same inputs.

    python -m bench peers --device cpu             # the shapes below
    python -m bench peers --quick                  # tiny shapes: a smoke run
    python -m bench peers --out bench/results      # writes peers-<device>.json

The "theirs" timing is the peer's function as its users call it (taken before patching);
"ours" is the very same call after ``patch(backend="auto")``.  The two are timed in
alternation, three rounds, and each keeps its fastest call (robust to other jobs on a shared
machine, which only ever add time).  Each pair is first checked
to agree (per-dtype tolerance; bf16 peers compute the log-softmax in bf16).  Peers that are
not installed are listed as skipped.  OpenRLHF is not measured: its modules import its GPU
stack (flash-attn, DeepSpeed, vLLM).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import ppo_fast as pf

from .common import ROUNDS, best_ms, command_line, machine, write_json

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@dataclass
class PeerCase:
    peer: str
    function: str  # as the peer names it
    shape: str
    make: Callable[[], dict]  # inputs
    call: Callable[[object, dict], object]  # (the peer's module or function holder, inputs) -> output
    holder: Callable[[], object]  # the module whose attribute is patched
    grad: str | None = None  # input differentiated in fwd+bwd
    atol: float = 1e-4
    rtol: float = 1e-4
    compare_mask: str | None = None  # outputs compared where this input is 1 (verl leaves values at masked positions)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _mask(b, t, gaps=False):
    lengths = torch.randint(max(1, t // 4), t + 1, (b, 1))
    m = (torch.arange(t) < lengths).float()
    if gaps:
        m = m * (torch.rand(b, t) > 0.1).float()
    return m


def _verl_config():
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )


def _cases(quick: bool) -> list[PeerCase]:
    return _logprob_cases(quick) + _rl_cases(quick) + _grpo_cases(quick)


def _trl_utils():
    return importlib.import_module("trl.trainer.utils")


def _verl_functional():
    return importlib.import_module("verl.utils.torch_functional")


def _core():
    return importlib.import_module("verl.trainer.ppo.core_algos")


def _logprob_cases(quick: bool) -> list[PeerCase]:
    """Log-probs from logits (TRL, verl) and TRL's fused LM head."""
    n, v = (256, 4096) if quick else (2048, 32000)
    head = (256, 64, 4096) if quick else (2048, 256, 32000)
    trl_utils, verl_f = _trl_utils, _verl_functional
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).replace("torch.", "")
        tol = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}

        def logits_inputs(dtype=dtype):
            b = 4
            return {"logits": (torch.randn(b, n // b, v) * 2).to(dtype), "labels": torch.randint(0, v, (b, n // b))}

        cases.append(
            PeerCase(
                "trl",
                "selective_log_softmax",
                f"N={n} V={v} {dname} T=0.7",
                logits_inputs,
                lambda m, x: m.selective_log_softmax(x["logits"], x["labels"], temperature=0.7),
                trl_utils,
                grad="logits",
                **tol,
            )
        )
        cases.append(
            PeerCase(
                "verl",
                "logprobs_from_logits",
                f"N={n} V={v} {dname}",
                logits_inputs,
                lambda m, x: m.logprobs_from_logits(x["logits"], x["labels"]),
                verl_f,
                grad="logits",
                **tol,
            )
        )
    hn, hh, hv = head

    def head_inputs():
        return {
            "hidden": torch.randn(hn, hh),
            "weight": torch.randn(hv, hh) * 0.05,
            "targets": torch.randint(0, hv, (hn,)),
        }

    cases.append(
        PeerCase(
            "trl",
            "fused LM head (ChunkedLogProbFunction)",
            f"N={hn} H={hh} V={hv}",
            head_inputs,
            lambda m, x: m._ChunkedLogProbFunction.apply(
                x["hidden"], x["weight"], None, x["targets"], 1.0, 4096, None, 1.0, ("log_probs", "entropy")
            ),
            trl_utils,
            grad="hidden",
        )
    )
    return cases


def _rl_cases(quick: bool) -> list[PeerCase]:
    """GAE, the PPO losses, the KL penalty and GRPO's advantages (verl)."""
    seq = [(8, 512)] if quick else [(256, 1024), (16, 4096)]
    loss_bt = (4, 1024) if quick else (64, 4096)
    core = _core
    cases = []
    for b, t in seq:

        def gae_inputs(b=b, t=t):
            m = _mask(b, t, gaps=True)
            return {"rewards": torch.randn(b, t) * m, "values": torch.randn(b, t), "mask": m}

        cases.append(
            PeerCase(
                "verl",
                "compute_gae_advantage_return",
                f"B={b} T={t}",
                gae_inputs,
                lambda m, x: m.compute_gae_advantage_return(x["rewards"], x["values"], x["mask"], 1.0, 0.95),
                core,
                compare_mask="mask",
            )
        )
    lb, lt = loss_bt

    def loss_inputs():
        m = _mask(lb, lt)
        old = -torch.rand(lb, lt) * 3
        return {
            "old": old,
            "logp": old + 0.1 * torch.randn(lb, lt),
            "adv": torch.randn(lb, lt),
            "mask": m,
            "values": torch.randn(lb, lt),
            "returns": torch.randn(lb, lt),
            "vpreds": torch.randn(lb, lt),
            "config": _verl_config(),
        }

    cases.append(
        PeerCase(
            "verl",
            "compute_policy_loss_vanilla",
            f"N={lb * lt} (B={lb} T={lt})",
            loss_inputs,
            lambda m, x: m.compute_policy_loss_vanilla(
                x["old"], x["logp"], x["adv"], x["mask"], "token-mean", x["config"]
            ),
            core,
            grad="logp",
        )
    )
    cases.append(
        PeerCase(
            "verl",
            "compute_value_loss",
            f"N={lb * lt} (B={lb} T={lt})",
            loss_inputs,
            lambda m, x: m.compute_value_loss(x["vpreds"], x["returns"], x["values"], x["mask"], 0.2),
            core,
            grad="vpreds",
        )
    )
    cases.append(
        PeerCase(
            "verl",
            "kl_penalty (low_var_kl)",
            f"N={lb * lt} (B={lb} T={lt})",
            loss_inputs,
            lambda m, x: m.kl_penalty(x["logp"], x["old"], "low_var_kl"),
            core,
            grad="logp",
        )
    )
    return cases


def _grpo_cases(quick: bool) -> list[PeerCase]:
    grpo = (64, 128, 8) if quick else (512, 1024, 64)
    core = _core
    cases = []
    gb, gt, groups = grpo

    def grpo_inputs():
        m = _mask(gb, gt)
        return {"rewards": torch.randn(gb, gt) * m, "mask": m, "index": np.repeat(np.arange(groups), gb // groups)}

    cases.append(
        PeerCase(
            "verl",
            "compute_grpo_outcome_advantage",
            f"B={gb} T={gt} groups={groups}",
            grpo_inputs,
            lambda m, x: m.compute_grpo_outcome_advantage(x["rewards"], x["mask"], x["index"]),
            core,
        )
    )
    return cases


def _run(fn: Callable[[], object], inputs: dict, grad: str | None, mode: str) -> Callable[[], object]:
    if mode == "fwd":

        def forward():
            with torch.no_grad():
                return fn()

        return forward
    leaf = inputs[grad]

    def forward_backward():
        leaf.grad = None
        out = _first(fn())
        out.float().sum().backward()
        return out

    return forward_backward


def measure_case(case: PeerCase, min_run_time: float) -> list[dict]:
    adapter = importlib.import_module(f"ppo_fast.integrations.{case.peer}")
    adapter.unpatch()
    holder = case.holder()
    # "theirs": the peer's function objects, bound now (before patching) into a frozen namespace.
    names = {
        "selective_log_softmax",
        "logprobs_from_logits",
        "_ChunkedLogProbFunction",
        "compute_gae_advantage_return",
        "compute_policy_loss_vanilla",
        "compute_value_loss",
        "kl_penalty",
        "compute_grpo_outcome_advantage",
    }
    theirs = type(
        "Theirs",
        (),
        {
            k: staticmethod(getattr(holder, k))
            if callable(getattr(holder, k)) and not isinstance(getattr(holder, k), type)
            else getattr(holder, k)
            for k in names
            if hasattr(holder, k)
        },
    )
    inputs = case.make()
    rows = []
    modes = ("fwd", "fwd+bwd") if case.grad else ("fwd",)
    for mode in modes:
        if case.grad:
            inputs[case.grad].requires_grad_(mode != "fwd")
        row = {"peer": case.peer, "function": case.function, "shape": case.shape, "mode": mode}
        try:
            their_run = _run(lambda: case.call(theirs, inputs), inputs, case.grad, mode)
            want = _first(their_run()).detach().float()
            with adapter.patch(backend="auto"):
                our_run = _run(lambda: case.call(holder, inputs), inputs, case.grad, mode)
                got = _first(our_run()).detach().float()
                if case.compare_mask:
                    got, want = got * inputs[case.compare_mask], want * inputs[case.compare_mask]
                err = (got - want).abs()
                ok = bool((err <= case.atol + case.rtol * want.abs()).all())
                row["max_abs_diff"] = float(err.max()) if err.numel() else 0.0
                if not ok:
                    row["status"] = "mismatch"
                    rows.append(row)
                    continue
            # Alternate the two, ROUNDS times, and keep each one's best call: on a shared
            # machine other jobs only ever add time, so the minimum is the least disturbed.
            theirs_ms, ours_ms = [], []
            for _ in range(ROUNDS):
                theirs_ms.append(best_ms(their_run, min_run_time))
                with adapter.patch(backend="auto"):
                    ours_ms.append(best_ms(our_run, min_run_time))
            row.update(
                status="ok",
                theirs_ms=min(theirs_ms),
                ours_ms=min(ours_ms),
                rounds=ROUNDS,
                speedup=min(theirs_ms) / min(ours_ms),
            )
        except Exception as err:  # reported, never hidden
            row.update(status="error", detail=f"{type(err).__name__}: {err}".splitlines()[0][:300])
        finally:
            adapter.unpatch()
            if case.grad:
                inputs[case.grad].grad = None
        print(
            f"  {case.peer:5s} {case.function:40s} {case.shape:28s} {mode:8s} "
            + (
                f"theirs {row['theirs_ms']:.4g} ms, ours {row['ours_ms']:.4g} ms, {row['speedup']:.2f}x"
                if row.get("status") == "ok"
                else f"{row['status'].upper()} {row.get('detail', row.get('max_abs_diff', ''))}"
            ),
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    return rows


def markdown(results: dict) -> str:
    lines = [
        "| peer | function | shape | mode | peer's own ms (best) | patched (ppo_fast) ms (best) | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if r["status"] == "ok":
            lines.append(
                f"| {r['peer']} {results['versions'].get(r['peer'], '')} | `{r['function']}` | {r['shape']} | {r['mode']} "
                f"| {r['theirs_ms']:.4g} | {r['ours_ms']:.4g} | {r['speedup']:.2f}x |"
            )
        else:
            lines.append(f"| {r['peer']} | `{r['function']}` | {r['shape']} | {r['mode']} | {r['status']} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu",), default="cpu", help="CPU only for now")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="folder for peers-<device>.json")
    parser.add_argument("--peers", default="trl,verl")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    versions, skipped = {}, {}
    for peer in args.peers.split(","):
        try:
            versions[peer] = importlib.import_module(f"ppo_fast.integrations.{peer}")._patching.peer_version(peer)
        except Exception:
            versions[peer] = None
        if versions[peer] is None:
            skipped[peer] = "not installed"
    rows = []
    for case in _cases(args.quick):
        if case.peer in skipped or case.peer not in versions:
            continue
        rows += measure_case(case, 0.05 if args.quick else 0.5)
    results = {
        "command": command_line("peers", argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(torch.device("cpu")),
        "versions": {
            **{k: v for k, v in versions.items() if v},
            "torch": torch.__version__,
            "ppo_fast": pf.__version__,
            "python": platform.python_version(),
        },
        "auto": {
            op: __import__("ppo_fast.backends", fromlist=["x"]).resolved_backend_name(op, "cpu")
            for op in ("token_logprobs", "gae", "kl_estimate", "clipped_policy_loss", "value_loss")
        },
        "skipped": skipped,
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(markdown(results))
    if args.out:
        write_json(os.path.join(args.out, f"peers-{args.device}{'-quick' if args.quick else ''}.json"), results)
    bad = [r for r in rows if r["status"] != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
