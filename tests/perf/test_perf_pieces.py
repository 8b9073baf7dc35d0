"""The cost model chunks="auto" decides with: pure, no processes."""

from dataclasses import replace

import pytest

from plait.perf.pieces import GEMM_ROWS, GEMM_WIDTHS, Calibration, Work, predict
from plait.perf.calibrate import DEFAULT_PROFILE

# a wire of 1e8 B/s with no latency, compute of 1e10 FLOP/s, no overheads
LINE = ((1e3, 1e-5), (1e6, 1e-2), (1e7, 0.1))
FLAT = Calibration(replace(DEFAULT_PROFILE, compute_flops=1e10, per_piece_overhead_s=0.0,
                           overlap_slowdown=0.0), curves={"all_reduce": LINE, "all_gather": LINE})


def test_one_piece_is_the_plain_path():
    work = Work(flops=5e8, wire_bytes=1e7, kind="all_reduce")
    assert predict(FLAT, work, 1) == pytest.approx(0.05 + 0.1)
    gather = Work(flops=5e8, wire_bytes=1e7, kind="all_gather", receive=True)
    assert predict(FLAT, gather, 1) == pytest.approx(0.15)


def test_pieces_approach_the_slower_resource():
    work = Work(flops=5e8, wire_bytes=1e7, kind="all_reduce", length=1024, width=1024, taper=False)
    times = [predict(FLAT, work, p) for p in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    # first piece's compute, then the wire throughout: 0.05/8 + 0.1
    assert times[-1] == pytest.approx(0.05 / 8 + 0.1)


def test_a_gathers_own_rows_hide_behind_the_first_transfer():
    plain = Work(flops=5e8, wire_bytes=1e7, kind="all_gather", receive=True)
    own = replace(plain, flops=2.5e8, lead_flops=2.5e8)  # half the rows need no wire
    assert predict(FLAT, own, 1) == pytest.approx(0.1 + 0.025)
    assert predict(FLAT, own, 1) < predict(FLAT, plain, 1)
    # MoE dispatch: the plain path moves everything, then multiplies; pieces hide own rows
    moe = replace(own, lead_in_plain=False)
    assert predict(FLAT, moe, 1) == pytest.approx(0.15)
    assert predict(FLAT, moe, 2) == predict(FLAT, own, 2) < predict(FLAT, plain, 2)


def test_a_reduce_scatters_own_rows_run_beside_the_last_transfers():
    # half the partial sums stay here: computed after the last piece is sent, beside the wire
    remote = Work(flops=2.5e8, tail_flops=2.5e8, wire_bytes=1e7, kind="all_reduce", length=1024,
                  width=1024, taper=False)
    assert predict(FLAT, remote, 1) == pytest.approx(0.05 + 0.1)  # plain: all, then the wire
    # the remote half's first piece (0.025 / 4), then the wire throughout; own rows hidden
    assert predict(FLAT, remote, 4) == pytest.approx(0.025 / 4 + 0.1)
    bulky = replace(remote, tail_flops=5e9)  # own rows longer than the wire: they set the end
    assert predict(FLAT, bulky, 4) == pytest.approx(0.025 + 0.5)


def test_slow_small_gemms_make_many_pieces_lose():
    # 128 rows and fewer at a quarter of the rate: the shape where fixed 8 pieces lost here
    table = tuple(tuple(2.5e9 if rows <= 128 else 1e10 for _ in GEMM_WIDTHS) for rows in GEMM_ROWS)
    cliff = replace(FLAT, gemm=table)
    work = Work(flops=2e9, wire_bytes=1e6, kind="all_reduce", length=1024, width=2048)
    assert predict(cliff, work, 8) > predict(cliff, work, 2)  # 128-row pieces at a quarter rate
    assert predict(FLAT, work, 8) < predict(FLAT, work, 2)  # the flat-rate model misses it


def test_overheads_cost_per_piece():
    slow = replace(FLAT, profile=replace(FLAT.profile, per_piece_overhead_s=0.01))
    work = Work(flops=5e8, wire_bytes=1e5, kind="all_reduce")  # compute-bound
    assert predict(slow, work, 4) - predict(FLAT, work, 4) == pytest.approx(3 * 0.01)


@pytest.mark.parametrize("k", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("flops", [2e8, 1e9, 3e9])  # compute 20 ms, 100 ms, 300 ms
def test_the_simulators_closed_form_is_the_equal_piece_flat_rate_case(k, flops):
    """perf.pipeline.fused_time (the simulator's) and this model (the operators') agree
    for untapered equal pieces at one rate on an alpha-beta link. With a per-piece
    overhead o the closed form charges it to the critical path, the walk to the compute
    (hidden when the wire is the bottleneck, slowed by k beside a transfer): they then
    differ by at most (p-1)·o·(1+k)."""
    from plait.perf.pipeline import fused_time

    for o in (0.0, 2e-4):
        profile = replace(DEFAULT_PROFILE, compute_flops=1e10, per_piece_overhead_s=o,
                          overlap_slowdown=k, latency_s=5e-4, base_latency_s=1e-4,
                          bandwidth_Bps=1e8)
        cal = Calibration(profile)  # no curves: every call is base + latency + bytes / bandwidth
        work = Work(flops=flops, wire_bytes=1e7, kind="all_reduce", taper=False)
        lat = profile.base_latency_s + profile.latency_s
        for p in (1, 2, 3, 5, 8):
            walk = predict(cal, work, p)
            closed = fused_time(flops / 1e10, lat + 1e7 / 1e8, p, profile, comm_latency_s=lat)
            if o == 0.0:
                assert walk == pytest.approx(closed), p
            else:
                assert abs(closed - walk) <= (p - 1) * o * (1 + k) + 1e-12, p
