"""Sequence-level rewards: a Python function or a sequence-classification reward model."""

from __future__ import annotations

import importlib
from typing import Callable, Sequence

import torch


class RewardError(RuntimeError):
    """The reward function or model failed or returned something unusable."""


def load_reward_fn(spec: str) -> Callable:
    """Import ``module:function`` (e.g. ``my_rewards:exact_match``)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward_fn {spec!r}: cannot import module {module_name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class FunctionScorer:
    """Calls ``fn(prompts, responses)`` and checks that it returns one finite-typed number per response."""

    def __init__(self, fn: Callable[[list[str], list[str]], Sequence[float] | torch.Tensor]):
        self.fn = fn
        self.name = _name(fn)

    def __call__(self, prompts: list[str], responses: list[str], device: torch.device) -> torch.Tensor:
        try:
            raw = self.fn(list(prompts), list(responses))
        except Exception as err:  # KeyboardInterrupt passes through on purpose
            raise RewardError(f"reward function {self.name} raised {type(err).__name__}: {err}") from err
        if isinstance(raw, (str, bytes)):
            raise RewardError(f"reward function {self.name} must return numbers, got {type(raw).__name__}")
        try:
            scores = torch.as_tensor(raw, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as err:
            raise RewardError(f"reward function {self.name} must return numbers, got {type(raw).__name__}: {err}") from err
        if scores.shape != (len(responses),):
            raise RewardError(
                f"reward function {self.name} must return {len(responses)} scores (one per response), "
                f"got shape {tuple(scores.shape)}"
            )
        return scores.detach().to(device)


class RewardModelScorer:
    """Scores ``prompt + response`` with an AutoModelForSequenceClassification (logit 0)."""

    def __init__(self, path: str, device: torch.device, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = f"reward model {path}"
        self.model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], device: torch.device) -> torch.Tensor:
        texts = [p + r for p, r in zip(prompts, responses)]
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], padding=True, truncation=True, return_tensors="pt")
            logits = self.model(**enc.to(self.model.device)).logits
            out.append(logits[:, 0].float())
        return torch.cat(out).to(device)


def check_finite(name: str, values: torch.Tensor, step: int) -> None:
    """Stop the run with a clear message when ``values`` holds NaN or inf."""
    if not bool(torch.isfinite(values).all()):
        bad = values[~torch.isfinite(values)].flatten()[0].item()
        raise NonFiniteError(f"step {step}: {name} is not finite (e.g. {bad}); stopping, the last good checkpoint is kept")


class NonFiniteError(RuntimeError):
    """A reward or loss became NaN or infinite."""
