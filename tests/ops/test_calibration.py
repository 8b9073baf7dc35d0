"""The calibration chunks="auto" uses: measured on the group, identical on every rank, sane."""

import pytest
import torch.distributed as dist

from plait.ops.calibration import CURVE_BYTES, GEMM_ROWS, GEMM_WIDTHS, Calibration, measure
from plait.perf.calibrate import DEFAULT_PROFILE
from plait.testing import run_ranks


def _measure():
    cal = measure()
    return cal, dist.get_rank()


def test_measured_on_the_group_and_the_same_everywhere():
    (a, _), (b, _) = run_ranks(_measure, 2)
    assert a == b  # every rank must pick the same piece count
    p = a.profile
    assert p.compute_flops > 1e8 and a.memory_Bps > 1e7 and p.latency_s > 0
    assert p.overlap_slowdown >= 0 and p.per_piece_overhead_s >= 0
    for kind in ("all_reduce", "all_to_all", "all_gather"):
        sizes = [b for b, _ in a.curves[kind]]
        assert sizes == list(CURVE_BYTES)
        assert all(t > 0 for _, t in a.curves[kind])
    assert len(a.gemm) == len(GEMM_ROWS) and all(len(r) == len(GEMM_WIDTHS) for r in a.gemm)
    assert all(rate > 1e7 for r in a.gemm for rate in r)


def test_curve_interpolates_and_extrapolates():
    cal = Calibration(DEFAULT_PROFILE, curves={"all_to_all": ((1e3, 1e-4), (1e6, 1e-2), (4e6, 5e-2))})
    assert cal.comm_time("all_to_all", 1e6) == pytest.approx(1e-2)
    assert 1e-4 < cal.comm_time("all_to_all", 3e4) < 1e-2
    assert cal.comm_time("all_to_all", 8e6) == pytest.approx(5e-2 + 4e6 * (4e-2 / 3e6))
    assert cal.comm_time("all_gather", 1e6) > 0  # an unmeasured kind: α–β from the profile


def test_gemm_rate_reads_the_table_between_and_beyond_its_points():
    rows = [[1e9 * (1 + i) for _ in GEMM_WIDTHS] for i in range(len(GEMM_ROWS))]
    cal = Calibration(DEFAULT_PROFILE, gemm=tuple(map(tuple, rows)))
    assert cal.gemm_rate(GEMM_ROWS[1], GEMM_WIDTHS[2]) == pytest.approx(2e9)
    assert cal.gemm_rate(1, 10**6) == pytest.approx(1e9)  # held at the edges
    assert cal.gemm_rate(10**6, 1) == pytest.approx(1e9 * len(GEMM_ROWS))
    between = cal.gemm_rate((GEMM_ROWS[1] * GEMM_ROWS[2]) ** 0.5, GEMM_WIDTHS[0])
    assert between == pytest.approx((2e9 * 3e9) ** 0.5)  # halfway in log rows
    assert Calibration(DEFAULT_PROFILE).gemm_rate(64, 64) == DEFAULT_PROFILE.compute_flops


def _interleaved_order():
    from plait.ops.calibration import _interleaved
    order = []
    timed = _interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, None, rounds=3)
    return order, sorted(timed)


def test_figures_are_timed_in_interleaved_rounds():
    """Every figure once a round (after one warm-up each), so drift lands on all alike, in
    balanced orders (two figures: one order, then its reverse)."""
    for order, names in run_ranks(_interleaved_order, 2):
        assert order == ["a", "b"] + ["a", "b"] + ["b", "a"] + ["a", "b"] and names == ["a", "b"]


def _auto_pick():
    from dataclasses import replace
    from plait.ops.context import OpsContext
    from plait.perf.pieces import Work
    # comm-bound, flat compute rate, no per-piece cost: predicted c/p + m, falling to the end
    wire = 8e6
    profile = replace(DEFAULT_PROFILE, compute_flops=1e10, latency_s=1e-9, base_latency_s=0.0,
                      bandwidth_Bps=wire / 0.1, per_piece_overhead_s=0.0, overlap_slowdown=0.0)
    ctx = OpsContext(calibrated=Calibration(profile))
    work = Work(flops=1e8, wire_bytes=wire, kind="all_reduce", taper=False)  # c = 10 ms, m = 100 ms
    return ctx.decide("op", "auto", work=work, rows=1024)


