"""Prompt files: ``.txt`` (one prompt per line), ``.jsonl`` (one JSON object per line)
or ``.json`` (one list), each prompt with an optional reference answer.

A JSON record is a string (the prompt) or an object ``{"prompt": ..., "answer": ...}``
(``answer`` optional; a number is read as its text).  Anything else is a ``ConfigError``
that names the option, the file and the line or item.

Standard library only: the ``ppo-fast`` launcher loads this file on its own to report a bad
prompts file before torch is imported.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    from .config import ConfigError
except ImportError:  # loaded on its own by the ppo-fast launcher, next to config.py loaded on its own
    ConfigError = (sys.modules.get("ppo_fast.trainer.config") or sys.modules["_ppo_fast_trainer_config"]).ConfigError

SUFFIXES = (".txt", ".jsonl", ".json")
RECORD = '{"prompt": "...", "answer": "..."} (answer optional)'


@dataclass
class Prompts:
    """Prompts and, per prompt, the reference answer or None."""

    texts: list[str]
    answers: list[str | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.answers:
            self.answers = [None] * len(self.texts)

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def all_answered(self) -> bool:
        return bool(self.answers) and all(a is not None for a in self.answers)


def read_prompts(path: str, option: str = "--prompts-file") -> Prompts:
    where = f"{option} {path}"
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{where}: no such file" + (" (it is a directory)" if file.is_dir() else ""))
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"{where}: unknown file type {suffix or '(no suffix)'}; use .txt (one prompt per line), "
            f".jsonl (one {RECORD} per line) or .json (a list of such objects or strings)"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if suffix == ".txt":
        prompts = Prompts([line for line in text.splitlines() if line.strip()])
    elif suffix == ".jsonl":
        prompts = _from_records(
            [
                (f"line {n}", _json(line, f"{where}, line {n}"))
                for n, line in enumerate(text.splitlines(), 1)
                if line.strip()
            ],
            where,
        )
    else:
        items = _json(text, where)
        if not isinstance(items, list):
            hint = " (one JSON object per line is a .jsonl file)" if isinstance(items, dict) else ""
            raise ConfigError(
                f"{where}: expected a JSON list of prompts (strings or {RECORD}), got {type(items).__name__}{hint}"
            )
        prompts = _from_records([(f"item {i}", item) for i, item in enumerate(items)], where)
    if not prompts.texts:
        raise ConfigError(f"{where}: holds no prompts")
    return prompts


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{where}: not valid JSON: {err.msg} (column {err.colno})"
            + (f", line {err.lineno}" if "line" not in where else "")
        ) from None


def _from_records(records: list[tuple[str, object]], where: str) -> Prompts:
    texts, answers = [], []
    for place, record in records:
        if isinstance(record, str):
            prompt, answer = record, None
        elif isinstance(record, dict):
            if "prompt" not in record:
                keys = ", ".join(map(repr, record)) or "none"
                raise ConfigError(
                    f"{where}, {place}: no 'prompt' field (its keys: {keys}); each record must be a string or {RECORD}"
                )
            prompt, answer = record["prompt"], record.get("answer")
        else:
            raise ConfigError(f"{where}, {place}: expected a string or {RECORD}, got {type(record).__name__}")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where}, {place}: 'prompt' must be a non-empty string, got {prompt!r}")
        if answer is not None:
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ConfigError(
                    f"{where}, {place}: 'answer' must be a string or a number, got {type(answer).__name__}"
                )
            answer = str(answer)
        texts.append(prompt)
        answers.append(answer)
    return Prompts(texts, answers)


def exact_match(responses: list[str], answers: list[str | None]) -> list[float]:
    """1.0 where the response, stripped of surrounding whitespace, equals the answer."""
    return [float(a is not None and r.strip() == a.strip()) for r, a in zip(responses, answers)]
