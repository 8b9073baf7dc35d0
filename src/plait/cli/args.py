"""Typed config dataclasses ⇄ argparse: one source for defaults, types and --help."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from .common import finite_float

__all__ = ["add_dataclass_args", "dataclass_from_args"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field whose metadata has a ``help``; tuples become comma-separated lists;
    a float must be finite (nan and inf pass every ``x <= 0`` check in ``__post_init__``)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        help_text = f.metadata.get("help")
        if f.name in skip or help_text is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        hint = hints[f.name]
        said = _default_text(default, help_text)
        if hint is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                default=None, help=f"{help_text}{said}")
            continue
        if typing.get_origin(hint) is tuple:
            parser.add_argument(_flag(f.name), default=None, metavar="A,B,…",
                                help=f"{help_text}{said}")
            continue
        base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        parser.add_argument(_flag(f.name), type=finite_float if base is float else base,
                            default=None, help=f"{help_text}{said}")


def _default_text(default, help_text: str) -> str:
    """`` (default: X)`` after a flag's help; nothing where the help states its own default
    or there is none to state (None, an empty list: the flag unset)."""
    if "default" in help_text or default is None or default == ():
        return ""
    if isinstance(default, tuple):
        return f" (default: {','.join(map(str, default))})"
    return f" (default: {default})"


def dataclass_from_args(cls: type, args: argparse.Namespace, defaults: dict | None = None):
    """Build ``cls`` from the flags the user gave; an unset flag takes ``defaults`` (e.g. the
    ``--quick`` preset), then the dataclass default."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if typing.get_origin(hints[f.name]) is tuple and isinstance(value, str):
            value = tuple(v.strip() for v in value.split(",") if v.strip())
            if typing.get_args(hints[f.name])[:1] == (int,):  # named here, not by int()
                bad = [v for v in value if not v.lstrip("+-").isdigit()]
                if bad:
                    raise ValueError(f"{_flag(f.name)}: {bad[0]!r} is not a whole number")
                value = tuple(int(v) for v in value)
        values[f.name] = value
    return cls(**{**(defaults or {}), **values})
