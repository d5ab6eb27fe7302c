"""What a run tells its user: the progress bar and samples, the summary (summary.json and the
last lines), the plot's title."""

from __future__ import annotations

import json
import time

from . import default_task, model_folder, packing, run_folder
from .evaluation import in_words
from .metrics import ACCURACY, EVAL_KEYS, plot_curves
from .run_folder import BEST_DIR, CONFIG_FILE, LOG_FILE, SUMMARY_FILE


class RunLog:
    """The run's messages: to ``log`` (the console), and once the run folder is claimed also to its
    ``train.log`` (the messages said before, first)."""

    def __init__(self, log):
        self.log, self.said, self.path = log, [], None

    def __call__(self, message: str) -> None:
        self.log(message)
        if self.path is None:
            self.said.append(message)
        else:
            self._append([message])

    def open(self, path) -> None:
        """Write to ``path`` from now on (appending: a resumed run goes on in the same log)."""
        self.path = path
        self._append([time.strftime("--- %Y-%m-%d %H:%M:%S"), *self.said])
        self.said = []

    def _append(self, messages: list[str]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:  # opened per message: no handle outlives the run
            f.write("".join(m + "\n" for m in messages))


def start_run_folder(run) -> None:
    """Once the run folder is claimed (rank 0): the run's resolved options to ``run_config.yaml``
    (``ppo-fast train --config`` reads it back), and its messages to ``train.log`` from now on."""
    import yaml

    if not run.parallel.main:
        return
    text = yaml.safe_dump(run.cfg.to_dict(), sort_keys=False)
    (run.output_dir / CONFIG_FILE).write_text(text)
    base = run.cfg.model_name_or_path
    run_folder.record_base(run.output_dir, base, model_folder.fingerprint(base) if base else None)
    run.log.open(run.output_dir / LOG_FILE)


def progress(run, bar, row: dict) -> None:
    """The bar's step and its reward, KL and throughput; every ``--sample-every`` steps, samples."""
    cfg = run.cfg
    bar.update(1)
    bar.set_postfix(
        reward=f"{row['objective/scores']:.3f}",
        kl=f"{row['objective/kl']:.3f}",
        tok_s=f"{row['throughput/tokens_per_s']:.0f}",
    )
    if "packing/packed_share" in row and row["step"] == 1:
        run.log(
            f"step 1: --padding-free packed {row['packing/packed_share']:.0%} of the update's micro-batches "
            f"(one is packed when its real tokens fill at most {packing.PACK_BELOW:.0%} of its padded rows)"
        )
    if cfg.sample_every and (row["step"] % cfg.sample_every == 0 or row["step"] == 1):
        lines = [f"step {row['step']} samples:"]
        for prompt, response, score in run.last_samples[: cfg.num_samples_to_print]:
            lines.append(f"  {prompt!r} -> {response!r}  (score {score:.2f})")
        run.log("\n".join(lines))


def summary(run, stop_reason: str, evals: tuple[dict, dict, dict]) -> dict:
    """The run's summary, written to summary.json, with its plot; ``evals`` are the held-out scores
    at the run's start, at this process's start and at the end (empty where not evaluated)."""
    before, start, after = evals
    plot = plot_curves(
        run.output_dir,
        before=before,
        after=after,
        after_step=run.step,
        title=plot_title(run),
        score_name=score_name(run.scorer),
    )
    result = {
        "stop_reason": stop_reason,
        "steps_done": run.step,
        "eval_before": before.get("eval/score"),
        "eval_after": after.get("eval/score"),
        "wall_time_s": time.perf_counter() - run.created,  # warm-up and loading included
        "phase_time_s": dict(run.timer.total),
        "plot": str(plot) if plot else None,
    }
    if "eval/exact_match" in before:
        result["exact_match_before"] = before["eval/exact_match"]
        result["exact_match_after"] = after.get("eval/exact_match")
    if run.best:
        result["best"] = {"step": run.best["step"], "eval_score": run.best["eval/score"], "path": BEST_DIR}
        run.log(f"best held-out score {run.best['eval/score']:.3f} at step {run.best['step']}: {BEST_DIR}/")
    (run.output_dir / SUMMARY_FILE).write_text(json.dumps(result, indent=2))
    if run.timer.total:
        run.log(run.timer.breakdown())
    if after:
        since = f", from step {run.resumed_from}" if run.resumed_from is not None else ""
        run.log(f"held-out greedy {in_words(start, after)} (wall time {result['wall_time_s']:.0f}s{since})")
    return result


def nothing_to_do(run) -> dict:
    """The run in output_dir already did ``cfg.steps`` steps: report it, change nothing."""
    run.log(run_folder.nothing_to_do(run.output_dir, run.step, run.cfg.steps))
    summary_file = run.output_dir / SUMMARY_FILE
    result = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    result.update(stop_reason="done", steps_done=run.step)
    return result


def plot_title(run) -> str:
    cfg = run.cfg
    if cfg.reward_fn:
        reward = f"reward {cfg.reward_fn}"
    elif cfg.reward_model:
        reward = f"reward model {cfg.reward_model}"
    else:
        reward = f"reward {run.scorer.name}"
    kl = (
        f"KL coef {cfg.kl_coef:g}"
        + (f" adaptive (target {cfg.target_kl:g})" if cfg.adaptive_kl else "")
        + f" ({cfg.kl_estimator_used}, in the {'reward' if cfg.kl_in_reward else 'loss'})"
    )
    critic = f", critic {cfg.critic}" if cfg.uses_critic else ""
    return (
        f"{model_in_words(run)}; {reward}\n{cfg.advantage_method}{critic}, {kl}, lr {cfg.learning_rate:g}, "
        f"batch {cfg.batch_size}x{cfg.group_size}, {cfg.num_ppo_epochs} epochs, {run.step} steps, "
        f"seed {cfg.seed}"
    )


def model_in_words(run) -> str:
    """``built-in addition task: a GPT-2 of 2 layers, width 64 (102k parameters), ...``."""
    policy = run.policy
    config = policy.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    width = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    kind = {"gpt2": "GPT-2"}.get(getattr(config, "model_type", ""), getattr(config, "model_type", "") or "model")
    shape = f" of {layers} layers, width {width}" if layers and width else ""
    count = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    lora = f", LoRA r{run.cfg.lora_r}: {_count(trainable)} trainable" if run.cfg.lora_r else ""
    size = f"a {kind}{shape} ({_count(count)} parameters{lora})"
    if run.builtin:
        return f"built-in addition task: {size}, warmed up on a sloppy teacher's sums"
    return f"{run.cfg.model_name_or_path or type(policy).__name__}: {size}"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def score_name(scorer) -> str:
    """What ``eval/score`` measures: the accuracy for the built-in task's reward, else the mean reward."""
    return ACCURACY if getattr(scorer, "fn", None) is default_task.addition_reward else EVAL_KEYS[0][1]
