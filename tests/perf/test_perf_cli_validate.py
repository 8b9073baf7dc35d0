"""``plait simulate``: tables, JSON, plots, validation records, clear config errors.

The validation is checked row by row: each published figure against its own tolerance
(references.py), the rows the model is known to miss marked as such with the reason;
local rows predict real measurements, recorded by ``plait bench`` on plait's
development VM (tests/data/perf, see its README), never data made by the model itself."""

import json
import re
import statistics
from pathlib import Path

import pytest

from plait.cli.main import build_parser
from plait.perf.calibrate import MachineProfile, load_records, split_records
from plait.perf.references import REFERENCES
from plait.perf.validate import THRESHOLDS, local_rows, published_rows

REQUIRED = {"case", "source", "predicted", "reference", "rel_error"}
DATA = Path(__file__).resolve().parents[1] / "data" / "perf"
RECORDED = sorted(str(p) for p in DATA.glob("bench-*-quick-run-*.json"))
LINK_BPS = 1e9 / 8  # the 1 Gbit/s emulated link the recordings ran over, per direction

# published rows the model misses, and why; strict: a fix makes these tests fail until the
# mark is taken off
KNOWN_MISSES = {
    "SC'24 fused operators, 4 GPUs: lower combined time": (
        "the model prices every piece as two kernel launches (2 x 5 us) plus a whole collective "
        "call (12 us latency); for the decode GEMV+AllReduce (30 us compute, 15 us all-reduce) "
        "that is more than a piece can hide, so it predicts no gain (0 %) where the paper's one "
        "persistent kernel with GPU-initiated puts pays neither; with the MoE case's 14.6 % "
        "the mean is 7.3 % against the published 12-20 % (and the shapes are plait's, the "
        "paper's are not encoded)"),
    "async TP Llama 3 8B, 64xH100 (FSDP 8, TP 8): throughput gain": (
        "the simulator prices overlapped pieces with no overlap slowdown (compute beside a "
        "transfer at full speed) and no cost for cutting each TP matmul into 8 smaller GEMMs; "
        "it predicts 16.9 % against the measured 9.9 % (an overlap slowdown of 0.5 would give "
        "9.3 %, but no published figure sets one)"),
    "async TP Llama 3 70B, 256xH100 (FSDP 32, TP 8): throughput gain": (
        "as for 8B: no overlap slowdown and free matmul decomposition in the simulator; it "
        "predicts 20.1 % against the measured 9.2 %"),
}
# the operators' chunks="auto" against the best fixed count on the recorded runs: most
# shapes within the 5 % the CLI asks, these not
AUTO_MISS = (
    "recorded runs: at embedding_all_to_all pool=32 auto took 8 pieces (its cost model: 22-24 % "
    "faster than plain) where 2 pieces were fastest in both runs and 8 were 15-17 % slower "
    "(auto_choice_over_best_fixed 1.15 and 1.17): the model underprices an embedding piece at "
    "that pool; four more shapes are 5-10 % off, about the round-to-round spread of two "
    "equally good counts on the shared 2-core VM")


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(["simulate", *argv])
    return args.func(args)


