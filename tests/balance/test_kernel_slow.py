"""Slow hosts made by the kernel (``bench hetero --slow-by kernel``): a rank ``F`` × slower is
its host's CPU budget ÷ ``F`` (cgroup cpu quota) for that step, and the speed monitor sees it.

The real run is judged by the kernel's own accounting (the budget read back from the cgroup,
the bound it puts on the step's CPU time over its wall time), not by wall-time ratios: on the
shared 2-core machine a loop's wall time moved 0.5-2x between rounds at a full budget
(tests/runtime/test_cgroup.py). The monitor's clocks on a budgeted host are checked against fake
clocks (what it reads, in which order); how closely it follows a real throttled host is
``plait bench hetero --slow-by kernel``'s to measure.
"""

import statistics
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from plait.balance import SpeedMonitor, speed
from plait.bench.hetero import HeteroBenchConfig, bench_hetero, run_hetero
from plait.bench.hetero_ideal import with_ideal
from plait.runtime import EmulatedCluster, SlowSpec, Straggler, launch, rank_context
from plait.runtime.slow.cgroup import (CpuController, cpu_budget, cpu_controller,
                                  cpu_throttled, make_cgroup, plait_cgroups, set_cpu_budget)
from plait.runtime.slow.straggler import host_throttle

from conftest import budgets_here, needs_netns

HERE = cpu_controller()


# --- what the parts do, without root ----------------------------------------------------------

def test_a_kernel_straggler_sets_every_steps_budget_and_sleeps_nothing():
    """With a throttle, each step's factor (1 included: the whole budget back) goes to it when
    the step is set, before the step runs, and the compute pieces are not stretched."""
    set_to, slept = [], []
    straggler = Straggler([SlowSpec(rank=1, factor=2.0, from_step=1, until_step=3)], 1,
                          clock=lambda: 0.0, sleep=slept.append, throttle=set_to.append)
    assert straggler.by == "kernel" and Straggler([], 1).by == "sleep"
    for step in range(4):
        straggler.set_step(step)
        with straggler.compute():
            pass
    assert set_to == [1.0, 2.0, 2.0, 1.0] and slept == [] and straggler.delayed_s == 0.0


@pytest.mark.parametrize("version", [1, 2])
def test_host_throttle_writes_budget_over_factor_and_reads_it_back(tmp_path, version):
    root = tmp_path
    if version == 2:
        (root / "cgroup.controllers").write_text("cpu\n")
        (root / "cgroup.subtree_control").write_text("cpu\n")
    path = Path(make_cgroup(CpuController(version, str(root)), "plait-1x0-h1", 1.0))
    for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us", "cpu.max"):
        assert (path / name).exists() == ((name == "cpu.max") == (version == 2))
    throttle = host_throttle(str(path), 1.0)
    for factor, cores, files in [(2.0, 0.5, ("5000", "10000")),
                                 (3.0, 1 / 3, ("3333", "10000")),
                                 (200.0, 0.01, ("1000", "100000")),  # the 1 ms least quota
                                 (1.0, 1.0, ("10000", "10000"))]:
        throttle(factor)
        assert cpu_budget(str(path)) == pytest.approx(cores, abs=1e-4), factor
        if version == 1:
            assert ((path / "cpu.cfs_quota_us").read_text(),
                    (path / "cpu.cfs_period_us").read_text()) == files
        else:
            assert (path / "cpu.max").read_text() == " ".join(files)
    quota = path / ("cpu.cfs_quota_us" if version == 1 else "cpu.max")
    quota.write_text("written by someone else")
    throttle(1.0)  # the same budget again: no write (each write refills the kernel's quota)
    assert quota.read_text() == "written by someone else"
    (path / "cpu.stat").write_text("nr_periods 40\nnr_throttled 7\nthrottled_time 123\n")
    assert cpu_throttled(str(path)) == 7
    with pytest.raises(ValueError, match="above 0 cores"):
        host_throttle(str(path), 0.0)


