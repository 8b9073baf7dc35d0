"""Every fused operator, forward and backward, on shared memory against the same calls on gloo:
3 ranks with uneven shares, float64, float32 and bfloat16, each operator at 3 pieces (the
cases of tests/ops/test_uneven_dtypes.py, one launch per transport).

The outputs are the same bits on both transports wherever the operator gathers or
exchanges (all_gather_matmul's forward, the embedding's and the MoE's all-to-alls); where
it all-reduces, every rank holds the same bits (shared memory sums in rank order; gloo's
ring in its own); and every output and gradient is within its dtype's tolerance of the
float64 reference, as on gloo.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
import test_uneven_dtypes as cases  # noqa: E402  (the cases and their reference)

from plait.testing import run_ranks  # noqa: E402


def _tensors():
    """Per (operator, dtype): every output and gradient, and the paths taken."""
    from plait.ops import get_context

    out = {}
    for name, case in cases.CASES.items():
        for dtype_name, dtype in cases.DTYPES.items():
            tensors, taken = case(dtype)
            out[name, dtype_name] = ({k: (got.detach().cpu(), cases._rel(got, want))
                                      for k, (got, want) in tensors.items()}, taken)
    return out, get_context().mover().name


@pytest.fixture(scope="module")
def both():
    return {name: run_ranks(_tensors, cases.WORLD, env={"PLAIT_TRANSPORT": name}, timeout_s=60)
            for name in ("gloo", "shm")}


EXCHANGED = {("all_gather_matmul", "y"), ("embedding_all_to_all", "out"),
             ("all_to_all_matmul + matmul_all_to_all", "y"),
             ("all_to_all_matmul + matmul_all_to_all", "out")}
REPLICATED = {("matmul_all_reduce", "y"), ("matmul_all_reduce (GEMV: pieces cut N)", "y"),
              ("column_parallel_matmul", "dx")}


def test_every_fused_operator_on_shared_memory_equals_gloo(both):
    for rank in range(cases.WORLD):
        (gloo, gloo_name), (shm, shm_name) = both["gloo"][rank], both["shm"][rank]
        assert (gloo_name, shm_name) == ("gloo", "shm")
        for key, (tensors, taken) in shm.items():
            assert taken == gloo[key][1], (key, taken)  # the same pieces ran
            assert all(path == "fused" for path, _ in taken.values()), (key, taken)
            for name, (got, err) in tensors.items():
                assert err <= cases.TOL[key[1]], (key, name, err)
                if (key[0], name) in EXCHANGED:
                    assert torch.equal(got, gloo[key][0][name][0]), (key, name)
                if (key[0], name) in REPLICATED:
                    assert torch.equal(got, both["shm"][0][0][key][0][name][0]), (key, name)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("plait-shm-")]


def _gemv_layouts(mixed: bool):
    """A GEMV at ``chunks="auto"`` on shared memory (the product made in the slot, transposed
    where w is column-major): the result, or the refusal when one rank's w is row-major."""
    import torch.distributed as dist
    from plait import ops

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    X, W = torch.randn(3, 4 * world, generator=gen, dtype=torch.float64), \
        torch.randn(4 * world, 10, generator=gen, dtype=torch.float64)
    x, w = X[:, 4 * rank:4 * rank + 4], W[4 * rank:4 * rank + 4]
    column_major = w.t().contiguous().t()
    try:
        y = ops.matmul_all_reduce(x, w.contiguous() if mixed and rank == 1 else column_major)
    except ValueError as err:
        return str(err)
    # made transposed: returned as the [M, N] view of the [N, M] buffer, not copied
    return float((y - X @ W).abs().max()), y.t().is_contiguous(), ops.explain("matmul_all_reduce")


@pytest.mark.parametrize("world", [2, 3])
def test_a_gemv_on_shared_memory_is_made_transposed_and_one_layout_is_agreed(world):
    env = {"PLAIT_TRANSPORT": "shm"}
    for err, contiguous, why in run_ranks(_gemv_layouts, world, False, env=env):
        assert err <= 1e-12 and contiguous and "fallback" in why
    refused = run_ranks(_gemv_layouts, world, True, env=env)
    assert all(isinstance(r, str) and "w column-major" in r for r in refused), refused


