"""What ``chunks="auto"`` knows about the running group: measured once, the same on every rank.

A :class:`Calibration` holds the machine profile (compute rate, memory
bandwidth, α, per-piece overhead o, overlap slowdown k) and, per collective
kind, the time of one call at a few sizes. Collective time is not linear in
size on every transport: gloo's all_to_all of one 4 MiB message runs at about
half the link rate while 1 MiB pieces run near it (README, bench collectives),
so the curve is interpolated rather than fitted with one α–β line.

The pipeline it predicts, for p pieces of compute C and wire bytes V:

    c = C / p,   m = t_comm(V / p)
    T(p) = c + m + (p − 1)·(max(c + k·min(c, m), m) + o),   T(1) = C + t_comm(V)

(the same pipeline as :func:`plait.perf.pipeline.fused_time`, with the piece's
transfer read off the measured curve instead of an α–β line; k slows compute
only while a transfer runs beside it).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..perf.calibrate import MachineProfile
from ..runtime.compat import all_gather_into
from ..runtime.timing import agreed_max, median, sync, time_repeated
from .agree import meta_device

__all__ = ["Calibration", "measure", "from_profile", "CURVE_BYTES"]

CURVE_BYTES = (16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # wire bytes a rank sends


@dataclass(frozen=True)
class Calibration:
    profile: MachineProfile
    memory_Bps: float = 10e9
    curves: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def comm_time(self, kind: str, wire_bytes: float) -> float:
        """Seconds for one ``kind`` call moving ``wire_bytes`` per rank."""
        points = self.curves.get(kind) or self.curves.get("all_reduce")
        if not points:
            p = self.profile
            return p.base_latency_s + p.latency_s + wire_bytes / p.bandwidth_Bps
        sizes = [b for b, _ in points]
        if wire_bytes <= sizes[0]:
            return points[0][1] * max(wire_bytes, 1.0) / sizes[0] if wire_bytes else 0.0
        i = bisect.bisect_left(sizes, wire_bytes)
        if i == len(points):  # beyond the last point: the last segment's slope
            (b0, t0), (b1, t1) = points[-2], points[-1]
            return t1 + (wire_bytes - b1) * (t1 - t0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[i - 1], points[i]
        f = (math.log(wire_bytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
        return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))

    def compute_time(self, flops: float, memory_bytes: float = 0.0) -> float:
        return flops / max(self.profile.compute_flops, 1.0) + memory_bytes / self.memory_Bps

    def pipeline_time(self, t_compute: float, kind: str, wire_bytes: float, pieces: int) -> float:
        if pieces == 1:
            return t_compute + self.comm_time(kind, wire_bytes)
        c, m = t_compute / pieces, self.comm_time(kind, wire_bytes / pieces)
        k, o = self.profile.overlap_slowdown, self.profile.per_piece_overhead_s
        return c + m + (pieces - 1) * (max(c + k * min(c, m), m) + o)


def from_profile(profile: MachineProfile) -> Calibration:
    """A saved profile (``plait simulate --calibrate``) as a calibration: α–β curves only."""
    return Calibration(profile=profile)


def measure(group=None) -> Calibration:
    """Measure on the running group (≈ 1 s on a 1 Gbit/s link); every rank gets rank 0's."""
    n, dev = dist.get_world_size(group), meta_device(group)
    x, w = torch.randn(512, 2048, device=dev), torch.randn(2048, 1024, device=dev)
    out = torch.empty(512, 1024, device=dev)  # 2 MiB
    compute_s = _median(lambda: torch.matmul(x, w, out=out), group, 5)  # medians: this is a
    # shared machine, where a minimum is a lucky moment, not the rate the operator will see
    table = torch.randn(200_000, 64, device=dev)
    ids = torch.randint(0, table.shape[0], (65536,), device=dev)
    memory_s = _median(lambda: table.index_select(0, ids), group, 5)
    alpha = _fastest(lambda: dist.all_reduce(torch.zeros(8, device=dev), group=group), group, 10)
    curves = {kind: _curve(group, n, kind, dev) for kind in ("all_reduce", "all_to_all", "all_gather")}
    cal = Calibration(MachineProfile(latency_s=alpha, bandwidth_Bps=CURVE_BYTES[-1] / curves["all_reduce"][-1][1],
                                     compute_flops=2 * 512 * 2048 * 1024 / compute_s, world_size=n,
                                     source="measured on the running group (plait.ops.calibration)"),
                      memory_Bps=ids.numel() * table.shape[1] * 4 / memory_s, curves=curves)
    k, o = _pipeline_overheads(cal, x, w, out, compute_s, group)
    profile = MachineProfile(**{**cal.profile.to_dict(), "per_piece_overhead_s": o, "overlap_slowdown": k})
    return _agree(Calibration(profile, cal.memory_Bps, cal.curves), group)


