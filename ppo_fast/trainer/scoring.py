"""Sequence-level rewards: a Python function or a sequence-classification reward model."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import numbers
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from . import reward_source
from .config import ConfigError

# The per-reward metrics (Scorer.metrics; glossary: metric_glossary.py), TRL's names.
METRICS = {
    "rewards/<name>/mean": "mean of one reward function's (or the reward model's) scores, before --reward-weights",
    "rewards/<name>/std": "their standard deviation over the step's responses",
}


class RewardError(RuntimeError):
    """The reward function or model failed or returned something unusable."""


def load_reward_fn(spec: str) -> Callable:
    """The function named by ``module:function`` or ``path/to/file.py:function``.

    A module is looked up on ``sys.path`` and then in the working directory (the
    ``ppo-fast`` console script does not put it on ``sys.path``, ``python -m`` does);
    a ``.py`` file's folder is put on ``sys.path`` so that it can import its neighbours.
    """
    where = f"--reward-fn {spec}"
    found = reward_source.problem(spec)  # a missing file, module or function: seen without running it
    if found:
        raise ConfigError(found)
    module_name, attr = reward_source.split(spec)
    if reward_source.is_file(module_name):
        module = _import_file(Path(module_name), where)
    else:
        cwd = os.getcwd()
        if _find_module(module_name) is None and cwd not in sys.path and "" not in sys.path:
            sys.path.append(cwd)
        if _find_module(module_name) is None:
            raise ConfigError(reward_source.no_module(spec))
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


def _show(value, limit: int = 60) -> str:
    """``a str ('0.5')``, ``None``: what a reward function returned, short."""
    if value is None:
        return "None"
    text = repr(value)
    return f"a {type(value).__name__} ({text if len(text) <= limit else text[:limit] + '...'})"


def _where_raised(fn, err: BaseException) -> str:
    """``/path/rewards.py:12``: the innermost line of the reward function's own file in the
    traceback (where it raised, or called what raised), else the innermost line."""
    frames = traceback.extract_tb(err.__traceback__)
    code = getattr(inspect.unwrap(fn), "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    own = [f for f in frames if code is not None and f.filename == code.co_filename]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else "unknown line"


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: called positionally, with two arguments
        return None


def _where_defined(fn: Callable) -> str:
    code = getattr(inspect.unwrap(fn), "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else _name(fn)


class FunctionScorer:
    """Calls a reward function and checks that it returns one number per response.  A function that
    takes ``**kwargs`` or a ``completions`` argument is called as TRL calls one,
    ``fn(prompts=..., completions=..., **columns)`` (the answer under ``answer_column``, every other
    column of the prompts' rows by its name; without ``**kwargs`` only the columns it names);
    else ``fn(prompts, responses)``, or ``fn(prompts, responses, answers)`` when it takes a third."""

    def __init__(self, fn: Callable[..., Sequence[float] | torch.Tensor], answer_column: str = "answer"):
        self.fn = fn
        self.name = _name(fn)
        self.answer_column = answer_column
        signature = _signature(fn)
        params = list(signature.parameters.values()) if signature is not None else []
        kinds = inspect.Parameter
        positional = [p.name for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
        required = sum(p.default is p.empty for p in params if p.name in positional)
        keyword_only = [p.name for p in params if p.kind is kinds.KEYWORD_ONLY and p.default is p.empty]
        var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in params)
        self.var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
        self.keyword_style = reward_source.keyword_style(positional, keyword_only, self.var_keyword)
        self.names = {p.name for p in params}
        problem = signature and reward_source.signature_problem(
            positional, required, keyword_only, var_positional, self.var_keyword
        )
        if problem:
            raise ConfigError(
                f"reward function {self.name} ({_where_defined(fn)}) {problem}; "
                f"a reward function is called as {reward_source.SIGNATURES}"
            )
        self.takes_answers = not self.keyword_style and (var_positional or len(positional) >= 3)

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        device: torch.device,
        answers: Sequence[str | None] | None = None,
        columns: dict[str, list] | None = None,
    ) -> torch.Tensor:
        answers = list(answers) if answers is not None else [None] * len(prompts)
        try:
            if self.keyword_style:
                raw = self.fn(prompts=list(prompts), completions=list(responses), **self._columns(answers, columns))
            elif self.takes_answers:
                raw = self.fn(list(prompts), list(responses), answers)
            else:
                raw = self.fn(list(prompts), list(responses))
        except Exception as err:  # KeyboardInterrupt passes through on purpose
            raise RewardError(
                # "name()": a function named like a verb ("raises") still reads as a call.
                f"reward function {self.name}() raised {_one_line(err)} (at {_where_raised(self.fn, err)})"
            ) from err
        return self._scores(raw, len(responses)).to(device)

    def _columns(self, answers: list, columns: dict[str, list] | None) -> dict[str, list]:
        """The keyword arguments a TRL-style function gets beside prompts and completions."""
        given = {**(columns or {}), self.answer_column: answers}
        return given if self.var_keyword else {k: v for k, v in given.items() if k in self.names}

    def _scores(self, raw, count: int) -> torch.Tensor:
        """``raw`` as ``count`` float32 scores; ``RewardError`` naming what was returned instead."""
        expected = f"a list of {count} numbers (one per response)"
        if isinstance(raw, torch.Tensor):
            scores = raw.detach()
            if scores.is_complex() or scores.dtype == torch.bool or scores.shape != (count,):
                raise RewardError(
                    f"reward function {self.name} returned a {scores.dtype} tensor of shape "
                    f"{tuple(scores.shape)}; expected {expected}"
                )
            return scores.float()
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) and not hasattr(raw, "__array__"):
            raise RewardError(f"reward function {self.name} returned {_show(raw)}; expected {expected}")
        items = list(raw)
        if len(items) != count:
            raise RewardError(f"reward function {self.name} returned {len(items)} scores; expected {expected}")
        for index, item in enumerate(items):
            if (
                isinstance(item, torch.Tensor)
                and item.numel() == 1
                and item.dtype != torch.bool
                and not item.is_complex()
            ):
                item = item.item()  # a list of one-number tensors
            if isinstance(item, bool) or not isinstance(item, numbers.Real):
                raise RewardError(
                    f"reward function {self.name} returned {_show(item)} as the score of response {index}; "
                    f"expected {expected}"
                )
        return torch.tensor([float(item) for item in items], dtype=torch.float32)


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
    def __call__(
        self, prompts: list[str], responses: list[str], device: torch.device, answers=None, columns=None
    ) -> torch.Tensor:
        texts = [p + r for p, r in zip(prompts, responses)]
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], padding=True, truncation=True, return_tensors="pt")
            logits = self.model(**enc.to(self.model.device)).logits
            out.append(logits[:, 0].float())
        return torch.cat(out).to(device)


class Rewards:
    """The run's reward: the weighted sum of its rewards (reward functions, a reward model), each
    reward's mean and std over the last call kept for the metrics (TRL's ``rewards/<name>/mean``)."""

    def __init__(self, scorers: list, weights: list[float]):
        self.scorers, self.weights = scorers, weights
        names = [s.name.removeprefix("reward model ") if isinstance(s, RewardModelScorer) else s.name for s in scorers]
        # Two rewards of one name (the same function twice, with two weights) are told apart by their place.
        self.metric_names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
        self.name = " + ".join(s.name for s in scorers)
        self.last: dict[str, torch.Tensor] = {}

    def __call__(self, prompts, responses, device, answers=None, columns=None) -> torch.Tensor:
        total = torch.zeros(len(responses), device=device)
        for scorer, weight, name in zip(self.scorers, self.weights, self.metric_names):
            scores = scorer(prompts, responses, device, answers, columns)
            self.last[name] = scores.detach()
            total = total + weight * scores
        return total

    @property
    def fn(self) -> Callable | None:
        """The reward function where it is the whole reward (one function, weight 1), else None."""
        only = self.scorers[0] if len(self.scorers) == 1 and self.weights == [1.0] else None
        return getattr(only, "fn", None)

    def metrics(self) -> dict[str, float]:
        """Each reward's mean and std over the responses of the last call (this rank's)."""
        out = {}
        for name, scores in self.last.items():
            out[f"rewards/{name}/mean"] = scores.float().mean().item()
            out[f"rewards/{name}/std"] = scores.float().std(correction=0).item() if scores.numel() else 0.0
        return out


def check_finite(name: str, values: torch.Tensor, step: int) -> None:
    """Stop the run with a clear message when ``values`` holds NaN or inf."""
    if not bool(torch.isfinite(values).all()):
        bad = values[~torch.isfinite(values)].flatten()[0].item()
        raise NonFiniteError(
            f"step {step}: {name} is not finite (e.g. {bad}); stopping, the last good checkpoint is kept"
        )


class NonFiniteError(RuntimeError):
    """A reward or loss became NaN or infinite."""
