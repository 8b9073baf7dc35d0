"""all_to_all_matmul / matmul_all_to_all against per-block matmuls on the full tensors, 1–4 ranks.

Tolerance: float64 within 1e-12 for outputs and gradients (each GEMM runs on a
row piece of a block, which MKL may round differently from the whole block);
exactly (``torch.equal``) for integer-valued data, where every sum is exact, so
any misplaced or dropped token shows; bit for bit between two runs with the same
chunk count.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings, strategies as st

from plait.ops.context import OpsContext, get_context
from plait.ops.moe import all_to_all_matmul, matmul_all_to_all
from plait.ops.calibration import Calibration
from plait.perf.calibrate import MachineProfile
from plait.runtime import RankError
from plait.testing import run_ranks

FUSE_PROFILE = MachineProfile(latency_s=1e-5, bandwidth_Bps=1e8, compute_flops=4e9,
                              source="test: fusing pays")


def _case(experts, *, hidden=4, ffn=5, chunks=3, integer=False, seed=0, most=4, zeros=(),
          x_grad=True, profile=None, validate="first"):
    """``zeros``: (source, destination) pairs that exchange no tokens at all."""
    return dict(experts=list(experts), hidden=hidden, ffn=ffn, chunks=chunks, integer=integer,
                seed=seed, most=most, zeros=list(zeros), x_grad=x_grad, profile=profile,
                validate=validate)


def _problem(case):
    """counts[s][d][e], every rank's tokens and experts, and the output gradients."""
    g = torch.Generator().manual_seed(case["seed"])
    experts, h, f = case["experts"], case["hidden"], case["ffn"]
    world = len(experts)

    def values(*shape):
        if case["integer"]:
            return torch.randint(-2, 3, shape, generator=g).double()
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    counts = [[torch.randint(0, case["most"] + 1, (experts[d],), generator=g).tolist()
               for d in range(world)] for _ in range(world)]
    for s, d in case["zeros"]:
        counts[s][d] = [0] * experts[d]
    x = [values(sum(map(sum, counts[s])), h) for s in range(world)]
    w1 = [values(experts[d], h, f) for d in range(world)]
    w2 = [values(experts[d], f, h) for d in range(world)]
    t_recv = [sum(sum(counts[s][d]) for s in range(world)) for d in range(world)]
    dy = [values(t_recv[d], f) for d in range(world)]
    dout = [values(x[s].shape[0], h) for s in range(world)]
    return counts, x, w1, w2, dy, dout


def _on_rank(case):
    rank, world = dist.get_rank(), dist.get_world_size()
    counts, xs, w1s, w2s, dys, douts = _problem(case)
    send, recv = counts[rank], [counts[s][rank] for s in range(world)]
    x = xs[rank].clone().requires_grad_(case["x_grad"])
    w1, w2 = w1s[rank].clone().requires_grad_(), w2s[rank].clone().requires_grad_()
    fresh = case["profile"] or case["validate"] != "first"
    ctx = (OpsContext(calibrated=Calibration(case["profile"]) if case["profile"] else None,
                      validate=case["validate"]) if fresh else get_context())
    kw = dict(chunks=case["chunks"], ctx=ctx)
    y = all_to_all_matmul(x, w1, send, torch.tensor(recv), **kw)  # counts: lists or tensors
    out = matmul_all_to_all(y, w2, send, recv, **kw)
    ((y * dys[rank]).sum() + (out * douts[rank]).sum()).backward()
    paths = [ctx.decisions[op].path for op in ("all_to_all_matmul", "matmul_all_to_all",
                                               "matmul_all_to_all.dgrad")]
    if case["x_grad"]:
        paths.append(ctx.decisions["all_to_all_matmul.dgrad"].path)
    return y.detach(), out.detach(), x.grad, w1.grad, w2.grad, paths


def _run_cases(cases):
    results = []
    for case in cases:
        first = _on_rank(case)
        results.append((first, _on_rank(case) if case["chunks"] == 3 else None))
    return results


def _reference(case):
    """Per (source, destination, expert) block: x_b @ w1[e], then @ w2[e], back in x's order."""
    counts, xs, w1s, w2s, dys, douts = _problem(case)
    world = len(xs)
    x = [t.clone().requires_grad_() for t in xs]
    w1 = [t.clone().requires_grad_() for t in w1s]
    w2 = [t.clone().requires_grad_() for t in w2s]
    y_blocks = [[] for _ in range(world)]  # by destination: rows (source, expert)
    out = []
    for s in range(world):
        at, parts = 0, []
        for d in range(world):
            for e, n in enumerate(counts[s][d]):
                block = x[s][at:at + n] @ w1[d][e]
                y_blocks[d].append((s, e, block))
                parts.append(block @ w2[d][e])
                at += n
        out.append(torch.cat(parts))
    y = [torch.cat([b for _, _, b in sorted(blocks, key=lambda i: i[:2])]) for blocks in y_blocks]
    loss = sum((y[d] * dys[d]).sum() for d in range(world))
    (loss + sum((out[s] * douts[s]).sum() for s in range(world))).backward()
    grads = [(x[r].grad, w1[r].grad, w2[r].grad) for r in range(world)]
    return [t.detach() for t in y], [t.detach() for t in out], grads