def _curve(group, n: int, kind: str, dev) -> tuple[tuple[float, float], ...]:
    points = []
    for wire in CURVE_BYTES:
        if kind == "all_reduce":  # a ring all_reduce of S bytes puts 2(n−1)/n·S on the wire
            buf = torch.empty(max(1, int(wire / (2 * (n - 1) / n)) // 4), device=dev)
            t = _median(lambda: dist.all_reduce(buf, group=group), group, 3)
        elif kind == "all_gather":  # every rank sends its shard to n−1 peers
            shard = torch.empty(max(1, int(wire / (n - 1)) // 4), device=dev)
            gathered = torch.empty(shard.numel() * n, device=dev)
            t = _median(lambda: all_gather_into(gathered, shard, group=group), group, 3)
        else:  # all_to_all of S bytes sends (n−1)/n·S to the peers
            count = max(n, int(wire * n / (n - 1)) // 4 // n * n)
            send, recv = torch.empty(count, device=dev), torch.empty(count, device=dev)
            t = _median(lambda: dist.all_to_all_single(recv, send, group=group), group, 3)
        points.append((float(wire), t))
    return tuple(points)


def _pipeline_overheads(cal: Calibration, x, w, out, compute_s: float, group) -> tuple[float, float]:
    """k: how much slower the matmul runs while a transfer shares its cores (timed alone and
    under a 4 MiB all_reduce in flight); o: what a real 4-piece matmul + all_reduce
    pipeline takes beyond the model's prediction with that k and no overhead."""
    dev = meta_device(group)
    big = torch.empty(int(CURVE_BYTES[-1] / 4), device=dev)

    def under_transfer() -> float:
        work = dist.all_reduce(big, group=group, async_op=True)
        start = time.perf_counter()
        torch.matmul(x, w, out=out)
        sync(dev)
        elapsed = time.perf_counter() - start
        work.wait()
        return elapsed

    shared = sorted(_fastest_value(under_transfer, group) for _ in range(5))[2]
    # at most 1: the transport cannot take more than the core the GEMM runs on
    k = min(1.0, max(0.0, shared / compute_s - 1.0))
    n = dist.get_world_size(group)
    fitted = Calibration(replace(cal.profile, overlap_slowdown=k), cal.memory_Bps, cal.curves)

    def pipeline(pieces: int = 4) -> None:
        works, rows = [], out.shape[0] // pieces
        for lo in range(0, out.shape[0], rows):
            torch.matmul(x[lo:lo + rows], w, out=out[lo:lo + rows])
            works.append(dist.all_reduce(out[lo:lo + rows], group=group, async_op=True))
        for work in works:
            work.wait()

    # o: what a real 4-piece pipeline takes beyond the model with o = 0, per extra piece
    ideal = fitted.pipeline_time(compute_s, "all_reduce", out.numel() * 4 * 2 * (n - 1) / n, 4)
    o = max(0.0, (_fastest(pipeline, group, 5) - ideal) / 3)
    # at most one small (256 KiB) call: one more piece costs one more call, not more;
    # a larger residue is a scheduling accident during calibration, not a per-piece cost
    return k, min(o, cal.comm_time("all_reduce", CURVE_BYTES[1]))


def _times(fn, group, repeats: int) -> list[float]:
    """``repeats`` timed calls after one warm-up; each the slowest rank's."""
    dev = meta_device(group)
    fn()
    return time_repeated(fn, repeats, dev, group)


def _median(fn, group, repeats: int) -> float:
    return median(_times(fn, group, repeats))


def _fastest(fn, group, repeats: int) -> float:
    return min(_times(fn, group, repeats))


def _fastest_value(fn, group) -> float:
    """``fn()`` returns its own duration; the slowest rank's, after a barrier."""
    dist.barrier(group=group)
    return agreed_max([fn()], group, meta_device(group))[0]


def _agree(cal: Calibration, group) -> Calibration:
    """Rank 0's calibration everywhere, so every rank picks the same piece count."""
    if dist.get_world_size(group) == 1:
        return cal
    box = [cal]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]
