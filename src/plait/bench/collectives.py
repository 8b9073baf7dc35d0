"""``plait bench collectives``: plait's counterpart of nccl-tests.

For each collective and message size: the median time of several timed
iterations after warm-up (each iteration's time is the max over ranks),
algorithm bandwidth ``algbw = bytes / time`` and bus bandwidth
``busbw = algbw × factor``, with nccl-tests' definitions
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

=================  ==========================  ===========
collective         ``bytes`` is                bus factor
=================  ==========================  ===========
all_reduce         the buffer                  2(n−1)/n
all_gather         the gathered output         (n−1)/n
reduce_scatter     the input to be reduced     (n−1)/n
all_to_all(v)      all a rank sends            (n−1)/n
=================  ==========================  ===========

Every first iteration's output is checked against the exact expected values
(as nccl-tests counts ``#wrong``).

On an emulated link each record also gives ``link_share``, busbw over the link
rate; and the largest message is timed a second way, as ``pieces`` calls of a
``pieces``-th of it all in flight at once. The link carries what the pieces
reach: where one call falls well short of it and the pieces do not, the
backend's algorithm is the limit, not the link. :func:`shortfalls` says, for
each collective below ``LINK_SHARE_OK`` of the link in one call, why (gloo's
algorithms, measured in docs/link.md).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..runtime import parse_rate, rank_context
from ..runtime.placement import run_placed
from ..runtime.timing import agreed_max, median, sync, time_once
from .config.collectives import COLLECTIVES, CollectiveBenchConfig
from .report import counted

__all__ = ["COLLECTIVES", "GLOO_SHORTFALL", "LINK_SHARE_OK", "CollectiveBenchConfig",
           "bench_collectives", "bus_factor", "link_share", "plot_bandwidth", "run_sweep",
           "shortfalls", "sweep_sizes", "uneven_splits"]


LINK_SHARE_OK = 0.9
"""A collective whose largest message reaches this share of the link in one call uses the link."""

_TAKE_TURNS = ("gloo posts each send before its receive, and a pair of ranks shares one TCP "
               "connection: the peer's ready-to-receive message waits behind this rank's "
               "payload, so the two directions take turns instead of running at once")
GLOO_SHORTFALL = {
    "reduce_scatter": "gloo runs reduce_scatter_tensor as an all-reduce of the whole input and "
                      "keeps this rank's slice: twice the bytes cross the link, so busbw stays "
                      "under half of it (pieces are all-reduces too)",
    "all_gather": _TAKE_TURNS + " (gloo's ring sends each half before receiving it)",
    "all_to_all": _TAKE_TURNS,
    "all_to_all_uneven": _TAKE_TURNS,
}
"""Why gloo's one call of a collective falls short of the link (measured: docs/link.md)."""


def bus_factor(collective: str, world_size: int) -> float:
    n = world_size
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def link_share(busbw_GBps: float, link: str | None) -> float | None:
    """busbw over the link's rate (both in bytes/s); None on loopback (no link to fill)."""
    bits = parse_rate(link)
    return busbw_GBps * 1e9 / (bits / 8) if bits else None


def shortfalls(records: list[dict]) -> dict[str, str]:
    """Collective → why its largest message's one call reaches under ``LINK_SHARE_OK`` of the
    link, with the share in one call and in pieces (none on loopback, where no link is filled)."""
    notes = {}
    for name in dict.fromkeys(r["collective"] for r in records):
        top = max((r for r in records if r["collective"] == name), key=lambda r: r["bytes"])
        if top["link_share"] is None or top["link_share"] >= LINK_SHARE_OK:
            continue
        measured = f"one call {top['link_share']:.0%} of the link"
        if top.get("pieces_link_share") is not None:
            measured += f", {top['pieces']} pieces in flight {top['pieces_link_share']:.0%}"
        why = (GLOO_SHORTFALL.get(name) if top["backend"] == "gloo" else None) or \
            f"not a known limit of {top['backend']}: a busy CPU or the link (docs/link.md " \
            "says how to tell them apart)"
        notes[name] = f"{measured}: {why}"
    return notes


def sweep_sizes(cfg: CollectiveBenchConfig) -> list[int]:
    sizes, size = [], cfg.min_bytes
    while size <= cfg.max_bytes:
        sizes.append(size)
        size *= cfg.step_factor
    return sizes


