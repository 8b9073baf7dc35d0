"""Symmetric shared memory for the ranks of one group on one host: every rank maps every
peer's segment, and a flag per slot says a piece has landed.

Each rank of the group makes one POSIX shared-memory segment (a file under ``/dev/shm``)
and maps it with every peer's (``torch.from_file(shared=True)``), so a rank reads and
writes any peer's memory as its own tensors: a piece is computed straight into a peer-
visible slot, and a peer reads it where it lies. Once every rank has mapped every segment
the files are unlinked: the mappings live on, and nothing is left under ``/dev/shm``
however the ranks end (a SIGKILL included). A segment still there from a maker that died
before unlinking is removed at the next set-up on the host (its name holds the maker's
pid), as the emulated cluster removes a dead maker's namespaces.

A segment: a control block of 32-bit flag words (one a 64-byte line, so two ranks never
write one line), then ``BUFFERS`` data buffers used in turn by successive calls. A flag
holds an *epoch* (the group's call count, never reset to 0: a flag from an earlier call
can never be taken for this one's; compared modulo 2**32). A rank sets a flag after the
data it stands for is written (x86-64 keeps stores in order, and shared memory is only
chosen there); a waiter spins 50 microseconds on the peer's flag (yielding its core while
it spins where the host has more ranks than cores; where it has a core a rank, it spins
on with a yield a turn up to 300 microseconds), then sleeps on it
(``futex``, woken by the writer when the waiter has said it sleeps; a wake lost between
the two costs at most one ``SLEEP_S``), so more ranks than cores neither hang nor starve
the machine. Every wait has the group's collective timeout, marks the launcher's
watchdog board, and checks every ``ALIVE_EVERY_S`` that the peer's process still lives: a
dead peer is named in one line, at once, not at the timeout.
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..runtime.leftovers import owner_alive
from ..runtime.progress import mark

__all__ = ["ShmSegments", "PeerDied", "supported", "remove_stale", "SHM_DIR", "WORDS",
           "BUFFERS"]

SHM_DIR = "/dev/shm"
PREFIX = "plait-shm-"
LINE = 16                # int32 words a flag line (64 bytes)
WORDS = 256              # flag lines in a control block
CONTROL_BYTES = WORDS * LINE * 4
BUFFERS = 2              # data buffers a segment, used in turn by successive calls
SPIN_S = 50e-6           # spin this long on a flag before sleeping on it
# where the host has a core a rank, then spin with a yield a turn until this long: a peer
# a little late (a decoding step's ranks drift by tens of microseconds) is met without a
# futex sleep and its wake-up (tens of microseconds on a VM), and a process sharing the
# core still runs (bench decode at batch 1 on 2 ranks: 0.834/0.861 of one process's time
# against 0.876/0.917 with the sleep at 50 us, runs taking turns)
YIELD_S = 300e-6
SLEEP_S = 1e-3           # one futex sleep at most (a lost wake costs no more)
ALIVE_EVERY_S = 0.1      # how often a sleeping waiter checks its peer still lives

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1   # not _PRIVATE: the word is shared between processes
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}
_SYS = _SYS_FUTEX.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in
             (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.complex64, torch.complex128)}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class PeerDied(RuntimeError):
    """A peer's process ended while this rank waited for it (one line naming it)."""


def supported() -> str | None:
    """None where shared memory can carry this host's collectives; else why not."""
    if platform.machine() not in _SYS_FUTEX:
        return (f"shared-memory collectives need x86-64's store order, this is "
                f"{platform.machine()}")
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable folder"
    return None


def host_id() -> str:
    """What ranks on one host share and ranks on two hosts do not: the boot, and the
    network namespace (two emulated hosts of one machine share ``/dev/shm`` but are two
    hosts: their traffic is meant to cross their link)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        net = "?"
    return f"{boot}:{net}"


def remove_stale() -> list[str]:
    """Remove segments whose maker's process is gone (a maker SIGKILLed between making and
    unlinking); the names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if not owner_alive(pid):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def reached(value: int, epoch: int) -> bool:
    """Whether flag ``value`` is at ``epoch`` or later (modulo 2**32)."""
    return ((value - epoch) & 0xFFFFFFFF) < 0x80000000


@dataclass
class _Peer:
    rank: int
    pid: int
    flags: np.ndarray     # uint32 [WORDS * LINE]: its control block
    data: torch.Tensor    # uint8 [BUFFERS * capacity]
    flags_i32: np.ndarray = None  # the same words as int32 (headers hold signed integers)
    raw: memoryview = None        # the same bytes (a header compared as bytes: no numpy call)
    words: memoryview = None      # the same words, read and written as Python ints (a flag
                                  # read is a hot path: no numpy scalar made)

    def __post_init__(self):
        self.flags_i32 = self.flags.view(np.int32)
        self.raw = memoryview(self.flags.view(np.uint8))
        self.words = memoryview(self.flags)


