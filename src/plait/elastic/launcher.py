"""One torchrun agent per emulated host; kill a host mid-run; the survivors go on.

    result = run_elastic(ElasticConfig(hosts=3, steps=60, kill_host=2, kill_at=20))

Each host of an :class:`~plait.runtime.EmulatedCluster` runs PyTorch's elastic agent
(``python -m torch.distributed.run``) inside its network namespace (``ip netns exec``),
``--nnodes MIN:MAX`` with the c10d rendezvous on host 0's address, one worker per host
(:mod:`plait.elastic.worker`). No supervisor of plait's own: when a host dies, the
survivors' workers see their peer's sockets close and fail, their agents restart them
(``--max-restarts``), the rendezvous drops the dead host once its heartbeats stop
(``keep_alive_interval`` × ``keep_alive_max_attempt``) and closes with the hosts that
are left, and the new workers load the last checkpoint under the new world's plan.

Fault injection: when rank 0's log shows step ``kill_at``, every process of host
``kill_host`` (its agent and its worker; with namespaces, everything in its namespace)
gets SIGKILL. That host's worker waits for it after step ``kill_at``, before that step's
checkpoint (``HOLD_ENV``), so the kill lands there however fast the machine runs: no rank
can finish the next step or publish that checkpoint without it (before, the kill landed
when the launcher's 0.05 s poll saw the step, a step or more later on a loaded machine, and
a fast one could finish first). Host 0 holds the rendezvous store (c10d has no
fail-over), so it is not the one to kill. Everything is stopped and removed on success,
failure, Ctrl-C, SIGTERM and at the deadline.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..runtime.cluster import EmulatedCluster, Host
from ..runtime.leftovers import ELASTIC_DIR_PREFIX, remove_leftovers
from .config import ElasticConfig
from .report import read_incarnations, summarize
from .worker import HOLD_ENV

__all__ = ["ElasticConfig", "run_elastic", "run_reference", "RDZV_PORT", "TMP_PREFIX"]

log = logging.getLogger("plait.elastic")

RDZV_PORT = 29400  # on host 0's address; loopback: a free port is taken instead
TMP_PREFIX = ELASTIC_DIR_PREFIX
# the rendezvous: a dead host's heartbeats are missed for 1 s × 3 before it is dropped, and
# a round closes 1 s after it has its minimum of hosts (torch's defaults: 5 s × 3 and 30 s)
RDZV_CONF = ("join_timeout=120,last_call_timeout=1,close_timeout=10,"
             "keep_alive_interval=1,keep_alive_max_attempt=3")


# An agent dies with the launcher's thread that started it, however the launcher ends
# (SIGKILL included: a killed `plait elastic` left its agents and workers training on): the
# first process asks for SIGKILL at its parent's death (PR_SET_PDEATHSIG, kept across exec),
# gives up if the launcher is already gone, then becomes torchrun. Each worker in turn ends
# with its agent (plait.elastic.worker). Not a preexec_fn: the launcher may have threads.
_DIE_WITH_LAUNCHER = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); "
                      "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
                      "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def _agent_command(cfg: ElasticConfig, host: Host, rdzv: str, run_id: str,
                   root: Path) -> list[str]:
    conf = f"is_host={'true' if host.index == 0 else 'false'},{RDZV_CONF}"
    command = [sys.executable, "-c", _DIE_WITH_LAUNCHER, str(os.getpid()),
               "-m", "torch.distributed.run",
               "--nnodes", f"{cfg.nnodes_min}:{cfg.hosts}", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", run_id,
               "--rdzv-conf", conf, "--max-restarts", str(cfg.max_restarts),
               "--monitor-interval", "0.2", "--local-addr", host.addr,
               "-m", "plait.elastic.worker", *cfg.worker_args(root)]
    return (["ip", "netns", "exec", host.netns] if host.netns else []) + command


def _env(host: Host, cfg: ElasticConfig, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    # torchrun's agent makes a torchelastic_* log folder in the temporary directory and
    # leaves it (measured: 141 left in /tmp by test runs); inside the run's own folder it
    # goes with the run
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    env.update(GLOO_SOCKET_IFNAME=host.ifname, PLAIT_TIMEOUT_S=f"{cfg.timeout_s:g}",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               LOGLEVEL=os.environ.get("PLAIT_ELASTIC_LOGLEVEL", "WARNING"))
    # torch's agents share one TCP store for the workers across rounds while node rank 0 stays,
    # and a restart after a membership change keeps the restart count (the workers' key prefix):
    # the next round's gloo then reads the last round's addresses ("Connection refused", about
    # 20 s a failed round here). A fresh store per round, on rank 0's worker, has no stale keys.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.pop("PLAIT_DEADLINE_S", None)
    if host.index == cfg.kill_host:
        env[HOLD_ENV] = str(cfg.kill_at)
    return env


def _children(pid: int) -> list[int]:
    """``pid``'s descendants (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _netns_pids(netns: str | None) -> list[int]:
    if netns is None:
        return []
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_host(agent: subprocess.Popen, host: Host) -> list[int]:
    """SIGKILL everything of a host: its agent, the agent's descendants, its namespace's pids."""
    pids = sorted({agent.pid, *_children(agent.pid), *_netns_pids(host.netns)})
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=10)
    return pids


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_elastic(cfg: ElasticConfig, *, on_event: Callable[[str, dict], None] | None = None,
                keep: str | os.PathLike | None = None) -> dict:
    """Run ``cfg`` on an emulated cluster (loopback where namespaces cannot be made) and
    return :func:`~plait.elastic.report.summarize`'s figures plus ``where``, ``kill_time``,
    ``killed_pids``, ``wall_s``. ``on_event(kind, record)``: ``"step"`` records, ``"kill"``.
    ``keep``: copy the logs there (the run's own folder is always removed)."""
    notify = on_event or (lambda kind, record: None)
    remove_leftovers()  # what SIGKILLed runs left: their folders, namespaces, processes
    work = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
    agents: list[tuple[subprocess.Popen, Host]] = []
    start = time.time()
    try:
        with EmulatedCluster(hosts=cfg.hosts, link=cfg.link) as cluster:
            port = RDZV_PORT if cluster.emulated else _free_port()
            rdzv = f"{cluster.hosts[0].addr}:{port}"
            run_id = f"plait-{os.getpid()}-{int(start)}"
            for host in cluster.hosts:
                out = open(work / f"agent-{host.index}.log", "w")
                agents.append((subprocess.Popen(
                    _agent_command(cfg, host, rdzv, run_id, work), env=_env(host, cfg, work),
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True), host))
                out.close()
            watched = _watch(cfg, agents, work, start, notify)
            return {**summarize(read_incarnations(work / "logs"), watched.get("kill_time")),
                    **watched, "where": cluster.describe(), "wall_s": time.time() - start}
    finally:
        _stop(agents)
        if keep is not None:
            Path(keep).mkdir(parents=True, exist_ok=True)
            for path in [*work.glob("agent-*.log"), *work.glob("logs/*.jsonl")]:
                shutil.copy(path, Path(keep))
        shutil.rmtree(work, ignore_errors=True)


