"""The fused operators' CUDA path on one GPU: correctness, stream ordering, timings.

    python scripts/device_check.py [--device cuda|cpu] [--json FILE]

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so with one GPU the
ranks here share it through gloo, which carries CUDA tensors (it copies each one to
the host, on a stream of its own that waits for the caller's stream). That is the
same code path the operators take under NCCL up to the collective call: pieces
computed on the GPU, each handed to an asynchronous collective as soon as it is
computed. What it checks:

1. correctness: every matmul operator, forward and backward, 2 and 3 ranks with
   uneven shares, fp32/bf16/fp64 on the GPU against a float64 CPU reference;
2. stream ordering: the same, with the inputs made by a long kernel chain on a
   side stream that the operators run under (a collective that read its piece
   before the stream reached it would send stale data);
3. NCCL: a world of one initialises and the operators give the plain result;
4. timings: one balanced matmul_all_reduce shape, unfused vs fused at 2 and 4
   pieces, median of repeated calls, beside compute alone and the collective alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from plait.ops import (all_gather_matmul, column_parallel_matmul, explain,  # noqa: E402
                       matmul_all_reduce, matmul_reduce_scatter)
from plait.runtime.launch import launch  # noqa: E402

TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2}
SHARES = {1: [64], 2: [40, 24], 3: [40, 8, 16]}  # uneven: K_r, M_r or N_r of each rank


def _full(seed, *shape):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return float((a.double().cpu() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _slow_zero(device, stream):
    """A zero that a few hundred ms of kernels on ``stream`` must finish before it exists."""
    with torch.cuda.stream(stream):
        big = torch.randn(4096, 4096, device=device)
        for _ in range(20):
            big = big @ big
            big = big / big.norm()
        return big[:1, :1].mul(0)


def _case(name, rank, world, chunks):
    """This rank's inputs, the fused call, its output gradient, and the float64 reference:
    (output, [grad of each input]) as this rank must see them."""
    sizes, m, k, n = SHARES[world], 48, 64, 32
    total, lo, hi = sum(sizes), sum(sizes[:rank]), sum(sizes[:rank + 1])
    if name == "matmul_all_reduce":  # K split: [M, K_r] @ [K_r, N], summed
        x, w, g = _full(1, m, total), _full(2, total, n), _full(3, m, n)
        mine = (x[:, lo:hi], w[lo:hi])
        fn = lambda a, b: matmul_all_reduce(a, b, chunks=chunks)  # noqa: E731
        pick = lambda y, gx, gw: (y, [gx[:, lo:hi], gw[lo:hi]])  # noqa: E731
        g_mine = g
    elif name == "all_gather_matmul":  # rows split in, columns split out
        x, w, g = _full(4, total, k), _full(5, k, total), _full(6, total, total)
        mine = (x[lo:hi], w[:, lo:hi])
        fn = lambda a, b: all_gather_matmul(a, b, sizes=sizes, chunks=chunks)  # noqa: E731
        pick = lambda y, gx, gw: (y[:, lo:hi], [gx[lo:hi], gw[:, lo:hi]])  # noqa: E731
        g_mine = g[:, lo:hi]
    else:  # matmul_reduce_scatter: K split in, rows split out
        x, w, g = _full(7, total, total), _full(8, total, n), _full(9, total, n)
        mine = (x[:, lo:hi], w[lo:hi])
        fn = lambda a, b: matmul_reduce_scatter(a, b, sizes=sizes, chunks=chunks)  # noqa: E731
        pick = lambda y, gx, gw: (y[lo:hi], [gx[:, lo:hi], gw[lo:hi]])  # noqa: E731
        g_mine = g[lo:hi]
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = xr @ wr
    y.backward(g)
    return mine, fn, g_mine, pick(y.detach(), xr.grad, wr.grad)


OPS = ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter")


def _check_rank(device_type, dtypes, side_stream):
    """Every operator × dtype × piece count on this rank: worst relative error of the
    output and the input gradients against the float64 reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)  # autograd's backward thread inherits it
    stream = torch.cuda.Stream(device) if side_stream else None
    rows = []
    for dtype in dtypes:
        for name in OPS:
            for chunks in (1, 3):
                mine, fn, g, (y_ref, g_ref) = _case(name, rank, world, chunks)
                a, b = (t.to(device=device, dtype=dtype).requires_grad_(True) for t in mine)
                if stream is None:
                    y = fn(a, b)
                    y.backward(g.to(device=device, dtype=dtype))
                else:
                    zero = _slow_zero(device, stream)
                    with torch.cuda.stream(stream):  # inputs not ready until the chain is done
                        y = fn(a + zero.to(dtype), b + zero.to(dtype))
                        y.backward(g.to(device=device, dtype=dtype))
                    torch.cuda.synchronize(device)
                err = max([_rel(y.detach(), y_ref)]
                          + [_rel(t.grad, r) for t, r in zip((a, b), g_ref)])
                rows.append(dict(op=name, dtype=str(dtype).split(".")[-1], chunks=chunks,
                                 world=world, rank=rank, side_stream=side_stream,
                                 rel_err=err, tol=TOL[dtype], ok=err <= TOL[dtype],
                                 dtype_kept=y.dtype == dtype,
                                 path=explain(name).split(":", 1)[-1].strip()[:80]))
    return rows


