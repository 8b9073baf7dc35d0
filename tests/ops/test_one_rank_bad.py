"""One rank handed a bad or mismatched argument: every rank refuses it, at once, and the group
still works.

For every public operator that crosses ranks (``plait.ops.__all__``) and every layer in
``plait.nn``, one rank gets a different ``chunks`` (two integers, or ``'auto'`` against an
integer), a different shape or dtype, a different ``requires_grad`` (the backward's
collectives), or a non-contiguous input (which must simply work). Every rank must raise
a ValueError/TypeError whose message names the problem within seconds (never the
group's timeout, never a crash inside gloo), and the same call with good arguments on
every rank, made next in the same processes, must match a single-process float64
reference (|error| ≤ 1e-10): the group is still usable. Zero-sized shares (fewer rows,
bags or tokens than ranks) are legal and checked the same way.
"""

import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import Phase, given, settings, strategies as st

import plait.nn as pnn
from plait import ops
from plait.ops.pieces import even_sizes
from plait.testing import run_ranks

TOL = 1e-10
TIMEOUT_S = 60  # the group's collective timeout (and rendezvous): no case may come near it
# a refusal takes one small gather (and one more to explain it): milliseconds, and what a
# peer's lag on a loaded machine adds; a fifth of the timeout tells it from a wait for it
FAST_S = 12.0
F64 = torch.float64

# what a refusal's message must name, by the kind of bad argument
NAMES = {"chunks": r"chunks", "auto": r"chunks.*'auto'|'auto'.*chunks",
         "rows": r"\bM\b|rows|sizes|batch|elements",
         "width": r"\b[KDN]\b|features|other dims|elements", "dtype": r"float32",
         "grad": r"grad", "count": r"indices"}


def _full(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _cut(sizes, rank):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _strided(t):
    """The same values, not contiguous (every other column of a wider buffer)."""
    wide = t.new_zeros(*t.shape[:-1], 2 * t.shape[-1])
    wide[..., ::2] = t
    out = wide[..., ::2]
    assert not out.is_contiguous() or t.numel() == 0 or t.shape[-1] == 1
    return out


def _err(got, want):
    """max |got - want|; a gradient that is None (nothing flowed there) reads as zeros."""
    if got is None:
        got = torch.zeros_like(want)
    if want is None:
        want = torch.zeros_like(got)
    got = got.detach()
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max()) if got.numel() else 0.0


# --- operators: each builds its inputs from ``p`` (this rank's), calls the operator, and
# --- gives (outputs and gradients, the reference's); ``p`` differs on the bad rank only

def _mar(p):
    r, world = dist.get_rank(), dist.get_world_size()
    ks, k = _cut(p["k_sizes"], r), sum(p["k_sizes"])
    X, W, G = _full(1, p["m"], k), _full(2, k, 6), _full(3, p["m"], 6)
    x, w = X[:, ks].to(p["dtype"]), W[ks].to(p["dtype"])
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    w.requires_grad_()
    y = ops.matmul_all_reduce(x, w, chunks=p["chunks"])
    y.backward(G)
    return [y, x.grad, w.grad], [X @ W, (G @ W.T)[:, ks], (X.T @ G)[ks]]


def _gemv(p):  # M ≤ 8: pieces cut N; a column-major w as row-parallel layers pass it
    r = dist.get_rank()
    ks, k = _cut(p["k_sizes"], r), sum(p["k_sizes"])
    X, W = _full(1, 3, k), _full(2, k, 10)
    x, w = X[:, ks].to(p["dtype"]), W[ks].t().contiguous().t()
    x = _strided(x) if p["strided"] else x
    y = ops.matmul_all_reduce(x, w, chunks=p["chunks"])
    # dense either way: held transposed where every rank's w is column-major (an empty
    # share's is not), returned as that buffer's view, else contiguous
    dense = y.is_contiguous() or y.t().is_contiguous()
    return [y, torch.tensor(float(not dense))], [X @ W, torch.tensor(0.0)]


