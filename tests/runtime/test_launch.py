"""launch(): results in rank order, failures named, nothing left running."""

import os
import re
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from plait.runtime import RankError, launch, rank_context
from plait.testing import run_ranks


def _all_reduce_rank_tensor(scale):
    x = torch.arange(4, dtype=torch.float64) * (dist.get_rank() + 1) * scale
    dist.all_reduce(x)
    return x


@pytest.mark.parametrize("world", [1, 2, 4])
def test_results_match_single_process_reference(world):
    results = run_ranks(_all_reduce_rank_tensor, world, 0.5)
    reference = sum(torch.arange(4, dtype=torch.float64) * (r + 1) * 0.5 for r in range(world))
    assert len(results) == world
    for got in results:
        torch.testing.assert_close(got, reference, rtol=0, atol=0)


def _rank_and_world():
    topo = rank_context().topology
    return topo.rank, topo.world_size, os.environ["RANK"]


def test_ranks_know_who_they_are():
    assert run_ranks(_rank_and_world, 4) == [(r, 4, str(r)) for r in range(4)]


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("shard sizes disagree")
    dist.barrier()


def test_exception_names_rank_and_carries_traceback():
    with pytest.raises(RankError) as info:
        run_ranks(_raise_on_rank_one, 2, timeout_s=10)
    err = info.value
    assert err.rank == 1
    assert "ValueError: shard sizes disagree" in str(err)
    assert "_raise_on_rank_one" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)


def _record_pid_then_die(pid_dir, wait_in):
    with open(os.path.join(pid_dir, str(dist.get_rank())), "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.2)  # the others are already waiting below
        # CLOCK_MONOTONIC is one clock for every process of the machine
        with open(os.path.join(pid_dir, "killed_at"), "w") as f:
            f.write(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGKILL)
    if wait_in == "all_reduce":  # gloo sees rank 1's sockets close and raises at once
        dist.all_reduce(torch.ones(1 << 20))
    else:  # a wait only its timeout ends (as NCCL's for a dead peer): the launcher must tell
        store = dist.FileStore(os.path.join(pid_dir, "store"), dist.get_world_size())
        store.wait(["never-set"], timedelta(seconds=rank_context().topology.timeout_s))
    dist.barrier()


@pytest.mark.parametrize("world, wait_in", [(2, "all_reduce"), (4, "all_reduce"), (3, "store")])
def test_sigkilled_rank_is_named_quickly_and_nothing_is_left(tmp_path, world, wait_in):
    timeout_s = 60.0  # twice the bound below: noticing only through it fails
    with pytest.raises(RankError) as info:
        launch(_record_pid_then_die, world, args=(str(tmp_path), wait_in), timeout_s=timeout_s,
               threads=1)
    took = time.monotonic() - float((tmp_path / "killed_at").read_text())
    # The launcher's own path is about 1 s: it polls every 0.1 s, listens 0.5 s for the
    # others' reports, and gives them 2 s to stop; the bound only tells it from the timeout.
    assert took < 30, f"the SIGKILL was reported {took:.1f} s after it ({timeout_s:g} s timeout)"
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)
    pids = [int((tmp_path / str(r)).read_text()) for r in range(world)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _stamp(folder):
    """When this rank got here, on CLOCK_MONOTONIC (one clock for every process)."""
    with open(os.path.join(folder, f"at{dist.get_rank()}"), "w") as f:
        f.write(repr(time.monotonic()))


def _since_stamp(folder, rank):
    return time.monotonic() - float((folder / f"at{rank}").read_text())


def _hang_forever_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(3600)


def test_deadline_stops_a_hung_rank():
    """Judged by the launcher's own clock, which the deadline runs on: stopping the run, it
    names rank 0 quiet for as long as that clock has run ("no progress for N s"), 2 s and a
    poll (0.1 s) at the deadline. Not from a stamp rank 0 writes as it starts to hang: in a
    run at load 7 here the deadline fired before rank 0 got there (no stamp:
    FileNotFoundError), and the stop's own seconds (SIGTERM, the processes' exit) are a
    loaded machine's, not the deadline's. The upper bound only tells a deadline that fires
    from one that does not (rank 0 sleeps an hour); the poll's lateness is the machine's."""
    start = time.monotonic()
    with pytest.raises(RankError, match="deadline") as info:
        launch(_hang_forever_on_rank_zero, 2, timeout_s=5, deadline_s=2, threads=1)
    assert time.monotonic() - start > 2  # not before it
    quiet = re.search(r"no progress for (\d+) s", info.value.summary)
    assert info.value.rank == 0 and quiet, info.value.summary
    assert 2 <= int(quiet[1]) < 30, info.value.summary


def _lone_collective_times_out(folder):
    if dist.get_rank() == 0:
        _stamp(folder)
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


def test_collective_timeout_raises_instead_of_hanging(tmp_path):
    with pytest.raises(RankError) as info:
        launch(_lone_collective_times_out, 2, args=(str(tmp_path),), timeout_s=3, threads=1,
               deadline_s=300)  # ends a hang, and says "deadline", not "timed out"
    took = _since_stamp(tmp_path, 0)
    # rank 0 timed out; the rank named is the one it waited for, which never answered
    assert info.value.rank == 1 and "timed out waiting for it" in info.value.summary
    assert any(o.startswith("rank 0 raised") for o in info.value.others)
    assert took >= 3, took  # by the timeout, not before it


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_world_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="world size"):
        launch(_rank_and_world, bad)


