"""Symmetric shared memory for the ranks of one group on one host: every rank maps every
peer's segment, and a flag per slot says a piece has landed.

Each rank of the group makes one POSIX shared-memory segment (a file under ``/dev/shm``),
reserves its pages (``posix_fallocate``: a ``/dev/shm`` too small for it is found at
set-up, not as a SIGBUS at the first write past what tmpfs can back), holds an exclusive
``flock`` on it for as long as it lives, writes a random token into it, and maps every
peer's (opened, never created: a rank whose ``/dev/shm`` is not its peers' finds no
segment, or another token, and every rank says so). A rank then reads and writes any
peer's memory as its own tensors: a piece is computed straight into a peer-visible slot,
and a peer reads it where it lies. Once every rank has mapped every segment the files are
unlinked: the mappings live on, and nothing is left under ``/dev/shm`` however the ranks
end (a SIGKILL included). A segment still there from a maker that died before unlinking
is removed at the next set-up on the host: its lock is free (the kernel drops a dead
process's locks, whatever pid namespace it ran in).

Set-up is collective and agreed: where any rank cannot make, reserve or see a segment,
every rank raises the same :class:`ShmUnavailable` naming why (the transport's choice
then falls back to ``torch.distributed``, or refuses where shared memory was asked for).

A segment: a control block of 32-bit flag words (one a 64-byte line, so two ranks never
write one line), a header and a note per data buffer (:mod:`.calls`), a failure note,
then ``BUFFERS`` data buffers used in turn by successive calls (:class:`Layout`: sized by
the group's world, so a header holds any group's splits). A flag holds an *epoch* (the
group's call count, never reset to 0; compared modulo 2**32, and every call writes every
flag a later call waits on, so a flag is never older than a few calls). A rank sets a
flag after the data it stands for is written (x86-64 keeps stores in order, and shared
memory is only chosen there); a waiter spins 50 microseconds on the peer's flag (yielding
its core while it spins where the host has more ranks than cores; where it has a core a
rank, it spins on with a yield a turn up to 300 microseconds), then sleeps on it
(``futex``, woken by the writer when the waiter has said it sleeps; a wake lost between
the two costs at most one ``SLEEP_S``), so more ranks than cores neither hang nor starve
the machine. Every wait has the group's collective timeout, marks the launcher's
watchdog board with its operator, reads the peer's ``FAILED`` word (a peer whose call
raised says so there: its peers raise too, never reading what it left half-written), and
checks every ``ALIVE_EVERY_S`` that the peer still lives (its lock is held): a dead peer
is named in one line, at once, not at the timeout.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import socket
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..runtime import current
from ..runtime.progress import mark

__all__ = ["ShmSegments", "ShmUnavailable", "PeerDied", "PeerFailed", "Layout", "supported",
           "remove_stale", "segment_bytes", "shm_free_bytes", "SHM_DIR", "BUFFERS", "LINE",
           "HDR", "DONE", "REDUCED", "FAILED"]

SHM_DIR = "/dev/shm"
PREFIX = "plait-shm-"
LINE = 16                # int32 words a flag line (64 bytes)
BUFFERS = 2              # data buffers a segment, used in turn by successive calls
HDR, DONE, REDUCED, FAILED = 0, 1, 2, 3  # flag lines of a rank's control block
_TOKEN_LINE = 4          # the maker's random token (16 bytes)
_SLEEPING_LINE = 5       # "I sleep on a flag", read by writers
_FIRST_HEADER_LINE = 8
HEADER_FIXED = 11        # a header's words before its values: epoch, state, width, name (8)
NOTE_LINES = 8           # a note (UTF-8): 512 bytes
SPIN_S = 50e-6           # spin this long on a flag before sleeping on it
# where the host has a core a rank, then spin with a yield a turn until this long: a peer
# a little late (a decoding step's ranks drift by tens of microseconds) is met without a
# futex sleep and its wake-up (tens of microseconds on a VM), and a process sharing the
# core still runs (bench decode at batch 1 on 2 ranks: 0.834/0.861 of one process's time
# against 0.876/0.917 with the sleep at 50 us, runs taking turns)
YIELD_S = 300e-6
SLEEP_S = 1e-3           # one futex sleep at most (a lost wake costs no more)
ALIVE_EVERY_S = 0.1      # how often a sleeping waiter checks its peer still lives
STALE_AFTER_S = 10.0     # a segment younger than this is never taken for a dead maker's

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1   # not _PRIVATE: the word is shared between processes
_SYS_FUTEX = {"x86_64": 202, "AMD64": 202}
_SYS = _SYS_FUTEX.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)
_MASK = 0xFFFFFFFF
_ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in
             (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              torch.complex64, torch.complex128)}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class PeerDied(RuntimeError):
    """A peer's process ended while this rank waited for it (one line naming it)."""


