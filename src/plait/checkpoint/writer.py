"""DCP's file writer, with a failed write reported as the ``OSError`` the file raised.

``torch.save`` into a file object swallows the file's ``OSError`` (a full disk's
``[Errno 28] No space left on device``) and fails with a bare
``RuntimeError: [enforce fail at inline_container.cc] . unexpected pos``. The shard
files here remember the first ``OSError`` their writes raised, and a failed
``write_data`` raises that one (chained to DCP's error) instead.
"""

from __future__ import annotations

import contextlib

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["Writer"]


class _Remembering:
    """A file that keeps the ``OSError`` a write raised, for :class:`Writer` to report."""

    def __init__(self, stream, seen: list[OSError]):
        self._stream, self._seen = stream, seen

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as err:
            self._seen.append(err)
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _FileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _Remembering(stream, self.errors) if "w" in mode else stream


class Writer(FileSystemWriter):
    """``FileSystemWriter`` (one file per rank, fsynced) whose failed write raises the
    file's own ``OSError``."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _FileSystem()

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            if self.fs.errors:
                raise self.fs.errors[0] from err
            raise
