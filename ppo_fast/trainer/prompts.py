"""Prompt files: ``.txt`` (one prompt per line), ``.jsonl`` (one JSON object per line) or
``.json`` (one list), and, with the ``datasets`` package, ``.parquet``, ``.csv`` and a folder
that ``Dataset.save_to_disk`` wrote; each prompt with an optional reference answer and any
other columns of its row.

A JSON record is a string (the prompt) or an object ``{"prompt": ..., "answer": ...}``
(``answer`` optional; a number is read as its text; the columns' names are
``--prompt-column`` and ``--answer-column``).  A prompt is text, or a conversation: a list of
``{"role": ..., "content": ...}`` messages (TRL's conversational format; a ``messages`` column
stands for the prompt column, its trailing assistant turns left out), which the policy's chat
template turns into text once its tokenizer is loaded (:func:`render_chats`).  Every other
field of a record is a column that reaches a keyword-style reward function.  Anything else is a
``ConfigError`` that names the option, the file and the line or item.

Standard library only: the ``ppo-fast`` launcher loads this file on its own to report a bad
prompts file before torch is imported (it does not load a ``datasets`` file, only finds it).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    from .config import ConfigError
except ImportError:  # loaded on its own by the ppo-fast launcher, next to config.py loaded on its own
    ConfigError = (sys.modules.get("ppo_fast.trainer.config") or sys.modules["_ppo_fast_trainer_config"]).ConfigError

SUFFIXES = (".txt", ".jsonl", ".json")
DATASET_SUFFIXES = (".parquet", ".csv")  # and a save_to_disk folder: read by the datasets package
RECORD = '{"prompt": "...", "answer": "..."} (answer optional)'
MESSAGES = "messages"  # TRL's conversational column: the conversation, its last assistant turns dropped


@dataclass
class Prompts:
    """Prompts (text, or None where ``chats`` holds a conversation still to render), per prompt the
    reference answer or None, and the row's other columns (``columns[name][i]``)."""

    texts: list[str | None]
    answers: list[str | None] = field(default_factory=list)
    columns: dict[str, list] = field(default_factory=dict)
    chats: list[list[dict] | None] = field(default_factory=list)

    def __post_init__(self):
        if not self.answers:
            self.answers = [None] * len(self.texts)
        if not self.chats:
            self.chats = [None] * len(self.texts)

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def all_answered(self) -> bool:
        return bool(self.answers) and all(a is not None for a in self.answers)

    def columns_of(self, rows: list[int]) -> dict[str, list]:
        """The other columns of ``rows`` (indices, repeats allowed), for a reward function."""
        return {name: [values[i] for i in rows] for name, values in self.columns.items()}

    def kept(self, rows: list[int]) -> Prompts:
        """The prompts at ``rows`` only."""
        return Prompts(
            [self.texts[i] for i in rows],
            [self.answers[i] for i in rows],
            self.columns_of(rows),
            [self.chats[i] for i in rows],
        )


def render_chats(prompts: Prompts, tokenizer, template: str | None, option: str) -> Prompts:
    """``prompts`` with each conversation turned into text by the chat template (``template``, a
    Jinja file's text, else the tokenizer's own) with the generation prompt appended, as TRL does."""
    if all(chat is None for chat in prompts.chats):
        return prompts
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"{option}: holds conversations, and the policy's tokenizer has no chat template; "
            "give one with --chat-template FILE (a Jinja template)"
        )
    texts = [
        text
        if chat is None
        else tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True)
        for text, chat in zip(prompts.texts, prompts.chats)
    ]
    return Prompts(texts, prompts.answers, prompts.columns)


@dataclass(frozen=True)
class Columns:
    """Which column of a record holds the prompt and which the answer."""

    prompt: str = "prompt"
    answer: str = "answer"

    def record_shape(self) -> str:
        return RECORD.replace('"prompt"', f'"{self.prompt}"').replace('"answer"', f'"{self.answer}"')


