"""What the user asked of the transport: which one (``--transport``, ``PLAIT_TRANSPORT``) and
how the operators' cross-rank checks travel (``PLAIT_CHECKS``); read without importing
torch, so the command line refuses a wrong name at once (``select`` chooses)."""

from __future__ import annotations

import os

__all__ = ["TRANSPORTS", "ENV", "wanted", "CHECKS", "checks_from_env"]

TRANSPORTS = ("auto", "shm", "gloo")
ENV = "PLAIT_TRANSPORT"


def wanted() -> str:
    """The transport asked for: ``PLAIT_TRANSPORT`` (``auto`` when unset)."""
    value = os.environ.get(ENV, "auto") or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"{ENV}={value!r}: choose one of {', '.join(TRANSPORTS)}")
    return value


CHECKS = ("carried", "gather")


def checks_from_env() -> str:
    """``PLAIT_CHECKS`` (``carried`` when unset: in the data calls' headers where the transport
    carries them), refused where it is neither."""
    value = os.environ.get("PLAIT_CHECKS", "carried") or "carried"
    if value not in CHECKS:
        raise ValueError(f"PLAIT_CHECKS={value!r}: choose one of {', '.join(CHECKS)}")
    return value
