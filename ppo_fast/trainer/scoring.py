"""Sequence-level rewards: a Python function or a sequence-classification reward model."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .config import ConfigError


class RewardError(RuntimeError):
    """The reward function or model failed or returned something unusable."""


def load_reward_fn(spec: str) -> Callable:
    """The function named by ``module:function`` or ``path/to/file.py:function``.

    A module is looked up on ``sys.path`` and then in the working directory (the
    ``ppo-fast`` console script does not put it on ``sys.path``, ``python -m`` does);
    a ``.py`` file's folder is put on ``sys.path`` so that it can import its neighbours.
    """
    where = f"--reward-fn {spec}"
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: must look like 'module:function' or 'path/to/file.py:function'")
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        module = _import_file(Path(module_name), where)
    else:
        cwd = os.getcwd()
        if _find_module(module_name) is None and cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)
        if _find_module(module_name) is None:
            raise ConfigError(
                f"{where}: no module {module_name!r} in the working directory ({cwd}) or on the Python path; "
                f"run from the folder that holds {module_name.replace('.', '/')}.py, or give its path: "
                f"--reward-fn path/to/{module_name.rsplit('.', 1)[-1]}.py:{attr}"
            )
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # the user's module raised while being imported
            raise ConfigError(f"{where}: importing {module_name!r} failed: {_one_line(err)}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        names = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        hint = f" (it defines: {', '.join(names)})" if names else ""
        raise ConfigError(f"{where}: {module_name!r} has no function {attr!r}{hint}")
    return fn


def _find_module(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a missing parent package of a dotted name
        return None


def _import_file(path: Path, where: str):
    if not path.is_file():
        raise ConfigError(f"{where}: no such file {path}")
    name = path.stem
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"{where}: importing {path} failed: {_one_line(err)}") from err
    return module


def _one_line(err: BaseException) -> str:
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} ({err.filename}, line {err.lineno})"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _takes_answers(fn: Callable) -> bool:
    """Whether ``fn`` accepts a third positional argument (the reference answers)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


class FunctionScorer:
    """Calls ``fn(prompts, responses)`` -- or ``fn(prompts, responses, answers)`` when it takes
    a third argument -- and checks that it returns one number per response."""

    def __init__(self, fn: Callable[..., Sequence[float] | torch.Tensor]):
        self.fn = fn
        self.name = _name(fn)
        self.takes_answers = _takes_answers(fn)

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        device: torch.device,
        answers: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        try:
            if self.takes_answers:
                raw = self.fn(
                    list(prompts), list(responses), list(answers) if answers is not None else [None] * len(prompts)
                )
            else:
                raw = self.fn(list(prompts), list(responses))
        except Exception as err:  # KeyboardInterrupt passes through on purpose
            raise RewardError(f"reward function {self.name} raised {type(err).__name__}: {err}") from err
        if isinstance(raw, (str, bytes)):
            raise RewardError(f"reward function {self.name} must return numbers, got {type(raw).__name__}")
        try:
            scores = torch.as_tensor(raw, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as err:
            raise RewardError(
                f"reward function {self.name} must return numbers, got {type(raw).__name__}: {err}"
            ) from err
        if scores.shape != (len(responses),):
            raise RewardError(
                f"reward function {self.name} must return {len(responses)} scores (one per response), "
                f"got shape {tuple(scores.shape)}"
            )
        return scores.detach().to(device)


class RewardModelScorer:
    """Scores ``prompt + response`` with an AutoModelForSequenceClassification (logit 0)."""

    takes_answers = False

    def __init__(self, path: str, device: torch.device, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from .models import load_pretrained

        self.name = f"reward model {path}"
        self.model = load_pretrained("--reward-model", path, AutoModelForSequenceClassification).to(device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_pretrained("--reward-model", path, AutoTokenizer)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str], device: torch.device, answers=None) -> torch.Tensor:
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
        raise NonFiniteError(
            f"step {step}: {name} is not finite (e.g. {bad}); stopping, the last good checkpoint is kept"
        )


class NonFiniteError(RuntimeError):
    """A reward or loss became NaN or infinite."""