class _Clocks:
    """A fake wall clock and thread CPU clock, as ``speed`` and ``straggler`` read ``time``:
    ``perf_counter`` and ``thread_time``, each call recorded in ``reads``; ``sleep`` and
    ``run`` move the wall clock (``run`` the CPU clock too); reading the CPU clock first
    waits ``held`` on the wall clock (the kernel throttling the thread where its accounting
    settles), then ``held`` is spent. Each clock is one object, as ``time``'s functions are
    (the monitor tells the wall clock by identity)."""

    def __init__(self):
        self.wall = self.cpu = self.held = 0.0
        self.reads: list[str] = []
        self.perf_counter, self.thread_time = self._wall, self._cpu

    def _wall(self) -> float:
        self.reads.append("wall")
        return self.wall

    def _cpu(self) -> float:
        self.reads.append("cpu")
        self.wall, self.held = self.wall + self.held, 0.0
        return self.cpu

    def sleep(self, seconds: float) -> None:
        self.wall += seconds

    def run(self, seconds: float) -> None:
        self.wall += seconds
        self.cpu += seconds


def _on_a_cpu_budget(monkeypatch) -> _Clocks:
    """This process as a rank on a host with a CPU budget, its clocks ``_Clocks``: the
    compute clock (``compute_clock``) is the wall clock."""
    from plait.runtime.slow import straggler

    clocks = _Clocks()
    monkeypatch.setattr(straggler, "_on_cpu_budget", lambda: True)
    monkeypatch.setattr(straggler, "time", clocks)
    monkeypatch.setattr(speed, "time", clocks)
    monkeypatch.setattr(speed, "_REAL_CLOCKS", (clocks.perf_counter, clocks.thread_time))
    return clocks


def test_on_the_wall_clock_the_monitor_counts_a_sleep_once(monkeypatch):
    """On a host with a CPU budget the compute clock is wall time, which runs through the sleep
    emulation's sleeps: a 2 × rank's region reads 2 × its compute, not 3 × (the sleep added
    again). 20 ms of compute on a fake wall clock, then the 20 ms sleep."""
    clocks = _on_a_cpu_budget(monkeypatch)
    straggler = Straggler([SlowSpec(rank=0, factor=2.0)], 0)
    monkeypatch.setattr(speed, "_straggler", lambda: straggler)
    monitor = SpeedMonitor()
    timer = monitor.timer("layer")
    token = timer.begin(None)
    with straggler.compute():
        clocks.run(0.02)
    timer.end(token, 1.0)
    assert straggler.delayed_s == 0.02  # (2 − 1) × the compute, slept
    assert monitor.compute_s == 0.04, monitor.compute_s


def test_kernel_ideal_stretches_the_whole_cpu_time_at_the_budgets_pace():
    """Under ``--slow-by kernel`` the ideal spreads the ``none`` run's CPU time per step over
    the hosts' whole budget (all of it is slowed; at most the whole step); under sleep, the
    timed compute only."""
    ref = {"seed": 0, "scenario": "none", "policy": "even", "t_step_s": 0.1,
           "compute_s_per_step": 0.02, "cpu_s_per_step": 0.03, "losses": [2.0],
           "factors": [[1.0, 1.0]] * 3, "slow_by": "kernel",
           "kernel": {"held_cores": [[0.5] * 3, [0.5] * 3]}}
    slow = {**ref, "scenario": "straggler-2x", "t_step_s": 0.15, "factors": [[1.0, 2.0]] * 3}
    kernel = with_ideal([dict(ref), dict(slow)], 1)[1]
    assert kernel["t_ideal_s"] == pytest.approx(0.1 - 0.06 + 0.06 * 2 / 1.5)
    whole = {**ref, "kernel": {"held_cores": [[0.25] * 3, [0.25] * 3]}}  # 0.12 s: over t_none
    assert with_ideal([whole, dict(slow)], 1)[1]["t_ideal_s"] == pytest.approx(0.1 * 2 / 1.5)
    sleep = with_ideal([{**ref, "slow_by": "sleep"}, {**slow, "slow_by": "sleep"}], 1)[1]
    assert sleep["t_ideal_s"] == pytest.approx(0.1 - 0.02 + 0.02 * 2 / 1.5)


