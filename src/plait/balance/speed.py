"""The speed monitor: each rank times its own compute in every layer, smooths it, shares it.

A layer's compute region (``plait.nn._shard.compute_scope`` / ``straggled``,
the same places the straggler emulation wraps) reports to the layer's
``compute_timer``, which :meth:`SpeedMonitor.attach` sets. On the plain path
the region is the local GEMM only; on the fused ``matmul_all_reduce`` and
``column_parallel_matmul`` it is each local piece (``plait.ops.compute``), so
waiting for another rank's pieces is never counted as this rank's compute. (The
sequence-parallel and MoE operators are still timed whole, their exposed wire
included.)

A rank's speed is the work it did (the weight elements it multiplied per forward: fewer
while ZERO-resized)
over the seconds it took, forward and backward. Counting work, not time, means
a rank given fewer columns is not mistaken for a faster one, so a plan that
moved work does not undo itself. Every ``every`` steps the group exchanges one
small float64 vector per rank (``2 · layers`` figures) in one all_gather, and
each rank folds the window into an EMA.

Clock: on a one-thread CPU rank, the thread's CPU time plus the straggler
emulation's sleeps in the region (ranks sharing cores are otherwise measured
slow whenever the scheduler runs another rank mid-GEMM); wall time otherwise.

Cost: two clock reads per region (CUDA: two events, read only at the
exchange), and one all_gather of a few hundred bytes every ``every`` steps;
``overhead_s`` is the time spent in the exchanges (on a rank that arrives early
it includes waiting for a slower one; the last to arrive measures the exchange).
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..runtime.straggler import compute_clock

__all__ = ["SpeedMonitor", "LayerTimer", "ema", "relative_speeds", "flag_stragglers"]


def ema(previous: float | None, new: float, alpha: float) -> float:
    """``alpha · new + (1 − alpha) · previous``; the first figure is taken as it is."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA weight alpha must be in (0, 1], got {alpha}")
    return new if previous is None else alpha * new + (1.0 - alpha) * previous


def relative_speeds(speeds: Sequence[float]) -> tuple[float, ...]:
    """Speeds scaled so the fastest rank is 1; a rank with no figure (≤ 0) counts as fastest."""
    speeds = [float(s) for s in speeds]
    known = [s for s in speeds if s > 0]
    if not known:
        return tuple(1.0 for _ in speeds)
    top = max(known)
    return tuple(s / top if s > 0 else 1.0 for s in speeds)


def flag_stragglers(speeds: Sequence[float], threshold: float = 1.2) -> tuple[int, ...]:
    """Ranks at least ``threshold`` × slower than the fastest (relative speed ≤ 1 / threshold)."""
    if not threshold >= 1.0:
        raise ValueError(f"a straggler threshold is a slowdown ratio ≥ 1, got {threshold}")
    rel = relative_speeds(speeds)
    return tuple(r for r, s in enumerate(rel) if s * threshold <= 1.0 + 1e-12)


class _CPUToken(NamedTuple):
    clock: object
    start: float
    straggler: object
    delayed: float