def read_prompts(path: str, option: str = "--prompts-file", columns: Columns = Columns(), load: bool = True) -> Prompts:
    """The prompts in ``path``.  ``load=False`` (the launcher, before torch): a ``datasets`` file
    is only found, not read."""
    where = f"{option} {path}"
    file = Path(path).expanduser()
    suffix = file.suffix.lower()
    if file.is_dir() or suffix in DATASET_SUFFIXES:
        return _from_dataset(file, where, columns, load)
    if not file.is_file():
        raise ConfigError(f"{where}: no such file")
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"{where}: unknown file type {suffix or '(no suffix)'}; use .txt (one prompt per line), "
            f".jsonl (one {columns.record_shape()} per line), .json (a list of such objects or strings), or with "
            f"the datasets package .parquet, .csv or a save_to_disk folder"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if suffix == ".txt":
        prompts = Prompts([line for line in text.splitlines() if line.strip()])
    elif suffix == ".jsonl":
        lines = [(f"line {n}", line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        prompts = _from_records([(place, _json(line, f"{where}, {place}")) for place, line in lines], where, columns)
    else:
        items = _json(text, where)
        if not isinstance(items, list):
            hint = " (one JSON object per line is a .jsonl file)" if isinstance(items, dict) else ""
            raise ConfigError(
                f"{where}: expected a JSON list of prompts (strings or {columns.record_shape()}), "
                f"got {type(items).__name__}{hint}"
            )
        prompts = _from_records([(f"item {i}", item) for i, item in enumerate(items)], where, columns)
    if not prompts.texts:
        raise ConfigError(f"{where}: holds no prompts")
    return prompts


def _from_dataset(file: Path, where: str, columns: Columns, load: bool) -> Prompts | None:
    """A ``.parquet`` or ``.csv`` file, or a ``save_to_disk`` folder, through the datasets package."""
    if file.is_dir() and not (file / "dataset_info.json").is_file():
        raise ConfigError(f"{where}: a folder that Dataset.save_to_disk did not write (no dataset_info.json)")
    if not file.exists():
        raise ConfigError(f"{where}: no such file")
    if importlib.util.find_spec("datasets") is None:
        raise ConfigError(f"{where}: reading it needs the datasets package; pip install datasets")
    if not load:
        return None
    import datasets

    try:
        if file.is_dir():
            data = datasets.load_from_disk(str(file))
        else:
            data = datasets.load_dataset(file.suffix[1:].lower(), data_files=str(file), split="train")
    except Exception as err:  # the package's own errors: a damaged file, a DatasetDict without splits
        reason = " ".join(str(err).split())[:300]
        raise ConfigError(f"{where}: datasets could not read it: {type(err).__name__}: {reason}") from None
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise ConfigError(f"{where}: a DatasetDict without a 'train' split (it has: {', '.join(data)})")
        data = data["train"]
    prompts = _from_records([(f"row {i}", row) for i, row in enumerate(data)], where, columns)
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


def _from_records(records: list[tuple[str, object]], where: str, columns: Columns = Columns()) -> Prompts:
    texts, answers, chats, others = [], [], [], []
    for place, record in records:
        if isinstance(record, str):
            prompt, answer, other = record, None, {}
        elif isinstance(record, dict):
            name = columns.prompt if columns.prompt in record or MESSAGES not in record else MESSAGES
            if name not in record:
                keys = ", ".join(map(repr, record)) or "none"
                raise ConfigError(
                    f"{where}, {place}: no {columns.prompt!r} field (its keys: {keys}); each record must be a string "
                    f"or {columns.record_shape()}"
                )
            prompt, answer = record[name], record.get(columns.answer)
            other = {k: v for k, v in record.items() if k not in (name, columns.answer)}
            if name == MESSAGES:
                prompt = _without_last_replies(prompt)
        else:
            raise ConfigError(
                f"{where}, {place}: expected a string or {columns.record_shape()}, got {type(record).__name__}"
            )
        chat = _conversation(prompt, f"{where}, {place}: {columns.prompt!r}")
        if chat is None and (not isinstance(prompt, str) or not prompt.strip()):
            raise ConfigError(
                f"{where}, {place}: {columns.prompt!r} must be a non-empty string or a list of messages, got {prompt!r}"
            )
        if answer is not None:
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ConfigError(
                    f"{where}, {place}: {columns.answer!r} must be a string or a number, got {type(answer).__name__}"
                )
            answer = str(answer)
        texts.append(None if chat is not None else prompt)
        chats.append(chat)
        answers.append(answer)
        others.append(other)
    names = list(dict.fromkeys(name for other in others for name in other))
    table = {name: [other.get(name) for other in others] for name in names}
    return Prompts(texts, answers, table, chats)


def _without_last_replies(messages):
    """A ``messages`` conversation up to its last user turn (its trailing assistant replies dropped)."""
    if not isinstance(messages, list):
        return messages
    end = len(messages)
    while end and isinstance(messages[end - 1], dict) and messages[end - 1].get("role") == "assistant":
        end -= 1
    return messages[:end]


def _conversation(prompt, where: str) -> list[dict] | None:
    """``prompt`` as a list of messages, None when it is text; ``ConfigError`` for a malformed one."""
    if not isinstance(prompt, list):
        return None
    if not prompt:
        raise ConfigError(f"{where}: an empty conversation")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ConfigError(f"{where}: message {i} is not a {{'role': ..., 'content': ...}} object: {message!r}")
    return prompt


def exact_match(responses: list[str], answers: list[str | None]) -> list[float]:
    """1.0 where the response, stripped of surrounding whitespace, equals the answer."""
    return [float(a is not None and r.strip() == a.strip()) for r, a in zip(responses, answers)]
