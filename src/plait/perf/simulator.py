"""Discrete-event simulation of training steps on a cluster.

Every rank runs the same program (workload.py), so events are processed in
program order, vectorised over all ranks: each rank has a compute-stream clock
and a background network-stream clock (data-parallel traffic).  An operation
starts when its stream is free and its inputs are ready; a collective starts
when the last member of its group arrives (a max over that group's axis of the
[dp, ep, tp] rank grid) and ends after its alpha-beta duration.  A fused pair
runs the piece pipeline (pipeline.fused_time) paced by the group's slowest
member.  Per rank the simulator accounts compute time, time waiting for slower
peers, and exposed (un-hidden) communication.

Speeds change per step: mixed GPU generations (per node), a persistent
log-normal jitter, and random transient slowdowns.  The balancing policies of
hetero.py re-plan shards each step from the previous step's measured speeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import SimConfig
from .hardware import get_accelerator
from .hetero import react, step_policy
from .pipeline import fused_time
from .workload import AXES, Pair, Workload, build_workload

__all__ = ["Engine", "VariantResult", "SimResult", "simulate", "simulate_variant", "rank_speeds"]


class Engine:
    """Per-rank clocks over the [dp, ep, tp] grid and their accounting."""

    def __init__(self, shape: tuple[int, int, int]):
        z = np.zeros(shape)
        self.t, self.net, self.net_own = z.copy(), z.copy(), z.copy()
        self.busy, self.wait, self.exposed = z.copy(), z.copy(), z.copy()

    @staticmethod
    def gmax(x: np.ndarray, axis: str | None) -> np.ndarray:
        if axis is None:
            return x
        return np.broadcast_to(np.max(x, axis=AXES[axis], keepdims=True), x.shape)

    def compute(self, dur) -> None:
        self.t = self.t + dur
        self.busy = self.busy + dur

    def blocking(self, axis: str, dur: float) -> None:
        """A collective on the critical path: wait for the group, then communicate."""
        start = self.gmax(self.t, axis)
        self.wait += start - self.t
        self.exposed += dur
        self.t = start + dur

    def fused(self, axis: str, tc: np.ndarray, pair: Pair, overhead: float) -> None:
        """The piece pipeline; every piece's collective waits for the slowest member's piece."""
        start, tc_max = self.gmax(self.t, axis), self.gmax(tc, axis)
        dur = fused_time(tc_max, pair.t_comm_s, pair.chunks, overhead, comm_latency_s=pair.comm_latency_s)
        self.wait += start - self.t + (tc_max - tc)
        self.busy += tc
        self.exposed += dur - tc_max
        self.t = start + dur

    def issue(self, axis: str, dur: float) -> tuple[np.ndarray, np.ndarray]:
        """A background collective on the network stream.

        Returns (end, own_end): when it ends, and when it would have ended had no
        peer arrived later than this rank (the difference is waiting, not comm).
        """
        self.net = self.gmax(np.maximum(self.net, self.t), axis) + dur
        self.net_own = np.maximum(self.net_own, self.t) + dur  # as if no peer were ever late
        return self.net, self.net_own

    def wait_for(self, ends: tuple[np.ndarray, np.ndarray]) -> None:
        end, own_end = ends
        gap = np.maximum(end - self.t, 0.0)
        comm = np.clip(own_end - self.t, 0.0, gap)
        self.exposed += comm
        self.wait += gap - comm
        self.t = self.t + gap

    def end_step(self, compute_s: float) -> float:
        """Wait for the network, run the once-per-step compute, global barrier."""
        self.wait_for((self.net, self.net_own))
        self.compute(compute_s)
        end = float(np.max(self.t))
        self.wait += end - self.t
        self.t = np.full_like(self.t, end)
        self.net, self.net_own = self.t.copy(), self.t.copy()
        return end


def _run_ops(eng: Engine, ops, mult, dense_mult, fused: bool, overhead: float) -> None:
    for op in ops:
        if isinstance(op, Pair):
            tc = op.t_compute_s * mult
            if fused and op.chunks > 1:
                eng.fused(op.axis, tc, op, overhead)
            else:
                eng.compute(tc)
                eng.blocking(op.axis, op.t_comm_s)
        else:
            eng.compute(op[1] * (dense_mult if op[0] == "dense" else mult))


def _step(eng: Engine, w: Workload, mults, dense_mult, fused: bool, overhead: float,
          react_layers: int) -> None:
    """One step; ``mults`` = (before, after) the balancer has seen this step's speeds,
    switching after ``react_layers`` forward layers."""
    ahead = eng.issue("dp", w.fsdp_gather_s) if w.fsdp_gather_s else None
    mult = mults[0]
    for layer in range(w.layers):  # forward; prefetch next layer's parameters
        if layer == react_layers:
            mult = mults[1]
        if ahead is not None:
            eng.wait_for(ahead)
            ahead = eng.issue("dp", w.fsdp_gather_s)
        _run_ops(eng, w.fwd, mult, dense_mult, fused, overhead)
    mult = mults[1]
    for _ in range(w.layers):  # backward
        if ahead is not None:
            eng.wait_for(ahead)
            ahead = eng.issue("dp", w.fsdp_gather_s)
        _run_ops(eng, w.bwd, mult, dense_mult, fused, overhead)
        if w.grad_sync_s:
            eng.issue("dp", w.grad_sync_s)


def rank_speeds(sim: SimConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(nominal speed per rank from GPU generation, persistent speed incl. jitter), [dp, ep, tp]."""
    par, cl = sim.parallel, sim.cluster
    ref = get_accelerator(cl.gpu)
    rate = (lambda a: a.mem_bw_Bps) if sim.model.kind == "dlrm" else (lambda a: a.flops(sim.model.dtype))
    per_gpu = sim.cluster.speeds.mixed_per == "gpu"
    units = cl.num_gpus if per_gpu else cl.nodes
    unit_speed = np.ones(units)
    order = rng.permutation(units)
    start = 0
    for gpu, frac in sim.cluster.speeds.mixed.items():
        k = int(round(frac * units))
        unit_speed[order[start:start + k]] = rate(get_accelerator(gpu)) / rate(ref)
        start += k
    if not per_gpu:
        unit_speed = np.repeat(unit_speed, cl.gpus_per_node)
    nominal = unit_speed.reshape(par.dp, par.ep, par.tp)
    jitter = sim.cluster.speeds.jitter
    persistent = nominal * (np.exp(rng.normal(0.0, jitter, nominal.shape)) if jitter else 1.0)
    return nominal, persistent


