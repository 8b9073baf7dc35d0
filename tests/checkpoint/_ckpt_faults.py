"""Faults injected into DCP's file writes (in a rank's own process): a full disk, a crash,
a held write. They replace ``FileSystem.create_stream`` for the shard files (``*.distcp``)
only while the context is open."""

import contextlib
import errno
import os
import time

from torch.distributed.checkpoint.filesystem import FileSystem


class _Capped:
    """A file that takes ``left`` bytes, then fails as a full disk does (or ends the
    process, ``crash``: a rank killed in the middle of its write)."""

    def __init__(self, stream, left: int, crash: bool):
        self.stream, self.left, self.crash = stream, left, crash

    def write(self, data):
        data = bytes(data)
        if len(data) > self.left:
            self.stream.write(data[:self.left])
            self.stream.flush()
            if self.crash:
                os._exit(17)
            self.left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left -= len(data)
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


GATE_LIMIT_S = 120.0


@contextlib.contextmanager
def faulty_writes(*, left: int = 4096, crash: bool = False, gate: str | None = None):
    """Shard files written inside the context fail after ``left`` bytes (ENOSPC, or the
    process ends with ``crash``), or with ``gate`` (a path) each starts only once that file
    exists instead (``GATE_LIMIT_S`` at most: a test that never opens it fails on what it
    found, not by hanging)."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            if "w" not in mode or not str(path).endswith(".distcp"):
                yield stream
            elif gate is not None:
                end = time.monotonic() + GATE_LIMIT_S
                while not os.path.exists(gate) and time.monotonic() < end:
                    time.sleep(0.01)
                yield stream
            else:
                yield _Capped(stream, left, crash)

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real
