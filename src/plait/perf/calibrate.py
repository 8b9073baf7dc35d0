"""Fit a machine's model constants from benchmark JSON and keep them as a profile.

Inputs are the files written by ``plait bench collectives --json`` and
``plait bench ops --json``: a JSON object ``{"records": [...], ...}`` or a bare
list of records.  The fitted ``MachineProfile`` is what ``chunks="auto"`` loads.

* latency / bandwidth: weighted least squares of
  ``time = base + steps * alpha + wire_bytes / B`` over collective records
  (collectives.latency_steps / wire_factor), each row weighted by 1/time so that
  small and large messages count alike; constants are kept non-negative.
* compute rate: ``t_compute = c0 + flops / F`` over op records that carry flops.
* per-piece overhead: the ``o`` of pipeline.fused_time that best explains the
  measured fused times, given each record's measured compute and comm times.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .collectives import COLLECTIVES, collective_time, latency_steps, wire_factor
from .pipeline import fused_time

__all__ = [
    "MachineProfile",
    "DEFAULT_PROFILE",
    "OP_COLLECTIVE",
    "default_profile_path",
    "load_profile",
    "load_records",
    "split_records",
    "fit_alpha_beta",
    "fit_compute_rate",
    "fit_per_piece_overhead",
    "fit_profile",
]

OP_COLLECTIVE = {
    "matmul_all_reduce": "all_reduce",
    "all_gather_matmul": "all_gather",
    "matmul_reduce_scatter": "reduce_scatter",
    "embedding_all_to_all": "all_to_all",
    "all_to_all_matmul": "all_to_all",
    "matmul_all_to_all": "all_to_all",
}


@dataclass(frozen=True, kw_only=True)
class MachineProfile:
    """Calibrated constants of one machine and link.

    latency_s: per-step latency alpha of a collective (seconds).
    bandwidth_Bps: effective per-rank bandwidth (bus-bandwidth asymptote, bytes/s).
    compute_flops: achieved FLOP/s of the operators' compute (0 = not measured).
    per_piece_overhead_s: extra seconds each additional piece of a fused op costs.
    base_latency_s: fixed cost of one collective call.
    link: the benchmark's link label ("1gbit", "loopback", ...).
    world_size: world size(s) of the records it was fitted on (largest).
    source: where it came from (files, record counts, date, or "uncalibrated default").
    fit_rel_error: median relative residual of the latency/bandwidth fit.
    """

    latency_s: float
    bandwidth_Bps: float
    compute_flops: float = 0.0
    per_piece_overhead_s: float = 0.0
    base_latency_s: float = 0.0
    link: str = ""
    world_size: int = 0
    source: str = ""
    fit_rel_error: float = 0.0

    def __post_init__(self):
        for name in ("latency_s", "compute_flops", "per_piece_overhead_s", "base_latency_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"MachineProfile.{name} must be >= 0, got {getattr(self, name)}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"MachineProfile.bandwidth_Bps must be > 0, got {self.bandwidth_Bps}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MachineProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"profile: unknown fields {sorted(unknown)}")
        return cls(**data)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "MachineProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))


# Used when no profile has been calibrated: a 1 GbE-class link, so that
# chunks="auto" stays conservative rather than optimistic.
DEFAULT_PROFILE = MachineProfile(latency_s=50e-6, bandwidth_Bps=0.117e9, compute_flops=50e9,
                                 per_piece_overhead_s=50e-6, base_latency_s=20e-6,
                                 source="uncalibrated default (1 GbE-class assumptions)")


def default_profile_path() -> Path:
    """$PLAIT_PROFILE, else ~/.cache/plait/profile.json."""
    return Path(os.environ.get("PLAIT_PROFILE", Path.home() / ".cache" / "plait" / "profile.json"))


def load_profile(path: str | os.PathLike | None = None) -> MachineProfile:
    """The profile at ``path`` (default location if None); DEFAULT_PROFILE if absent."""
    path = default_profile_path() if path is None else Path(path)
    return MachineProfile.load(path) if path.exists() else DEFAULT_PROFILE


def load_records(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Records of every file; each gets ``_file`` naming where it came from."""
    out = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        records = data.get("records", []) if isinstance(data, dict) else data
        if not isinstance(records, list):
            raise ValueError(f"{path}: 'records' must be a list, got {type(records).__name__}")
        out.extend({**r, "_file": str(path)} for r in records if isinstance(r, dict))
    return out


