"""Alpha-beta collective costs: bus factors, limits, monotonicity, hierarchy."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.perf.collectives import (AlphaBeta, COLLECTIVES, bus_bandwidth, bus_factor, collective_time,
                                    hierarchical_time, piece_latency, wire_factor)
from plait.perf.hardware import LINKS, get_link

AB = AlphaBeta(latency_s=5e-6, bandwidth_Bps=100e9, base_s=10e-6)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_bus_factors_follow_nccl_tests(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for coll in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven"):
        assert bus_factor(coll, n) == pytest.approx((n - 1) / n)


@pytest.mark.parametrize("coll", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_large_messages_reach_the_link_bandwidth_as_bus_bandwidth(coll):
    size = 64 << 30
    t = collective_time(coll, size, 8, AB)
    assert bus_bandwidth(coll, size, 8, t) == pytest.approx(AB.bandwidth_Bps, rel=1e-3)


def test_small_messages_cost_the_latency():
    t = collective_time("all_reduce", 0, 8, AB)
    assert t == pytest.approx(AB.base_s + 2 * 7 * AB.latency_s)
    assert collective_time("all_gather", 0, 8, AB) == pytest.approx(AB.base_s + 7 * AB.latency_s)


def test_one_rank_is_free_and_bad_names_fail():
    assert collective_time("all_reduce", 1 << 20, 1, AB) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcastish", 1, 2, AB)
    with pytest.raises(ValueError, match="unknown algorithm"):
        collective_time("all_reduce", 1, 4, AB, algo="butterfly")


@settings(max_examples=60, deadline=None)
@given(coll=st.sampled_from(COLLECTIVES), n=st.integers(2, 512),
       a=st.floats(1, 1e9), b=st.floats(1, 1e9), link=st.sampled_from(sorted(LINKS)))
def test_time_grows_with_size_and_never_beats_the_wire(coll, n, a, b, link):
    lo, hi = sorted((a, b))
    lnk = get_link(link)
    t_lo, t_hi = collective_time(coll, lo, n, lnk), collective_time(coll, hi, n, lnk)
    assert t_lo <= t_hi
    # no protocol moves the wire bytes faster than the link's effective bandwidth
    assert t_hi >= wire_factor(coll, n) * hi / lnk.effective_bw_Bps * (1 - 1e-9)


def test_best_all_reduce_is_no_worse_than_ring_and_tree_helps_latency_at_scale():
    ib = get_link("ib-ndr")
    for size in (1e3, 1e6, 1e9):
        assert collective_time("all_reduce", size, 1024, ib, algo="best") <= \
            collective_time("all_reduce", size, 1024, ib)
    assert collective_time("all_reduce", 1e3, 1024, ib, algo="tree") < \
        collective_time("all_reduce", 1e3, 1024, ib, algo="ring")


def test_hierarchical_reduces_to_flat_and_is_bounded_by_the_slow_link():
    nv, ib = get_link("nvlink4"), get_link("ib-ndr")
    size = 1 << 30
    assert hierarchical_time("all_reduce", size, local=8, nodes=1, intra=nv, inter=ib) == \
        pytest.approx(collective_time("all_reduce", size, 8, nv))
    t = hierarchical_time("all_reduce", size, local=8, nodes=16, intra=nv, inter=ib)
    flat_nv = collective_time("all_reduce", size, 128, nv)
    flat_ib = collective_time("all_reduce", size, 128, ib)
    assert flat_nv < t < flat_ib  # the NICs carry 1/8 of the data each
    a2a = hierarchical_time("all_to_all", size, local=8, nodes=16, intra=nv, inter=ib)
    assert a2a >= size * 15 / 16 / ib.effective_bw_Bps


def test_mesh_links_give_a_small_group_fewer_links():
    fabric = get_link("infinity-fabric")
    assert fabric.for_group(4).effective_bw_Bps == pytest.approx(fabric.effective_bw_Bps * 3 / 7)
    assert get_link("nvlink4").for_group(4) is get_link("nvlink4")


def test_piece_latency_of_all_to_all_skips_per_peer_posting():
    ib = get_link("ib-ndr")
    full = collective_time("all_to_all", 0, 1024, ib)
    assert piece_latency("all_to_all", 1024, ib) < full / 10
    assert piece_latency("all_reduce", 8, ib) == pytest.approx(collective_time("all_reduce", 0, 8, ib))
    assert math.isclose(piece_latency("all_gather", 1, ib), 0.0)


def test_curve_time_reads_a_measured_curve():
    from plait.perf.collectives import curve_time

    curve = [(1024.0, 1e-4), (4096.0, 2e-4), (16384.0, 1e-3)]
    assert curve_time(curve, 4096.0) == pytest.approx(2e-4)
    assert 1e-4 < curve_time(curve, 2048.0) < 2e-4  # between points: log-log
    assert curve_time(curve, 512.0) == pytest.approx(0.5e-4)  # below: proportional
    assert curve_time(curve, 32768.0) == pytest.approx(1e-3 + 16384 * (8e-4 / 12288))  # last slope


def test_fused_pieces_are_priced_at_their_own_size():
    from plait.perf.validate import _curves, _piece_priced

    coll = [{"collective": "all_reduce", "world_size": 2, "link": "1gbit", "bytes": b, "time_s": t}
            for b, t in ((262144, 1e-3), (1048576, 8e-3), (4194304, 40e-3))]
    fused = {"op": "matmul_all_to_all", "world_size": 2, "link": "1gbit", "path": "fused",
             "chunks": 4, "comm_bytes": 2 * 1048576, "t_comm_s": 0.07}
    priced = _piece_priced(fused, _curves(coll))
    # 2 MiB on the wire in 4 pieces: 512 KiB each, what a 512 KiB all_reduce sends on 2
    # ranks; it sits halfway (in log) between the 256 KiB and 1 MiB points
    assert priced["t_comm_s"] == pytest.approx(4 * 1e-3 * 8 ** 0.5)
    assert priced["t_comm_s"] < fused["t_comm_s"]
    fallback = {**fused, "path": "fallback", "chunks": 1}
    assert _piece_priced(fallback, _curves(coll)) is fallback
