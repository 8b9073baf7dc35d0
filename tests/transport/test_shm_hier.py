"""Several ranks per host on the emulated cluster (2 hosts × 2 ranks): ``auto`` takes shared
memory inside each host and gloo between hosts for the group's all-reduces, in the same
call; one rank per host takes gloo; every rank of one host alone takes shared memory.

The all-reduce (one-shot and two-shot sizes) and a fused ``matmul_all_reduce`` hold the
same bits on every rank, within float64 rounding of the sum; the other collectives of the
mixed group (gloo) equal the reference exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from conftest import needs_netns  # noqa: E402

from plait.runtime import EmulatedCluster, launch  # noqa: E402


def _mixed():
    from plait.ops import get_context, matmul_all_reduce

    rank, world = dist.get_rank(), dist.get_world_size()
    transport = get_context().mover()
    out = {"transport": transport.choice.name, "reason": transport.choice.reason}
    for n in (1000, 300_000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        want = sum(torch.randn(n, generator=torch.Generator().manual_seed(r),
                               dtype=torch.float64) for r in range(world))
        transport.all_reduce(x)
        out[n] = (x, float((x - want).abs().max()))
    a = torch.randn(12, 8, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(9 + rank), dtype=torch.float64)
    out["fused"] = matmul_all_reduce(a, w, chunks=2)
    out["fused_ref"] = sum(torch.randn(12, 8, generator=torch.Generator().manual_seed(r),
                                       dtype=torch.float64) @
                           torch.randn(8, 6, generator=torch.Generator().manual_seed(9 + r),
                                       dtype=torch.float64) for r in range(world))
    gathered = torch.empty(world, 3, dtype=torch.float64)
    transport.all_gather(gathered, torch.full((1, 3), float(rank), dtype=torch.float64),
                         [1] * world)
    out["gathered"] = gathered[:, 0].tolist()
    return out


@needs_netns
def test_two_hosts_of_two_ranks_take_shared_memory_inside_and_gloo_between():
    with EmulatedCluster(hosts=2, link="1gbit", tag="shmhier") as cluster:
        results = launch(_mixed, 4, cluster=cluster, env={"PLAIT_TRANSPORT": "auto"},
                         threads=1, timeout_s=60)
        single = launch(_mixed, 2, cluster=cluster, env={"PLAIT_TRANSPORT": "auto"},
                        threads=1, timeout_s=60)
    assert all(r["transport"] == "shm+gloo" for r in results), results[0]["reason"]
    assert "2 hosts" in results[0]["reason"]
    for n in (1000, 300_000):
        for r in results:
            assert torch.equal(r[n][0], results[0][n][0]) and r[n][1] < 1e-12, (n, r[n][1])
    for r in results:
        assert torch.equal(r["fused"], results[0]["fused"])
        assert float((r["fused"] - r["fused_ref"]).abs().max()) < 1e-12
        assert r["gathered"] == [0.0, 1.0, 2.0, 3.0]
    # one rank per host: nothing shares memory
    assert all(r["transport"] == "gloo" for r in single), single[0]["reason"]
    assert "a host of its own" in single[0]["reason"]
