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
from torch.utils._python_dispatch import TorchDispatchMode

from plait.balance import SpeedMonitor, ema, flag_stragglers, relative_speeds
from plait.nn import ColumnParallelLinear, RowParallelLinear, ShardPlan
from plait.runtime.testing import run_ranks


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


_PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class _FlopClock(TorchDispatchMode):
    """This rank as a device that takes 1 ns per FLOP of its matrix products: ``clock()``,
    put in place of the CPU clock that the monitor and the straggler emulation read, moves
    only as they run, so a region's time is its FLOPs (× the emulated slowdown, whose sleep
    the monitor counts) whoever else shares the cores. Records each collective's bytes."""

    def __init__(self):
        super().__init__()
        self.now, self.sent = 0.0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _PRODUCTS:
            a, b = args[-2], args[-1]
            self.now += 2 * a.numel() * b.shape[-1] * 1e-9
        elif func.namespace == "c10d" and "barrier" not in func.name():
            inputs = args[1] if "allgather" in func.name() else args[0]
            self.sent.append(sum(t.numel() * t.element_size() for t in inputs))
        return out

    def clock(self, device=None):
        return lambda: self.now


def _monitor_on_virtual_devices(every, steps, slow_until):
    """Rank 1 emulated 3× slower (``SlowSpec``) for the first ``slow_until`` steps, then as
    fast as rank 0; for plans 1:1 and 3:1 (rank 1 with a third of rank 0's work, so its time
    equals rank 0's), plain and fused: after each exchange the speeds, layer 1's speeds and
    the stragglers; per step the bytes the monitor sent."""
    from plait.balance import speed
    from plait.runtime import SlowSpec, Straggler, rank_context, straggler

    device = _FlopClock()
    speed.compute_clock = straggler.compute_clock = device.clock  # in this rank's process only
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
            monitor = SpeedMonitor(every=every, alpha=0.25)
            assert monitor.attach(model) == ["0", "1"]
            readings, sent = [], []
            with device:
                for step in range(steps):
                    slow.set_step(step)
                    model(x).square().mean().backward()
                    before = len(device.sent)
                    if monitor.step():
                        readings.append((monitor.speeds(), monitor.layer_speeds("1"),
                                         monitor.stragglers()))
                    sent.append(device.sent[before:])
            out[sizes, overlap] = readings, sent, monitor.shares
    return out


def test_monitor_finds_the_slow_rank_whatever_its_share():
    """Rank 1 emulated 3× slower is found at speeds (1, 1/3) exactly, also when a 3:1 plan
    gives it a third of rank 0's work and so the same time (speeds count work); once it is
    fast again its speed climbs as the EMA (alpha 0.25) says: 1/2, then 5/8. Every rank holds
    the same figures, and the monitor sends one all-gather of 2 layers × (seconds, work)
    float64 per 2 steps, nothing in between."""
    results = run_ranks(_monitor_on_virtual_devices, 2, 2, 12, 8)
    assert results[0] == results[1]  # every rank holds the same figures
    want = [1 / 3] * 4 + [1 / 2, 5 / 8]  # exchanges after steps 1, 3, 5, 7 (slow), 9, 11
    for case, (readings, sent, shares) in results[0].items():
        assert shares == len(readings) == len(want), (case, shares)
        for (speeds, layer, stragglers), w in zip(readings, want):
            assert speeds[0] == 1.0 and layer[0] == 1.0, (case, speeds, layer)
            assert speeds[1] == pytest.approx(w, rel=1e-9), (case, speeds, w)
            assert layer[1] == pytest.approx(w, rel=1e-9), (case, layer, w)
            assert stragglers == (1,), (case, stragglers)
        assert sent == [[], [2 * 2 * 8]] * 6, (case, sent)
