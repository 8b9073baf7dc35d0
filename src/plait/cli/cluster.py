"""``plait cluster``: run any torchrun-style script on an emulated cluster, or clean up after one.

``plait cluster run --hosts 2 --link 1gbit -- python train.py`` starts the
command once per rank, inside its host's namespace, with the variables
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
GLOO_SOCKET_IFNAME, so ``plait.runtime.init_from_env()`` (or plain
``init_process_group("gloo")``) just works. When one rank fails the others
are stopped; the namespaces are removed whatever happens.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

from ..runtime import EmulatedCluster
from ..runtime.slow.cgroup import cpu_controller, join_cgroup, plait_cgroups, remove_cgroup
from ..runtime.cluster import NETNS_PREFIX, _netns_names, remove_stale_namespaces
from ..runtime.leftovers import NETNS_OWNED, owner_alive, remove_leftovers
from .common import add_launch_args, port_number, resolve_placement

__all__ = ["register", "run_on_cluster"]


def register(cluster, _rest=None) -> None:
    which = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    run = which.add_parser("run", help="run COMMAND once per rank, each rank in its host's namespace")
    add_launch_args(run, deadline_s=0)  # it runs the user's own command: no deadline unless asked
    run.add_argument("--port", type=port_number, default=29500, help="MASTER_PORT on host 0")
    run.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR[@FROM[-UNTIL]]",
                     help="make a rank FACTOR× slower at compute (read by plait's layers)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS…]")
    run.set_defaults(func=_run)
    status = which.add_parser("status", help="list namespaces and CPU-budget cgroups plait "
                                             "made that still exist")
    status.set_defaults(func=_status)
    clean = which.add_parser("clean", help="remove what plait runs that are gone left behind "
                                           "(namespaces, cgroups, launch folders)")
    clean.add_argument("--all", action="store_true",
                       help="every plait namespace and cgroup, a running plait's too (which "
                            "breaks it)")
    clean.set_defaults(func=_clean)


def _set_pdeathsig() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


class _Subreaper:
    """While entered, this process adopts its descendants' orphans (prctl
    PR_SET_CHILD_SUBREAPER): a rank that exits leaves what it started as our children,
    not init's, so ``stop`` finds and ends them too. The previous setting comes back after."""

    def __enter__(self) -> "_Subreaper":
        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was))
        self._libc, self._was = libc, was.value
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.before = set(_children_of().get(os.getpid(), ()))  # not ours to stop
        return self

    def stop(self, procs: list[subprocess.Popen]) -> None:
        """SIGKILL the ranks, everything they started and every orphan we adopted; reap."""
        tree = _children_of()
        # a rank already reaped (poll) gave its pid back: it may be another process's now
        roots = [p.pid for p in procs if p.poll() is None] + \
            [pid for pid in tree.get(os.getpid(), ()) if pid not in self.before
             and pid not in {p.pid for p in procs}]
        # parents before their children: a shell whose child dies first wakes and prints
        # "Killed" under our one-line message (seen in CI), a killed shell prints nothing
        doomed, seen, at = list(roots), set(roots), 0
        while at < len(doomed):
            children = [c for c in tree.get(doomed[at], ()) if c not in seen]
            doomed.extend(children)
            seen.update(children)
            at += 1
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # gone, or not ours after all
                pass
        for proc in procs:
            proc.wait()
        for pid in seen - {p.pid for p in procs}:
            try:  # an adopted orphan is our child now: reap it
                os.waitpid(pid, 0)
            except ChildProcessError:  # a grandchild still under its own parent
                pass

    def __exit__(self, *exc) -> None:
        self._libc.prctl(PR_SET_CHILD_SUBREAPER, self._was)


def _children_of() -> dict[int, list[int]]:
    """parent pid → its children's pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _rank_setup(cgroup: str | None):
    """preexec_fn of a rank: into its host's CPU budget (if any), and die with the launcher."""
    def setup() -> None:
        if cgroup is not None:
            join_cgroup(cgroup)
        _set_pdeathsig()
    return setup


