"""LoRA (``--lora-r``) against full fine-tuning: the update phase's memory on a Llama-shaped model,
and the built-in job's held-out accuracy over seeds.

``memory``: one process, three set-ups of the same randomly initialised Llama-shaped policy (GRPO,
no critic), each measured over building what the set-up adds to the loaded policy (the
reference copy, the adapters, AdamW), scoring one batch of rollouts (old and reference log-probs)
and one PPO update (forward, backward, AdamW step): LoRA (the reference is the policy with its
adapters off), full fine-tuning with the reference copy the trainer keeps, and full
fine-tuning without any reference (a floor: what the reference copy adds).  Peak memory is the
process's peak-RSS rise on CPU (``bench.timing``), ``max_memory_allocated`` on CUDA; the bytes of
parameters, gradients and optimizer state are also counted from the tensors themselves.

``learning``: ``ppo-fast train``'s built-in job (the defaults) with ``--lora-r`` and without, for
each seed: the held-out greedy accuracy before and after PPO.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time

import torch

from .common import result_header, write_json
from .timing import memory_method, peak_extra_bytes

SETUPS = ("lora", "full_with_reference_copy", "full_without_reference")


def llama(quick: bool, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = (
        dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4, vocab_size=1024)
        if quick
        else dict(
            hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, vocab_size=32000
        )
    )
    config = LlamaConfig(**shape, num_key_value_heads=shape["num_attention_heads"], max_position_embeddings=256)
    return LlamaForCausalLM(config).float().eval().to(device), shape


def rollouts(vocab: int, rows: int, prompt: int, response: int, device: torch.device):
    from ppo_fast.trainer.rollout import Batch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[rows // 2 :, -response // 3 :] = False  # some responses end early
    return Batch(ids.to(device), mask.to(device), prompt)


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def one_setup(setup: str, policy, batch, lora_r: int) -> dict:
    """Build what ``setup`` adds to ``policy``, score ``batch`` and run one PPO update; the counted bytes."""
    from ppo_fast.trainer import TrainerConfig, lora
    from ppo_fast.trainer.estimate import EstimateOptions, estimate
    from ppo_fast.trainer.models import frozen_reference
    from ppo_fast.trainer.rollout import score_old_and_ref
    from ppo_fast.trainer.update import Experience, ppo_update

    cfg = TrainerConfig(advantage_method="grpo", group_size=2, num_mini_batches=1, num_ppo_epochs=1, lora_r=None)
    reference, scope, adapters = None, contextlib.nullcontext, None
    if setup == "lora":
        adapters = lora.attach(TrainerConfig(lora_r=lora_r, lora_alpha=2.0 * lora_r), policy)
        reference, scope = policy, adapters.disable_adapter
    elif setup == "full_with_reference_copy":
        reference = frozen_reference(policy)
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    rows = batch.input_ids.shape[0]
    old, ref, _ = score_old_and_ref(policy, reference or policy, None, batch, temperature=1.0, reference_scope=scope)
    if reference is None:
        ref = old  # no reference: the KL is 0 (the scoring pass above stands in for its cost)
    scores = torch.arange(rows, dtype=torch.float32, device=old.device) % 3
    options = EstimateOptions.of(cfg, kl_coef=0.05)
    est = estimate(scores, old, ref, None, batch.response_mask, options)
    stats = ppo_update(
        policy,
        None,
        optimizer,
        scheduler,
        Experience(batch=batch, old_logprobs=old, advantages=est.advantages, old_values=None, returns=None),
        cfg,
        step=1,
    )
    counted = {
        "policy_parameters": _bytes(policy.parameters()),
        "trainable_parameters": _bytes(params),
        "reference_own_parameters": 0 if reference in (None, policy) else _bytes(reference.parameters()),
        "gradients": _bytes(p.grad for p in params),
        "optimizer_state": _bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }
    if adapters is not None:
        adapters.unload()  # the policy without adapters, trainable, again for the next set-up
        policy.requires_grad_(True)
    return {"counted_bytes": counted, "ratio_dev_at_start": stats["policy/ratio_dev_at_start"]}


def memory(device: torch.device, quick: bool, lora_r: int) -> dict:
    policy, shape = llama(quick, device)
    batch = rollouts(shape["vocab_size"], 4 if quick else 8, 16 if quick else 64, 16 if quick else 128, device)
    # One untimed update first: the allocator's and MKL's workspaces are not charged to the first set-up.
    one_setup("full_without_reference", policy, batch, lora_r)
    policy.zero_grad(set_to_none=True)
    results = {}
    for setup in SETUPS:
        start = time.perf_counter()
        found = {}

        def run(setup=setup, found=found):
            found.update(one_setup(setup, policy, batch, lora_r))

        peak = peak_extra_bytes(run, device.type)
        policy.zero_grad(set_to_none=True)
        results[setup] = {"peak_extra_bytes": peak, "seconds": time.perf_counter() - start, **found}
        print(f"{setup}: peak extra {peak / 2**20:.0f} MiB, counted {found['counted_bytes']}", flush=True)
    full = results["full_with_reference_copy"]["peak_extra_bytes"]
    for row in results.values():
        row["peak_vs_full_with_reference_copy"] = row["peak_extra_bytes"] / full
    rows, length = batch.input_ids.shape
    return {
        "shape": shape,
        "parameters": sum(p.numel() for p in policy.parameters()),
        "batch": {"rows": rows, "tokens_per_row": length, "prompt": batch.prompt_width},
        "lora_r": lora_r,
        "setups": results,
        "memory_method": memory_method(device.type),
    }


def learning(seeds: list[int], lora_r: int, lora_lr: float, steps: int | None) -> dict:
    from ppo_fast.trainer import PPOTrainer, TrainerConfig

    runs = {"full": [], f"lora_r{lora_r}": []}
    for seed in seeds:
        for name, options in (("full", {}), (f"lora_r{lora_r}", dict(lora_r=lora_r, learning_rate=lora_lr))):
            with tempfile.TemporaryDirectory(prefix="ppo_fast_bench_lora_") as out:
                cfg = TrainerConfig(output_dir=out, seed=seed, **options, **({"steps": steps} if steps else {}))
                start = time.perf_counter()
                summary = PPOTrainer(cfg, log=lambda message: None).train()
                seconds = time.perf_counter() - start
            row = {"seed": seed, "before": summary["eval_before"], "after": summary["eval_after"], "seconds": seconds}
            runs[name].append(row)
            print(name, row, flush=True)
    means = {
        name: {key: sum(r[key] for r in rows) / len(rows) for key in ("before", "after", "seconds")}
        for name, rows in runs.items()
    }
    return {
        "runs": runs,
        "means": means,
        "lora_learning_rate": lora_lr,
        "full_learning_rate": TrainerConfig.learning_rate,
    }


def markdown(data: dict) -> str:
    """The tables of a result file: peak memory per set-up, accuracy per seed (whichever it holds)."""
    lines = []
    if "memory" in data:
        mem = data["memory"]
        shape = ", ".join(f"{k} {v}" for k, v in mem["shape"].items())
        lines += [
            f"Llama-shaped, {mem['parameters'] / 1e6:.0f}M parameters ({shape}), float32, "
            f"{mem['batch']['rows']} rows of {mem['batch']['tokens_per_row']} tokens, LoRA r={mem['lora_r']}:",
            "",
            "| set-up | peak extra MiB | vs full + reference copy | trainable MiB | reference's own MiB | "
            "gradients MiB | AdamW state MiB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, row in mem["setups"].items():
            c = {k: v / 2**20 for k, v in row["counted_bytes"].items()}
            lines.append(
                f"| {name.replace('_', ' ')} | {row['peak_extra_bytes'] / 2**20:.0f} | "
                f"{row['peak_vs_full_with_reference_copy']:.2f} | {c['trainable_parameters']:.1f} | "
                f"{c['reference_own_parameters']:.1f} | {c['gradients']:.1f} | {c['optimizer_state']:.1f} |"
            )
        lines.append("")
    if "learning" in data:
        learn = data["learning"]
        names = list(learn["runs"])
        lines += [
            "| seed | held-out before | " + " | ".join(f"{n} after" for n in names) + " |",
            "| ---: | ---: | " + " | ".join("---:" for _ in names) + " |",
        ]
        for i, row in enumerate(learn["runs"][names[0]]):
            after = " | ".join(f"{learn['runs'][n][i]['after']:.3f}" for n in names)
            lines.append(f"| {row['seed']} | {row['before']:.3f} | {after} |")
        means = " | ".join(f"{learn['means'][n]['after']:.3f}" for n in names)
        lines.append(f"| mean | {learn['means'][names[0]]['before']:.3f} | {means} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("memory", "learning", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="a tiny model and 2 short runs (a smoke test)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--lora-learning-rate", type=float, default=1e-3)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="bench_out/lora.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = result_header("lora", argv, device)
    if args.part in ("memory", "both"):
        result["memory"] = memory(device, args.quick, args.lora_r)
    if args.part in ("learning", "both"):
        seeds = [int(s) for s in args.seeds.split(",")][: 1 if args.quick else None]
        result["learning"] = learning(seeds, args.lora_r, args.lora_learning_rate, 2 if args.quick else None)
    write_json(args.out, result)
    return 0