def test_validate_json_has_required_keys_and_names_every_source(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no reports/bench here: local rows skipped with a hint
    out = tmp_path / "out.json"
    rc = _run(["--validate", "--json", str(out), "--plot", str(tmp_path / "v.png")])
    text = capsys.readouterr().out
    assert "local rows skipped" in text and "plait bench ops --json reports/bench/ops.json" in text
    data = json.loads(out.read_text())
    assert data["records"] and all(REQUIRED <= set(r) for r in data["records"])
    assert all(r["source"] for r in data["records"])
    # every published row carries its own tolerance into the JSON
    assert {r["case"]: r["tolerance"] for r in data["records"]} == {
        c: ref.tolerance for c, ref in REFERENCES.items()}
    pub = data["summary"]["published"]  # the CLI's median; each row on its own: below
    assert pub["n"] >= 8 and pub["rel_error"] <= THRESHOLDS["published"] and rc == 0
    assert (tmp_path / "v.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def published() -> dict:
    return {r.case: r for r in published_rows()}


def test_every_reference_has_a_row(published):
    assert set(published) == set(REFERENCES)


def _case(case: str):
    if case not in KNOWN_MISSES:
        return case
    return pytest.param(case, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                                      reason=KNOWN_MISSES[case]))


@pytest.mark.parametrize("case", [_case(c) for c in REFERENCES])
def test_published_row_within_its_own_tolerance(case, published):
    row = published[case]
    assert row.rel_error <= row.tolerance == REFERENCES[case].tolerance, (
        f"{case}: predicted {row.predicted:.4g} against {row.reference:.4g} {row.unit}, "
        f"{row.rel_error:.1%} off; tolerance {row.tolerance:.0%}")


def test_published_predictions_are_genuine(published):
    # predictions change with the catalog: not copies of the references
    assert len({round(r.predicted, 6) for r in published.values()}) > len(published) // 2
    assert all(r.rel_error > 1e-6 for r in published.values())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[int, dict]:
    """``plait simulate --validate`` on the recorded runs: (exit status, its JSON)."""
    assert len(RECORDED) == 4, f"tests/data/perf holds {RECORDED}"
    out = tmp_path_factory.mktemp("validate") / "v.json"
    rc = _run(["--validate", "--measurements", *RECORDED, "--json", str(out)])
    return rc, json.loads(out.read_text())


def _rows(data: dict, kind: str, source: str = "") -> list[dict]:
    return [r for r in data["records"] if r["kind"] == kind and source in r["source"]]


_COLL_CASE = re.compile(r"local (\w+) n=(\d+) (\d+) B on (\S+)$")


def test_local_collective_rows_predict_measured_sizes_never_fitted(recorded):
    """Each row's reference is a recorded time; alpha-beta is fitted on every other size
    (sorted) of its series, so no size a row predicts was fitted, in any run."""
    coll, _ = split_records(load_records(RECORDED))
    series: dict = {}
    for r in coll:
        series.setdefault((r["collective"], r["world_size"], r["link"]), []).append(r)
    rows = _rows(recorded[1], "local", "bench collectives")
    by_series: dict = {}
    for row in rows:
        name, n, size, link = _COLL_CASE.match(row["case"]).groups()
        by_series.setdefault((name, int(n), link), []).append((int(size), row["reference"]))
    assert set(by_series) == set(series)  # every collective of the recordings, all 5
    for key, recs in series.items():
        held_out = sorted({r["bytes"] for r in recs})[1::2]
        expected = sorted((r["bytes"], r["time_s"] * 1e3) for r in recs if r["bytes"] in held_out)
        got = sorted(by_series[key])
        assert [s for s, _ in got] == [s for s, _ in expected], key  # every run's record, no other
        assert [t for _, t in got] == pytest.approx([t for _, t in expected], rel=1e-12), key
    assert all(r["predicted"] != r["reference"] for r in rows)


def _scaled(records: list[dict], which, factor: float) -> list[dict]:
    """``records`` with the measured times of those ``which`` picks multiplied by ``factor``."""
    keys = ("time_s", "time_min_s", "time_max_s", "t_fused_s")
    return [{**r, **{k: r[k] * factor for k in keys if k in r}} if which(r) else r for r in records]


def test_no_local_row_is_predicted_from_its_own_measurement():
    """Triple the held-out sizes' measured times: their predictions do not move (the fit
    never saw them); the same for one op/shape group's fused times (its per-piece overhead
    is fitted on the other groups), while the other groups' predictions do move."""
    records = load_records(RECORDED)
    coll, _ = split_records(records)
    held_out = {(name, size) for name in {r["collective"] for r in coll}
                for size in sorted({r["bytes"] for r in coll if r["collective"] == name})[1::2]}
    base = local_rows(records)

    def moved(which) -> list:
        rows = local_rows(_scaled(records, which, 3.0))
        assert [r.case for r in rows] == [r.case for r in base]
        return rows

    after = moved(lambda r: (r.get("collective"), r.get("bytes")) in held_out)
    pairs = [(b, a) for b, a in zip(base, after) if "bench collectives" in b.source]
    assert len(pairs) >= 20 and all(a.predicted == b.predicted for b, a in pairs)
    assert all(a.reference == pytest.approx(3 * b.reference) for b, a in pairs)

    def in_group(r: dict) -> bool:  # embedding_all_to_all [pool=8], both runs
        return r.get("op") == "embedding_all_to_all" and r["shape"]["pool"] == 8
    after = moved(in_group)
    ops = [(b, a) for b, a in zip(base, after) if b.kind == "local" and "bench ops" in b.source]
    mine = [(b, a) for b, a in ops if b.case.startswith("local embedding_all_to_all [")
            and "pool=8," in b.case]
    assert len(mine) == 2 and all(a.predicted == b.predicted for b, a in mine)
    assert all(a.reference == pytest.approx(3 * b.reference) for b, a in mine)
    # the other groups' overhead was fitted on this group too: theirs do move
    assert any(a.predicted != b.predicted for b, a in ops if (b, a) not in mine)


def test_local_op_rows_predict_every_recorded_fused_op(recorded):
    _, ops = split_records(load_records(RECORDED))
    measured = sorted(r["t_fused_s"] * 1e3 for r in ops if r["path"] == "fused" and r["chunks"] > 1)
    rows = _rows(recorded[1], "local", "bench ops")
    assert sorted(r["reference"] for r in rows) == pytest.approx(measured, rel=1e-12)
    assert {r["case"].split()[1] for r in rows} == {"matmul_all_reduce", "matmul_reduce_scatter",
                                                   "embedding_all_to_all", "all_to_all_matmul",
                                                   "matmul_all_to_all"}
    assert all("fitted on other groups" in r["note"] for r in rows)
    groups = {(r["op"], json.dumps(r["shape"], sort_keys=True)) for r in ops}
    assert len(_rows(recorded[1], "local-auto")) == len(groups) == 16  # one per op and shape


def test_local_rows_median_error_on_recorded_runs(recorded):
    """The CLI's local rule (median within 15 %), and the same for the collectives and the
    fused ops apart, so neither half's model can hide behind the other's."""
    rc, data = recorded
    local = data["summary"]["local"]
    assert local["n"] >= 30 and local["rel_error"] <= THRESHOLDS["local"] and local["pass"]
    for source in ("bench collectives", "bench ops"):
        errs = [r["rel_error"] for r in _rows(data, "local", source) if r["role"] == "validation"]
        assert len(errs) >= 10 and statistics.median(errs) <= THRESHOLDS["local"], source


def test_fused_op_model_beats_no_overlap_and_perfect_overlap(recorded):
    """The piece pipeline must explain the recorded fused times better than either bound it
    sits between: compute then communication (no overlap) and max of the two (perfect)."""
    _, ops = split_records(load_records(RECORDED))
    fused = [r for r in ops if r["path"] == "fused" and r["chunks"] > 1]
    model = statistics.median(r["rel_error"] for r in _rows(recorded[1], "local", "bench ops"))
    for bound in (lambda r: r["t_compute_s"] + r["t_comm_s"],
                  lambda r: max(r["t_compute_s"], r["t_comm_s"])):
        naive = statistics.median(abs(bound(r) - r["t_fused_s"]) / r["t_fused_s"] for r in fused)
        assert model < 0.6 * naive, (model, naive)


def test_auto_is_as_fast_as_the_best_fixed_count_on_most_recorded_shapes(recorded):
    """Weaker than the CLI's rule (every shape within 5 %, xfailed below): the median."""
    errs = [r["rel_error"] for r in _rows(recorded[1], "local-auto")]
    assert statistics.median(errs) <= THRESHOLDS["local-auto"]
    assert max(errs) <= 0.2  # none past the worst recorded miss (15.8 %) by much


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=AUTO_MISS)
def test_auto_within_5_percent_of_the_best_fixed_count_on_every_recorded_shape(recorded):
    rc, data = recorded
    assert data["summary"]["local-auto"]["pass"] and rc == 0


