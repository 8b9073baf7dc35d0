"""What a plait process that died without cleaning up (SIGKILL, OOM) left behind, found and removed.

Everything plait makes on the machine carries its maker's pid in its name:
network namespaces ``plait-<pid>x<hex>-h0`` (and their bridge and veths, which go
with them), the hosts' CPU-budget cgroups of the same names (runtime.slow.cgroup; what
still runs in one is stopped, as the host it emulated is gone) and launch folders
``plait-launch-<pid>-…`` and ``plait-elastic-<pid>-…`` in the temporary directory; what
still runs in a namespace whose maker is gone is stopped first. When the next run starts it
removes those whose maker is no longer running, and says so. Anything whose maker
still runs is left alone (another plait run on the same machine), and so is anything
named otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile

from .slow.cgroup import cpu_controller, plait_cgroups, remove_cgroup

__all__ = ["ELASTIC_DIR_PREFIX", "LAUNCH_DIR_PREFIX", "owner_alive", "remove_leftovers"]

log = logging.getLogger("plait.runtime")

NETNS_OWNED = re.compile(r"^plait-(\d+)x[0-9a-f]+-")
LAUNCH_DIR_PREFIX = "plait-launch-"  # + the launcher's pid + "-" (runtime.launch makes them)
ELASTIC_DIR_PREFIX = "plait-elastic-"  # + the launcher's pid + "-" (plait.elastic makes them)
LAUNCH_DIR_OWNED = re.compile(rf"^(?:{LAUNCH_DIR_PREFIX}|{ELASTIC_DIR_PREFIX})(\d+)-")


def owner_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts: it is not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _dead_owner(name: str, pattern: re.Pattern) -> int | None:
    match = pattern.match(name)
    if match is None:
        return None
    pid = int(match.group(1))
    return None if owner_alive(pid) else pid


def _stale_namespaces() -> list[str]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if _dead_owner(n, NETNS_OWNED) is not None]


def _stale_cgroups() -> list[str]:
    controller = cpu_controller()
    if controller is None or os.geteuid() != 0:
        return []
    return [os.path.join(controller.root, n) for n in plait_cgroups(controller)
            if _dead_owner(n, NETNS_OWNED) is not None]


def _stale_launch_dirs() -> list[str]:
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [os.path.join(root, n) for n in names if _dead_owner(n, LAUNCH_DIR_OWNED) is not None]


def _stop_inside(netns: str) -> list[int]:
    """SIGKILL every process in ``netns``; the pids it stopped."""
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
    stopped = []
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
            stopped.append(pid)
        except ProcessLookupError:
            pass
    return stopped


def remove_leftovers() -> list[str]:
    """Remove the namespaces and launch folders of plait processes that are gone; returns
    what was removed, and logs one line when anything was."""
    removed = []
    for name in _stale_namespaces():
        stopped = _stop_inside(name)  # a host that is gone runs nothing (an orphaned rank)
        if stopped:
            log.warning("plait: stopped pids %s, still running in network namespace %s",
                        stopped, name)
        if subprocess.run(["ip", "netns", "del", name], capture_output=True).returncode == 0:
            removed.append(f"network namespace {name}")
    for path in _stale_cgroups():
        try:
            stopped = remove_cgroup(path)
        except OSError as exc:
            log.warning("plait: could not remove cgroup %s: %s", path, exc)
            continue
        removed.append(f"cgroup {path}")
        if stopped:
            log.warning("plait: stopped pids %s, still running in %s", stopped, path)
    for path in _stale_launch_dirs():
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(f"folder {path}")
    if removed:
        pids = sorted({int(m.group(1)) for r in removed
                       for m in [re.search(r"plait-(?:launch-|elastic-)?(\d+)", r)] if m})
        log.warning("plait: removed what an earlier plait run (pid %s, no longer running) "
                    "left behind: %s", ", ".join(map(str, pids)), ", ".join(removed))
    return removed