@dataclass(frozen=True)
class VariantResult:
    """One (fusion, policy) variant; times are means over the measured steps."""

    fused: bool
    policy: str
    step_s: float
    throughput: float           # tokens/s (transformers) or samples/s (dlrm)
    exposed_comm_share: float   # un-hidden communication / step, mean over ranks
    wait_share: float           # waiting for slower peers / step, mean over ranks
    compute_share: float
    skipped: float              # work dropped by resizing (fraction)
    migrate_s: float            # seconds per step spent migrating shards
    mfu: float                  # model FLOPs / (step * peak), reference GPU


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    variants: tuple[VariantResult, ...]
    wall_s: float

    def get(self, *, fused: bool, policy: str = "even") -> VariantResult:
        for v in self.variants:
            if v.fused == fused and v.policy == policy:
                return v
        raise KeyError(f"no variant fused={fused} policy={policy!r}")


def _plans(policy: str, state, w: Workload, nominal, measured, speed, axis: int | None):
    """(multipliers before/after reacting, next state, skipped fraction, migration seconds)."""
    if axis is None:
        return (1.0 / speed, 1.0 / speed), state, 0.0, 0.0

    def last(x):
        return None if x is None else np.moveaxis(x, axis, -1)

    plan, state, moved = step_policy(policy, state, nominal=last(nominal), measured=last(measured),
                                     work_s=1.0, move_s_per_share=w.move_s_per_share)
    seen = react(policy, plan, state, last(speed))
    n = speed.shape[axis]
    mults = tuple(np.moveaxis(n * p.shares * p.keep, -1, axis) / speed for p in (plan, seen))
    return mults, state, float(np.mean(seen.skipped)), float(np.max(moved))


def simulate_variant(sim: SimConfig, w: Workload, *, fused: bool, policy: str) -> VariantResult:
    """Simulate ``sim.steps`` steps of one variant (same seed: same speeds for all variants)."""
    rng = np.random.default_rng(sim.seed)
    nominal, persistent = rank_speeds(sim, rng)
    sp, acc = sim.cluster.speeds, get_accelerator(sim.cluster.gpu)
    overhead = sim.per_piece_overhead_s if sim.per_piece_overhead_s is not None else 2 * acc.launch_s
    axis = AXES.get(w.balance_axis) if w.balance_axis else None
    state, measured, remaining = None, None, np.zeros(nominal.shape, dtype=int)
    eng, t0, totals = Engine(nominal.shape), 0.0, np.zeros(6)
    for step in range(sim.steps):
        starts = (remaining == 0) & (rng.random(nominal.shape) < sp.transient_prob)
        remaining = np.where(starts, sp.transient_steps, remaining)
        speed = persistent * np.where(remaining > 0, sp.transient_slowdown, 1.0)
        remaining = np.maximum(remaining - 1, 0)
        mults, state, skipped, migrate_s = _plans(policy, state, w, nominal, measured, speed, axis)
        busy0, wait0, exp0 = eng.busy.copy(), eng.wait.copy(), eng.exposed.copy()
        eng.t = eng.t + migrate_s  # shards move over the group's link before the step
        eng.exposed += migrate_s
        _step(eng, w, mults, 1.0 / speed, fused, overhead, sim.react_layers)
        end = eng.end_step(w.step_compute_s)
        dt, t0 = end - t0, end
        measured = speed  # the monitor sees this step's speeds when planning the next
        if step == 0 and sim.steps > 1:
            continue  # warm-up: balancers have not measured anything yet
        totals += [dt, np.mean(eng.busy - busy0) / dt, np.mean(eng.wait - wait0) / dt,
                   np.mean(eng.exposed - exp0) / dt, skipped, migrate_s]
    step_s, comp, wait, exp, skipped, mig = (float(x) for x in totals / max(sim.steps - 1, 1))
    return VariantResult(fused=fused, policy=policy, step_s=step_s,
                         throughput=w.samples_per_step / step_s, exposed_comm_share=exp,
                         wait_share=wait, compute_share=comp, skipped=skipped, migrate_s=mig,
                         mfu=w.flops_per_step / (step_s * acc.flops(sim.model.dtype)))


def simulate(sim: SimConfig, *, fusion: tuple[bool, ...] = (False, True),
             policies: tuple[str, ...] | None = None) -> SimResult:
    """Every (fusion, policy) variant of ``sim``."""
    import time

    t = time.perf_counter()
    w = build_workload(sim)
    policies = sim.policies if policies is None else policies
    out = tuple(simulate_variant(sim, w, fused=f, policy=p) for f in fusion for p in policies)
    return SimResult(config=sim, variants=out, wall_s=time.perf_counter() - t)
