"""Run one benchmark function on N ranks, on loopback or an emulated cluster."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ..runtime import EmulatedCluster, launch, parse_rate

__all__ = ["LOOPBACK", "run_placed"]


LOOPBACK = ("on loopback: every rank on this machine's loopback interface "
            "(pass --hosts N for an emulated cluster)")


def run_placed(fn: Callable[[Any], list[dict]], cfg: Any, *, ranks: int, hosts: int = 0,
               link: str | None = "1gbit", timeout_s: float | None = None,
               on_progress=None, slow=()) -> tuple[list[dict], str]:
    """``fn(cfg)`` on every rank; rank 0's records and a line saying where it ran.

    ``cfg.extra`` gains ``link`` and ``hosts`` so every record says where it was measured.
    """
    if ranks < 1:
        raise ValueError(f"world size must be at least 1, got {ranks}")
    parse_rate(link)  # refuse a bad rate before anything starts
    if not hosts:
        cfg = replace(cfg, extra={**cfg.extra, "link": "loopback", "hosts": 0})
        records = launch(fn, ranks, args=(cfg,), timeout_s=timeout_s, on_progress=on_progress,
                         slow=slow)[0]
        return records, LOOPBACK
    if ranks % hosts:
        raise ValueError(f"{ranks} ranks do not divide over {hosts} hosts")
    with EmulatedCluster(hosts=hosts, link=link) as cluster:
        cfg = replace(cfg, extra={**cfg.extra, "link": cluster.link_label,
                                  "hosts": hosts if cluster.emulated else 0})
        records = launch(fn, ranks, args=(cfg,), cluster=cluster, timeout_s=timeout_s,
                         on_progress=on_progress, slow=slow)[0]
        return records, cluster.describe()
