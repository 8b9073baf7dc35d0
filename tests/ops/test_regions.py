"""The region edges a decoding step crosses (a vocab-parallel embedding's all-reduce, a
gathered lm_head): ``reduce_from_region`` and ``gather_from_region`` on 2 and 3 ranks with
uneven shares, on gloo and on shared memory (where the cross-rank check rides in the data
call's header, or, with ``PLAIT_CHECKS=gather``, is a gloo gather of its own), with and without a backward, against a single-process float64 reference;
a rank with another shape is refused on every rank, and the group goes on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.testing import run_ranks

SIZES = [2, 3, 1]


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _attempt(call):
    try:
        call()
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def _body():
    from plait.ops import get_context
    from plait.ops.regions import gather_from_region, reduce_from_region

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = SIZES[:world]
    terms = [_full(10 + r, 3, 5) for r in range(world)]
    whole = _full(20, 2, sum(sizes))
    lo = sum(sizes[:rank])
    seen = {}
    for grad in (False, True):
        x = terms[rank].clone().requires_grad_(grad)
        y = reduce_from_region(x)
        if grad:
            y.backward(torch.ones_like(y))
            seen["reduce dx"] = float((x.grad - 1).abs().max())
        seen[f"reduce grad={grad}"] = float((y.detach() - sum(terms)).abs().max())
        part = whole[:, lo:lo + sizes[rank]].clone().requires_grad_(grad)
        g = gather_from_region(part, None, -1, sizes)
        if grad:
            g.backward(whole)  # the gradient of the gathered tensor: its own slice comes back
            seen["gather dx"] = float((part.grad - whole[:, lo:lo + sizes[rank]]).abs().max())
        seen[f"gather grad={grad}"] = float((g.detach() - whole).abs().max())
    seen["gather (sizes found)"] = float(
        (gather_from_region(whole[:, lo:lo + sizes[rank]], None, -1) - whole).abs().max())
    # one rank with another shape: refused everywhere; then the group still works
    bad = terms[rank][:, :4] if rank == 1 else terms[rank]
    seen["reduce refused"] = _attempt(lambda: reduce_from_region(bad))
    odd = _full(1, 3, sizes[rank]) if rank == world - 1 else whole[:, lo:lo + sizes[rank]]
    seen["gather refused"] = _attempt(lambda: gather_from_region(odd, None, -1, sizes))
    long = _full(2, 2, sizes[rank] + 1) if rank == 0 else whole[:, lo:lo + sizes[rank]]
    seen["sizes refused"] = _attempt(lambda: gather_from_region(long, None, -1, sizes))
    # sizes that are not integers on one rank, after the good signature was planned: refused
    # on every rank (worked out on that rank alone, its peers would wait in the data call)
    junk = [None, *sizes[1:]] if rank == world - 1 else sizes
    seen["junk sizes refused"] = _attempt(
        lambda: gather_from_region(whole[:, lo:lo + sizes[rank]], None, -1, junk))
    seen["after"] = float((reduce_from_region(terms[rank]) - sum(terms)).abs().max())
    return seen, get_context().mover().name


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("transport, checks", [("gloo", "carried"), ("shm", "carried"),
                                               ("shm", "gather")])
def test_region_edges_on_every_transport(world, transport, checks):
    env = {"PLAIT_TRANSPORT": transport, "PLAIT_CHECKS": checks}
    for seen, name in run_ranks(_body, world, env=env):
        assert name == transport
        for key, err in seen.items():
            if key.endswith("refused"):
                continue
            assert err <= 1e-12, (key, err)
        assert "reduce_from_region" in seen["reduce refused"] and \
            "elements" in seen["reduce refused"], seen["reduce refused"]
        assert "gather_from_region" in seen["gather refused"] and \
            "other dims" in seen["gather refused"], seen["gather refused"]
        assert "do not fit" in seen["sizes refused"], seen["sizes refused"]  # rank 0's own
        assert seen["junk sizes refused"] is not None and \
            "gather_from_region" in seen["junk sizes refused"], seen["junk sizes refused"]
