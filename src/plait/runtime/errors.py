"""Errors the runtime raises in the caller when a rank fails."""

from __future__ import annotations

__all__ = ["RankError"]


class RankError(RuntimeError):
    """A rank raised, or died, while running a launched function.

    ``rank`` names it; ``remote_traceback`` is the traceback printed on that
    rank (empty when the process died without one, e.g. SIGKILL);
    ``exitcode`` is the process's exit status (negative: killed by that signal).
    """

    def __init__(self, rank: int, summary: str, remote_traceback: str = "",
                 exitcode: int | None = None, others: list[str] | None = None):
        self.rank = rank
        self.summary = summary
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.others = others or []
        text = f"rank {rank} {summary}"
        if remote_traceback:
            text += f"\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        if self.others:
            text += "\n--- then ---\n" + "\n".join(self.others)
        super().__init__(text)

    def __reduce__(self):
        return (RankError, (self.rank, self.summary, self.remote_traceback, self.exitcode, self.others))
