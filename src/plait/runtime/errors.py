"""Errors the runtime raises in the caller when a rank fails."""

from __future__ import annotations

import signal
from typing import Callable

__all__ = ["RankError"]


class RankError(RuntimeError):
    """A rank raised, died, or stopped making progress while running a launched function.

    ``rank`` names it; ``summary`` says what happened to it in one line;
    ``remote_traceback`` is the traceback printed on that rank (empty when the
    process died without one, e.g. SIGKILL); ``exitcode`` is the process's exit
    status (negative: killed by that signal); ``host`` is where it ran
    (``"host 1 (10.213.0.2)"`` on the emulated cluster, ``"loopback"`` otherwise,
    None where unknown); ``others`` what the other ranks reported after it.
    """

    def __init__(self, rank: int, summary: str, remote_traceback: str = "",
                 exitcode: int | None = None, others: list[str] | None = None,
                 host: str | None = None):
        self.rank = rank
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.others = others or []
        self.host = host
        text = self.headline()
        if remote_traceback:
            text += f"\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        if self.others:
            text += "\n--- then ---\n" + "\n".join(self.others)
        super().__init__(text)

    def headline(self) -> str:
        """One line: which rank, where, what happened (what a command line prints)."""
        where = f" on {self.host}" if self.host and self.host != "loopback" else ""
        return f"rank {self.rank}{where} {self.summary}"

    def __reduce__(self):
        return (RankError, (self.rank, self.summary, self.remote_traceback, self.exitcode,
                            self.others, self.host))


# --- what the launcher makes of its ranks' reports (runtime.launch) -------------------------

def is_secondary(summary: str, tb: str) -> bool:
    """A failure that is the echo of another rank's (a peer hung up on it, or timed out on it)."""
    text = summary + tb
    return any(s in text for s in ("DistBackendError", "Connection closed by peer",
                                   "Connection reset by peer", "Broken pipe", "Timed out"))


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"died (killed by {signal.Signals(-code).name}) before returning"
    return f"died (exit code {code}) before returning"


def host_label(host) -> str:
    """``"host 1 (10.213.0.2)"`` for an emulated host, ``"loopback"`` otherwise."""
    return f"host {host.index} ({host.addr})" if host.netns is not None else "loopback"


def raise_first(failures: list, hosts: list[str]) -> None:
    """Raise the root cause of ``failures`` ((rank, summary, traceback, exitcode, exception)
    each): a death or a genuine exception beats the peers' "connection closed" echoes."""
    ordered = sorted(enumerate(failures),
                     key=lambda item: (is_secondary(item[1][1], item[1][2]), item[0]))
    rank, summary, tb, code, exc = ordered[0][1]
    others = [f"rank {r} {s}" for _, (r, s, *_rest) in ordered[1:]]
    raise RankError(rank, summary, tb, code, others, hosts[rank]) from exc


def all_timed_out(failures: list, hosts: list[str], last_op: Callable[[int], str | None]) -> list:
    """Every rank timed out and none died or stopped: the wire between them failed. Say so on
    the first, with each rank's host, its operator and which way it was waiting."""
    def way(summary: str) -> str:
        return "sending" if "send" in summary else "receiving" if "recv" in summary else "waiting"

    ranks = "; ".join(f"rank {r} on {hosts[r]} {way(s)}"
                      + (f" in {last_op(r)}" if last_op(r) else "")
                      for r, s, *_ in sorted(failures))
    rank, _, tb, code, exc = sorted(failures)[0][:5]
    summary = (f"timed out, as did every rank, and none died or stopped ({ranks}): the link "
               "between their hosts is down or stalled, or the timeout is too short for it")
    return [(rank, summary, tb, code, exc)]
