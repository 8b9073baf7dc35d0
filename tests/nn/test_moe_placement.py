"""Experts placed anywhere and replicated, moved mid-training with their AdamW state: the
single device's losses, float64, on 2 and 3 ranks.

A float64 MoE (8 experts, top-2) trains 6 AdamW steps on each rank's own tokens against the
single-device ``MoEFeedForward`` on all of them. After step 2 the experts move
(``MoE.place``) to a placement ``plait.balance.experts.place_experts`` makes for a skewed
load: experts change ranks and the hot ones get copies, each copy taking a
share of its rows. Every step's loss, and at the end every weight (gathered), equal the
single device's within 1e-10; the copies of an expert stay equal. Without the copies'
gradients summed (``sum_replica_grads`` made a no-op), the losses part from the single
device's (the test would fail: it is checked here too).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from plait.balance.experts import place_experts
from plait.models import MoEFeedForward
from plait.nn import MoE
from plait.nn.placement import Homes
from plait.testing import run_ranks

TOL = 1e-10
H, F, E, TOKENS, STEPS, MOVE_AT = 8, 12, 8, 48, 6, 2


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(TOKENS, H, generator=g, dtype=torch.float64)
    target = torch.randn(TOKENS, H, generator=g, dtype=torch.float64)
    return x, target


def _reference() -> tuple[MoEFeedForward, list[float]]:
    torch.manual_seed(0)
    ref = MoEFeedForward(H, F, E, top_k=2).double()
    with torch.no_grad():
        ref.router.weight.normal_()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, target = _data(step)
        loss = (ref(x) - target).square().sum() / TOKENS
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return ref, losses


def _homes(world: int) -> Homes:
    loads = [90, 3, 8, 2, 4, 5, 6, 2]  # a skewed routing: expert 0 over any rank's share
    speeds = [1.0] * world  # expert 0 split near evenly: every copy takes rows
    placement = place_experts(loads, speeds)
    assert placement.copies() >= 1  # the test moves copies, not only whole experts
    return Homes(placement.replicas, world)


def _train(world: int, summed: bool = True):
    import plait.nn.placement as placement

    if not summed:
        placement.sum_replica_grads = lambda grad, *a, **k: grad
        import plait.nn.moe as moe

        moe.sum_replica_grads = placement.sum_replica_grads
    rank = dist.get_rank()
    torch.manual_seed(0)
    single = MoEFeedForward(H, F, E, top_k=2).double()
    with torch.no_grad():
        single.router.weight.normal_()
    layer = MoE.from_module(single, chunks=2)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    rows = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    losses, moved = [], None
    for step in range(STEPS):
        if step == MOVE_AT:
            moved = layer.place(_homes(world), opt)
        x, target = _data(step)
        part = (layer(x[rows]) - target[rows]).square().sum() / TOKENS
        opt.zero_grad()
        part.backward()
        opt.step()
        total = part.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    slots = layer.homes.slots(rank)
    return losses, layer.full_state_dict(), moved, slots, layer.w1.detach().clone()


@pytest.mark.parametrize("world", [2, 3])
def test_moved_and_replicated_experts_train_as_one_device(world):
    ref, want = _reference()
    out = run_ranks(_train, world, world, timeout_s=120)
    losses, state, moved, _, _ = out[0]
    assert moved >= 1
    assert max(abs(a - b) for a, b in zip(losses, want)) < TOL, (losses, want)
    for key, value in ref.state_dict().items():
        assert float((state[key] - value).abs().max()) < TOL, key
    homes = _homes(world)
    for e in homes.replicated():  # every copy of a replicated expert holds the same weights
        copies = [out[r][4][out[r][3].index(e)] for r, _ in homes.homes[e]]
        assert all(torch.equal(copies[0], c) for c in copies[1:]), e


def test_without_summed_copies_the_losses_part():
    _, want = _reference()
    losses = run_ranks(_train, 2, 2, False, timeout_s=120)[0][0]
    assert max(abs(a - b) for a, b in zip(losses[MOVE_AT + 1:], want[MOVE_AT + 1:])) > 1e-6


def test_a_placement_that_leaves_a_rank_empty_or_splits_wrong_is_refused():
    with pytest.raises(ValueError, match="would hold no expert"):
        Homes((((0, 1.0),), ((0, 1.0),)), 2)
    with pytest.raises(ValueError, match="sum to 1"):
        Homes((((0, 0.5), (1, 0.4)), ((1, 1.0),)), 2)
    homes = Homes((((0, 0.5), (1, 0.5)), ((1, 1.0),)), 2)
    assert homes.split(0, 7) == [4, 3] and homes.slots(1) == [0, 1]
    send, recv = homes.send_recv([[7, 2], [3, 5]], 0)
    assert send == [[4], [3, 2]] and recv == [[4], [2]]