def _check(cases, results):
    for case, per_rank in zip(cases, zip(*results)):
        ref_y, ref_out, ref_grads = _reference(case)
        tol = 0 if case["integer"] else 1e-12
        for rank, (first, again) in enumerate(per_rank):
            y, out, gx, g1, g2, _ = first
            torch.testing.assert_close(y, ref_y[rank], rtol=tol, atol=tol)
            torch.testing.assert_close(out, ref_out[rank], rtol=tol, atol=tol)
            want_gx, want_g1, want_g2 = ref_grads[rank]
            if case["x_grad"]:
                torch.testing.assert_close(gx, want_gx, rtol=tol, atol=tol)
            else:
                assert gx is None
            torch.testing.assert_close(g1, want_g1, rtol=tol, atol=tol)
            torch.testing.assert_close(g2, want_g2, rtol=tol, atol=tol)
            if again is not None:  # same chunks twice: the same bits
                for a, b in zip(again[:5], first[:5]):
                    assert (a is None and b is None) or torch.equal(a, b), (case, rank)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_matches_per_block_matmuls(world):
    even, uneven = [2] * world, [1, 3, 2, 2][:world]
    auto = dict(profile=FUSE_PROFILE)  # no calibration run; these shapes are too small to fuse
    cases = [_case(even, chunks=c, seed=1, **auto) for c in (1, 3, "auto")]
    cases += [_case(uneven, chunks=c, seed=2, zeros=[(0, world - 1)], **auto)
              for c in (1, 3, "auto")]
    cases += [_case(uneven, chunks=c, seed=3, integer=True, zeros=[(world - 1, 0)]) for c in (1, 3)]
    cases += [_case(uneven, chunks=3, seed=4, x_grad=False)]           # wgrad only
    cases += [_case(uneven, chunks=5, seed=5, most=1)]                 # more pieces than rows
    cases += [_case(even, chunks=3, seed=6, most=0)]                   # no tokens at all
    cases += [_case(uneven, chunks=3, seed=7, validate="never")]       # no per-call check
    results = run_ranks(_run_cases, world, cases)
    _check(cases, results)
    for (first, _), case in zip(results[0], cases):
        asked = isinstance(case["chunks"], int) and case["chunks"] > 1
        fused = world > 1 and asked and case["most"]
        assert set(first[5]) == {"fused" if fused else "fallback"}, (case, first[5])


def test_auto_fuses_when_the_model_says_so():
    cases = [_case([2, 2], hidden=256, ffn=64, most=128, chunks="auto", profile=FUSE_PROFILE)]
    results = run_ranks(_run_cases, 2, cases)
    _check(cases, results)
    assert all(set(r[0][0][5]) == {"fused"} for r in results), [r[0][0][5] for r in results]


@st.composite
def _cases(draw, world):
    experts = draw(st.lists(st.integers(1, 3), min_size=world, max_size=world))
    rank = st.integers(0, world - 1)
    zeros = draw(st.lists(st.tuples(rank, rank), max_size=2))
    return _case(experts, hidden=draw(st.integers(1, 5)), ffn=draw(st.integers(1, 5)),
                 chunks=draw(st.sampled_from([1, 2, 3, 4])), seed=draw(st.integers(0, 2 ** 16)),
                 most=draw(st.integers(0, 4)), zeros=zeros)


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_token_counts_match_reference(world, data):
    cases = data.draw(st.lists(_cases(world), min_size=4, max_size=4))
    _check(cases, run_ranks(_run_cases, world, cases))


# --- bad input: every rank raises, before any token moves ---------------------

