"""GEMM + AllReduce, AllGather + GEMM, GEMM + ReduceScatter: forward and backward against
a single-process reference (float64, |error| ≤ 1e-10), fused against plain, on 2 and 4 ranks
(3 ranks, and float32 and bfloat16: test_uneven_dtypes.py). Every call's path is asserted:
a fixed count fuses with as many pieces as the smallest share has rows, the tiny shapes'
chunks="auto" falls back, and a cost model that sees a slow link makes auto fuse."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from plait.ops import (OpsContext, all_gather_matmul, column_parallel_matmul, explain,
                       matmul_all_reduce, matmul_reduce_scatter)
from plait.ops.calibration import Calibration
from plait.ops.matmul_all_reduce import matmul_all_reduce_start
from plait.perf.calibrate import MachineProfile
from plait.runtime import RankError
from plait.testing import run_ranks

TOL = 1e-10


def _line(op, chunks, most):
    """What ``explain(op)`` says after a call at ``chunks`` whose pieces are capped at
    ``most`` (rows of the smallest share; N for a GEMV): the path, the pieces, the reason."""
    if chunks == "auto":  # every shape here sends too few bytes to cut
        return f"{op}: fallback (1 piece): auto: pieces would be under"
    pieces = min(chunks, max(most, 1))
    if pieces == 1:
        why = "chunks=1 asked for" if chunks == 1 else f"only {max(most, 1)} rows to split"
        return f"{op}: fallback (1 piece): {why}"
    return f"{op}: fused ({pieces} pieces): chunks={chunks} asked for"


def _cut(total_sizes, rank):
    start = sum(total_sizes[:rank])
    return slice(start, start + total_sizes[rank])


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _err(a, b):
    return float((a.detach() - b).abs().max()) if a.numel() else 0.0


def _matmul_all_reduce_case(m, k_sizes, n, chunks, column_major=False):
    r = dist.get_rank()
    X, W, G = _full(1, m, sum(k_sizes)), _full(2, sum(k_sizes), n), _full(3, m, n)
    ks = _cut(k_sizes, r)
    x = X[:, ks].clone().requires_grad_()
    # column-major: as a row-parallel layer passes weight.t() (the GEMV then holds its
    # output transposed)
    w = (W[ks].t().contiguous().t() if column_major else W[ks].clone()).requires_grad_()
    y = matmul_all_reduce(x, w, chunks=chunks)
    y.backward(G)
    again = matmul_all_reduce(x.detach(), w.detach(), chunks=chunks)
    return {"y": _err(y, X @ W), "dx": _err(x.grad, (G @ W.T)[:, ks]), "dw": _err(w.grad, (X.T @ G)[ks]),
            "repeat_bitwise": torch.equal(y.detach(), again), "path": explain("matmul_all_reduce")}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("m", [64, 5])  # 5 rows: the GEMV path splits N instead
@pytest.mark.parametrize("chunks", [1, 3, "auto"])
def test_matmul_all_reduce_even_and_uneven(world, m, chunks):
    for k_sizes in ([8] * world, [3, 13, 1, 7][:world]):
        for out in run_ranks(_matmul_all_reduce_case, world, m, k_sizes, 24, chunks):
            assert max(out["y"], out["dx"], out["dw"]) < TOL, out
            assert out["repeat_bitwise"]
            # pieces cut M = 64 rows, or N = 24 columns for the GEMV
            assert out["path"].startswith(_line("matmul_all_reduce", chunks, 24)), out["path"]


@pytest.mark.parametrize("world", [2, 4])
def test_gemv_with_a_column_major_weight(world):
    for k_sizes in ([8] * world, [3, 13, 1, 7][:world]):
        for out in run_ranks(_matmul_all_reduce_case, world, 4, k_sizes, 24, 3, True):
            assert max(out["y"], out["dx"], out["dw"]) < TOL, out
            assert out["repeat_bitwise"] and "fused (3 pieces)" in out["path"]


def _two_in_flight(m, k_sizes, n, chunks):
    """Two calls started before either is waited for (the second's check and pieces go
    out while the first's are on the wire), waited in order, then both backward."""
    r = dist.get_rank()
    ks = _cut(k_sizes, r)
    out = {}
    started = []
    for seed in (1, 4):
        X, W = _full(seed, m, sum(k_sizes)), _full(seed + 1, sum(k_sizes), n)
        x, w = X[:, ks].clone().requires_grad_(), W[ks].clone().requires_grad_()
        started.append((X, W, x, w, matmul_all_reduce_start(x, w, chunks=chunks)))
    for seed, (X, W, x, w, flight) in zip((1, 4), started):
        G = _full(seed + 2, m, n)
        y = flight.wait()
        y.backward(G)
        out[seed] = max(_err(y, X @ W), _err(x.grad, (G @ W.T)[:, ks]), _err(w.grad, (X.T @ G)[ks]))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_started_all_reduces_can_be_in_flight_together(world):
    for chunks in (1, 3):
        for out in run_ranks(_two_in_flight, world, 40, [3, 13, 1, 7][:world], 24, chunks):
            assert max(out.values()) < TOL, out


def _column_parallel_case(m, k, n_sizes, chunks):
    r = dist.get_rank()
    X, W, G = _full(1, m, k), _full(2, k, sum(n_sizes)), _full(3, m, sum(n_sizes))
    ns = _cut(n_sizes, r)
    x, w = X.clone().requires_grad_(), W[:, ns].clone().requires_grad_()
    y = column_parallel_matmul(x, w, chunks=chunks)
    y.backward(G[:, ns])
    return ({"y": _err(y, (X @ W)[:, ns]), "dx": _err(x.grad, G @ W.T),
             "dw": _err(w.grad, (X.T @ G)[:, ns])}, explain("column_parallel_matmul.dgrad"))


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_matmul_backward_is_a_fused_all_reduce(world):
    for chunks in (1, 4):
        for out, path in run_ranks(_column_parallel_case, world, 32, 16, [5, 9, 2, 4][:world],
                                   chunks):
            assert max(out.values()) < TOL, out
            assert path.startswith(_line("column_parallel_matmul.dgrad", chunks, 32)), path


def _deferred_wgrad_case(m, k, f_sizes, chunks):
    """x → column_parallel_matmul → tanh → matmul_all_reduce(wgrad_into=p): an MLP shard.

    The row-parallel weight's gradient is deferred: still pending when the backward reaches
    the column-parallel layer, drained by the time that layer's input gradient exists (it
    ran under the dgrad's all_reduce, not at the end), and equal to the reference."""
    from plait.ops import deferred

    r = dist.get_rank()
    X, W1, W2, G = _full(1, m, k), _full(2, k, sum(f_sizes)), _full(3, sum(f_sizes), k), _full(4, m, k)
    fs = _cut(f_sizes, r)
    x, w1 = X.clone().requires_grad_(), W1[:, fs].clone().requires_grad_()
    p = W2[fs].t().contiguous().requires_grad_()  # [K, F_r]: nn.Linear's layout
    seen = {}
    h = column_parallel_matmul(x, w1, chunks=chunks)
    h.register_hook(lambda g: seen.update(pending_before_dgrad=deferred.pending()))
    x.register_hook(lambda g: seen.update(pending_after_dgrad=deferred.pending()))
    y = matmul_all_reduce(torch.tanh(h), p.t(), chunks=chunks, wgrad_into=p)
    y.backward(G)
    H = torch.tanh(X @ W1)
    dh = (G @ W2.T) * (1 - H ** 2)
    return {"y": _err(y, H @ W2), "dp": _err(p.grad, (H.T @ G)[fs].t()),
            "dw1": _err(w1.grad, (X.T @ dh)[:, fs]), "dx": _err(x.grad, dh @ W1.T),
            **seen, "pending_at_end": deferred.pending(),
            "paths": [explain("matmul_all_reduce"), explain("column_parallel_matmul.dgrad")]}


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_weight_gradient_runs_under_the_next_dgrad(world):
    for chunks in (1, 3):
        for out in run_ranks(_deferred_wgrad_case, world, 24, 6, [4, 10, 2, 6][:world], chunks):
            assert max(out["y"], out["dp"], out["dw1"], out["dx"]) < TOL, out
            assert out["pending_before_dgrad"] == 1 and out["pending_after_dgrad"] == 0, out
            assert out["pending_at_end"] == 0
            for line, op in zip(out["paths"], ("matmul_all_reduce", "column_parallel_matmul.dgrad")):
                assert line.startswith(_line(op, chunks, 24)), line


def _deferred_after_a_failed_backward_case():
    """A backward that raises after the row-parallel weight's gradient was deferred (before
    any dgrad ran it): the next, whole backward's gradient is that step's alone."""
    from plait.ops import deferred

    r = dist.get_rank()
    X, W, G = _full(1, 16, 8), _full(2, 8, 6), _full(3, 16, 6)
    ks = _cut([3, 5], r)
    p = W[ks].t().contiguous().requires_grad_()
    x = X[:, ks].clone().requires_grad_()

    def boom(_):
        raise RuntimeError("a failure mid-backward")
    x.register_hook(boom)  # after matmul_all_reduce's backward has deferred p's gradient
    failed = None
    try:
        matmul_all_reduce(x, p.t(), chunks=2, wgrad_into=p).backward(G)
    except RuntimeError as err:
        failed = str(err)
    left = deferred.pending()
    p.grad = None
    matmul_all_reduce(X[:, ks], p.t(), chunks=2, wgrad_into=p).backward(G)
    return failed, left, _err(p.grad, (X.T @ G)[ks].t()), deferred.pending()


def test_a_failed_backwards_deferred_gradient_never_lands_in_a_later_step():
    for failed, left, err, pending in run_ranks(_deferred_after_a_failed_backward_case, 2):
        assert failed and "mid-backward" in failed and left == 1  # it was held, unrun
        assert err < TOL and pending == 0  # dropped, not added to the next step's


def _deferred_alone_case():
    """No fused collective follows: the deferred gradient still lands, at the backward's end."""
    r = dist.get_rank()
    X, W, G = _full(1, 16, 8), _full(2, 8, 6), _full(3, 16, 6)
    ks = _cut([3, 5], r)
    p = W[ks].t().contiguous().requires_grad_()
    matmul_all_reduce(X[:, ks], p.t(), chunks=2, wgrad_into=p).backward(G)
    return _err(p.grad, (X.T @ G)[ks].t())


def test_a_deferred_weight_gradient_lands_at_the_end_of_the_backward():
    assert max(run_ranks(_deferred_alone_case, 2)) < TOL


def _sequence_parallel_case(m_sizes, k, n, chunks, dim):
    r, p = dist.get_rank(), dist.get_world_size()
    # all_gather_matmul: x rows sharded (m_sizes), w is this rank's column shard
    X, Wc = _full(1, sum(m_sizes), k), _full(2, k, n * p)
    G = _full(3, sum(m_sizes), n * p)
    ms, ns = _cut(m_sizes, r), slice(r * n, (r + 1) * n)
    x, w = X[ms].clone().requires_grad_(), Wc[:, ns].clone().requires_grad_()
    if dim == 1:  # a [B=1, S, K] layout gathered along the sequence dim
        y = all_gather_matmul(x.unsqueeze(0), w, dim=1, chunks=chunks).squeeze(0)
    else:
        y = all_gather_matmul(x, w, chunks=chunks)
    y.backward(G[:, ns])
    out = {"ag_y": _err(y, X @ Wc[:, ns]), "ag_dx": _err(x.grad, (G @ Wc.T)[ms]),
           "ag_dw": _err(w.grad, (X.T @ G)[:, ns])}
    # matmul_reduce_scatter: x sharded on K, output rows scattered by m_sizes
    K = k * p
    X2, W2, G2 = _full(4, sum(m_sizes), K), _full(5, K, n), _full(6, sum(m_sizes), n)
    ks = slice(r * k, (r + 1) * k)
    x2, w2 = X2[:, ks].clone().requires_grad_(), W2[ks].clone().requires_grad_()
    y2 = matmul_reduce_scatter(x2, w2, sizes=m_sizes, chunks=chunks)
    y2.backward(G2[ms])
    again = matmul_reduce_scatter(x2.detach(), w2.detach(), sizes=m_sizes, chunks=chunks)
    out.update(rs_y=_err(y2, (X2 @ W2)[ms]), rs_dx=_err(x2.grad, (G2 @ W2.T)[:, ks]),
               rs_dw=_err(w2.grad, (X2.T @ G2)[ks]))
    # the last call of each (``again`` ran without grad: the backward's are this call's)
    paths = {op: explain(op) for op in ("all_gather_matmul", "all_gather_matmul.dgrad",
                                        "matmul_reduce_scatter", "matmul_reduce_scatter.dgrad")}
    return out, torch.equal(y2.detach(), again), paths


def _check_paths(paths, m_sizes, chunks):
    """Both operators and both backward collectives cut every rank's rows alike: no more
    pieces than the smallest share has rows (an empty share: the plain path)."""
    for op, line in paths.items():
        assert line.startswith(_line(op, chunks, min(m_sizes))), (m_sizes, line)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("chunks", [1, 3, "auto"])
def test_gather_and_scatter_even_and_uneven(world, chunks):
    for m_sizes in ([12] * world, [7, 20, 0, 5][:world]):
        for out, repeat, paths in run_ranks(_sequence_parallel_case, world, m_sizes, 6, 10,
                                            chunks, 0):
            assert max(out.values()) < TOL, out
            assert repeat
            _check_paths(paths, m_sizes, chunks)


def _empty_share_along_dim1():
    r = dist.get_rank()
    X, W = _full(1, 2, 5, 4), _full(2, 4, 3)  # [B=2, S=5, K] gathered along S, rank 1 has none
    x = X[:, :5] if r == 0 else X[:, 5:]
    y = all_gather_matmul(x, W, dim=1, chunks=2)
    return _err(y, X @ W)


def test_all_gather_matmul_along_another_dim():
    for out, _, paths in run_ranks(_sequence_parallel_case, 2, [9, 4], 6, 10, 2, 1):
        assert max(out.values()) < TOL, out
        _check_paths(paths, [9, 4], 2)
    assert max(run_ranks(_empty_share_along_dim1, 2)) < TOL


@settings(max_examples=6, deadline=None)
@given(world=st.sampled_from([2, 4]), data=st.data())
def test_property_uneven_splits(world, data):
    m_sizes = data.draw(st.lists(st.integers(0, 9), min_size=world, max_size=world).filter(sum))
    chunks = data.draw(st.integers(1, 5))
    for out, repeat, paths in run_ranks(_sequence_parallel_case, world, m_sizes, 4, 3, chunks, 0):
        assert max(out.values()) < TOL, (m_sizes, chunks, out)
        assert repeat
        _check_paths(paths, m_sizes, chunks)


def _bad_input(kind):
    r = dist.get_rank()
    if kind == "rows_disagree":
        matmul_all_reduce(torch.randn(8 + r, 4), torch.randn(4, 3))
    elif kind == "dtype":
        matmul_all_reduce(torch.randn(8, 4), torch.randn(4, 3, dtype=torch.float64))
    elif kind == "w_shape":
        all_gather_matmul(torch.randn(8, 4), torch.randn(5, 3))
    elif kind == "sizes_sum":
        matmul_reduce_scatter(torch.randn(8, 4), torch.randn(4, 3), sizes=[4, 5])
    elif kind == "sizes_wrong_rank":
        all_gather_matmul(torch.randn(8, 4), torch.randn(4, 3), sizes=[6, 6])
    elif kind == "chunks":
        matmul_all_reduce(torch.randn(8, 4), torch.randn(4, 3), chunks=0)
    elif kind == "column_rows_disagree":  # its backward all-reduce is checked in the forward
        column_parallel_matmul(torch.randn(8 + r, 4, requires_grad=True), torch.randn(4, 3))


@pytest.mark.parametrize("kind, message", [
    ("rows_disagree", "ranks disagree on M: rank 0 has 8, rank 1 has 9"),
    ("dtype", "must share one dtype"),
    ("w_shape", "do not chain"),
    ("sizes_sum", "sum to 9, but x has 8 rows"),
    ("sizes_wrong_rank", "sizes [6, 6] give rank"),
    ("chunks", "chunks must be 'auto' or a positive integer"),
    ("column_rows_disagree", "column_parallel_matmul.dgrad: ranks disagree on M: rank 0 has 8, "
                             "rank 1 has 9"),
])
def test_bad_input_is_refused_clearly(kind, message):
    with pytest.raises(RankError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        run_ranks(_bad_input, 2, kind, timeout_s=10)


def _one_rank_and_tiny():
    x, w = torch.randn(4, 8), torch.randn(8, 4)
    y = matmul_all_reduce(x, w)
    return torch.allclose(y, x @ w), explain("matmul_all_reduce")


def test_world_of_one_and_tiny_shapes_fall_back_and_say_why():
    ok, why = run_ranks(_one_rank_and_tiny, 1)[0]
    assert ok and "fallback" in why and "one rank" in why
    _, why = run_ranks(_one_rank_and_tiny, 2)[0]
    assert "fallback" in why and "auto" in why


# a link as slow as the compute, as the cost model sees them: no calibration run, and auto's
# choice the same on any machine
FUSE_PROFILE = MachineProfile(latency_s=1e-5, bandwidth_Bps=1e8, compute_flops=1e9,
                              source="test: fusing pays")


def _auto_fuses(m_sizes, k_sizes, n_sizes, k, n):
    """Every operator, forward and backward, at chunks="auto" on shapes that send
    256-512 KiB (pieces of at least 64 KiB fit): (errors, each collective's explain line)."""
    r = dist.get_rank()
    ctx = OpsContext(calibrated=Calibration(FUSE_PROFILE))
    ms, ks, ns = _cut(m_sizes, r), _cut(k_sizes, r), _cut(n_sizes, r)
    m, kk, nn = sum(m_sizes), sum(k_sizes), sum(n_sizes)
    err = {}
    # matmul_all_reduce: x [M, K_r] @ w [K_r, N]
    X, W, G = _full(1, m, kk), _full(2, kk, n), _full(3, m, n)
    x, w = X[:, ks].clone().requires_grad_(), W[ks].clone().requires_grad_()
    matmul_all_reduce(x, w, chunks="auto", ctx=ctx).backward(G)
    err["all_reduce"] = max(_err(x.grad, (G @ W.T)[:, ks]), _err(w.grad, (X.T @ G)[ks]),
                            _err(matmul_all_reduce(x.detach(), w.detach(), ctx=ctx), X @ W))
    # column_parallel_matmul: its dgrad dy [M, N_r] @ w_rᵀ [N_r, K] is all-reduced
    X, W, G = _full(4, m, k), _full(5, k, nn), _full(6, m, nn)
    x, w = X.clone().requires_grad_(), W[:, ns].clone().requires_grad_()
    y = column_parallel_matmul(x, w, chunks="auto", ctx=ctx)
    y.backward(G[:, ns])
    err["column"] = max(_err(y, (X @ W)[:, ns]), _err(x.grad, G @ W.T),
                        _err(w.grad, (X.T @ G)[:, ns]))
    # all_gather_matmul: x [M_r, K] gathered, @ w [K, N_r]; its dgrad a reduce-scatter
    x, w = X[ms].clone().requires_grad_(), W[:, ns].clone().requires_grad_()
    y = all_gather_matmul(x, w, chunks="auto", ctx=ctx)
    y.backward(G[:, ns])
    err["gather"] = max(_err(y, (X @ W)[:, ns]), _err(x.grad, (G @ W.T)[ms]),
                        _err(w.grad, (X.T @ G)[:, ns]))
    # matmul_reduce_scatter: x [M, K_r] @ w [K_r, N], rows scattered; its dgrad a gather
    X, W, G = _full(7, m, kk), _full(8, kk, n), _full(9, m, n)
    x, w = X[:, ks].clone().requires_grad_(), W[ks].clone().requires_grad_()
    y = matmul_reduce_scatter(x, w, sizes=m_sizes, chunks="auto", ctx=ctx)
    y.backward(G[ms])
    err["scatter"] = max(_err(y, (X @ W)[ms]), _err(x.grad, (G @ W.T)[:, ks]),
                         _err(w.grad, (X.T @ G)[ks]))
    return err, {op: d.line() for op, d in ctx.decisions.items()}


def test_auto_fuses_when_the_model_says_so():
    ops = {"matmul_all_reduce", "column_parallel_matmul.dgrad", "all_gather_matmul",
           "all_gather_matmul.dgrad", "matmul_reduce_scatter", "matmul_reduce_scatter.dgrad"}
    for err, lines in run_ranks(_auto_fuses, 2, [96, 160], [5, 11], [20, 36], 128, 256):
        assert max(err.values()) < TOL, err
        assert set(lines) == ops
        for op, line in lines.items():
            assert line.startswith(f"{op}: fused (") and ": auto: " in line, line
