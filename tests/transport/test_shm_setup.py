"""Shared memory's set-up checks what it relies on, and where the host cannot give it, ``auto``
takes gloo with the reason and ``shm`` is refused in one line that says what to change
(each fails on 3a37ce8, the code before):

5. a ``/dev/shm`` too small for the segments (Docker's default is 64 MiB, shared with the
   DataLoader's workers): no SIGBUS at the first write, nothing left behind;
6. ranks that share a network but not ``/dev/shm`` (Docker ``--network=host`` without
   ``--ipc=host``): one rank in a mount namespace of its own finds no peer segment, and
   every rank says so instead of waiting for the timeout.

Needs root (a mount namespace and a tmpfs), as CI has.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from plait.testing import run_ranks

FAST = 10.0
_CLONE_NEWNS, _MS_REC, _MS_PRIVATE = 0x00020000, 0x4000, 0x40000

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a mount namespace)")


def _private_shm(size: str) -> None:
    """This process's own ``/dev/shm``: a fresh tmpfs of ``size`` in a mount namespace of
    its own (gone with the process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0 or \
            libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0 or \
            libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, f"size={size}".encode()) != 0:
        raise OSError(ctypes.get_errno(), "a private /dev/shm")


def _choices(private_rank: int | None, size: str):
    """Each wanted transport's choice (name and reason) or refusal, where ``private_rank``
    (or every rank, when None) has a ``/dev/shm`` of its own of ``size``; what this rank's
    ``/dev/shm`` holds of plait's afterwards."""
    from plait.transport.select import choose

    if private_rank is None or dist.get_rank() == private_rank:
        _private_shm(size)
    seen = {}
    for wanted in ("auto", "shm"):
        try:
            transport = choose(None, wanted, timeout_s=FAST)
            seen[wanted] = (transport.choice.name, transport.choice.reason)
        except ValueError as err:
            seen[wanted] = ("refused", str(err))
    dist.barrier()
    seen["left"] = [n for n in os.listdir("/dev/shm") if n.startswith("plait-shm-")]
    return seen


@needs_root
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_do_not_share_dev_shm_take_gloo_and_say_why(world):
    for seen in run_ranks(_choices, world, world - 1, "64m", timeout_s=FAST):
        name, reason = seen["auto"]
        assert name == "gloo" and "do not share /dev/shm" in reason, seen
        kind, text = seen["shm"]
        assert kind == "refused" and text.startswith("--transport shm:"), seen
        assert "do not share /dev/shm" in text and "--ipc=host" in text, seen
        assert seen["left"] == []


@needs_root
def test_a_dev_shm_too_small_takes_gloo_and_says_its_size():
    for seen in run_ranks(_choices, 2, None, "3m", timeout_s=FAST):
        name, reason = seen["auto"]
        assert name == "gloo" and "/dev/shm has 3.00 MiB free" in reason, seen
        kind, text = seen["shm"]
        assert kind == "refused" and "/dev/shm has 3.00 MiB free" in text, seen
        assert "--shm-size" in text and seen["left"] == []


def _segments():
    """A group's segments made past choose()'s check (each rank's fits, not both): made, or
    the refusal."""
    from plait.transport.collectives import ShmGroup
    from plait.transport.shm import ShmUnavailable

    try:
        ShmGroup(capacity=1 << 20, timeout_s=FAST)
        return "made"
    except ShmUnavailable as err:
        return str(err)


_SHARED_SMALL = textwrap.dedent(f"""
    import os, sys
    sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
    from test_shm_setup import _private_shm, _segments
    from plait.runtime import launch

    _private_shm("3m")  # before the launcher's fork server: every rank shares this one
    print(launch(_segments, 2, threads=1, timeout_s=10))
    print(sorted(os.listdir("/dev/shm")))
""")


@needs_root
def test_segments_that_do_not_fit_a_shared_dev_shm_are_refused_on_every_rank():
    """Both ranks in one 3 MiB ``/dev/shm``: the second segment's pages cannot be reserved,
    and every rank refuses at set-up (the code before made sparse files and died of SIGBUS
    at the first write past what tmpfs holds)."""
    proc = subprocess.run([sys.executable, "-c", _SHARED_SMALL], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    verdicts, left = proc.stdout.strip().splitlines()[-2:]
    assert "cannot hold a 2.00 MiB segment" in verdicts and "--shm-size" in verdicts, verdicts
    assert verdicts.count("cannot hold") == 2 and left == "[]", (verdicts, left)
