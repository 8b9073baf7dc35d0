"""One collective call on shared memory: its epoch, its header (the cross-rank check carried
in the slot), its flags, and the release of its buffer.

Every rank of the group makes the same calls in the same order (as with any collective),
so the *n*-th call has epoch *n* on every rank, and uses data buffer ``n % BUFFERS`` of
every segment. A call:

1. waits until every rank has finished call ``n − BUFFERS`` (its ``DONE`` flag): nobody
   reads that buffer any more, so it may be written;
2. writes its header — its epoch, whether this rank rejected its input (and why, in the
   buffer's note), its operation, its width and its values (dtype, shapes, splits: what
   fixes the schedule) — and, with it, the data its peers will read; raises ``HDR``
   (:meth:`Call.exchange`); reads every rank's header and raises on every rank where any
   differs in any word (another operation, another length, another field, another
   epoch) or any rank rejected its input: the check rides with the data, a few flag
   reads and no round trip of its own, and a mismatch is an error on every rank, never
   a hang nor a sum of what a peer left from another call;
3. where it has a second phase (a two-shot all-reduce: each rank sums its own chunk of
   every rank's data), raises ``REDUCED`` once its chunk is summed; a reader of that
   chunk waits on the owner's flag;
4. raises ``REDUCED`` (where it did not) and ``DONE``: every call writes every flag a
   later call waits on, so none is ever read as reached by a value from long ago (the
   epoch wraps at 2**32; a flag older than 2**31 calls would read as ahead).

A refusal that every rank reaches alike (a mismatch, a rejected input) closes the call on
every rank and the group goes on (:meth:`Call.refuse`). Anything else raised inside a
call is a failure: the group stops there (:class:`~.collectives.ShmGroup`).
"""

from __future__ import annotations

import struct
from typing import Sequence

import torch

from .shm import (BUFFERS, DONE, HDR, HEADER_FIXED, LINE, REDUCED, ShmSegments, read_note,
                  reached, write_note)

__all__ = ["Call", "Carried", "Header", "HDR", "DONE", "REDUCED", "DTYPE_CODES", "dtype_code",
           "dtype_named"]

# One integer per dtype in every cross-rank check, the shared-memory calls' headers and the
# operators' rows alike (0: none); named again in the messages (dtype_named)
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float64: 3, torch.float16: 4,
               torch.int64: 5, torch.int32: 6, torch.uint8: 7, torch.int8: 8, torch.bool: 9,
               torch.int16: 10, torch.complex64: 11, torch.complex128: 12}
_DTYPE_NAMED = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as its one integer; a TypeError for one no check carries."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"dtype {dtype} cannot cross ranks here")
    return code


def dtype_named(code: int):
    """The dtype ``code`` stands for (the code itself where none does)."""
    return _DTYPE_NAMED.get(code, code)

_MASK = 0xFFFFFFFF
_OK, _REJECTED = 0, 1
_NAME_BYTES = 4 * (HEADER_FIXED - 3)  # a header's operation name, NUL-padded


