"""Fit a machine's model constants from benchmark JSON and keep them as a profile.

Inputs are the files written by ``plait bench collectives --json`` and
``plait bench ops --json``: a JSON object ``{"records": [...], ...}`` or a bare
list of records.  The fitted ``MachineProfile`` is what ``chunks="auto"`` loads.

* latency / bandwidth: weighted least squares of
  ``time = base + steps * alpha + wire_bytes / B`` over collective records
  (collectives.latency_steps / wire_factor), each row weighted by 1/time so that
  small and large messages count alike; constants are kept non-negative.
* compute rate: ``t_compute = c0 + flops / F`` over op records that carry flops.
* per-piece overhead and overlap slowdown: the ``o`` and ``k`` of
  pipeline.fused_time that best explain the measured fused times, given each
  record's measured compute and comm times (grid over k, least squares in o).
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

from .collectives import COLLECTIVES, latency_steps, piece_latency, wire_factor
from .pipeline import PipelineOverheads, fused_time

__all__ = [
    "MachineProfile",
    "DEFAULT_PROFILE",
    "OP_COLLECTIVE",
    "default_profile_path",
    "load_profile",
    "load_records",
    "load_calibration",
    "split_records",
    "reliable",
    "spread",
    "fit_alpha_beta",
    "fit_per_collective",
    "fit_compute_rate",
    "fit_per_piece_overhead",
    "fit_pipeline",
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
    overlap_slowdown: compute runs 1 + this slower while a collective overlaps it.
    base_latency_s: fixed cost of one collective call.
    link: the benchmark's link label ("1gbit", "loopback", ...).
    world_size: world size(s) of the records it was fitted on (largest).
    source: where it came from (files, record counts, date, or "uncalibrated default").
    fit_rel_error: median relative residual of the latency/bandwidth fit.
    collectives: per-collective constants (name, base_latency_s, latency_s,
        bandwidth_Bps) where the backend implements collectives differently
        (gloo's reduce_scatter is not a ring); collective_time uses them.
    curves, gemm, memory_Bps: what the pieces model (:mod:`plait.perf.pieces`)
        prices pieces with, as ``plait bench ops`` measured them on the group
        (per collective kind, (wire bytes, seconds per call) points; GEMM FLOP/s
        by output rows and width; pooled-lookup bytes/s); empty when not measured.
    """

    latency_s: float
    bandwidth_Bps: float
    compute_flops: float = 0.0
    per_piece_overhead_s: float = 0.0
    overlap_slowdown: float = 0.0
    base_latency_s: float = 0.0
    link: str = ""
    world_size: int = 0
    source: str = ""
    fit_rel_error: float = 0.0
    collectives: tuple[tuple[str, float, float, float], ...] = ()
    curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    gemm: tuple[tuple[float, ...], ...] = ()
    memory_Bps: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "collectives", tuple(tuple(c) for c in self.collectives))
        object.__setattr__(self, "curves", tuple(
            (str(kind), tuple((float(b), float(t)) for b, t in points))
            for kind, points in self.curves))
        object.__setattr__(self, "gemm", tuple(tuple(float(v) for v in row) for row in self.gemm))
        for name in ("latency_s", "compute_flops", "per_piece_overhead_s", "base_latency_s",
                     "overlap_slowdown"):
            if getattr(self, name) < 0:
                raise ValueError(f"MachineProfile.{name} must be >= 0, got {getattr(self, name)}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"MachineProfile.bandwidth_Bps must be > 0, got {self.bandwidth_Bps}")

    def compute_time_s(self, flops: float) -> float:
        """Predicted seconds of ``flops`` of operator compute on this machine."""
        if self.compute_flops <= 0:
            raise ValueError(f"profile has no compute rate (source: {self.source or 'unknown'})")
        return flops / self.compute_flops

    def for_collective(self, name: str) -> "MachineProfile":
        """This profile with ``name``'s own constants, if it has them."""
        for cname, base, alpha, bw in self.collectives:
            if cname == name:
                return dataclasses.replace(self, base_latency_s=base, latency_s=alpha,
                                           bandwidth_Bps=bw, collectives=())
        return self

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
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid benchmark JSON ({e})") from None
        records = data.get("records", []) if isinstance(data, dict) else data
        if not isinstance(records, list):
            raise ValueError(f"{path}: 'records' must be a list, got {type(records).__name__}")
        out.extend({**r, "_file": str(path)} for r in records if isinstance(r, dict))
    return out


def load_calibration(paths: Iterable[str | os.PathLike]) -> dict | None:
    """The calibration ``plait bench ops`` JSON among ``paths`` recorded in its meta (what
    its ``chunks="auto"`` priced pieces with), or None. With several runs, their median,
    figure by figure, over the runs shaped like the newest (same world size, curve sizes
    and rate table): one calibration is a few seconds of a shared machine, and a slow
    stretch in one run's is outvoted by the others."""
    found = []
    for path in paths:
        try:
            meta = json.loads(Path(path).read_text()).get("meta", {})
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("calibration"), dict):
            found.append((Path(path).stat().st_mtime, meta["calibration"]))
    if not found:
        return None
    newest = max(found, key=lambda f: f[0])[1]
    alike = [cal for _, cal in found if _shape(cal) == _shape(newest)]
    return _median_of(alike)


