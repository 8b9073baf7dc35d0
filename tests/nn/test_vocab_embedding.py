"""VocabParallelEmbedding against nn.Embedding on 2 and 3 ranks (uneven rows), on shared
memory and gloo: the lookup bit-identical on every rank, forward and backward, and a row
of inf or NaN owned by one rank appearing where it is looked up and nowhere else (a rank
that does not own an id contributes exact zeros, not its row times 0).
"""

import pytest
import torch
import torch.nn as nn

from plait.parallel.layers import VocabParallelEmbedding
from plait.plan import ShardPlan
from plait.testing import run_ranks

V, D = 11, 4
PLANS = {2: (7, 4), 3: (5, 2, 4)}


def _case(plan, dtype):
    torch.manual_seed(0)
    ref = nn.Embedding(V, D, padding_idx=1).to(dtype)
    with torch.no_grad():  # the first row of every shard: what a rank looks up for an id
        at = 0             # it does not own, were the lookup masked by a product
        for size in plan:
            ref.weight[at, 0] = float("inf")
            ref.weight[at, 1] = float("nan")
            at += size
    layer = VocabParallelEmbedding(ref, plan=ShardPlan(plan))
    finite = torch.tensor([[2, 3, 10], [6, 8, 9]])  # no shard's first row
    with torch.no_grad():
        decoded = layer(finite)  # a decoding step's path
    ids = torch.tensor([[0, 2, 7], [1, 10, 5]])
    out = layer(ids)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (out * grad).sum().backward()
    want = ref(ids)
    (want * grad).sum().backward()
    mine = layer.plan.slice_of(layer.info.rank)
    return (torch.equal(decoded, ref(finite).detach()), bool(torch.isfinite(decoded).all()),
            torch.equal(out.detach().nan_to_num(), want.detach().nan_to_num()),
            torch.equal(layer.weight.grad, ref.weight.grad[mine]))


def _run(world, transport):
    return [_case(PLANS[world], dtype) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world", [2, 3])
def test_lookup_is_exact_and_owned_rows_alone(world, transport):
    results = run_ranks(_run, world, world, transport, env={"PLAIT_TRANSPORT": transport})
    for rank, per_dtype in enumerate(results):
        for dtype, (decoded, finite, forward, grads) in zip(("fp32", "bf16"), per_dtype):
            assert finite, (rank, dtype, "an unowned row's inf/NaN leaked into the lookup")
            assert decoded and forward and grads, (rank, dtype, decoded, forward, grads)
