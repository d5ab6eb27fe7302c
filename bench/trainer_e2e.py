"""The trainer end to end on a Llama-shaped model: ppo_fast's GRPO and PPO steps against TRL's GRPOTrainer.

One randomly initialised Llama (Qwen2.5-0.5B's shape by default: hidden 896, 24 layers, vocabulary
151,936, tied head; built locally, no hub) with a word-level tokenizer made in memory, random
prompts of a fixed length and a cheap reward (the share of even token ids in the response).  Every
set-up trains from the same weights on the same prompts, with the same rows per step, response
length, bf16 autocast and one optimizer step on all the rows per generation (TRL's default); each takes ``--warmup`` untimed steps then ``--steps`` timed ones.

Set-ups, in the order of what they answer (``--budget-s`` cuts the list, the cut ones reported):
ppo_fast GRPO (fused head and packing as the run decides them), TRL's GRPOTrainer unpatched and
under ``ppo_fast.integrations.trl.patch()``, ppo_fast GRPO with the policy loss in two passes
(the fused head off) and with padded rows (packing off), then ppo_fast PPO (GAE, separate critic).
Per set-up: the wall time per step (median and range), sequences/s and response tokens/s, and
the peak memory of the timed steps (CUDA).  The fused head is switched off by replacing the run's
loss path (``run.loss_path``), the one decision the trainer makes about it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import statistics
import tempfile
import time

import torch

QWEN_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
)
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SETUPS = ("ours-grpo", "trl-grpo", "trl-grpo-patched", "ours-grpo-two-pass", "ours-grpo-padded", "ours-ppo")


def tokenizer_of(vocab: int):
    """A word-level tokenizer of ``vocab`` ids: ``t0 .. t{vocab-3}``, then pad and EOS; left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 2)} | {"<pad>": vocab - 2, "<eos>": vocab - 1}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def model_of(shape: dict, tokenizer, vocab: int, positions: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **shape,
        vocab_size=vocab,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    with device:  # initialised where it trains: 0.5B parameters initialise in seconds on a GPU, not on its host
        return LlamaForCausalLM(config).float().eval()


def even_share(completions, **kwargs) -> list[float]:
    """The reward: the share of even token ids in each response (TRL's signature; ours takes it too)."""
    out = []
    for text in completions:
        ids = [int(word[1:]) for word in text.split() if word.startswith("t") and word[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(1, len(ids)))
    return out


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None


def _summary(step_s: list[float], rows: int, response: int, device: torch.device) -> dict:
    median = statistics.median(step_s)
    return {
        "step_s": median,
        "step_s_range": [min(step_s), max(step_s)],
        "steps": len(step_s),
        "sequences_per_s": rows / median,
        "response_tokens_per_s_max": rows * response / median,
        "peak_mib": _peak_mib(device),
    }


def run_ours(setup: str, model, tokenizer, prompts: list[str], sizes: dict, device: torch.device) -> dict:
    """ppo_fast's trainer, ``warmup`` + ``steps`` iterations of ``setup``."""
    from ppo_fast.trainer import PPOTrainer, TrainerConfig
    from ppo_fast.trainer.update import LossPath

    ppo = setup == "ours-ppo"
    with tempfile.TemporaryDirectory(prefix="ppo_fast_e2e_") as out_dir:
        cfg = TrainerConfig(
            output_dir=out_dir,
            steps=sizes["warmup"] + sizes["steps"],
            device=device.type,
            advantage_method="gae" if ppo else "grpo",
            batch_size=sizes["prompts"],
            group_size=1 if ppo else sizes["group"],
            response_length=sizes["response"],
            num_ppo_epochs=1,  # TRL's GRPOTrainer default: one optimizer step on all the rows per generation
            num_mini_batches=1,
            padding_free=False if setup == "ours-grpo-padded" else None,
            learning_rate=1e-6,
            sample_every=0,
            save_every=0,
            eval_every=0,
        )
        trainer = PPOTrainer(
            cfg,
            policy=copy.deepcopy(model).to(device),
            tokenizer=tokenizer,
            reward_fn=even_share,
            prompts=prompts,
            log=lambda message: None,
        )
        if setup == "ours-grpo-two-pass":
            trainer.run.loss_path = LossPath(fused=False, why="bench: the fused head switched off")
        decided = {"loss_path": str(trainer.run.loss_path), "padding_free": trainer.run.cfg.padding_free}
        for _ in range(sizes["warmup"]):
            trainer.train_step()
        _peak_reset(device)
        step_s, phases = [], []
        for _ in range(sizes["steps"]):
            start = time.perf_counter()
            row = trainer.train_step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - start)
            phases.append({k.removeprefix("time/"): v for k, v in row.items() if k.startswith("time/")})
        rows = cfg.batch_size * cfg.group_size
        result = _summary(step_s, rows, cfg.response_length, device)
        trainer.run.engine.close()
    phase_s = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    return result | {"rows": rows, "phase_s": phase_s, "decided": decided}


def run_trl(setup: str, folder: str, tokenizer, prompts: list[str], sizes: dict, device: torch.device) -> dict:
    """TRL's GRPOTrainer on the same model folder, prompts and sizes; under our ``patch()`` for ``-patched``."""
    if importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None:
        return {"skipped": "trl or datasets is not installed (bench/gpu_wheels.txt carries them to the GPU)"}
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import ppo_fast.integrations.trl as pf_trl

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_begin(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            if state.global_step == sizes["warmup"]:
                _peak_reset(device)
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter() - self.begin)

    rows = sizes["prompts"] * sizes["group"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-e2e-"),
        use_cpu=device.type == "cpu",
        bf16=device.type == "cuda",
        use_vllm=False,
        report_to="none",
        per_device_train_batch_size=rows,
        num_generations=sizes["group"],
        max_completion_length=sizes["response"],
        max_steps=sizes["warmup"] + sizes["steps"],
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-6,
        beta=0.04,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    times = StepTimes()
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    with pf_trl.patch() if setup.endswith("-patched") else contextlib.nullcontext():
        trainer = GRPOTrainer(
            model=folder,
            reward_funcs=even_share,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[times],
        )
        trainer.train()
    timed = times.ends[sizes["warmup"] :]
    return _summary(timed, rows, sizes["response"], device) | {"rows": rows}


def run(device: torch.device, quick: bool, budget_s: float, setups=SETUPS) -> dict:
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers is not installed"}
    shape = QUICK if quick else QWEN_05B
    vocab = 512 if quick else 151936
    sizes = (
        dict(prompts=2, group=2, prompt=8, response=4, warmup=1, steps=2)
        if quick
        else dict(prompts=16, group=4, prompt=64, response=64, warmup=1, steps=2)
    )
    tokenizer = tokenizer_of(vocab)
    model = model_of(shape, tokenizer, vocab, sizes["prompt"] + sizes["response"] + 8, device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab - 2, (4 * sizes["prompts"], sizes["prompt"]), generator=generator)
    prompts = [" ".join(f"t{i}" for i in row) for row in ids.tolist()]
    folder = tempfile.mkdtemp(prefix="llama-e2e-")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    results, started = {}, time.perf_counter()
    for setup in setups:
        spent = time.perf_counter() - started
        if spent > budget_s:
            results[setup] = {"skipped": f"the budget of {budget_s:.0f} s was spent ({spent:.0f} s)"}
            continue
        begin = time.perf_counter()
        try:
            if setup.startswith("trl"):
                results[setup] = run_trl(setup, folder, tokenizer, prompts, sizes, device)
            else:
                results[setup] = run_ours(setup, model, tokenizer, prompts, sizes, device)
        except Exception as err:  # reported in the row; the other set-ups still run
            results[setup] = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
        results[setup]["setup_s"] = time.perf_counter() - begin
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "model": f"Llama {shape}, vocabulary {vocab}, {parameters / 1e6:.0f}M parameters, float32 weights, bf16 autocast",
        "sizes": sizes,
        "results": results,
    }


def markdown(data: dict) -> str:
    e2e = data["trainer_e2e"]
    if "results" not in e2e:
        return f"trainer_e2e: {e2e.get('skipped') or e2e.get('error')}\n"
    lines = [
        f"{e2e['model']}; sizes {e2e['sizes']}; machine {data['machine']}",
        "",
        "| set-up | step s (median, range) | sequences/s | peak MiB | phases (median s) | decided |",
        "|---|---|---|---|---|---|",
    ]
    for setup, r in e2e["results"].items():
        if "step_s" not in r:
            lines.append(f"| {setup} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        phases = ", ".join(f"{k} {v:.3g}" for k, v in r.get("phase_s", {}).items())
        low, high = r["step_s_range"]
        decided = "; ".join(f"{k}: {v}" for k, v in r.get("decided", {}).items())
        lines.append(
            f"| {setup} | {r['step_s']:.3f} ({low:.3f}-{high:.3f}) | {r['sequences_per_s']:.1f} | {peak} | {phases} "
            f"| {decided} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``python -m bench trainer_e2e``: the set-ups above; JSON and markdown into ``--out``."""
    import argparse
    import os

    from .common import command_line, machine, versions, write_json

    parser = argparse.ArgumentParser(prog="python -m bench trainer_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama and batch: a smoke run")
    parser.add_argument("--budget-s", type=float, default=240.0, help="no set-up starts after this many seconds")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--out", default=None, help="folder for trainer-e2e-<device>.json/.md")
    args = parser.parse_args(argv)
    setups = [s for s in args.setups.split(",") if s]
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        parser.error(f"--setups: unknown {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
    device = torch.device(args.device)
    data = {
        "command": command_line("trainer_e2e", argv),
        "machine": machine(device),
        "versions": versions(),
        "trainer_e2e": run(device, args.quick, args.budget_s, setups),
    }
    text = markdown(data)
    print(text)
    if args.out:
        name = f"trainer-e2e-{device.type}{'-quick' if args.quick else ''}"
        write_json(os.path.join(args.out, name + ".json"), data)
        with open(os.path.join(args.out, name + ".md"), "w") as f:
            f.write(text)
    results = data["trainer_e2e"].get("results", {})
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
