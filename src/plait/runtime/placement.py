"""Run one function (a training run, a benchmark) on N ranks, on loopback or an emulated
cluster, and say where it ran."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Sequence

from .slow.cgroup import parse_budgets, parse_host_cpu
from .cluster import EmulatedCluster, parse_rate
__all__ = ["HOST_CPU_ENV", "LOOPBACK", "run_placed"]


LOOPBACK = ("on loopback: every rank on this machine's loopback interface "
            "(pass --hosts N for an emulated cluster)")
HOST_CPU_ENV = "PLAIT_HOST_CPU"  # "1,0.5": what --host-cpu said (cli.common sets it)


def run_placed(fn: Callable[[Any], list[dict]], cfg: Any, *, ranks: int, hosts: int = 0,
               link: str | None = "1gbit", timeout_s: float | None = None,
               on_progress=None, slow=(),
               host_cpu: float | Sequence[float] | None = None) -> tuple[list[dict], str]:
    """``fn(cfg)`` on every rank; rank 0's records and a line saying where it ran.

    ``host_cpu``: each host's CPU budget in cores (runtime.slow.cgroup); None takes
    ``PLAIT_HOST_CPU`` where the command line set it, else no budget.
    ``cfg.extra`` gains ``link``, ``hosts`` and ``host_cpu`` so every record says where it
    was measured.
    """
    from .launch import launch  # torch: here, not where the command line parses flags

    if ranks < 1:
        raise ValueError(f"world size must be at least 1, got {ranks}")
    parse_rate(link)  # refuse a bad rate before anything starts
    if host_cpu is None and os.environ.get(HOST_CPU_ENV):
        host_cpu = parse_host_cpu(os.environ[HOST_CPU_ENV])
    if not hosts:
        if host_cpu is not None:
            raise ValueError("a CPU budget per host needs an emulated cluster (hosts > 0)")
        cfg = replace(cfg, extra={**cfg.extra, "link": "loopback", "hosts": 0})
        records = launch(fn, ranks, args=(cfg,), timeout_s=timeout_s, on_progress=on_progress,
                         slow=slow)[0]
        return records, LOOPBACK
    if ranks % hosts:
        raise ValueError(f"{ranks} ranks do not divide over {hosts} hosts")
    budgets = parse_budgets(host_cpu, hosts)
    with EmulatedCluster(hosts=hosts, link=link, cpu=budgets) as cluster:
        extra = {**cfg.extra, "link": cluster.link_label,
                 "hosts": hosts if cluster.emulated else 0}
        if budgets:
            extra["host_cpu"] = budgets
        cfg = replace(cfg, extra=extra)
        records = launch(fn, ranks, args=(cfg,), cluster=cluster, timeout_s=timeout_s,
                         on_progress=on_progress, slow=slow)[0]
        return records, cluster.describe()
