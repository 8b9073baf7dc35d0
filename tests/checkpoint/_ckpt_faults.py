"""Faults injected into DCP's file writes (in a rank's own process): a full disk, a crash,
a slow disk. They replace ``FileSystem.create_stream`` for the shard files (``*.distcp``)
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


@contextlib.contextmanager
def faulty_writes(*, left: int = 4096, crash: bool = False, delay_s: float = 0.0):
    """Shard files written inside the context fail after ``left`` bytes (ENOSPC, or the
    process ends with ``crash``), or with ``delay_s`` each start that late instead."""
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            if "w" not in mode or not str(path).endswith(".distcp"):
                yield stream
            elif delay_s:
                time.sleep(delay_s)
                yield stream
            else:
                yield _Capped(stream, left, crash)

    FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real
