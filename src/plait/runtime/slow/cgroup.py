"""Slow hosts made by the kernel: a CPU budget per emulated host (cgroup ``cpu`` controller).

A host's budget is a number of cores (``0.5``: half of one core, ``2``: two
cores). Its ranks, and every process they start, run in a cgroup of its own
whose CFS bandwidth quota is ``budget × period`` in every ``period`` (10 ms,
so a throttled rank waits at most a few milliseconds at a time, not the
default 100 ms). A host at 0.5 is then slower at everything it computes —
GEMMs, gloo's copies and reductions, Python — not only where a straggler
emulation sleeps. The budget is a cap, not a reservation: other load on the
machine can still take cores from a host below its budget.

cgroup v1 (a hierarchy with the ``cpu`` controller: ``cpu.cfs_quota_us``,
``cpu.cfs_period_us``) and v2 (``cpu.max``) are both handled; v1 is used
where the ``cpu`` controller is bound to a v1 hierarchy (it then cannot be
on v2). Needs root. The groups are named like the namespaces,
``plait-<pid>x<hex>-h<i>`` under the controller's mount, so the next run (or
``plait cluster clean``) removes what a killed run left (runtime.leftovers).
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Sequence

__all__ = ["CpuController", "find_cpu_controller", "cpu_controller", "cpu_support",
           "parse_budgets", "parse_host_cpu", "quota_for", "make_cgroup", "join_cgroup",
           "cgroup_pids", "remove_cgroup", "plait_cgroups", "NoisyNeighbour",
           "set_cpu_budget", "cpu_budget", "cpu_throttled", "thread_sched", "CPU_PERIOD_US",
           "MIN_BUDGET"]

CPU_PERIOD_US = 10_000  # 10 ms: throttling in short slices (the kernel's default is 100 ms)
MIN_BUDGET = 0.01       # cores; v1 needs a quota of at least 1 ms, so 0.01 takes a 100 ms period
CGROUP_PREFIX = "plait-"


@dataclass(frozen=True)
class CpuController:
    """Where the ``cpu`` controller is: its hierarchy's version (1 or 2) and mount point."""

    version: int
    root: str


def _unescape(path: str) -> str:
    """mountinfo writes a space as \\040 (and tab, newline, backslash alike)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def find_cpu_controller(mountinfo: str) -> CpuController | None:
    """The ``cpu`` controller's hierarchy, from the text of ``/proc/self/mountinfo``: the v1
    hierarchy that has it (``cpu`` or ``cpu,cpuacct``) when there is one, else a v2 mount."""
    v2 = None
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype, superopts = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "cpu" in superopts:
            return CpuController(1, _unescape(fields[4]))
        if fstype == "cgroup2" and v2 is None:
            v2 = CpuController(2, _unescape(fields[4]))
    return v2


def cpu_controller() -> CpuController | None:
    """This machine's ``cpu`` controller, or None where there is none (not Linux)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return find_cpu_controller(f.read())
    except OSError:
        return None


def cpu_support(controller: CpuController | None) -> str | None:
    """None when hosts can get a CPU budget under ``controller``, else the reason they cannot."""
    if controller is None:
        return "no cgroup hierarchy with the cpu controller is mounted"
    if os.geteuid() != 0:
        return "a CPU budget (cgroup cpu controller) needs root"
    if not os.access(controller.root, os.W_OK):
        return f"{controller.root} is not writable (mounted read-only?)"
    if controller.version == 2:
        try:
            with open(os.path.join(controller.root, "cgroup.controllers")) as f:
                if "cpu" not in f.read().split():
                    return (f"the cgroup v2 hierarchy at {controller.root} has no cpu controller "
                            "(bound to a v1 hierarchy, or not delegated here)")
        except OSError as exc:
            return f"cannot read {controller.root}/cgroup.controllers: {exc.strerror}"
    return None


