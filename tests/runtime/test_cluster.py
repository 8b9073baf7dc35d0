"""The emulated cluster: namespaces appear and vanish, links are really rate-limited."""

import logging
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import plait.runtime.cluster as cluster_mod
from plait.runtime import EmulatedCluster, launch, max_hosts, parse_rate, rank_context
from plait.runtime.cluster import format_rate
from plait.runtime.leftovers import remove_leftovers

from conftest import needs_netns, read_tbf


def _namespaces(tag):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if f"plait-{tag}-" in line]


@pytest.mark.parametrize("text, bits", [("1gbit", 1e9), ("100mbit", 1e8), ("2.5Gbit", 2.5e9),
                                        ("500kbit", 5e5), ("loopback", None), (None, None)])
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits
    assert parse_rate(format_rate(bits)) == bits


@pytest.mark.parametrize("text", ["1gbps", "fast", "1 gigabit", "-1gbit", "10bit"])
def test_unknown_rate_is_refused(text):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


def test_more_hosts_than_the_machine_can_make():
    with pytest.raises(ValueError, match="more than this machine can make"):
        EmulatedCluster(hosts=max_hosts() + 1)
    with pytest.raises(ValueError, match="positive"):
        EmulatedCluster(hosts=0)


def test_falls_back_to_loopback_without_root(monkeypatch, caplog):
    monkeypatch.setattr(cluster_mod.os, "geteuid", lambda: 1000)
    with EmulatedCluster(hosts=2, link="1gbit") as cluster:
        assert not cluster.emulated
        assert [h.addr for h in cluster.hosts] == ["127.0.0.1"] * 2
        assert "need root" in cluster.describe()
        assert cluster.link_label == "loopback"
    assert "falling back to loopback" in caplog.text


def _where_am_i():
    ctx = rank_context()
    x = torch.ones(1)
    dist.all_reduce(x)
    return ctx.host.addr, ctx.host.netns, x.item()


@needs_netns
def test_ranks_run_inside_their_hosts_and_teardown_removes_everything():
    with EmulatedCluster(hosts=2, link="1gbit") as cluster:
        tag = cluster.tag
        assert len(_namespaces(tag)) == 3  # two hosts and the switch
        out = launch(_where_am_i, 4, cluster=cluster, threads=1, timeout_s=20)
    assert [o[0] for o in out] == ["10.213.0.1", "10.213.0.1", "10.213.0.2", "10.213.0.2"]
    assert all(o[2] == 4.0 for o in out)
    assert _namespaces(tag) == []


@needs_netns
def test_teardown_runs_on_error_and_setup_is_idempotent():
    cluster = EmulatedCluster(hosts=2, link="1gbit", tag="idem01")
    with pytest.raises(RuntimeError, match="boom"):
        with cluster:
            raise RuntimeError("boom")
    assert _namespaces("idem01") == []
    # a crashed run's leftovers are cleared by the next up() of the same tag
    subprocess.run(["ip", "netns", "add", "plait-idem01-h0"], check=True)
    with EmulatedCluster(hosts=2, link="1gbit", tag="idem01") as again:
        again.up()  # a second up() is a no-op
        assert len(_namespaces("idem01")) == 3
    assert _namespaces("idem01") == []


