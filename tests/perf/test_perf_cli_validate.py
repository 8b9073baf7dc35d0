"""``plait simulate``: tables, JSON, plots, validation records, clear config errors."""

import argparse
import json

import numpy as np
import pytest

from plait.cli.simulate import register
from plait.perf.collectives import collective_time
from plait.perf.calibrate import MachineProfile
from plait.perf.pipeline import fused_time
from plait.perf.validate import published_rows

REQUIRED = {"case", "source", "predicted", "reference", "rel_error"}


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
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
    pub = data["summary"]["published"]
    assert pub["n"] >= 8 and pub["rel_error"] <= 0.25 and rc == 0
    assert (tmp_path / "v.png").stat().st_size > 1000


def test_published_predictions_are_genuine():
    rows = {r.case: r for r in published_rows()}
    # predictions change with the catalog: not copies of the references
    assert len({round(r.predicted, 6) for r in rows.values()}) > len(rows) // 2
    assert all(r.rel_error > 1e-6 for r in rows.values())


def _bench_files(tmp_path):
    prof = MachineProfile(latency_s=0.2e-3, bandwidth_Bps=0.1e9, base_latency_s=0.5e-3)
    rng = np.random.default_rng(0)
    coll = []
    for c in ("all_reduce", "all_gather"):
        for b in [2 ** k for k in range(12, 26)]:
            t = collective_time(c, b, 2, prof) * (1 + rng.normal(0, 0.03))
            coll.append({"collective": c, "bytes": b, "time_s": t, "world_size": 2, "link": "1gbit",
                         "hosts": 2, "algbw_GBps": 0.0, "busbw_GBps": 0.0,
                         "time_min_s": t * 0.9, "time_max_s": t * 1.1})
    ops = []
    for m in (256, 512, 1024):
        tc, tm = m * 1e-4, collective_time("all_reduce", m * 4096, 2, prof)
        lat = collective_time("all_reduce", 0, 2, prof)
        for p in (1, 2, 4, 8):
            tf = fused_time(tc, tm, p, 1e-3, comm_latency_s=lat) * (1 + rng.normal(0, 0.01))
            ops.append({"op": "matmul_all_reduce", "shape": {"m": m, "k": 1024, "n": 1024},
                        "world_size": 2, "t_compute_s": tc, "t_comm_s": tm, "t_unfused_s": tc + tm,
                        "t_fused_s": tf, "t_limit_s": max(tc, tm), "chunks": p,
                        "path": "fused" if p > 1 else "fallback", "correct": True, "link": "1gbit"})
    (tmp_path / "c.json").write_text(json.dumps({"records": coll}))
    (tmp_path / "o.json").write_text(json.dumps(ops))  # a bare list is accepted too
    return [str(tmp_path / "c.json"), str(tmp_path / "o.json")]


def test_local_rows_from_bench_files_and_calibration(tmp_path, capsys):
    files = _bench_files(tmp_path)
    out = tmp_path / "v.json"
    rc = _run(["--validate", "--measurements", *files, "--json", str(out)])
    data = json.loads(out.read_text())
    kinds = {r["kind"] for r in data["records"]}
    assert {"published", "local", "local-auto"} <= kinds
    assert data["summary"]["local"]["rel_error"] <= 0.15
    assert data["summary"]["local-auto"]["rel_error"] <= 0.05
    assert rc == 0
    prof_path = tmp_path / "profile.json"
    assert _run(["--calibrate", "--measurements", *files, "--profile", str(prof_path)]) == 0
    prof = MachineProfile.load(prof_path)
    assert prof.bandwidth_Bps == pytest.approx(0.1e9, rel=0.1)
    assert prof.per_piece_overhead_s == pytest.approx(1e-3, rel=0.3)


def test_simulate_presets_table_json_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = _run(["--cluster", "h100-64", "--model", "llama3-8b", "--tp", "8", "--dp", "8", "--fsdp",
               "--steps", "2", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "exposed communication" in text and "semi" in text
    data = json.loads(out.read_text())
    assert len(data["records"]) == 10 and {"step_s", "exposed_comm_share"} <= set(data["records"][0])
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
