"""Calibration: recover known constants from synthetic benchmark records; profile round-trip."""

import json

import numpy as np
import pytest

from plait.perf.calibrate import (DEFAULT_PROFILE, MachineProfile, default_profile_path, fit_alpha_beta,
                                  fit_pipeline, fit_profile, load_profile, load_records)
from plait.perf.collectives import bus_factor, collective_time
from plait.perf.pipeline import PipelineOverheads, fused_time

TRUE = MachineProfile(latency_s=80e-6, bandwidth_Bps=0.11e9, base_latency_s=300e-6)
O_TRUE, K_TRUE = 1.5e-3, 0.2


def _coll_records(rng, noise=0.02, world=4):
    out = []
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for nbytes in [2 ** k for k in range(10, 26, 2)]:
            t = collective_time(coll, nbytes, world, TRUE) * (1 + rng.normal(0, noise))
            out.append({"collective": coll, "bytes": nbytes, "time_s": t, "world_size": world,
                        "algbw_GBps": nbytes / t / 1e9, "busbw_GBps": nbytes / t / 1e9 * bus_factor(coll, world),
                        "link": "1gbit", "hosts": world, "time_min_s": t * 0.95, "time_max_s": t * 1.05})
    return out


def _op_records(rng, noise=0.01, world=4):
    out = []
    for m in (512, 1024, 2048):
        flops = 2.0 * m * 1024 * 1024
        tc = 1e-3 + flops / 30e9
        nbytes = m * 1024 * 4
        tm = collective_time("all_reduce", nbytes, world, TRUE)
        lat = collective_time("all_reduce", 0, world, TRUE)
        for p in (1, 2, 4, 8):
            tf = fused_time(tc, tm, p, PipelineOverheads(O_TRUE, K_TRUE), comm_latency_s=lat)
            out.append({"op": "matmul_all_reduce", "shape": {"m": m, "k": 1024, "n": 1024},
                        "world_size": world, "t_compute_s": tc, "t_comm_s": tm, "t_unfused_s": tc + tm,
                        "t_fused_s": tf * (1 + rng.normal(0, noise)), "t_limit_s": max(tc, tm),
                        "chunks": p, "path": "fused" if p > 1 else "fallback", "correct": True,
                        "link": "1gbit", "flops": flops, "comm_bytes": nbytes})
    return out


def test_fit_recovers_latency_and_bandwidth():
    recs = _coll_records(np.random.default_rng(1))
    base, alpha, bw, err = fit_alpha_beta(recs)
    assert bw == pytest.approx(TRUE.bandwidth_Bps, rel=0.03)
    # base and per-step latency trade off across collectives; their sum per call is what matters
    for n_steps in (3, 6):
        assert base + n_steps * alpha == pytest.approx(TRUE.base_latency_s + n_steps * TRUE.latency_s,
                                                       rel=0.10)
    assert err < 0.05


def test_fit_profile_recovers_pipeline_constants_and_compute_rate():
    rng = np.random.default_rng(2)
    prof = fit_profile(_coll_records(rng) + _op_records(rng))
    assert prof.bandwidth_Bps == pytest.approx(TRUE.bandwidth_Bps, rel=0.03)
    assert prof.compute_flops == pytest.approx(30e9, rel=0.03)
    assert prof.per_piece_overhead_s == pytest.approx(O_TRUE, rel=0.15, abs=2e-4)
    assert prof.overlap_slowdown == pytest.approx(K_TRUE, abs=0.06)
    assert prof.link == "1gbit" and prof.world_size == 4 and "collective" in prof.source
    assert prof.compute_time_s(30e9) == pytest.approx(1.0, rel=0.03)
    with pytest.raises(ValueError, match="no compute rate"):
        TRUE.compute_time_s(1.0)
    o, k = fit_pipeline(_op_records(rng, noise=0.0), TRUE)
    assert o == pytest.approx(O_TRUE, rel=0.02) and k == pytest.approx(K_TRUE, abs=1e-6)


def test_profile_round_trip_and_default_location(tmp_path, monkeypatch):
    prof = fit_profile(_coll_records(np.random.default_rng(3)))
    path = prof.save(tmp_path / "sub" / "profile.json")
    again = MachineProfile.load(path)
    assert again == prof and hash(again) == hash(prof)
    monkeypatch.setenv("PLAIT_PROFILE", str(path))
    assert default_profile_path() == path
    assert load_profile() == prof
    assert load_profile(tmp_path / "missing.json") is DEFAULT_PROFILE
    monkeypatch.delenv("PLAIT_PROFILE")
    assert default_profile_path().parts[-3:] == (".cache", "plait", "profile.json")


