"""``plait bench ops``: each fused operator against compute-then-collective.

For every operator and shape, timed on every rank (each iteration's time is
the slowest rank's; the median over iterations is reported):

- ``t_compute``: the operator's compute alone (its GEMMs on the local shard);
- ``t_comm``: its collective alone, on ready buffers (what the plain path sends);
- ``t_unfused_one_call``: the plain path: compute, then the collective in one call
  (all_gather_matmul: the gather, then the GEMM; its own ``chunks=1`` already overlaps
  its own rows, and is timed among the fixed piece counts);
- ``t_unfused_pieces``: compute, then the same bytes as ``unfused_pieces`` collectives all
  in flight, none overlapping the compute (:meth:`plait.bench.case.Case.plain_pieces`):
  gloo's one big all-to-all, all-gather or reduce-scatter uses about half a link that
  pieces fill (docs/link.md), and that gain is the pieces', not fusion's;
- ``t_unfused = min(one call, pieces)``: the best way this backend moves the bytes;
- ``t_fused``: ``chunks="auto"``, and each fixed piece count of the sweep (and auto's
  own count, timed as a fixed one beside them, to compare its choice count to count);
- ``t_limit``: no schedule can beat it (:func:`physical_limit`): on an emulated link,
  max(compute alone, the bytes the busiest host link must carry ÷ the link's rate)
  (``limit_kind`` "link"); on loopback, with no rate, max(compute alone, the collective
  alone as measured) ("measured"); on shared memory, compute plus one core's copy of the
  bytes ("copy", :func:`_one_host_limit`). Its measured terms are their fastest round, not
  their median (a limit is a lower bound); a fused time under it by more than the token
  bucket's burst (``limit_tolerance_s``) is flagged (``beats_limit``): a bug in the limit;
- ``t_beside``: the compute and the transfer at once, neither waiting for the other
  (:meth:`plait.bench.case.Case.beside`): what this machine allows;
- ``peak_bytes_*``: the most tensor memory each path holds at once (outputs included).

``speedup = t_unfused / t_fused`` (over the best baseline: what overlap gains);
``speedup_one_call = t_unfused_one_call / t_fused`` (pieces and overlap together);
``efficiency = t_limit / t_fused``. Every timed variant's output (unfused, unfused
pieces, beside, auto, each count) is compared with the case's own
compute-then-collective, written with plain torch.distributed calls
(``correct_by_variant``; ``correct`` is all of them), and the path and pieces auto and
each count took are recorded (``path_by_variant``). The variants are interleaved iteration
by iteration, so drift of a shared machine hits them alike, in orders that form a Williams
design (:func:`plait.runtime.timing.balanced_orders`): each follows a different one each
iteration (in a fixed order, auto right after the plain path ran slower than the same count
timed among the others).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..ops import all_gather_matmul, get_context, matmul_all_reduce, matmul_reduce_scatter
from ..ops.matmul_all_reduce import GEMV_ROWS
from ..ops.pieces import even_sizes
from ..perf.pieces import calibration_dict
from ..runtime import parse_rate, rank_context
from ..ops.context import transport_of
from ..runtime.timing import agreed_max, median, time_interleaved, time_once
from .case import (SLOTS, Case, all_gather_pieces, all_reduce_pieces, all_to_all_equal,
                   all_to_all_pieces, check_outputs, gather_equal)
from .cases_sparse import SPARSE_CASES
from .config.ops import FULL_SHAPES, OPS, QUICK_SHAPES, OpsBenchConfig
from .memory import peak_bytes

__all__ = ["OpsBenchConfig", "run_ops_sweep", "QUICK_SHAPES", "FULL_SHAPES", "CASES"]


class MatmulAllReduceCase(Case):
    op = "matmul_all_reduce"

    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        m, k, n = shape["m"], shape["k"], shape["n"]
        k_r = even_sizes(k, self.world)[self.rank]
        # the weight as a row-parallel layer holds it ([N, K_r], like nn.Linear) and passes it
        self.x, self.w = self.randn(m, k_r), self.randn(n, k_r).t()
        # the output in the layout the operator computes it: a GEMV's is held transposed
        self.gemv = m <= GEMV_ROWS
        self.wire = [self.x.new_empty(n, m) if self.gemv else self.x.new_empty(m, n)
                     for _ in range(SLOTS)]
        self.flops, self.comm_bytes = 2 * m * k_r * n, 2 * (self.world - 1) / self.world * m * n * 4

    def result(self, slot=0):  # a view of the wire buffer (made here: it follows it to a device)
        return self.wire[slot].t() if self.gemv else self.wire[slot]

    def compute(self, slot=0):
        torch.mm(self.x, self.w, out=self.result(slot))

    def comm(self, async_op=False, slot=0):
        return transport_of(None).all_reduce(self.wire[slot], async_op=async_op)

    def run(self, chunks):
        return matmul_all_reduce(self.x, self.w, chunks=chunks)

    def comm_pieces(self, pieces, slot=0):
        return all_reduce_pieces(self.wire[slot], pieces)

    def received(self, slot=0):
        return self.wire[slot]

    def link_bytes(self, host_of):
        # a bandwidth-optimal all-reduce puts 2(H-1)/H of the buffer through each host's
        # link each way (nccl-tests' busbw convention), over H hosts
        hosts = len(set(host_of))
        return 2 * (hosts - 1) / hosts * self.wire[0].numel() * self.wire[0].element_size()


class AllGatherMatmulCase(Case):
    op = "all_gather_matmul"
    comm_first = True

    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        m, k, n = shape["m"], shape["k"], shape["n"]
        n_r = even_sizes(n, self.world)[self.rank]
        self.x, self.w = self.randn(m // self.world, k), self.randn(k, n_r)
        self.gathered = [self.x.new_empty(m // self.world * self.world, k) for _ in range(SLOTS)]
        self.y = [g @ self.w for g in self.gathered]
        self.flops, self.comm_bytes = 2 * m * k * n_r, (self.world - 1) / self.world * m * k * 4

    def result(self, slot=0):
        return self.y[slot]

    def compute(self, slot=0):
        torch.matmul(self.gathered[slot], self.w, out=self.y[slot])

    def comm(self, async_op=False, slot=0):
        return gather_equal(self.gathered[slot], self.x, async_op=async_op)

    def run(self, chunks):
        return all_gather_matmul(self.x, self.w, chunks=chunks)

    def comm_pieces(self, pieces, slot=0):
        return all_gather_pieces(self.gathered[slot], self.x, pieces)

    def received(self, slot=0):
        return self.gathered[slot]

    def link_bytes(self, host_of):
        # every host must receive every other host's rows, and send its own at least once
        share = self.x.numel() * self.x.element_size()
        on = {h: host_of.count(h) * share for h in host_of}
        total = share * len(host_of)
        return max(max(total - b, b) for b in on.values()) if len(on) > 1 else 0.0

    def plain(self):
        # not run(1): with one piece the operator still multiplies its own rows while the
        # gather is on the wire; the plain path (Megatron's, plait.nn's overlap=False) waits
        gathered = self.x.new_empty(self.gathered[0].shape)  # the plain path's own buffer
        gather_equal(gathered, self.x)
        return gathered @ self.w


class MatmulReduceScatterCase(Case):
    op = "matmul_reduce_scatter"

    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        m, k, n = shape["m"], shape["k"], shape["n"]
        k_r = even_sizes(k, self.world)[self.rank]
        self.x, self.w = self.randn(m, k_r), self.randn(k_r, n)
        self.partial = [self.x @ self.w for _ in range(SLOTS)]
        self.recv = [torch.empty_like(p) for p in self.partial]
        self.flops, self.comm_bytes = 2 * m * k_r * n, (self.world - 1) / self.world * m * n * 4

    def result(self, slot=0):  # the sum over sources of this rank's rows, in rank order
        return self.recv[slot].view(self.world, -1, self.recv[slot].shape[1]).sum(0)

    def compute(self, slot=0):
        torch.matmul(self.x, self.w, out=self.partial[slot])

    def comm(self, async_op=False, slot=0):  # the plain path's: one all_to_all of partial sums
        return all_to_all_equal(self.recv[slot], self.partial[slot], async_op=async_op)

    def run(self, chunks):
        return matmul_reduce_scatter(self.x, self.w, chunks=chunks)

    def comm_pieces(self, pieces, slot=0):
        rows = [self.partial[slot].shape[0] // self.world] * self.world
        return all_to_all_pieces(self.recv[slot], self.partial[slot], rows, rows, pieces)

    def received(self, slot=0):
        return self.recv[slot]

    def sent_bytes(self):  # each rank's partial sums of every other rank's rows
        block = self.partial[0].numel() // self.world * self.partial[0].element_size()
        return [[0.0 if s == d else block for d in range(self.world)] for s in range(self.world)]


CASES = {c.op: c for c in (MatmulAllReduceCase, AllGatherMatmulCase, MatmulReduceScatterCase)}
CASES.update(SPARSE_CASES)
assert tuple(CASES) == OPS, "bench.config.ops.OPS names each case, in order"

def burst_s(bits_per_s: float) -> float:
    """How long the emulated link's token bucket can run ahead of its rate: tbf's burst is
    max(1 ms of line rate, 64 KiB) (:func:`plait.runtime.cluster._tbf`), and a transfer
    that starts on a full bucket passes that many bytes at once (docs/link.md). 1 ms at
    1 Gbit/s: 1.5 % of the 67 ms that 8 MiB take."""
    return max(0.001, 64 * 1024 * 8 / bits_per_s)


def physical_limit(t_compute: float, t_comm: float, link_bytes: float, link: str | None) -> dict:
    """No schedule of the operator can beat ``t_limit_s``.

    On an emulated link (``limit_kind`` "link"): max(compute alone, the bytes the busiest
    host link must carry ÷ its rate), the wire's figure from the link, not from a measured
    collective (whose algorithm may use half the link); ``limit_tolerance_s`` is the token
    bucket's burst, by which a transfer may beat its rate. On loopback ("measured"): there is
    no rate, so max(compute alone, the collective alone, measured), no tolerance."""
    bits = parse_rate(link)
    if bits is None:
        return {"t_limit_s": max(t_compute, t_comm), "limit_kind": "measured", "t_link_s": None,
                "limit_tolerance_s": 0.0}
    t_link = link_bytes / (bits / 8)
    return {"t_limit_s": max(t_compute, t_link), "limit_kind": "link", "t_link_s": t_link,
            "limit_tolerance_s": burst_s(bits) if link_bytes else 0.0}


def beats_limit(record: dict) -> bool:
    """Whether the fused time beats the physical limit by more than its tolerance: a bug in
    the bench (a limit that is not one), flagged in the record, summary and table."""
    return record["t_fused_s"] + record["limit_tolerance_s"] < record["t_limit_s"]


def _rounds(cfg: OpsBenchConfig, call, device) -> int:
    """Rounds for a shape: ``cfg.iters``, or more (at most 4 ×) where one ``call`` (the
    unfused path, timed once, the slowest rank's) is so short that the variants would be
    timed for under ``cfg.min_time_s`` each. A few ms call on this shared VM swings by
    10-50 % from one round to the next (an embedding_all_to_all of 9 ms read 8.8-13.8 ms
    over 11 rounds), so 11 rounds left auto's paired ratio to the unfused path up to 7 %
    off its own code's. Every rank takes the same count (one agreed time)."""
    if cfg.min_time_s <= 0:
        return cfg.iters
    t = agreed_max([time_once(call, device)], device=device)[0]
    return max(cfg.iters, min(4 * cfg.iters, math.ceil(cfg.min_time_s / max(t, 1e-6))))


def _paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of a / b timed in the same round: the two ran moments apart,
    so a slow stretch of the machine divides out (the ratio of their medians keeps it)."""
    return median([x / y for x, y in zip(a, b)])


def _bench_case(case: Case, cfg: OpsBenchConfig, host_of: list[int]) -> dict:
    device = rank_context().topology.device
    case.run("auto")  # auto decides on its first call
    decision = get_context().decisions[case.op]
    # auto's own count is timed as a fixed count too (beside the sweep's, not among them)
    own = f"chunks={decision.chunks}"
    counts = list(dict.fromkeys([*map(int, cfg.fixed_chunks), decision.chunks]))
    # the pieces the fused operator sends (auto's; where it takes one, the sweep's most)
    pieces = decision.chunks if decision.chunks > 1 else max([2, *map(int, cfg.fixed_chunks)])
    variants = {"compute": case.compute, "comm": case.comm, "beside": case.beside,
                "unfused": case.plain, "unfused_pieces": lambda: case.plain_pieces(pieces),
                "auto": lambda: case.run("auto")}
    for c in counts:
        variants[f"chunks={c}"] = lambda c=c: case.run(c)
    case.start_beside()
    for fn in variants.values():
        for _ in range(cfg.warmup):
            fn()
    timed = time_interleaved(variants, _rounds(cfg, case.plain, device), device)
    times = {name: median(ts) for name, ts in timed.items()}
    outputs, paths = _variant_outputs(case, counts, pieces)
    checked = check_outputs(case, outputs)
    # the fixed count takes the same path with as many pieces?
    same_code = paths[str(decision.chunks)] == [decision.path, decision.chunks]
    peak_unfused = peak_bytes(case.plain)
    peak_fused = peak_bytes(lambda: case.run("auto"))
    fixed = {name: times[name] for name in (f"chunks={int(c)}" for c in cfg.fixed_chunks)}
    best_name = min(fixed, key=fixed.get) if fixed else own
    ctx = rank_context()
    link_bytes = case.link_bytes(host_of)
    # a lower bound: the fastest round of each measured term (docstring)
    fastest = {name: min(timed[name]) for name in ("compute", "comm")}
    limit = physical_limit(fastest["compute"], fastest["comm"], link_bytes, ctx.link)
    t_limit = limit["t_limit_s"]
    # the strongest unfused baseline: one big collective, or the same bytes in pieces
    baseline = min(("unfused", "unfused_pieces"), key=times.get)
    t_unfused = times[baseline]
    return {
        "op": case.op, "shape": case.shape, "world_size": case.world, "dtype": str(case.dtype)[6:],
        "t_compute_s": times["compute"], "t_comm_s": times["comm"],
        "t_compute_fastest_s": fastest["compute"], "t_comm_fastest_s": fastest["comm"],
        "t_unfused_one_call_s": times["unfused"], "t_unfused_pieces_s": times["unfused_pieces"],
        "unfused_pieces": pieces, "t_unfused_s": t_unfused,
        "t_fused_s": times["auto"], **limit, "link_bytes": link_bytes,
        # the same were each rank a host of its own (on loopback, where no link is crossed)
        "rank_link_bytes": case.link_bytes(list(range(case.world))),
        "t_beside_s": times["beside"],
        "t_fixed_s": {name[7:]: t for name, t in fixed.items()},
        "best_fixed_chunks": int(best_name[7:]) if fixed else None,
        "t_best_fixed_s": fixed.get(best_name),
        # auto as timed, against the best fixed count
        "auto_over_best_fixed": _paired(timed["auto"], timed[best_name]),
        # auto's choice: its count, timed as a fixed count, against the best (the same code as
        # auto's, so the decision is compared without timing one count twice); and auto as
        # timed against its own count (what auto adds: its lookup, and noise)
        "auto_choice_over_best_fixed": (_paired(timed[own], timed[best_name]) if same_code
                                        else None),
        "auto_over_own_count": _paired(timed["auto"], timed[own]) if same_code else None,
        # each round's time of auto and of each count (the slowest rank's)
        # each round's compute alone and collective alone (the limit's fastest rounds)
        # and the unfused baselines' (auto_over_unfused reads them)
        "t_measured_rounds_s": {name: timed[name] for name in ("compute", "comm", "unfused",
                                                              "unfused_pieces")},
        "t_rounds_s": {name.removeprefix("chunks="): ts for name, ts in timed.items()
                       if name == "auto" or name.startswith("chunks=")},
        "chunks": decision.chunks, "path": decision.path, "reason": decision.reason,
        # over the best unfused baseline (the gain from overlap), and over the one big call
        # (overlap and pieces together)
        "speedup": t_unfused / times["auto"], "speedup_one_call": times["unfused"] / times["auto"],
        # auto against that baseline round by round (see _paired): what summarize's worst
        # slowdown reads; the ratio of the medians above keeps a slow stretch of the machine
        # that fell on one of them (a fallback runs the baseline's own code: 1.08 and 1.19
        # by medians in two runs, where the same code can only differ by noise)
        "auto_over_unfused": _paired(timed["auto"], timed[baseline]),
        "efficiency": t_limit / times["auto"],
        "efficiency_vs_beside": times["beside"] / times["auto"],
        "comm_ratio": times["comm"] / max(times["compute"], 1e-12),
        # every timed variant's output against the case's own compute-then-collective
        "correct": all(ok for _, ok in checked.values()),
        "correct_by_variant": {name: ok for name, (_, ok) in checked.items()},
        "max_abs_diff": max(diff for diff, _ in checked.values()),
        "max_abs_diff_by_variant": {name: diff for name, (diff, _) in checked.items()},
        # the path and pieces of auto and of each count, as the operator recorded them
        "path_by_variant": paths,
        "peak_bytes_unfused": peak_unfused, "peak_bytes_fused": peak_fused,
        "flops": case.flops, "comm_bytes": case.comm_bytes,
        "link": ctx.link, "backend": ctx.topology.backend, **cfg.extra,
    }


def _variant_outputs(case: Case, counts: list[int], pieces: int) -> tuple[dict, dict]:
    """Every timed variant's output from one more call each, after the timing (``beside``:
    one call finishing each slot), and the path and pieces (``[path, chunks]``) that auto
    and each count took."""
    outputs = {"unfused": [case.plain()]}
    # the pieces land in the buffers the one call timed beside them filled: poison them, so
    # a piece that does not land shows
    case.received(0).fill_(float("nan"))
    outputs["unfused_pieces"] = [case.plain_pieces(pieces).clone()]
    case.start_beside()
    outputs["beside"] = []
    for _ in range(SLOTS):
        case.beside()
        outputs["beside"].append(case.beside_result().clone())  # the next call overwrites it
    paths = {}
    for name, chunks in [("auto", "auto"), *((str(c), c) for c in counts)]:
        outputs[name] = [case.run(chunks)]
        made = get_context().decisions[case.op]
        paths[name] = [made.path, made.chunks]
    return outputs, paths


def _on_device(case, device: torch.device):
    """Move the case's tensors (and lists of them) to the rank's device (cases build on CPU)."""
    for name, value in vars(case).items():
        if isinstance(value, torch.Tensor):
            setattr(case, name, value.to(device))
        elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            setattr(case, name, [v.to(device) for v in value])
    return case


def run_ops_sweep(cfg: OpsBenchConfig) -> dict:
    """Run on every rank of an initialised group: ``{"records", "calibration"}`` (the same on
    every rank; the calibration is what ``chunks="auto"`` priced pieces with). Several
    transports take turns at every shape (in alternating orders), each shape's variants
    timed on one transport at a time."""
    from ..transport.select import choose, wanted
    from .collectives import _copy_GBps

    ctx = rank_context()
    cal = get_context().calibration()  # calibrate once, before anything is timed
    transports = {name: choose(None, name) for name in cfg.transports or (wanted(),)}
    records = []
    device = ctx.topology.device
    host_of = [None] * dist.get_world_size()
    dist.all_gather_object(host_of, ctx.host.index)  # which links a rank's bytes cross
    for i, (op, shape) in enumerate(cfg.shapes()):
        case = _on_device(CASES[op](shape, torch.float32), device)
        order = list(transports.items())
        for asked, transport in (order[::-1] if i % 2 else order):
            with get_context().using(transport):
                record = _bench_case(case, cfg, host_of)
            record.update(transport=transport.choice.name, transport_asked=asked,
                          transport_reason=transport.choice.reason)
            _one_host_limit(record, _copy_GBps(int(case.comm_bytes), torch.float32, device))
            records.append({**record, "beats_limit": beats_limit(record)})
        ctx.report({"op": op, "shape": shape})
    return {"records": records, "calibration": calibration_dict(cal)}


def _one_host_limit(record: dict, copy_GBps: float) -> None:
    """Beside every record, the limit on one host: one core's copy bandwidth for the bytes
    the collective moves (``comm_bytes``, its bus bytes a rank), measured in the same run.
    On shared memory it is the limit, as the link's rate is on the emulated cluster: the
    compute's fastest round plus that copy (``limit_kind`` "copy"), a sum, not a max,
    because a CPU rank has one core and no copy engine, so the core that computes is the
    one that moves the bytes and the two cannot overlap (``t_beside_s``, the two at once
    with no dependency, measures that: within a few % of the sum on this machine)."""
    t_copy = record["comm_bytes"] / (copy_GBps * 1e9)
    record.update(copy_GBps=copy_GBps, t_copy_s=t_copy)
    if record["transport"] in ("shm", "shm+gloo") and record["limit_kind"] == "measured":
        t_limit = record["t_compute_fastest_s"] + t_copy
        record.update(t_limit_s=t_limit, limit_kind="copy",
                      efficiency=t_limit / record["t_fused_s"])


def bench_ops(cfg: OpsBenchConfig, *, ranks: int, hosts: int = 0, link: str | None = "1gbit",
              timeout_s: float | None = None, on_progress=None) -> tuple[list[dict], str, dict]:
    """The sweep on ``ranks`` local ranks (``hosts`` emulated hosts; 0: loopback):
    (records, where it ran, the calibration auto used)."""
    from ..runtime.placement import run_placed

    out, where = run_placed(run_ops_sweep, cfg, ranks=ranks, hosts=hosts, link=link,
                            timeout_s=timeout_s, on_progress=on_progress)
    return out["records"], where, out["calibration"]


def summarize_transports(records: list[dict]) -> dict:
    """:func:`summarize` for one transport; for several, one summary each, and shared
    memory's fused time against gloo's unfused, shape by shape (median and each)."""
    names = list(dict.fromkeys(r.get("transport", "gloo") for r in records))
    if len(names) == 1:
        return summarize(records)
    out = {name: summarize([r for r in records if r.get("transport", "gloo") == name])
           for name in names}
    out["all_correct"] = all(r["correct"] for r in records)  # what the exit status reads
    by = {(r["op"], str(r["shape"]), r["transport"]): r for r in records}
    if "shm" in names and "gloo" in names:
        ratios = [by[op, shape, "gloo"]["t_unfused_s"] / by[op, shape, "shm"]["t_fused_s"]
                  for op, shape, t in by if t == "shm" and (op, shape, "gloo") in by]
        out["gloo_unfused_over_shm_fused_median"] = median(ratios) if ratios else None
        out["gloo_unfused_over_shm_fused"] = ratios
        # the most any shared-memory schedule could reach: gloo's unfused time over shared
        # memory's limit (its compute's fastest round plus one core's copy of the bytes: a
        # bound no round beats)
        bound = [by[op, shape, "gloo"]["t_unfused_s"] / by[op, shape, "shm"]["t_limit_s"]
                 for op, shape, t in by if t == "shm" and (op, shape, "gloo") in by]
        out["gloo_unfused_over_shm_limit_median"] = median(bound) if bound else None
        # were shared memory's collective free: gloo's unfused time over shm's compute alone
        # in its median round, the statistic the fused time is (so below "at most", which
        # takes the fastest round): what the fused median reaches with a collective costing
        # nothing
        free = [by[op, shape, "gloo"]["t_unfused_s"] / by[op, shape, "shm"]["t_compute_s"]
                for op, shape, t in by if t == "shm" and (op, shape, "gloo") in by]
        out["gloo_unfused_over_shm_compute_median"] = median(free) if free else None
    return out


def _auto_over_unfused(record: dict) -> float:
    """Auto over the unfused baseline, paired round by round (records stored before
    ``auto_over_unfused`` existed: the ratio of the medians)."""
    return record.get("auto_over_unfused", record["t_fused_s"] / record["t_unfused_s"])


def summarize(records: list[dict]) -> dict:
    """The figures the issue asks for: over shapes whose communication is between half and
    twice the compute, the median speedup and efficiency; over all, auto's worst slowdown."""
    balanced = [r for r in records if 0.5 <= r["comm_ratio"] <= 2.0]
    slow = [r for r in records if _auto_over_unfused(r) > 1.05]
    vs_best = [r.get("auto_over_best_fixed", r["t_fused_s"] / r["t_best_fixed_s"])
               for r in records if r.get("t_best_fixed_s")]
    choice = [r["auto_choice_over_best_fixed"] for r in records
              if r.get("auto_choice_over_best_fixed") is not None]
    own = [r["auto_over_own_count"] for r in records if r.get("auto_over_own_count") is not None]
    return {
        "balanced_shapes": len(balanced),
        # over the best unfused baseline (one call or pieces), and over the one call alone
        "median_speedup_balanced": median([r["speedup"] for r in balanced]) if balanced else None,
        "median_speedup_one_call_balanced": (median([r["speedup_one_call"] for r in balanced])
                                             if balanced else None),
        "median_efficiency_balanced": median([r["efficiency"] for r in balanced]) if balanced else None,
        # over every shape (a one-host run has few shapes whose transfer is half the compute)
        "median_efficiency": median([r["efficiency"] for r in records]) if records else None,
        # what this machine allows: compute and transfer at once with no dependency
        "median_beside_efficiency_balanced": (median([r["t_limit_s"] / r["t_beside_s"]
                                                      for r in balanced]) if balanced else None),
        "median_efficiency_vs_beside_balanced": (median([r["efficiency_vs_beside"]
                                                         for r in balanced]) if balanced else None),
        "auto_slower_than_unfused_by_5pct": [f"{r['op']} {r['shape']}" for r in slow],
        # per shape, the median over rounds of auto / the unfused baseline timed in the same
        # round; and the same as the ratio of the two medians
        "worst_auto_over_unfused": max((_auto_over_unfused(r) for r in records), default=None),
        "worst_auto_over_unfused_medians": max((r["t_fused_s"] / r["t_unfused_s"]
                                                for r in records), default=None),
        # per shape, the median over rounds of auto / best fixed count timed in the same round
        "median_auto_over_best_fixed": median(vs_best) if vs_best else None,
        "worst_auto_over_best_fixed": max(vs_best) if vs_best else None,
        # the same for auto's count timed as a fixed one: the choice alone
        "worst_auto_choice_over_best_fixed": max(choice) if choice else None,
        # auto as timed over its own count: its lookup (and the noise of timing code twice)
        "median_auto_over_own_count": median(own) if own else None,
        "all_correct": all(r["correct"] for r in records),
        # fused faster than no schedule can be: the limit is wrong (a bug), or the machine
        # timed something else; the rows, and how many of each kind of limit
        "beats_limit": [f"{r['op']} {r['shape']} ({r['limit_kind']})" for r in records
                        if r["beats_limit"]],
        "beats_physical_limit": sum(r["beats_limit"] for r in records if r["limit_kind"] == "link"),
        "fused_never_uses_more_memory": all(r["peak_bytes_fused"] <= r["peak_bytes_unfused"]
                                            for r in records),
    }


def plot_ops(records: list[dict], path) -> None:
    """Grouped bars per shape: unfused, fused (auto) and the physical limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [f"{r['op'].replace('_', ' ')}\n" + "×".join(str(v) for v in r["shape"].values())
              for r in records]
    x = np.arange(len(records))
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(records)), 4.8))
    for i, (key, name) in enumerate((("t_unfused_s", "unfused (best)"), ("t_fused_s", "fused (auto)"),
                                     ("t_limit_s", f"limit ({records[0]['limit_kind']})"))):
        ax.bar(x + (i - 1) * 0.27, [1e3 * r[key] for r in records], 0.27, label=name)
    ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("time (ms, median)")
    ax.set_title(f"plait bench ops: {records[0]['world_size']} ranks, {records[0]['link']}")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