def _cpm(p):
    r = dist.get_rank()
    ns = _cut(p["n_sizes"], r)
    X, W, G = _full(1, p["m"], 5), _full(2, 5, sum(p["n_sizes"])), _full(3, p["m"], sum(p["n_sizes"]))
    x = X.to(p["dtype"])
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    w = W[:, ns].clone().requires_grad_()
    y = ops.column_parallel_matmul(x, w, chunks=p["chunks"])
    y.backward(G[:, ns])
    return [y, x.grad, w.grad], [(X @ W)[:, ns], G @ W.T, (X.T @ G)[:, ns]]


def _agm(p):
    r = dist.get_rank()
    ms, ns = _cut(p["m_sizes"], r), _cut(p["n_sizes"], r)
    k = 4 + p["k_extra"]
    X, W, G = _full(1, sum(p["m_sizes"]), k), _full(2, k, sum(p["n_sizes"])), \
        _full(3, sum(p["m_sizes"]), sum(p["n_sizes"]))
    x = X[ms].to(p["dtype"])
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    w = W[:, ns].clone().requires_grad_()
    y = ops.all_gather_matmul(x, w, chunks=p["chunks"])
    y.backward(G[:, ns])
    return [y, x.grad, w.grad], [X @ W[:, ns], (G @ W.T)[ms], (X.T @ G)[:, ns]]


def _mrs(p):
    r, world = dist.get_rank(), dist.get_world_size()
    ks = _cut(p["k_sizes"], r)
    ms = _cut(even_sizes(p["m"], world), r)  # sizes=None: even, zero shares when m < world
    X, W, G = _full(1, p["m"], sum(p["k_sizes"])), _full(2, sum(p["k_sizes"]), 5), _full(3, p["m"], 5)
    x = X[:, ks].to(p["dtype"])
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    w = W[ks].clone().requires_grad_(p["grad"])  # either needing a gradient means a backward
    y = ops.matmul_reduce_scatter(x, w, chunks=p["chunks"])
    y.backward(G[ms])
    return [y, x.grad, w.grad], [(X @ W)[ms], (G @ W.T)[:, ks], (X.T @ G)[ks]]


def _emb(p):
    r, world = dist.get_rank(), dist.get_world_size()
    d, batch, rows = 3 + p["k_extra"], p["batch"], 7
    tables = [_full(10 + t, rows, d) for t in range(world)]  # one table per rank
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 4, (world, batch), generator=gen)
    idx = [torch.randint(0, rows, (int(lengths[t].sum()),), generator=gen) for t in range(world)]
    off = [torch.cat([torch.zeros(1, dtype=torch.long), lengths[t].cumsum(0)[:-1]]) for t in range(world)]
    G = _full(4, batch, world, d)
    bs = _cut(even_sizes(batch, world), r)  # batch_sizes=None: even, zero shares when batch < world
    mine = tables[r].to(p["dtype"], copy=True).requires_grad_(p["grad"])
    i = _strided(idx[r][None])[0] if p["strided"] else idx[r]
    out = ops.embedding_all_to_all([mine], [i], [off[r]], chunks=p["chunks"])
    if p["grad"]:
        out.backward(G[bs])
    ref = [t.clone().requires_grad_() for t in tables]
    full = torch.stack([F.embedding_bag(idx[t], ref[t], off[t], mode="sum") for t in range(world)], 1)
    (full * G).sum().backward()
    got = [out] + ([mine.grad] if p["grad"] else [])
    return got, [full[bs].detach()] + ([ref[r].grad] if p["grad"] else [])


def _moe_routes(world, experts):
    """counts[s][d][e]: tokens rank s sends rank d's expert e (zeros included)."""
    gen = torch.Generator().manual_seed(6)
    return [[torch.randint(0, 3, (experts[d],), generator=gen).tolist() for d in range(world)]
            for s in range(world)]


