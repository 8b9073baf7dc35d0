"""The launcher's watchdog: a run that stops making progress ends, naming the rank."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from plait.runtime import RankError, launch, rank_context
from plait.runtime.launch import _may_still_report
from plait.runtime.progress import ProgressBoard, mark
from plait.runtime.watchdog import GRACE_S, Watchdog, process_state

from conftest import needs_netns


def _fused_then_stop(stop_rank, at, stamp):
    from plait.ops import matmul_all_reduce

    x = w = torch.ones(32, 32)
    for i in range(10_000):
        if i == at and dist.get_rank() == stop_rank:
            stamp.write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        matmul_all_reduce(x, w, chunks=2)


def test_a_stopped_rank_is_named_within_the_timeout(tmp_path):
    stamp = tmp_path / "stopped_at"
    with pytest.raises(RankError) as info:
        launch(_fused_then_stop, 3, args=(1, 20, stamp), timeout_s=4, threads=1)
    took = time.time() - float(stamp.read_text())  # from the SIGSTOP to every rank gone
    assert info.value.rank == 1, info.value
    assert "stopped (SIGSTOP" in info.value.summary and "matmul_all_reduce" in info.value.summary
    # Named by the others' collective timeout (4 s; about 4.5 s here to every rank gone), not
    # by the watchdog, which alone would have ended it at 4 + GRACE_S: the launcher says which
    # ended it, and a wall-time bound between the two would measure a loaded machine's share
    # of a core as much as the launcher
    summary = info.value.summary
    assert "the others timed out waiting for it" in summary, summary
    assert "no rank made progress" not in summary, summary
    print(f"\nnamed {took:.1f} s after the SIGSTOP")


def _progress_then_all_quiet(folder):
    for _ in range(2):
        mark("a step")
    with open(os.path.join(folder, str(dist.get_rank())), "w") as f:
        f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process
    mark("a step")  # the last progress, after the stamp
    time.sleep(120)  # every rank stops making progress, and no collective is left to time out


def test_no_progress_on_any_rank_ends_the_run_after_timeout_plus_grace(tmp_path):
    """The launcher's watchdog stops the run, not before its limit: every rank's last mark
    follows its stamp. How soon after the limit is the launcher's poll, a loaded machine's
    to stretch: the decision itself is timed exactly below, on readings fed to it. Had the
    watchdog not fired, the ranks' sleep would have ended and launch returned."""
    with pytest.raises(RankError) as info:
        launch(_progress_then_all_quiet, 2, args=(str(tmp_path),), timeout_s=2, threads=1)
    quiet = time.monotonic() - max(float((tmp_path / str(r)).read_text()) for r in range(2))
    summary = info.value.summary
    assert "no rank made progress for 12 s (the collective timeout + 10 s)" in summary, summary
    assert "last in a step" in summary, summary
    assert quiet > 2 + GRACE_S, quiet


def _board(world: int) -> ProgressBoard:
    """A board in this process's memory, as the ranks' shared one reads."""
    return ProgressBoard(counts=[0] * world, names=bytearray(world * 48))


def test_the_watchdog_expires_the_limit_after_the_last_mark_of_any_rank():
    board = _board(2)
    watchdog = Watchdog(board, 2, timeout_s=2, grace_s=10)
    t = time.monotonic()
    assert not watchdog.expired(t + 1e6)  # nothing marked: not armed, however long
    board.mark(1, "a step")
    assert not watchdog.expired(t + 100)  # seen now
    assert not watchdog.expired(t + 112)  # at the limit, not past it
    board.mark(0, "an op")
    assert not watchdog.expired(t + 105)  # a mark of any rank starts the limit afresh
    assert not watchdog.expired(t + 117)
    assert watchdog.expired(t + 117.001)
    rank, why = watchdog.blame([0, 1], {0: None, 1: None}, t + 120)
    assert (rank, why) == (1, "stopped answering: it made no progress, last in a step, "
                              "no progress for 20 s")


def _marks_so_far():
    return rank_context().progress.count(dist.get_rank())


def test_a_run_that_never_marks_leaves_the_watchdog_unarmed():
    # no plait operator and no report: nothing marks on a rank's behalf (its start, the
    # group's rendezvous), so the watchdog does not arm (above; the deadline still holds)
    assert launch(_marks_so_far, 2, timeout_s=10, threads=1) == [0, 0]


def test_process_state_reads_proc():
    assert process_state(os.getpid()) == "R"
    assert process_state(None) is None and process_state(2 ** 22 + 1) is None


def _link_down_mid_run(stamp):
    import subprocess

    from plait.ops import matmul_all_reduce

    x = w = torch.ones(64, 64)
    for i in range(100_000):
        if i == 20 and dist.get_rank() == 1:  # inside its own host's namespace
            with open(stamp, "w") as f:
                f.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process
            subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
        matmul_all_reduce(x, w, chunks=2)


@needs_netns
def test_a_link_down_names_every_rank_and_host(tmp_path):
    from plait.runtime import EmulatedCluster

    stamp = tmp_path / "link_down_at"
    with EmulatedCluster(hosts=2, link="1gbit", require=True) as cluster:
        with pytest.raises(RankError) as info:
            launch(_link_down_mid_run, 2, args=(str(stamp),), cluster=cluster, timeout_s=3,
                   threads=1)
        took = time.monotonic() - float(stamp.read_text())
    # both ranks' collectives time out at 3 s (about 3 s here); at 3 + GRACE_S the watchdog
    # alone would have ended it: "as did every rank" is said only where every rank reported
    # its own timeout (the watchdog's stop says "no rank made progress"); the launcher waits
    # for a rank that marked within the timeout to report its own (launch._may_still_report)
    text = info.value.headline()
    assert "timed out, as did every rank" in text and "link between their hosts" in text
    assert "no rank made progress" not in text, text
    print(f"\nreported {took:.1f} s after the link went down")
    assert "rank 1 on host 1 (10.213.0.2)" in text and "in matmul_all_reduce" in text


def test_after_a_timeout_the_launcher_listens_for_the_ranks_that_may_still_time_out():
    """Past the grace (0.5 s), the launcher goes on listening only while every failure is an
    echo (a timeout) and a rank yet to report marked within the timeout (its own collective
    is then due to time out too), for the timeout plus 5 s at most."""
    board = _board(3)
    watchdog = Watchdog(board, 3, timeout_s=3)
    t = time.monotonic()
    board.mark(0, "matmul_all_reduce")
    board.mark(1, "matmul_all_reduce")
    watchdog.poll(t)
    pids = {0: None, 1: None, 2: None}
    timed_out = [(0, "raised DistBackendError: ... Timed out waiting 3000ms ...", "", None, None)]
    assert _may_still_report(timed_out, {1, 2}, watchdog, pids, 0.6, t + 3.1)
    assert not _may_still_report(timed_out, {1, 2}, watchdog, pids, 0.6, t + 8.1)  # 3 + 5 s
    assert not _may_still_report(timed_out, {1, 2}, watchdog, pids, 8.1, t + 3.1)
    assert not _may_still_report(timed_out, {2}, watchdog, pids, 0.6, t + 3.1)  # never marked
    raised = [(0, "raised ValueError: shard sizes disagree", "", None, None)]
    assert not _may_still_report(raised, {1}, watchdog, pids, 0.6, t + 3.1)  # the root cause
