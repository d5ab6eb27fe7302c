"""Whether a local model folder can be loaded: its ``config.json`` and its tokenizer's files.

Standard library only: the ``ppo-fast`` launcher (``ppo_fast_cli.py``) loads this file on
its own to report a bad ``--model-name-or-path``/``--reward-model`` folder before torch is
imported; ``ppo_fast.trainer.models.check_pretrained`` asks the same for Python callers.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# A tokenizer that AutoTokenizer can load without converting: the fast tokenizer's file, or a
# slow tokenizer's vocabulary (SentencePiece, WordPiece, byte-level BPE with its merges).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt")
BPE_FILES = ("vocab.json", "merges.txt")


def looks_local(name: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything else is meant as a local folder."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def problem(option: str, name: str, tokenizer: bool = True) -> str | None:
    """Why the folder ``name`` cannot be loaded, or None when it looks complete (or is not a
    local folder: a hub id is resolved later, by transformers)."""
    path = Path(name).expanduser()
    if not path.exists():
        if looks_local(name):
            return f"{option} {name}: no such directory (relative paths start from {os.getcwd()})"
        return None
    if not path.is_dir():
        return f"{option} {name}: is a file; give the folder written by save_pretrained()"
    if not (path / "config.json").is_file():
        return f"{option} {name}: no config.json in this folder; give the folder written by save_pretrained()"
    if tokenizer and not _has_tokenizer(path):
        present = [f for f in BPE_FILES if (path / f).is_file()]
        missing = (
            f"{' and '.join(f for f in BPE_FILES if f not in present)} (next to {present[0]})"
            if present
            else f"tokenizer.json (or another tokenizer's files: {', '.join(TOKENIZER_FILES[1:])}, "
            f"or {' + '.join(BPE_FILES)})"
        )
        return (
            f"{option} {name}: no tokenizer in this folder: {missing} is missing; save the tokenizer there "
            "too (tokenizer.save_pretrained(folder))"
        )
    return None


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES) or all((path / f).is_file() for f in BPE_FILES)


# The bytes of each weight file read for its fingerprint: its start (a safetensors header names every
# tensor's dtype, shape and offset) and its end, so two trainings of one architecture differ.
_FINGERPRINT_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def fingerprint(name: str) -> str | None:
    """A short hash of a local model folder's ``config.json`` and its weight files (their names and
    sizes, and a MiB at each end of each): what ``--resume`` compares to tell another base model of the
    same architecture apart; None where ``name`` is not a local folder."""
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        return None
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for weights in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as file:
            digest.update(file.read(_FINGERPRINT_BYTES))
            file.seek(max(size - _FINGERPRINT_BYTES, 0))
            digest.update(file.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]
