"""A trained policy after the run: ``ppo-fast eval`` scores it on held-out prompts, ``ppo-fast
generate`` samples from it.

``PATH`` is a run folder (its latest checkpoint's policy, or ``best/`` with ``--best``), a
checkpoint (``checkpoints/step-N``) or a policy folder (``save_pretrained``'s).  The run's options
come from its ``run_config.yaml`` (or the checkpoint's trainer state), so the built-in task's
held-out prompts and reward, or a custom run's ``--eval-prompts-file`` and reward, are found
as the run used them; the command's own options override them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from . import checkpoint, lora, run_folder, startup
from .config import (
    BUILTIN_RESPONSE_LENGTH,
    CUSTOM_RESPONSE_LENGTH,
    RENAMED,
    ConfigError,
    TrainerConfig,
    read_config_file,
)
from .distributed import SINGLE
from .evaluation import held_out
from .models import third_party_output
from .prompts import Prompts, read_prompts, render_chats
from .rollout import decode_responses, generate
from .startup import resolve_device


@dataclasses.dataclass
class Saved:
    policy_dir: Path  # a save_pretrained folder (model and tokenizer)
    cfg: TrainerConfig  # the run's options (defaults where none were found)
    builtin: bool  # the built-in task's run


def find(path: str, best: bool = False) -> Saved:
    """The policy folder ``path`` names, and the options of the run that made it."""
    root = Path(path)
    if _policy_folder(root):
        policy, checkpoint_dir = root, root.parent if root.name == checkpoint.POLICY_DIR else None
    elif _policy_folder(root / checkpoint.POLICY_DIR):
        policy, checkpoint_dir = root / checkpoint.POLICY_DIR, root
    elif root.is_dir() and (best or checkpoint.latest(root)):
        checkpoint_dir = None if best else checkpoint.latest(root)
        policy = root / run_folder.BEST_DIR if best else checkpoint_dir / checkpoint.POLICY_DIR
        if not _policy_folder(policy):
            raise ConfigError(f"{path}: no {run_folder.BEST_DIR}/ (the run was not made with --keep-best)")
    else:
        raise ConfigError(
            f"{path}: not a run folder with a checkpoint, a checkpoint (checkpoints/step-N) or a policy folder "
            "(config.json, or a LoRA adapter folder: adapter_config.json)"
        )
    cfg = _options(policy, checkpoint_dir)
    return Saved(policy, cfg, builtin=cfg.model_name_or_path is None)


def _policy_folder(folder: Path) -> bool:
    """A ``save_pretrained`` folder, or a PEFT adapter folder (a LoRA run's)."""
    return (folder / "config.json").is_file() or (folder / lora.ADAPTER_CONFIG).is_file()


def _options(policy: Path, checkpoint_dir: Path | None) -> TrainerConfig:
    """The run's options: its run_config.yaml, else the checkpoint's trainer state, else the defaults."""
    for folder in (policy.parent, policy.parent.parent.parent):  # best/ or policy/ of checkpoints/step-N
        if (folder / run_folder.CONFIG_FILE).is_file():
            return TrainerConfig.from_dict(read_config_file(folder / run_folder.CONFIG_FILE))
    if checkpoint_dir is not None and (checkpoint_dir / checkpoint.STATE_FILE).is_file():
        saved = checkpoint.load_state(checkpoint_dir).config
        return TrainerConfig.from_dict({RENAMED.get(name, name): value for name, value in saved.items()})
    return TrainerConfig()


def load(saved: Saved, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    third_party_output(saved.cfg.verbose)

    if (saved.policy_dir / lora.ADAPTER_CONFIG).is_file():  # a LoRA run's adapters, merged onto their base
        policy = lora.load_merged(saved.policy_dir).to(device).eval()
    else:
        policy = AutoModelForCausalLM.from_pretrained(saved.policy_dir).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(saved.policy_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return policy, tokenizer


def response_length(saved: Saved, given: int | None) -> int:
    default = BUILTIN_RESPONSE_LENGTH if saved.builtin else CUSTOM_RESPONSE_LENGTH
    return given or saved.cfg.response_length or default


def evaluate(path: str, *, best=False, eval_prompts_file=None, reward_fn=None, device="auto") -> dict:
    """The held-out scores of the saved policy, as the trainer's evaluation computes them."""
    saved = find(path, best)
    cfg = dataclasses.replace(
        saved.cfg,
        eval_prompts_file=eval_prompts_file or saved.cfg.eval_prompts_file,
        reward_fn=reward_fn or saved.cfg.reward_fn,
    )
    device = resolve_device(device)
    # The run's own sources of held-out prompts and reward, as the trainer finds them.
    _, eval_set, reward = startup.datasets_and_reward(cfg, startup.Given(prompts=[]), saved.builtin)
    if not saved.builtin and eval_set is None:
        raise ConfigError(f"{path}: the run had no held-out prompts; give --eval-prompts-file")
    scorer = startup.scorer(cfg, reward, device)
    policy, tokenizer = load(saved, device)
    _, eval_set = startup.prompt_sets(cfg, Prompts([]), eval_set, saved.builtin, tokenizer, lambda _: None)
    context = SimpleNamespace(
        eval_set=eval_set,
        parallel=SINGLE,
        tokenizer=tokenizer,
        response_length=response_length(saved, None),
        scorer=scorer,
        device=device,
    )
    scores = held_out(context, policy)
    return {"policy": str(saved.policy_dir), "prompts": len(eval_set.texts), **scores}


def sample(path: str, prompts: list[str] | Prompts, *, best=False, max_new_tokens=None, temperature=0.0, device="auto"):
    """``[(prompt, response)]``: greedy responses (``temperature`` 0) or samples at ``temperature``;
    conversations through the run's chat template; ``ConfigError`` for a prompt that leaves no room
    for the response in the model's positions."""
    saved = find(path, best)
    device = resolve_device(device)
    policy, tokenizer = load(saved, device)
    prompts = prompts if isinstance(prompts, Prompts) else Prompts(list(prompts))
    template = Path(saved.cfg.chat_template).read_text() if saved.cfg.chat_template else None
    prompts = render_chats(prompts, tokenizer, template, "--prompts-file").texts
    new_tokens = response_length(saved, max_new_tokens)
    _check_positions(policy, tokenizer, prompts, new_tokens)
    with torch.no_grad():
        batch = generate(
            policy,
            tokenizer,
            prompts,
            max_new_tokens=new_tokens,
            temperature=temperature or 1.0,
            top_p=1.0,
            greedy=not temperature,
        )
    return list(zip(prompts, decode_responses(tokenizer, batch)))


def _check_positions(policy, tokenizer, prompts: list[str], new_tokens: int) -> None:
    """``ConfigError`` naming the first prompt whose tokens and ``new_tokens`` pass the model's positions."""
    config = getattr(policy, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not limit:
        return
    for i, ids in enumerate(tokenizer(prompts)["input_ids"]):
        if len(ids) + new_tokens > limit:
            raise ConfigError(
                f"generate: prompt {i} is {len(ids)} tokens, and with --max-new-tokens {new_tokens} passes the "
                f"model's {limit} positions; shorten it or lower --max-new-tokens"
            )


def run(args) -> int:
    """``ppo-fast eval`` / ``ppo-fast generate``: one JSON line per result on stdout."""
    if args.command == "eval":
        result = evaluate(
            args.path,
            best=args.best,
            eval_prompts_file=args.eval_prompts_file,
            reward_fn=args.reward_fn,
            device=args.device,
        )
        print(json.dumps(result))
        return 0
    prompts = Prompts(list(args.prompt or []))
    if args.prompts_file:
        given = read_prompts(args.prompts_file, "--prompts-file")
        prompts = Prompts(prompts.texts + given.texts, chats=prompts.chats + given.chats)
    if not prompts:
        raise ConfigError("generate: give --prompt TEXT (one or more) or --prompts-file FILE")
    for prompt, response in sample(
        args.path,
        prompts,
        best=args.best,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        device=args.device,
    ):
        print(json.dumps({"prompt": prompt, "response": response}))
    return 0
