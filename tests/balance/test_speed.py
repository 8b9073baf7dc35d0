"""plait.balance.speed: the pure parts without processes, then the monitor on 2 ranks with
rank 1 emulated 3× slower (plain path, so the timed region is the local GEMM only)."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from plait.balance import SpeedMonitor, ema, flag_stragglers, relative_speeds
from plait.nn import ColumnParallelLinear, RowParallelLinear, ShardPlan
from plait.runtime import SlowSpec, launch


def test_ema_and_relative_speeds():
    assert ema(None, 4.0, 0.5) == 4.0
    assert ema(4.0, 2.0, 0.25) == 3.5
    with pytest.raises(ValueError, match="alpha must be in"):
        ema(1.0, 1.0, 0.0)
    assert relative_speeds([2.0, 1.0, 4.0]) == (0.5, 0.25, 1.0)
    assert relative_speeds([0.0, 0.0]) == (1.0, 1.0)  # nothing measured yet
    assert relative_speeds([0.0, 2.0]) == (1.0, 1.0)  # a rank with no figure is not a straggler


def test_flag_stragglers():
    assert flag_stragglers([1.0, 0.5, 0.9], threshold=1.2) == (1,)
    assert flag_stragglers([2.0, 2.0 / 1.2], threshold=1.2) == (1,)  # exactly at the threshold
    assert flag_stragglers([1.0, 0.95]) == ()
    with pytest.raises(ValueError, match="slowdown ratio"):
        flag_stragglers([1.0], threshold=0.5)


def test_monitor_on_one_rank_times_each_layer():
    model = nn.Sequential(ColumnParallelLinear(16, 32), RowParallelLinear(32, 8))
    monitor = SpeedMonitor(every=2)
    assert monitor.attach(model) == ["0", "1"]
    x = torch.randn(4, 16)
    shared = []
    for _ in range(4):
        model(x).sum().backward()
        shared.append(monitor.step())
    assert shared == [False, True, False, True] and monitor.shares == 2
    assert monitor.speeds() == (1.0,) and monitor.layer_speeds("1") == (1.0,)
    assert all(v[0] is not None and v[0] > 0 for v in monitor._smoothed.values())
    with pytest.raises(ValueError, match="no layer 'x' is timed"):
        monitor.layer_speeds("x")
    with pytest.raises(ValueError, match="every must be a positive"):
        SpeedMonitor(every=0)


def _train_and_monitor(sizes, steps, every):
    torch.manual_seed(0)
    plan = ShardPlan(tuple(sizes))
    model = nn.Sequential(ColumnParallelLinear(128, 256, plan=plan.scaled(256 // plan.total),
                                               overlap=False),
                          RowParallelLinear(256, 128, plan=plan.scaled(256 // plan.total),
                                            overlap=False))
    monitor = SpeedMonitor(every=every, alpha=0.5)
    monitor.attach(model)
    x = torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(steps):
        model(x).square().mean().backward()
        monitor.step()
    wall = time.perf_counter() - start
    return monitor.speeds(), monitor.layer_speeds("1"), monitor.stragglers(), \
        monitor.overhead_s / wall, dist.get_rank()


@pytest.mark.parametrize("sizes", [(1, 1), (3, 1)])
def test_monitor_finds_the_slow_rank_whatever_its_share(sizes):
    """Rank 1 is 3× slower; with the plan 3:1 it also has a third of rank 0's work, so its
    time equals rank 0's: speeds count work, so it is still found 3× slower."""
    results = launch(_train_and_monitor, 2, args=(sizes, 12, 4), slow=[SlowSpec(1, 3.0)],
                     threads=1, timeout_s=30)
    speeds, layer, stragglers, overhead, _ = results[0]
    assert all(r[:3] == results[0][:3] for r in results)  # every rank holds the same figures
    assert speeds[0] == 1.0 and 0.05 < speeds[1] < 0.6, speeds
    assert layer[0] == 1.0 and layer[1] < 0.6, layer
    assert stragglers == (1,)
    # The last rank to reach an exchange waits for no one: its share is the exchange's own cost.
    # Here a step is ~8 ms and a gloo exchange 1–5 ms on 2 shared cores (the first one ~11 ms),
    # so only a loose bound; the < 2 % of issue 5 is for real step times (benchmark, later).
    assert min(r[3] for r in results) < 0.3, [r[3] for r in results]
