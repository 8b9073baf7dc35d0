"""Collective costs in the alpha-beta form, with nccl-tests' conventions.

A collective of ``nbytes`` over ``n`` ranks costs

    t = base + steps(coll, n) * alpha + wire(coll, n) * nbytes / B

where ``B`` is the effective per-direction bandwidth of one rank, ``alpha`` the
per-step latency, and ``wire`` the bytes each rank puts on the wire per byte of
``nbytes``.  Sizes follow nccl-tests (doc/PERFORMANCE.md): all_reduce = buffer
size, all_gather = total output, reduce_scatter = total input, all_to_all =
total bytes a rank sends.  Bus bandwidth = (nbytes / t) * bus_factor.

Two protocols are modelled as NCCL does (src/graph/tuning.cc): a low-latency
one (LL, half the bandwidth, small per-step latency) and the bandwidth one
(Simple); a call costs the cheaper of the two.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "COLLECTIVES",
    "AlphaBeta",
    "bus_factor",
    "wire_factor",
    "latency_steps",
    "collective_time",
    "hierarchical_time",
    "bus_bandwidth",
    "piece_latency",
    "curve_time",
]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven")
ALGORITHMS = ("ring", "tree", "two_shot")
_TREE_BW = 0.92  # NCCL tuning.cc: tree all_reduce busBw *= .92


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """Latency/bandwidth constants of one link class.

    latency_s: per-step latency of the bandwidth protocol.
    bandwidth_Bps: effective per-direction bandwidth of one rank.
    base_s: fixed cost of one call.
    ll_latency_s: per-step latency of the low-latency protocol; None = no LL.
    ll_bandwidth_factor: LL's fraction of bandwidth (NCCL: 0.5).
    peer_s: cost of posting one peer's message in an all_to_all, whose n-1
        sends go out concurrently (NCCL tuning.cc getNetOverhead: 1 us on x86).
    """

    latency_s: float
    bandwidth_Bps: float
    base_s: float = 0.0
    ll_latency_s: float | None = None
    ll_bandwidth_factor: float = 0.5
    peer_s: float = 0.0

    @classmethod
    def of(cls, link) -> "AlphaBeta":
        """From a hardware.Link, a MachineProfile, or an AlphaBeta."""
        if isinstance(link, AlphaBeta):
            return link
        if hasattr(link, "effective_bw_Bps"):  # hardware.Link
            return cls(latency_s=link.latency_s, bandwidth_Bps=link.effective_bw_Bps,
                       base_s=link.base_s, ll_latency_s=link.ll_latency_s, peer_s=1e-6)
        return cls(latency_s=link.latency_s, bandwidth_Bps=link.bandwidth_Bps,
                   base_s=getattr(link, "base_latency_s", 0.0))


def _check(collective: str, n: int) -> str:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(COLLECTIVES)}")
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    return "all_to_all" if collective == "all_to_all_uneven" else collective


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: all_reduce 2(n-1)/n, others (n-1)/n."""
    collective = _check(collective, n)
    return 2.0 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def wire_factor(collective: str, n: int, algo: str = "ring") -> float:
    """Bytes a rank sends per byte of the nccl-tests size."""
    collective = _check(collective, n)
    if collective == "all_reduce" and algo == "tree":
        return 2.0 / _TREE_BW * (n - 1) / n if n > 1 else 0.0
    return bus_factor(collective, n)


def latency_steps(collective: str, n: int, algo: str = "ring") -> int:
    """Sequential latency steps of one call (all_to_all: one round of concurrent sends)."""
    collective = _check(collective, n)
    if n == 1:
        return 0
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algo!r}; known: {', '.join(ALGORITHMS)}")
    if collective == "all_reduce":
        if algo == "tree":
            return 2 * math.ceil(math.log2(n))
        return 2 if algo == "two_shot" else 2 * (n - 1)
    if collective == "all_to_all":
        return 1
    return 1 if algo == "two_shot" else n - 1


