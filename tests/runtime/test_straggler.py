"""Straggler emulation: the delay is proportional to the compute actually done."""

import os
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from plait.runtime import SlowSpec, Straggler, parse_slow, validate_slow
from plait.runtime.slow.straggler import compute_clock


@pytest.mark.parametrize("text, spec", [
    ("1:2", SlowSpec(rank=1, factor=2.0)),
    ("3:1.5@10-30", SlowSpec(rank=3, factor=1.5, from_step=10, until_step=30)),
    ("0:4@50", SlowSpec(rank=0, factor=4.0, from_step=50)),
])
def test_parse_slow(text, spec):
    assert parse_slow(text) == spec


@pytest.mark.parametrize("text", ["1", "a:2", "1:0.5", "1:2@30-10", "1:2@x"])
def test_bad_slow_is_refused(text):
    with pytest.raises(ValueError):
        parse_slow(text)


def test_slow_naming_a_missing_rank_is_refused():
    with pytest.raises(ValueError, match="rank 4, but there are only 4 ranks"):
        validate_slow([parse_slow("4:2")], 4)


@given(start=st.integers(0, 100), length=st.integers(1, 100), step=st.integers(0, 300))
def test_window(start, length, step):
    straggler = Straggler([SlowSpec(rank=0, factor=3.0, from_step=start, until_step=start + length)], 0)
    straggler.set_step(step)
    assert straggler.factor() == (3.0 if start <= step < start + length else 1.0)


class _Clock:
    """A compute clock that moves only when the test says compute ran, and a sleep that
    records instead of waiting: the delays are exact, whatever the machine's load."""

    def __init__(self):
        self.now = 0.0
        self.slept = []

    def __call__(self):
        return self.now

    def work(self, seconds):
        self.now += seconds

    def sleep(self, seconds):
        self.slept.append(seconds)


def test_delay_is_proportional_to_the_work_done():
    clock = _Clock()
    straggler = Straggler([SlowSpec(rank=0, factor=3.0)], rank=0, clock=clock, sleep=clock.sleep)
    for work in (0.25, 0.75):  # binary fractions: (3 - 1) × work is exact
        with straggler.compute():
            clock.work(work)
        clock.work(10.0)  # outside compute (communication, waiting): not stretched
    assert clock.slept == [0.5, 1.5]
    assert straggler.delayed_s == 2.0


def test_windows_on_one_rank_multiply():
    clock = _Clock()
    specs = [parse_slow("1:2@0-10"), parse_slow("1:1.5@5"), parse_slow("0:7")]
    straggler = Straggler(specs, rank=1, clock=clock, sleep=clock.sleep)
    for step in (3, 7, 12):  # factors 2, 2 × 1.5 and 1.5; rank 0's spec is not this rank's
        straggler.set_step(step)
        with straggler.compute():
            clock.work(0.5)
    assert clock.slept == [0.5, 1.0, 0.25]


def test_other_ranks_are_not_slowed():
    clock = _Clock()
    straggler = Straggler([SlowSpec(rank=1, factor=10.0)], rank=0, clock=clock, sleep=clock.sleep)
    with straggler.compute():
        clock.work(0.5)
    assert clock.slept == [] and straggler.delayed_s == 0.0


def test_compute_clock_is_the_thread_time_of_a_one_thread_cpu_rank():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert compute_clock() is time.thread_time
        assert compute_clock(torch.device("cpu")) is time.thread_time
        assert compute_clock(torch.device("cuda", 0)) is time.perf_counter
        torch.set_num_threads(2)
        assert compute_clock(torch.device("cpu")) is time.perf_counter
    finally:
        torch.set_num_threads(threads)


def test_compute_clock_is_wall_time_on_a_host_with_a_cpu_budget(monkeypatch):
    """A throttled rank's wait is not CPU time: under --host-cpu, thread time would read a
    half-core host as full speed."""
    from plait.runtime import current
    from plait.runtime.cluster import Host

    threads = torch.get_num_threads()

    def on(cgroup):
        return SimpleNamespace(host=Host(0, None, "lo", "127.0.0.1", cgroup=cgroup))
    try:
        torch.set_num_threads(1)
        monkeypatch.setattr(current, "_current", on(None))
        assert compute_clock() is time.thread_time
        monkeypatch.setattr(current, "_current", on("/sys/fs/cgroup/cpu/plait-1x0-h0"))
        assert compute_clock() is time.perf_counter
    finally:
        torch.set_num_threads(threads)


def test_by_default_waiting_inside_compute_is_not_stretched():
    """The real clock and sleep: a one-thread CPU rank descheduled mid-compute (here, a
    sleep) is not slowed for it. 10 ms of a 100 ms wait bounds the CPU time of going to
    sleep and waking, with room to spare on a loaded machine; wall time would give 100 ms."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        straggler = Straggler([SlowSpec(rank=0, factor=2.0)], rank=0)
        with straggler.compute():
            time.sleep(0.1)
    finally:
        torch.set_num_threads(threads)
    assert 0.0 <= straggler.delayed_s < 0.01


_THREADS_AT_COLLECTION = torch.get_num_threads()  # before any test sets a number of its own


def test_the_test_process_runs_the_threads_conftest_asks_for():
    # conftest sets OMP_NUM_THREADS before torch loads: set after, it was ignored, and this
    # process ran a thread per core (so compute_clock picked wall time here, thread time in ranks)
    assert _THREADS_AT_COLLECTION == int(os.environ["OMP_NUM_THREADS"])
