"""The rank's context slot: set once per rank process (``plait.runtime.context``), read here
by what the context itself holds or is below it (progress marks, the compute clock), which
must not import the context.

Outside a launched rank (torchrun, ``plait cluster run``) the slot stays empty until
``rank_context()`` builds a context from the environment.
"""

from __future__ import annotations

from typing import Any

__all__ = ["get", "put"]

_current: Any = None  # a plait.runtime.context.RankContext, or None


def get() -> Any:
    """This rank's context, or None where none is set."""
    return _current


def put(ctx: Any) -> None:
    """Set (or, with None, clear) this rank's context."""
    global _current
    _current = ctx
