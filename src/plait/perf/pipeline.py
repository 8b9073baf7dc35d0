"""A fused compute-collective operator as a two-stage pipeline of pieces.

The operator's work is cut into ``p`` pieces; piece i's collective runs while
piece i+1 is computed (or, for gather-then-compute operators, piece i+1 is
received while piece i is computed: the same pipeline mirrored).  With

    c = t_compute / p                         (compute of one piece)
    m = (t_comm - a) / p + a                  (one piece's collective; a = its latency)

the operator takes

    T(p) = c + m + (p - 1) * max(c + k * min(c, m), m) + (p - 1) * o

the first piece's compute, the overlapped middle, the last piece's collective,
a per-piece overhead ``o`` (launch, stream/event sync, smaller and less
efficient kernels), and an overlap slowdown ``k``: compute that shares the
machine with a running collective goes 1 + k times slower while the collective
runs, i.e. for min(c, m) of each step (CPU cycles spent on the transport; on
GPUs, SMs and memory bandwidth taken by the collective).
T(1) = t_compute + t_comm exactly: one piece is the unfused operator.  The
physical limit is max(t_compute, t_comm).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .collectives import collective_time, piece_latency

__all__ = [
    "PipelineOverheads",
    "ChunkChoice",
    "fused_time",
    "unfused_time",
    "limit_time",
    "choose_chunks",
    "best_chunks",
    "DEFAULT_MIN_PIECE_BYTES",
]

DEFAULT_MIN_PIECE_BYTES = 64 * 1024  # below this a piece is latency-bound on every link


@dataclass(frozen=True)
class PipelineOverheads:
    """per_piece_overhead_s: o; overlap_slowdown: k; latency_s: default piece latency."""

    per_piece_overhead_s: float = 0.0
    overlap_slowdown: float = 0.0
    latency_s: float = 0.0


def _overhead(profile_or_overheads) -> float:
    if profile_or_overheads is None:
        return 0.0
    if isinstance(profile_or_overheads, (int, float)):
        return float(profile_or_overheads)
    return float(profile_or_overheads.per_piece_overhead_s)


def _slowdown(profile_or_overheads) -> float:
    return float(getattr(profile_or_overheads, "overlap_slowdown", 0.0) or 0.0)


def fused_time(t_compute_s, t_comm_s, chunks, profile_or_overheads=None, *,
               comm_latency_s=None):
    """Predicted seconds of the fused operator with ``chunks`` pieces.

    profile_or_overheads: a MachineProfile or PipelineOverheads (per_piece_overhead_s,
    overlap_slowdown and, unless ``comm_latency_s`` is given, latency_s as each
    piece's collective latency), a float per-piece overhead, or None (no
    overheads).  Works on numpy arrays.
    """
    p = np.maximum(np.asarray(chunks, dtype=float), 1.0)
    tc = np.asarray(t_compute_s, dtype=float)
    tm = np.asarray(t_comm_s, dtype=float)
    if comm_latency_s is None:
        comm_latency_s = getattr(profile_or_overheads, "latency_s", 0.0) or 0.0
    lat = np.minimum(np.asarray(comm_latency_s, dtype=float), tm)
    c = tc / p
    m = (tm - lat) / p + lat
    k = _slowdown(profile_or_overheads)
    t = c + m + (p - 1.0) * np.maximum(c + k * np.minimum(c, m), m) + (p - 1.0) * _overhead(profile_or_overheads)
    return float(t) if t.ndim == 0 else t


def unfused_time(t_compute_s: float, t_comm_s: float) -> float:
    """Compute, then the collective."""
    return t_compute_s + t_comm_s


def limit_time(t_compute_s: float, t_comm_s: float) -> float:
    """No schedule beats the slower of the two resources."""
    return max(t_compute_s, t_comm_s)


def best_chunks(t_compute_s: float, t_comm_s: float, profile_or_overheads=None, *,
                max_chunks: int = 16, comm_latency_s: float | None = None,
                tolerance: float = 0.01) -> tuple[int, float]:
    """(pieces in 1..max_chunks, predicted time): the fewest pieces within
    ``tolerance`` of the best prediction (a flat optimum is not worth extra
    pieces, each of which risks its overhead)."""
    times = [fused_time(t_compute_s, t_comm_s, p, profile_or_overheads, comm_latency_s=comm_latency_s)
             for p in range(1, max(1, max_chunks) + 1)]
    limit = min(times) * (1.0 + tolerance)
    best = next(i for i, t in enumerate(times) if t <= limit)
    return best + 1, float(times[best])


@dataclass(frozen=True)
class ChunkChoice:
    """What ``chunks="auto"`` decided and why.

    chunks: pieces to use (1 when not fused).
    fused: whether to take the fused path.
    reason: one human-readable line, shown in logs and benchmark output.
    t_pred_fused_s: predicted time at ``chunks`` pieces (== unfused when not fused).
    t_pred_unfused_s: predicted compute-then-collective time.
    t_pred_limit_s: max(compute, communication).
    """

    chunks: int
    fused: bool
    reason: str
    t_pred_fused_s: float
    t_pred_unfused_s: float
    t_pred_limit_s: float = 0.0


def _comm_time(comm_bytes: float, profile, collective: str | None, world_size: int | None):
    """(collective time, the latency each piece repeats)."""
    if collective is None:
        lat = getattr(profile, "base_latency_s", 0.0) + profile.latency_s
        return lat + comm_bytes / profile.bandwidth_Bps, lat
    if world_size is None:
        raise ValueError("choose_chunks: world_size is required when collective is given")
    return (collective_time(collective, comm_bytes, world_size, profile),
            piece_latency(collective, world_size, profile))


def choose_chunks(*, t_compute_s: float, comm_bytes: float, profile, max_chunks: int = 16,
                  min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES, collective: str | None = None,
                  world_size: int | None = None, min_gain: float = 0.02) -> ChunkChoice:
    """Best number of pieces for a fused operator, or the reason not to fuse.

    t_compute_s: predicted compute seconds of the whole operator on this rank
    (e.g. ``profile.compute_time_s(flops)``, or a measured time).
    comm_bytes: with ``collective`` None, the bytes this rank puts on the wire
    (one latency per call); with ``collective`` and ``world_size``, the
    nccl-tests size of that collective (all_reduce = buffer, all_gather = output...).
    profile: a MachineProfile (latency_s, bandwidth_Bps, per_piece_overhead_s).
    min_gain: fuse only if the prediction beats unfused by this fraction.
    Pure and cached: safe to call on every operator call.
    """
    if max_chunks < 1:
        raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
    return _choose(float(t_compute_s), float(comm_bytes), profile, int(max_chunks),
                   int(min_piece_bytes), collective, world_size, float(min_gain))


@functools.lru_cache(maxsize=4096)
def _choose(tc, comm_bytes, profile, max_chunks, min_piece_bytes, collective, world_size,
            min_gain) -> ChunkChoice:
    if world_size == 1:
        return ChunkChoice(1, False, "one rank: no collective to overlap", tc, tc, tc)
    if comm_bytes <= 0:
        return ChunkChoice(1, False, "no bytes to communicate", tc, tc, tc)
    tm, lat = _comm_time(comm_bytes, profile, collective, world_size)
    unfused, limit = unfused_time(tc, tm), limit_time(tc, tm)
    p_max = min(max_chunks, int(comm_bytes // max(min_piece_bytes, 1)))

    def no(reason: str) -> ChunkChoice:
        return ChunkChoice(1, False, reason, unfused, unfused, limit)

    if p_max < 2:
        return no(f"pieces would be under {min_piece_bytes} B ({comm_bytes:.0f} B to send)")
    times = {p: fused_time(tc, tm, p, profile, comm_latency_s=lat) for p in range(2, p_max + 1)}
    floor = min(times.values()) * 1.01  # a flat optimum: take the fewest pieces
    best = min(p for p, t in times.items() if t <= floor)
    gain = 1.0 - times[best] / unfused
    if gain < min_gain:
        if tm < 0.05 * tc:
            return no(f"communication negligible ({tm * 1e6:.1f} us vs compute {tc * 1e6:.1f} us)")
        if tc < 0.05 * tm:
            return no(f"compute negligible ({tc * 1e6:.1f} us vs communication {tm * 1e6:.1f} us)")
        return no(f"predicted gain {gain:.1%} at {best} pieces is below {min_gain:.0%} "
                  f"(per-piece overhead {_overhead(profile) * 1e6:.1f} us)")
    return ChunkChoice(best, True, f"{best} pieces: predicted {gain:.1%} faster than unfused",
                       times[best], unfused, limit)
