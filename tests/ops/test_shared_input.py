"""Column-parallel siblings reading one input (q/k/v; gate/up): one input-gradient
all-reduce instead of one each, fused and plain, on 2 and 3 ranks with uneven shards,
against a single-process reference (float64, |error| ≤ 1e-10)."""

import pytest
import torch
import torch.distributed as dist

from plait.ops import explain
from plait.transport import base
from plait.ops.shared_input import SharedInput
from plait.testing import run_ranks

TOL = 1e-10


def _backward_counting_all_reduces(outs, grads) -> list[tuple]:
    """``autograd.backward(outs, grads)``; the shape of every all-reduce it sent."""
    calls = []
    real = base.dist_all_reduce

    def counted(tensor, *a, **kw):
        calls.append(tuple(tensor.shape))
        return real(tensor, *a, **kw)
    base.dist_all_reduce = counted
    try:
        torch.autograd.backward(outs, grads)
    finally:
        base.dist_all_reduce = real
    return calls


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _cut(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _err(a, b):
    return float((a.detach() - b).abs().max()) if a.numel() else 0.0


def _siblings_case(shards, overlap, chunks, other, into=False):
    """x [2, 6, K] read by len(shards) siblings (sibling j's columns split ``shards[j]``);
    ``other``: one more sibling call on another tensor (2·x), which needs its own wrap;
    ``into``: each weight a parameter p [N_j, K] passed as p.t() with ``wgrad_into=p``."""
    from plait.ops import deferred

    r, k = dist.get_rank(), 5
    X = _full(1, 2, 6, k)
    Ws = [_full(10 + j, k, sum(s)) for j, s in enumerate(shards)]
    Gs = [_full(20 + j, 2, 6, sum(s)) for j, s in enumerate(shards)]
    x = X.clone().requires_grad_()
    ps = [W[:, _cut(s, r)].t().contiguous().requires_grad_() for W, s in zip(Ws, shards)]
    ws = [p.t() for p in ps]
    shared = SharedInput(overlap=overlap, chunks=chunks)
    width = sum(w.shape[1] for w in ws)
    h = x * 1.0  # a non-leaf, as a layer's input is
    ys = [shared.matmul(h, w, width=width, wgrad_into=p if into else None)
          for w, p in zip(ws, ps)]
    outs, grads = list(ys), [G[..., _cut(s, r)] for G, s in zip(Gs, shards)]
    if other:
        outs.append(shared.matmul(2 * h, ws[0], width=width, wgrad_into=ps[0] if into else None))
        grads.append(grads[0])
    calls = _backward_counting_all_reduces(outs, grads)
    dx = sum(G @ W.T for G, W in zip(Gs, Ws)) * 1.0
    if other:
        dx = dx + 2 * (Gs[0] @ Ws[0].T)
    dws = [(X.flatten(0, 1).T @ G.flatten(0, 1)) for G in Gs]
    if other:
        dws[0] = dws[0] + (2 * X).flatten(0, 1).T @ Gs[0].flatten(0, 1)
    err = {"dx": _err(x.grad, dx)}
    err.update({f"y{j}": _err(y, (X @ W)[..., _cut(s, r)])
                for j, (y, W, s) in enumerate(zip(ys, Ws, shards))})
    err.update({f"dw{j}": _err(p.grad.t(), dW[:, _cut(s, r)])
                for j, (p, dW, s) in enumerate(zip(ps, dws, shards))})
    err["pending"] = deferred.pending()
    path = explain("column_parallel_matmul.dgrad") if overlap else None
    return err, calls, shared.wraps, path


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_siblings_sum_their_input_grads_before_one_all_reduce(world, overlap):
    # q/k/v-like: three siblings, uneven and one empty share on 3 ranks
    shards = [[4, 2, 3][:world], [1, 3, 0][:world], [2, 2, 2][:world]]
    for chunks, into in ((1, False), (3, True)):
        for err, calls, wraps, path in run_ranks(_siblings_case, world, shards, overlap, chunks,
                                                 False, into):
            assert max(err.values()) < TOL, err
            assert wraps == 1
            # one [M, K] all-reduce (in pieces when fused), not one per sibling
            assert sum(c[0] for c in calls) == 12 and all(c[1] == 5 for c in calls), calls
            if overlap:
                assert len(calls) == chunks and path.startswith(
                    f"column_parallel_matmul.dgrad: {'fused' if chunks > 1 else 'fallback'} "
                    f"({chunks} piece"), (calls, path)
            else:
                assert len(calls) == 1, calls


def test_a_sibling_reading_another_tensor_has_its_own_all_reduce():
    for overlap in (True, False):
        for err, calls, wraps, _ in run_ranks(_siblings_case, 2, [[3, 2], [2, 4]], overlap, 1,
                                              True, True):
            assert max(err.values()) < TOL, err
            assert wraps == 2 and len(calls) == 2, (wraps, calls)


def _no_grad_case():
    shared = SharedInput(chunks=1)
    x = _full(1, 4, 3).requires_grad_()
    w = _full(2, 3, 2)
    with torch.no_grad():
        y = shared.matmul(x, w)
    z = shared.matmul(x.detach(), w)  # x needs no gradient: nothing to reduce
    return _err(y, x.detach() @ w), _err(z, x.detach() @ w), shared.wraps


def test_no_gradient_means_no_wrap_and_no_collective():
    for y, z, wraps in run_ranks(_no_grad_case, 2):
        assert y == 0 and z == 0 and wraps == 0


def _together_case(shards, overlap, chunks, use, again):
    """``SharedInput.linear``: the siblings (sibling j's columns split ``shards[j]``) as one
    GEMM; ``use``: which siblings' outputs reach the loss; ``again``: sibling 0 reads x a
    second time (a GEMM and an all-reduce of its own). Weights are parameters [N_j, K] with
    a gradient hook each, which sees their gradients: they come through autograd."""
    r, k = dist.get_rank(), 5
    X = _full(1, 2, 6, k)
    Ws = [_full(10 + j, k, sum(s)) for j, s in enumerate(shards)]
    Gs = [_full(20 + j, 2, 6, sum(s)) for j, s in enumerate(shards)]
    x = X.clone().requires_grad_()
    ps = tuple(W[:, _cut(s, r)].t().contiguous().requires_grad_() for W, s in zip(Ws, shards))
    hooked = []
    for j, p in enumerate(ps):
        p.register_hook(lambda g, j=j: hooked.append(j) if g is not None else None)
    shared = SharedInput(overlap=overlap, chunks=chunks)
    h = x * 1.0  # a non-leaf, as a layer's input is
    ys = [shared.linear(h, ps, j) for j in range(len(ps))]
    outs = [ys[j] for j in use]
    grads = [Gs[j][..., _cut(shards[j], r)] for j in use]
    if again:
        outs.append(shared.linear(h, ps, 0))
        grads.append(grads[0] if 0 in use else Gs[0][..., _cut(shards[0], r)])
    calls = _backward_counting_all_reduces(outs, grads)
    reads = list(use) + ([0] if again else [])
    dx = sum(Gs[j] @ Ws[j].T for j in reads)
    err = {"dx": _err(x.grad, dx)}
    err.update({f"y{j}": _err(y, (X @ W)[..., _cut(s, r)])
                for j, (y, W, s) in enumerate(zip(ys, Ws, shards))})
    for j, (p, s) in enumerate(zip(ps, shards)):
        dW = sum((X.flatten(0, 1).T @ Gs[i].flatten(0, 1) for i in reads if i == j),
                 torch.zeros(k, sum(s), dtype=torch.float64))
        err[f"dw{j}"] = _err(p.grad.t(), dW[:, _cut(s, r)]) if p.grad is not None else \
            (0.0 if j not in reads else float("inf"))
    nones = [j for j, p in enumerate(ps) if p.grad is None]
    return err, calls, shared.wraps, sorted(hooked), nones


def _together_cases(cases):
    return [_together_case(*case) for case in cases]


@pytest.mark.parametrize("world", [2, 3])
def test_siblings_as_one_gemm_match_one_process(world):
    shards = [[4, 2, 3][:world], [1, 3, 0][:world], [2, 2, 2][:world]]
    cases = [(shards, overlap, chunks, use, False) for overlap in (True, False)
             for chunks, use in ((1, (0, 1, 2)), (3, (0, 2)))]
    if world == 2:  # sibling 0 reads x again: a GEMM and an all-reduce of its own
        cases += [([[3, 2], [2, 4]], overlap, 1, (0, 1), True) for overlap in (True, False)]
    for per_rank in run_ranks(_together_cases, world, cases):
        for (_, overlap, chunks, use, again), got in zip(cases, per_rank):
            err, calls, wraps, hooked, nones = got
            assert max(err.values()) < TOL, err
            if again:
                assert wraps == 2 and len(calls) == 2, (wraps, calls)
                continue
            assert wraps == 1 and sum(c[0] for c in calls) == 12, (wraps, calls)
            assert len(calls) == (chunks if overlap else 1), calls
            # every used weight's gradient came through autograd (its hook saw it); none else
            assert hooked == sorted(use) and nones == [j for j in range(3) if j not in use]