def uneven_splits(world_size: int, count: int) -> list[list[int]]:
    """``splits[i][j]``: elements rank i sends rank j; each row sums to ``count``, rows differ."""
    splits = []
    for i in range(world_size):
        weights = [1 + (i + j) % world_size for j in range(world_size)]
        row = [count * w // sum(weights) for w in weights]
        row[-1] += count - sum(row)
        splits.append(row)
    return splits


class _Case:
    """Buffers and the call for one collective at one size on this rank; ``check`` verifies."""

    def __init__(self, name: str, nbytes: int, dtype: torch.dtype, device: torch.device,
                 transport):
        self.name, n = name, dist.get_world_size()
        self.transport = transport
        r = dist.get_rank()
        elem = torch.empty((), dtype=dtype).element_size()
        count = max(n, nbytes // elem // n * n)  # divisible by n so every shape is legal
        self.nbytes = count * elem
        make = lambda k, fill: torch.full((k,), float(fill), dtype=dtype, device=device)  # noqa: E731
        self.splits_in = self.splits_out = None
        if name == "all_reduce":
            self.inp = self.out = make(count, r + 1)
        elif name == "all_gather":
            self.inp, self.out = make(count // n, r + 1), make(count, 0)
        elif name == "reduce_scatter":
            self.inp, self.out = make(count, r + 1), make(count // n, 0)
        elif name == "all_to_all":
            self.inp, self.out = make(count, r + 1), make(count, 0)
        else:
            splits = uneven_splits(n, count)
            self.splits_in = splits[r]
            self.splits_out = [splits[j][r] for j in range(n)]
            self.inp, self.out = make(count, r + 1), make(sum(self.splits_out), 0)

    def __call__(self, async_op: bool = False):
        """Run the collective on the case's transport; with ``async_op`` return its work
        handle without waiting."""
        t, n = self.transport, dist.get_world_size()
        if self.name == "all_reduce":
            return t.all_reduce(self.out, async_op=async_op)
        if self.name == "all_gather":
            return t.all_gather(self.out.view(n, -1), self.inp.view(1, -1), [1] * n,
                                async_op=async_op)
        if self.name == "reduce_scatter":
            return t.reduce_scatter(self.out.view(1, -1), self.inp.view(n, -1), [1] * n,
                                    async_op=async_op)
        counts_out = self.splits_out or [self.out.numel() // n] * n
        counts_in = self.splits_in or [self.inp.numel() // n] * n
        return t.all_to_all(self.out.view(-1, 1), self.inp.view(-1, 1), counts_out, counts_in,
                            async_op=async_op)

    def expected(self) -> torch.Tensor:
        n = dist.get_world_size()
        if self.name in ("all_reduce", "reduce_scatter"):
            return torch.full_like(self.out.cpu(), n * (n + 1) / 2)
        if self.name == "all_gather":
            return torch.arange(1, n + 1, dtype=self.out.dtype).repeat_interleave(self.out.numel() // n)
        counts = self.splits_out or [self.out.numel() // n] * n
        return torch.cat([torch.full((c,), float(j + 1), dtype=self.out.dtype)
                          for j, c in enumerate(counts)])

    def check(self) -> int:
        """Run once and count wrong elements (nccl-tests' #wrong)."""
        self()
        wrong = int((self.out.cpu() != self.expected()).sum())
        if self.name == "all_reduce":
            self.out.fill_(dist.get_rank() + 1)  # later iterations keep small values
        return wrong


def _iterations(cfg: CollectiveBenchConfig, probe_s: float) -> int:
    iters = int(cfg.budget_s / max(probe_s, 1e-6))
    return max(cfg.min_iters, min(cfg.max_iters, iters))


REP_S = 2e-3  # an iteration repeats a call until it lasts about this long (small messages)


def _in_flight(cases: list[_Case]) -> None:
    for work in [case(async_op=True) for case in cases]:
        work.wait()


def _repeated(run, reps: int):
    def many():
        for _ in range(reps):
            run()
    return many


def _time_point(cfg: CollectiveBenchConfig, run, device) -> tuple[list[float], int]:
    """Warm-up, then per-call times (each iteration the slowest rank's, over ``reps``
    calls back to back: a call of a few microseconds is not timed alone, as nccl-tests
    averages over -n); and ``reps``. Each iteration starts behind a barrier and one untimed
    call of the collective itself: the barrier's own exit skew (hundreds of microseconds on
    gloo) would otherwise land on the first timed call."""
    for _ in range(cfg.warmup):
        run()
    probe = agreed_max([_synced(run, 10, device) / 10])[0]
    reps = max(1, min(1000, int(REP_S / max(probe, 1e-7))))
    reps = int(agreed_max([reps])[0])
    per = agreed_max([_synced(run, reps, device)
                      for _ in range(_iterations(cfg, probe * reps))])
    return [t / reps for t in per], reps


def _synced(run, reps: int, device) -> float:
    """Seconds of ``reps`` calls of ``run`` back to back on this rank, behind a barrier and
    one untimed call (which meets every rank at the collective itself)."""
    sync(device)
    dist.barrier()
    run()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        run()
    sync(device)
    return time.perf_counter() - start


def _copy_GBps(nbytes: int, dtype, device) -> float:
    """This rank's single-core copy bandwidth for ``nbytes`` (a memcpy of the message, timed
    in the same run): the one-host limit printed beside each shared-memory figure."""
    src = torch.ones(max(1, nbytes // torch.empty((), dtype=dtype).element_size()), dtype=dtype,
                     device=device)
    dst = torch.empty_like(src)
    run = lambda: dst.copy_(src)  # noqa: E731
    for _ in range(2):
        run()
    probe = time_once(run, device, barrier=False)
    reps = max(1, min(1000, int(REP_S / max(probe, 1e-7))))
    times = [time_once(_repeated(run, reps), device, barrier=False) / reps for _ in range(5)]
    return src.numel() * src.element_size() / median(times) / 1e9


def _time_pieces(cfg: CollectiveBenchConfig, name: str, nbytes: int, dtype, device,
                 transport) -> dict:
    """The same message as ``cfg.pieces`` calls in flight: their bytes, median time, #wrong."""
    cases = [_Case(name, nbytes // cfg.pieces, dtype, device, transport)
             for _ in range(cfg.pieces)]
    wrong = agreed_max([sum(case.check() for case in cases)])[0]
    times, _ = _time_point(cfg, lambda: _in_flight(cases), device)
    return {"bytes": sum(case.nbytes for case in cases), "time_s": median(times),
            "wrong": int(wrong)}


def _transports(cfg: CollectiveBenchConfig) -> dict:
    """Each transport asked for, made on the world group (every rank)."""
    from ..transport.select import choose, wanted

    return {name: choose(None, name) for name in cfg.transports or (wanted(),)}


def run_sweep(cfg: CollectiveBenchConfig) -> list[dict]:
    """Run on every rank of an initialised group; returns the records (same on every rank).
    Several transports take turns at every point (interleaved, so a slow stretch of the
    machine lands on each)."""
    ctx = rank_context()
    n, device = dist.get_world_size(), ctx.topology.device
    dtype = getattr(torch, cfg.dtype)
    transports = _transports(cfg)
    records = []
    sizes = sweep_sizes(cfg)
    for name in cfg.collectives:
        for nbytes in sizes:
            copy_GBps = agreed_max([-_copy_GBps(nbytes, dtype, device)])[0] * -1  # the slowest
            for asked, transport in transports.items():
                records.append(_point(cfg, name, nbytes, dtype, device, asked, transport,
                                      copy_GBps, nbytes == sizes[-1]))
                ctx.report({"collective": name, "bytes": records[-1]["bytes"],
                            "time_s": records[-1]["time_s"]})
    return records


def _point(cfg, name, nbytes, dtype, device, asked, transport, copy_GBps, last) -> dict:
    ctx = rank_context()
    n = dist.get_world_size()
    case = _Case(name, nbytes, dtype, device, transport)
    wrong = agreed_max([case.check()])[0]
    times, reps = _time_point(cfg, case, device)
    t = median(times)
    algbw = case.nbytes / t / 1e9
    busbw = algbw * bus_factor(name, n)
    record = {
        "collective": name, "bytes": case.nbytes, "dtype": cfg.dtype,
        "transport": transport.choice.name, "transport_asked": asked,
        "transport_reason": transport.choice.reason,
        "time_s": t, "time_us": t * 1e6, "time_min_s": min(times), "time_max_s": max(times),
        "iters": len(times), "reps": reps, "algbw_GBps": algbw, "busbw_GBps": busbw,
        "copy_GBps": copy_GBps, "busbw_over_copy": busbw / copy_GBps,
        "link_share": link_share(busbw, ctx.link), "wrong": int(wrong),
        "pieces": 0, "pieces_time_s": None, "pieces_link_share": None,
        "world_size": n, "backend": ctx.topology.backend, "link": ctx.link, **cfg.extra,
    }
    del case  # the pieces' buffers take its place, not its size again
    if cfg.pieces and last and transport.choice.name != "shm":  # shm calls finish as made
        pieces = _time_pieces(cfg, name, record["bytes"], dtype, device, transport)
        busbw_p = pieces["bytes"] / pieces["time_s"] / 1e9 * bus_factor(name, n)
        record.update(pieces=cfg.pieces, pieces_time_s=pieces["time_s"],
                      pieces_link_share=link_share(busbw_p, ctx.link))
        record["wrong"] += pieces["wrong"]
    return record


def bench_collectives(cfg: CollectiveBenchConfig, *, ranks: int, hosts: int = 0,
                      link: str | None = "1gbit", timeout_s: float | None = None,
                      on_progress=None) -> tuple[list[dict], str]:
    """The sweep on ``ranks`` local ranks, on ``hosts`` emulated hosts (0: loopback).
    Returns (records, a line saying where it ran)."""
    return run_placed(run_sweep, cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=timeout_s,
                      on_progress=on_progress)


def plot_bandwidth(records: list[dict], path, link_GBps: float | None = None) -> None:
    """Bus bandwidth against message size, one line per collective, the link rate dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["collective"] for r in records):
        rows = [r for r in records if r["collective"] == name]
        ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=name)
    if link_GBps:
        ax.axhline(link_GBps, linestyle="--", color="grey", label=f"link {link_GBps:g} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    world = records[0]["world_size"] if records else "?"
    ax.set_title(f"plait bench collectives: {counted(world, 'rank')}, {records[0]['link'] if records else ''}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
