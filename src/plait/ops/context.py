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
    validate: str = "first"  # "first" call per shape signature, "always", or "never"
    decisions: dict[str, Decision] = field(default_factory=dict)
    _checked: dict[tuple, tuple] = field(default_factory=dict)
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

    # --- cross-rank shape checks ------------------------------------------
    def gather_meta(self, op: str, local: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every rank's ``local`` integers (shapes, dtype code), checked once per signature.

        One small all_gather, before any data moves, so disagreeing shapes raise a
        clear error instead of a hang or a garbled collective.
        """
        key = (op, local)
        if self.validate != "always" and key in self._checked:
            return list(self._checked[key])
        if self.validate == "never":
            return [local] * dist.get_world_size(self.group)
        mine = torch.tensor(local, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        result = tuple(tuple(t.tolist()) for t in everyone)
        self._checked[key] = result
        return list(result)


def measure_profile(group=None) -> MachineProfile:
    """Calibrate on the running group: a matmul for the compute rate, two all_reduces for α and β."""
    a = torch.randn(256, 256)
    for _ in range(2):
        a @ a
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    compute_flops = 5 * 2 * 256 ** 3 / (time.perf_counter() - start)
    small, big = torch.zeros(8), torch.zeros(256 * 1024)  # 32 B and 1 MiB
    n = dist.get_world_size(group)

    def median_time(t: torch.Tensor) -> float:
        times = []
        for _ in range(5):
            dist.barrier(group=group)
            begin = time.perf_counter()
            dist.all_reduce(t, group=group)
            times.append(time.perf_counter() - begin)
        return sorted(times)[2]

    median_time(big)  # warm-up: connections made
    alpha, t_big = median_time(small), median_time(big)
    wire = 2 * (n - 1) / n * big.numel() * 4
    bandwidth = wire / max(t_big - alpha, 1e-6)
    return MachineProfile(latency_s=alpha / max(2 * (n - 1), 1), bandwidth_Bps=bandwidth,
                          compute_flops=compute_flops, per_piece_overhead_s=alpha,
                          base_latency_s=0.0, world_size=n,
                          source="measured on the running group (plait.ops.context.measure_profile)")


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
    return replace(ctx, profile=profile, decisions={}, _checked={}, _logged=set())
