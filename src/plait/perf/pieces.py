"""What one call of a fused operator costs at p pieces: the pieces model, pure computation.

The fused operators choose their piece count with it (``chunks="auto"``,
:mod:`plait.ops.context`), over a :class:`Calibration` that
:func:`plait.ops.calibration.measure` fills on the running group; the
simulator's closed form (:func:`plait.perf.pipeline.fused_time`) is its
special case of equal pieces at one flat rate (tests/perf/test_perf_pieces.py
checks that they agree).

A fused operator is a two-resource pipeline: the compute (one core, or the
GPU's SMs) and the wire. Pieces go through it in order, either

- ``send`` (GEMM + all_reduce, GEMM + reduce_scatter, MoE combine, embedding):
  piece j is computed, then sent; the wire takes it once it is free;
  ``tail_flops`` (a reduce-scatter's own rows, which feed no transfer) runs
  after the last piece is sent, beside the wire; or
- ``receive`` (all_gather + GEMM, MoE dispatch): every transfer is posted at
  once and they arrive in order; piece j is computed once it has arrived and
  the previous one is done. ``lead_flops`` (a gather's own rows, which need no
  wire) runs first, beside the transfers.

Walking the pieces through that recurrence gives the time; one piece is the
plain path (compute then collective, or collective then compute). Two things
make more pieces cost more than the ideal ``max(compute, comm)``:

- each piece's GEMM is smaller, and small GEMMs run slower: the rate of a
  piece is read off the calibration's measured table of rate by (rows, width)
  (:meth:`Calibration.gemm_rate`); on this machine's CPU a [128, 512] × [512,
  2048] GEMM runs at half the rate of a [512, 512] × [512, 2048] one;
- a per-piece overhead ``o`` on the compute side (launch, bookkeeping), and
  compute sharing the machine with a running transfer goes ``1 + k`` slower.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

from .calibrate import MachineProfile
from .collectives import curve_time

__all__ = ["Work", "predict", "Calibration", "from_profile", "calibration_dict", "GEMM_ROWS",
           "GEMM_WIDTHS",
           "GEMM_K", "split", "tapered", "offsets"]

GEMM_ROWS = (4, 16, 64, 128, 192, 256, 512)  # output rows of the timed GEMMs ([rows, 512] @ [512, width])
GEMM_WIDTHS = (256, 1024, 2048, 4096)
GEMM_K = 512


def split(total: int, pieces: int) -> list[int]:
    """``total`` rows in ``pieces`` near-equal parts (larger ones first), none empty."""
    pieces = max(1, min(pieces, total)) if total else 1
    base, extra = total // pieces, total % pieces  # not divmod: a traced length is symbolic
    return [base + (1 if i < extra else 0) for i in range(pieces)]


def tapered(total: int, pieces: int) -> list[int]:
    """``total`` rows in ``pieces`` parts whose first and last are half the others.

    A pipeline of pieces exposes the first piece's compute (nothing to send
    yet) and the last piece's transfer (nothing left to compute): halving those
    two shortens both exposed ends. ``tapered(8, 3) == [2, 4, 2]``.
    """
    if pieces <= 2 or total < 2 * pieces:
        return split(total, pieces)
    weights = [1] + [2] * (pieces - 2) + [1]
    sizes = [total * w // sum(weights) for w in weights]
    sizes[len(sizes) // 2] += total - sum(sizes)
    return sizes


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each part, and the end: ``offsets([2, 3]) == [0, 2, 5]``."""
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


