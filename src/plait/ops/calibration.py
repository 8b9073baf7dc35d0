"""What ``chunks="auto"`` knows about the running group: measured once, the same on every rank.

:func:`measure` fills a :class:`plait.perf.pieces.Calibration` (the pieces
model's view of a machine, pure data) on the running group. It holds the machine profile (compute rate, memory
bandwidth, α, per-piece overhead o, overlap slowdown k), per collective
kind, the time of one call at a few sizes, and the GEMM rate by output
shape: small pieces run slower than the whole (on this machine's CPU a
128-row piece of a 2048-wide GEMM at half the rate of a 512-row one), which
is what makes too many pieces lose. Collective time is not linear in
size on every transport: gloo's all_to_all of one 4 MiB message runs at about
half the link rate while 1 MiB pieces run near it (README, bench collectives),
so the curve is interpolated rather than fitted with one α–β line.

:mod:`plait.perf.pieces` walks an operator's pieces through compute and wire
with these figures.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..perf.calibrate import MachineProfile
from ..perf.pieces import GEMM_K, GEMM_ROWS, GEMM_WIDTHS, Calibration, Work, from_profile, predict
from ..runtime.compat import all_gather_into
from ..runtime.timing import agreed_max, median, sync, time_interleaved, time_repeated
from .agree import meta_device

__all__ = ["Calibration", "measure", "from_profile", "CURVE_BYTES", "GEMM_ROWS", "GEMM_WIDTHS"]

CURVE_BYTES = (16 * 1024, 256 * 1024, 1024 * 1024, 4 * 1024 * 1024)  # wire bytes a rank sends
ROUNDS = 5  # timed rounds; each round times every figure once, and each figure is its median


def measure(group=None) -> Calibration:
    """Measure on the running group (≈ 1 s on a 1 Gbit/s link); every rank gets rank 0's.

    The compute figures (one GEMM, the pooled lookups, the GEMM rate table) are timed in
    interleaved rounds, every figure once a round, and so are the collective curves: a
    slow stretch of a shared machine then lands on one round of every figure, not on
    every repeat of some of them. Timed one after the other, a stretch at 60 % of the
    usual rate once covered all but the largest rows of the table, and auto picked 2
    pieces where 8 was 20 % faster (README, simulate --validate)."""
    n, dev = dist.get_world_size(group), meta_device(group)
    x, w = torch.randn(512, 2048, device=dev), torch.randn(2048, 1024, device=dev)
    out = torch.empty(512, 1024, device=dev)  # 2 MiB
    # pooled lookups as the embedding operator makes them (8 ids a bag); index_select, timed
    # before, allocates its output each call and swung 0.3-4.4 GB/s between calibrations
    table = torch.randn(200_000, 64, device=dev)
    ids = torch.randint(0, table.shape[0], (65536,), device=dev)
    bags = torch.arange(0, ids.numel(), 8, device=dev)
    cells = _gemm_cells(dev)
    # medians: this is a shared machine, where a minimum is a lucky moment, not the rate
    # the operator will see
    compute = _interleaved({"gemm": lambda: torch.matmul(x, w, out=out),
                            "lookups": lambda: F.embedding_bag(ids, table, bags, mode="sum"),
                            **{key: run for key, (run, _) in cells.items()}}, group)
    alpha = _fastest(lambda: dist.all_reduce(torch.zeros(8, device=dev), group=group), group, 10)
    curves = _curves(group, n, dev)
    gemm = tuple(tuple(cells[(rows, width)][1] / compute[(rows, width)] for width in GEMM_WIDTHS)
                 for rows in GEMM_ROWS)
    cal = Calibration(MachineProfile(latency_s=alpha, bandwidth_Bps=CURVE_BYTES[-1] / curves["all_reduce"][-1][1],
                                     compute_flops=2 * 512 * 2048 * 1024 / compute["gemm"], world_size=n,
                                     source="measured on the running group (plait.ops.calibration)"),
                      memory_Bps=ids.numel() * table.shape[1] * 4 / compute["lookups"], curves=curves,
                      gemm=gemm)
    k, o = _pipeline_overheads(cal, x, w, out, group)
    profile = MachineProfile(**{**cal.profile.to_dict(), "per_piece_overhead_s": o, "overlap_slowdown": k})
    return _agree(replace(cal, profile=profile), group)


CELL_FLOPS = 2 * 128 * GEMM_K * 2048  # a smaller GEMM is repeated back to back up to this


def _gemm_cells(dev) -> dict:
    """(rows, width) → (a function running [rows, GEMM_K] @ [GEMM_K, width] back to back
    until it has done CELL_FLOPS, the flops it does). The pieces of an operator run back
    to back; timed one call after a barrier, a small GEMM also paid for whatever the
    barrier left running on its core (a 128-row cell 20-30 % under the 512-row one across
    ranks, within 1 % in one quiet process), and 8 pieces looked slow where they were not."""
    x = torch.randn(GEMM_ROWS[-1], GEMM_K, device=dev)
    out = torch.empty(GEMM_ROWS[-1] * GEMM_WIDTHS[-1], device=dev)
    weights = {width: torch.randn(GEMM_K, width, device=dev) for width in GEMM_WIDTHS}

    def cell(rows, width):
        a, b, y = x[:rows], weights[width], out[:rows * width].view(rows, width)
        calls = max(1, CELL_FLOPS // (2 * rows * GEMM_K * width))

        def run():
            for _ in range(calls):
                torch.matmul(a, b, out=y)
        return run, 2.0 * rows * GEMM_K * width * calls
    return {(rows, width): cell(rows, width) for rows in GEMM_ROWS for width in GEMM_WIDTHS}


def _curves(group, n: int, dev) -> dict[str, tuple[tuple[float, float], ...]]:
    """Per kind, seconds per call at each size of CURVE_BYTES, the calls issued as a fused
    operator issues its pieces: back to back, async, up to the largest size's bytes in all
    (at most 8 calls), then waited for; the time per call is the total over the calls. One
    isolated call is slower per byte than the same call among others in flight, and gloo's
    single large all_to_all swings between about half and the whole link rate from one
    calibration to the next, which made pieces look slower than the call they cut."""
    kinds = ("all_reduce", "all_to_all", "all_gather")
    def point(kind, wire):
        calls = [_one_call(group, n, kind, wire, dev)
                 for _ in range(max(1, min(8, CURVE_BYTES[-1] // wire)))]

        def pipelined():
            for work in [call() for call in calls]:
                work.wait()
        return pipelined, len(calls)
    points = {(kind, wire): point(kind, wire) for kind in kinds for wire in CURVE_BYTES}
    timed = _interleaved({key: run for key, (run, _) in points.items()}, group)
    return {kind: tuple((float(wire), timed[(kind, wire)] / points[(kind, wire)][1])
                        for wire in CURVE_BYTES) for kind in kinds}


def _one_call(group, n: int, kind: str, wire: float, dev):
    """A function starting one async ``kind`` call that puts ``wire`` bytes per rank on the
    wire, on buffers of its own."""
    if kind == "all_reduce":  # a ring all_reduce of S bytes puts 2(n−1)/n·S on the wire
        buf = torch.empty(max(1, int(wire / (2 * (n - 1) / n)) // 4), device=dev)
        return lambda: dist.all_reduce(buf, group=group, async_op=True)
    if kind == "all_gather":  # every rank sends its shard to n−1 peers
        shard = torch.empty(max(1, int(wire / (n - 1)) // 4), device=dev)
        gathered = torch.empty(shard.numel() * n, device=dev)
        return lambda: all_gather_into(gathered, shard, group=group, async_op=True)
    # all_to_all of S bytes sends (n−1)/n·S to the peers
    count = max(n, int(wire * n / (n - 1)) // 4 // n * n)
    send, recv = torch.empty(count, device=dev), torch.empty(count, device=dev)
    return lambda: dist.all_to_all_single(recv, send, group=group, async_op=True)


def _pipeline_overheads(cal: Calibration, x, w, out, group) -> tuple[float, float]:
    """k: how much slower the matmul runs while a transfer shares its cores (timed alone and
    under a 4 MiB all_reduce in flight, in turns, so drift hits both alike); o: what a
    real 4-piece matmul + all_reduce pipeline takes beyond the model with that k."""
    dev = meta_device(group)
    big = torch.empty(int(CURVE_BYTES[-1] / 4), device=dev)

    def matmul(beside: bool) -> float:
        work = dist.all_reduce(big, group=group, async_op=True) if beside else None
        start = time.perf_counter()
        torch.matmul(x, w, out=out)
        sync(dev)
        elapsed = time.perf_counter() - start
        if work is not None:
            work.wait()
        return elapsed

    ratios = [_fastest_value(lambda: matmul(True), group) / _fastest_value(lambda: matmul(False), group)
              for _ in range(11)]
    # at most 1: the transport cannot take more than the core the GEMM runs on
    k = min(1.0, max(0.0, median(ratios) - 1.0))
    n = dist.get_world_size(group)
    fitted = replace(cal, profile=replace(cal.profile, overlap_slowdown=k))

    def pipeline(pieces: int = 4) -> None:
        works, rows = [], out.shape[0] // pieces
        for lo in range(0, out.shape[0], rows):
            torch.matmul(x[lo:lo + rows], w, out=out[lo:lo + rows])
            works.append(dist.all_reduce(out[lo:lo + rows], group=group, async_op=True))
        for work in works:
            work.wait()

    piece_work = Work(flops=2.0 * x.shape[0] * x.shape[1] * w.shape[1], kind="all_reduce",
                      wire_bytes=out.numel() * 4 * 2 * (n - 1) / n, length=out.shape[0],
                      width=out.shape[1], taper=False)
    o = max(0.0, (_median(pipeline, group, 5) - predict(fitted, piece_work, 4)) / 3)
    # at most one call's latency α: the small GEMMs' slowness is in the rate table and the
    # transfers' latency in the curves, so what is left per piece is launching one more
    # call; a larger residue is this machine's noise during calibration (it swung 0-2 ms
    # between runs when the cap was a 256 KiB call), not a cost every piece pays
    return k, min(o, cal.profile.latency_s)


def _times(fn, group, repeats: int) -> list[float]:
    """``repeats`` timed calls after one warm-up; each the slowest rank's."""
    dev = meta_device(group)
    fn()
    return time_repeated(fn, repeats, dev, group)


def _median(fn, group, repeats: int) -> float:
    return median(_times(fn, group, repeats))


def _interleaved(fns: dict, group, rounds: int = ROUNDS) -> dict:
    """Each function's median time (the slowest rank's) over ``rounds`` interleaved rounds
    (:func:`plait.runtime.timing.time_interleaved`), after one warm-up call each."""
    for fn in fns.values():
        fn()
    timed = time_interleaved(fns, rounds, meta_device(group), group)
    return {name: median(ts) for name, ts in timed.items()}


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