def _timed_all_reduce(nbytes):
    x = torch.ones(nbytes // 4)
    dist.all_reduce(x)  # warm-up: connections are made
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    return min(times)


@needs_netns
def test_link_rate_limits_all_reduce_bandwidth():
    link = "200mbit"
    nbytes = 4 << 20
    with EmulatedCluster(hosts=2, link=link) as cluster:
        t = launch(_timed_all_reduce, 2, args=(nbytes,), cluster=cluster, threads=1)[0]
        switch = f"{cluster_mod.NETNS_PREFIX}{cluster.tag}-sw"
        qdiscs = [read_tbf(h.netns, "eth0") for h in cluster.hosts] + \
                 [read_tbf(switch, f"p{h.index}") for h in cluster.hosts]
    busbw = nbytes / t * 2 * (2 - 1) / 2  # nccl-tests: all_reduce bus factor 2(n-1)/n
    fraction = busbw / (parse_rate(link) / 8)
    print(f"\nall_reduce of 4 MiB at {link}: busbw {fraction:.0%} of the link (fastest of 3)")
    # each way (a host's eth0, its switch port) shaped at the rate asked for, as the kernel
    # holds it, and carrying the reduce-scatter's and the all-gather's halves of 4 all-reduces
    for q in qdiscs:
        assert (q["kind"], q["rate"]) == ("tbf", parse_rate(link) / 8), q
        assert q["bytes"] >= 4 * nbytes, q
    # the fastest of 3 (each ~0.17 s on the wire), which no load makes faster: above the rate
    # (and a 5 % allowance for a 64 KiB bucket and the clocks), shaping failed
    assert fraction <= 1.05, f"busbw {busbw / 1e6:.1f} MB/s is {fraction:.0%} of {link}"


_WAIT_FOREVER = """
import os, sys, time
import torch.distributed as dist

def wait_forever(folder):
    open(os.path.join(folder, f"rank{dist.get_rank()}"), "w").close()
    time.sleep(120)
"""


def _wait_for_ranks(folder, proc, world=2, limit_s=300):
    """Until every rank is inside wait_forever. A cold start loads torch in a new forkserver
    first (15.9 s to the ranks' first line at load 8 here, an eighth of a core a process at
    CI's load 14): the limit is there to end a start that hangs, not to time one."""
    end = time.monotonic() + limit_s
    while not all((folder / f"rank{r}").exists() for r in range(world)):
        assert proc.poll() is None, f"the run ended before its ranks started ({proc.returncode})"
        assert time.monotonic() < end, f"the ranks did not start within {limit_s} s"
        time.sleep(0.05)


_SIGTERMED = _WAIT_FOREVER + """
from plait.runtime import EmulatedCluster, launch

if __name__ == "__main__":
    with EmulatedCluster(hosts=2, link="1gbit", tag=sys.argv[1], require=True) as cluster:
        print("up", flush=True)
        launch(wait_forever, 2, args=(sys.argv[2],), cluster=cluster)
"""


@needs_netns
@pytest.mark.netns
def test_sigterm_mid_launch_leaves_no_namespace_or_process(tmp_path):
    # `timeout` and `kill` send SIGTERM; by default it ends Python where it stands, past
    # every `with` and atexit, and the namespaces stayed behind
    script = tmp_path / "sigtermed.py"
    script.write_text(_SIGTERMED)
    tag = "sigterm"
    proc = subprocess.Popen([sys.executable, str(script), tag, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "up"
        assert _namespaces(tag)
        _wait_for_ranks(tmp_path, proc)
        proc.terminate()
        assert proc.wait(timeout=120) == 128 + 15  # ends a hang: it takes seconds
    finally:
        proc.kill()
        cluster_mod.remove_stale_namespaces(tag)
    assert _namespaces(tag) == []


_KILLED = _WAIT_FOREVER + """
from plait.runtime import EmulatedCluster, launch

if __name__ == "__main__":
    with EmulatedCluster(hosts=2, link="1gbit", require=True) as cluster:
        print(cluster.tag, flush=True)
        launch(wait_forever, 2, args=(sys.argv[1],), cluster=cluster)
"""


@needs_netns
@pytest.mark.netns
def test_the_next_run_removes_what_a_sigkilled_run_left(tmp_path, caplog, monkeypatch):
    # SIGKILL runs no handler: the namespaces and the launch folder stay until the next run.
    # The killed run's temporary folder is the test's (here too): it also leaves
    # multiprocessing's pymp-* folder (its forkserver's socket), which no later run can
    # tell from a live one's, and a CI run of the suite left one in /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        tag = proc.stdout.readline().strip()
        _wait_for_ranks(tmp_path, proc)
        folders = [f for f in os.listdir(tempfile.gettempdir())
                   if f.startswith(f"plait-launch-{proc.pid}-")]
        assert _namespaces(tag) and folders
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert _namespaces(tag), "SIGKILL left them (what this test is about)"
    with caplog.at_level(logging.WARNING, logger="plait.runtime"):
        removed = remove_leftovers()
    assert _namespaces(tag) == []
    assert not [f for f in os.listdir(tempfile.gettempdir())
                if f.startswith(f"plait-launch-{proc.pid}-")]
    assert len(removed) == 4 and f"pid {proc.pid}, no longer running" in caplog.text


def test_leftovers_of_a_running_process_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = tmp_path / f"plait-launch-{os.getpid()}-abc"
    dead = tmp_path / "plait-launch-4194305-abc"  # above the kernel's pid limit (2^22): never running
    other = tmp_path / "plait-launch-notapid"
    elastic = tmp_path / "plait-elastic-4194305-abc"  # plait elastic's run folder
    for folder in (mine, dead, other, elastic):
        folder.mkdir()
    assert sorted(remove_leftovers()) == sorted([f"folder {dead}", f"folder {elastic}"])
    assert mine.exists() and other.exists() and not dead.exists() and not elastic.exists()


@needs_netns
def test_what_still_runs_in_a_dead_runs_namespace_is_stopped_with_it():
    """A process left in a namespace whose maker is gone (an orphaned rank or agent) is
    SIGKILLed before the namespace goes: a host that is gone runs nothing."""
    name = "plait-4194305xdead-h0"  # a maker above the kernel's pid limit: never running
    subprocess.run(["ip", "netns", "add", name], check=True)
    proc = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"])
    try:
        end = time.monotonic() + 60  # ends a hang: it takes milliseconds
        while str(proc.pid) not in subprocess.run(["ip", "netns", "pids", name],
                                                  capture_output=True, text=True).stdout:
            assert time.monotonic() < end, "the sleep never entered the namespace"
            time.sleep(0.05)
        assert f"network namespace {name}" in remove_leftovers()
        assert proc.wait(timeout=10) == -9
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                          text=True).stdout
    finally:
        proc.kill()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_netns
def test_cluster_clean_spares_a_running_plait_and_status_says_who_made_what():
    with EmulatedCluster(hosts=2, link="1gbit", require=True) as cluster:
        run = [sys.executable, "-m", "plait", "cluster"]
        status = subprocess.run(run + ["status"], capture_output=True, text=True, timeout=300)
        assert f"{cluster.hosts[0].netns}  (made by pid {os.getpid()}, still running)" in status.stdout
        clean = subprocess.run(run + ["clean"], capture_output=True, text=True, timeout=300)
        assert clean.returncode == 0 and _namespaces(cluster.tag), clean.stdout  # ours survive