def parse_host_cpu(text: str) -> list[float]:
    """``"1,0.5"`` → [1.0, 0.5]; ``"0.5"`` → [0.5] (every host). Numbers only; see
    :func:`parse_budgets` for the bounds."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not cores per host: write e.g. 1,0.5 "
                         "(or one number for every host)") from None
    return values


def parse_budgets(cpu: float | Sequence[float] | None, hosts: int) -> list[float] | None:
    """Every host's budget in cores (one number: the same for each), or None (no budget).

    Refused: a count that is neither 1 nor ``hosts``; a budget that is not finite, not above
    0, under :data:`MIN_BUDGET` or above this machine's cores (it could never be spent).
    """
    if cpu is None:
        return None
    budgets = [cpu] if isinstance(cpu, (int, float)) else list(cpu)
    if len(budgets) == 1:
        budgets = budgets * hosts
    if len(budgets) != hosts:
        raise ValueError(f"{len(budgets)} CPU budgets {budgets} for {hosts} hosts; give one "
                         "per host, or one for every host")
    cores = os.cpu_count() or 1
    for i, b in enumerate(budgets):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ValueError(f"host {i}'s CPU budget {b!r} is not a finite number of cores")
        if b <= 0:
            raise ValueError(f"host {i}'s CPU budget must be above 0 cores, got {b:g}")
        if b < MIN_BUDGET:
            raise ValueError(f"host {i}'s CPU budget {b:g} is under {MIN_BUDGET:g} core")
        if b > cores:
            raise ValueError(f"host {i}'s CPU budget {b:g} is more than this machine's "
                             f"{cores} cores")
    return [float(b) for b in budgets]


def quota_for(cores: float) -> tuple[int, int]:
    """(quota, period) in µs for a budget of ``cores``: a 10 ms period, longer only where
    the quota would fall under the kernel's 1 ms minimum."""
    period = max(CPU_PERIOD_US, math.ceil(1000 / cores))
    return max(1000, round(cores * period)), period


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def make_cgroup(controller: CpuController, name: str, cores: float) -> str:
    """Make ``name`` under the controller's mount with a budget of ``cores``; returns its path.
    On v2 the mount's ``cgroup.subtree_control`` gains ``+cpu`` where it lacks it (left on)."""
    path = os.path.join(controller.root, name)
    quota, period = quota_for(cores)
    if controller.version == 2:
        control = os.path.join(controller.root, "cgroup.subtree_control")
        with open(control) as f:
            enabled = f.read().split()
        if "cpu" not in enabled:
            _write(control, "+cpu")
    os.mkdir(path)
    try:
        if controller.version == 1:
            _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
            _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        else:
            _write(os.path.join(path, "cpu.max"), f"{quota} {period}")
    except BaseException:
        os.rmdir(path)
        raise
    return path


def set_cpu_budget(path: str, cores: float) -> None:
    """Give the cgroup at ``path`` (made by :func:`make_cgroup`) a new budget of ``cores``
    (at least :data:`MIN_BUDGET`), while its processes run: the kernel applies it from its next
    period. Two small writes (v1: period, then quota; v2: ``cpu.max``), so a rank can set its
    own host's budget every step; it needs write access to the files (root)."""
    quota, period = quota_for(max(float(cores), MIN_BUDGET))
    if os.path.exists(os.path.join(path, "cpu.max")):
        _write(os.path.join(path, "cpu.max"), f"{quota} {period}")
    else:
        _write(os.path.join(path, "cpu.cfs_period_us"), str(period))
        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))


def cpu_budget(path: str) -> float | None:
    """The budget the kernel holds the cgroup at ``path`` to, in cores (quota ÷ period, read
    back from its files, v1 or v2); None where it has no limit."""
    v2 = os.path.join(path, "cpu.max")
    if os.path.exists(v2):
        with open(v2) as f:
            quota, period = f.read().split()
        return None if quota == "max" else int(quota) / int(period)
    with open(os.path.join(path, "cpu.cfs_quota_us")) as f:
        quota = int(f.read())
    with open(os.path.join(path, "cpu.cfs_period_us")) as f:
        period = int(f.read())
    return None if quota < 0 else quota / period


def cpu_throttled(path: str) -> int:
    """How many periods the kernel has held the cgroup at ``path`` back so far (``nr_throttled``
    in its ``cpu.stat``, v1 and v2 alike)."""
    with open(os.path.join(path, "cpu.stat")) as f:
        stat = dict(line.split()[:2] for line in f.read().splitlines() if line.strip())
    return int(stat["nr_throttled"])


def thread_sched() -> tuple[float, float]:
    """This thread's CPU seconds and the seconds it waited while runnable, for a core or for
    its cgroup's quota: the kernel's accounting (``/proc/thread-self/schedstat``)."""
    with open("/proc/thread-self/schedstat") as f:
        cpu, waited, _ = f.read().split()
    return int(cpu) / 1e9, int(waited) / 1e9


def join_cgroup(path: str, pid: int | None = None) -> None:
    """Move process ``pid`` (default: this one, with all its threads) into the cgroup at
    ``path``; what it starts afterwards is born there."""
    _write(os.path.join(path, "cgroup.procs"), str(pid or os.getpid()))


def cgroup_pids(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f.read().split()]
    except FileNotFoundError:
        return []


