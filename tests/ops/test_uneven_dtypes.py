"""Every fused operator, forward and backward, on 3 ranks with uneven shares, in float64,
float32 and bfloat16, against a single-process float64 reference.

Each operator runs at a fixed 3 pieces (its decision is asserted: the piece loop runs),
on inputs drawn in float64 and rounded to the dtype; the reference computes with those
rounded values in float64, so only the operator's own arithmetic is measured. The
output and every gradient keep the input's dtype. Error: max |got - reference| over the
tensor, relative to max |reference|, at most TOL[dtype]:

=========  ========  ===================================================================
dtype      TOL       measured here (worst over operators, tensors and ranks)
=========  ========  ===================================================================
float64    1e-12     5e-16: the order of sums only
float32    1e-5      2e-7
bfloat16   3e-2      1e-2 (an MoE weight gradient): an 8-bit mantissa, and every partial
                     sum rounded to it (each rank's product before the all-reduce, each
                     piece's, each gradient block's)
=========  ========  ===================================================================

One launch of 3 ranks runs every case (launching ranks costs seconds).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.ops import (all_gather_matmul, all_to_all_matmul, column_parallel_matmul,
                       embedding_all_to_all, get_context, matmul_all_reduce, matmul_all_to_all,
                       matmul_reduce_scatter)
from plait.testing import run_ranks

WORLD, CHUNKS = 3, 3
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 3e-2}
DEVICE = torch.device("cpu")  # where the operators' inputs live; scripts/device_check.py: cuda
K_SIZES = [5, 11, 2]     # a reduction dim's shares
M_SIZES = [4, 9, 6]      # row shares (each ≥ CHUNKS: every rank's rows cut into 3 pieces)
N_SIZES = [3, 5, 2]      # column shares
TABLES = [1, 3, 2]       # embedding tables per rank
EXPERTS = [1, 3, 2]      # MoE experts per rank


def _cut(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _draw(seed, *shape, dtype):
    """Drawn in float64, rounded to ``dtype``: (the operator's input, its float64 value)."""
    full = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rounded = full.to(dtype)
    return rounded.to(DEVICE), rounded.double()


def _taken(*ops):
    decisions = get_context().decisions
    return {op: (decisions[op].path, decisions[op].chunks) for op in ops}


# --- the matmul operators ------------------------------------------------------

def _matmul_all_reduce(dtype, m):
    r = dist.get_rank()
    (X, Xd), (W, Wd), (G, Gd) = (_draw(s, *shape, dtype=dtype) for s, shape in
                                 ((1, (m, sum(K_SIZES))), (2, (sum(K_SIZES), 16)), (3, (m, 16))))
    ks = _cut(K_SIZES, r)
    x, w = X[:, ks].clone().requires_grad_(), W[ks].clone().requires_grad_()
    y = matmul_all_reduce(x, w, chunks=CHUNKS)
    taken = _taken("matmul_all_reduce")
    y.backward(G)
    return {"y": (y, Xd @ Wd), "dx": (x.grad, (Gd @ Wd.T)[:, ks]),
            "dw": (w.grad, (Xd.T @ Gd)[ks])}, taken


def _column_parallel(dtype):
    r = dist.get_rank()
    n = sum(N_SIZES)
    (X, Xd), (W, Wd), (G, Gd) = (_draw(s, *shape, dtype=dtype) for s, shape in
                                 ((4, (20, 12)), (5, (12, n)), (6, (20, n))))
    ns = _cut(N_SIZES, r)
    x, w = X.clone().requires_grad_(), W[:, ns].clone().requires_grad_()
    y = column_parallel_matmul(x, w, chunks=CHUNKS)
    y.backward(G[:, ns])
    return {"y": (y, (Xd @ Wd)[:, ns]), "dx": (x.grad, Gd @ Wd.T),
            "dw": (w.grad, (Xd.T @ Gd)[:, ns])}, _taken("column_parallel_matmul.dgrad")


def _all_gather_matmul(dtype):
    r = dist.get_rank()
    m, n = sum(M_SIZES), sum(N_SIZES)
    (X, Xd), (W, Wd), (G, Gd) = (_draw(s, *shape, dtype=dtype) for s, shape in
                                 ((7, (m, 8)), (8, (8, n)), (9, (m, n))))
    ms, ns = _cut(M_SIZES, r), _cut(N_SIZES, r)
    x, w = X[ms].clone().requires_grad_(), W[:, ns].clone().requires_grad_()
    y = all_gather_matmul(x, w, chunks=CHUNKS)
    taken = _taken("all_gather_matmul")
    y.backward(G[:, ns])
    taken.update(_taken("all_gather_matmul.dgrad"))  # a fused reduce-scatter
    return {"y": (y, (Xd @ Wd)[:, ns]), "dx": (x.grad, (Gd @ Wd.T)[ms]),
            "dw": (w.grad, (Xd.T @ Gd)[:, ns])}, taken


def _matmul_reduce_scatter(dtype):
    r = dist.get_rank()
    m, k = sum(M_SIZES), sum(K_SIZES)
    (X, Xd), (W, Wd), (G, Gd) = (_draw(s, *shape, dtype=dtype) for s, shape in
                                 ((10, (m, k)), (11, (k, 7)), (12, (m, 7))))
    ks, ms = _cut(K_SIZES, r), _cut(M_SIZES, r)
    x, w = X[:, ks].clone().requires_grad_(), W[ks].clone().requires_grad_()
    y = matmul_reduce_scatter(x, w, sizes=M_SIZES, chunks=CHUNKS)
    taken = _taken("matmul_reduce_scatter")
    y.backward(G[ms])
    taken.update(_taken("matmul_reduce_scatter.dgrad"))  # a fused all-gather
    return {"y": (y, (Xd @ Wd)[ms]), "dx": (x.grad, (Gd @ Wd.T)[:, ks]),
            "dw": (w.grad, (Xd.T @ Gd)[ks])}, taken


# --- embedding_all_to_all --------------------------------------------------------

def _embedding_problem(dtype, batch, dim=8):
    """Every global table (rounded weight, its float64 value, indices, offsets) and the
    output gradient [B, T, D]; bags of 0 to 4 ids."""
    g = torch.Generator().manual_seed(13)
    tables = []
    for t in range(sum(TABLES)):
        rows = int(torch.randint(5, 13, (1,), generator=g))
        bags = torch.randint(0, 5, (batch,), generator=g)
        idx = torch.randint(0, rows, (int(bags.sum()),), generator=g)
        off = torch.cat([torch.zeros(1, dtype=torch.long), bags.cumsum(0)[:-1]])
        tables.append((*_draw(100 + t, rows, dim, dtype=dtype), idx, off))
    return tables, _draw(99, batch, len(tables), dim, dtype=dtype)


def _embedding(dtype):
    r = dist.get_rank()
    tables, (G, Gd) = _embedding_problem(dtype, sum(M_SIZES))
    mine = tables[_cut(TABLES, r)]
    weights = [w.clone().requires_grad_() for w, _, _, _ in mine]
    out = embedding_all_to_all(weights, [i.to(DEVICE) for _, _, i, _ in mine],
                               [o.to(DEVICE) for _, _, _, o in mine],
                               batch_sizes=M_SIZES, chunks=CHUNKS)
    taken = _taken("embedding_all_to_all")
    ms = _cut(M_SIZES, r)
    (out * G[ms]).sum().backward()
    taken.update(_taken("embedding_all_to_all.wgrad"))
    # the reference: every table pooled over the whole batch in float64, then this rank's rows
    ref_weights = [wd.clone().requires_grad_() for _, wd, _, _ in tables]
    pooled = torch.stack([F.embedding_bag(i, w, o, mode="sum")
                          for w, (_, _, i, o) in zip(ref_weights, tables)], 1)  # [B, T, D]
    (pooled * Gd).sum().backward()
    got = {"out": (out, pooled.detach()[ms])}
    for t, (weight, ref) in enumerate(zip(weights, ref_weights[_cut(TABLES, r)])):
        got[f"dw{t}"] = (weight.grad, ref.grad)
    return got, taken


# --- MoE dispatch and combine ----------------------------------------------------

def _moe_counts():
    """counts[s][d][e]: tokens rank s sends expert e of rank d (uneven, some none)."""
    g = torch.Generator().manual_seed(14)
    return [[torch.randint(0, 7, (EXPERTS[d],), generator=g).tolist() for d in range(WORLD)]
            for _ in range(WORLD)]


def _moe_reference(counts, x, w1, w2, dy, dout):
    """Per (source, destination, expert) block in float64: dispatch's y (rows by source,
    expert on each destination), combine's output (x's row order), and the gradients."""
    x, w1, w2 = ([t.clone().requires_grad_() for t in ts] for ts in (x, w1, w2))
    ys, outs = [[] for _ in range(WORLD)], []
    for s in range(WORLD):
        at, parts = 0, []
        for d in range(WORLD):
            for e, n in enumerate(counts[s][d]):
                block = x[s][at:at + n] @ w1[d][e]
                ys[d].append((s, e, block))
                parts.append(block @ w2[d][e])
                at += n
        outs.append(torch.cat(parts))
    y = [torch.cat([b for _, _, b in sorted(blocks, key=lambda i: i[:2])]) for blocks in ys]
    loss = sum((y[d] * dy[d]).sum() + (outs[d] * dout[d]).sum() for d in range(WORLD))
    loss.backward()
    return ([t.detach() for t in y], [t.detach() for t in outs],
            [(x[r].grad, w1[r].grad, w2[r].grad) for r in range(WORLD)])


def _moe(dtype):
    r = dist.get_rank()
    counts = _moe_counts()
    t_send = [sum(map(sum, counts[s])) for s in range(WORLD)]
    t_recv = [sum(sum(counts[s][d]) for s in range(WORLD)) for d in range(WORLD)]
    h, f = 8, 6
    x, w1, w2, dy, dout = ([_draw(seed + 10 * q, *shape(q), dtype=dtype) for q in range(WORLD)]
                           for seed, shape in ((20, lambda q: (t_send[q], h)),
                                               (21, lambda q: (EXPERTS[q], h, f)),
                                               (22, lambda q: (EXPERTS[q], f, h)),
                                               (23, lambda q: (t_recv[q], f)),
                                               (24, lambda q: (t_send[q], h))))
    send, recv = counts[r], [counts[s][r] for s in range(WORLD)]
    xr, w1r, w2r = (t[r][0].clone().requires_grad_() for t in (x, w1, w2))
    y = all_to_all_matmul(xr, w1r, send, recv, chunks=CHUNKS)
    out = matmul_all_to_all(y, w2r, send, recv, chunks=CHUNKS)
    taken = _taken("all_to_all_matmul", "matmul_all_to_all")
    ((y * dy[r][0]).sum() + (out * dout[r][0]).sum()).backward()
    taken.update(_taken("all_to_all_matmul.dgrad", "matmul_all_to_all.dgrad"))
    ref_y, ref_out, ref_grads = _moe_reference(counts, *([v for _, v in t] for t in
                                                           (x, w1, w2, dy, dout)))
    gx, g1, g2 = ref_grads[r]
    return {"y": (y, ref_y[r]), "out": (out, ref_out[r]), "dx": (xr.grad, gx),
            "dw1": (w1r.grad, g1), "dw2": (w2r.grad, g2)}, taken


CASES = {"matmul_all_reduce": lambda dtype: _matmul_all_reduce(dtype, 24),
         "matmul_all_reduce (GEMV: pieces cut N)": lambda dtype: _matmul_all_reduce(dtype, 4),
         "column_parallel_matmul": _column_parallel,
         "all_gather_matmul": _all_gather_matmul,
         "matmul_reduce_scatter": _matmul_reduce_scatter,
         "embedding_all_to_all": _embedding,
         "all_to_all_matmul + matmul_all_to_all": _moe}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got.detach().double().cpu() - want).abs().max()) if want.numel() else 0.0
    return diff / scale if scale else diff


def _every_case():
    """Per (operator, dtype): per tensor, (its dtype's name, relative error, shape matches);
    and the path and pieces of each of the operator's collectives."""
    results = {}
    for name, case in CASES.items():
        for dtype_name, dtype in DTYPES.items():
            tensors, taken = case(dtype)
            results[name, dtype_name] = (
                {key: (str(got.dtype).removeprefix("torch."), _rel(got, want),
                       got.shape == want.shape) for key, (got, want) in tensors.items()},
                taken)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_every_case, WORLD)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_fused_on_3_uneven_ranks_matches_float64(per_rank, name, dtype):
    for rank, results in enumerate(per_rank):
        tensors, taken = results[name, dtype]
        assert taken and set(taken.values()) == {("fused", CHUNKS)}, (rank, taken)
        for key, (got_dtype, err, same_shape) in tensors.items():
            assert same_shape and got_dtype == dtype, (rank, key, got_dtype)
            assert err <= TOL[dtype], f"rank {rank}: {key} off by {err:.1e} (tolerance {TOL[dtype]})"