def _bad_inputs():
    rank = dist.get_rank()
    x, w = torch.zeros(5, 4, dtype=torch.float64), torch.zeros(2, 4, 3, dtype=torch.float64)
    send = [[1, 1], [2, 1]] if rank == 0 else [[2, 1], [0, 2]]  # rank 0 → rank 1: [2, 1]
    recv = [[1, 1], [2, 1]] if rank == 0 else [[2, 1], [0, 2]]  # rank 1 ← rank 0: [2, 1]
    x = x[:sum(map(sum, send))]
    lying = [[1, 1], [1, 1]] if rank == 1 else recv  # rank 1 expects [1, 1] from rank 0
    cases = {
        "counts_disagree": (x, w, send, lying),
        "rows": (x[:4] if rank == 0 else x, w, send, recv),
        "dtypes": (x.float(), w, send, recv),
        "hidden_across_ranks": (torch.zeros(x.shape[0], 4 + rank, dtype=torch.float64),
                                torch.zeros(2, 4 + rank, 3, dtype=torch.float64), send, recv),
        "recv_shape": (x, w, send, [row + [0] for row in recv]),
        "float_counts": (x, w, torch.tensor(send, dtype=torch.float32), recv),
        "send_row_vs_experts": (x, w, [send[0], send[1] + [0]], recv),
        "not_chained": (x, w.transpose(1, 2), send, recv),
    }
    warm = OpsContext()  # a later bad call, after a good one on the same context
    all_to_all_matmul(x, w, send, recv, ctx=warm, chunks=2)
    cases["counts_after_a_good_call"] = (x, w, send, lying, warm)
    seen = {}
    for name, (xx, ww, ss, rr, *ctx) in cases.items():
        try:
            all_to_all_matmul(xx, ww, ss, rr, chunks=2, ctx=ctx[0] if ctx else OpsContext())
            seen[name] = None
        except (TypeError, ValueError) as err:
            seen[name] = (type(err).__name__, str(err))
    ok = all_to_all_matmul(x, w + 1, send, recv, chunks=2)  # still in step afterwards
    return seen, ok


def test_bad_input_raises_on_every_rank():
    disagree = ("ValueError", "rank 0 sends rank 1 [2, 1] tokens per expert (send_counts[1]), "
                              "but rank 1 expects [1, 1] (recv_counts[0])")
    expected = {
        "counts_disagree": disagree,
        "counts_after_a_good_call": disagree,
        "rows": ("ValueError", "send_counts sum to 5, but x has 4 rows"),
        "dtypes": ("TypeError", "share one dtype"),
        "hidden_across_ranks": ("ValueError", "ranks disagree on K: rank 0 has 4, rank 1 has 5"),
        "recv_shape": ("ValueError", "recv_counts must be [2][2]"),
        "float_counts": ("TypeError",
                         "send_counts must be a 2-D integer tensor, got torch.float32"),
        "send_row_vs_experts": ("ValueError",
                                "send_counts row 1 has 3 entries, but rank 1 has 2 experts"),
        "not_chained": ("ValueError", "do not chain"),
    }
    results = run_ranks(_bad_inputs, 2, timeout_s=10)
    for rank, (seen, ok) in enumerate(results):
        for name, (kind, text) in expected.items():
            assert seen[name] is not None, f"rank {rank} accepted {name}"
            assert seen[name][0] == kind and text in seen[name][1], (rank, name, seen[name])
        assert torch.equal(ok, torch.zeros_like(ok))
    assert "input rejected on rank 0" in results[1][0]["rows"][1]


def _raise_in_op():
    y, w = torch.zeros(3, 2), torch.zeros(1, 2, 2)
    matmul_all_to_all(y, w, [[1], [1]], [[1], [1]])


def test_error_reaches_the_caller():
    with pytest.raises(RankError, match="recv_counts sum to 2, but y has 3 rows"):
        run_ranks(_raise_in_op, 2, timeout_s=10)


def test_the_model_sees_own_tokens_need_no_wire():
    """The busiest rank's own tokens: multiplied first in a dispatch (beside the transfers,
    not in its plain path), last in a combine (beside the last pieces)."""
    from plait.ops.moe import _Routes

    traffic = ((30, 10), (20, 45))  # rows rank a sends rank b; rank 1 receives 55, 45 its own
    routes = _Routes(0, 2, ((30, ), (10, )), ((30, ), (20, )), traffic)
    dispatch, combine = routes.estimate(4, 8, 4, False), routes.estimate(4, 8, 4, True)
    per_row = 2.0 * 4 * 8
    assert (dispatch.flops, dispatch.lead_flops, dispatch.tail_flops) == (10 * per_row, 45 * per_row, 0.0)
    assert dispatch.receive and not dispatch.lead_in_plain
    assert (combine.flops, combine.tail_flops, combine.lead_flops) == (10 * per_row, 45 * per_row, 0.0)
    assert not combine.receive
    assert dispatch.wire_bytes == 20 * 4 * 4  # the most rows one rank sends others: rank 1's 20
    assert combine.wire_bytes == 20 * 8 * 4
    assert routes.largest_block() == 20
    assert _Routes(0, 2, ((1, ), (1, )), ((1, ), (1, )), None).estimate(4, 8, 4, False).wire_bytes == 0
