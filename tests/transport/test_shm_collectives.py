"""Collectives on shared memory against the same collectives on gloo, in one launch: 2 and 3
ranks, uneven splits, float32, bfloat16 and float64.

- all_gather, reduce_scatter's rows and all_to_all (a rank with an empty share too):
  bit-identical to gloo's;
- all_reduce, one-shot (4 KiB) and two-shot (past ``ONE_SHOT_BYTES``), and a message
  larger than a buffer (in turns): the same bits on every rank, and within the dtype's
  tolerance of the float64 sum;
- the cross-rank check rides in the call's header: a rank whose shape differs, or that
  rejects its input, makes every rank raise the same error, and the group goes on;
- nothing is left under ``/dev/shm``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from plait.testing import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def _data(seed: int, shape, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _gather_and_scatter(out: dict, key: str, transport, piece, whole, rows) -> None:
    """``transport``'s all_gather of ``piece`` and reduce_scatter of ``whole`` into ``out``."""
    gathered = piece.new_empty(sum(rows), *piece.shape[1:])
    transport.all_gather(gathered, piece, rows)
    out[f"all_gather/{key}"] = gathered
    mine = whole.new_empty(rows[dist.get_rank()], *whole.shape[1:])
    transport.reduce_scatter(mine, whole, rows)
    out[f"reduce_scatter/{key}"] = mine


def _both(capacity: int):
    """The collectives on gloo and on shared memory, each rank's results by name."""
    from plait.transport.collectives import ONE_SHOT_BYTES, ShmGroup
    from plait.transport.base import Choice, DistTransport

    rank, world = dist.get_rank(), dist.get_world_size()
    shm = ShmGroup(capacity=capacity, timeout_s=20)
    gloo = DistTransport(None, Choice("gloo", "the reference"))
    out = {}
    for dtype in DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        for n in (1024 // size * 4, ONE_SHOT_BYTES // size + 77, capacity // size * 2 + 5):
            x = _data(rank, (n,), dtype)
            want = sum(_data(r, (n,), torch.float64) for r in range(world))
            got = x.clone()
            shm.all_reduce(got)
            out[f"all_reduce/{dtype}/{n}"] = (got, float((got.double() - want).abs().max()))
        rows = [3, 0, 5][:world] if world == 3 else [4, 1]
        piece = _data(10 + rank, (rows[rank], 6), dtype)
        whole = _data(20 + rank, (sum(rows), 3), dtype)
        send_rows = [(rank + d) % 3 + (d == 0) for d in range(world)]
        every: list = [None] * world
        dist.all_gather_object(every, send_rows)
        recv_rows = [every[s][rank] for s in range(world)]
        send = _data(30 + rank, (sum(send_rows), 5), dtype)
        for name, transport in (("gloo", gloo), ("shm", shm)):
            _gather_and_scatter(out, f"{dtype}/{name}", transport, piece, whole, rows)
            recv = torch.empty(sum(recv_rows), 5, dtype=dtype)
            transport.all_to_all(recv, send, recv_rows, send_rows)
            out[f"all_to_all/{dtype}/{name}"] = recv
            # the last rank sends nothing and gets nothing (an expert-parallel rank with no
            # tokens): its share is empty, its width still 5
            idle = world - 1
            empty_send = [0 if rank == idle or d == idle else 2 for d in range(world)]
            empty_recv = [0 if rank == idle or s == idle else 2 for s in range(world)]
            got = torch.empty(sum(empty_recv), 5, dtype=dtype)
            transport.all_to_all(got, send[:sum(empty_send)], empty_recv, empty_send)
            out[f"all_to_all_empty/{dtype}/{name}"] = got
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_on_shared_memory_equals_gloo(world):
    capacity = 1 << 20  # a small buffer: the largest all_reduce goes in three turns
    results = run_ranks(_both, world, capacity, timeout_s=60)
    for key in results[0]:
        if key.startswith("all_reduce/"):
            dtype = getattr(torch, key.split("/")[1].replace("torch.", ""))
            for rank in results:
                assert torch.equal(rank[key][0], results[0][key][0]), key  # every rank alike
                assert rank[key][1] < TOL[dtype] * world, (key, rank[key][1])
    for rank in results:
        for key in [k for k in rank if k.endswith("/shm")]:
            gloo = rank[key.replace("/shm", "/gloo")]
            assert torch.equal(rank[key], gloo), key  # reduce_scatter: both in rank order
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("plait-shm-")]


