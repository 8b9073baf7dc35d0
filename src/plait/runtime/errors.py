"""Errors the runtime raises in the caller when a rank fails."""

from __future__ import annotations

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
