"""The model's predictions next to measurements and published figures.

Published rows (references.py) are predicted from the catalog and the model
alone.  Local rows come from this machine's benchmark JSON, and never predict
a record with constants fitted on that record:

* collectives: within each (collective, world size, link) series, alpha-beta is
  fitted on the even-indexed sizes (sorted) and predicts the odd ones, every run's
  record of a held-out size held out;
  records whose own iterations spread by more than their median (scheduling
  noise on small messages) are shown but neither fitted nor counted;
* fused ops: each fused record's time is predicted from its own measured compute
  and its pieces' comm (each piece's wire bytes priced on the measured all_reduce
  curve of ``plait bench collectives``, where one exists, else the plain call's
  time cut p ways) through the piece pipeline, with the per-piece
  overhead fitted on the *other* operator/shape groups (leave-one-group-out);
* chunks="auto": where ``plait bench ops`` timed fixed piece counts beside auto, the
  operator's own auto (its calibrated cost model, :mod:`plait.perf.pieces`) against
  the best of them (the fastest count by its median over the runs): the median, over
  every round of every run, of auto's time over that count's in the same round (a
  round times each variant once, moments apart, so a slow stretch of a shared machine
  divides out; two medians taken apart keep it: the same 8 pieces timed as auto and as
  ``chunks=8`` came out up to 16 % apart); for older records with one count per
  record, the measured time at the count this module's pipeline model picks.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass

from .calibrate import (NOISE_LIMIT, MachineProfile, fit_alpha_beta,
                        fit_per_collective, fit_pipeline, op_comm_latency, reliable, split_records,
                        spread)
from .collectives import bus_bandwidth, collective_time, curve_time, piece_latency, wire_factor
from .compute import gemm_time
from .config import SimConfig
from .hardware import get_accelerator, get_link
from .pipeline import PipelineOverheads, best_chunks, fused_time
from .references import REFERENCES
from .simulator import simulate

__all__ = ["Row", "published_rows", "local_rows", "summarize", "THRESHOLDS", "NO_LOCAL_HINT"]

THRESHOLDS = {"published": 0.25, "local": 0.15, "local-auto": 0.05}
NO_LOCAL_HINT = ("local rows skipped: no benchmark JSON found; produce it with "
                 "`plait bench collectives --json reports/bench/collectives.json` and "
                 "`plait bench ops --json reports/bench/ops.json`")


@dataclass(frozen=True)
class Row:
    case: str
    source: str
    predicted: float
    reference: float
    unit: str
    kind: str = "published"  # published | local | local-auto
    role: str = "validation"  # validation | calibration (shown, not counted)
    note: str = ""
    tolerance: float | None = None  # published rows: the source's own (references.py)

    @property
    def rel_error(self) -> float:
        return abs(self.predicted - self.reference) / abs(self.reference)

    def to_dict(self) -> dict:
        return {**asdict(self), "rel_error": self.rel_error}


def _pub(case: str, predicted: float, note: str = "") -> Row:
    ref = REFERENCES[case]
    return Row(case, ref.source, predicted, ref.value, ref.unit, "published", ref.role,
               "; ".join(x for x in (ref.note, note) if x), ref.tolerance)


def _nccl_rows() -> list[Row]:
    out = []
    for case, coll, link, size in (
            ("nccl-tests all_reduce busbw, 8xH100, ring, 8 GiB", "all_reduce", "nvlink4", 8 << 30),
            ("nccl-tests all_gather busbw, 8xH100, 8 GiB", "all_gather", "nvlink4", 8 << 30),
            ("nccl-tests all_reduce busbw, 8xA100 (NVSwitch), 1 GiB", "all_reduce", "nvlink3", 1 << 30)):
        t = collective_time(coll, size, 8, get_link(link))
        out.append(_pub(case, bus_bandwidth(coll, size, 8, t) / 1e9,
                        f"model: {link} NCCL-effective bandwidth + tuning.cc latencies"))
    return out


def _flux_pair(gpu: str, link: str, op: str) -> tuple[float, float, int]:
    """(unfused s, fused s, pieces) for Flux's shapes on 8 GPUs."""
    acc, lnk = get_accelerator(gpu), get_link(link)
    m, k, n, tp = 4096, 12288, 49152, 8
    if op == "ag":  # [M, K] gathered, [M, K] @ [K, N/tp]
        tc, coll = gemm_time(m, k, n // tp, acc, "fp16"), "all_gather"
    else:  # [M, N/tp] @ [N/tp, K] -> reduce-scatter [M, K]
        tc, coll = gemm_time(m, n // tp, k, acc, "fp16"), "reduce_scatter"
    nbytes = m * k * 2
    tm, lat = collective_time(coll, nbytes, tp, lnk), collective_time(coll, 0, tp, lnk)
    p, fused = best_chunks(tc, tm, 2 * acc.launch_s, max_chunks=16, comm_latency_s=lat)
    return tc + tm, fused, p


def _flux_rows() -> list[Row]:
    out = []
    for gpu, link in (("A800", "nvlink3-a800"), ("H800", "nvlink4-h800")):
        for op, label in (("ag", "AG+GEMM"), ("rs", "GEMM+RS")):
            unfused, fused, p = _flux_pair(gpu, link, op)
            if gpu == "A800":
                out.append(_pub(f"Flux {label} 8xA800, torch total", unfused * 1e3))
                continue
            out.append(_pub(f"Flux {label} 8xH800, torch (unfused) total", unfused * 1e3))
            out.append(_pub(f"Flux {label} 8xH800, fused total", fused * 1e3,
                            f"plait pipeline, {p} pieces"))
    return out


def _sc24_4gpu() -> Row:
    acc, lnk = get_accelerator("MI300X"), get_link("infinity-fabric").for_group(4)
    cases = {  # plait's representative shapes (the paper's are not encoded here)
        "GEMV+AllReduce (decode, b=8, [8, 28672/4] @ [28672/4, 8192])":
            (gemm_time(8, 28672 // 4, 8192, acc, "bf16"), "all_reduce", 8 * 8192 * 2),
        "GEMM+All-to-All (MoE down-proj, [4096, 14336] @ [14336, 4096])":
            (gemm_time(4096, 14336, 4096, acc, "bf16"), "all_to_all", 4096 * 4096 * 2),
    }
    saves = []
    for tc, coll, nbytes in cases.values():
        tm, lat = collective_time(coll, nbytes, 4, lnk), piece_latency(coll, 4, lnk)
        _, fused = best_chunks(tc, tm, 2 * acc.launch_s, max_chunks=16, comm_latency_s=lat)
        saves.append(100 * (1 - fused / (tc + tm)))
    note = ("mean of " + ", ".join(f"{c}: {s:.1f} %" for c, s in zip(cases, saves))
            + "; 4x MI300X; each piece is a whole collective call and repeats its latency, "
              "which the paper's GPU-initiated puts avoid")
    return _pub("SC'24 fused operators, 4 GPUs: lower combined time", sum(saves) / len(saves), note)


def _sim_gain(data: dict) -> tuple[float, float]:
    res = simulate(SimConfig.from_dict({"steps": 2, **data}), policies=("even",))
    return res.get(fused=False).step_s, res.get(fused=True).step_s


def _sim_rows() -> list[Row]:
    unf, fus = _sim_gain({"cluster": "mi300x-128n", "model": "dlrm", "parallel": {"tp": 1, "dp": 1024}})
    rows = [_pub("SC'24 DLRM at 128 nodes (simulated): lower training time", 100 * (1 - fus / unf))]
    for case, model, nodes in (
            ("async TP Llama 3 8B, 64xH100 (FSDP 8, TP 8): throughput gain", "llama3-8b", 8),
            ("async TP Llama 3 70B, 256xH100 (FSDP 32, TP 8): throughput gain", "llama3-70b", 32)):
        unf, fus = _sim_gain({"cluster": {"preset": "h100-64", "gpu": "H100-500W", "nodes": nodes},
                              "model": model, "chunks": 8,
                              "parallel": {"tp": 8, "dp": nodes, "fsdp": True}})
        rows.append(_pub(case, 100 * (unf / fus - 1),
                         "simulated; async TP = one piece per TP rank (chunks=8); the model assumes "
                         "overlap costs compute nothing on GPUs (no published slowdown used)"))
    return rows


def published_rows() -> list[Row]:
    """Every published comparison (validation and calibration rows)."""
    return _nccl_rows() + _flux_rows() + [_sc24_4gpu()] + _sim_rows()


def _files(records) -> str:
    return ", ".join(sorted({str(r.get("_file", "?")).rsplit("/", 1)[-1] for r in records}))


def _profiles(coll: list[dict]) -> dict[str, MachineProfile]:
    """One alpha-beta profile per link label, with per-collective constants."""
    out = {}
    for link in sorted({str(r.get("link", "")) for r in coll}):
        recs = [r for r in coll if str(r.get("link", "")) == link]
        if len({r["bytes"] for r in recs}) < 2:
            continue
        base, alpha, bw, _ = fit_alpha_beta(reliable(recs))
        out[link] = MachineProfile(latency_s=alpha, bandwidth_Bps=bw, base_latency_s=base,
                                   collectives=fit_per_collective(recs))
    return out


def _collective_rows(coll: list[dict]) -> list[Row]:
    series = defaultdict(list)
    for r in coll:
        series[(r["collective"], int(r["world_size"]), str(r.get("link", "")))].append(r)
    train, test = [], []
    for recs in series.values():
        # held out by size, not by record: with several runs, a size one run fitted must
        # not be predicted in another run's record
        held_out = set(sorted({r["bytes"] for r in recs})[1::2])
        train += [r for r in recs if r["bytes"] not in held_out]
        test += sorted((r for r in recs if r["bytes"] in held_out), key=lambda r: r["bytes"])
    profiles = _profiles(train)
    rows = []
    for r in test:
        link = str(r.get("link", ""))
        if link not in profiles:
            continue
        pred = collective_time(r["collective"], r["bytes"], int(r["world_size"]), profiles[link])
        sp = spread(r)
        noisy = sp is not None and sp > NOISE_LIMIT
        note = "held-out size; alpha-beta fitted on the other sizes of each collective"
        if noisy:
            note += f"; measurement spread {sp:.0%} of its median > {NOISE_LIMIT:.0%}: not counted"
        rows.append(Row(f"local {r['collective']} n={r['world_size']} {r['bytes']} B on {link}",
                        f"{_files([r])}: plait bench collectives", pred * 1e3,
                        float(r["time_s"]) * 1e3, "ms", "local",
                        "noisy" if noisy else "validation", note))
    return rows


def _group_key(r: dict) -> tuple:
    return (r["op"], tuple(sorted((r.get("shape") or {}).items())), int(r["world_size"]),
            str(r.get("link", "")))


# the collective whose measured curve prices every piece: the one gloo runs at the link rate
# at every size here (bench collectives: 93-94 % of the link at 16 MiB)
PIECE_CURVE = "all_reduce"


def _curves(coll: list[dict]) -> dict[tuple, list[tuple[float, float]]]:
    """(collective, world size, link) → (nccl-tests bytes, median seconds) by size."""
    times = defaultdict(list)
    for r in coll:
        times[(r["collective"], int(r["world_size"]), str(r.get("link", "")), int(r["bytes"]))].append(
            float(r["time_s"]))
    curves = defaultdict(list)
    for (kind, n, link, size), ts in sorted(times.items()):
        curves[(kind, n, link)].append((float(size), statistics.median(ts)))
    return dict(curves)


def _piece_priced(r: dict, curves) -> dict:
    """A fused record whose comm is its pieces' own: p calls of 1/p of its wire bytes each,
    each priced as the bytes a rank sends in a measured all_reduce (``PIECE_CURVE``), not
    as the plain call's time cut p ways, nor on the curve of the op's own collective:
    gloo's single large all_to_all or all_gather runs at half the link rate in one call
    and near it in the next (bench collectives' 4 MiB all_to_all: 34 ms in one run, 69
    ms in another), while pieces of a MiB or less, issued back to back, move at about
    the rate of an all_reduce. The bytes on the wire, not the collective's name, set a
    piece's time. Unchanged without a curve or the bytes."""
    n, kind = int(r["world_size"]), PIECE_CURVE
    curve = curves.get((kind, n, str(r.get("link", ""))))
    p = int(r.get("chunks", 1))
    if not curve or len(curve) < 2 or not r.get("comm_bytes") or r.get("path") != "fused" or p < 2:
        return r
    piece = curve_time(curve, float(r["comm_bytes"]) / wire_factor(kind, n) / p)
    return {**r, "t_comm_s": p * piece, "_pieces_priced": True}


def _op_rows(coll: list[dict], ops: list[dict]) -> list[Row]:
    profiles = _profiles(coll)
    curves = _curves(coll)
    ops = [_piece_priced(r, curves) for r in ops]
    groups = defaultdict(list)
    for r in ops:
        if r.get("t_compute_s", 0) > 0 and r.get("t_comm_s", 0) > 0:
            groups[_group_key(r)].append(r)
    rows = []
    for key, recs in groups.items():
        prof = profiles.get(key[3]) or MachineProfile(latency_s=0.0, bandwidth_Bps=1.0)
        others = [r for k, g in groups.items() if k != key for r in g]
        o = PipelineOverheads(*fit_pipeline(others, prof))
        shape = ",".join(f"{k}={v}" for k, v in key[1])
        for r in recs:
            p = int(r.get("chunks", 1))
            if r.get("path") != "fused" or p < 2 or not r.get("t_fused_s", 0) > 0:
                continue
            pred = fused_time(r["t_compute_s"], r["t_comm_s"], p, o, comm_latency_s=op_comm_latency(r, prof))
            rows.append(Row(f"local {key[0]} [{shape}] n={key[2]} chunks={p} fused",
                            f"{_files([r])}: plait bench ops", pred * 1e3, r["t_fused_s"] * 1e3, "ms",
                            "local", note=f"pipeline from measured compute and "
                                          f"{'piece-size curve' if r.get('_pieces_priced') else 'plain'}"
                                          f" comm; overhead "
                                          f"{o.per_piece_overhead_s * 1e6:.0f} us, slowdown "
                                          f"{o.overlap_slowdown:.2f} fitted on other groups"))
        rows += _auto_row(key, recs, prof, o, shape)
    return rows


def _counts(recs) -> str:
    """The piece counts auto took, run by run (one figure where they agree)."""
    counts = [r.get("chunks") for r in recs]
    return str(counts[0]) if len(set(counts)) == 1 else ", ".join(map(str, counts))


def _auto_row(key, recs, prof, o, shape) -> list[Row]:
    timed = [r for r in recs if r.get("t_fixed_s") and r.get("t_fused_s", 0) > 0]
    if timed:  # plait bench ops: the operators' own auto, timed beside fixed piece counts
        fixed = defaultdict(list)
        for r in timed:
            for p, t in r["t_fixed_s"].items():
                fixed[int(p)].append(float(t))
        meas = {p: statistics.median(v) for p, v in fixed.items()}
        best = min(meas, key=meas.get)
        # auto as timed against the best count, round by round (the two ran moments apart);
        # the note adds auto's count timed as a fixed one (the same code, where the bench
        # found it so) against the best: the choice alone
        rounds = [r for r in timed if "auto" in r.get("t_rounds_s", {})]
        paired = [a / b for r in rounds
                  for a, b in zip(r["t_rounds_s"]["auto"], r["t_rounds_s"][str(best)])]
        choice = [a / b for r in rounds if r.get("auto_choice_over_best_fixed") is not None
                  for a, b in zip(r["t_rounds_s"][str(r["chunks"])], r["t_rounds_s"][str(best)])]
        if paired:
            auto, how = meas[best] * statistics.median(paired), (
                f"median of {len(paired)} per-round ratios auto / {best} pieces")
            if choice:
                how += (f"; auto's count timed as a fixed one / {best}: "
                        f"{statistics.median(choice):.3f}")
        else:  # older records: medians only
            auto, how = statistics.median(float(r["t_fused_s"]) for r in timed), "medians"
        return [Row(f"local chunks=auto vs best fixed: {key[0]} [{shape}] n={key[2]}",
                    f"{_files(timed)}: plait bench ops sweep", auto * 1e3, meas[best] * 1e3, "ms",
                    "local-auto", note=f"the operator's auto ({_counts(timed)} pieces) "
                                       f"measured; best fixed {best} (by median); {how}")]
    fused = [r for r in recs if r.get("path") == "fused" and r.get("t_fused_s", 0) > 0]
    by_p = defaultdict(list)
    for r in fused:
        by_p[int(r["chunks"])].append(float(r["t_fused_s"]))
    by_p[1] += [float(r["t_unfused_s"]) for r in recs if r.get("t_unfused_s", 0) > 0]
    if len([p for p in by_p if by_p[p]]) < 2:
        return []
    meas = {p: statistics.median(v) for p, v in by_p.items() if v}
    tc = statistics.median(r["t_compute_s"] for r in recs)
    tm = statistics.median(r["t_comm_s"] for r in recs)
    p_auto, t_pred = best_chunks(tc, tm, o, max_chunks=max(meas),
                                 comm_latency_s=op_comm_latency(recs[0], prof))
    if t_pred >= 0.98 * (tc + tm):
        p_auto = 1
    nearest = min(meas, key=lambda p: (abs(p - p_auto), p))
    best = min(meas, key=meas.get)
    return [Row(f"local chunks=auto vs best fixed: {key[0]} [{shape}] n={key[2]}",
                f"{_files(recs)}: plait bench ops sweep", meas[nearest] * 1e3, meas[best] * 1e3, "ms",
                "local-auto", note=f"auto picks {p_auto} (measured at {nearest}); best fixed {best}")]


def local_rows(records: list[dict]) -> list[Row]:
    """Rows from this machine's benchmark records (see module doc for the splits)."""
    coll, ops = split_records(records)
    return _collective_rows(coll) + _op_rows(coll, ops)


def summarize(rows: list[Row]) -> dict:
    """Per kind: count, median (local-auto: max) relative error, threshold, pass."""
    out = {}
    for kind, limit in THRESHOLDS.items():
        errs = [r.rel_error for r in rows if r.kind == kind and r.role == "validation"]
        if not errs:
            out[kind] = {"n": 0, "threshold": limit, "pass": None}
            continue
        stat = max(errs) if kind == "local-auto" else statistics.median(errs)
        out[kind] = {"n": len(errs), "statistic": "max" if kind == "local-auto" else "median",
                     "rel_error": stat, "threshold": limit, "pass": stat <= limit}
    return out
