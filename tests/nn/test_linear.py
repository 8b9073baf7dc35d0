"""ColumnParallelLinear / RowParallelLinear against nn.Linear on 2 and 4 ranks.

Tolerance: float64, |error| ≤ 1e-10 for outputs and every gradient (the
sharded sums run in another order than one GEMM); weights and
``to_module`` / ``full_state_dict`` round trips exactly (they are copies).
Every case runs fused (``chunks=2``) and plain, with and without sequence
parallelism, with even and uneven plans.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from plait.nn import ColumnParallelLinear, RowParallelLinear, ShardPlan
from plait.nn._shard import shard_of
from plait.ops import explain
from plait.testing import raised, run_ranks

TOL = 1e-10
B, S = 2, 5


def _t(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _reference(k, n, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, dtype=torch.float64)
    x = _t(seed + 1, B, S, k).requires_grad_()
    g = _t(seed + 2, B, S, n)
    y = lin(x)
    (y * g).sum().backward()
    return lin, x, g, y.detach()


def _seq_cut(seq_sizes, rank):
    start = sum(seq_sizes[:rank])
    return slice(start, start + seq_sizes[rank])


def _err(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


def _column_case(k, heads, unit, blocks, sizes, overlap, sp, seq_sizes):
    rank = dist.get_rank()
    plan = None if sizes is None else ShardPlan(sizes)
    lin, x_ref, g, y_ref = _reference(k, blocks * heads * unit, seed=len(str(sizes)) + unit)
    layer = ColumnParallelLinear.from_module(
        lin, plan=plan, unit=unit, blocks=blocks, overlap=overlap, chunks=2,
        sequence_parallel=sp, seq_plan=None if seq_sizes is None else ShardPlan(seq_sizes))
    plan = layer.plan
    cut = _seq_cut(seq_sizes or _even(S), rank) if sp else slice(None)
    x = x_ref.detach()[:, cut].clone().requires_grad_()
    y = layer(x)
    mine = lambda t, dim: shard_of(t, plan, rank, dim, blocks=blocks, unit=unit)  # noqa: E731
    (y * mine(g, -1)).sum().backward()
    errs = [_err(y.detach(), mine(y_ref, -1)), _err(x.grad, x_ref.grad[:, cut]),
            _err(layer.weight.grad, mine(lin.weight.grad, 0)),
            _err(layer.bias.grad, mine(lin.bias.grad, 0))]
    back = layer.to_module()
    exact = torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)
    return max(errs), exact


def _row_case(k, n, unit, sizes, overlap, sp, seq_sizes):
    rank = dist.get_rank()
    lin, x_ref, g, y_ref = _reference(k, n, seed=3 + len(str(sizes)))
    layer = RowParallelLinear.from_module(
        lin, plan=None if sizes is None else ShardPlan(sizes), unit=unit, overlap=overlap,
        chunks=2, sequence_parallel=sp, seq_plan=None if seq_sizes is None else ShardPlan(seq_sizes))
    plan = layer.plan
    cut = _seq_cut(seq_sizes or _even(S), rank) if sp else slice(None)
    x = shard_of(x_ref.detach(), plan, rank, -1, unit=unit).requires_grad_()
    y = layer(x)
    (y * g[:, cut]).sum().backward()
    errs = [_err(y.detach(), y_ref[:, cut]),
            _err(x.grad, shard_of(x_ref.grad, plan, rank, -1, unit=unit)),
            _err(layer.weight.grad, shard_of(lin.weight.grad, plan, rank, 1, unit=unit)),
            _err(layer.bias.grad, lin.bias.grad)]
    state = layer.full_state_dict()
    exact = torch.equal(state["weight"], lin.weight) and torch.equal(state["bias"], lin.bias)
    return max(errs), exact


def _even(total):
    world = dist.get_world_size()
    return [total // world + (r < total % world) for r in range(world)]


def _reshard_case(uneven):
    """Column and row layers moved to another plan: the same weights, gradients and outputs."""
    rank = dist.get_rank()
    out = []
    for cls, dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1)):
        lin, x_ref, g, y_ref = _reference(12, 12, seed=7)
        layer = cls.from_module(lin, chunks=2)
        x = x_ref.detach() if dim == 0 else shard_of(x_ref.detach(), layer.plan, rank, -1)
        y = layer(x)
        gy = shard_of(g, layer.plan, rank, -1) if dim == 0 else g
        (y * gy).sum().backward()
        new = ShardPlan(uneven)
        weight = layer.weight
        layer.reshard(new)
        same_param = layer.weight is weight
        w_ok = torch.equal(layer.weight.detach(), shard_of(lin.weight.detach(), new, rank, dim))
        g_ok = _err(layer.weight.grad, shard_of(lin.weight.grad, new, rank, dim)) < TOL
        x2 = x_ref.detach() if dim == 0 else shard_of(x_ref.detach(), new, rank, -1)
        y2 = layer(x2).detach()
        want = shard_of(y_ref, new, rank, -1) if dim == 0 else y_ref
        out.append((same_param, w_ok, g_ok, _err(y2, want) < TOL))
    return out


def _run_all(cases):
    results = []
    for kind, args in cases:
        results.append((kind, args, (_column_case if kind == "col" else _row_case)(*args)))
    results.append(("reshard", (), _reshard_case([1, 11] if dist.get_world_size() == 2
                                                 else [2, 5, 1, 4])))
    results.append(("paths", (), explain()))
    return results


def _cases(world):
    uneven_cols = {2: [5, 1], 4: [1, 2, 2, 1]}[world]   # of 6 units
    uneven_heads = {2: [3, 1], 4: [1, 1, 1, 1]}[world]  # of 4 heads
    uneven_seq = {2: [1, 4], 4: [2, 0, 2, 1]}[world]    # of S = 5
    cases = []
    for sizes in (None, uneven_cols):
        for overlap in (True, False):
            for sp in (False, True):
                seq = uneven_seq if (sp and sizes) else None
                cases.append(("col", (8, 6, 1, 1, sizes, overlap, sp, seq)))
                cases.append(("row", (6, 7, 1, sizes, overlap, sp, seq)))
    # QKV-style: 3 blocks of 4 heads of 2 columns; the matching row layer counts heads too
    for sp in (False, True):
        cases.append(("col", (8, 4, 2, 3, uneven_heads, True, sp, None)))
        cases.append(("row", (8, 5, 2, uneven_heads, True, sp, None)))
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_linear_layers_match_nn_linear(world):
    cases = _cases(world)
    results = run_ranks(_run_all, world, cases)
    for rank_results in results:
        for kind, args, value in rank_results:
            if kind == "reshard":
                assert all(all(flags) for flags in value), value
                continue
            if kind == "paths":  # the fused operators really ran fused (chunks=2)
                for op in ("matmul_all_reduce", "column_parallel_matmul.dgrad",
                           "all_gather_matmul", "matmul_reduce_scatter"):
                    assert f"{op}: fused" in value, value
                continue
            err, exact = value
            assert err < TOL, (kind, args, err)
            assert exact, (kind, args)


# --- construction errors ----------------------------------------------------

def _errors():
    lin = nn.Linear(8, 6)
    attempts = {
        "short": lambda: ColumnParallelLinear.from_module(lin, plan=ShardPlan((3, 2))),
        "empty_rank": lambda: ColumnParallelLinear(8, 6, plan=ShardPlan((6, 0))),
        "world": lambda: RowParallelLinear(8, 6, plan=ShardPlan((2, 2, 4))),
        "weight_shape": lambda: ColumnParallelLinear(8, 6, full_weight=torch.zeros(8, 6)),
        "bias_shape": lambda: RowParallelLinear(8, 6, full_weight=torch.zeros(6, 8),
                                                full_bias=torch.zeros(8)),
        "heads": lambda: ColumnParallelLinear(8, 24, blocks=3, unit=3),
        "not_a_plan": lambda: ColumnParallelLinear(8, 6, plan=[3, 3]),
        "not_linear": lambda: RowParallelLinear.from_module(nn.Conv1d(2, 2, 1)),
    }
    return raised(attempts)


def test_bad_plans_and_weights_raise_at_construction():
    seen = run_ranks(_errors, 2)[0]
    assert "sum to 5 columns, but the dimension has 6" in seen["short"]
    assert "shard sizes [6, 0] leave rank 1 with no columns" in seen["empty_rank"]
    assert "name 3 ranks, but the group has 2" in seen["world"]
    assert "weight has shape (8, 6), but the layer's full weight is (6, 8)" in seen["weight_shape"]
    assert "bias has shape (8,)" in seen["bias_shape"]
    assert "not 3 block(s) of whole units of 3" in seen["heads"]
    assert seen["not_a_plan"].startswith("TypeError") and "ShardPlan" in seen["not_a_plan"]
    assert seen["not_linear"].startswith("TypeError")


def _world_of_one():
    lin = nn.Linear(4, 3, dtype=torch.float64)
    col, row = ColumnParallelLinear.from_module(lin), RowParallelLinear.from_module(lin)
    x = _t(0, 2, 4)
    assert torch.equal(col(x), lin(x)) and torch.equal(row(x), lin(x))
    assert torch.equal(col.to_module().weight, lin.weight)
    with pytest.raises(ValueError, match="name 2 ranks, but the group has 1"):
        ColumnParallelLinear(4, 4, plan=ShardPlan((2, 2)))


def test_a_world_of_one_is_the_plain_layer_and_no_group_is_an_error():
    """Without torch.distributed initialised a layer would run as a world of one on every
    process, each the whole model: refused, naming what to call."""
    run_ranks(_world_of_one, 1)
    lin = nn.Linear(4, 3)
    for make in (ColumnParallelLinear.from_module, RowParallelLinear.from_module):
        with pytest.raises(ValueError, match="need torch.distributed initialised"):
            make(lin)


# --- straggler emulation: forward and backward compute are both slowed --------

def _straggled():
    from plait.runtime import rank_context

    lin = nn.Linear(256, 256)
    straggler = rank_context().straggler
    out = []
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls.from_module(lin, chunks=2)
        x = torch.randn(64, 256 if cls is ColumnParallelLinear else 128, requires_grad=True)
        before = straggler.delayed_s
        y = layer(x)
        forward = straggler.delayed_s - before
        y.sum().backward()
        out.append((forward, straggler.delayed_s - before - forward))
    return out


def test_a_slow_rank_is_slow_in_forward_and_backward():
    from plait.runtime import launch, parse_slow

    fast, slow = launch(_straggled, 2, slow=[parse_slow("1:3")], timeout_s=30, threads=1)
    assert all(f == 0 and b == 0 for f, b in fast), fast
    assert all(f > 0 and b > 0 for f, b in slow), slow
