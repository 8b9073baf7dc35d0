"""The calibration chunks="auto" uses: measured on the group, identical on every rank, sane."""

import pytest
import torch.distributed as dist

from plait.ops.calibration import CURVE_BYTES, Calibration, measure
from plait.perf.calibrate import DEFAULT_PROFILE
from plait.runtime.testing import run_ranks


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


def test_curve_interpolates_and_extrapolates():
    cal = Calibration(DEFAULT_PROFILE, curves={"all_to_all": ((1e3, 1e-4), (1e6, 1e-2), (4e6, 5e-2))})
    assert cal.comm_time("all_to_all", 1e6) == pytest.approx(1e-2)
    assert 1e-4 < cal.comm_time("all_to_all", 3e4) < 1e-2
    assert cal.comm_time("all_to_all", 8e6) == pytest.approx(5e-2 + 4e6 * (4e-2 / 3e6))
    assert cal.comm_time("all_gather", 1e6) > 0  # an unmeasured kind: α–β from the profile


def test_one_piece_is_compute_then_collective():
    cal = Calibration(DEFAULT_PROFILE, curves={"all_reduce": ((1e4, 1e-4), (1e6, 1e-2), (1e7, 0.1))})
    assert cal.pipeline_time(0.05, "all_reduce", 1e7, 1) == pytest.approx(0.15)
    assert cal.pipeline_time(0.05, "all_reduce", 1e7, 4) < 0.15