@dataclass(frozen=True)
class Calibration:
    """A machine as the pieces model sees it: the profile (compute rate, α, per-piece
    overhead o, overlap slowdown k), the memory rate of pooled lookups, per collective
    kind the time of one call at a few sizes (interpolated: not linear in size on every
    transport), and the GEMM rate by output shape."""

    profile: MachineProfile
    memory_Bps: float = 10e9
    curves: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    gemm: tuple[tuple[float, ...], ...] = ()  # FLOP/s, [rows in GEMM_ROWS][width in GEMM_WIDTHS]

    def comm_time(self, kind: str, wire_bytes: float) -> float:
        """Seconds for one ``kind`` call moving ``wire_bytes`` per rank."""
        points = self.curves.get(kind) or self.curves.get("all_reduce")
        if not points:
            p = self.profile
            return p.base_latency_s + p.latency_s + wire_bytes / p.bandwidth_Bps
        return curve_time(points, wire_bytes)

    def compute_time(self, flops: float, memory_bytes: float = 0.0) -> float:
        return flops / max(self.profile.compute_flops, 1.0) + memory_bytes / self.memory_Bps

    def gemm_rate(self, rows: int, width: int) -> float:
        """FLOP/s of a GEMM with a [rows, width] output: the measured table (made to rise
        with rows, :func:`rising_in_rows`), interpolated in log rows and log width, held at
        its edges; the flat rate without a table."""
        if not self.gemm:
            return max(self.profile.compute_flops, 1.0)
        table = rising_in_rows(tuple(map(tuple, self.gemm)))
        i, fi = _between(GEMM_ROWS, rows)
        j, fj = _between(GEMM_WIDTHS, width)
        g = [[math.log(table[a][b]) for b in (j, j + 1)] for a in (i, i + 1)]
        top, bottom = g[0][0] + fj * (g[0][1] - g[0][0]), g[1][0] + fj * (g[1][1] - g[1][0])
        return math.exp(top + fi * (bottom - top))


