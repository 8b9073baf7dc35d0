"""embedding_all_to_all against embedding_bag-then-all_to_all on the full tables, 1–4 ranks.

Tolerance: the exchanged pooled embeddings are compared bit for bit
(``torch.equal``); weight gradients (sums in another order than autograd's)
within 1e-12 in float64, exactly for integer-valued data, and bit for bit
between two runs with the same chunk count.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st

from plait.ops.context import OpsContext, get_context
from plait.ops.embedding import embedding_all_to_all
from plait.ops.calibration import Calibration
from plait.perf.calibrate import MachineProfile
from plait.runtime import RankError
from plait.testing import run_ranks

# comm-heavy enough that chunks="auto" fuses a 256 KiB exchange
FUSE_MEMORY_BPS = 2e8  # gathers as slow as the link, so the model sees something to overlap
FUSE_PROFILE = MachineProfile(latency_s=1e-5, bandwidth_Bps=1e8, compute_flops=5e7,
                              source="test: fusing pays")


def _case(tables_per_rank, batch_sizes=None, *, batch=None, dim=3, mode="sum", chunks=3,
          integer=False, seed=0, profile=None, max_bag=4):
    batch = sum(batch_sizes) if batch_sizes is not None else batch
    return dict(tables_per_rank=list(tables_per_rank), batch_sizes=batch_sizes, batch=batch,
                dim=dim, mode=mode, chunks=chunks, integer=integer, seed=seed, profile=profile,
                max_bag=max_bag)


def _problem(case):
    """Every global table (weight, indices, offsets) and the output gradient [B, T, D]."""
    g = torch.Generator().manual_seed(case["seed"])
    batch, dim = case["batch"], case["dim"]

    def values(*shape):
        if case["integer"]:
            return torch.randint(-3, 4, shape, generator=g).double()
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    tables = []
    for _ in range(sum(case["tables_per_rank"])):
        rows = int(torch.randint(1, 9, (1,), generator=g))
        bags = torch.randint(0, case["max_bag"] + 1, (batch,), generator=g)  # empty bags too
        idx = torch.randint(0, rows, (int(bags.sum()),), generator=g)
        off = torch.cat([torch.zeros(1, dtype=torch.long), bags.cumsum(0)[:-1]])[:batch]
        tables.append((values(rows, dim), idx, off))
    return tables, values(batch, len(tables), dim)


def _slices(case, world):
    sizes = case["batch_sizes"]
    if sizes is None:
        b = case["batch"]
        sizes = [b // world + (1 if r < b % world else 0) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world + 1)]
    owned = [sum(case["tables_per_rank"][:r]) for r in range(world + 1)]
    return starts, owned


def _on_rank(case):
    rank, world = dist.get_rank(), dist.get_world_size()
    tables, grad = _problem(case)
    starts, owned = _slices(case, world)
    mine = tables[owned[rank]:owned[rank + 1]]
    weights = [w.clone().requires_grad_() for w, _, _ in mine]
    ctx = (OpsContext(calibrated=Calibration(case["profile"], memory_Bps=FUSE_MEMORY_BPS))
           if case["profile"] else get_context())
    out = embedding_all_to_all(weights, [i for _, i, _ in mine], [o for _, _, o in mine],
                               batch_sizes=case["batch_sizes"], mode=case["mode"],
                               chunks=case["chunks"], ctx=ctx)
    (out * grad[starts[rank]:starts[rank + 1]]).sum().backward()
    return (out.detach(), [w.grad for w in weights], ctx.decisions["embedding_all_to_all"].path,
            ctx.decisions["embedding_all_to_all.wgrad"].path)


def _run_cases(cases):
    """Several cases in one launch; chunks=3 ones run twice (determinism)."""
    results = []
    for case in cases:
        first = _on_rank(case)
        again = _on_rank(case) if case["chunks"] == 3 else None
        results.append((first, again))
    return results


def _reference(case):
    tables, grad = _problem(case)
    weights = [w.clone().requires_grad_() for w, _, _ in tables]
    pooled = [F.embedding_bag(i, w, o, mode=case["mode"]) for w, (_, i, o) in zip(weights, tables)]
    out = torch.stack(pooled, 1)  # [B, T, D]: embedding_bag everything, then "all_to_all"
    (out * grad).sum().backward()
    return out.detach(), [w.grad for w in weights]


def _check(cases, results, world):
    for case, per_rank in zip(cases, zip(*results)):
        ref_out, ref_grads = _reference(case)
        starts, owned = _slices(case, world)
        for rank, (first, again) in enumerate(per_rank):
            out, grads, _, _ = first
            assert out.shape == (starts[rank + 1] - starts[rank], len(ref_grads), case["dim"])
            assert torch.equal(out, ref_out[starts[rank]:starts[rank + 1]]), (case, rank)
            for grad, ref in zip(grads, ref_grads[owned[rank]:owned[rank + 1]]):
                tol = 0 if case["integer"] else 1e-12
                torch.testing.assert_close(grad, ref, rtol=tol, atol=tol)
            if again is not None:
                assert torch.equal(again[0], out)
                assert all(torch.equal(a, b) for a, b in zip(again[1], grads)), (case, rank)


UNEVEN = {2: dict(tables_per_rank=[1, 3], batch_sizes=[2, 7]),
          4: dict(tables_per_rank=[1, 3, 2, 1], batch_sizes=[3, 0, 5, 2])}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_embedding_bag_then_all_to_all(world):
    even = [2] * world
    uneven = UNEVEN.get(world, dict(tables_per_rank=[3], batch_sizes=[6]))
    auto = dict(profile=FUSE_PROFILE)  # no calibration run; these shapes are too small to fuse
    cases = [_case(even, batch=8, chunks=chunks, seed=1, **auto) for chunks in (1, 3, "auto")]
    cases += [_case(**uneven, chunks=chunks, seed=2, **auto) for chunks in (1, 3, "auto")]
    cases += [_case(**uneven, mode="mean", chunks=chunks, seed=3) for chunks in (1, 3)]
    cases += [_case(**uneven, integer=True, chunks=chunks, seed=4) for chunks in (1, 3)]
    cases += [_case(even, batch=2 * world - 1, chunks=5, seed=5)]  # more pieces than rows
    cases += [_case(even, [0] * world, chunks=3, seed=6)]          # an empty batch
    results = run_ranks(_run_cases, world, cases)
    _check(cases, results, world)
    for (first, _), case in zip(results[0], cases):
        want = "fused" if world > 1 and isinstance(case["chunks"], int) and case["chunks"] > 1 \
            and case["batch"] else "fallback"  # tiny "auto" shapes fall back (pieces < 64 KiB)
        assert first[2] == first[3] == want, case


def test_auto_fuses_when_the_model_says_so():
    cases = [_case([2, 2], batch=512, dim=64, chunks="auto", profile=FUSE_PROFILE, max_bag=2)]
    results = run_ranks(_run_cases, 2, cases)
    _check(cases, results, 2)
    assert all(r[0][0][2] == r[0][0][3] == "fused" for r in results)


@st.composite
def _cases(draw, world):
    tables = draw(st.lists(st.integers(1, 3), min_size=world, max_size=world))
    sizes = draw(st.lists(st.integers(0, 5), min_size=world, max_size=world))
    return _case(tables, sizes, dim=draw(st.integers(1, 4)),
                 mode=draw(st.sampled_from(["sum", "mean"])),
                 chunks=draw(st.sampled_from([1, 2, 3, 4])), seed=draw(st.integers(0, 2 ** 16)))


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_split_matches_reference(world, data):
    cases = data.draw(st.lists(_cases(world), min_size=4, max_size=4))
    _check(cases, run_ranks(_run_cases, world, cases), world)


# --- bad input: every rank raises, before any data collective ------------------

def _bad_inputs():
    rank = dist.get_rank()
    idx, off = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2, 3])
    w = torch.zeros(4, 3, dtype=torch.float64)
    cases = {
        "two_dims": ([w, torch.zeros(4, 2, dtype=torch.float64)], [idx, idx], [off, off], {}),
        "dims_across_ranks": ([torch.zeros(4, 3 + rank, dtype=torch.float64)], [idx], [off], {}),
        "float_indices": ([w], [idx.double()], [off], {}),
        "mixed_dtypes": ([w, w.float()], [idx, idx], [off, off], {}),
        "batch_sizes": ([w], [idx], [off], dict(batch_sizes=[1, 2])),
        "out_of_range_on_rank_1": ([w], [torch.tensor([0, 1, 2, 4 * rank])], [off], {}),
        "bag_counts": ([w, w], [idx, idx], [off, off[:3]], {}),
        "chunks": ([w], [idx], [off], dict(chunks=0)),
        "mode": ([w], [idx], [off], dict(mode="max")),
        "batch_across_ranks": ([w], [idx], [off[:3 + rank]], {}),
    }
    warm = OpsContext()  # a later bad batch, after a good one on the same context
    embedding_all_to_all([w], [idx], [off], ctx=warm)
    cases["out_of_range_after_a_good_call"] = ([w], [torch.tensor([0, 1, 2, 5 * rank])], [off],
                                               dict(ctx=warm))
    seen = {}
    for name, (tables, indices, offsets, kw) in cases.items():
        try:  # a fresh context each
            embedding_all_to_all(tables, indices, offsets, **{"ctx": OpsContext(), **kw})
            seen[name] = None
        except (TypeError, ValueError) as err:
            seen[name] = (type(err).__name__, str(err))
    ok = embedding_all_to_all([w + rank], [idx], [off], chunks=2)  # still in step afterwards
    return seen, ok


def test_bad_input_raises_on_every_rank():
    expected = {
        "two_dims": ("ValueError", "one D; got shapes [(4, 3), (4, 2)]"),
        "dims_across_ranks": ("ValueError", "ranks disagree on D: rank 0 has 3, rank 1 has 4"),
        "float_indices": ("TypeError", "torch.float64"),
        "mixed_dtypes": ("TypeError", "share one dtype"),
        "batch_sizes": ("ValueError", "batch_sizes [1, 2]"),
        "out_of_range_on_rank_1": ("ValueError", "indices span [0, 4] but the table has 4 rows"),
        "out_of_range_after_a_good_call": ("ValueError", "indices span [0, 5]"),
        "bag_counts": ("ValueError", "offsets lengths [4, 3]"),
        "chunks": ("ValueError", "chunks must be 'auto' or a positive integer, got 0"),
        "mode": ("ValueError", "'max'"),
        "batch_across_ranks": ("ValueError", "ranks disagree"),
    }
    results = run_ranks(_bad_inputs, 2, timeout_s=10)
    for rank, (seen, ok) in enumerate(results):
        for name, (kind, text) in expected.items():
            assert seen[name] is not None, f"rank {rank} accepted {name}"
            assert seen[name][0] == kind and text in seen[name][1], (rank, name, seen[name])
        assert ok.shape == (2, 2, 3)
        assert torch.equal(ok[:, 1], torch.ones(2, 3, dtype=torch.float64))
    for name in ("out_of_range_on_rank_1", "out_of_range_after_a_good_call"):
        assert "input rejected on rank 1" in results[0][0][name][1]


def _raise_in_op():
    w = torch.zeros(4, 3)
    embedding_all_to_all([w], [torch.tensor([0, 1])], [torch.tensor([0, 1])], batch_sizes=[2, 1])


def test_error_reaches_the_caller():
    with pytest.raises(RankError, match=r"batch_sizes \[2, 1\] must give each of 2 ranks"):
        run_ranks(_raise_in_op, 2, timeout_s=10)
