"""Communication threads ahead of compute (plait.runtime.priority)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from plait.runtime import launch
from plait.runtime.priority import comm_threads, raise_comm_threads
from plait.runtime.testing import TEST_TIMEOUT_S, run_ranks


def _fifo_allowed() -> bool:
    """Whether this process may use SCHED_FIFO (root, and a cgroup that grants real-time
    time): tried in a child, so this process keeps its own policy."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


fifo_allowed = pytest.mark.skipif(not _fifo_allowed(),
                               reason="SCHED_FIFO is not allowed here (needs CAP_SYS_NICE)")


def _policies(extra_group):
    if extra_group:  # a new group's gloo starts threads of its own; the ops context raises them
        from plait.ops import get_context

        get_context(dist.new_group(list(range(dist.get_world_size()))))
    dist.all_reduce(torch.ones(4))
    main = os.getpid()
    return {tid: os.sched_getscheduler(tid) for tid in comm_threads()}, os.sched_getscheduler(main)


@fifo_allowed
@pytest.mark.parametrize("extra_group", [False, True])
def test_gloo_threads_run_ahead_of_compute(extra_group):
    for threads, main_policy in run_ranks(_policies, 2, extra_group):
        # gloo's socket loop and its work threads, per group
        assert len(threads) >= (6 if extra_group else 3)
        assert set(threads.values()) == {os.SCHED_FIFO}
        assert main_policy == os.SCHED_OTHER  # compute keeps the ordinary scheduler


def test_off_leaves_every_thread_alone():
    # ranks fork from a server started earlier: the setting travels in launch's env
    results = launch(_policies, 2, args=(False,), env={"PLAIT_COMM_PRIORITY": "off"},
                     timeout_s=TEST_TIMEOUT_S, threads=1)
    for threads, _ in results:
        assert threads and set(threads.values()) == {os.SCHED_OTHER}


def test_outside_a_group_there_is_nothing_to_raise():
    # this test process made no gloo group: no comm thread, and every thread keeps its policy
    before = {t: os.sched_getscheduler(t) for t in map(int, os.listdir("/proc/self/task"))}
    assert comm_threads() == [] and raise_comm_threads() == 0
    assert {t: os.sched_getscheduler(t) for t in before} == before