def test_kernel_ideal_is_no_shorter_than_the_slow_hosts_unmovable_work():
    """A rank slowed by the kernel keeps its unmovable work whatever the plan: the ideal is
    the longer of the capacity step and that work ``F`` × longer on the slowest host (the
    CPU time of all threads less the timed layers', over the budget); a run without those
    figures, and a sleep-made one, keep the capacity step."""
    cpu = [[0.06] * 3, [0.06] * 3]  # per rank, per step
    movable = [[0.02] * 3, [0.02] * 3]  # 0.04 s of unmovable CPU: 0.08 s on half a core
    ref = {"seed": 0, "scenario": "none", "policy": "even", "t_step_s": 0.15,
           "compute_s_per_step": 0.04, "cpu_s_per_step": 0.06, "losses": [2.0],
           "factors": [[1.0, 1.0]] * 3, "slow_by": "kernel",
           "kernel": {"held_cores": [[0.5] * 3, [0.5] * 3], "cpu_s": cpu,
                      "movable_cpu_s": movable}}
    graded = {**ref, "scenario": "graded", "t_step_s": 0.4, "factors": [[4.0, 1.0]] * 3}
    out = with_ideal([dict(ref), dict(graded)], 1)[1]
    capacity = 0.15 - 0.12 + 0.12 * 2 / 1.25
    assert out["t_capacity_s"] == pytest.approx(capacity)  # 0.222 s
    assert out["t_floor_s"] == pytest.approx(0.04 / 0.5 * 4)  # 0.32 s: it binds
    assert out["t_ideal_s"] == pytest.approx(0.32) and out["ratio_to_ideal"] == pytest.approx(1.25)
    mild = {**graded, "factors": [[2.0, 1.0]] * 3}  # 0.16 s: the capacity step binds
    assert with_ideal([dict(ref), mild], 1)[1]["t_ideal_s"] == pytest.approx(
        0.15 - 0.12 + 0.12 * 2 / 1.5)
    old = {**ref, "kernel": {"held_cores": [[0.5] * 3, [0.5] * 3]}}
    assert "t_floor_s" not in with_ideal([old, dict(graded)], 1)[1]
    sleep = with_ideal([{**ref, "slow_by": "sleep"}, {**graded, "slow_by": "sleep"}], 1)[1]
    assert "t_floor_s" not in sleep and sleep["t_ideal_s"] == sleep["t_capacity_s"]


def test_kernel_mode_is_refused_without_one_rank_per_host(monkeypatch):
    from plait.cli.main import build_parser

    args = build_parser().parse_args(["bench", "hetero", "--slow-by", "kernel"])
    assert args.slow_by == "kernel"  # the flag comes from HeteroBenchConfig's field
    with pytest.raises(ValueError, match="choose from"):
        HeteroBenchConfig(slow_by="nap")
    monkeypatch.delenv("PLAIT_HOST_CPU", raising=False)
    cfg = HeteroBenchConfig(slow_by="kernel", scenarios=("none",), policies=("even",))
    for ranks, hosts, given in ((2, 0, "got no --hosts"), (4, 2, "got --hosts 2")):
        with pytest.raises(ValueError, match=f"one rank per host: --hosts {ranks} .*{given}"):
            bench_hetero(cfg, ranks=ranks, hosts=hosts)


# --- real budgets on this machine -------------------------------------------------------------

def _kernel_hetero(steps):
    """Rank side: the cost of setting this host's budget from inside the rank (its network
    namespace, its host's cgroup), then bench hetero's runs of a small GPT, the slowdown made
    by the kernel."""
    cgroup = rank_context().host.cgroup
    budget = cpu_budget(cgroup)
    costs = []
    for _ in range(20):
        start = time.perf_counter()
        set_cpu_budget(cgroup, budget)
        costs.append(time.perf_counter() - start)
    dist.barrier()
    cfg = HeteroBenchConfig(scenarios=("none", "straggler-2x"), policies=("even",), steps=steps,
                            warmup=2, seeds=1, n_layer=1, n_head=8, n_embd=128, seq_len=32,
                            batch_size=8, eval_batches=1, every=2, slow_by="kernel")
    return run_hetero(cfg), statistics.median(costs)