def collective_time(collective: str, nbytes: float, n: int, link, *, algo: str = "ring") -> float:
    """Seconds for one collective; ``link`` is a Link, MachineProfile or AlphaBeta.

    ``algo="best"`` takes the cheapest of ring, tree and two_shot (all_reduce).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if hasattr(link, "for_collective"):  # a calibrated profile with per-collective constants
        link = link.for_collective(collective)
    collective = _check(collective, n)
    if n == 1:
        return 0.0
    ab = AlphaBeta.of(link)
    if algo == "best":
        algos = ALGORITHMS if collective == "all_reduce" else ("ring",)
        return min(collective_time(collective, nbytes, n, ab, algo=a) for a in algos)
    steps = latency_steps(collective, n, algo)
    volume = wire_factor(collective, n, algo) * nbytes
    t = ab.base_s + steps * ab.latency_s + volume / ab.bandwidth_Bps
    if ab.ll_latency_s is not None:
        t_ll = ab.base_s + steps * ab.ll_latency_s + volume / (ab.bandwidth_Bps * ab.ll_bandwidth_factor)
        t = min(t, t_ll)
    if collective == "all_to_all":
        t += (n - 1) * ab.peer_s
    return t


def hierarchical_time(collective: str, nbytes: float, *, local: int, nodes: int,
                      intra, inter) -> float:
    """Two-level collective: ``local`` ranks per node on ``intra``, ``nodes`` nodes on ``inter``.

    all_reduce = intra reduce_scatter + inter all_reduce on 1/local of the data
    (one NIC per GPU, ``local`` rings in parallel) + intra all_gather.
    all_gather / reduce_scatter = inter phase on 1/local of the data + intra phase.
    all_to_all = the intra and inter shares of the traffic move concurrently.
    """
    collective = _check(collective, local * nodes)
    if hasattr(intra, "for_group"):
        intra = intra.for_group(local)
    if nodes == 1:
        return collective_time(collective, nbytes, local, intra)
    if local == 1:
        algo = "best" if collective == "all_reduce" else "ring"
        return collective_time(collective, nbytes, nodes, inter, algo=algo)
    if collective == "all_reduce":
        return (collective_time("reduce_scatter", nbytes, local, intra)
                + collective_time("all_reduce", nbytes / local, nodes, inter, algo="best")
                + collective_time("all_gather", nbytes, local, intra))
    if collective in ("all_gather", "reduce_scatter"):
        return (collective_time(collective, nbytes / local, nodes, inter)
                + collective_time(collective, nbytes, local, intra))
    n = local * nodes
    intra_share = nbytes * (local - 1) / n  # bytes to peers on this node
    inter_share = nbytes * (nodes - 1) * local / n
    ab_i, ab_e = AlphaBeta.of(intra), AlphaBeta.of(inter)
    t_intra = collective_time("all_to_all", intra_share * local / (local - 1), local, ab_i)
    t_inter = (ab_e.base_s + ab_e.latency_s + (n - local) * ab_e.peer_s
               + inter_share / ab_e.bandwidth_Bps)
    return max(t_intra, t_inter)


def bus_bandwidth(collective: str, nbytes: float, n: int, time_s: float) -> float:
    """nccl-tests bus bandwidth in bytes/s."""
    return nbytes / time_s * bus_factor(collective, n)


def piece_latency(collective: str, n: int, link, *, nodes: int = 1) -> float:
    """Latency each piece of a fused operator pays again.

    A piece of a reduction or gather is a whole (smaller) collective, so it pays
    the full latency.  An all_to_all is cut by destination: a piece posts its own
    peers' messages, so it repeats only the call and hop latency, not the
    per-peer posting cost (that is split among the pieces like bandwidth).
    """
    if hasattr(link, "for_collective"):
        link = link.for_collective(collective)
    collective = _check(collective, n)
    if n == 1:
        return 0.0
    t = collective_time(collective, 0.0, n, link)
    if collective == "all_to_all":
        t -= (n - 1) * AlphaBeta.of(link).peer_s
    return t


def curve_time(points: Sequence[tuple[float, float]], size: float) -> float:
    """Seconds at ``size`` on a measured curve of (size, seconds) points, sorted by size:
    interpolated in log size and log time (a transport is not linear in size on every
    link: gloo's single 4 MiB all_to_all runs at about half the rate of 1 MiB pieces),
    proportional below the first point, along the last segment beyond the last."""
    if not points:
        raise ValueError("curve_time: an empty curve")
    sizes = [b for b, _ in points]
    if size <= sizes[0]:
        return points[0][1] * max(size, 1.0) / sizes[0] if size > 0 else 0.0
    if len(points) == 1:
        return points[0][1] * size / sizes[0]
    i = bisect.bisect_left(sizes, size)
    if i == len(points):
        (b0, t0), (b1, t1) = points[-2], points[-1]
        return t1 + (size - b1) * (t1 - t0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[i - 1], points[i]
    f = (math.log(size) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