def _timing_rank(device_type, repeats):
    """One balanced matmul_all_reduce: compute alone, all_reduce alone, unfused, fused."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    big = device_type == "cuda"
    if big:
        torch.cuda.set_device(device)
    m, k, n = (4096, 65536 // world, 1024) if big else (512, 1024, 256)
    x = torch.randn(m, k, device=device)
    w = torch.randn(k, n, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if big else (lambda: None)

    def timed(fn):
        fn()
        sync()
        dist.barrier()
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    y = x @ w
    variants = {
        "compute": lambda: x @ w,
        "all_reduce": lambda: dist.all_reduce(y),
        "unfused": lambda: dist.all_reduce(x @ w),
        "fused_2": lambda: matmul_all_reduce(x, w, chunks=2),
        "fused_4": lambda: matmul_all_reduce(x, w, chunks=4),
    }
    order = list(variants) * 1
    times = {name: [] for name in variants}
    for _ in range(3):  # interleaved rounds
        for name in order:
            times[name].append(timed(variants[name]))
    return dict(shape=dict(m=m, k_per_rank=k, n=n, dtype="float32"), world=world,
                median_s={name: statistics.median(ts) for name, ts in times.items()},
                rounds_s=times)


def _every_operator_rank():
    """tests/ops/test_uneven_dtypes.py's cases (every operator, embedding and MoE
    included, 3 uneven ranks, three dtypes) with the operators' inputs on the GPU."""
    torch.cuda.set_device(0)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.ops import test_uneven_dtypes as cases
    cases.DEVICE = torch.device("cuda", 0)
    rows = []
    for (name, dtype), (tensors, taken) in cases._every_case().items():
        worst = max(err for _, err, _ in tensors.values())
        kept = all(kind == dtype and same for kind, _, same in tensors.values())
        fused = all(path == "fused" for path, _ in taken.values())
        rows.append(dict(op=name, dtype=dtype, rel_err=worst, tol=cases.TOL[dtype],
                         ok=worst <= cases.TOL[dtype] and kept and fused,
                         paths=sorted(set(map(str, taken.values())))))
    return rows


def _nccl_world_of_one():
    """NCCL initialises with one rank; each operator gives the plain result, forward and
    backward, and says why it did not cut."""
    torch.cuda.set_device(0)
    rows = {}
    for name in OPS:
        mine, fn, g, (y_ref, g_ref) = _case(name, 0, 1, 2)
        a, b = (t.to("cuda").float().requires_grad_(True) for t in mine)
        y = fn(a, b)
        y.backward(g.to("cuda").float())
        rows[name] = max([_rel(y.detach(), y_ref)]
                         + [_rel(t.grad, r) for t, r in zip((a, b), g_ref)])
    return dict(rel_err=rows, explain=explain(), backend=dist.get_backend())


