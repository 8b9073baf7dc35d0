"""Shared memory neither hangs, starves nor leaks.

- 3 ranks on this machine's 2 cores run 3,000 fused calls (``matmul_all_reduce``, 2 pieces:
  6,000 collectives and 3,000 checks) on shared memory with the default settings: every
  result is the same on every rank and the run finishes (its deadline only ends a hang);
- a rank SIGKILLed mid-loop is named (rank and signal) by the launcher, and the ranks
  waiting for it stop on their own: the waiter sees its peer's process gone at its next
  check (every 0.1 s), not at the group's timeout;
- nothing is left under ``/dev/shm`` after either; a segment whose maker died before
  unlinking it (a SIGKILL in the set-up's window) is removed by the next set-up.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from plait.runtime import RankError, launch

SHM = {"PLAIT_TRANSPORT": "shm"}


def _ours() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("plait-shm-"))


def _many_calls(calls: int):
    from plait.ops import get_context, matmul_all_reduce

    rank = dist.get_rank()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    w = torch.randn(8, 12, generator=torch.Generator().manual_seed(10 + rank))
    total = torch.zeros(16, 12)
    for _ in range(calls):
        total += matmul_all_reduce(x, w, chunks=2)
    return total, get_context().mover().name, get_context().decisions["matmul_all_reduce"].path


def test_three_ranks_on_two_cores_make_3000_fused_calls():
    results = launch(_many_calls, 3, args=(3000,), env=SHM, threads=1, deadline_s=600)
    total, transport, path = results[0]
    assert (transport, path) == ("shm", "fused")
    for other, _, _ in results[1:]:
        assert torch.equal(other, total)
    assert _ours() == []


def _die_at(folder: str, at: int):
    from plait.ops import matmul_all_reduce

    rank = dist.get_rank()
    x, w = torch.ones(4, 3), torch.ones(3, 5)
    for i in range(10 ** 6):
        if rank == 1 and i == at:
            with open(os.path.join(folder, "killed_at"), "w") as f:
                f.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        matmul_all_reduce(x, w, chunks=2)


@pytest.mark.parametrize("world", [2, 3])
def test_a_sigkilled_rank_is_named_and_its_peers_stop(tmp_path, world):
    timeout_s = 60.0
    with pytest.raises(RankError) as info:
        launch(_die_at, world, args=(str(tmp_path), 200), env=SHM, timeout_s=timeout_s,
               threads=1, deadline_s=300)
    took = time.monotonic() - float((tmp_path / "killed_at").read_text())
    assert info.value.rank == 1 and "SIGKILL" in str(info.value), str(info.value)
    # its peers saw it die (a liveness check every 0.1 s a wait), not the group's timeout:
    # half of it is a hang guard many times their own seconds, and fails if they waited it out
    assert took < timeout_s / 2, took
    assert _ours() == []


def test_a_dead_makers_segment_is_removed_by_the_next_set_up(monkeypatch):
    """A segment is a dead maker's when its lock is free and it is older than a set-up
    takes: that one goes; a live maker's (its lock held, in whatever pid namespace), a
    young one, and one this user may not remove (another user's, in a sticky /dev/shm:
    the unlink raises) stay, and set-up goes on."""
    import fcntl

    from plait.transport import shm as shm_mod
    from plait.transport.shm import PREFIX, SHM_DIR, STALE_AFTER_S, remove_stale

    old = time.time() - 2 * STALE_AFTER_S
    paths = {name: os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{name}-0")
             for name in ("stale", "live", "young", "theirs")}
    for name, path in paths.items():
        with open(path, "wb") as f:
            f.truncate(4096)
        if name != "young":
            os.utime(path, (old, old))
    held = os.open(paths["live"], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # its maker lives
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if path == paths["theirs"]:
            raise PermissionError(13, "Permission denied", path)
        return real_unlink(path, *args, **kwargs)
    try:
        monkeypatch.setattr(shm_mod.os, "unlink", unlink)
        removed = remove_stale()
        assert [n for n, p in paths.items() if os.path.basename(p) in removed] == ["stale"]
        monkeypatch.undo()
        assert [n for n, p in paths.items() if os.path.exists(p)] == ["live", "young", "theirs"]
    finally:
        os.close(held)
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)