def test_calibration_from_recorded_runs_finds_the_link_rate(tmp_path):
    """The fit of the recorded collectives: no collective faster than the 1 Gbit/s link,
    all_reduce close to it (gloo's all_reduce ran at 93-94 % of the link)."""
    prof_path = tmp_path / "profile.json"
    assert _run(["--calibrate", "--measurements", *RECORDED, "--profile", str(prof_path)]) == 0
    prof = MachineProfile.load(prof_path)
    assert prof.link == "1gbit" and prof.world_size == 2
    bw = {name: b for name, _, _, b in prof.collectives}
    assert set(bw) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                       "all_to_all_uneven"}
    assert all(0 < b <= LINK_BPS for b in bw.values()) and prof.bandwidth_Bps <= LINK_BPS
    assert bw["all_reduce"] == pytest.approx(0.94 * LINK_BPS, rel=0.1)
    # the pieces model bench ops measured (its meta) comes with it
    assert prof.per_piece_overhead_s > 0 and prof.curves and prof.gemm


def test_simulate_presets_table_json_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = _run(["--cluster", "h100-64", "--model", "llama3-8b", "--tp", "8", "--dp", "8", "--fsdp",
               "--steps", "2", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "exposed communication" in text and "semi" in text
    data = json.loads(out.read_text())
    assert len(data["records"]) == 10 and {"step_s", "exposed_comm_share"} <= set(data["records"][0])
    # how long the simulation took is reported by the command, not asserted by a test
    assert re.search(r"simulated in \d+\.\d s", text) and data["wall_s"] > 0
    assert png.stat().st_size > 1000


def test_bad_configs_fail_with_the_field_named(tmp_path, capsys):
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"cluster": {"gpu": "H900", "nodes": 1}, "model": "gpt-small"}))
    assert _run(["--config", str(cfg)]) == 2
    assert "cluster.gpu: unknown GPU 'H900'" in capsys.readouterr().err
    assert _run(["--cluster", "h100-64", "--model", "llama3-8b", "--tp", "8", "--dp", "4"]) == 2
    assert "tp=8 × dp=4 × ep=1 = 32 do not match 64 GPUs" in capsys.readouterr().err