def test_auto_takes_the_predicted_best_not_the_fewest_pieces_near_it():
    # 8 pieces predicted 101.25 ms, 7 pieces 101.43, 4 pieces 102.5: a 2 % tie took 4
    for decision in run_ranks(_auto_pick, 2):
        assert (decision.path, decision.chunks) == ("fused", 8)


def test_a_dip_in_the_rate_table_is_read_as_noise():
    """More rows of the same GEMM never run slower: a dip is pooled with its neighbour."""
    from plait.perf.pieces import rising_in_rows

    column = [10.0, 20.0, 40.0, 50.0, 60.0, 58.0, 47.0]  # 256 and 512 rows timed in a slow moment
    table = tuple((v, 2 * v, 3 * v, 4 * v) for v in column)
    rising = rising_in_rows(table)
    assert [row[0] for row in rising] == [10.0, 20.0, 40.0, 50.0, 55.0, 55.0, 55.0]
    assert [row[3] for row in rising][-3:] == [220.0] * 3
    cal = Calibration(DEFAULT_PROFILE, gemm=table)
    assert cal.gemm_rate(GEMM_ROWS[-1], GEMM_WIDTHS[0]) == pytest.approx(55.0)
    assert cal.gemm_rate(GEMM_ROWS[-1], GEMM_WIDTHS[0]) >= cal.gemm_rate(GEMM_ROWS[-3], GEMM_WIDTHS[0])


def _auto_with_a_profile_on_rank_0_only(path):
    import os

    import torch

    from plait.ops import get_context, matmul_all_reduce

    if dist.get_rank() == 0:  # a profile saved on one host only
        os.environ["PLAIT_PROFILE"] = path
    x, w = torch.ones(512, 256), torch.ones(256, 512)
    y = matmul_all_reduce(x, w, chunks="auto")
    cal = get_context().calibration()
    return cal.profile.source, get_context().decisions["matmul_all_reduce"], float(y[0, 0])


def test_auto_follows_rank_0s_profile_on_every_rank(tmp_path):
    path = tmp_path / "profile.json"
    DEFAULT_PROFILE.save(path)
    (src0, d0, y0), (src1, d1, y1) = run_ranks(_auto_with_a_profile_on_rank_0_only, 2, str(path))
    assert src0 == src1 == DEFAULT_PROFILE.source  # rank 1 took rank 0's, measured nothing
    assert d0 == d1 and y0 == y1 == 2 * 256


def _auto_on_loopback_gloo(path):
    import os

    import torch

    from plait.ops import get_context, matmul_all_reduce

    os.environ["PLAIT_PROFILE"] = path
    x, w = torch.ones(1024, 512), torch.ones(512, 1024)
    y = matmul_all_reduce(x, w, chunks="auto")
    ctx = get_context()
    return ctx.mover().one_host, ctx.decisions["matmul_all_reduce"], float(y[0, 0])


def test_auto_on_gloo_between_ranks_of_one_host_takes_the_plain_path(tmp_path):
    # measured here (no saved profile): loopback TCP is copied by the cores that compute,
    # so auto falls back before any model is read; a saved profile is followed as it stands
    measured = run_ranks(_auto_on_loopback_gloo, 2, str(tmp_path / "none.json"),
                         env={"PLAIT_TRANSPORT": "gloo"})
    for one_host, decision, y in measured:
        assert one_host and y == 2 * 512
        assert (decision.path, decision.chunks) == ("fallback", 1)
        assert "loopback" in decision.reason
    path = tmp_path / "profile.json"
    DEFAULT_PROFILE.save(path)
    saved = run_ranks(_auto_on_loopback_gloo, 2, str(path), env={"PLAIT_TRANSPORT": "gloo"})
    assert all("loopback" not in decision.reason for _, decision, _ in saved)