class PeerFailed(RuntimeError):
    """A peer's call raised (its ``FAILED`` word is set): this rank's call cannot finish."""


class ShmUnavailable(ValueError):
    """The group's ranks cannot share memory here; raised on every rank alike, with why."""


@dataclass(frozen=True)
class Layout:
    """Where things lie in a group's segments (every rank computes the same one).
    ``header_words``: the most values a call's header holds (any operator's check on this
    world: MoE's is 7 + 4 W, an all_to_all's 3 + 2 W)."""

    world: int
    capacity: int        # bytes of one data buffer
    header_words: int
    header_lines: int
    note_line: int       # the first buffer's note
    failure_line: int    # the failure note
    control_bytes: int   # page-aligned: the data buffers start on a page

    @classmethod
    def of(cls, world: int, capacity: int) -> "Layout":
        header_words = 24 + 4 * world
        header_lines = -(-(HEADER_FIXED + header_words) // LINE)
        note_line = _FIRST_HEADER_LINE + BUFFERS * header_lines
        failure_line = note_line + BUFFERS * NOTE_LINES
        control = -(-(failure_line + NOTE_LINES) * LINE * 4 // 4096) * 4096
        return cls(world, int(capacity), header_words, header_lines, note_line,
                   failure_line, control)

    @property
    def size(self) -> int:
        """Bytes of one rank's segment."""
        return self.control_bytes + BUFFERS * self.capacity

    def header_word(self, buffer: int) -> int:
        """The first word of buffer ``buffer``'s header."""
        return (_FIRST_HEADER_LINE + buffer * self.header_lines) * LINE

    def note_byte(self, buffer: int) -> int:
        """The first byte of buffer ``buffer``'s note."""
        return (self.note_line + buffer * NOTE_LINES) * LINE * 4

    @property
    def note_bytes(self) -> int:
        return NOTE_LINES * LINE * 4


def segment_bytes(world: int, capacity: int) -> int:
    """Bytes one rank's segment takes (a host of ``world`` ranks needs that many times it)."""
    return Layout.of(world, capacity).size


def shm_free_bytes() -> int | None:
    """Bytes ``/dev/shm`` can still give (None where it cannot be read)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


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
    hosts: their traffic is meant to cross their link). It does not show that ranks
    share ``/dev/shm``: set-up checks that itself (the token)."""
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
    """Remove segments whose maker is gone (SIGKILLed between making and unlinking): their
    lock is free, and they are older than ``STALE_AFTER_S`` (a live maker takes its lock
    microseconds after making the file). What cannot be opened or removed (another user's,
    in a sticky ``/dev/shm``) is left alone. The names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < STALE_AFTER_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its maker lives
            os.unlink(path)
            removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def reached(value: int, epoch: int) -> bool:
    """Whether flag ``value`` is at ``epoch`` or later (modulo 2**32)."""
    return ((value - epoch) & _MASK) < 0x80000000


@dataclass
class _Peer:
    rank: int
    fd: int               # held open: its lock says the maker lives
    flags: np.ndarray     # uint32 [control words]: its control block
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

    Collective to make (every rank of ``group``). ``capacity``: bytes of one data buffer
    (every rank must give the same). Raises :class:`ShmUnavailable` on every rank alike
    where the ranks cannot share memory.
    """

    def __init__(self, group=None, *, capacity: int, timeout_s: float):
        self.group, self.timeout_s = group, float(timeout_s)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.layout = layout = Layout.of(self.world, capacity)
        self.capacity = layout.capacity
        why = supported()
        remove_stale()
        path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-"
                                     f"{self.rank}")
        token = os.urandom(16)
        mine = None
        try:
            if why is None:
                mine, why = _make(path, layout, token, self.rank)
            every: list = [None] * self.world
            dist.all_gather_object(every, (path, token, self.capacity, host_id(), why,
                                           os.readlink("/proc/self/ns/pid")), group=group)
            _agree_to_share(every, self.rank)
            self.peers = [mine if r == self.rank else None for r in range(self.world)]
            why = self._map_peers(every)
            verdicts: list = [None] * self.world  # also the barrier: every rank has mapped
            dist.all_gather_object(verdicts, why, group=group)
            refused = [v for v in verdicts if v is not None]
            if refused:
                raise ShmUnavailable(refused[0])
        except BaseException:
            self._close_all(mine)
            raise
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        mine = self.peers[self.rank]
        self.flags, self.words, self.raw = mine.flags, mine.words, mine.raw
        self.flags_i32, self.data = mine.flags_i32, mine.data
        self.others = [p for p in self.peers if p.rank != self.rank]  # every peer but this rank
        my_pidns = os.readlink("/proc/self/ns/pid")
        # a peer in this pid namespace: its pid read too (a lock a forked child still holds
        # would hide its death); in another, its lock alone says it lives
        self._pids = {r: pid_ns[0] if pid_ns[1] == my_pidns else None
                      for r, pid_ns in enumerate(self._peer_pids)}
        self._sleeping_word = _SLEEPING_LINE * LINE
        # a rank per core or fewer: spin on the core (a yield would hand it to any other
        # process for a time slice); more ranks than cores: yield it while spinning
        self._crowded = self.world > len(os.sched_getaffinity(0))
        ctx = current.get()
        board = None if ctx is None else ctx.progress
        # the watchdog's board, bumped once a call (every call shows progress, not only
        # the waits that reach their slow path)
        self.ticks = None if board is None else board.counts
        self.tick_at = None if ctx is None else ctx.topology.rank
        self._views: dict = {}
        self._every: dict = {}

    def _map_peers(self, every: list) -> str | None:
        """Open and map every peer's segment (never creating one); None, or why not."""
        self._peer_pids = []
        for rank, (path, token, _, _, _, pidns) in enumerate(every):
            self._peer_pids.append((int(os.path.basename(path)[len(PREFIX):].split("-")[0]),
                                    pidns))
            if rank == self.rank:
                continue
            try:
                self.peers[rank] = _open(rank, path, self.layout, token)
            except _NotShared as err:
                return (f"ranks {rank} and {self.rank} do not share {SHM_DIR} (rank "
                        f"{self.rank} {err}): give them one (--ipc=host, or one pod's "
                        f"shared {SHM_DIR})")
            except OSError as err:
                return f"rank {self.rank} cannot map rank {rank}'s segment: {err}"
        return None

    def _close_all(self, mine) -> None:
        for peer in getattr(self, "peers", None) or [mine]:
            if peer is not None:
                try:
                    os.close(peer.fd)
                except OSError:
                    pass

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
        self.words[word * LINE] = epoch & _MASK
        for peer in self.others:
            if peer.words[self._sleeping_word]:
                self._futex(self.flags, word, _FUTEX_WAKE, 2**31 - 1)
                return

    def fail(self, text: str) -> None:
        """This rank's calls stop here: ``text`` in its failure note, then its ``FAILED``
        word raised (a peer waiting on any of its flags reads it and raises)."""
        note = self.layout.failure_line * LINE * 4
        write_note(self.flags, note, self.layout.note_bytes, text)
        self.words[FAILED * LINE] = 1

    def failure(self, rank: int) -> str | None:
        """``rank``'s failure note, where its ``FAILED`` word is raised."""
        peer = self.peers[rank]
        if not peer.words[FAILED * LINE]:
            return None
        return read_note(peer.flags, self.layout.failure_line * LINE * 4, self.layout.note_bytes)

    def wait(self, rank: int, word: int, epoch: int, op: str) -> None:
        """Until ``rank``'s flag ``word`` reaches ``epoch``: a spin that yields the core (a
        peer sharing it runs), then futex sleeps; the timeout, the watchdog board, the
        peer's failure and its death are minded."""
        peer = self.peers[rank]
        flags, words = peer.flags, peer.words
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
            if words[FAILED * LINE]:
                raise PeerFailed(f"{op}: rank {rank} failed ({self.failure(rank)}); rank "
                                 f"{self.rank} was waiting for it (shared memory)")
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(f"{op}: rank {self.rank} waited {self.timeout_s:g} s for "
                                   f"rank {rank} (shared memory, epoch {epoch})")
            if now - checked > ALIVE_EVERY_S:
                checked = now
                if not self.alive(rank):
                    raise PeerDied(f"{op}: rank {rank} died; rank {self.rank} was waiting "
                                   f"for it (shared memory)")
            mine[self._sleeping_word] = 1
            if not reached(words[index], epoch):
                self._futex(flags, word, _FUTEX_WAIT, value, SLEEP_S)
            mine[self._sleeping_word] = 0

    def alive(self, rank: int) -> bool:
        """Whether ``rank``'s process lives: it holds its segment's lock (read in any pid
        namespace), and, in this one, its pid exists."""
        fd = self.peers[rank].fd
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = self._pids.get(rank)
            return pid is None or _pid_exists(pid)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False

    def _futex(self, flags: np.ndarray, word: int, op: int, value: int,
               timeout_s: float | None = None) -> None:
        address = flags.ctypes.data + word * LINE * 4
        ts = None
        if timeout_s is not None:
            ts = ctypes.byref(_Timespec(0, int(timeout_s * 1e9)))
        _libc.syscall(_SYS, ctypes.c_void_p(address), op,
                      ctypes.c_uint(value & _MASK), ts, None, 0)


class _NotShared(OSError):
    """A peer's segment is not where this rank looks: the ranks see two ``/dev/shm``."""


def _make(path: str, layout: Layout, token: bytes, rank: int
          ) -> tuple[_Peer | None, str | None]:
    """This rank's segment: made, locked, its pages reserved, its token written; or why
    not (``/dev/shm`` too small, not writable)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as err:
        return None, f"cannot make {path}: {err.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.posix_fallocate(fd, 0, layout.size)
    except OSError as err:
        os.close(fd)
        free = shm_free_bytes()
        have = "" if free is None else f"; it has {free / 2**20:.2f} MiB free"
        return None, (f"{SHM_DIR} cannot hold a {layout.size / 2**20:.2f} MiB segment a rank "
                      f"({err.strerror}{have}): give it more (docker --shm-size, or "
                      f"--ipc=host) or use --transport gloo")
    peer = _map(rank, fd, layout)
    peer.raw[_TOKEN_LINE * LINE * 4:_TOKEN_LINE * LINE * 4 + len(token)] = token
    return peer, None


def _open(rank: int, path: str, layout: Layout, token: bytes) -> _Peer:
    """Map ``rank``'s segment at ``path``, made by its rank (never created here): raises
    :class:`_NotShared` where it is missing or holds another token."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise _NotShared(f"finds no {path}") from None
    try:
        if os.fstat(fd).st_size != layout.size:
            raise _NotShared(f"finds {path} of another size")
        peer = _map(rank, fd, layout)
        at = _TOKEN_LINE * LINE * 4
        if bytes(peer.raw[at:at + len(token)]) != token:
            raise _NotShared(f"finds another {path}")
    except BaseException:
        os.close(fd)
        raise
    return peer


def _map(rank: int, fd: int, layout: Layout) -> _Peer:
    mapped = mmap.mmap(fd, layout.size)
    flags = np.frombuffer(mapped, dtype=np.uint32, count=layout.control_bytes // 4)
    data = torch.frombuffer(mapped, dtype=torch.uint8, offset=layout.control_bytes)
    return _Peer(rank, fd, flags, data)


def _agree_to_share(every: list, rank: int) -> None:
    """Every rank's set-up report judged alike on every rank: a rank that could not make its
    segment, ranks on two hosts, or two capacities refuse the group."""
    failed = [(r, why) for r, (_, _, _, _, why, _) in enumerate(every) if why is not None]
    if failed:
        r, why = failed[0]
        raise ShmUnavailable(f"rank {r}: {why}" if r != rank else why)
    hosts = {host for _, _, _, host, _, _ in every}
    if len(hosts) != 1:
        raise ShmUnavailable(f"shared memory needs every rank of the group on one host; the "
                             f"ranks are on {len(hosts)}")
    capacities = [capacity for _, _, capacity, _, _, _ in every]
    if len(set(capacities)) != 1:
        raise ValueError(f"shared memory: the ranks give different buffer capacities "
                         f"{capacities}; every rank must give the same")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_note(flags: np.ndarray, at: int, size: int, text: str) -> None:
    """``text`` (UTF-8, cut to fit, NUL-ended) at byte ``at`` of a control block."""
    raw = text.encode()[:size - 1] + b"\0"
    flags.view(np.uint8)[at:at + len(raw)] = np.frombuffer(raw, dtype=np.uint8)


def read_note(flags: np.ndarray, at: int, size: int) -> str:
    """The note at byte ``at`` of a control block."""
    raw = flags.view(np.uint8)[at:at + size].tobytes()
    return raw.split(b"\0", 1)[0].decode(errors="replace")
