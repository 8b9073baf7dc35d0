"""gloo's small collectives as an exchange inside ``latency_bound()`` (a decoding step:
``plait.transport.base.dist_all_reduce`` and ``dist_all_gather``), on 2 and 3 ranks against
one process:

- an all-reduce up to ``EXCHANGE_BYTES`` is the sum in rank order, the same bits on every
  rank, in place and outside autograd (a tensor that requires grad, as a layer's is);
- with ``async_op`` nothing is summed until ``wait()``, two in flight keep their order, and
  a rank that waits at once meets one that does not (how a rank calls never decides it:
  a slowed rank's timed path is asynchronous where its peer's is not);
- past ``EXCHANGE_BYTES``, gloo's own all-reduce, within the dtype's tolerance;
- an all-gather up to it: every rank's piece, in rank order, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.testing import run_ranks
from plait.transport import base


def _piece(rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _in_rank_order(world: int, n: int, dtype) -> torch.Tensor:
    total = _piece(0, n, dtype) + _piece(1, n, dtype)
    for rank in range(2, world):
        total = total + _piece(rank, n, dtype)
    return total


def _exchanges(world: int) -> dict:
    with base.latency_bound():
        return _calls(world)


def _calls(world: int) -> dict:
    rank, out = dist.get_rank(), {}
    for dtype in (torch.float32, torch.bfloat16):
        x = _piece(rank, 1000, dtype).requires_grad_()
        base.dist_all_reduce(x, None)
        out[f"sum/{dtype}"] = x.detach().clone()
    a, b = _piece(rank, 64, torch.float64), 2 * _piece(rank, 64, torch.float64)
    ha, hb = base.dist_all_reduce(a, None, async_op=True), base.dist_all_reduce(b, None, True)
    out["untouched"] = torch.equal(a, _piece(rank, 64, torch.float64))
    hb.wait()
    ha.wait()
    out["async"] = (a.clone(), b.clone())
    c = _piece(rank, 64, torch.float64)
    if rank == 0:
        base.dist_all_reduce(c, None, async_op=True).wait()
    else:
        base.dist_all_reduce(c, None)
    out["mixed"] = c
    big = _piece(rank, base.EXCHANGE_BYTES // 4 + 1, torch.float64)
    base.dist_all_reduce(big, None)
    out["big"] = big
    gathered = torch.empty(world * 5, 3, dtype=torch.int64)
    base.dist_all_gather(gathered, torch.full((5, 3), rank, dtype=torch.int64), None)
    out["gathered"] = gathered
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_small_collectives_are_exact_exchanges(world):
    outs = run_ranks(_exchanges, world, world)
    for dtype in (torch.float32, torch.bfloat16):
        want = _in_rank_order(world, 1000, dtype)
        for out in outs:  # the rank-order sum, bit for bit, on every rank
            assert torch.equal(out[f"sum/{dtype}"], want), dtype
    a = _in_rank_order(world, 64, torch.float64)
    for out in outs:
        assert out["untouched"]  # nothing summed before wait()
        assert torch.equal(out["async"][0], a) and torch.equal(out["async"][1], 2 * a)
        assert torch.equal(out["mixed"], a)
        n = base.EXCHANGE_BYTES // 4 + 1
        torch.testing.assert_close(out["big"], _in_rank_order(world, n, torch.float64),
                                   rtol=1e-12, atol=1e-12)
        want = torch.arange(world).repeat_interleave(5)[:, None].expand(-1, 3)
        assert torch.equal(out["gathered"], want)
