"""Shared memory gives the right sum or an error on every rank, never a silent wrong one, and
runs wherever gloo would (one test a scenario; each fails on 3a37ce8, the code before):

1. two ranks making different calls (a barrier against an all_reduce; a header-only check
   against a data call whose first words agree) are refused on every rank;
2. a flag is never read as reached by a value from long ago: the two-shot all_reduce after
   2**31 one-shot calls waits for its peer's sum;
3. a call that raises on one rank after it began is an error on every rank (never a stale
   sum) and the group's later calls are refused; an all_gather output that is strided or
   of the wrong size on one rank is refused on every rank at once;
4. a second thread's call on a group is refused;
7. a hierarchy of uneven hosts (2 + 1 and 1 + 2 ranks) sums right;
8. 24 ranks make an all_to_all and an MoE-wide check on shared memory;
9. a small buffer and skewed splits stage no more than the buffer holds; two ranks giving
   two capacities are refused;
10. every call marks the watchdog's board, fast or not.

5 and 6 (a small ``/dev/shm``, ranks that do not share one) are in test_shm_setup.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from plait.testing import run_ranks

FAST = 10.0  # a collective timeout for these tests: a hang on the old code fails fast


def _data(seed: int, shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _outcome(call):
    """``("ok", value)`` or ``(error type, message)``."""
    try:
        return "ok", call()
    except Exception as err:  # noqa: BLE001 - the test reads what was raised
        return type(err).__name__, str(err)


# --- 1: another call, another length --------------------------------------------------
def _other_calls():
    from plait.transport.collectives import ShmGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    shm = ShmGroup(timeout_s=FAST)
    seen = {}
    for i in range(2):  # both buffers' headers hold an all_reduce of 32 floats
        shm.all_reduce(torch.full((32,), float(i)))

    def barrier_or_sum():
        if odd:
            return shm.barrier()
        return shm.all_reduce(torch.full((32,), float(rank))).tolist()
    seen["barrier"] = _outcome(barrier_or_sum)

    def check_or_sum():
        if odd:  # a check whose words are an all_reduce's of 32 float32s
            return shm.gather_meta("matmul_all_reduce", (1, 32), 2)
        return shm.all_reduce(torch.full((32,), float(rank))).tolist()
    seen["check"] = _outcome(check_or_sum)
    seen["after"] = shm.all_reduce(torch.ones(32))[0].item()
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_making_different_calls_are_refused_on_every_rank(world):
    for seen in run_ranks(_other_calls, world, timeout_s=FAST):
        for case in ("barrier", "check"):
            kind, text = seen[case]
            assert kind == "ValueError" and "different calls" in text, (case, seen[case])
        assert "barrier of 0 fields" in seen["barrier"][1], seen["barrier"]
        assert "matmul_all_reduce of 2 fields" in seen["check"][1], seen["check"]
        assert seen["after"] == world  # refused alike: the group goes on


# --- 2: 2**31 calls -----------------------------------------------------------------
def _past_two_to_the_31():
    """One two-shot call (its REDUCED flag written), then the group jumps to just below
    2**31 calls as if every call since had been one-shot, makes one-shot calls across
    2**31, then a two-shot call in which rank 1 sums its chunk 0.3 s late."""
    from plait.transport import collectives
    from plait.transport.calls import DONE, HDR

    rank, world = dist.get_rank(), dist.get_world_size()
    shm = collectives.ShmGroup(timeout_s=FAST)
    n = collectives.ONE_SHOT_BYTES // 4 + 1000  # two-shot
    shm.all_reduce(torch.ones(n))
    start = 2**31 - 3
    shm.epoch = start
    shm.segments.set(HDR, start)  # what every one-shot call writes
    shm.segments.set(DONE, start)
    dist.barrier()
    for _ in range(6):  # across 2**31
        shm.all_reduce(torch.ones(8))
    if rank == 1:
        summing = collectives._sum_into

        def late(out, parts):
            time.sleep(0.3)
            summing(out, parts)
        collectives._sum_into = late
    x = _data(rank, (n,))
    shm.all_reduce(x)
    want = sum(_data(r, (n,)) for r in range(world))
    return shm.epoch, float((x - want).abs().max())


@pytest.mark.parametrize("world", [2, 3])
def test_the_two_shot_call_after_2_to_the_31_calls_waits_for_its_peers_sum(world):
    for epoch, err in run_ranks(_past_two_to_the_31, world, timeout_s=FAST):
        assert epoch > 2**31 and err < 1e-4, (epoch, err)


# --- 3: a call that raises on one rank ------------------------------------------------
def _raises_mid_call():
    from plait.transport.collectives import ShmGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    shm = ShmGroup(timeout_s=FAST)
    shm.all_reduce(torch.ones(16))
    seen = {}

    def product(slot):
        if odd:
            raise RuntimeError("out of memory (on purpose)")
        slot.copy_(torch.full_like(slot, 2.0))
    started = time.monotonic()
    seen["call"] = _outcome(lambda: shm.reduce_computed(product, torch.empty(16)).tolist())
    seen["seconds"] = time.monotonic() - started
    seen["next"] = _outcome(lambda: shm.all_reduce(torch.ones(16)).tolist())
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_a_call_that_raises_on_one_rank_is_an_error_on_every_rank(world):
    for rank, seen in enumerate(run_ranks(_raises_mid_call, world, timeout_s=FAST)):
        kind, text = seen["call"]
        if rank == world - 1:
            assert kind == "RuntimeError" and "on purpose" in text, seen
        else:  # never the stale slot's sum
            assert kind == "PeerFailed" and f"rank {world - 1}" in text, seen
            assert "on purpose" in text and seen["seconds"] < FAST / 2, seen
        kind, text = seen["next"]
        assert kind == "GroupBroken" and "make a new group" in text, seen


def _bad_gather_output(how: str):
    from plait.transport.collectives import ShmGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    shm = ShmGroup(timeout_s=FAST)
    out = torch.empty(2 * world, 6)
    if rank == world - 1:
        out = out[:, :3] if how == "strided" else out[:-1, :3].contiguous()
    else:
        out = out[:, :3].contiguous()
    started = time.monotonic()
    seen = _outcome(lambda: shm.all_gather(out, torch.ones(2, 3), [2] * world))
    took = time.monotonic() - started
    after = shm.all_reduce(torch.ones(4)).tolist()
    return seen, took, after


@pytest.mark.parametrize("how", ["strided", "short"])
@pytest.mark.parametrize("world", [2, 3])
def test_an_all_gather_output_wrong_on_one_rank_is_refused_on_every_rank(world, how):
    for (kind, text), took, after in run_ranks(_bad_gather_output, world, how,
                                               timeout_s=FAST):
        assert kind == "ValueError" and f"rank {world - 1}'s output" in text, text
        assert took < FAST / 2 and after == [world] * 4


# --- 4: two threads -------------------------------------------------------------------
def _two_threads():
    from plait.transport.collectives import ShmGroup

    shm = ShmGroup(timeout_s=FAST)
    shm.all_reduce(torch.ones(4))
    seen = {}
    other = threading.Thread(target=lambda: seen.update(
        thread=_outcome(lambda: shm.all_reduce(torch.ones(4)))))
    other.start()
    other.join()
    seen["owner"] = shm.all_reduce(torch.ones(4)).tolist()
    return seen


def test_a_second_thread_is_refused_and_the_owner_goes_on():
    for seen in run_ranks(_two_threads, 2, timeout_s=FAST):
        kind, text = seen["thread"]
        assert kind == "RuntimeError" and "one thread" in text, seen
        assert seen["owner"] == [2.0] * 4


# --- 7: uneven hosts ------------------------------------------------------------------
def _uneven_hosts(layout: str):
    """A hierarchy whose hosts are given (``"aab"``: ranks 0 and 1 on one host, rank 2 on
    another): its all_reduce, one-shot and two-shot sizes, against the float64 sum."""
    from plait.transport.base import Choice
    from plait.transport.hier import HierTransport

    rank, world = dist.get_rank(), dist.get_world_size()
    hier = HierTransport(None, Choice("shm+gloo", "test"), list(layout), timeout_s=FAST)
    out = {"inside": hier.inside_reason}
    for n in (1000, 300_001):
        x = _data(rank, (n,), torch.float64)
        hier.all_reduce(x)
        want = sum(_data(r, (n,), torch.float64) for r in range(world))
        out[n] = (x, float((x - want).abs().max()))
    return out


@pytest.mark.parametrize("layout", ["aab", "abb"])
def test_hosts_of_different_rank_counts_sum_right(layout):
    results = run_ranks(_uneven_hosts, 3, layout, timeout_s=FAST)
    for n in (1000, 300_001):
        for r in results:
            assert torch.equal(r[n][0], results[0][n][0]) and r[n][1] < 1e-12, (n, r[n][1])
    assert sorted(r["inside"] for r in results) == \
        ["one rank on this host", "shared memory", "shared memory"]


# --- 8: 24 ranks ----------------------------------------------------------------------
def _many_ranks():
    from plait.transport.base import Choice, DistTransport
    from plait.transport.collectives import ShmGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    shm = ShmGroup(timeout_s=60)
    gloo = DistTransport(None, Choice("gloo", "the reference"))
    send_rows = [(rank + d) % 3 for d in range(world)]
    recv_rows = [(s + rank) % 3 for s in range(world)]
    send = _data(rank, (sum(send_rows), 5))
    got = {}
    for name, transport in (("shm", shm), ("gloo", gloo)):
        out = torch.empty(sum(recv_rows), 5)
        transport.all_to_all(out, send, recv_rows, send_rows)
        got[name] = out
    width = 7 + 4 * world  # MoE's check on this many ranks rides in one header
    rows = shm.gather_meta("moe_dispatch", tuple(range(width)), width)
    return torch.equal(got["shm"], got["gloo"]), rows == [tuple(range(width))] * world


def test_24_ranks_make_an_all_to_all_and_an_moe_check_on_shared_memory():
    results = run_ranks(_many_ranks, 24, timeout_s=60)
    assert results == [(True, True)] * 24


# --- 9: a small buffer ----------------------------------------------------------------
def _skewed(capacity: int):
    """reduce_scatter and all_to_all whose turns' ranges round up past a turn (rank 0's
    rows and sends skewed), on a small buffer, against gloo."""
    from plait.transport.base import Choice, DistTransport
    from plait.transport.collectives import ShmGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    shm = ShmGroup(capacity=capacity, timeout_s=FAST)
    gloo = DistTransport(None, Choice("gloo", "the reference"))
    rows = [0, 2047, 2049][:world] if world == 3 else [2047, 2049]
    whole = _data(rank, (sum(rows), 1))
    send_rows = [[0, 2047, 2049][:world], [1] * world, [2] * world][rank]
    every: list = [None] * world
    dist.all_gather_object(every, send_rows)
    recv_rows = [every[s][rank] for s in range(world)]
    send = _data(10 + rank, (sum(send_rows), 1))
    same = {}
    for name, transport in (("shm", shm), ("gloo", gloo)):
        mine = whole.new_empty(rows[rank], 1)
        transport.reduce_scatter(mine, whole, rows)
        out = torch.empty(sum(recv_rows), 1)
        transport.all_to_all(out, send, recv_rows, send_rows)
        same[name] = (mine, out)
    return all(torch.equal(a, b) for a, b in zip(same["shm"], same["gloo"]))


@pytest.mark.parametrize("world", [2, 3])
def test_a_small_buffer_with_skewed_splits_equals_gloo(world):
    assert run_ranks(_skewed, world, 8192, timeout_s=FAST) == [True] * world


def _two_capacities():
    from plait.transport.collectives import ShmGroup

    return _outcome(lambda: ShmGroup(capacity=8192 * (1 + dist.get_rank()), timeout_s=FAST))


def test_ranks_giving_two_capacities_are_refused_on_every_rank():
    for kind, text in run_ranks(_two_capacities, 2, timeout_s=FAST):
        assert kind == "ValueError" and "[8192, 16384]" in text, text


# --- 10: the watchdog's board ---------------------------------------------------------
def _marks():
    from plait.runtime.context import rank_context
    from plait.transport.collectives import ShmGroup

    shm = ShmGroup(timeout_s=FAST)
    board, rank = rank_context().progress, dist.get_rank()
    before = board.count(rank)
    for _ in range(50):
        shm.all_reduce(torch.ones(4))
    return board.count(rank) - before


def test_every_call_marks_the_watchdogs_board():
    assert all(marks >= 50 for marks in run_ranks(_marks, 2, timeout_s=FAST))