def _progress_and_return():
    rank_context().report({"step": dist.get_rank()})
    return dist.get_rank()


def test_progress_reports_reach_the_caller():
    seen = []
    assert launch(_progress_and_return, 2, on_progress=lambda r, p: seen.append((r, p))) == [0, 1]
    assert sorted(seen) == [(0, {"step": 0}), (1, {"step": 1})]


_LAUNCHER = """
import os, sys, time
from plait.runtime import launch

def work(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(120)

if __name__ == "__main__":
    launch(work, 2, args=(sys.argv[1],), timeout_s=200)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dead rank its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigkilled_launcher_takes_its_ranks_with_it(tmp_path):
    """The ranks' parent is the forkserver, which outlives a SIGKILLed launcher (each rank
    holds its alive pipe): before each rank watched the launcher's pid, a killed `plait
    train` left its ranks training for a minute."""
    import subprocess
    import sys

    script, folder = tmp_path / "launcher.py", tmp_path / "pids"
    script.write_text(_LAUNCHER)
    folder.mkdir()
    # its TMPDIR the test's: a SIGKILLed launcher leaves multiprocessing's pymp-* folder
    proc = subprocess.Popen([sys.executable, str(script), str(folder)],
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 300  # ends a hang: a cold start loads torch twice
        while len(os.listdir(folder)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.2)
        ranks = [int(p) for p in os.listdir(folder)]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60  # they would sleep 120 s
        while any(map(_running, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in ranks if _running(p)]
    finally:
        proc.kill()
        for pid in [int(p) for p in os.listdir(folder)]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"


def _progress_until_stopped():
    from plait.runtime.progress import mark

    while True:
        mark("a step")
        time.sleep(0.05)


def test_a_deadline_over_ranks_still_running_blames_the_deadline():
    """Ranks that keep making progress until the deadline: the error says the run passed
    its deadline while they ran, not that a rank stopped answering (a new user's trial read
    "stopped answering: it made no progress, ..., no progress for 0 s" there). The deadline
    runs from the launch, so it leaves the ranks 10 s to start marking (well under 1 s
    here; at 2 s a rank at load 7 had not started when it fired)."""
    with pytest.raises(RankError, match="deadline") as info:
        launch(_progress_until_stopped, 2, timeout_s=5, deadline_s=10, threads=1)
    summary = info.value.summary
    assert summary.startswith("had not finished (last in a step)"), summary
    assert "stopped answering" not in summary and "no progress for" not in summary, summary


def _plait_logging():
    import logging

    logger = logging.getLogger("plait")
    return (logger.level, logger.propagate,
            [h.formatter._fmt for h in logger.handlers if h.formatter is not None])


def test_verbose_reaches_every_rank(monkeypatch):
    """``plait -v`` sets PLAIT_VERBOSE; each rank then logs plait's lines at DEBUG on stderr,
    naming itself (the balancer's decisions are logged on the ranks); without it, nothing
    is set up on them."""
    from plait.runtime.launch import VERBOSE_ENV

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    assert [r[2] for r in run_ranks(_plait_logging, 2)] == [[], []]
    monkeypatch.setenv(VERBOSE_ENV, "1")
    assert run_ranks(_plait_logging, 2) == [(10, False, [f"plait: rank {r}: %(message)s"])
                                             for r in range(2)]
