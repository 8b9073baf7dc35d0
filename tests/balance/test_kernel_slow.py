"""Slow hosts made by the kernel (``bench hetero --slow-by kernel``): a rank ``F`` × slower is
its host's CPU budget ÷ ``F`` (cgroup cpu quota) for that step, and the speed monitor sees it.

The real runs are judged by the kernel's own accounting (the budget read back from the cgroup,
the step's CPU time over its wall time, the periods it throttled), not by wall-time ratios: on
the shared 2-core machine a loop's wall time moved 0.5-2x between rounds at a full budget
(tests/test_cgroup.py). The monitor's reading is judged against the ``none`` run's, taken in
the same launch, step by step interleaved with it.
"""

import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.balance import SpeedMonitor, speed
from plait.balance.speed import window_speed
from plait.bench.hetero import HeteroBenchConfig, bench_hetero, run_hetero, with_ideal
from plait.runtime import EmulatedCluster, SlowSpec, Straggler, launch, rank_context
from plait.runtime.cgroup import (CpuController, cpu_budget, cpu_controller,
                                  cpu_throttled, make_cgroup, plait_cgroups, set_cpu_budget,
                                  thread_sched)
from plait.runtime.straggler import host_throttle

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


def test_on_the_wall_clock_the_monitor_counts_a_sleep_once(monkeypatch):
    """On a host with a CPU budget the compute clock is wall time, which runs through the sleep
    emulation's sleeps: a 2 × rank's region reads 2 × its compute, not 3 × (the sleep added
    again). 20 ms of spinning on the wall clock, then the 20 ms sleep."""
    straggler = Straggler([SlowSpec(rank=0, factor=2.0)], 0, clock=time.perf_counter)
    monkeypatch.setattr(speed, "compute_clock", lambda device=None: time.perf_counter)
    monkeypatch.setattr(speed, "_straggler", lambda: straggler)
    monitor = SpeedMonitor()
    timer = monitor.timer("layer")
    token = timer.begin(None)
    with straggler.compute():
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:
            pass
    timer.end(token, 1.0)
    spun = straggler.delayed_s  # (2 − 1) × the measured compute
    assert 0.02 <= spun < 0.05, spun
    assert 1.9 <= monitor.compute_s / spun < 2.6, (monitor.compute_s, spun)


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
    rank's host at 0.5 core (read back from the cgroup) and throttled it, on every ``none``
    step both hosts had their whole core; setting a budget from inside a rank takes well
    under a millisecond. The whole budget is back after the run, and the cgroups are gone
    after the cluster. (The monitor's reading is printed here; it is judged on a CPU-bound
    loop below: bench hetero's small steps are half waiting, and a quota holds back only a
    host that would use more than it.)"""
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
    assert sum(throttled) > 0, throttled
    assert max(costs) < 1e-3, costs  # two small writes, every step
    assert after == [1.0, 1.0], after
    assert not [n for n in plait_cgroups(HERE) if n.startswith(f"plait-{tag}-")]


def _fmt(values):
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def _spin_monitored(steps: int, n: int):
    """Rank side: ``steps`` steps of a CPU-bound loop of ``n`` matmuls, two to a timed region,
    the last rank 2 × slower by the kernel (``host_throttle``), every step started together; the
    monitor's speeds and seconds, per step the regions' CPU time (with the timer's) and wall
    time inside the timer, and over steps 8 to 27 (the monitor's window) this thread's CPU
    time and runnable wait (the kernel's accounting)."""
    cgroup = rank_context().host.cgroup
    rank = dist.get_rank()
    straggler = Straggler([SlowSpec(rank=dist.get_world_size() - 1, factor=2.0)], rank,
                          throttle=host_throttle(cgroup, cpu_budget(cgroup)))
    rank_context().straggler = straggler
    monitor = SpeedMonitor(every=4, window=5)
    timer = monitor.timer("spin")
    a = torch.randn(192, 192)
    cpu, wall = [], []
    try:
        for step in range(steps):
            straggler.set_step(step)
            dist.barrier()
            if step == 8:
                first = thread_sched()
            wall.append(0.0)
            thread = time.thread_time()
            for _ in range(n // 2):  # short regions, as a fused operator's pieces are
                token = timer.begin(None)
                start = time.perf_counter()  # no CPU clock here: reading it moves throttling
                a @ a
                a @ a
                wall[-1] += time.perf_counter() - start
                timer.end(token, 2.0)
            cpu.append(time.thread_time() - thread)
            monitor.step()
        last = thread_sched()
    finally:
        straggler.throttle(1.0)
    return monitor.speeds(), monitor.compute_s, cpu, wall, last[0] - first[0], last[1] - first[1]


@needs_netns
def test_the_monitor_reads_a_kernel_throttled_rank_by_the_time_the_kernel_held_it():
    """The last rank held to half of its host's core, its compute in short regions (two small
    matmuls each, as a fused operator's pieces). By the kernel's accounting its thread got at
    most 0.6 of the time it was runnable (CPU time over CPU time plus runnable wait). The
    monitor times a region by the wall clock, so it holds the time the kernel held the rank
    back (by the thread's CPU time it would not: waiting for the quota is not CPU time), and
    its reading of the last rank is within 0.15 of that share over the other rank's
    regions' CPU time over their seconds (0.41-0.60 against 0.49-0.53 at 40 matmuls a step,
    0.50-0.56 in 6 runs at 80). It reads the CPU clock before the wall clock at a region's
    end: the kernel throttles a thread at the reading that settles its accounting, and with
    the wall clock read first those waits fell outside the regions and this rank read
    0.83-1.00 (0.98-1.00 at 80). A loaded machine also slows the other rank (at load 9 on
    the 2 cores both ranks got about 0.3 of a core)."""
    budgets_here()
    with EmulatedCluster(hosts=2, link="1gbit", cpu=1.0) as cluster:
        out = launch(_spin_monitored, 2, args=(28, 80), cluster=cluster, threads=1,
                     timeout_s=60, deadline_s=120)
    speeds = out[0][0]
    held = [c / (c + w) for *_, c, w in out]  # of the time it was runnable, steps 8 to 27
    fast = sum(out[0][2]) / out[0][1]  # rank 0: its CPU time over the monitor's seconds
    print(f"\nkernel 2x, short CPU-bound regions: share of runnable time (rank 0, rank 1) "
          f"{_fmt(held)}, rank 0's CPU over its regions' seconds {fast:.2f}; monitor "
          f"{_fmt(speeds)}; regions' wall time inside the timer {sum(out[0][3]) * 1e3:.0f} ms "
          f"on rank 0, {sum(out[1][3]) * 1e3:.0f} ms on rank 1, the monitor's "
          f"{out[0][1] * 1e3:.0f} and {out[1][1] * 1e3:.0f}; {os.getloadavg()[0]:.1f} load")
    assert held[1] <= 0.6, held  # unthrottled it reads about 1
    assert speeds[0] == 1.0, speeds
    assert speeds[1] == pytest.approx(held[1] / min(fast, 1.0), abs=0.15), (speeds, held, fast)
