"""What a launched rank knows about where it runs: one object, set once per process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from . import current
from .cluster import Host
from .dist import Topology
from .progress import ProgressBoard
from .slow.straggler import Straggler

__all__ = ["RankContext", "rank_context"]


@dataclass
class RankContext:
    """Owned by the launcher's worker for the lifetime of the rank process."""

    topology: Topology
    host: Host
    link: str  # "loopback" or a tc rate such as "1gbit"
    straggler: Straggler = field(default_factory=lambda: Straggler([], 0))
    reporter: Callable[[Any], None] | None = None
    progress: ProgressBoard | None = None  # the launcher's watchdog reads it (runtime.progress)

    def report(self, payload: Any) -> None:
        """Send ``payload`` to the launcher's ``on_progress`` (a no-op outside ``launch``);
        a report counts as progress for the launcher's watchdog."""
        if self.progress is not None:
            self.progress.mark(self.topology.rank)
        if self.reporter is not None:
            self.reporter(payload)


def rank_context() -> RankContext:
    """The context of this rank. Outside ``launch`` (under torchrun or ``plait cluster run``)
    it is built from the environment: PLAIT_SLOW (``1:2,3:1.5@10-20``) and PLAIT_LINK."""
    if current.get() is None:
        import os

        from .dist import topology
        from .slow.straggler import parse_slow

        topo = topology()
        specs = [parse_slow(s) for s in os.environ.get("PLAIT_SLOW", "").split(",") if s]
        current.put(RankContext(topo, Host(0, None, "lo", "127.0.0.1"),
                                os.environ.get("PLAIT_LINK", "loopback"),
                                Straggler(specs, topo.rank)))
    return current.get()


def _set_rank_context(ctx: RankContext | None) -> None:
    current.put(ctx)