def _symm_mem_world_of_one():
    """torch's symmetric memory (plait.transport.cuda) on a one-rank NCCL group: float32 and
    bf16 through it (one-shot and two-shot sizes), float16 and an odd-length bf16 routed to
    NCCL, a call on a side stream ordered after the last one, and no host sync in a call
    once its (dtype, numel) is agreed (torch's sync debug mode set to error)."""
    from plait.transport.base import Choice
    from plait.transport.cuda import SymmMemTransport, symm_mem_path

    torch.cuda.set_device(0)
    transport = SymmMemTransport(None, Choice("symm_mem", "device check"))
    rows = {}
    for dtype, numel in ((torch.float32, 1000), (torch.float32, 1 << 18), (torch.bfloat16, 4096),
                         (torch.bfloat16, 4095), (torch.float16, 4096)):
        x = torch.randn(numel, device="cuda").to(dtype)
        want = x.clone()
        transport.all_reduce(x)  # agrees the signature (a host sync, once)
        torch.cuda.set_sync_debug_mode("error")
        try:
            transport.all_reduce(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        path = symm_mem_path(dtype, numel * x.element_size(), transport.capacity) or "symm_mem"
        rows[f"{dtype}x{numel}"] = dict(path=path, equal=bool(torch.equal(x, want)))
    side = torch.cuda.Stream()
    y = torch.ones(1000, device="cuda")
    with torch.cuda.stream(side):
        transport.all_reduce(y)
    torch.cuda.synchronize()
    rows["side_stream"] = dict(path="symm_mem", equal=bool((y == 1).all()))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = args.device
    facts = dict(torch=torch.__version__, device=device)
    if device == "cuda":
        facts.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                     nccl=".".join(map(str, torch.cuda.nccl.version())))
    print(json.dumps(facts), flush=True)
    result = dict(facts=facts, correctness=[], nccl=None, timings=[])
    dtypes = [torch.float64, torch.float32, torch.bfloat16]
    failed = 0
    for world in (2, 3):
        streams = (False, True) if device == "cuda" else (False,)
        for side_stream in streams:
            t0 = time.perf_counter()
            ranks = launch(_check_rank, world, args=(device, dtypes, side_stream), timeout_s=120,
                           threads=2)
            for rows in ranks:
                for row in rows:
                    result["correctness"].append(row)
                    failed += not (row["ok"] and row["dtype_kept"])
            print(f"world {world} side_stream={side_stream}: "
                  f"{sum(len(r) for r in ranks)} checks, {time.perf_counter() - t0:.1f} s", flush=True)
    worst = {}
    for row in result["correctness"]:
        key = (row["op"], row["dtype"], row["side_stream"])
        worst[key] = max(worst.get(key, 0.0), row["rel_err"])
    print(f"{'op':24} {'dtype':9} {'side stream':11} {'worst rel err':>13} {'tol':>7}")
    for (op, dt, side), err in sorted(worst.items()):
        tol = TOL[getattr(torch, dt)]
        print(f"{op:24} {dt:9} {str(side):11} {err:13.2e} {tol:7.0e} {'ok' if err <= tol else 'FAIL'}")
    if device == "cuda":
        every = launch(_every_operator_rank, 3, timeout_s=120, threads=2)
        print(f"{'every operator, 3 uneven ranks':40} {'dtype':9} {'worst rel err':>13}")
        for rank_rows in every:
            for row in rank_rows:
                failed += not row["ok"]
        for row in every[0]:
            worst = max(r["rel_err"] for rows in every for r in rows
                        if (r["op"], r["dtype"]) == (row["op"], row["dtype"]))
            print(f"{row['op']:40} {row['dtype']:9} {worst:13.2e} "
                  f"{'ok' if worst <= row['tol'] else 'FAIL'} {row['paths']}")
        result["every_operator"] = every
    paths = {}
    for row in result["correctness"]:
        paths.setdefault((row["op"], row["chunks"]), set()).add(row["path"])
    for (op, chunks), seen in sorted(paths.items()):
        print(f"path {op} chunks={chunks}: {' | '.join(sorted(seen))}")
        failed += chunks > 1 and any("fallback" in p or "plain" in p for p in seen)
    if device == "cuda":
        try:
            result["nccl"] = launch(_nccl_world_of_one, 1, backend="nccl", timeout_s=60)[0]
        except Exception as err:  # reported, not hidden: the row says what broke
            result["nccl"] = dict(error=f"{type(err).__name__}: {str(err)[-2000:]}")
        failed += "error" in result["nccl"] or max(result["nccl"]["rel_err"].values()) > 1e-4
        print("nccl world of one:", json.dumps(result["nccl"]), flush=True)
        try:
            result["symm_mem"] = launch(_symm_mem_world_of_one, 1, backend="nccl",
                                        timeout_s=60)[0]
        except Exception as err:  # reported, not hidden
            result["symm_mem"] = dict(error=f"{type(err).__name__}: {str(err)[-2000:]}")
        failed += "error" in result["symm_mem"] or not all(
            row["equal"] for row in result["symm_mem"].values())
        print("symmetric memory, world of one:", json.dumps(result["symm_mem"]), flush=True)
    for world in (2, 3):
        timing = launch(_timing_rank, world, args=(device, args.repeats), timeout_s=300,
                        threads=2)[0]
        result["timings"].append(timing)
        med = timing["median_s"]
        limit = max(med["compute"], med["all_reduce"])
        print(f"timing world {world} {timing['shape']}: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms" for k, v in med.items())
            + f"; limit max(compute, all_reduce) {limit * 1e3:.2f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(f"{failed} failed checks of {len(result['correctness'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