@functools.lru_cache(maxsize=16)
def rising_in_rows(table: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
    """The GEMM rate table, each width's column made non-decreasing in rows by the
    least-squares fit that is (pool-adjacent-violators): more rows of the same GEMM
    amortize the same packing of w, so a smaller rate at more rows is the noise of the
    moment it was timed (one saved profile had 512 rows at 47 GFLOP/s, 256 at 58)."""
    columns = [_pool_adjacent_violators([row[j] for row in table]) for j in range(len(table[0]))]
    return tuple(tuple(column[i] for column in columns) for i in range(len(table)))


def _pool_adjacent_violators(values: list[float]) -> list[float]:
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


def _between(grid: tuple[int, ...], value: float) -> tuple[int, float]:
    """(i, f): ``value`` sits a fraction f (in log scale) of the way from grid[i] to grid[i+1]."""
    value = min(max(value, grid[0]), grid[-1])
    i = min(max(bisect.bisect_right(grid, value) - 1, 0), len(grid) - 2)
    return i, (math.log(value) - math.log(grid[i])) / (math.log(grid[i + 1]) - math.log(grid[i]))


def from_profile(profile: MachineProfile) -> Calibration:
    """A saved profile (``plait simulate --calibrate``) as a calibration: with the curves,
    GEMM table and lookup rate ``plait bench ops`` measured where the profile has them,
    else α–β and one flat compute rate."""
    kept = {"curves": dict(profile.curves), "gemm": profile.gemm}
    if profile.memory_Bps > 0:
        kept["memory_Bps"] = profile.memory_Bps
    return Calibration(profile=dataclasses.replace(profile, curves=(), gemm=(), memory_Bps=0.0),
                       **kept)


def calibration_dict(cal: Calibration) -> dict:
    """A calibration as JSON-ready data (``plait bench ops`` writes it into its meta)."""
    return {"profile": cal.profile.to_dict(), "memory_Bps": cal.memory_Bps,
            "curves": {k: [list(p) for p in v] for k, v in cal.curves.items()},
            "gemm": [list(row) for row in cal.gemm]}


@dataclass(frozen=True)
class Work:
    """One call of a fused operator, as the busiest rank sees it.

    flops / memory_bytes: the compute the pieces cut (GEMM flops; bytes gathered);
    wire_bytes, kind: what the collective moves and which measured curve prices it;
    receive: pieces arrive, then are computed (otherwise computed, then sent);
    lead_flops: compute that waits for no transfer and runs first (own rows);
    tail_flops: compute that feeds no transfer and runs after the last piece is sent,
        beside the wire (a reduce-scatter's own rows); the plain path runs it first;
    length, width: the pieces cut ``length`` rows of a GEMM whose output is
        ``width`` wide (``columns``: they cut a GEMV's ``length`` columns and its
        output has ``width`` rows); length 0 prices every piece at the flat rate;
    taper: the first and last piece are half the others (:func:`tapered`);
    lead_in_plain: the plain path (one piece) also runs ``lead_flops`` beside its transfer
        (all_gather_matmul's own rows); False: it moves everything, then computes
        (MoE dispatch).
    """

    flops: float
    wire_bytes: float
    kind: str = "all_to_all"
    memory_bytes: float = 0.0
    receive: bool = False
    lead_flops: float = 0.0
    tail_flops: float = 0.0
    length: int = 0
    width: int = 0
    columns: bool = False
    taper: bool = True
    lead_in_plain: bool = True


def _fractions(work: Work, pieces: int) -> list[tuple[float, int]]:
    """(share of the work, rows of the piece's GEMM) for each piece."""
    if work.length <= 0:
        return [(1.0 / pieces, 0)] * pieces
    sizes = (tapered if work.taper else split)(work.length, pieces)
    total = sum(sizes)
    return [(s / total, s) for s in sizes]


def _compute(cal: Calibration, flops: float, memory_bytes: float, rows: int, work: Work) -> float:
    if rows <= 0 or flops <= 0:
        return cal.compute_time(flops, memory_bytes)
    m, n = (work.width, rows) if work.columns else (rows, work.width)
    return flops / cal.gemm_rate(m, n) + memory_bytes / cal.memory_Bps


def predict(cal: Calibration, work: Work, pieces: int) -> float:
    """Seconds of the call with ``pieces`` pieces (1: the plain path)."""
    k, o = cal.profile.overlap_slowdown, cal.profile.per_piece_overhead_s
    parts = _fractions(work, max(1, pieces))
    compute = [_compute(cal, work.flops * f, work.memory_bytes * f, rows, work) + (o if j else 0.0)
               for j, (f, rows) in enumerate(parts)]
    wire = [cal.comm_time(work.kind, work.wire_bytes * f) for f, _ in parts]
    if work.receive:
        if pieces <= 1 and not work.lead_in_plain:  # everything moved, then computed
            return wire[0] + _compute(cal, work.lead_flops, 0.0, work.length, work) + compute[0]
        return _receive(cal, work, compute, wire, k)
    tail = _compute(cal, work.tail_flops, 0.0, work.length, work) if work.tail_flops else 0.0
    if pieces <= 1:  # the plain path: everything computed, then sent
        return tail + compute[0] + wire[0]
    return _send(compute, wire, k, tail)


def _send(compute: list[float], wire: list[float], k: float, tail: float = 0.0) -> float:
    t_compute = t_wire = 0.0
    for c, m in zip(compute, wire):
        beside = max(0.0, min(c, t_wire - t_compute))  # the previous piece still on the wire
        t_compute += c + k * beside
        t_wire = max(t_wire, t_compute) + m
    t_compute += tail + k * max(0.0, min(tail, t_wire - t_compute))  # beside the last pieces
    return max(t_wire, t_compute)


def _receive(cal: Calibration, work: Work, compute: list[float], wire: list[float], k: float) -> float:
    arrived, t = [], 0.0
    for m in wire:  # all posted at once, served in order
        t += m
        arrived.append(t)
    last = arrived[-1] if arrived else 0.0
    lead = _compute(cal, work.lead_flops, 0.0, work.length, work) if work.lead_flops else 0.0
    t_compute = lead + k * min(lead, last)
    for c, at in zip(compute, arrived):
        start = max(t_compute, at)
        t_compute = start + c + k * max(0.0, min(c, last - start))
    return t_compute