@needs_netns
def test_a_2x_rank_is_held_to_half_its_hosts_budget_through_bench_hetero():
    """2 hosts of 1 core, one rank each, ``none`` and ``straggler-2x`` interleaved step by step
    through bench hetero's own loop: on every ``straggler-2x`` step the kernel held the last
    rank's host at 0.5 core (read back from the cgroup), and its CPU share per step is at
    most that (the quota is a bound; a loaded machine only lowers it); on every ``none`` step
    both hosts had their whole core. The whole budget is back after the run, and the cgroups
    are gone after the cluster. Printed, not judged (they measure the machine): the periods
    the kernel throttled (none when other load keeps the rank under its quota), what a budget
    write costs from inside a rank (well under a millisecond on a quiet machine) and the
    monitor's reading (bench hetero's small steps are half waiting, and a quota holds back
    only a host that would use more than it)."""
    budgets_here()
    with EmulatedCluster(hosts=2, link="1gbit", cpu=1.0) as cluster:
        out = launch(_kernel_hetero, 2, args=(15,), cluster=cluster, threads=1, timeout_s=60,
                     deadline_s=240)
        after = [cpu_budget(h.cgroup) for h in cluster.hosts]
        tag = cluster.tag
    records, costs = out[0][0], [o[1] for o in out]
    runs = {r["scenario"]: r for r in records}
    none, slow = runs["none"], runs["straggler-2x"]
    for r in (none, slow):
        assert r["slow_by"] == "kernel" and len(r["kernel"]["held_cores"][0]) == 15, r["kernel"]
    assert none["kernel"]["held_cores"] == [[1.0] * 15, [1.0] * 15]
    assert slow["kernel"]["held_cores"] == [[1.0] * 15, [0.5] * 15]
    share = slow["kernel"]["cpu_share"][1]
    throttled = slow["kernel"]["throttled_periods"][1]
    print(f"\nkernel 2x in bench hetero: last rank's CPU share per step "
          f"{statistics.median(share):.2f} (median; none run "
          f"{statistics.median(none['kernel']['cpu_share'][1]):.2f}), periods throttled "
          f"{sum(throttled)} (none run {sum(none['kernel']['throttled_periods'][1])}); monitor "
          f"{_fmt(slow['speeds'])} (none run {_fmt(none['speeds'])}); x ideal "
          f"{slow['ratio_to_ideal']:.2f}; a budget write {max(costs) * 1e6:.0f} us (median "
          f"of 20, the slower rank's)")
    assert statistics.median(share) <= 0.55, share
    assert after == [1.0, 1.0], after
    assert not [n for n in plait_cgroups(HERE) if n.startswith(f"plait-{tag}-")]


def _fmt(values):
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def test_the_monitor_reads_a_kernel_throttled_rank_by_the_time_the_kernel_held_it(monkeypatch):
    """On a host with a CPU budget the monitor times a region by the wall clock, so it holds
    the time the kernel held the rank back (by the thread's CPU time it would not: waiting
    for the quota is not CPU time). The kernel throttles a thread at the reading that settles
    its accounting, so the timer reads the thread's CPU clock before the wall clock at both
    ends of a region: a wait at the region's start lands before it, one at its end (for the
    quota the region used) inside it. A fake kernel holds the thread 5 ms at every CPU-clock
    read: a region of 10 ms of compute reads 15 ms, its CPU time 10 ms. (With the wall clock
    read first at the end, the waits fell outside the regions and a 2 × rank read 0.83-1.00
    on real budgets.) How closely the monitor follows a real throttled host is measured by
    ``plait bench hetero --slow-by kernel`` (its records hold the kernel's accounting beside
    the monitor's speeds), not judged here."""
    clocks = _on_a_cpu_budget(monkeypatch)
    monkeypatch.setattr(speed, "_straggler", lambda: None)
    monitor = SpeedMonitor()
    timer = monitor.timer("layer")
    clocks.held = 0.005
    token = timer.begin(None)
    clocks.run(0.01)
    clocks.held = 0.005
    timer.end(token, 1.0)
    assert clocks.reads == ["cpu", "wall", "cpu", "wall"], clocks.reads
    assert monitor.compute_s == pytest.approx(0.015, rel=1e-12), monitor.compute_s
    assert monitor.region_cpu_s == pytest.approx(0.01, rel=1e-12), monitor.region_cpu_s
