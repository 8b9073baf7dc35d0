"""``bench hetero``'s noisy-neighbour scenario: a real CPU-bound process on the last rank's
host, inside its CPU budget, from ``--spike-at`` on; nothing emulated.

Runs are interleaved step by step, so the neighbour is held (SIGSTOP) outside its own run's
steps: judged by the kernel's accounting of the neighbour's CPU seconds per step, which must
be zero on every other run's step and on its own run's steps before it starts.
"""

import os
import time

import pytest
import torch.distributed as dist

from plait.bench.hetero import HeteroBenchConfig, bench_hetero, run_hetero
from plait.bench.hetero_ideal import neighbour_factors, with_ideal
from plait.runtime.slow.scenarios import Neighbour, factors_at, scenario_specs
from plait.runtime import EmulatedCluster, Straggler, launch, rank_context
from plait.runtime.slow.cgroup import (NoisyNeighbour, cgroup_pids, cpu_controller,
                                  plait_cgroups)

from conftest import budgets_here, needs_netns

HERE = cpu_controller()


# --- the parts, without root ------------------------------------------------------------------

def test_the_neighbour_is_on_the_last_rank_from_spike_at_and_not_emulated():
    cfg = HeteroBenchConfig(scenarios=("none", "noisy-neighbour"), policies=("even",),
                            steps=10, spike_at=4)
    specs = scenario_specs("noisy-neighbour", 3, cfg)
    assert specs == [Neighbour(rank=2, from_step=4)]
    assert [factors_at(specs, 3, s) for s in (3, 4, 9)] == [[1.0] * 3, [1.0, 1.0, 2.0],
                                                            [1.0, 1.0, 2.0]]
    # the straggler emulation never sleeps for it: the neighbour itself is the slowdown
    slept = []
    straggler = Straggler([s for s in specs if not isinstance(s, Neighbour)], 2,
                          clock=lambda: 0.0, sleep=slept.append)
    straggler.set_step(6)
    assert straggler.factor() == 1.0


def test_the_neighbours_ideal_stretches_all_the_ranks_cpu_work():
    """A neighbour takes the host's cores from everything the rank runs, so its ideal takes
    ``c`` as ``--slow-by kernel`` does: the none run's CPU time over the host's budget."""
    ref = {"seed": 0, "scenario": "none", "policy": "even", "t_step_s": 0.1,
           "compute_s_per_step": 0.02, "cpu_s_per_step": 0.03, "losses": [2.0],
           "factors": [[1.0, 1.0]] * 3, "slow_by": "sleep",
           "kernel": {"held_cores": [[0.5] * 3, [0.5] * 3]}}
    noisy = {**ref, "scenario": "noisy-neighbour", "t_step_s": 0.15,
             "factors": [[1.0, 2.0]] * 3}
    straggler = {**noisy, "scenario": "straggler-2x"}
    out = with_ideal([dict(ref), dict(noisy), dict(straggler)], 1)
    assert out[1]["t_ideal_s"] == pytest.approx(0.1 - 0.06 + 0.06 * 2 / 1.5)
    assert out[2]["t_ideal_s"] == pytest.approx(0.1 - 0.02 + 0.02 * 2 / 1.5)
    # the slowdown as the even run measured it beside the none run, from spike_at on
    cfg = HeteroBenchConfig(scenarios=("none", "noisy-neighbour"), policies=("even",),
                            steps=4, warmup=1, spike_at=2)
    ref["step_times_s"] = [0.1, 0.1, 0.1, 0.1]
    even = {**noisy, "step_times_s": [0.5, 0.1, 0.13, 0.19]}
    assert neighbour_factors([ref, even], cfg) == [pytest.approx(1 + 0.06 / 0.06)]


def test_the_neighbour_is_asked_for_and_must_start_within_the_run():
    """Not in the default scenarios (they run on loopback, which it refuses); a neighbour that
    would start after the last step, or a scenario named twice, is refused in one line."""
    assert "noisy-neighbour" not in HeteroBenchConfig().scenarios
    with pytest.raises(ValueError, match="does not start within --steps 16"):
        HeteroBenchConfig(scenarios=("none", "noisy-neighbour"), steps=16, spike_at=16)
    with pytest.raises(ValueError, match="names noisy-neighbour more than once"):
        HeteroBenchConfig(scenarios=("none", "noisy-neighbour", "noisy-neighbour"))
    with pytest.raises(ValueError, match="names semi more than once"):
        HeteroBenchConfig(policies=("semi", "even", "semi"))