def _shape(cal: dict) -> tuple:
    """What must match for two calibrations' figures to be comparable one by one."""
    return (cal.get("profile", {}).get("world_size"),
            tuple(sorted((k, tuple(p[0] for p in v)) for k, v in cal.get("curves", {}).items())),
            tuple(len(row) for row in cal.get("gemm", [])))


def _median_of(cals: list[dict]) -> dict:
    """Figure by figure, the median of calibrations of one shape (sizes are kept)."""
    def med(values):
        return float(np.median(values))
    first = cals[0]
    profile = dict(first.get("profile", {}))
    for key, value in profile.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "world_size":
            profile[key] = med([c["profile"][key] for c in cals])
    curves = {kind: [[size, med([c["curves"][kind][i][1] for c in cals])]
                     for i, (size, _) in enumerate(points)]
              for kind, points in first.get("curves", {}).items()}
    gemm = [[med([c["gemm"][i][j] for c in cals]) for j in range(len(row))]
            for i, row in enumerate(first.get("gemm", []))]
    return {**first, "profile": profile, "curves": curves, "gemm": gemm,
            "memory_Bps": med([c.get("memory_Bps", 0.0) for c in cals]), "runs": len(cals)}


def split_records(records: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(collective records, op records) with the fields each fit needs."""
    coll = [r for r in records if r.get("collective") in COLLECTIVES
            and r.get("time_s", 0) > 0 and r.get("world_size", 0) > 1 and r.get("bytes", 0) > 0]
    ops = [r for r in records if r.get("op") in OP_COLLECTIVE and r.get("world_size", 0) > 1
           and r.get("correct", True) is not False]
    return coll, ops


NOISE_LIMIT = 1.0  # (max - min) / median of a record's timed iterations


def spread(record: dict) -> float | None:
    """(max - min) / median of a record's timed iterations, if it reports them."""
    if record.get("time_max_s") is None or record.get("time_min_s") is None:
        return None
    return (float(record["time_max_s"]) - float(record["time_min_s"])) / float(record["time_s"])


def reliable(records: Sequence[dict], limit: float = NOISE_LIMIT) -> list[dict]:
    """Records whose iterations agree to within ``limit`` of their median.

    On a shared or emulated machine small messages are scheduling noise (spreads
    of several times the median); a fit should not chase them.  Falls back to
    all records when fewer than two distinct sizes would remain.
    """
    keep = [r for r in records if (spread(r) or 0.0) <= limit]
    return keep if len({r["bytes"] for r in keep}) >= 2 else list(records)


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


def fit_per_collective(records: Sequence[dict]) -> tuple[tuple[str, float, float, float], ...]:
    """(name, base, latency, bandwidth) for every collective with >= 2 records."""
    out = []
    for name in sorted({r["collective"] for r in records}):
        recs = reliable([r for r in records if r["collective"] == name])
        if len({r["bytes"] for r in recs}) >= 2:
            base, alpha, bw, _ = fit_alpha_beta(recs)
            out.append((name, base, alpha, bw))
    return tuple(out)


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
    """Latency each piece of the record's collective repeats, under an alpha-beta profile."""
    return piece_latency(OP_COLLECTIVE[record["op"]], int(record["world_size"]), profile_like)


def _fused_points(op_records: Sequence[dict], profile_like):
    pts = []
    for r in op_records:
        p = int(r.get("chunks", 1))
        if r.get("path") != "fused" or p < 2 or not r.get("t_fused_s", 0) > 0:
            continue
        pts.append((p, float(r["t_compute_s"]), float(r["t_comm_s"]), float(r["t_fused_s"]),
                    op_comm_latency(r, profile_like)))
    return pts


def fit_pipeline(op_records: Sequence[dict], profile_like) -> tuple[float, float]:
    """(per-piece overhead s, overlap slowdown) explaining multi-piece fused records.

    For each slowdown k on a grid, the overhead has a closed form (least squares
    on relative residuals, kept >= 0); the pair with the smallest residual wins.
    (0, 0) when no record has a fused multi-piece time.
    """
    pts = _fused_points(op_records, profile_like)
    if not pts:
        return 0.0, 0.0
    p, tc, tm, t, lat = (np.asarray(x, dtype=float) for x in zip(*pts))
    best = (np.inf, 0.0, 0.0)
    for k in np.arange(0.0, 2.0001, 0.05):
        base = fused_time(tc, tm, p, PipelineOverheads(0.0, float(k)), comm_latency_s=lat)
        w = (p - 1) / t
        o = max(0.0, float(np.sum(w * (t - base) / t) / np.sum(w * w)))
        res = float(np.sum(((base + (p - 1) * o - t) / t) ** 2))
        if res < best[0] - 1e-12:
            best = (res, o, float(k))
    return best[1], best[2]


def fit_per_piece_overhead(op_records: Sequence[dict], profile_like) -> float:
    """Per-piece overhead (s) alone, with no overlap slowdown."""
    pts = _fused_points(op_records, profile_like)
    if not pts:
        return 0.0
    p, tc, tm, t, lat = (np.asarray(x, dtype=float) for x in zip(*pts))
    base = fused_time(tc, tm, p, 0.0, comm_latency_s=lat)
    w = (p - 1) / t
    return max(0.0, float(np.sum(w * (t - base) / t) / np.sum(w * w)))


def _pick_link(records: Sequence[dict], link: str | None) -> str | None:
    if link is not None:
        return link
    counts = Counter(str(r.get("link", "")) for r in records)
    return counts.most_common(1)[0][0] if counts else None


def fit_profile(records: Sequence[dict], *, link: str | None = None,
                source: str = "", measured: dict | None = None) -> MachineProfile:
    """A MachineProfile from benchmark records (collectives and, optionally, ops).

    With several links in the records, fits the one named by ``link`` (default:
    the one with most collective records). ``measured``: the calibration ``plait bench
    ops`` priced its pieces with (its JSON's ``meta.calibration``): its curves, GEMM
    table, lookup and flat compute rates, overlap slowdown and per-piece overhead are
    kept (not refitted from the records), since the
    pieces model was measured with them, so ``chunks="auto"`` loading the profile
    decides as it did in the benchmark.
    """
    coll, ops = split_records(records)
    link = _pick_link(coll, link)
    coll = [r for r in coll if str(r.get("link", "")) == link]
    ops = [r for r in ops if str(r.get("link", link)) == link] or ops
    base, alpha, bw, err = fit_alpha_beta(reliable(coll))
    partial = MachineProfile(latency_s=alpha, bandwidth_Bps=bw, base_latency_s=base,
                             collectives=fit_per_collective(coll))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    files = sorted({Path(r.get("_file", "?")).name for r in coll + ops})
    if not measured:
        pieces = dict(zip(("per_piece_overhead_s", "overlap_slowdown"), fit_pipeline(ops, partial)))
    else:
        m = measured["profile"]
        pieces = {"compute_flops": m["compute_flops"],
                  "per_piece_overhead_s": m["per_piece_overhead_s"],
                  "overlap_slowdown": m["overlap_slowdown"],
                  "curves": tuple(measured.get("curves", {}).items()),
                  "gemm": measured.get("gemm", ()), "memory_Bps": measured.get("memory_Bps", 0.0)}
    return dataclasses.replace(
        partial,
        **{"compute_flops": fit_compute_rate(ops), **pieces},
        link=link or "",
        world_size=max(int(r["world_size"]) for r in coll),
        source=source or f"fit {stamp} on {len(coll)} collective + {len(ops)} op records "
                         f"({', '.join(files)})" + (f"; pieces model as bench ops measured it (median of "
                                                    f"{measured.get('runs', 1)} runs)" if measured else ""),
        fit_rel_error=err,
    )