def _moe(p, combine):
    r, world = dist.get_rank(), dist.get_world_size()
    experts, h, f = [1, 2, 1][:world], 4 + p["k_extra"], 3
    c = _moe_routes(world, experts)
    send, recv = c[r], [c[s][r] for s in range(world)]
    width_in, width_out = (f, h) if combine else (h, f)
    rows_of = [sum(map(sum, c[s])) for s in range(world)]  # tokens each rank sends
    ins = [_full(20 + s, rows_of[s], width_in) for s in range(world)]  # dispatch: x of rank s
    ws = [_full(30 + d, experts[d], width_in, width_out) for d in range(world)]
    if combine:  # y on rank d: rows (s, e) of the tokens rank d received
        ins = [_full(40 + d, sum(c[s][d][e] for s in range(world) for e in range(experts[d])),
                     width_in) for d in range(world)]
    ref_in = [t.clone().requires_grad_() for t in ins]
    ref_w = [t.clone().requires_grad_() for t in ws]
    outs = _moe_reference(ref_in, ref_w, c, world, experts, combine)
    grads = [_full(50 + q, *o.shape) for q, o in enumerate(outs)]
    sum((o * g).sum() for o, g in zip(outs, grads)).backward()
    x = ins[r].to(p["dtype"])
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    w = ws[r].clone().requires_grad_()
    op = ops.matmul_all_to_all if combine else ops.all_to_all_matmul
    y = op(x, w, send, recv, chunks=p["chunks"])
    y.backward(grads[r])
    got = [y, w.grad] + ([x.grad] if p["grad"] else [])
    return got, [outs[r].detach(), ref_w[r].grad] + ([ref_in[r].grad] if p["grad"] else [])


def _moe_reference(ins, ws, c, world, experts, combine):
    """Every rank's output, single-process: dispatch rows (s, e) on each owner; combine rows
    (d, e) back on each sender."""
    def block(t, counts_rows, a, e):  # rows of block (a, e) in a tensor ordered (a, e)
        at = sum(sum(row) for row in counts_rows[:a]) + sum(counts_rows[a][:e])
        return t[at:at + counts_rows[a][e]]
    if not combine:
        return [torch.cat([block(ins[s], c[s], d, e) @ ws[d][e]
                           for s in range(world) for e in range(experts[d])]) for d in range(world)]
    recv = [[c[s][d] for s in range(world)] for d in range(world)]  # on d, ordered (s, e)
    return [torch.cat([block(ins[d], recv[d], s, e) @ ws[d][e]
                       for d in range(world) for e in range(experts[d])]) for s in range(world)]


OPS = {"matmul_all_reduce": _mar, "matmul_all_reduce.gemv": _gemv,
       "column_parallel_matmul": _cpm, "all_gather_matmul": _agm,
       "matmul_reduce_scatter": _mrs, "embedding_all_to_all": _emb,
       "all_to_all_matmul": lambda p: _moe(p, False), "matmul_all_to_all": lambda p: _moe(p, True)}

# the kinds of bad argument each operator can be handed (a K_r or M_r of its own is no
# mismatch where shards may be uneven; matmul_all_reduce's backward crosses no rank)
KINDS = {"matmul_all_reduce": ("chunks", "auto", "rows", "dtype", "strided"),
         "matmul_all_reduce.gemv": ("chunks", "auto", "dtype", "strided"),
         "column_parallel_matmul": ("chunks", "auto", "rows", "dtype", "grad", "strided"),
         "all_gather_matmul": ("chunks", "auto", "width", "dtype", "grad", "strided"),
         "matmul_reduce_scatter": ("chunks", "auto", "rows", "dtype", "grad", "strided"),
         "embedding_all_to_all": ("chunks", "auto", "rows", "width", "dtype", "grad", "strided"),
         "all_to_all_matmul": ("chunks", "auto", "width", "dtype", "grad", "strided"),
         "matmul_all_to_all": ("chunks", "auto", "width", "dtype", "grad", "strided")}


