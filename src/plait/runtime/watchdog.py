"""The launcher's watchdog: ends a run that stops making progress, and says which rank stopped.

It runs in the launcher, which keeps the ordinary scheduler whatever the ranks'
communication threads get (runtime.priority), so it runs even when a rank's own
collective timeout cannot fire. Two things it watches:

- progress: each rank's counter on the :class:`~plait.runtime.progress.ProgressBoard`
  (plait's operators and ``rank_context().report`` mark it). Once any rank has
  marked, a run in which no rank marks anything for the collective timeout plus
  ``GRACE_S`` is stopped; a run that never marks (a function with no plait
  operator) is left to its deadline.
- the processes: a rank whose process is stopped (SIGSTOP, a debugger) or the
  one furthest behind is the one named when the others give up waiting on it.
"""

from __future__ import annotations

import time

from .progress import ProgressBoard

__all__ = ["Watchdog", "GRACE_S", "process_state"]

GRACE_S = 10.0
"""Beyond the collective timeout, how long a run may go without any rank's progress."""

_STATES = {"T": "its process is stopped (SIGSTOP or a debugger)", "t": "its process is traced",
           "D": "its process waits in the kernel (uninterruptible)", "Z": "its process is a zombie"}


def process_state(pid: int | None) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, …) from /proc, None if unknown."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class Watchdog:
    """Owned by one launch; ``expired(now)`` is polled by the launcher's loop."""

    def __init__(self, board: ProgressBoard, world_size: int, timeout_s: float,
                 grace_s: float = GRACE_S):
        self.board = board
        self.world_size = world_size
        self.grace_s = grace_s
        self.timeout_s = timeout_s
        self.limit_s = timeout_s + grace_s
        self._counts = [0] * world_size
        self._changed_at = [time.monotonic()] * world_size

    def poll(self, now: float) -> None:
        for rank in range(self.world_size):
            count = self.board.count(rank)
            if count != self._counts[rank]:
                self._counts[rank] = count
                self._changed_at[rank] = now

    def expired(self, now: float) -> bool:
        """True when some rank has marked progress but none has for ``limit_s``."""
        self.poll(now)
        if not any(self._counts):
            return False
        return now - max(self._changed_at) > self.limit_s

    def marked(self, rank: int) -> bool:
        """Whether ``rank`` has marked any progress yet."""
        return self.board.count(rank) > 0

    def quiet_s(self, rank: int, now: float) -> float:
        """Seconds since ``rank`` last marked progress (since the watch began if never)."""
        self.poll(now)
        return now - self._changed_at[rank]

    def blame(self, ranks: list[int], pids: dict[int, int | None], now: float) -> tuple[int, str]:
        """Of ``ranks`` (those that never answered), the one to name and why: a stopped
        process first, else the one with the least progress, then the one quiet longest."""
        self.poll(now)

        def key(rank: int):
            stopped = process_state(pids.get(rank)) in ("T", "t")
            return (not stopped, self._counts[rank], self._changed_at[rank], rank)

        rank = min(ranks, key=key)
        state = process_state(pids.get(rank))
        why = _STATES.get(state or "", "it made no progress")
        where = self.board.last_op(rank)
        quiet = now - self._changed_at[rank]
        text = f"stopped answering: {why}"
        text += f", last in {where}" if where else ""
        text += f", no progress for {quiet:.0f} s"
        return rank, text