def _straggler():
    """This rank's straggler emulation, whose sleeps count as compute (a slow device)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from ..runtime import rank_context

    return rank_context().straggler


class LayerTimer:
    """What a layer holds: ``begin(device)`` before its compute, ``end(token, work)`` after."""

    def __init__(self, monitor: "SpeedMonitor", key: str):
        self.monitor, self.key = monitor, key

    def begin(self, device: torch.device | None):
        if device is not None and device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        straggler = _straggler()
        clock = compute_clock(device)
        return _CPUToken(clock, clock(), straggler, straggler.delayed_s if straggler else 0.0)

    def count(self, work: float) -> None:
        """Work done in regions timed piece by piece (counted once, not per piece)."""
        self.monitor._add(self.key, 0.0, work)

    def end(self, token, work: float = 0.0) -> None:
        if isinstance(token, _CPUToken):
            delayed = token.straggler.delayed_s - token.delayed if token.straggler else 0.0
            self.monitor._add(self.key, token.clock() - token.start + delayed, work)
        else:  # CUDA: read the pair at the next exchange, after one synchronize
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self.monitor._pending.append((self.key, token, stop, work))


class SpeedMonitor:
    """Per-rank compute speed, smoothed and shared over ``group``.

    ``attach(model)`` once; ``step()`` at the end of every training step (every
    rank: every ``every``-th call is a collective); read ``speeds()``,
    ``layer_speeds(name)`` and ``stragglers()``.
    """

    def __init__(self, group=None, *, every: int = 10, alpha: float = 0.5):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        ema(None, 0.0, alpha)  # validates alpha
        self.group, self.every, self.alpha = group, every, alpha
        live = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if live else 1
        self.rank = dist.get_rank(group) if live else 0
        self.keys: list[str] = []
        self._seconds: dict[str, float] = {}
        self._work: dict[str, float] = {}
        self._pending: list = []
        self._smoothed: dict[str, list[float | None]] = {}  # key (and "" for all) → per rank
        self.steps = 0
        self.shares = 0
        self.overhead_s = 0.0
        self.compute_s = 0.0  # this rank's timed compute, all layers, since it was made

    # --- wiring -------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> list[str]:
        """Give every plait layer of ``model`` (a module with ``compute_timer``) a timer."""
        names = [name for name, m in model.named_modules() if hasattr(m, "compute_timer")]
        for name in names:
            model.get_submodule(name).compute_timer = self.timer(name)
        return names

    def timer(self, key: str) -> LayerTimer:
        if key not in self._seconds:
            self.keys.append(key)
            self._seconds[key], self._work[key] = 0.0, 0.0
            self._smoothed[key] = [None] * self.world
        return LayerTimer(self, key)

    def _add(self, key: str, seconds: float, work: float) -> None:
        self._seconds[key] += seconds
        self._work[key] += work
        self.compute_s += seconds

    def discard(self) -> None:
        """Forget this window's figures (a warm-up step); no collective."""
        self._resolve_pending()
        for key in self.keys:
            self._seconds[key], self._work[key] = 0.0, 0.0

    # --- the exchange ---------------------------------------------------------
    def step(self) -> bool:
        """End of a training step; every ``every``-th call shares (all ranks). True if it did."""
        self.steps += 1
        if self.steps % self.every:
            return False
        self.share()
        return True

    def share(self) -> None:
        """Exchange this window's seconds and work (one all_gather) and fold them into the EMA."""
        start = time.perf_counter()
        self._resolve_pending()
        self.shares += 1
        if not self.keys:  # nothing attached (the same on every rank): nothing to exchange
            return
        local = torch.tensor([v for k in self.keys for v in (self._seconds[k], self._work[k])],
                             dtype=torch.float64)  # [2·L]
        table = self._gather(local).view(self.world, len(self.keys), 2)  # [p, L, (s, work)]
        self._fold(table)
        for key in self.keys:
            self._seconds[key], self._work[key] = 0.0, 0.0
        self.overhead_s += time.perf_counter() - start

    def _resolve_pending(self) -> None:
        if self._pending:
            torch.cuda.synchronize()
            for key, begin, stop, work in self._pending:
                self._add(key, begin.elapsed_time(stop) / 1e3, work)
            self._pending.clear()

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return local.clone()
        device = "cpu"
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        parts = [torch.empty_like(local, device=device) for _ in range(self.world)]
        dist.all_gather(parts, local.to(device), group=self.group)
        return torch.stack(parts).cpu()

    def _fold(self, table: torch.Tensor) -> None:
        rows = table.tolist()  # [p][L][2]
        for i, key in enumerate(self.keys + [""]):
            for r in range(self.world):
                pairs = rows[r] if key == "" else [rows[r][i]]
                seconds, work = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
                if seconds > 0 and work > 0:  # no figure this window: keep the last
                    smoothed = self._smoothed.setdefault(key, [None] * self.world)
                    smoothed[r] = ema(smoothed[r], work / seconds, self.alpha)

    # --- what it says ---------------------------------------------------------
    def speeds(self) -> tuple[float, ...]:
        """Every rank's smoothed speed over all layers, fastest = 1 (all 1 before any figure)."""
        return relative_speeds([s or 0.0 for s in self._smoothed.get("", [None] * self.world)])

    def layer_speeds(self, key: str) -> tuple[float, ...]:
        """The same for one layer (its name in the model, as ``attach`` returned it)."""
        if key not in self._seconds:
            raise ValueError(f"no layer {key!r} is timed; timed: {self.keys}")
        return relative_speeds([s or 0.0 for s in self._smoothed[key]])

    def stragglers(self, threshold: float = 1.2) -> tuple[int, ...]:
        """Ranks at least ``threshold`` × slower than the fastest."""
        return flag_stragglers(self.speeds(), threshold)
