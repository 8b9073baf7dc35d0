"""What a config dataclass field carries for the command line: its ``--help`` text."""

from __future__ import annotations

__all__ = ["help_meta"]


def help_meta(text: str) -> dict:
    """``field(metadata=help_meta("…"))``: the flag's help (``plait.cli.args`` reads it)."""
    return {"help": text}