def _decoding_calls():
    """A decoding step's row-parallel call, made again and again with one signature on
    shared memory (its check planned once, then carried in every call's header); then one
    rank with another N, one inside ``refused``, one with another M: every rank refused,
    and the good call after each still exact."""
    import torch.distributed as dist
    from plait import ops
    from plait.ops.context import refused
    from plait.ops.context import get_context

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    X, W = torch.randn(2, 1, 4 * world, generator=gen, dtype=torch.float64), \
        torch.randn(4 * world, 6, generator=gen, dtype=torch.float64)
    x, w = X[..., 4 * rank:4 * rank + 4], W[4 * rank:4 * rank + 4].t().contiguous().t()
    seen = {}

    def good(name):
        with torch.no_grad():
            seen[name] = float((ops.matmul_all_reduce(x[:1], w) - X[:1] @ W).abs().max())

    def bad(name, call):
        try:
            with torch.no_grad():
                call()
            seen[name] = None
        except ValueError as err:
            seen[name] = str(err)
    for i in range(4):
        good(f"call {i}")
    plans = [key for key in get_context()._plans if key[0] == "matmul_all_reduce"]
    seen["plans"] = len(plans)
    wide = torch.cat([w, w[:, :1]], dim=1) if rank == world - 1 else w
    bad("other N", lambda: ops.matmul_all_reduce(x[:1], wide))
    good("after N")
    problem = ValueError("this rank's layer refused its input") if rank == 0 else None

    def inside():
        with refused(problem):
            ops.matmul_all_reduce(x[:1], w)
    bad("refused", inside)
    good("after refused")
    bad("other M", lambda: ops.matmul_all_reduce(x if rank == 1 else x[:1], w))
    good("after M")
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_a_decoding_steps_check_is_planned_once_and_still_refuses_every_rank(world):
    for seen in run_ranks(_decoding_calls, world, env={"PLAIT_TRANSPORT": "shm"}):
        assert seen["plans"] == 1, seen
        assert all(seen[k] <= 1e-12 for k in seen if k.startswith(("call", "after"))), seen
        assert "N" in seen["other N"], seen
        assert "this rank's layer refused its input" in seen["refused"], seen
        assert "M" in seen["other M"], seen


def _gemv_grad(chunks):
    """A GEMV (3 rows) made transposed, under autograd: its output is changed in place (a
    view of the operator's own buffer could not be), and the gradients are exact."""
    import torch.distributed as dist
    from plait import ops

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(5)
    X, W = torch.randn(3, 4 * world, generator=gen, dtype=torch.float64), \
        torch.randn(4 * world, 10, generator=gen, dtype=torch.float64)
    x = X[:, 4 * rank:4 * rank + 4].clone().requires_grad_(True)
    w = W[4 * rank:4 * rank + 4].t().contiguous().t().requires_grad_(True)
    y = ops.matmul_all_reduce(x, w, chunks=chunks)
    y += 1.0
    y.sum().backward()
    ones = torch.ones(3, 10, dtype=torch.float64)
    return (float((y.detach() - (X @ W + 1)).abs().max()),
            float((x.grad - ones @ W[4 * rank:4 * rank + 4].t()).abs().max()),
            float((w.grad - X[:, 4 * rank:4 * rank + 4].t() @ ones).abs().max()))


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_transposed_gemv_output_takes_an_in_place_change_under_autograd(transport):
    for chunks in ("auto", 2):
        for errors in run_ranks(_gemv_grad, 2, chunks, env={"PLAIT_TRANSPORT": transport}):
            assert max(errors) <= 1e-12, (chunks, errors)


def _reduced_in_place():
    """A region's all-reduce and a one-row product, each changed in place under autograd
    (a view made inside a custom Function could not be), with exact gradients."""
    import torch.distributed as dist
    from plait import ops
    from plait.ops.regions import reduce_from_region

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = reduce_from_region(x)
    y.add_(1.0)
    (y * 2).sum().backward()
    gen = torch.Generator().manual_seed(6)
    X, W = torch.randn(1, 4 * world, generator=gen, dtype=torch.float64), \
        torch.randn(4 * world, 5, generator=gen, dtype=torch.float64)
    a = X[:, 4 * rank:4 * rank + 4].clone().requires_grad_(True)
    z = ops.matmul_all_reduce(a, W[4 * rank:4 * rank + 4])
    z.mul_(3.0)
    z.sum().backward()
    return (y._base is None and z._base is None,
            torch.equal(y.detach(), torch.full((2, 3), world * (world + 1) / 2 + 1,
                                               dtype=torch.float64)),
            torch.equal(x.grad, torch.full((2, 3), 2.0, dtype=torch.float64)),
            float((z.detach() - 3 * X @ W).abs().max()),
            float((a.grad - 3 * torch.ones(1, 5, dtype=torch.float64)
                   @ W[4 * rank:4 * rank + 4].t()).abs().max()))


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_reduced_output_takes_an_in_place_change_under_autograd(world, transport):
    for rank, (plain, values, grads, err, grad_err) in enumerate(
            run_ranks(_reduced_in_place, world, env={"PLAIT_TRANSPORT": transport})):
        assert plain and values and grads, (rank, plain, values, grads)
        assert err <= 1e-12 and grad_err <= 1e-12, (rank, err, grad_err)



def _applied() -> list[str]:
    import plait

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    notes = plait.parallel.applied(plait.parallelize(model, {"0": "colwise", "2": "rowwise"}))
    assert str(notes) == "\n".join(notes)  # printed: a line each
    assert str(plait.parallel.applied(model[1])) == "not made parallel by plait.parallelize"
    return list(notes)


@pytest.mark.parametrize("asked", ["auto", "shm", "gloo"])
def test_applied_says_which_transport_the_collectives_take_and_why(asked):
    """The issue: ``plait.parallel.applied(model)`` says which transport ran and why."""
    for notes in run_ranks(_applied, 2, env={"PLAIT_TRANSPORT": asked}):
        said = [n for n in notes if n.startswith("collectives: ")]
        took = "gloo" if asked == "gloo" else "shm"
        assert len(said) == 1 and said[0].startswith(f"collectives: {took} ("), notes
        assert ("asked for" in said[0]) == (asked != "auto"), notes
