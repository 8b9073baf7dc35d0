"""An emulated cluster on one machine: Linux network namespaces and rate-limited links.

Each host is a network namespace with one interface (``eth0``) on a private
bridge that lives in a "switch" namespace of its own, so nothing in the
machine's root namespace is touched. Both directions of every host's link are
shaped by a token-bucket filter (``tc qdisc … tbf``), so a host has ``rate``
up and ``rate`` down, like a NIC on a non-blocking switch. Communication then
costs wall time the way a real link does, instead of competing for the same
CPU as compute (what loopback does).

Without root or without iproute2 the cluster falls back to loopback and says
so in one line; ``EmulatedCluster.emulated`` tells which one you got.

``cpu=`` gives each host a CPU budget in cores (``[1, 0.5]``: host 1 has half
a core), enforced by the kernel's cgroup ``cpu`` controller on the host's
ranks and everything they start (:mod:`plait.runtime.slow.cgroup`). None, the
default, throttles nothing. A budget that cannot be enforced is an error,
not a fallback: a benchmark that asked for a slow host must get one.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, replace
from typing import Sequence

from .slow.cgroup import (CpuController, NoisyNeighbour, cpu_controller, cpu_support, make_cgroup,
                     parse_budgets, quota_for, remove_cgroup)
from .leftovers import remove_leftovers

__all__ = [
    "EmulatedCluster",
    "Host",
    "parse_rate",
    "format_rate",
    "max_hosts",
    "cluster_support",
    "remove_stale_namespaces",
]

log = logging.getLogger("plait.runtime")

NETNS_PREFIX = "plait-"
SUBNET = "10.213.0"  # private /24, only inside namespaces this module creates
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)bit\s*$", re.IGNORECASE)


def parse_rate(text: str | None) -> float | None:
    """``"1gbit"`` → 1e9 bits/s; ``None``, ``""`` or ``"loopback"`` → None (unshaped)."""
    if text is None or text.strip().lower() in ("", "loopback", "none", "unlimited"):
        return None
    match = _RATE_RE.match(text)
    if not match:
        raise ValueError(
            f"unknown link rate {text!r}; write a number and a tc bit unit, "
            "e.g. 100mbit, 1gbit, 2.5gbit, 10gbit (or 'loopback' for no shaping)"
        )
    bits = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if bits < 1e5:
        raise ValueError(f"link rate {text!r} is below 100kbit; too slow to be useful")
    return bits


def format_rate(bits_per_s: float | None) -> str:
    """Inverse of :func:`parse_rate`, in tc's notation (``1e9`` → ``"1gbit"``)."""
    if bits_per_s is None:
        return "loopback"
    for unit, scale in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:g}{unit}"
    return f"{bits_per_s:g}bit"


def max_hosts() -> int:
    """The most hosts this machine can make: each host runs at least one rank
    process, so beyond 16 per core the emulation measures the scheduler, not
    the links; and one /24 holds at most 250 addresses."""
    return min(250, 16 * (os.cpu_count() or 1))


def cluster_support() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "this OS has no Linux network namespaces"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or accept loopback)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


@dataclass(frozen=True)
class Host:
    """One emulated host: where its ranks run and which interface gloo binds."""

    index: int
    netns: str | None  # None: the machine's own namespace (loopback)
    ifname: str
    addr: str
    cgroup: str | None = None  # its CPU budget's cgroup (its ranks join it); None: no budget


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"emulated cluster: `{' '.join(cmd)}` failed: {proc.stderr.strip()}")


def _netns_names() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def remove_stale_namespaces(tag: str | None = None) -> list[str]:
    """Delete namespaces this module made (all of them, or one cluster's); returns their names."""
    prefix = NETNS_PREFIX + (f"{tag}-" if tag else "")
    removed = [name for name in _netns_names() if name.startswith(prefix)]
    for name in removed:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return removed