def _turned():
    """all_gather, reduce_scatter and all_to_all whose messages are several times a 64 KiB
    buffer (so they go in turns, each rank's rows or each block cut into element ranges),
    uneven rows with empty shares, against gloo; then a rank holding other rows than it
    says, refused everywhere."""
    from plait.transport.base import Choice, DistTransport
    from plait.transport.collectives import ShmGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    shm = ShmGroup(capacity=1 << 16, timeout_s=20)
    gloo = DistTransport(None, Choice("gloo", "the reference"))
    rows = [700, 0, 1100][:world] if world == 3 else [900, 301]
    out = {}
    for dtype in DTYPES:
        piece = _data(40 + rank, (rows[rank], 33), dtype)
        whole = _data(50 + rank, (sum(rows), 29), dtype)
        for name, transport in (("gloo", gloo), ("shm", shm)):
            _gather_and_scatter(out, f"{dtype}/{name}", transport, piece, whole, rows)
            # rank 0 sends 600 rows to every rank (over a turn); the others a few, or none
            send_rows = [[600] * world, [3, 0, 5][:world], [0] * world][rank]
            every: list = [None] * world
            dist.all_gather_object(every, send_rows)
            recv_rows = [every[s][rank] for s in range(world)]
            send = _data(60 + rank, (sum(send_rows), 31), dtype)
            recv = torch.empty(sum(recv_rows), 31, dtype=dtype)
            transport.all_to_all(recv, send, recv_rows, send_rows)
            out[f"all_to_all/{dtype}/{name}"] = recv
    wrong = _data(1, (rows[rank] + (rank == 0), 33), torch.float32)
    try:
        shm.all_gather(torch.empty(sum(rows), 33), wrong, rows)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    again = torch.empty(sum(rows), 33, dtype=torch.float32)
    shm.all_gather(again, _data(40 + rank, (rows[rank], 33), torch.float32), rows)
    out["again"] = again
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_messages_larger_than_a_buffer_go_in_turns_and_equal_gloo(world):
    for rank in run_ranks(_turned, world, timeout_s=60):
        for key in [k for k in rank if k.endswith("/shm")]:
            assert torch.equal(rank[key], rank[key.replace("/shm", "/gloo")]), key
        assert rank["refused"] is not None and "expect rows" in rank["refused"], rank
        assert torch.equal(rank["again"], rank["all_gather/torch.float32/gloo"])
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("plait-shm-")]


def _checked(bad_rank: int):
    """A good call, a call where ``bad_rank``'s shape differs, one where it rejects its
    input, an all_to_all whose send on ``bad_rank`` has a row more than its splits say,
    then a good call again: each rank's outcome."""
    from plait.transport.collectives import ShmGroup

    rank = dist.get_rank()
    shm = ShmGroup(capacity=1 << 16, timeout_s=20)
    seen = []
    for case in ("good", "shape", "rejected", "a2a", "good"):
        n = 33 if case == "shape" and rank == bad_rank else 32
        problem = ValueError("x is not what it should be") \
            if case == "rejected" and rank == bad_rank else None
        try:
            if problem is not None:
                shm.gather_meta("op", None, 2, problem)
            elif case == "rejected":
                shm.gather_meta("op", (1, 2), 2)
            elif case == "a2a":
                splits = [2] * shm.world
                send = torch.ones(2 * shm.world + (rank == bad_rank), 3)
                shm.all_to_all(torch.empty(2 * shm.world, 3), send, splits, splits)
            else:
                x = torch.ones(n)
                shm.all_reduce(x)
            seen.append(("ok", None))
        except (ValueError, TypeError) as err:
            seen.append((type(err).__name__, str(err)))
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_a_mismatch_on_one_rank_is_an_error_on_every_rank_and_the_group_goes_on(world):
    results = run_ranks(_checked, world, world - 1)
    for rank, seen in enumerate(results):
        assert seen[0] == ("ok", None) and seen[4] == ("ok", None), seen
        kind, text = seen[1]
        assert kind == "ValueError" and "ranks disagree on numel" in text, text
        assert f"rank {world - 1} has (33)" in text, text
        kind, text = seen[2]
        assert kind == "ValueError" and "x is not what it should be" in text, text
        if rank != world - 1:
            assert f"input rejected on rank {world - 1}" in text, text
        kind, text = seen[3]  # a send that is not its splits: refused on every rank
        assert kind == "ValueError" and f"rank {world - 1} sends [2" in text, text