def test_pieces_are_priced_by_their_wire_bytes_on_the_all_reduce_curve():
    """A piece's time is its bytes on the wire at the all_reduce's measured rate, whatever
    its collective: gloo's one large all_to_all runs at half rate in some calls, its
    pieces do not, so that op's own curve would price them as slow as the worst call."""
    from plait.perf.validate import _piece_priced

    curves = {("all_reduce", 2, "1gbit"): [(1e5, 1e-3), (1e6, 1e-2), (1e7, 1e-1)],
              ("all_to_all", 2, "1gbit"): [(2e5, 2e-3), (2e6, 4e-2), (2e7, 4e-1)]}  # half rate
    rec = {"op": "all_to_all_matmul", "world_size": 2, "link": "1gbit", "chunks": 4,
           "path": "fused", "comm_bytes": 4e6, "t_comm_s": 0.08}
    priced = _piece_priced(rec, curves)
    assert priced["t_comm_s"] == pytest.approx(4 * 1e-2)  # four 1e6-byte pieces at 1e8 B/s
    assert _piece_priced({**rec, "chunks": 1}, curves)["t_comm_s"] == 0.08  # plain: as measured


def test_auto_against_the_best_count_is_compared_round_by_round():
    """Two runs where a slow stretch hit auto's rounds more than the fixed counts' medians
    show: the paired per-round ratio divides it out; the medians alone would not."""
    from plait.perf.validate import _auto_row
    from plait.perf.pipeline import PipelineOverheads

    def run(auto, eight, four):
        return {"op": "matmul_all_reduce", "t_fused_s": sorted(auto)[len(auto) // 2], "chunks": 8,
                "t_fixed_s": {"8": sorted(eight)[len(eight) // 2], "4": sorted(four)[len(four) // 2]},
                "t_rounds_s": {"auto": auto, "8": eight, "4": four}, "_file": "ops.json"}
    # rounds 1-2 slow for every variant; auto was measured slow in more rounds than 8
    slow, fast = 2.0, 1.0
    recs = [run([slow, slow, fast * 1.01], [slow, fast, fast], [slow, 1.2, 1.2]),
            run([fast * 1.01, slow, slow], [fast, fast, slow], [1.2, slow, 1.2])]
    key = ("matmul_all_reduce", (("m", 1),), 2, "1gbit")
    row, = _auto_row(key, recs, MachineProfile(latency_s=0.0, bandwidth_Bps=1.0),
                     PipelineOverheads(0.0, 0.0), "m=1")
    assert row.reference == pytest.approx(1e3)  # best fixed: 8 pieces, median 1.0 s
    assert row.rel_error == pytest.approx(0.01)  # not the 100 % of median(auto) / median(8)
    assert "per-round" in row.note
    for r in recs:  # auto's count (8) timed as a fixed count too: the choice is the best
        r["auto_choice_over_best_fixed"] = 1.0
    row, = _auto_row(key, recs, MachineProfile(latency_s=0.0, bandwidth_Bps=1.0),
                     PipelineOverheads(0.0, 0.0), "m=1")
    assert row.rel_error == pytest.approx(0.01)  # the row is auto as timed
    assert "auto's count timed as a fixed one / 8: 1.000" in row.note
    del recs[0]["t_rounds_s"], recs[1]["t_rounds_s"]  # older records: medians only
    row, = _auto_row(key, recs, MachineProfile(latency_s=0.0, bandwidth_Bps=1.0),
                     PipelineOverheads(0.0, 0.0), "m=1")
    assert row.rel_error == pytest.approx(1.0)
