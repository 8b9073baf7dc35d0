"""Communication threads ahead of compute: the CPU counterpart of a high-priority comm stream.

On a GPU a piece's collective runs on its own stream and engines, so it never
waits for the GEMM that follows it. On a CPU rank gloo moves data on threads of
its own (``gloo_tcp_loop`` for the sockets, ``pt_gloo_runloop`` for the
collective's steps and reductions), and they share the cores with the compute
thread: under the ordinary scheduler a woken comm thread can wait for a core a
GEMM holds, and the wire idles meanwhile.

``PLAIT_COMM_PRIORITY`` says what plait does about it:

- ``auto`` (the default): ``nice`` where this machine runs no more ranks than
  this process may use cores (PLAIT_RANKS_ON_MACHINE or torchrun's LOCAL_WORLD_SIZE,
  against the CPU affinity),
  ``off`` where ranks outnumber cores. There a spinning comm thread takes the
  core from a peer's compute that it is waiting for: 3 ranks on 2 cores, 3000
  fused all-reduces of a 64×64 product, took 74 s at nice -10 and 49 s off.
- ``nice``: the comm threads get nice -10 (``nice:N`` picks N, -20 to 19). The
  fair scheduler still gives every thread its share by weight, so nothing can
  be starved: a comm thread that spins only takes more of the core it shares
  (about 9 parts in 10 against one nice-0 thread at -10).
- ``rt``: ``SCHED_FIFO`` priority 1, the old default. It can starve: gloo's
  socket thread does spin (``Pair::handleEvents`` busy-polls, 100 % system time
  while a transfer waits), and with more ranks than cores a rank at real-time
  priority spinning for a peer that cannot get a core hung a 3-rank run on 2
  cores until killed, and starved every other program on the machine; with as
  many ranks as cores (2 on 2) two spinning ``SCHED_FIFO`` threads held both
  cores until real-time throttling stopped them, ~1 s stalls (docs/link.md). So
  ``rt`` is refused (``auto``'s choice is used, said once) unless ranks leave a
  core free, and a watchdog outside the ranks (runtime.watchdog) ends a run that stops.
- ``off``: every thread keeps the priority it has.

Raising a priority needs CAP_SYS_NICE (root); without it nothing changes and
:func:`raise_comm_threads` says so once. What each setting costs or gains in
``plait bench ops`` is measured in docs/cluster.md.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["COMM_THREAD_PREFIXES", "comm_threads", "comm_priority", "raise_comm_threads",
           "prioritize_group"]

log = logging.getLogger("plait.runtime")

COMM_THREAD_PREFIXES = ("gloo", "pt_gloo")
"""Names (``/proc/self/task/*/comm``) of the threads gloo moves and reduces data on."""

DEFAULT_NICE = -10
_RT_PRIORITY = 1  # the lowest real-time level: above every ordinary thread, below the kernel's
_said: set[str] = set()


def comm_threads() -> list[int]:
    """Thread ids of this process's communication threads (empty where /proc is absent)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(COMM_THREAD_PREFIXES):
            found.append(int(tid))
    return sorted(found)


def comm_priority(setting: str | None = None) -> tuple[str, int]:
    """``("off", 0)``, ``("nice", N)`` or ``("rt", 1)`` from ``setting`` (default
    PLAIT_COMM_PRIORITY, else ``auto``); ``auto`` is ``off`` where ranks outnumber cores,
    and ``rt`` is refused (``auto``'s choice instead) unless a core is left over."""
    text = (setting if setting is not None
            else os.environ.get("PLAIT_COMM_PRIORITY", "auto")).strip().lower()
    if text in ("off", "0", "no", "false", "none"):
        return "off", 0
    if text in ("auto", "rt"):
        ranks, cores = _local_ranks(), _usable_cores()
        fallback = ("nice", DEFAULT_NICE) if ranks <= cores else ("off", 0)  # auto's
        if text == "auto":
            return fallback
        if ranks < cores:  # a core left over: spinning real-time threads cannot hold them all
            return "rt", _RT_PRIORITY
        _say_once("rt-refused", f"PLAIT_COMM_PRIORITY=rt refused: {ranks} ranks on {cores} "
                                "cores could starve the machine (real-time comm threads that "
                                "spin hold every core until throttled, ~1 s: docs/link.md); "
                                f"comm threads get {'nice' if fallback[0] == 'nice' else 'no'} "
                                "priority instead", logging.WARNING)
        return fallback
    if text == "nice":
        return "nice", DEFAULT_NICE
    if text.startswith("nice:"):
        try:
            value = int(text[5:])
        except ValueError:
            value = None
        if value is not None and -20 <= value <= 19:
            return "nice", value
    raise ValueError(f"PLAIT_COMM_PRIORITY={text!r}: write auto, off, nice, nice:N (-20..19) "
                     "or rt")


def raise_comm_threads(setting: str | None = None) -> int:
    """Put every communication thread at the priority ``comm_priority`` gives; returns how many
    are there. Idempotent and cheap (a look at /proc/self/task): called after a group is made,
    since each gloo group starts threads of its own. Does nothing with ``off``, where there
    is no /proc (no Linux threads to find), or without the permission, which it logs once."""
    mode, level = comm_priority(setting)
    if mode == "off":
        return 0
    done = 0
    for tid in comm_threads():
        try:
            if mode == "rt":
                if os.sched_getscheduler(tid) != os.SCHED_FIFO:
                    os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(level))
            elif os.getpriority(os.PRIO_PROCESS, tid) != level:
                os.setpriority(os.PRIO_PROCESS, tid, level)  # a thread id: Linux nices threads
            done += 1
        except PermissionError:
            _say_once("eperm", f"comm threads keep their priority: {mode} {level} needs "
                               "CAP_SYS_NICE (root); transfers may wait behind compute for a core")
            return done
        except (ProcessLookupError, OSError):  # the thread ended meanwhile
            continue
    return done


def prioritize_group(group=None) -> int:
    """Raise the threads of a gloo ``group`` just made (None: the default group).

    Collective: every rank of the group calls it. A thread names itself once it runs,
    so a barrier first makes sure the group's threads have started and carry
    gloo's names; a no-op for other backends (NCCL moves data on the GPU).
    """
    import torch.distributed as dist

    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) == 1:
        return 0
    dist.barrier(group=group)
    # a work thread may not have named itself yet even after the barrier (seen once in ~10
    # launches): look again until no new comm thread shows up, a few ms at most
    raised, seen = raise_comm_threads(), len(comm_threads())
    for _ in range(5):
        time.sleep(0.002)
        if len(comm_threads()) == seen:
            break
        raised, seen = raise_comm_threads(), len(comm_threads())
    return raised


def _local_ranks() -> int:
    """Ranks sharing this machine's cores: PLAIT_RANKS_ON_MACHINE (launch and ``plait cluster
    run`` set it: emulated hosts share the cores), else torchrun's LOCAL_WORLD_SIZE, else 1."""
    for name in ("PLAIT_RANKS_ON_MACHINE", "LOCAL_WORLD_SIZE"):
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    return 1


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _say_once(key: str, message: str, level: int = logging.INFO) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, "plait: %s", message)