def _tbf(netns: str, dev: str, bits_per_s: float) -> None:
    # burst: 1 ms at line rate, never below 64 KiB (one GSO segment must fit the
    # bucket). Measured here at 1gbit: a 0.2 ms bucket starves on timer wake-ups
    # (one-way TCP at 70 % of rate), 1 ms reaches ~90-95 %. The cost: a message
    # under ~1 ms of line rate passes as one burst, faster than the link.
    # latency (queue depth) 20 ms: deep enough for line rate, shallow enough
    # that the reverse direction's ACKs are not stuck behind 100 ms of data.
    burst = max(int(bits_per_s / 8 * 0.001), 64 * 1024)
    _run("ip", "netns", "exec", netns, "tc", "qdisc", "replace", "dev", dev, "root",
         "tbf", "rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "20ms")


class EmulatedCluster:
    """``hosts`` namespaces joined by links of ``link`` (e.g. ``"1gbit"``).

    Use as a context manager; tear-down always runs (on error, Ctrl-C and at
    interpreter exit). ``up()`` is idempotent: it first removes whatever a
    crashed run of the same ``tag`` left behind.

    >>> with EmulatedCluster(hosts=2, link="1gbit") as cluster:
    ...     launch(fn, world_size=2, cluster=cluster)
    """

    def __init__(self, *, hosts: int, link: str | None = "1gbit", tag: str | None = None,
                 require: bool = False, cpu: float | Sequence[float] | None = None):
        if not isinstance(hosts, int) or hosts < 1:
            raise ValueError(f"hosts must be a positive integer, got {hosts!r}")
        if hosts > max_hosts():
            raise ValueError(
                f"{hosts} hosts is more than this machine can make: at most {max_hosts()} "
                f"({os.cpu_count()} cores × 16 rank processes, capped at one /24)"
            )
        self.n_hosts = hosts
        self.link = link
        self.bits_per_s = parse_rate(link)
        # the maker's pid in every name: the next run removes what a dead one left (leftovers)
        self.tag = tag or f"{os.getpid()}x{uuid.uuid4().hex[:4]}"
        self.require = require
        self.cpu = parse_budgets(cpu, hosts)  # cores per host, or None: no budget
        self.hosts: list[Host] = []
        self.fallback_reason: str | None = None
        self._made: list[str] = []
        self._cgroups: list[str] = []
        self._controller: CpuController | None = None
        self._sigterm_unwinds = False  # our handler is installed (see _unwind_on_sigterm)

    @property
    def emulated(self) -> bool:
        return bool(self._made)

    @property
    def link_label(self) -> str:
        return format_rate(self.bits_per_s) if self.emulated else "loopback"

    def describe(self) -> str:
        budget = ""
        if self.cpu:
            version = self._controller.version if self._controller else "?"
            budget = (f"; CPU budget {', '.join(f'{b:g}' for b in self.cpu)} cores per host "
                      f"(cgroup v{version} cpu quota, {self._period_ms()} ms period)")
        if self.emulated:
            return (f"emulated cluster: {self.n_hosts} hosts in network namespaces, "
                    f"links {format_rate(self.bits_per_s)} each way (tbf){budget}")
        return f"loopback (no emulated cluster: {self.fallback_reason}){budget}"

    def _period_ms(self) -> str:
        periods = sorted({quota_for(b)[1] / 1000 for b in self.cpu or ()})
        return "/".join(f"{p:g}" for p in periods)

    def up(self) -> "EmulatedCluster":
        if self.hosts:
            return self
        if self.cpu:
            self._controller = cpu_controller()
            why_not = cpu_support(self._controller)
            if why_not is not None:
                raise RuntimeError(f"cannot give hosts a CPU budget: {why_not}")
        reason = cluster_support()
        if reason is None and self.bits_per_s is None:
            reason = "no link rate given"
        if reason is not None:
            if self.require:
                raise RuntimeError(f"cannot make an emulated cluster: {reason}")
            self.fallback_reason = reason
            log.warning("plait: falling back to loopback: %s", reason)
            if not self.cpu:
                self.hosts = [Host(i, None, "lo", "127.0.0.1") for i in range(self.n_hosts)]
                return self
        atexit.register(self.down)
        self._unwind_on_sigterm()
        try:
            remove_leftovers()
            if reason is None:
                self._build()
            else:
                self.hosts = [Host(i, None, "lo", "127.0.0.1") for i in range(self.n_hosts)]
            if self.cpu:
                self._budget()
        except BaseException:
            self.down()
            raise
        return self

    def _budget(self) -> None:
        """One cgroup per host with its CPU budget; the hosts learn where it is."""
        assert self._controller is not None and self.cpu is not None
        for host, cores in zip(list(self.hosts), self.cpu):
            name = f"{NETNS_PREFIX}{self.tag}-h{host.index}"
            stale = os.path.join(self._controller.root, name)
            if os.path.isdir(stale):  # a crashed run of the same tag
                remove_cgroup(stale)
            self._cgroups.append(make_cgroup(self._controller, name, cores))
            self.hosts[host.index] = replace(host, cgroup=self._cgroups[-1])

    def noisy_neighbour(self, host: int, processes: int = 1) -> NoisyNeighbour:
        """A CPU-bound neighbour on ``host`` (inside its CPU budget), not yet started: call
        ``start()`` partway through a run, ``stop()`` (or leave it to ``down()``) after."""
        if not 0 <= host < len(self.hosts):
            raise ValueError(f"no host {host}: the cluster has {len(self.hosts)} (is it up?)")
        return NoisyNeighbour(self.hosts[host].cgroup, processes)

    def _build(self) -> None:
        remove_stale_namespaces(self.tag)
        switch = f"{NETNS_PREFIX}{self.tag}-sw"
        _run("ip", "netns", "add", switch)
        self._made.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i in range(self.n_hosts):
            ns = f"{NETNS_PREFIX}{self.tag}-h{i}"
            port = f"p{i}"
            addr = f"{SUBNET}.{i + 1}"
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth",
                 "peer", "name", port, "netns", switch)
            _run("ip", "-n", switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", switch, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Shaped where it is sent, a host's TCP is held back by its own full queue and
            # loses nothing; the switch ports alone would drop what arrives too fast, silently
            # (at 200mbit, 2 hosts: 3077 drops, up to 1275 segments resent a case; docs/link.md)
            _tbf(ns, "eth0", self.bits_per_s)   # host → switch
            _tbf(switch, port, self.bits_per_s)  # switch → host (what several senders share)
            self.hosts.append(Host(i, ns, "eth0", addr))

    def down(self) -> None:
        """Remove every namespace (and with them every veth, bridge and qdisc) and every CPU
        budget's cgroup (stopping what still runs in it, e.g. a noisy neighbour). Idempotent."""
        for path in reversed(self._cgroups):
            try:
                stopped = remove_cgroup(path)
            except OSError as exc:
                log.warning("plait: could not remove cgroup %s: %s", path, exc)
                continue
            if stopped:
                log.info("plait: stopped pids %s still in %s", stopped, path)
        self._cgroups.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        self.hosts = []
        atexit.unregister(self.down)
        if self._sigterm_unwinds:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what it was before up()
            self._sigterm_unwinds = False

    def _unwind_on_sigterm(self) -> None:
        """While the cluster is up, SIGTERM (``timeout``, ``kill``) exits through Python, so
        ``with`` blocks, ``finally`` and atexit run and remove the namespaces; by default it
        ends the process where it stands and leaves them behind. Only where nobody else
        handles SIGTERM, and only from the main thread (the one signals reach)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._sigterm_unwinds = True
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    def host_of_rank(self, rank: int, world_size: int) -> Host:
        """Ranks are placed on hosts in contiguous blocks, as torchrun places them on nodes."""
        if world_size % self.n_hosts:
            raise ValueError(
                f"world size {world_size} does not divide over {self.n_hosts} hosts; "
                "use a multiple of the host count"
            )
        return self.hosts[rank // (world_size // self.n_hosts)]

    def __enter__(self) -> "EmulatedCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
