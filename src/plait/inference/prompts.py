"""``plait generate``'s prompts: token ids from ``--prompt-ids`` or ``--prompt-file``, or
text through the tokenizer saved beside a checkpoint; each mistake refused in one line
naming its flag (and line), before torch or any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

from .config import MODELS

__all__ = ["read_prompts", "text_prompts", "tokenizer_of"]


def tokenizer_of(model: str):
    """The tokenizer saved beside a checkpoint directory's model, or None (a model plait
    builds from a config, or a checkpoint saved without one)."""
    if model in MODELS:
        return None
    folder = Path(model)
    if not any((folder / name).is_file() for name in
               ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {model}: its tokenizer does not load: "
                         f"{str(err).splitlines()[0]}") from None


def text_prompts(texts, model: str, tokenizer) -> tuple[tuple[int, ...], ...]:
    """``--prompt``'s texts as token ids (its tokenizer's); refused in one line where the
    model has none."""
    if tokenizer is None:
        where = "a model built from a config" if model in MODELS else model
        raise ValueError(f"--prompt takes text, and {where} has no tokenizer (save one beside "
                         "the model with tokenizer.save_pretrained); give token ids with "
                         "--prompt-ids")
    rows = tuple(tuple(tokenizer(text)["input_ids"]) for text in texts)
    if any(not row for row in rows):
        raise ValueError("--prompt: a text that gives no tokens")
    return rows


def read_prompts(text: str | None, path: str | None) -> tuple[tuple[int, ...], ...]:
    """Prompts from ``--prompt-ids`` ("1 2 3") or ``--prompt-file`` (one prompt a line, ids
    by spaces or commas; or a JSON list of lists); a ValueError naming the line."""
    if text is not None and path is not None:
        raise ValueError("give --prompt-ids or --prompt-file, not both")
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--prompt-file {path}: "
                             f"{'a folder' if file.is_dir() else 'no such file'}")
        raw = file.read_text()
        if raw.lstrip().startswith("["):
            try:
                rows = json.loads(raw)
                return tuple(tuple(int(t) for t in row) for row in rows)
            except (ValueError, TypeError) as err:
                raise ValueError(f"--prompt-file {path}: not a JSON list of lists of token "
                                 f"ids ({err})") from None
        lines = [ln for ln in raw.splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"--prompt-file {path}: no prompt in it")
        return tuple(_ids(ln, f"--prompt-file {path} line {i + 1}")
                     for i, ln in enumerate(lines))
    return (_ids(text if text is not None else "1 2 3 4", "--prompt-ids"),)


def _ids(line: str, where: str) -> tuple[int, ...]:
    parts = line.replace(",", " ").split()
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        bad = next(p for p in parts if not p.lstrip("-").isdigit())
        raise ValueError(f"{where}: {bad!r} is not a token id (prompts are token ids, "
                         "separated by spaces)") from None
