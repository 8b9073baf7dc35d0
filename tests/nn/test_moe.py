"""Expert-parallel MoE against the single-device MoEFeedForward on 2 and 4 ranks.

Tolerance: float64, outputs and every gradient (tokens, router, experts)
within 1e-12. Even and uneven expert plans, uneven tokens per rank, fused
(``chunks=2``) and plain; tokens distinct per rank, or replicated. The layer's routed load
(``MoE.routed``, from its count exchange) is the single device's top-k counts, on every rank.
"""

import pytest
import torch
import torch.distributed as dist

from plait.models import MoEFeedForward
from plait.nn import MoE, ShardPlan
from plait.testing import raised, run_ranks

TOL = 1e-12
H, F, E, TOKENS = 4, 6, 5, 11


def _problem(seed):
    torch.manual_seed(seed)
    ref = MoEFeedForward(H, F, E, top_k=2).double()
    with torch.no_grad():  # larger weights than the model's init: routing and outputs vary
        ref.router.weight.normal_()
        ref.w1.normal_()
        ref.w2.normal_()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(TOKENS, H, generator=g, dtype=torch.float64).requires_grad_()
    grad = torch.randn(TOKENS, H, generator=g, dtype=torch.float64)
    out = ref(x)
    (out * grad).sum().backward()
    return ref, x, grad, out.detach()


def _err(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


def _case(plan, tokens, overlap, replicated, seed):
    rank = dist.get_rank()
    ref, x_ref, grad, want = _problem(seed)
    layer = MoE.from_module(ref, plan=None if plan is None else ShardPlan(plan), overlap=overlap,
                            chunks=2, replicated_input=replicated)
    rows = slice(None) if replicated else slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    x = x_ref.detach()[rows].clone().requires_grad_()
    out = layer(x)
    (out * grad[rows]).sum().backward()
    mine = layer.plan.slice_of(rank)
    errs = [_err(out.detach(), want[rows]), _err(x.grad, x_ref.grad[rows]),
            _err(layer.router.weight.grad, ref.router.weight.grad),
            _err(layer.w1.grad, ref.w1.grad[mine]), _err(layer.w2.grad, ref.w2.grad[mine])]
    state = layer.full_state_dict()
    exact = all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    routed = layer.routed.take()
    return max(errs), exact, routed, layer.routed.take()


def _routed_alone(seed) -> list[int]:
    from plait.nn.moe import route_top_k

    ref, x, _, _ = _problem(seed)
    _, experts = route_top_k(ref.router(x.detach()), ref.top_k)
    return torch.bincount(experts.reshape(-1), minlength=E).tolist()


def _run(cases):
    return [_case(*c) for c in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_moe_matches_single_device(world):
    plan = {2: [4, 1], 4: [1, 2, 1, 1]}[world]
    tokens = {2: [8, 3], 4: [4, 0, 5, 2]}[world]
    even = [TOKENS // world + (r < TOKENS % world) for r in range(world)]
    cases = [(None, even, True, False, 1), (None, even, False, False, 1),
             (plan, tokens, True, False, 2), (plan, tokens, False, False, 2),
             (plan, tokens, True, True, 3), (None, even, False, True, 3)]
    for per_rank in run_ranks(_run, world, cases):
        for case, (err, exact, routed, after) in zip(cases, per_rank):
            assert err < TOL and exact, (case, err)
            assert routed == _routed_alone(case[-1]) and after == [0] * E, (case, routed)


def _errors():
    ref = MoEFeedForward(H, F, E)
    attempts = {
        "empty_rank": lambda: MoE.from_module(ref, plan=ShardPlan((5, 0))),
        "short": lambda: MoE.from_module(ref, plan=ShardPlan((2, 2))),
        "w1_shape": lambda: MoE(H, F, E, full_w1=torch.zeros(E, F, H)),
        "top_k": lambda: MoE(H, F, E, top_k=6),
    }
    return raised(attempts)


def test_bad_plans_and_weights_raise_at_construction():
    seen = run_ranks(_errors, 2)[0]
    assert "shard sizes [5, 0] leave rank 1 with no experts" in seen["empty_rank"]
    assert "sum to 4 experts, but the dimension has 5" in seen["short"]
    assert "w1 has shape (5, 6, 4), but the layer's full w1 is (5, 4, 6)" in seen["w1_shape"]
    assert "top_k" in seen["top_k"]