def _good(world, chunks, m):
    """Arguments every rank agrees on; zero-sized shares wherever a user can give one."""
    return {"chunks": chunks, "dtype": F64, "grad": True, "strided": False, "k_extra": 0,
            "m": m,  # below the world: matmul_reduce_scatter's even split has empty shares
            "k_sizes": [3, 0, 2][:world], "n_sizes": [2, 3, 0][:world],
            "m_sizes": [4, 0, 3][:world], "batch": m}  # embedding: fewer bags than ranks too


def _bad(kind, good, bad_chunks):
    """What the bad rank gets instead of ``good``."""
    return {"chunks": {"chunks": bad_chunks},
            "auto": {"chunks": "auto"},
            "rows": {"m": good["m"] + 1, "batch": good["batch"] + 1},
            "width": {"k_extra": 1},
            "dtype": {"dtype": torch.float32},
            "grad": {"grad": False},
            "strided": {"strided": True}}[kind]  # not bad: it must simply work


def _every_operator(bad_rank, good_chunks, bad_chunks, m):
    """For each operator and each kind: the call with one rank's argument changed, then
    the good call on every rank; (what the first did, its seconds, the second's error)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {}
    for name, call in OPS.items():
        good = _good(world, good_chunks, 3 if name.endswith("gemv") else m)
        for kind in KINDS[name]:
            p = {**good, **_bad(kind, good, bad_chunks)} if rank == bad_rank else good
            seen[name, kind] = (*_timed(call, p), _worst(*call(good)))
    return seen


def _timed(call, p):
    started = time.perf_counter()
    try:
        outcome = _worst(*call(p))
    except (ValueError, TypeError) as err:
        outcome = f"{type(err).__name__}: {err}"
    return outcome, time.perf_counter() - started


def _worst(got, want):
    return max(_err(a, b) for a, b in zip(got, want, strict=True))


def _check(results, layers=False):
    """Every rank: each bad call refused in seconds, naming its problem (a strided input,
    a rank without tokens simply worked), and the good call after it exact."""
    for rank, seen in enumerate(results):
        for (name, kind), (outcome, seconds, after) in seen.items():
            where = (rank, name, kind, outcome, seconds)
            assert seconds < FAST_S, where
            assert after < TOL, where
            if kind in ("strided", "empty"):
                assert not isinstance(outcome, str) and outcome < TOL, where
                continue
            assert isinstance(outcome, str) and outcome.startswith(("ValueError", "TypeError")), where
            assert layers or name.split(".")[0] in outcome, where
            assert re.search(NAMES[kind], outcome), where


# --- layers: built on every rank from one single-device twin; the bad rank's call differs

B = 2  # batch of the linear layers' [B, S, K] inputs


def _linear_input(p, k, rank_share=None):
    """(x as this rank passes it, the full X for the reference, the rows of it x holds)."""
    X = _full(60, B, p["m"], k + p["k_extra"])
    share = slice(None) if rank_share is None else rank_share
    x = X[:, share].to(p["dtype"])
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    return x, X, share


def _column(p, sp=False, overlap=True):
    r, world = dist.get_rank(), dist.get_world_size()
    k, n = 5, 6
    ref = nn.Linear(k, n, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(_full(61, n, k)), ref.bias.copy_(_full(62, n))
    layer = pnn.ColumnParallelLinear.from_module(ref, chunks=p["chunks"], overlap=overlap,
                                                 sequence_parallel=sp)
    x, X, share = _linear_input(p, k, _cut(even_sizes(p["m"], world), r) if sp else None)
    G = _full(63, B, p["m"], n)
    cols = layer.plan.slice_of(r)
    y = layer(x)
    y.backward(G[..., cols])
    Xr = X.clone().requires_grad_()
    (ref(Xr) * G).sum().backward()
    return ([y, x.grad, layer.weight.grad, layer.bias.grad],
            [ref(X)[..., cols].detach(), Xr.grad[:, share], ref.weight.grad[cols], ref.bias.grad[cols]])


def _row(p, sp=False, overlap=True):
    r, world = dist.get_rank(), dist.get_world_size()
    k, n = 6, 5
    ref = nn.Linear(k, n, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(_full(64, n, k)), ref.bias.copy_(_full(65, n))
    layer = pnn.RowParallelLinear.from_module(ref, chunks=p["chunks"], overlap=overlap,
                                              sequence_parallel=sp)
    ks = layer.plan.slice_of(r)
    X = _full(60, B, p["m"], k)
    x = X[..., ks].to(p["dtype"])
    if p["k_extra"]:
        x = torch.cat([x, x[..., :1]], -1)
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    seq = _cut(even_sizes(p["m"], world), r) if sp else slice(None)
    G = _full(66, B, p["m"], n)
    y = layer(x)
    y.backward(G[:, seq])
    Xr = X.clone().requires_grad_()
    (ref(Xr) * G).sum().backward()
    return ([y, x.grad, layer.weight.grad, layer.bias.grad],
            [ref(X)[:, seq].detach(), Xr.grad[..., ks], ref.weight.grad[:, ks], ref.bias.grad])


def _embedding_bag(p):
    r, world = dist.get_rank(), dist.get_world_size()
    rows, d, batch = 7, 3, p["batch"]
    full = [_full(70 + t, rows, d) for t in range(world + 1)]
    layer = pnn.ShardedEmbeddingBag([rows] * (world + 1), d, chunks=p["chunks"],
                                    full_weights=full, dtype=F64)
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 4, (world + 1, batch), generator=gen)
    idx = [torch.randint(0, rows, (int(n.sum()),), generator=gen) for n in lengths]
    off = [torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)[:-1]]) for n in lengths]
    if p["strided"]:
        idx = [_strided(i[None])[0] for i in idx]
    drop = 1 if p["k_extra"] else 0  # the bad rank passes one table's bags too few
    out = layer(idx[:len(idx) - drop], off[:len(off) - drop])
    bs = _cut(even_sizes(batch, world), r)
    G = _full(71, batch, world + 1, d)
    out.backward(G[bs])
    ref = [w.clone().requires_grad_() for w in full]
    whole = torch.stack([F.embedding_bag(i, w, o, mode="sum") for i, w, o in zip(idx, ref, off)], 1)
    (whole * G).sum().backward()
    owned = list(layer.owned)
    return ([out] + [layer.bags[str(t)].weight.grad for t in owned],
            [whole[bs].detach()] + [ref[t].grad for t in owned])


def _moe_layer(p):
    r, world = dist.get_rank(), dist.get_world_size()
    h, f, e = 4, 3, world + 1
    router, w1, w2 = _full(80, e, h), _full(81, e, h, f), _full(82, e, f, h)
    layer = pnn.MoE(h, f, e, 2, chunks=p["chunks"], full_router=router, full_w1=w1,
                    full_w2=w2, dtype=F64)
    tokens = 0 if p["empty"] else 3 + r  # each rank's own tokens, as many as it has
    X = _full(83 + r, tokens, h + p["k_extra"])
    x = X.to(p["dtype"])
    x = (_strided(x) if p["strided"] else x.clone()).requires_grad_(p["grad"])
    G = _full(84 + r, tokens, h)
    y = layer(x)
    y.backward(G)
    Xr = X.clone().requires_grad_()
    weights, experts = pnn.moe.route_top_k(Xr @ router.T, 2)
    want = pnn.moe.experts_reference(Xr, weights, experts, w1, w2)
    if want.requires_grad:  # no tokens: nothing to differentiate
        (want * G).sum().backward()
    return [y, x.grad], [want.detach(), Xr.grad]


LAYERS = {
    "ColumnParallelLinear": (_column, ("chunks", "auto", "rows", "width", "dtype", "grad", "strided")),
    "ColumnParallelLinear.plain": (lambda p: _column(p, overlap=False),
                                   ("rows", "width", "dtype", "grad", "strided")),
    "ColumnParallelLinear.sp": (lambda p: _column(p, sp=True),
                                ("chunks", "auto", "width", "dtype", "grad", "strided")),
    "ColumnParallelLinear.sp.plain": (lambda p: _column(p, sp=True, overlap=False),
                                      ("width", "dtype", "grad", "strided")),
    "RowParallelLinear": (_row, ("chunks", "auto", "rows", "width", "dtype", "strided")),
    "RowParallelLinear.plain": (lambda p: _row(p, overlap=False),
                                ("rows", "width", "dtype", "strided")),
    "RowParallelLinear.sp": (lambda p: _row(p, sp=True),  # (w needs grad on every rank)
                             ("chunks", "auto", "rows", "width", "dtype", "strided")),
    "RowParallelLinear.sp.plain": (lambda p: _row(p, sp=True, overlap=False),
                                   ("rows", "width", "dtype", "strided")),
    "ShardedEmbeddingBag": (_embedding_bag, ("chunks", "auto", "rows", "count", "strided")),
    "MoE": (_moe_layer, ("chunks", "auto", "width", "dtype", "strided", "empty")),
}


def _every_layer(bad_rank, good_chunks, bad_chunks, m):
    rank, world = dist.get_rank(), dist.get_world_size()
    seen = {}
    for name, (call, kinds) in LAYERS.items():
        good = {**_good(world, good_chunks, m), "empty": False}
        for kind in kinds:
            change = {"count": {"k_extra": 1}, "empty": {"empty": True}}.get(kind) \
                or _bad(kind, good, bad_chunks)
            p = {**good, **change} if rank == bad_rank else good
            seen[name, kind] = (*_timed(call, p), _worst(*call(good)))
    return seen


def _everything(bad_rank, good_chunks, bad_chunks, m):
    """Operators on ``m`` rows, then layers on a sequence and batch shorter than the world
    (empty shares), all in one launch: a launch costs more than all the calls together."""
    return _every_operator(bad_rank, good_chunks, bad_chunks, m), \
        _every_layer(bad_rank, good_chunks, bad_chunks, dist.get_world_size() - 1)


@pytest.mark.parametrize("world", [2, 3])
@settings(max_examples=1, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(data=st.data())
def test_one_bad_rank_is_refused_on_every_rank_and_the_group_goes_on(world, data):
    # one example a run, unshrunk: each costs a launch (a failing one names its draws, and
    # the next run replays it first)
    good_chunks = data.draw(st.integers(1, 4), "good chunks")
    bad_chunks = data.draw(st.integers(1, 5).filter(lambda c: c != good_chunks), "bad chunks")
    bad_rank = data.draw(st.integers(0, world - 1), "bad rank")
    m = data.draw(st.integers(1, 9), "rows")
    # no wall-time bound on the launch as a whole: a case that waited out the collective
    # timeout shows in its own seconds (FAST_S, a fifth of the timeout), or raises gloo's
    # timeout, which no case catches; the launch's start-up is the machine's load
    ops_seen, layers_seen = zip(*run_ranks(_everything, world, bad_rank, good_chunks, bad_chunks,
                                           m, timeout_s=TIMEOUT_S))
    _check(ops_seen)
    _check(layers_seen, layers=True)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 50), world=st.integers(1, 9))
def test_even_sizes_cover_the_total_with_empty_shares_last(total, world):
    sizes = even_sizes(total, world)
    assert len(sizes) == world and sum(sizes) == total
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    assert even_sizes(2, 3) == [1, 1, 0]


def test_refusals_name_dtypes_and_auto_and_one_piece():
    from plait.ops.agree import check_same, dtype_code
    from plait.ops.context import Decision

    f32, f16 = dtype_code(torch.float32), dtype_code(torch.float16)
    with pytest.raises(ValueError, match=r"op: ranks disagree on \(dtype, chunks\): rank 0 has "
                                         r"\(torch.float32, 'auto'\), rank 2 has \(torch.float16, 2\)"):
        check_same("op", ("dtype", "M", "chunks"), [(f32, 4, 0), (f32, 4, 0), (f16, 4, 2)])
    check_same("op", ("dtype", "M"), [(f32, 4), (f32, 4)])
    assert "(1 piece)" in Decision("op", "fallback", 1, "why").line()
    assert "(3 pieces)" in Decision("op", "fused", 3, "why").line()