def _in_place(bad_rank: int):
    """reduce_scatter into this rank's own rows of its tensor, and all_to_all with one
    tensor as send and output (uneven splits, every rank sending as many rows as it gets),
    each against the same call on separate buffers; then an all_to_all whose output on
    ``bad_rank`` is not contiguous, and a good call after it."""
    from plait.transport.collectives import ShmGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    shm = ShmGroup(capacity=1 << 16, timeout_s=20)
    out = {}
    for n in (4, 3000):  # one call, and in turns (a rank's tensor over a buffer)
        rows = [2 + r for r in range(world)]
        at = sum(rows[:rank])
        tensor = _data(40 + rank, (sum(rows), n), torch.float32)
        want = shm.reduce_scatter(tensor.new_empty(rows[rank], n), tensor.clone(), rows)
        shm.reduce_scatter(tensor[at:at + rows[rank]], tensor, rows)
        out[f"reduce_scatter/{n}"] = torch.equal(tensor[at:at + rows[rank]], want)
        splits = [rank + d + 1 for d in range(world)]  # rank s sends d s + d + 1 rows
        send = _data(50 + rank, (sum(splits), n), torch.float32)
        want = shm.all_to_all(send.new_empty(send.shape), send.clone(), splits, splits)
        shm.all_to_all(send, send, splits, splits)
        out[f"all_to_all/{n}"] = torch.equal(send, want)
    splits = [2] * world
    recv = torch.empty(2 * world, 6)
    try:
        shm.all_to_all(recv[:, :3] if rank == bad_rank else recv[:, :3].contiguous(),
                       torch.ones(2 * world, 3), splits, splits)
        out["strided"] = None
    except ValueError as err:
        out["strided"] = str(err)
    ones = torch.ones(3)
    shm.all_reduce(ones)
    out["after"] = ones.tolist()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_in_place_calls_equal_separate_buffers_and_a_strided_output_is_refused(world):
    for seen in run_ranks(_in_place, world, world - 1, timeout_s=60):
        assert all(seen[k] for k in seen if k.startswith(("reduce_scatter", "all_to_all"))), seen
        assert seen["strided"] is not None and "not contiguous" in seen["strided"], seen
        assert seen["after"] == [world] * 3


def test_an_in_place_call_is_found_by_address_not_by_storage():
    """Two storages over the same bytes (``torch.from_numpy`` of two views of one array)
    are in place as much as two views of one storage (a review found the storage test
    missed them); disjoint views of one storage are not."""
    import numpy as np

    from plait.transport.collectives import _shares_memory

    array = np.zeros(16, dtype=np.float32)
    whole, tail = torch.from_numpy(array), torch.from_numpy(array[4:])
    assert _shares_memory(whole, tail) and not _shares_memory(whole[:4], tail)
    t = torch.zeros(6, 4)
    assert _shares_memory(t[4:6], t) and not _shares_memory(t[:2], t[2:])
    assert not _shares_memory(torch.empty(0), torch.empty(0))