class Header:
    """A call's fields, as integers; what differs between ranks is named in the error.
    ``local``: the fields that may differ (a rank's own shard size). ``packed``: the words
    written into the slot after its epoch: "no rank rejected its input", the width, the
    operation's name, then the values."""

    __slots__ = ("op", "names", "values", "local", "packed")

    def __init__(self, op: str, names: Sequence[str], values: Sequence[int],
                 local: Sequence[str] = ()):
        assert len(names) == len(values), (names, values)
        self.op, self.names, self.values, self.local = op, names, values, local
        self.packed = _pack(_OK, op, values)


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
    """One call's session on ``shm`` (see the module doc); ``epoch`` is its number.
    ``closed``: this rank has released the call; ``refused``: it ended in a refusal every
    rank reached alike."""

    __slots__ = ("shm", "epoch", "header", "problem", "buffer", "rows", "alike", "closed",
                 "refused", "_start")

    def __init__(self, shm: ShmSegments, epoch: int, header: Header,
                 problem: Exception | None = None):
        self.shm, self.epoch, self.header, self.problem = shm, epoch, header, problem
        self.buffer = epoch % BUFFERS
        self.closed = self.refused = False
        assert len(header.values) <= shm.layout.header_words, (header.op, len(header.values))
        if epoch >= BUFFERS:
            done = epoch - BUFFERS
            for peer in shm.peers:  # almost always long done: a flag read, not a wait
                if not reached(peer.words[DONE * LINE], done):
                    shm.wait(peer.rank, DONE, done, header.op)
        self._start = shm.layout.header_word(self.buffer)
        self._write_header(problem)
        self.rows: list[tuple[int, ...]] | None = None
        self.alike = False  # every rank's header is this one's, word for word

    # --- the check, carried in the slot ----------------------------------------
    def _write_header(self, problem: Exception | None) -> None:
        at, packed = 4 * (self._start + 1), self.header.packed
        if problem is None:
            self.shm.raw[at:at + len(packed)] = packed
        else:
            packed = _pack(_REJECTED, self.header.op, self.header.values)
            self.shm.raw[at:at + len(packed)] = packed
            write_note(self.shm.flags, self.shm.layout.note_byte(self.buffer),
                       self.shm.layout.note_bytes, f"{type(problem).__name__}:{problem}")
        self.shm.words[self._start] = self.epoch & _MASK

    def exchange(self, verify=None) -> list[tuple[int, ...]]:
        """Raise ``HDR``: this rank's header, and whatever the caller wrote into its slots
        before, are there for every peer. Wait for every peer's, then check them: every
        rank raises the same error where a rank rejected its input, or any word of a
        header (operation, width, a field, the epoch) differs. Every rank's header values,
        in rank order.

        ``verify(rows)``: the operator's own check, asked first where the ranks made one
        operation two ways (headers of two widths: one rank carries the check in its data
        call, another makes it a call of its own) on the fields every header has, so its
        error names what differs; the call is refused either way."""
        shm, epoch = self.shm, self.epoch
        shm.set(HDR, epoch)
        start, stamp = self._start, epoch & _MASK
        a = 4 * (start + 1)
        b = a + len(self.header.packed)  # the header's bytes, compared as bytes
        ours = self.header.packed if self.problem is None else shm.raw[a:b]
        alike = self.problem is None
        for peer in shm.others:
            if not reached(peer.words[HDR * LINE], epoch):
                shm.wait(peer.rank, HDR, epoch, self.header.op)
            alike = alike and peer.raw[a:b] == ours and peer.words[start] == stamp
        if alike:  # the common case: every header is this one, and none rejected its input
            rows = [tuple(self.header.values)] * shm.world
            self.rows, self.alike = rows, True
            return rows
        rows = self._read_headers(verify)
        self.check_fields(rows)
        self.rows = rows
        return rows

    def _read_headers(self, verify) -> list[tuple[int, ...]]:
        """Every rank's header values, read word by word: raises (the call refused, on every
        rank alike) where a rank rejected its input or made another call."""
        shm, start = self.shm, self._start
        limit = shm.layout.header_words
        rows, failed, calls = [], [], []
        for peer in shm.peers:
            stamp, state, width = peer.flags_i32[start:start + 3].tolist()
            stamp, width = stamp & _MASK, max(0, min(width, limit))
            at = 4 * (start + 3)
            op = bytes(peer.raw[at:at + _NAME_BYTES]).split(b"\0", 1)[0].decode(errors="replace")
            if state == _REJECTED:
                failed.append((peer.rank, read_note(peer.flags, shm.layout.note_byte(
                    self.buffer), shm.layout.note_bytes)))
            calls.append((op, width, stamp))
            rows.append(tuple(peer.flags_i32[start + HEADER_FIXED:
                                             start + HEADER_FIXED + width].tolist()))
        if failed:
            if self.problem is not None:
                raise self.refuse(self.problem)
            kind = TypeError if failed[0][1].startswith("TypeError:") else ValueError
            raise self.refuse(kind(f"{self.header.op}: input rejected on " + "; ".join(
                f"rank {r}: {text.partition(':')[2]}" for r, text in failed)))
        if len(set(calls)) > 1:
            told = "; ".join(f"rank {r} makes call {stamp} {op} of {width} fields"
                             for r, (op, width, stamp) in enumerate(calls))
            refusal = ValueError(f"{self.header.op}: the ranks make different calls ({told})")
            if verify is not None and len({(op, stamp) for op, _, stamp in calls}) == 1:
                fields = min(width for _, width, _ in calls)
                try:
                    verify([row[:fields] for row in rows])
                except (ValueError, TypeError) as err:
                    refusal = err
                except Exception:  # noqa: BLE001 - its fields are not all there: ours says
                    pass
            raise self.refuse(refusal)
        return rows

    def check_fields(self, rows: list[tuple[int, ...]], names: Sequence[str] | None = None,
                     local: Sequence[str] | None = None) -> None:
        """Raise (every rank alike, the call refused) where a field not in ``local``
        differs between ``rows`` (default: the header's own names and local fields)."""
        names = self.header.names if names is None else names
        local = self.header.local if local is None else local
        differ = [i for i, name in enumerate(names) if name not in local
                  and any(row[i] != rows[0][i] for row in rows)]
        if not differ:
            return
        field = ", ".join(names[i] for i in differ)
        told = ", ".join(f"rank {r} has ({', '.join(str(row[i]) for i in differ)})"
                         for r, row in enumerate(rows))
        raise self.refuse(ValueError(f"{self.header.op}: ranks disagree on {field}: {told}"))

    def refuse(self, err: BaseException) -> BaseException:
        """Close the call on a refusal that every rank reaches alike (the group goes on);
        ``err``, for the caller to raise."""
        if not self.closed:
            self.close()
        self.refused = True
        return err

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
        """This rank reads nothing more of this call's buffers. ``REDUCED`` is written
        too (a plain store: nobody waits on it in a call that did not raise it)."""
        self.shm.words[REDUCED * LINE] = self.epoch & _MASK
        self.shm.set(DONE, self.epoch)
        self.closed = True


_PACKERS: dict[int, struct.Struct] = {}


def _pack(state: int, op: str, values: Sequence[int]) -> bytes:
    """A header's words after its epoch, in the host's order (one call, no numpy)."""
    packer = _PACKERS.get(len(values))
    if packer is None:
        packer = _PACKERS[len(values)] = struct.Struct(f"=2i{_NAME_BYTES}s{len(values)}i")
    return packer.pack(state, len(values), op.encode()[:_NAME_BYTES - 1], *values)