class ShmSegments:
    """The mapped segments of a group's ranks on one host; see the module doc.

    Collective to make (every rank of ``group``). ``capacity``: bytes of one data buffer.
    """

    def __init__(self, group=None, *, capacity: int, timeout_s: float):
        why = supported()
        if why is not None:
            raise ValueError(f"shared memory cannot be used here: {why}")
        self.group, self.capacity, self.timeout_s = group, int(capacity), float(timeout_s)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        size = CONTROL_BYTES + BUFFERS * self.capacity
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        root = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(token, src=root, group=group)
        remove_stale()
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{token[0]}-{self.rank}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            os.close(fd)
            mine = (path, os.getpid(), host_id())
            every: list = [None] * self.world
            dist.all_gather_object(every, mine, group=group)
            hosts = {h for _, _, h in every}
            if len(hosts) != 1:
                raise ValueError(f"shared memory needs every rank of the group on one host; "
                                 f"the ranks are on {len(hosts)}")
            self.peers = [self._map(r, p, pid, size) for r, (p, pid, _) in enumerate(every)]
            dist.barrier(group=group)  # every rank has mapped every segment
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.flags = self.peers[self.rank].flags
        self.words = self.peers[self.rank].words
        self.raw = self.peers[self.rank].raw
        self.flags_i32 = self.peers[self.rank].flags_i32
        self.data = self.peers[self.rank].data
        self.others = [p for p in self.peers if p.rank != self.rank]  # every peer but this rank
        self._sleeping_word = WORDS - 1  # my "I sleep on a flag" word, read by writers
        # a rank per core or fewer: spin on the core (a yield would hand it to any other
        # process for a time slice); more ranks than cores: yield it while spinning
        self._crowded = self.world > len(os.sched_getaffinity(0))
        self._views: dict = {}
        self._every: dict = {}

    def _map(self, rank: int, path: str, pid: int, size: int) -> _Peer:
        raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        flags = raw[:CONTROL_BYTES].view(torch.int32).numpy().view(np.uint32)
        return _Peer(rank, pid, flags, raw[CONTROL_BYTES:])

    # --- buffers ---------------------------------------------------------------
    def buffer(self, rank: int, index: int, dtype: torch.dtype, count: int,
               offset: int = 0) -> torch.Tensor:
        """``count`` elements of ``dtype`` from byte ``offset`` of data buffer ``index`` of
        ``rank``'s segment: memory every rank of the group sees (views kept: a decoding
        step asks for the same few again and again)."""
        key = (rank, index % BUFFERS, dtype, count, offset)
        view = self._views.get(key)
        if view is None:
            start = (index % BUFFERS) * self.capacity + offset
            nbytes = count * _ITEMSIZE[dtype]
            assert offset + nbytes <= self.capacity, (offset, nbytes, self.capacity)
            view = self.peers[rank].data[start:start + nbytes].view(dtype)
            if len(self._views) > 4096:
                self._views.clear()
            self._views[key] = view
        return view

    def buffers(self, index: int, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """Every rank's ``buffer(rank, index, dtype, count)``, in rank order (kept too)."""
        key = (index % BUFFERS, dtype, count)
        views = self._every.get(key)
        if views is None:
            if len(self._every) > 1024:
                self._every.clear()
            views = self._every[key] = [self.buffer(r, index, dtype, count)
                                       for r in range(self.world)]
        return views

    # --- flags -------------------------------------------------------------------
    def set(self, word: int, epoch: int) -> None:
        """Publish ``epoch`` in this rank's flag ``word``, after the data it stands for,
        and wake any peer asleep on it."""
        self.words[word * LINE] = epoch & 0xFFFFFFFF
        for peer in self.others:
            if peer.words[self._sleeping_word * LINE]:
                self._futex(self.flags, word, _FUTEX_WAKE, 2**31 - 1)
                return

    def wait(self, rank: int, word: int, epoch: int, op: str) -> None:
        """Until ``rank``'s flag ``word`` reaches ``epoch``: a spin that yields the core (a
        peer sharing it runs), then futex sleeps; the timeout, the watchdog board and the
        peer's death are minded."""
        flags, words = self.peers[rank].flags, self.peers[rank].words
        index = word * LINE
        if reached(words[index], epoch):
            return
        start = time.perf_counter()
        while True:
            if self._crowded:  # more ranks than cores here: a peer may need this one
                os.sched_yield()
            if reached(words[index], epoch):
                return
            if time.perf_counter() - start > SPIN_S:
                break
        if not self._crowded:  # a rank a core: spin on, handing the core to anything else
            while time.perf_counter() - start < YIELD_S:  # runnable on it (a yield is cheap)
                os.sched_yield()
                if reached(words[index], epoch):
                    return
        mark(op)
        deadline = start + self.timeout_s
        checked = start
        mine = self.flags
        while True:
            value = words[index]
            if reached(value, epoch):
                return
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"{op}: rank {self.rank} waited {self.timeout_s:g} s for "
                                   f"rank {rank} (shared memory, epoch {epoch})")
            if now - checked > ALIVE_EVERY_S:
                checked = now
                if not owner_alive(self.peers[rank].pid):
                    raise PeerDied(f"{op}: rank {rank} (pid {self.peers[rank].pid}) died; "
                                   f"rank {self.rank} was waiting for it (shared memory)")
            mine[self._sleeping_word * LINE] = 1
            if not reached(words[index], epoch):
                self._futex(flags, word, _FUTEX_WAIT, value, SLEEP_S)
            mine[self._sleeping_word * LINE] = 0

    def _futex(self, flags: np.ndarray, word: int, op: int, value: int,
               timeout_s: float | None = None) -> None:
        address = flags.ctypes.data + word * LINE * 4
        ts = None
        if timeout_s is not None:
            ts = ctypes.byref(_Timespec(0, int(timeout_s * 1e9)))
        _libc.syscall(_SYS, ctypes.c_void_p(address), op,
                      ctypes.c_uint(value & 0xFFFFFFFF), ts, None, 0)
