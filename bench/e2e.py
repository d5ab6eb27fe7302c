"""End to end: one PPO iteration of ``ppo_fast.trainer`` with ``auto`` ops against ``reference`` ops.

Both runs build the same model (the built-in addition task's small GPT-2, randomly
initialised: no warm-up, no downloads) from the same seed and sample the same prompts.
A first iteration warms up (kernel compilation, autotuning, allocator), the second is
timed; its per-phase wall times and response tokens/s come from the trainer's own metrics.
"""

from __future__ import annotations

import importlib.util
import tempfile

import torch

import ppo_fast as pf

BACKENDS_COMPARED = ("reference", "auto")


def _sizes(device: torch.device, quick: bool) -> dict:
    if quick:
        return {"batch_size": 8, "response_length": 4, "num_ppo_epochs": 1, "num_mini_batches": 1}
    return {
        "batch_size": 512 if device.type == "cuda" else 64,
        "response_length": 8,
        "num_ppo_epochs": 2,
        "num_mini_batches": 2,
    }


def _timed_iteration(backend: str, device: torch.device, sizes: dict) -> dict:
    from ppo_fast.trainer import PPOTrainer, TrainerConfig, default_task

    with tempfile.TemporaryDirectory(prefix="ppo_fast_bench_") as out_dir:
        cfg = TrainerConfig(
            output_dir=out_dir, steps=2, device=device.type, backend=backend, sample_every=0, save_every=0, **sizes
        )
        tokenizer = default_task.build_tokenizer()
        trainer = PPOTrainer(
            cfg,
            policy=default_task.build_model(tokenizer, cfg.seed),
            tokenizer=tokenizer,
            reward_fn=default_task.addition_reward,
            prompts=default_task.prompts(cfg)[0],
            log=lambda message: None,
        )
        with pf.use_backend(backend):
            trainer.train_step()  # warm-up
            row = trainer.train_step()
    phases = {key.removeprefix("time/"): value for key, value in row.items() if key.startswith("time/")}
    return {"phase_s": phases, "tokens_per_s": row["throughput/tokens_per_s"]}


def run_e2e(device: torch.device, quick: bool) -> dict:
    if importlib.util.find_spec("ppo_fast.trainer") is None:
        return {"skipped": "ppo_fast.trainer is not in this checkout"}
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers is not installed (the trainer's models need it)"}
    sizes = _sizes(device, quick)
    description = (
        "one PPO iteration (GAE, separate critic) of the built-in task's GPT-2 (random init), "
        + ", ".join(f"{k}={v}" for k, v in sizes.items())
        + "; second of two iterations timed"
    )
    try:
        runs = {backend: _timed_iteration(backend, device, sizes) for backend in BACKENDS_COMPARED}
    except Exception as err:  # reported, and fails the run, but the op results are kept
        return {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300], "description": description}
    return {"description": description, "runs": runs}


def main(argv=None) -> int:
    """``python -m bench e2e``: the end-to-end iteration alone (``python -m bench ops`` runs it with the ops)."""
    import argparse
    import os

    from .common import command_line, machine, versions, write_json

    parser = argparse.ArgumentParser(prog="python -m bench e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny batch: a smoke run")
    parser.add_argument("--out", default=None, help="folder for e2e-<device>.json (not written without it)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = {
        "command": command_line("e2e", argv),
        "machine": machine(device),
        "versions": versions(),
        "e2e": run_e2e(device, quick=args.quick),
    }
    for backend, run in result["e2e"].get("runs", {}).items():
        print(
            f"{backend:10s} {run['tokens_per_s']:10.1f} tokens/s  "
            + " ".join(f"{k}={v:.3g}s" for k, v in run["phase_s"].items())
        )
    print(result["e2e"].get("error") or result["e2e"].get("skipped") or result["e2e"]["description"])
    if args.out:
        write_json(os.path.join(args.out, f"e2e-{device.type}{'-quick' if args.quick else ''}.json"), result)
    return 1 if result["e2e"].get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