def test_records_as_object_or_list_and_bad_profiles(tmp_path):
    recs = _coll_records(np.random.default_rng(4))[:3]
    (tmp_path / "a.json").write_text(json.dumps({"meta": {}, "records": recs}))
    (tmp_path / "b.json").write_text(json.dumps(recs))
    loaded = load_records([tmp_path / "a.json", tmp_path / "b.json"])
    assert len(loaded) == 6 and loaded[0]["_file"].endswith("a.json")
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        MachineProfile(latency_s=1e-6, bandwidth_Bps=0.0)
    with pytest.raises(ValueError, match="unknown fields"):
        MachineProfile.from_dict({"latency_s": 1.0, "bandwidth_Bps": 1.0, "colour": "red"})
    with pytest.raises(ValueError, match=">= 2 collective records"):
        fit_alpha_beta(recs[:1])


def test_per_collective_constants_are_used_by_collective_time():
    prof = MachineProfile(latency_s=1e-3, bandwidth_Bps=1e8,
                          collectives=(("reduce_scatter", 0.0, 1e-3, 0.5e8),))
    t_rs = collective_time("reduce_scatter", 1e8, 2, prof)
    t_ag = collective_time("all_gather", 1e8, 2, prof)
    assert t_rs == pytest.approx(1e-3 + 0.5 * 1e8 / 0.5e8)
    assert t_ag == pytest.approx(1e-3 + 0.5 * 1e8 / 1e8)


def test_a_profile_keeps_the_pieces_model_bench_ops_measured(tmp_path):
    """fit_profile(measured=) → save → load → the operators' Calibration: the same curves,
    GEMM table, lookup rate, k and o as the calibration bench ops recorded."""
    from dataclasses import replace

    from plait.perf.pieces import GEMM_ROWS, GEMM_WIDTHS, Calibration, calibration_dict, from_profile

    gemm = tuple(tuple(1e9 * (1 + i) * (1 + j) for j in range(len(GEMM_WIDTHS)))
                 for i in range(len(GEMM_ROWS)))
    measured = Calibration(replace(DEFAULT_PROFILE, overlap_slowdown=0.45, per_piece_overhead_s=3e-4),
                           memory_Bps=1.5e10, gemm=gemm,
                           curves={"all_to_all": ((1e4, 1e-4), (1e6, 8e-3), (4e6, 7e-2))})
    rng = np.random.default_rng(3)
    prof = fit_profile(_coll_records(rng) + _op_records(rng),
                       measured=json.loads(json.dumps(calibration_dict(measured))))
    cal = from_profile(MachineProfile.load(prof.save(tmp_path / "p.json")))
    assert cal.curves == measured.curves and cal.gemm == measured.gemm
    assert cal.memory_Bps == 1.5e10
    assert cal.gemm_rate(100, 3000) == pytest.approx(measured.gemm_rate(100, 3000))
    assert (cal.profile.overlap_slowdown, cal.profile.per_piece_overhead_s) == (0.45, 3e-4)
    assert cal.comm_time("all_to_all", 2e6) == pytest.approx(measured.comm_time("all_to_all", 2e6))
    assert from_profile(fit_profile(_coll_records(rng))).gemm == ()  # without: α–β, flat rate


def test_several_bench_ops_runs_give_their_median_calibration(tmp_path):
    """load_calibration: figure by figure, the median of the runs shaped like the newest;
    one run's slow stretch is outvoted, and a run of another shape is left out."""
    import os

    from plait.perf.calibrate import load_calibration
    from plait.perf.pieces import Calibration, calibration_dict

    def run(name, scale, world=2, mtime=0):
        cal = Calibration(replace_profile(world, 1e10 * scale), memory_Bps=1e9 * scale,
                          gemm=((1e9 * scale, 2e9 * scale), (3e9 * scale, 4e9 * scale)),
                          curves={"all_reduce": ((1e4, 1e-4 / scale), (1e6, 1e-2 / scale))})
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {"calibration": calibration_dict(cal)}, "records": []}))
        os.utime(path, (mtime, mtime))
        return path

    paths = [run("a.json", 1.0, mtime=1), run("b.json", 0.5, mtime=2), run("c.json", 1.2, mtime=3),
             run("other.json", 9.0, world=4, mtime=0)]
    med = load_calibration(paths)
    assert med["runs"] == 3
    assert med["gemm"] == [[1e9, 2e9], [3e9, 4e9]]  # the 0.5 run's table is outvoted
    assert med["curves"]["all_reduce"] == [[1e4, 1e-4], [1e6, 1e-2]]
    assert med["memory_Bps"] == 1e9 and med["profile"]["compute_flops"] == 1e10
    assert med["profile"]["world_size"] == 2
    assert load_calibration([paths[-1]])["profile"]["world_size"] == 4
    assert load_calibration([tmp_path / "missing.json"]) is None


def replace_profile(world, flops):
    from dataclasses import replace
    return replace(DEFAULT_PROFILE, world_size=world, compute_flops=flops)