def _watch(cfg: ElasticConfig, agents: list, work: Path, start: float,
           notify: Callable[[str, dict], None]) -> dict:
    """Follow rank 0's logs until every live agent has exited; kill the host on cue."""
    seen, killed = 0, {}
    while True:
        if time.time() - start > cfg.deadline_s:
            raise RuntimeError(f"elastic run passed its {cfg.deadline_s:g} s deadline at step "
                               f"{seen}; every agent was stopped{_agent_tail(work)}")
        steps = [r for recs in read_incarnations(work / "logs") for r in recs
                 if r.get("event") == "step"]
        for record in steps:
            if record["time"] > killed.get("kill_time", 0) and record["step"] > seen:
                seen = record["step"]
                notify("step", record)
        if cfg.kill_host is not None and not killed and seen >= cfg.kill_at:
            agent, host = agents[cfg.kill_host]
            kill_time = time.time()
            pids = _kill_host(agent, host)
            killed = {"kill_time": kill_time, "killed_pids": pids, "killed_host": host.index}
            notify("kill", {"host": host.index, "step": seen, "pids": pids})
            seen = 0  # what the survivors log from here on is news, from their first step
        live = [(a, h) for a, h in agents if h.index != killed.get("killed_host")]
        codes = [a.poll() for a, _ in live]
        if all(code is not None for code in codes):
            failed = [(h.index, c) for (_, h), c in zip(live, codes) if c != 0]
            if failed:
                raise RuntimeError(f"elastic run failed: agent of host {failed[0][0]} exited "
                                   f"with status {failed[0][1]}{_agent_tail(work)}")
            return killed
        time.sleep(0.05)


def _agent_tail(work: Path, lines: int = 6) -> str:
    tails = []
    for path in sorted(work.glob("agent-*.log")):
        text = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        if text:
            tails.append(f"{path.name}: " + " | ".join(text[-lines:]))
    return ("; " + "; ".join(tails)) if tails else ""


def _stop(agents: list) -> None:
    """SIGTERM every agent's process tree, then SIGKILL what is left after 5 s."""
    trees = {}
    for agent, host in agents:
        if agent.poll() is None or _children(agent.pid):
            trees[agent.pid] = [agent.pid, *_children(agent.pid), *_netns_pids(host.netns)]
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for pids in trees.values() for p in pids if _alive(p)]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.time() + wait_s
        while time.time() < end and any(_alive(p) for p in alive):
            for agent, _ in agents:
                agent.poll()  # reap
            time.sleep(0.05)
    for agent, _ in agents:
        if agent.poll() is None:
            agent.wait(timeout=5)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def run_reference(cfg: ElasticConfig) -> dict:
    """The uninterrupted run in one process (the plain model, no torchrun): its figures."""
    work = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-ref-"))
    try:
        proc = subprocess.run([sys.executable, "-m", "plait.elastic.worker",
                               *cfg.worker_args(work)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=cfg.deadline_s)
        if proc.returncode != 0:
            raise RuntimeError(f"reference run failed: {proc.stderr.strip().splitlines()[-1:]}")
        return summarize(read_incarnations(work / "logs"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
