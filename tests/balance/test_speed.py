"""plait.balance.speed: the pure parts without processes, then the monitor on 2 ranks that are
virtual devices: the compute clock (what the monitor and the straggler emulation read) counts
each rank's matrix-product FLOPs, so with rank 1 emulated 3× slower every figure is known
exactly and is checked to 1e-9 (the CPU clock on 2 shared cores gave anything from 0.05 to 0.6
for a true 1/3).

The monitor's cost in wall time is a benchmark's figure, not a unit test's: ``plait bench
hetero`` reports it per run (``monitor_overhead``, the exchanges' time over the step time) and
its summary's ``max_monitor_overhead`` (1.7–1.9 % in docs/results/bench-hetero-quick). Here its
cost is checked as what it sends: one collective of ``2 · layers`` float64 figures every
``every`` steps, nothing in between.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from plait.balance import SpeedMonitor, ema, flag_stragglers, relative_speeds
from plait.nn import ColumnParallelLinear, RowParallelLinear, ShardPlan
from plait.testing import run_ranks
from plait.nn.record import record


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
    run_ranks(_monitor_on_one_rank, 1)  # plait layers need a group: a world of one


def _monitor_on_one_rank():
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
    assert monitor.compute_s > 0  # the layers' compute was timed
    with pytest.raises(ValueError, match="no layer 'x' is timed"):
        monitor.layer_speeds("x")
    with pytest.raises(ValueError, match="every must be a positive"):
        SpeedMonitor(every=0)
    with pytest.raises(ValueError, match="window must be a positive"):
        SpeedMonitor(window=0)


def _monitor_on_virtual_devices(every, steps, slow_until):
    """Rank 1 emulated 3× slower (``SlowSpec``) for the first ``slow_until`` steps, then as
    fast as rank 0; for plans 1:1 and 3:1 (rank 1 with a third of rank 0's work, so its time
    equals rank 0's), plain and fused: after each exchange the speeds, layer 1's speeds and
    the stragglers and the newest 2 readings; per step the bytes the monitor sent."""
    from plait.testing.virtual import VirtualDevice
    from plait.runtime import SlowSpec, Straggler, rank_context

    device = VirtualDevice().install(unmovable=False)  # in this rank's process only
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    out = {}
    for sizes in ((1, 1), (3, 1)):
        for overlap in (False, True):
            slow = Straggler([SlowSpec(1, 3.0, until_step=slow_until)], dist.get_rank())
            rank_context().straggler = slow
            plan = ShardPlan(sizes).scaled(64 // sum(sizes))
            kw = dict(plan=plan, overlap=overlap, chunks=2, seed=0)
            model = nn.Sequential(ColumnParallelLinear(64, 64, **kw),
                                  RowParallelLinear(64, 32, **kw))
            monitor = SpeedMonitor(every=every, window=3)
            assert monitor.attach(model) == ["0", "1"]
            readings, sent = [], []
            with device:
                for step in range(steps):
                    slow.set_step(step)
                    model(x).square().mean().backward()
                    before = len(device.sent)
                    if monitor.step():
                        readings.append((monitor.speeds(), monitor.layer_speeds("1"),
                                         monitor.stragglers(), monitor.recent()))
                    sent.append(device.sent[before:])
            out[sizes, overlap] = readings, sent, monitor.shares
    return out


def test_monitor_finds_the_slow_rank_whatever_its_share():
    """Rank 1 emulated 3× slower is found at speeds (1, 1/3) exactly, also when a 3:1 plan
    gives it a third of rank 0's work and so the same time (speeds count work); once it is
    fast again its speed is the median of the last 3 readings: 1/3 after one fast reading,
    1 after two, while ``recent()`` gives the newest readings themselves (the first fast one
    reads 1 at once). Every rank holds the same figures, and the monitor sends one all-gather
    of 2 layers × (seconds, work) and the unmovable seconds, float64, per 2 steps,
    nothing in between."""
    results = run_ranks(_monitor_on_virtual_devices, 2, 2, 12, 8)
    assert results[0] == results[1]  # every rank holds the same figures
    want = [1 / 3] * 4 + [1 / 3, 1]  # exchanges after steps 1, 3, 5, 7 (slow), 9, 11
    newest = [[1 / 3]] + [[1 / 3, 1 / 3]] * 3 + [[1 / 3, 1], [1, 1]]
    for case, (readings, sent, shares) in results[0].items():
        assert shares == len(readings) == len(want), (case, shares)
        for (speeds, layer, stragglers, recent), w, n in zip(readings, want, newest):
            assert [r[0] for r in recent] == [1.0] * len(n), (case, recent)
            assert [r[1] for r in recent] == pytest.approx(n, rel=1e-9), (case, recent, n)
            assert speeds[0] == 1.0 and layer[0] == 1.0, (case, speeds, layer)
            assert speeds[1] == pytest.approx(w, rel=1e-9), (case, speeds, w)
            assert layer[1] == pytest.approx(w, rel=1e-9), (case, layer, w)
            assert stragglers == ((1,) if w < 1 else ()), (case, stragglers)
        assert sent == [[], [(2 * 2 + 1) * 8]] * 6, (case, sent)


def _migrated_on_virtual_devices(steps):
    """The last rank emulated 2× slower throughout, timed by FLOPs (at step 12 a stall of
    0.1 s, 40-60 steps' compute, in rank 0's first product), an MLP (96 → 192 → 32 columns,
    fused, 2 pieces) balanced by policy ``migrate`` through ``Balancer`` (every 2 steps,
    window 5, no warm-up): after each exchange that no decision followed, (step, speeds,
    confidence, the plan's sizes); the decisions (step, kind, sizes, reason)."""
    from plait.balance import Balancer, PolicyConfig
    from plait.testing.virtual import VirtualDevice
    from plait.runtime import SlowSpec, Straggler, rank_context

    world = dist.get_world_size()
    device = VirtualDevice().install(unmovable=False)  # in this rank's process only
    slow = Straggler([SlowSpec(world - 1, 2.0)], dist.get_rank())
    rank_context().straggler = slow
    kw = dict(overlap=True, chunks=2)
    model = nn.Sequential(ColumnParallelLinear(96, 192, seed=0, **kw),
                          RowParallelLinear(192, 32, seed=1, **kw))
    record(model, dims={"mlp": ("0", "1")})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    balancer = Balancer(model, opt, None, PolicyConfig(name="migrate"), every=2, warmup=0)
    x = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    readings = []
    for step in range(steps):
        slow.set_step(step)
        if step == 12 and dist.get_rank() == 0:
            device.stall(0.1)
        with device:
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        shares = balancer.monitor.shares
        if not balancer.step(step) and balancer.monitor.shares > shares:
            readings.append((step, balancer.monitor.speeds(), balancer.monitor.confidence(),
                             model[0].plan.sizes))
    return readings, [(d.step, d.kind, d.sizes, d.reason) for d in balancer.log]


@pytest.mark.parametrize("world", [2, 3])
def test_a_2x_straggler_reads_half_before_and_after_migration(world):
    """The last rank 2× slower reads 0.5 (within 5 %) on 2 and 3 ranks before the balancer
    migrates work away from it and after, on the new plan: speeds are per unit of work. The policy acts once the window of 5 readings is half full (step 5: readings
    after steps 1, 3, 5); the readings taken under the old plan are dropped at the move, and
    confidence climbs again from 1/5. A stall of 40-60 steps' compute on rank 0 in one reading
    does not move the trimmed mean (a plain mean of the window reads rank 0 as the
    straggler)."""
    results = run_ranks(_migrated_on_virtual_devices, world, 24)
    assert all(r == results[0] for r in results)  # every rank holds the same figures
    readings, decisions = results[0]
    even = ShardPlan.even(192, world).sizes
    assert [(s, k) for s, k, *_ in decisions] == [(5, "migrate")], decisions
    moved, reason = decisions[0][2:]
    assert moved[-1] < even[-1] and sum(moved) == 192, moved
    seen = ", ".join(["1.00"] * (world - 1) + ["0.50"])
    assert f"speeds [{seen}]" in reason, reason
    want = [1.0] * (world - 1) + [0.5]
    assert [(r[0], r[2]) for r in readings] == [(1, 0.2), (3, 0.4), (7, 0.2), (9, 0.4),
                                                (11, 0.6), (13, 0.8)] + [
        (s, 1.0) for s in range(15, 24, 2)], readings
    for step, speeds, confidence, sizes in readings:
        assert sizes == (even if step < 5 else moved), (step, sizes)
        assert speeds == pytest.approx(want, rel=0.05), (step, speeds)
