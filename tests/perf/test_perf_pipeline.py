"""The fused-operator piece pipeline and chunks="auto"."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.perf.calibrate import MachineProfile
from plait.perf.pipeline import PipelineOverheads, _choose, best_chunks, choose_chunks, fused_time

PROFILE = MachineProfile(latency_s=20e-6, bandwidth_Bps=1e9, per_piece_overhead_s=10e-6)
times = st.floats(1e-6, 1.0)


@settings(max_examples=100, deadline=None)
@given(tc=times, tm=times, o=st.floats(0, 1e-3), k=st.floats(0, 1), lat=st.floats(0, 1e-3))
def test_one_piece_is_the_unfused_operator(tc, tm, o, k, lat):
    assert fused_time(tc, tm, 1, PipelineOverheads(o, k), comm_latency_s=lat) == pytest.approx(tc + tm)


@settings(max_examples=100, deadline=None)
@given(tc=times, tm=times, p=st.integers(1, 64), o=st.floats(0, 1e-3), lat=st.floats(0, 1e-3))
def test_no_schedule_beats_the_physical_limit(tc, tm, p, o, lat):
    assert fused_time(tc, tm, p, o, comm_latency_s=lat) >= max(tc, tm) * (1 - 1e-12)


def test_balanced_pipeline_without_overheads_approaches_the_limit():
    t = fused_time(1.0, 1.0, 100, None, comm_latency_s=0.0)
    assert t == pytest.approx(1.01)
    assert fused_time(np.array([1.0, 2.0]), 1.0, 4, 0.0).shape == (2,)


@settings(max_examples=100, deadline=None)
@given(tc=st.floats(1e-6, 0.1), nbytes=st.floats(1e3, 1e9), mc=st.integers(1, 32))
def test_choose_chunks_never_predicts_fused_slower(tc, nbytes, mc):
    c = choose_chunks(t_compute_s=tc, comm_bytes=nbytes, profile=PROFILE, max_chunks=mc)
    if c.fused:
        assert c.chunks >= 2
        assert c.t_pred_fused_s < c.t_pred_unfused_s
        assert c.t_pred_fused_s >= c.t_pred_limit_s * (1 - 1e-12)
    else:
        assert c.chunks == 1 and c.t_pred_fused_s == c.t_pred_unfused_s and c.reason


def test_choose_chunks_fuses_balanced_work_and_explains_refusals():
    tm = PROFILE.latency_s + 8e6 / PROFILE.bandwidth_Bps
    c = choose_chunks(t_compute_s=tm, comm_bytes=8e6, profile=PROFILE)
    assert c.fused and 2 <= c.chunks <= 16 and "faster" in c.reason
    assert not choose_chunks(t_compute_s=1e-3, comm_bytes=8e6, profile=PROFILE, world_size=1).fused
    tiny = choose_chunks(t_compute_s=1e-3, comm_bytes=1000, profile=PROFILE)
    assert not tiny.fused and "under" in tiny.reason
    neg = choose_chunks(t_compute_s=1.0, comm_bytes=1e6, profile=PROFILE)
    assert not neg.fused and "communication negligible" in neg.reason
    coll = choose_chunks(t_compute_s=tm, comm_bytes=8e6, profile=PROFILE, collective="all_reduce",
                         world_size=4)
    assert coll.t_pred_unfused_s > tm  # all_reduce moves 2(n-1)/n of the buffer


def test_choose_chunks_is_cached_so_operators_may_call_it_every_time():
    """The operators ask on every call; a repeated question is answered from the cache (the
    same object), not recomputed. How long a call takes is a benchmark's figure, not a
    unit test's."""
    args = dict(t_compute_s=1.234e-3, comm_bytes=4e6, profile=PROFILE)
    first = choose_chunks(**args)
    hits = _choose.cache_info().hits
    again = [choose_chunks(**args) for _ in range(3)]
    assert all(c is first for c in again)
    assert _choose.cache_info().hits == hits + 3
    other = choose_chunks(**{**args, "comm_bytes": 8e6})  # another question: another answer
    assert other is not first and other.t_pred_unfused_s > first.t_pred_unfused_s


def test_best_chunks_prefers_fewer_pieces_on_a_flat_optimum():
    p, _ = best_chunks(1.0, 1e-3, 0.0, max_chunks=16, comm_latency_s=0.0)
    assert p <= 2  # hiding 1 ms behind 1 s: extra pieces buy nothing
    p, t = best_chunks(1.0, 1.0, 1e-3, max_chunks=16, comm_latency_s=1e-4)
    assert p > 2 and t < 2.0