def split_records(records: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(collective records, op records) with the fields each fit needs."""
    coll = [r for r in records if r.get("collective") in COLLECTIVES
            and r.get("time_s", 0) > 0 and r.get("world_size", 0) > 1 and r.get("bytes", 0) > 0]
    ops = [r for r in records if r.get("op") in OP_COLLECTIVE and r.get("world_size", 0) > 1]
    return coll, ops


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, by trying column subsets (few columns here)."""
    best, best_res = np.zeros(a.shape[1]), float(np.sum(b ** 2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((a[:, cols] @ x - b) ** 2))
            if res < best_res - 1e-15:
                best, best_res = np.zeros(a.shape[1]), res
                best[list(cols)] = x
    return best


def fit_alpha_beta(records: Sequence[dict]) -> tuple[float, float, float, float]:
    """(base_s, latency_s, bandwidth_Bps, median relative error) from collective records."""
    if len(records) < 2:
        raise ValueError(f"need >= 2 collective records to fit latency and bandwidth, got {len(records)}")
    rows, t = [], []
    for r in records:
        n = int(r["world_size"])
        rows.append([1.0, latency_steps(r["collective"], n), wire_factor(r["collective"], n) * r["bytes"]])
        t.append(float(r["time_s"]))
    a, t = np.asarray(rows), np.asarray(t)
    x = _nonneg_lstsq(a / t[:, None], np.ones_like(t))
    if x[2] <= 0:
        raise ValueError("collective records do not determine a bandwidth (no size dependence)")
    rel = np.abs(a @ x - t) / t
    return float(x[0]), float(x[1]), float(1.0 / x[2]), float(np.median(rel))


def fit_compute_rate(op_records: Sequence[dict]) -> float:
    """Achieved FLOP/s from op records carrying ``flops``; 0.0 if none do."""
    pts = [(float(r["flops"]), float(r["t_compute_s"])) for r in op_records
           if r.get("flops") and r.get("t_compute_s", 0) > 0]
    if not pts:
        return 0.0
    f, t = np.asarray(pts).T
    if len(pts) >= 3 and np.ptp(f) > 0:
        x = _nonneg_lstsq(np.stack([np.ones_like(f), f], 1) / t[:, None], np.ones_like(t))
        if x[1] > 0:
            return float(1.0 / x[1])
    return float(np.median(f / t))


def op_comm_latency(record: dict, profile_like) -> float:
    """Latency part of the record's collective under an alpha-beta profile."""
    return collective_time(OP_COLLECTIVE[record["op"]], 0.0, int(record["world_size"]), profile_like)


def fit_per_piece_overhead(op_records: Sequence[dict], profile_like) -> float:
    """Per-piece overhead (s) explaining fused times of multi-piece fused records."""
    num = den = 0.0
    for r in op_records:
        p = int(r.get("chunks", 1))
        if r.get("path") != "fused" or p < 2 or not r.get("t_fused_s", 0) > 0:
            continue
        t = float(r["t_fused_s"])
        base = fused_time(r["t_compute_s"], r["t_comm_s"], p, 0.0,
                          comm_latency_s=op_comm_latency(r, profile_like))
        num += (p - 1) * (t - base) / t ** 2
        den += (p - 1) ** 2 / t ** 2
    return max(0.0, num / den) if den > 0 else 0.0


def _pick_link(records: Sequence[dict], link: str | None) -> str | None:
    if link is not None:
        return link
    counts = Counter(str(r.get("link", "")) for r in records)
    return counts.most_common(1)[0][0] if counts else None


def fit_profile(records: Sequence[dict], *, link: str | None = None,
                source: str = "") -> MachineProfile:
    """A MachineProfile from benchmark records (collectives and, optionally, ops).

    With several links in the records, fits the one named by ``link`` (default:
    the one with most collective records).
    """
    coll, ops = split_records(records)
    link = _pick_link(coll, link)
    coll = [r for r in coll if str(r.get("link", "")) == link]
    ops = [r for r in ops if str(r.get("link", link)) == link] or ops
    base, alpha, bw, err = fit_alpha_beta(coll)
    partial = MachineProfile(latency_s=alpha, bandwidth_Bps=bw, base_latency_s=base)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    files = sorted({Path(r.get("_file", "?")).name for r in coll + ops})
    return dataclasses.replace(
        partial,
        compute_flops=fit_compute_rate(ops),
        per_piece_overhead_s=fit_per_piece_overhead(ops, partial),
        link=link or "",
        world_size=max(int(r["world_size"]) for r in coll),
        source=source or f"fit {stamp} on {len(coll)} collective + {len(ops)} op records "
                         f"({', '.join(files)})",
        fit_rel_error=err,
    )
