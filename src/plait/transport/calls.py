"""One collective call on shared memory: its epoch, its header (the cross-rank check carried
in the slot), its flags, and the release of its buffer.

Every rank of the group makes the same calls in the same order (as with any collective),
so the *n*-th call has epoch *n* on every rank, and uses data buffer ``n % BUFFERS`` of
every segment. A call:

1. waits until every rank has finished call ``n − BUFFERS`` (its ``DONE`` flag): nobody
   reads that buffer any more, so it may be written;
2. writes its header (op, dtype, shapes, chunks: what fixes the schedule; or that this
   rank rejected its input, and why) and, with it, the data its peers will read; raises
   ``HDR`` (:meth:`Call.exchange`); reads every rank's header and raises on every rank
   where any differs or any rank rejected its input: the check rides with the data, a
   few flag reads and no round trip of its own, and a mismatch is an error on every
   rank, never a hang;
3. where it has a second phase (a two-shot all-reduce: each rank sums its own chunk of
   every rank's data), raises ``REDUCED`` once its chunk is summed; a reader of that
   chunk waits on the owner's flag;
4. raises ``DONE``.

A fused operator's pieces are calls of their own, one a piece, each flagged as above once
the piece is written: the next piece is computed while the peers read this one.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np
import torch

from .shm import BUFFERS, LINE, WORDS, ShmSegments, reached

__all__ = ["Call", "Carried", "Header", "HDR", "DONE", "REDUCED", "HEADER_WORDS"]

HDR, DONE, REDUCED = 0, 1, 2  # flag lines of a rank's control block
# a header and a note per data buffer: call n writes those of buffer n % BUFFERS, which no
# rank reads any more once every rank has finished call n − BUFFERS (step 1 above)
_HEADER_LINE = 128            # headers (packed integers) from this line on, 8 lines each
HEADER_WORDS = 48             # at most this many integers a header
_NOTE_LINE = 128 + 8 * BUFFERS  # rejected inputs' messages (UTF-8) from this line on
_NOTE_BYTES = (WORDS - 1 - _NOTE_LINE) // BUFFERS * LINE * 4
assert REDUCED < _HEADER_LINE and HEADER_WORDS + 1 <= 8 * LINE


class Header:
    """A call's fields, as integers; what differs between ranks is named in the error.
    ``local``: the fields that may differ (a rank's own shard size). ``packed``: the words
    written into the slot (a 0, "no rank rejected its input", then the values)."""

    __slots__ = ("op", "names", "values", "local", "packed")

    def __init__(self, op: str, names: Sequence[str], values: Sequence[int],
                 local: Sequence[str] = ()):
        assert len(names) == len(values) <= HEADER_WORDS, (names, values)
        self.op, self.names, self.values, self.local = op, names, values, local
        self.packed = _packer(len(values) + 1).pack(0, *values)


class Carried:
    """An operator's cross-rank check, carried in the header of the call that moves its
    data (no call of its own): ``op``, its fields' ``names`` and this rank's ``values``,
    and ``verify(rows)``, which raises (every rank alike) where every rank's values do not
    agree. An operator makes one per signature (``OpsContext.carried_plan``), so the
    headers made from it are kept: a decoding step's calls build and pack none."""

    __slots__ = ("op", "names", "values", "verify", "_headers")

    def __init__(self, op: str, names: Sequence[str], values: Sequence[int], verify):
        self.op, self.names, self.values, self.verify = op, tuple(names), tuple(values), verify
        self._headers: dict[tuple, Header] = {}

    def header(self, names: tuple, values: tuple) -> Header:
        """The header of a call that carries this check's fields, then its own ``names``
        (``values``, a tuple): every field local (``verify`` judges the check's, the call
        its own)."""
        header = self._headers.get(values)
        if header is None:
            if len(self._headers) >= 64:  # a call's own fields vary (a gather's rows): bounded
                self._headers.clear()
            every = (*self.names, *names)
            header = self._headers[values] = Header(self.op, every, (*self.values, *values),
                                                    local=every)
        return header


class Call:
    """One call's session on ``shm`` (see the module doc); ``epoch`` is its number."""

    __slots__ = ("shm", "epoch", "header", "problem", "buffer", "rows", "alike", "_start")

    def __init__(self, shm: ShmSegments, epoch: int, header: Header,
                 problem: Exception | None = None):
        self.shm, self.epoch, self.header, self.problem = shm, epoch, header, problem
        self.buffer = epoch % BUFFERS
        if epoch >= BUFFERS:
            done = epoch - BUFFERS
            for peer in shm.peers:  # almost always long done: a flag read, not a wait
                if not reached(peer.words[DONE * LINE], done):
                    shm.wait(peer.rank, DONE, done, header.op)
        self._start = (_HEADER_LINE + 8 * self.buffer) * LINE
        self._write_header(problem)
        self.rows: list[tuple[int, ...]] | None = None
        self.alike = False  # every rank's header is this one's, word for word

    # --- the check, carried in the slot ----------------------------------------
    def _write_header(self, problem: Exception | None) -> None:
        at, packed = 4 * self._start, self.header.packed
        if problem is None:
            self.shm.raw[at:at + len(packed)] = packed
        else:
            values = self.header.values
            _packer(len(values) + 1).pack_into(self.shm.raw, at, 1, *values)
            note_at = _NOTE_LINE * LINE * 4 + self.buffer * _NOTE_BYTES
            text = f"{type(problem).__name__}:{problem}".encode()[:_NOTE_BYTES - 1]
            note = self.shm.flags.view(np.uint8)[note_at:note_at + _NOTE_BYTES]
            note[:len(text) + 1] = np.frombuffer(text + b"\0", dtype=np.uint8)

    def exchange(self) -> list[tuple[int, ...]]:
        """Raise ``HDR``: this rank's header, and whatever the caller wrote into its slots
        before, are there for every peer. Wait for every peer's, then check them: every
        rank raises the same error where a rank rejected its input or a field differs.
        Every rank's header, in rank order."""
        shm, epoch = self.shm, self.epoch
        shm.set(HDR, epoch)
        start, width = self._start, len(self.header.values) + 1
        a, b = 4 * start, 4 * (start + width)  # the header's bytes, compared as bytes
        ours = self.header.packed if self.problem is None else shm.raw[a:b]
        alike = self.problem is None
        for peer in shm.others:
            if not reached(peer.words[HDR * LINE], epoch):
                shm.wait(peer.rank, HDR, epoch, self.header.op)
            alike = alike and peer.raw[a:b] == ours
        if alike:  # the common case: every header is this one, and none rejected its input
            rows = [tuple(self.header.values)] * shm.world
            self.rows, self.alike = rows, True
            return rows
        rows, failed = [], []
        note_at = _NOTE_LINE * LINE * 4 + self.buffer * _NOTE_BYTES
        for peer in shm.peers:
            theirs = peer.flags_i32[start:start + width].tolist()
            if theirs[0]:
                failed.append((peer.rank, _note(peer.flags, note_at)))
            rows.append(tuple(theirs[1:]))
        if failed:
            self.close()
            if self.problem is not None:
                raise self.problem
            kind = TypeError if failed[0][1].startswith("TypeError:") else ValueError
            raise kind(f"{self.header.op}: input rejected on " + "; ".join(
                f"rank {r}: {text.partition(':')[2]}" for r, text in failed))
        self.check_fields(rows)
        self.rows = rows
        return rows

    def check_fields(self, rows: list[tuple[int, ...]], names: Sequence[str] | None = None,
                     local: Sequence[str] | None = None) -> None:
        """Raise (every rank alike, the call closed) where a field not in ``local`` differs
        between ``rows`` (default: the header's own names and local fields)."""
        names = self.header.names if names is None else names
        local = self.header.local if local is None else local
        differ = [i for i, name in enumerate(names) if name not in local
                  and any(row[i] != rows[0][i] for row in rows)]
        if not differ:
            return
        self.close()
        field = ", ".join(names[i] for i in differ)
        told = ", ".join(f"rank {r} has ({', '.join(str(row[i]) for i in differ)})"
                         for r, row in enumerate(rows))
        raise ValueError(f"{self.header.op}: ranks disagree on {field}: {told}")

    # --- data and flags ----------------------------------------------------------
    def slot(self, rank: int, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
        """``count`` elements at byte ``offset`` of this call's buffer in ``rank``'s segment."""
        return self.shm.buffer(rank, self.buffer, dtype, count, offset)

    def slots(self, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """Every rank's ``slot(rank, dtype, count)``, in rank order."""
        return self.shm.buffers(self.buffer, dtype, count)

    def reduced(self) -> None:
        """This rank's chunk of a two-shot all-reduce is summed in its slot."""
        self.shm.set(REDUCED, self.epoch)

    def wait_reduced(self, rank: int) -> None:
        """Until ``rank``'s chunk is summed."""
        self.shm.wait(rank, REDUCED, self.epoch, self.header.op)

    def close(self) -> None:
        """This rank reads nothing more of this call's buffers."""
        self.shm.set(DONE, self.epoch)


_PACKERS: dict[int, struct.Struct] = {}


def _packer(words: int) -> struct.Struct:
    """``words`` signed 32-bit integers in the host's order (a header's: one call, no numpy)."""
    packer = _PACKERS.get(words)
    if packer is None:
        packer = _PACKERS[words] = struct.Struct(f"={words}i")
    return packer


def _note(flags: np.ndarray, at: int) -> str:
    raw = flags.view(np.uint8)[at:at + _NOTE_BYTES].tobytes()
    return raw.split(b"\0", 1)[0].decode(errors="replace")