@pytest.mark.parametrize("hosts", [0, 3])
def test_the_neighbour_needs_one_rank_per_host(hosts):
    cfg = HeteroBenchConfig(scenarios=("none", "noisy-neighbour"), policies=("even",))
    with pytest.raises(ValueError, match="noisy-neighbour.*one rank per host: --hosts 2"):
        bench_hetero(cfg, ranks=2, hosts=hosts)


# --- real processes -----------------------------------------------------------------------

def _cpu_moves(neighbour: NoisyNeighbour, since: float, limit_s: float = 60.0) -> float:
    """Seconds until the neighbour's CPU count passes ``since`` (polled; ``limit_s``: it
    never did, however loaded the machine)."""
    start = time.monotonic()
    while neighbour.cpu_s() <= since:
        assert time.monotonic() - start < limit_s, f"no CPU in {limit_s:g} s: {since}"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_paused_neighbour_takes_no_cpu_and_a_resumed_one_does(tmp_path):
    """SIGSTOP and SIGCONT around a run's steps: paused, its CPU seconds stand still (the
    kernel's count, exactly: a stopped process is not run); resumed, they grow (polled for,
    up to a minute: how soon depends on the machine's load); stopped, it is gone, paused or
    not."""
    group = tmp_path / "group"  # a plain folder stands in for a cgroup: nothing is budgeted
    group.mkdir()
    (group / "cgroup.procs").write_text("")
    neighbour = NoisyNeighbour(str(group))
    neighbour._wait_inside = lambda limit_s: None  # the folder is no cgroup to join
    try:
        neighbour.start()
        pids = neighbour.pids
        _cpu_moves(neighbour, 0.0)
        neighbour.pause()
        held = neighbour.cpu_s()
        time.sleep(0.3)
        assert neighbour.cpu_s() == held
        neighbour.resume()
        _cpu_moves(neighbour, held)
        neighbour.pause()
    finally:
        neighbour.stop()
    assert neighbour.pids == [] and not any(os.path.exists(f"/proc/{p}") for p in pids)


def _noisy_hetero():
    cfg = HeteroBenchConfig(scenarios=("none", "noisy-neighbour"), policies=("even",),
                            steps=10, warmup=2, seeds=1, spike_at=4, n_layer=1, n_head=8,
                            n_embd=128, seq_len=32, batch_size=8, eval_batches=1)
    out = run_hetero(cfg)
    dist.barrier()
    host = rank_context().host.cgroup
    busy = [p for p in cgroup_pids(host) if p != os.getpid()
            and "while True" in open(f"/proc/{p}/cmdline").read()]
    return out, busy


@needs_netns
def test_the_neighbour_runs_only_in_its_own_runs_steps_and_is_gone_after():
    """2 hosts of 1 core: the noisy-neighbour run and the none run interleaved step by step.
    The neighbour took no CPU (exactly: it is stopped) in any step of the none run, on either
    host, nor in its own run's steps before spike_at, and took CPU on the last host over its
    run's steps from spike_at on (a total: how much of each step it gets depends on the
    machine's load, and the kernel counts it in 10 ms ticks); no busy loop is left when the
    runs end, and no cgroup once the cluster is down."""
    budgets_here()
    with EmulatedCluster(hosts=2, link="1gbit", cpu=1.0) as cluster:
        out = launch(_noisy_hetero, 2, cluster=cluster, threads=1, timeout_s=60,
                     deadline_s=240)
        tag = cluster.tag
    records = {r["scenario"]: r for r in out[0][0]}
    noisy, none = records["noisy-neighbour"], records["none"]
    took = noisy["kernel"]["neighbour_cpu_s"]
    print(f"\nneighbour CPU s per noisy step on host 1: {[round(t, 2) for t in took[1]]}; "
          f"host 1's CPU share {[round(s, 2) for s in noisy['kernel']['cpu_share'][1]]} "
          f"(none run {[round(s, 2) for s in none['kernel']['cpu_share'][1]]})")
    assert took[0] == [0.0] * 10 and took[1][:4] == [0.0] * 4, took
    assert sum(took[1][4:]) > 0, took
    assert none["kernel"]["neighbour_cpu_s"] == [[0.0] * 10, [0.0] * 10]
    assert noisy["factors"][3] == [1.0, 1.0] and noisy["factors"][4] == [1.0, 2.0]
    assert noisy["slow_by"] == "neighbour" and none["slow_by"] == "sleep"
    assert noisy["ratio_to_ideal"] > 0
    assert [busy for _, busy in out] == [[], []]
    assert not [n for n in plait_cgroups(HERE) if n.startswith(f"plait-{tag}-")]
