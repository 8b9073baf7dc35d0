"""ShardedEmbeddingBag against the single-device EmbeddingBagCollection on 2 and 4 ranks.

Tolerance: float64; pooled outputs and table gradients within 1e-12 (the same
sums, in another order only where a bag's rows arrive in pieces); weights and
round trips exactly. Even and uneven table plans and batch plans, fused
(``chunks=2``) and plain.
"""

import pytest
import torch
import torch.distributed as dist

from plait.models import EmbeddingBagCollection
from plait.nn import ShardPlan, ShardedEmbeddingBag
from plait.testing import raised, run_ranks

TOL = 1e-12
ROWS = [7, 3, 11, 5, 4, 9]
D, BATCH = 3, 9


def _problem(tables, seed=0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ref = EmbeddingBagCollection(ROWS[:tables], D).double()
    indices, offsets = [], []
    for n in ROWS[:tables]:
        lengths = torch.randint(0, 4, (BATCH,), generator=g)  # empty bags too
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
        indices.append(torch.randint(0, n, (int(lengths.sum()),), generator=g))
    grad = torch.randn(BATCH, tables, D, generator=g, dtype=torch.float64)
    out = ref(indices, offsets)
    (out * grad).sum().backward()
    return ref, indices, offsets, grad, out.detach()


def _case(tables, plan, batch, overlap):
    rank = dist.get_rank()
    ref, indices, offsets, grad, want = _problem(tables, seed=tables + len(str(plan)))
    layer = ShardedEmbeddingBag.from_module(
        ref, plan=None if plan is None else ShardPlan(plan), overlap=overlap, chunks=2,
        batch_plan=None if batch is None else ShardPlan(batch))
    sizes = layer.batch_sizes(BATCH)
    rows = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    out = layer(indices, offsets)
    (out * grad[rows]).sum().backward()
    err = float((out.detach() - want[rows]).abs().max()) if out.numel() else 0.0
    for t in layer.owned:
        err = max(err, float((layer.bags[str(t)].weight.grad - ref.bags[t].weight.grad).abs().max()))
    back = layer.to_module()
    exact = all(torch.equal(b.weight, r.weight) for b, r in zip(back, ref.bags))
    return err, exact, list(layer.owned)


def _run(cases):
    return [_case(*c) for c in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_embedding_bag_matches_single_device(world):
    uneven = {2: (5, [4, 1], [2, 7]), 4: (6, [1, 2, 2, 1], [3, 0, 4, 2])}[world]
    tables, plan, batch = uneven
    cases = [(tables, None, None, True), (tables, None, None, False),
             (tables, plan, batch, True), (tables, plan, batch, False)]
    results = run_ranks(_run, world, cases)
    for per_rank in results:
        for case, (err, exact, owned) in zip(cases, per_rank):
            assert err < TOL and exact, (case, err)
    owned = [per_rank[2][2] for per_rank in results]  # the uneven plan's tables, by rank
    assert sum(owned, []) == list(range(tables)) and [len(o) for o in owned] == plan


def _errors():
    ref = EmbeddingBagCollection(ROWS[:3], D)
    attempts = {
        "empty_rank": lambda: ShardedEmbeddingBag.from_module(ref, plan=ShardPlan((3, 0))),
        "short": lambda: ShardedEmbeddingBag.from_module(ref, plan=ShardPlan((1, 1))),
        "weight_shape": lambda: ShardedEmbeddingBag([7, 3], D, full_weights=[torch.zeros(7, D),
                                                                              torch.zeros(3, D + 1)]),
        "not_bags": lambda: ShardedEmbeddingBag.from_module(torch.nn.Linear(2, 2)),
    }
    return raised(attempts)


def test_bad_plans_and_tables_raise_at_construction():
    seen = run_ranks(_errors, 2)[0]
    assert "shard sizes [3, 0] leave rank 1 with no tables" in seen["empty_rank"]
    assert "sum to 2 tables, but the dimension has 3" in seen["short"]
    assert "table 1 weight has shape (3, 4), but the layer's full table 1 weight is (3, 3)" \
        in seen["weight_shape"]
    assert seen["not_bags"].startswith("TypeError")
