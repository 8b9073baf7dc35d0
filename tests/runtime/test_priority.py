"""Communication threads ahead of compute (plait.runtime.priority)."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from plait.runtime import launch
from plait.runtime.priority import DEFAULT_NICE, comm_priority, comm_threads, raise_comm_threads
from plait.testing import TEST_TIMEOUT_S, run_ranks


def _fifo_allowed() -> bool:
    """Whether this process may use SCHED_FIFO (root, and a cgroup that grants real-time
    time): tried in a child, so this process keeps its own policy."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


fifo_allowed = pytest.mark.skipif(not _fifo_allowed(),
                                  reason="SCHED_FIFO is not allowed here (needs CAP_SYS_NICE)")


def _nice_allowed() -> bool:
    """Whether this process may take a negative nice (CAP_SYS_NICE, which root in a container
    may lack): tried in a child, so this process keeps its own."""
    probe = "import os; os.setpriority(os.PRIO_PROCESS, 0, -1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


nice_allowed = pytest.mark.skipif(not _nice_allowed(),
                                  reason="a negative nice needs CAP_SYS_NICE")


def _policies(extra_group):
    if extra_group:  # a new group's gloo starts threads of its own; the ops context raises them
        from plait.ops import get_context

        get_context(dist.new_group(list(range(dist.get_world_size()))))
    dist.all_reduce(torch.ones(4))
    main = os.getpid()
    return ({tid: (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
             for tid in comm_threads()},
            (os.sched_getscheduler(main), os.getpriority(os.PRIO_PROCESS, main)))


def _launch_policies(world, setting, extra_group=False):
    env = {} if setting is None else {"PLAIT_COMM_PRIORITY": setting}
    # ranks fork from a server started earlier: the setting travels in launch's env
    return launch(_policies, world, args=(extra_group,), env=env, timeout_s=TEST_TIMEOUT_S,
                  threads=1)


def _cores():
    return len(os.sched_getaffinity(0))


@nice_allowed
@pytest.mark.parametrize("extra_group", [False, True])
def test_default_nices_gloo_threads_where_ranks_fit_the_cores(extra_group):
    assert _cores() >= 2, "this test runs 2 ranks"
    for threads, main in _launch_policies(2, None, extra_group):
        # gloo's socket loop and its work threads, per group
        assert len(threads) >= (6 if extra_group else 3)
        assert set(threads.values()) == {(os.SCHED_OTHER, DEFAULT_NICE)}
        assert main == (os.SCHED_OTHER, 0)  # compute keeps the ordinary scheduler


def test_default_leaves_threads_alone_with_more_ranks_than_cores():
    for threads, _ in _launch_policies(_cores() + 1, None):
        assert threads and set(threads.values()) == {(os.SCHED_OTHER, 0)}


@fifo_allowed
def test_rt_is_opt_in_and_refused_unless_a_core_is_left_over():
    """rt with as many ranks as cores stalled ~1 s at a time (docs/link.md): refused there
    (auto's nice instead) and with more ranks (nothing raised), taken with fewer."""
    for threads, _ in _launch_policies(_cores(), "rt"):
        assert threads and set(threads.values()) == {(os.SCHED_OTHER, DEFAULT_NICE)}
    for threads, _ in _launch_policies(_cores() + 1, "rt"):
        assert {policy for policy, _ in threads.values()} == {os.SCHED_OTHER}


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_rt_needs_a_core_left_over(monkeypatch, extra):
    """No processes: the decision from PLAIT_RANKS_ON_MACHINE against this process's cores."""
    cores = _cores()
    if cores + extra < 1:
        pytest.skip("one core: no fewer ranks than cores to run")
    monkeypatch.setenv("PLAIT_RANKS_ON_MACHINE", str(cores + extra))
    expected = {-1: ("rt", 1), 0: ("nice", DEFAULT_NICE), 1: ("off", 0)}[extra]
    assert comm_priority("rt") == expected
    assert comm_priority("auto") == (("off", 0) if extra > 0 else ("nice", DEFAULT_NICE))


@nice_allowed  # else nothing could raise a thread, and this could not fail
def test_off_leaves_every_thread_alone():
    # 2 ranks: where they fit the cores the default nices comm threads (the test above)
    for threads, _ in _launch_policies(2, "off"):
        assert threads and set(threads.values()) == {(os.SCHED_OTHER, 0)}


@pytest.mark.parametrize("setting, expected", [
    ("off", ("off", 0)), ("nice", ("nice", DEFAULT_NICE)), ("nice:-5", ("nice", -5)),
    ("NICE:19", ("nice", 19))])
def test_settings_parse(setting, expected):
    assert comm_priority(setting) == expected


@pytest.mark.parametrize("bad", ["fifo", "nice:-21", "nice:x", "nice:20", ""])
def test_bad_settings_are_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="auto, off, nice"):
        comm_priority(bad)


def _fused_loop(n):
    from plait.ops import matmul_all_reduce

    x, w = torch.ones(64, 64), torch.ones(64, 64)
    for _ in range(n):
        matmul_all_reduce(x, w, chunks=4)
    return dist.get_rank()


def test_more_ranks_than_cores_with_the_default_finishes():
    # The old default (comm threads at SCHED_FIFO) hung this until killed, starving the
    # machine: a rank's spinning socket thread held the core its peer needed to compute.
    # Judged by what ends a hang, not by a wall-time bound (about 10 s on 2 busy cores, 28 s
    # at load 7, against 60; a CI machine at load 14 gives a process an eighth of a core):
    # each fused op marks progress, so a hang leaves the ranks silent and the launcher's
    # watchdog ends the run timeout_s + GRACE_S later (a RankError naming the rank; a rank
    # made to hang at its 100th op fails this so), and the deadline ends a run that crawls.
    ranks = _cores() + 1
    start = time.monotonic()
    assert launch(_fused_loop, ranks, args=(300,), timeout_s=20, threads=1,
                  deadline_s=600) == list(range(ranks))
    print(f"\n{ranks} ranks on {_cores()} cores, 300 fused ops each: "
          f"{time.monotonic() - start:.1f} s")


def test_outside_a_group_there_is_nothing_to_raise():
    # this test process made no gloo group: no comm thread, and every thread keeps its policy
    before = {t: os.sched_getscheduler(t) for t in map(int, os.listdir("/proc/self/task"))}
    assert comm_threads() == [] and raise_comm_threads() == 0
    assert {t: os.sched_getscheduler(t) for t in before} == before