def remove_cgroup(path: str, wait_s: float = 5.0) -> list[int]:
    """Stop what still runs in the cgroup (SIGKILL: the host is switched off) and remove it;
    returns the pids it stopped. Idempotent. Raises OSError if it cannot be removed."""
    killed = []
    end = time.monotonic() + wait_s
    while True:
        for pid in cgroup_pids(path):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(path)
            return sorted(set(killed))
        except FileNotFoundError:
            return sorted(set(killed))
        except OSError:  # EBUSY while a killed process is still leaving
            if time.monotonic() > end:
                raise
            time.sleep(0.02)


def plait_cgroups(controller: CpuController | None) -> list[str]:
    """Names of the cgroups plait made under ``controller`` that still exist."""
    if controller is None:
        return []
    try:
        names = os.listdir(controller.root)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(CGROUP_PREFIX)
                  and os.path.isdir(os.path.join(controller.root, n)))


# The busy loop joins the cgroup itself and asks to die with its starter's thread
# (PR_SET_PDEATHSIG = 1, SIGKILL = 9): a preexec_fn would run in a forked copy of a
# multi-threaded rank (gloo's threads), where a lock another thread held stays held.
_BUSY_LOOP = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(1, 9)
if os.getppid() != int(sys.argv[2]):
    sys.exit(0)
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
while True:
    pass
"""


class NoisyNeighbour:
    """``processes`` CPU-bound processes (a Python busy loop each) in a host's cgroup: they
    take that host's cores from its ranks, as another tenant's job would.

    ``start()`` returns once every loop runs inside the cgroup; ``pause()`` and ``resume()``
    hold and release them (``bench hetero`` runs one only during its own run's steps);
    ``stop()`` may come at any time (``with`` for start and stop). Stopped at interpreter exit, and killed with the thread that
    started them (PR_SET_PDEATHSIG), so a SIGKILLed starter leaves none running; removing
    the cgroup (the cluster's ``down()``) stops any that remain.
    """

    def __init__(self, cgroup: str | None, processes: int = 1):
        if not cgroup or not os.path.isdir(cgroup):
            raise ValueError(f"no cgroup at {cgroup!r}: a noisy neighbour needs a host with a "
                             "CPU budget (EmulatedCluster(cpu=...))")
        if processes < 1:
            raise ValueError(f"a noisy neighbour needs at least 1 process, got {processes}")
        self.cgroup = cgroup
        self.processes = processes
        self._procs: list[subprocess.Popen] = []

    @property
    def running(self) -> bool:
        return any(p.poll() is None for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.poll() is None]

    def start(self) -> "NoisyNeighbour":
        import atexit

        if self._procs:
            return self
        atexit.register(self.stop)
        try:
            for _ in range(self.processes):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-S", "-c", _BUSY_LOOP, self.cgroup, str(os.getpid())],
                    stdin=subprocess.DEVNULL))
            self._wait_inside(10.0)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_inside(self, limit_s: float) -> None:
        end = time.monotonic() + limit_s
        while not set(p.pid for p in self._procs) <= set(cgroup_pids(self.cgroup)):
            if any(p.poll() is not None for p in self._procs):
                raise RuntimeError(f"a noisy neighbour for {self.cgroup} ended as it started")
            if time.monotonic() > end:
                raise RuntimeError(f"a noisy neighbour did not join {self.cgroup} within "
                                   f"{limit_s:g} s")
            time.sleep(0.01)

    def pause(self) -> None:
        """Hold the busy loops where they are (SIGSTOP); returns once each is stopped, so they
        take nothing from what runs next. ``resume()`` lets them run on."""
        self._signal(signal.SIGSTOP)
        end = time.monotonic() + 1.0
        while any(_proc_stat(pid)[0] not in ("T", "t", "Z", "X", "") for pid in self.pids):
            if time.monotonic() > end:
                raise RuntimeError(f"a noisy neighbour in {self.cgroup} did not stop within 1 s")
            time.sleep(0.0005)

    def resume(self) -> None:
        """Let paused busy loops run again (SIGCONT)."""
        self._signal(signal.SIGCONT)

    def cpu_s(self) -> float:
        """The CPU seconds the busy loops have used so far (user + system, the kernel's)."""
        return sum(_proc_stat(pid)[1] for pid in self.pids)

    def _signal(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Kill the busy loops (paused or not) and wait for them. Idempotent."""
        import atexit

        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._procs = []
        atexit.unregister(self.stop)

    def __enter__(self) -> "NoisyNeighbour":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _proc_stat(pid: int) -> tuple[str, float]:
    """A process's state letter and CPU seconds (utime + stime) from ``/proc/PID/stat``;
    ("", 0.0) for one that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return "", 0.0
    return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
