"""The owner of the fused operators' state for one process group.

An :class:`OpsContext` holds the calibrated machine profile that
``chunks="auto"`` reads, the cache of cross-rank shape checks, and the record
of which path each operator took and why (``explain``). One context per group,
made on first use and kept for the group's lifetime; pass ``ctx=`` to an
operator to use another (a test, a benchmark that wants its own profile).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..perf.calibrate import MachineProfile, default_profile_path
from .agree import gather_checked
from ..perf.pipeline import ChunkChoice, choose_chunks

__all__ = ["Decision", "OpsContext", "get_context", "explain"]

log = logging.getLogger("plait.ops")


@dataclass(frozen=True)
class Decision:
    """Which path an operator call took: ``fused`` with ``chunks`` pieces, or ``fallback``."""

    op: str
    path: str
    chunks: int
    reason: str
    predicted: ChunkChoice | None = None

    def line(self) -> str:
        return f"{self.op}: {self.path} ({self.chunks} pieces): {self.reason}"


@dataclass
class OpsContext:
    group: object = None
    profile: MachineProfile | None = None
    max_chunks: int = 16
    # "always": one small all_gather of shapes per call (≈ one latency, 0.4 ms on the
    # emulated 1 Gbit/s link); "never": trust the caller where an operator needs no
    # global facts (MoE with a fixed chunk count).
    validate: str = "always"
    decisions: dict[str, Decision] = field(default_factory=dict)
    _logged: set[tuple] = field(default_factory=set)

    # --- calibration -------------------------------------------------------
    def machine_profile(self) -> MachineProfile:
        """The profile for ``chunks="auto"``: the saved one if present (PLAIT_PROFILE or
        ~/.cache/plait/profile.json), else measured on this group once; identical on all ranks."""
        if self.profile is None:
            path = default_profile_path()
            profile = MachineProfile.load(path) if path.exists() else measure_profile(self.group)
            self.profile = _agree(profile, self.group)
        return self.profile

    # --- decisions ---------------------------------------------------------
    def decide(self, op: str, chunks, *, flops: float, comm_bytes: float, rows: int,
               min_rows: int = 1) -> Decision:
        """Fused with N pieces, or fallback and why. Same inputs on every rank → same answer."""
        world = dist.get_world_size(self.group)
        if world == 1:
            return self._record(Decision(op, "fallback", 1, "one rank: nothing to communicate"))
        most = max(1, rows // max(min_rows, 1))
        if chunks != "auto":
            if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
                raise ValueError(f"{op}: chunks must be 'auto' or a positive integer, got {chunks!r}")
            n = min(chunks, most)
            if n == 1:
                why = "chunks=1 asked for" if chunks == 1 else f"only {rows} rows to split"
                return self._record(Decision(op, "fallback", 1, why))
            return self._record(Decision(op, "fused", n, f"chunks={chunks} asked for"))
        profile = self.machine_profile()
        choice = choose_chunks(t_compute_s=flops / max(profile.compute_flops, 1.0),
                               comm_bytes=comm_bytes, profile=profile,
                               max_chunks=min(self.max_chunks, most))
        path = "fused" if choice.fused else "fallback"
        return self._record(Decision(op, path, choice.chunks if choice.fused else 1,
                                     f"auto: {choice.reason}", choice))

    def _record(self, decision: Decision) -> Decision:
        self.decisions[decision.op] = decision
        key = (decision.op, decision.path, decision.chunks)
        if key not in self._logged:
            self._logged.add(key)
            if dist.get_rank(self.group) == 0:
                log.info("%s", decision.line())
        return decision

    # --- cross-rank checks -------------------------------------------------
    def gather_meta(self, op: str, width: int, row, problem: Exception | None = None
                    ) -> list[tuple[int, ...]]:
        """Every rank's ``row`` of ``width`` integers (dtype code, dims, sizes) before any
        data moves, raising on every rank if any rank's local checks failed
        (``problem``, with ``row`` None there); see :mod:`plait.ops.agree`."""
        return [tuple(r) for r in gather_checked(op, self.group, problem, row, width)]


def measure_profile(group=None) -> MachineProfile:
    """Calibrate on the running group, once (≈ 0.6 s on a 1 Gbit/s link).

    compute rate: a 512×2048×1024 matmul; α: the fastest of ten 32-byte
    all_reduces; bandwidth: a 2 MiB all_reduce. Then the same matmul +
    all_reduce as a real 2- and 4-piece pipeline: against the model's
    ``T(p) = c + m + (p−1)(c(1+k) + o)`` (compute-bound by construction, c > m)
    the two runs give the overlap slowdown k (compute slowed by the transfers
    sharing its cores) and the per-piece overhead o.
    """
    n = dist.get_world_size(group)
    x, w = torch.randn(512, 2048), torch.randn(2048, 1024)
    out = torch.empty(512, 1024)  # 2 MiB
    compute_s = _fastest(lambda: torch.matmul(x, w, out=out), group, 3)
    alpha = _fastest(lambda: dist.all_reduce(torch.zeros(8), group=group), group, 10)
    wire = 2 * (n - 1) / n * out.numel() * out.element_size()
    comm_s = _fastest(lambda: dist.all_reduce(out, group=group), group, 3)

    def pipeline(pieces: int) -> None:
        works, rows = [], 512 // pieces
        for lo in range(0, 512, rows):
            torch.matmul(x[lo:lo + rows], w, out=out[lo:lo + rows])
            works.append(dist.all_reduce(out[lo:lo + rows], group=group, async_op=True))
        for work in works:
            work.wait()

    # per piece beyond the first: c(1+k) + o, from T(p) − c − m = (p−1)(c(1+k) + o)
    per = {p: (_fastest(lambda p=p: pipeline(p), group, 3) - (compute_s + comm_s) / p) / (p - 1)
           for p in (2, 4)}
    k = max(0.0, (per[2] - per[4]) / (compute_s / 4) - 1.0)
    overhead = max(0.0, per[4] - compute_s / 4 * (1.0 + k))
    return MachineProfile(latency_s=alpha, bandwidth_Bps=wire / max(comm_s - alpha, 1e-6),
                          compute_flops=2 * 512 * 2048 * 1024 / compute_s,
                          per_piece_overhead_s=overhead, overlap_slowdown=k, world_size=n,
                          source="measured on the running group (plait.ops.context.measure_profile)")


def _fastest(fn, group, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up), slowest rank's."""
    fn()
    best = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        best.append(time.perf_counter() - start)
    t = torch.tensor([min(best)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _agree(profile: MachineProfile, group) -> MachineProfile:
    """The same profile on every rank (rank 0's), so every rank picks the same chunk count."""
    if dist.get_world_size(group) == 1:
        return profile
    box = [profile]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


_CONTEXTS: dict[object, OpsContext] = {}


def get_context(group=None) -> OpsContext:
    """The context of ``group`` (default group: None), made on first use."""
    if group not in _CONTEXTS:
        _CONTEXTS[group] = OpsContext(group=group)
    return _CONTEXTS[group]


def explain(op: str | None = None, group=None) -> str:
    """Which path the last call of each operator took, and why (one line each)."""
    decisions = get_context(group).decisions
    if op is not None:
        return decisions[op].line() if op in decisions else f"{op}: not called yet"
    return "\n".join(d.line() for d in decisions.values()) or "no fused operator called yet"


def with_profile(ctx: OpsContext, profile: MachineProfile) -> OpsContext:
    return replace(ctx, profile=profile, decisions={}, _logged=set())
