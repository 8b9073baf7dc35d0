"""What one call of a fused operator costs at p pieces: a pure model over a calibration.

A fused operator is a two-resource pipeline: the compute (one core, or the
GPU's SMs) and the wire. Pieces go through it in order, either

- ``send`` (GEMM + all_reduce, GEMM + reduce_scatter, MoE combine, embedding):
  piece j is computed, then sent; the wire takes it once it is free; or
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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .pieces import split, tapered

if TYPE_CHECKING:  # calibration measures with this model: no import cycle at run time
    from .calibration import Calibration

__all__ = ["Work", "predict"]


@dataclass(frozen=True)
class Work:
    """One call of a fused operator, as the busiest rank sees it.

    flops / memory_bytes: the compute the pieces cut (GEMM flops; bytes gathered);
    wire_bytes, kind: what the collective moves and which measured curve prices it;
    receive: pieces arrive, then are computed (otherwise computed, then sent);
    lead_flops: compute that waits for no transfer and runs first (own rows);
    length, width: the pieces cut ``length`` rows of a GEMM whose output is
        ``width`` wide (``columns``: they cut a GEMV's ``length`` columns and its
        output has ``width`` rows); length 0 prices every piece at the flat rate;
    taper: the first and last piece are half the others (:func:`pieces.tapered`).
    """

    flops: float
    wire_bytes: float
    kind: str = "all_to_all"
    memory_bytes: float = 0.0
    receive: bool = False
    lead_flops: float = 0.0
    length: int = 0
    width: int = 0
    columns: bool = False
    taper: bool = True


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
        return _receive(cal, work, compute, wire, k)
    return _send(compute, wire, k)


def _send(compute: list[float], wire: list[float], k: float) -> float:
    t_compute = t_wire = 0.0
    for c, m in zip(compute, wire):
        beside = max(0.0, min(c, t_wire - t_compute))  # the previous piece still on the wire
        t_compute += c + k * beside
        t_wire = max(t_wire, t_compute) + m
    return t_wire


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