def run_on_cluster(cmd: list[str], *, ranks: int, hosts: int, link: str | None,
                   port: int = 29500, timeout_s: float | None = None, slow: str = "",
                   deadline_s: float | None = None, host_cpu=None) -> int:
    """Run ``cmd`` on every rank; returns 0, or the first failing rank's exit status in the
    shell's convention (128 + N for a rank ended by signal N; 124 past ``deadline_s``).
    ``host_cpu``: each host's CPU budget in cores (EmulatedCluster's ``cpu``)."""
    if not cmd:
        raise ValueError("no command given; write: plait cluster run --hosts 2 -- python train.py")
    with EmulatedCluster(hosts=max(hosts, 1), link=link, cpu=host_cpu) as cluster, \
            _Subreaper() as reaper:
        print(f"plait: {cluster.describe()}", flush=True)
        procs, where = [], []
        try:
            for rank in range(ranks):
                host = cluster.host_of_rank(rank, ranks)
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks),
                           LOCAL_RANK=str(rank % (ranks // cluster.n_hosts)),
                           LOCAL_WORLD_SIZE=str(ranks // cluster.n_hosts),
                           PLAIT_RANKS_ON_MACHINE=str(ranks),  # every host shares these cores
                           MASTER_ADDR=cluster.hosts[0].addr, MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME=host.ifname, PLAIT_SLOW=slow,
                           PLAIT_LINK=cluster.link_label)
                if timeout_s:
                    env["PLAIT_TIMEOUT_S"] = str(timeout_s)
                prefix = ["ip", "netns", "exec", host.netns] if host.netns else []
                procs.append(subprocess.Popen(prefix + cmd, env=env,
                                              preexec_fn=_rank_setup(host.cgroup)))
                where.append(f"host {host.index} ({host.addr})" if host.netns else "loopback")
            return _wait_all(procs, where, deadline_s)
        finally:
            reaper.stop(procs)  # the ranks and whatever they started, ended or not


def _wait_all(procs: list[subprocess.Popen], where: list[str], deadline_s: float | None) -> int:
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            on = f" on {where[rank]}" if where[rank] != "loopback" else ""
            if code < 0:  # subprocess's way of saying "ended by signal -code"
                what, status = f"was killed by {signal.Signals(-code).name}", 128 - code
            else:
                what, status = f"exited with status {code}", code
            print(f"plait: rank {rank}{on} {what}; the other ranks were stopped", file=sys.stderr)
            return status
        if all(c == 0 for c in codes):
            return 0
        if deadline_s and time.monotonic() - start > deadline_s:
            print(f"plait: the run passed its {deadline_s:g} s deadline (--deadline); every rank "
                  "was stopped", file=sys.stderr)
            return 124
        time.sleep(0.05)


def _run(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return run_on_cluster(cmd, ranks=ranks, hosts=hosts, link=link, port=args.port,
                          timeout_s=args.timeout, slow=",".join(args.slow),
                          deadline_s=args.deadline or None, host_cpu=args.host_cpu_budgets)


def _owner(name: str) -> str:
    match = NETNS_OWNED.match(name)
    if match is None:
        return "maker unknown"
    pid = int(match.group(1))
    return f"made by pid {pid}, " + ("still running" if owner_alive(pid) else "gone")


def _status(args: argparse.Namespace) -> int:
    names = [n for n in _netns_names() if n.startswith(NETNS_PREFIX)]
    print("\n".join(f"{n}  ({_owner(n)})" for n in names) if names else "no plait namespaces")
    controller = cpu_controller()
    groups = plait_cgroups(controller)
    if groups:
        print("\n".join(f"cgroup {controller.root}/{n}  ({_owner(n)})" for n in groups))
    return 0


def _clean(args: argparse.Namespace) -> int:
    """What dead runs left; with --all, every plait namespace (a live run's too: it breaks)."""
    if args.all:
        removed = remove_stale_namespaces()
        controller = cpu_controller()
        for name in plait_cgroups(controller):
            remove_cgroup(f"{controller.root}/{name}")
            removed.append(f"{controller.root}/{name}")
    else:
        removed = [r.removeprefix("network namespace ").split(" ", 1)[-1]
                   for r in remove_leftovers()]
    print(f"removed {len(removed)}" + (f": {', '.join(removed)}" if removed else "")
          + ("" if args.all else " (what plait runs that are gone left; --all also removes "
                                 "a running one's)"))
    return 0
