"""Asynchronous rollouts (``--max-staleness``) against the synchronous loop: the built-in job's wall-clock
steps per second and held-out accuracy, over seeds.

Each set-up runs ``ppo-fast train``'s built-in job (its defaults, or ``--steps``) once per seed:

- ``sync_t1`` and ``sync_t2``: the synchronous loop (``--max-staleness 0``) on 1 and 2 torch threads;
- ``async_k1_t1``: a producer process and the trainer, 1 torch thread each (``--max-staleness 1``);
- ``async_k1_t2``: the same on 2 threads each (oversubscribed on 2 cores: measured, not assumed).

``--model llama``: a randomly initialised Llama-shaped policy (4 layers, width 256) on the same prompts and
reward, GRPO with one pass per batch and 32-token responses: a job where generation weighs more.  Its
accuracy means nothing (a random model learns nothing in 20 steps); its steps per second do.

The steps per second are counted over the PPO steps themselves (the sum of ``time/step``: generation,
scoring, update and, when async, the wait for the producer's batch), from the second step on (the first
waits for the producer process to start); the held-out evaluations and the warm-up are left out, and
``train_seconds`` is the whole ``train()`` with them.  The seed's warm-up model is made once and copied into the other set-ups' folders.
The async metrics' means (age, idle fractions) say where the time went.  Labelled with the machine and
its load; a busy machine slows the two processes unevenly, so measure on a quiet one.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from .common import result_header, write_json

SETUPS = {
    "sync_t1": dict(max_staleness=0, cpu_threads=1),
    "sync_t2": dict(max_staleness=0, cpu_threads=2),
    "async_k1_t1": dict(max_staleness=1, cpu_threads=1),
    "async_k1_t2": dict(max_staleness=1, cpu_threads=2),
}
DEFAULT_SETUPS = tuple(SETUPS)
# The loss under staleness (--setups k2_naive,k2_bypass_tis,...): naive PPO on the stale batch (the engine's
# log-probs as pi_old, no weights), bypass with token-level TIS, decoupled (pi_prox recomputed) without and
# with TIS (AReaL's decoupled PPO), at 2 and 4 updates of staleness.
CORRECTIONS = {
    "naive": dict(off_policy_loss="bypass"),
    "bypass_tis": dict(off_policy_loss="bypass", rollout_correction="token_tis"),
    "decoupled": dict(off_policy_loss="decoupled"),
    "decoupled_tis": dict(off_policy_loss="decoupled", rollout_correction="token_tis"),
}
# Partial rollouts (--setups async_k2_t1,async_k2_partial16_t1): rounds of 16 tokens, at the same bound.
SETUPS |= {
    "async_k2_t1": dict(max_staleness=2, cpu_threads=1),
    "async_k2_partial16_t1": dict(max_staleness=2, cpu_threads=1, partial_rollouts=16),
}
# The vLLM-CPU engine (--model llama: vLLM's CPU attention takes no head size below 32; run with the vLLM venv
# of .ci/vllm.sh): in the trainer's process, and in the producer's at one update of staleness.
SETUPS |= {
    "sync_vllm_t1": dict(max_staleness=0, cpu_threads=1, rollout_engine="vllm"),
    "async_k1_vllm_t1": dict(max_staleness=1, cpu_threads=1, rollout_engine="vllm"),
}
SETUPS |= {
    f"k{k}_{name}": dict(max_staleness=k, cpu_threads=1, **loss) for k in (2, 4) for name, loss in CORRECTIONS.items()
}
# The weights broadcast to the producer (--weight-transfer broadcast, gloo here) against the staging copy.
SETUPS["async_k1_broadcast_t1"] = dict(max_staleness=1, cpu_threads=1, weight_transfer="broadcast")
QUICK = dict(steps=3, sft_steps=10, eval_size=16, batch_size=8)
# --model llama: a randomly initialised Llama-shaped policy on the built-in prompts and reward, GRPO with one
# pass over each batch and long responses (a random model seldom stops): a job where generation weighs.
LLAMA_SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4)
LLAMA = dict(steps=20, response_length=32, advantage_method="grpo", group_size=4, batch_size=8)
LLAMA |= dict(num_ppo_epochs=1, num_mini_batches=1, eval_every=0)


def llama_job(seed: int) -> dict:
    """The policy, tokenizer, prompts and reward of ``--model llama`` (PPOTrainer's keyword arguments)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppo_fast.trainer import TrainerConfig, default_task

    tokenizer = default_task.build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        **LLAMA_SHAPE,
        num_key_value_heads=LLAMA_SHAPE["num_attention_heads"],
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    train, held_out = default_task.prompts(TrainerConfig(eval_size=32, seed=seed))
    return dict(
        policy=LlamaForCausalLM(config),
        tokenizer=tokenizer,
        prompts=train,
        eval_prompts=held_out,
        reward_fn=default_task.addition_reward,
    )


MODELS = {
    "builtin": "The built-in job (its defaults)",
    "llama": "A random Llama-shaped policy, GRPO, 32-token responses (speed only: it learns nothing in 20 steps)",
}
ASYNC_KEYS = ("async/age", "async/producer_idle_frac", "async/trainer_idle_frac", "async/groups_dropped")
ASYNC_KEYS += ("async/partial_rounds", "async/partial_continued", "async/partial_dropped")


def one_run(root: Path, setup: str, seed: int, options: dict, model: str = "builtin") -> dict:
    """One built-in run; its steps/s over the PPO steps, wall time, held-out accuracy and async means."""
    from ppo_fast.trainer import PPOTrainer, TrainerConfig
    from ppo_fast.trainer.metrics import METRICS_FILE, read_metrics

    out = root / f"{setup}-seed{seed}"
    warmup = root / f"warmup-seed{seed}"
    if warmup.exists():
        shutil.copytree(warmup, out / "warmup")
    cfg = TrainerConfig(output_dir=str(out), seed=seed, **{**SETUPS[setup], **options})
    given = llama_job(seed) if model == "llama" else {}
    trainer = PPOTrainer(cfg, log=lambda message: None, **given)
    start = time.perf_counter()
    summary = trainer.train()
    seconds = time.perf_counter() - start
    if not warmup.exists() and model == "builtin":
        shutil.copytree(out / "warmup", warmup)
    rows = read_metrics(out / METRICS_FILE)
    steady = rows[1:] or rows  # the first step waits for the producer process to start (in train_seconds)
    result = {
        "seed": seed,
        "steps": len(rows),
        "steps_per_s": len(steady) / sum(row["time/step"] for row in steady),
        # Synchronous: generation and reward's share of a step (overlap saves at most this); async: the wait.
        "rollout_share": sum(row["time/rollout"] for row in steady) / sum(row["time/step"] for row in steady),
        "train_seconds": seconds,
        "before": summary["eval_before"],
        "after": summary["eval_after"],
        "eval_curve": [[row["step"], row["eval/score"]] for row in rows if "eval/score" in row],
    }
    phases = sorted({key for row in steady for key in row if key.startswith("time/") and key != "time/step"})
    result["phase_seconds"] = {key: statistics.fmean(row.get(key, 0.0) for row in steady) for key in phases}
    for key in ASYNC_KEYS:
        if key in rows[0]:
            result[key.removeprefix("async/")] = statistics.fmean(row[key] for row in rows)
    torch.set_num_threads(1)  # the next set-up sets its own
    return result


def trainer_options(text: str) -> dict:
    """``name=value,...`` as TrainerConfig values (typed and checked as a config file's)."""
    from ppo_fast.trainer import TrainerConfig

    pairs = dict(item.split("=", 1) for item in text.split(",") if item.strip())
    cfg = TrainerConfig.from_dict(pairs, source="--options")
    return {name: getattr(cfg, name) for name in pairs}


def measure(setups: list[str], seeds: list[int], options: dict, model: str) -> dict:
    runs = {setup: [] for setup in setups}
    with tempfile.TemporaryDirectory(prefix="ppo_fast_bench_async_") as tmp:
        for seed in seeds:
            for setup in setups:
                row = one_run(Path(tmp), setup, seed, options, model)
                runs[setup].append(row)
                print(setup, row, flush=True)
    means = {
        setup: {
            key: statistics.fmean(r[key] for r in rows)
            for key in rows[0]
            if key not in ("seed", "phase_seconds", "eval_curve")
        }
        for setup, rows in runs.items()
    }
    base = means[setups[0]]["steps_per_s"]
    for setup in setups:
        means[setup]["speedup_vs_" + setups[0]] = means[setup]["steps_per_s"] / base
        values = [r["steps_per_s"] for r in runs[setup]]
        means[setup]["steps_per_s_spread"] = [min(values), max(values)]
    return {"runs": runs, "means": means, "options": options, "model": model}


def markdown(data: dict) -> str:
    """The result's table: per set-up, steps/s (mean, min-max over seeds), the speed-up and the accuracy."""
    res = data["result"]
    first = next(iter(res["means"]))
    lines = [
        f"{MODELS[res.get('model', 'builtin')]}, {len(res['runs'][first])} seed(s), options {res['options'] or 'the defaults'}; "
        f"{data['machine'].get('cpu', '')}, load average "
        + ", ".join(f"{v:.1f}" for v in data["machine"].get("load_average", ()))
        + ".",
        "",
        f"| set-up | steps/s | min-max | vs {first} | held-out before | after | time/rollout share | age | "
        "producer idle | trainer idle | weight sync ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for setup, m in res["means"].items():
        low, high = m["steps_per_s_spread"]
        extra = " | ".join(f"{m[k]:.2f}" if k in m else "-" for k in ("age", "producer_idle_frac", "trainer_idle_frac"))
        lines.append(
            f"| {setup} | {m['steps_per_s']:.3f} | {low:.3f}-{high:.3f} | {m['speedup_vs_' + first]:.2f}x | "
            f"{m['before']:.3f} | {m['after']:.3f} | {m['rollout_share']:.2f} | {extra} | "
            f"{_weight_sync_ms(res['runs'][setup])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench async", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps of a tiny warm-up, 1 seed (a smoke test)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--model", choices=tuple(MODELS), default="builtin", help="; ".join(MODELS.values()))
    parser.add_argument(
        "--setups", default=",".join(DEFAULT_SETUPS), help=f"of {', '.join(SETUPS)}; the first is the base"
    )
    parser.add_argument("--steps", type=int, default=None, help="PPO steps (default: the built-in job's)")
    parser.add_argument(
        "--options", default="", help="trainer options for every set-up, e.g. num_ppo_epochs=1,response_length=8"
    )
    parser.add_argument("--out", default="bench_out/async-cpu.json", help="the JSON; the .md table beside it")
    args = parser.parse_args(argv)
    setups = args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"--setups: unknown {', '.join(unknown)}; choose of {', '.join(SETUPS)}")
    seeds = [int(s) for s in args.seeds.split(",")][: 1 if args.quick else None]
    options = dict(LLAMA) if args.model == "llama" else {}
    options |= QUICK if args.quick else {}
    if args.steps:
        options["steps"] = args.steps
    options |= trainer_options(args.options)
    data = result_header("async", argv, torch.device("cpu"))
    data["result"] = measure(setups, seeds, options, args.model)
    write_json(args.out, data)
    Path(args.out).with_suffix(".md").write_text(markdown(data))
    print(markdown(data))
    return 0


def _weight_sync_ms(runs: list[dict]) -> str:
    """The trainer's ``time/weight_sync`` a step, in ms, over the set-up's runs (min-max); "-" where none."""
    seen = [
        r["phase_seconds"]["time/weight_sync"] * 1e3 for r in runs if "time/weight_sync" in r.get("phase_seconds", {})
    ]
    return f"{min(seen):.1f}-{max(seen):.1f}" if seen else "-"
