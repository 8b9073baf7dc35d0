"""``bench hetero``'s ideal: the step time a perfect balancer would reach.

With per-step slowdowns ``F_r``, the capacity-proportional step
spreads the tensor-parallel compute ``c`` (what the emulation slows: the
``none`` run's measured compute per rank per step) in proportion to the speeds
``1/F_r``, so ``t_ideal = t_none − c + c · p / Σ_r (1/F_r)``: total work over
summed speeds, plus everything the emulation does not slow (communication,
attention, the replicated embedding and head, the optimizer). Each run's
``t_ideal_s`` is the median of that over its timed steps. Under ``--slow-by kernel``
everything a rank runs is slowed: a rank slowed ``F`` × is slow at its replicated work
too, and the fast ranks make up for it by taking more of the sharded work, which gives the
same formula with ``c`` the wall time of all the rank's CPU work on its whole budget: the
``none`` run's CPU time per rank per step (all of its threads, ``cpu_s_per_step``, the mean
over its timed steps: the first steps' allocations land on the run that steps first) over
the hosts' mean budget in cores, at most ``t_none``. That holds where the budget binds; on
a machine that gives a host less than its budget the kernel's ``F`` is not reached either.
A noisy neighbour, too, slows all the rank's work, so its ideal takes ``c`` the same way.

That capacity-proportional step (``t_capacity_s``) assumes a fast rank can take over any of
a slow one's work. Where the kernel or a neighbour slows all of it, the slow rank's
unmovable work (its replicated layers, the optimizer, its share of every collective's CPU,
Python) stays on it whatever the plan: the step can be no shorter than the slowest rank's
unmovable CPU time, ``F`` × its time on the whole budget (``t_floor_s``; per rank, from the
``none`` run: its CPU time, all threads, less its thread's CPU time in the timed layers,
over its budget). The ideal is the longer of the two, step by step: in kernel-made graded
runs a rank's unmovable CPU was about 60 % of its step, so the 4 × host alone took longer
than the capacity step.
"""

from __future__ import annotations

import statistics
from typing import Sequence

__all__ = ["ideal_step", "with_ideal", "floor_step", "neighbour_factors"]


def ideal_step(t_none: float, compute: float, factors) -> float:
    """The capacity-proportional step under per-rank slowdowns ``factors``: the
    tensor-parallel ``compute`` spread in proportion to the speeds ``1/F_r``, the rest as in
    the no-straggler step ``t_none``."""
    return t_none - compute + compute * len(factors) / sum(1.0 / f for f in factors)


def with_ideal(records: list[dict], warmup: int) -> list[dict]:
    """Add ``t_no_straggler_s``, ``t_ideal_s`` and ``ratio_to_ideal`` from each seed's
    ``none``/``even`` run (see the module docstring: ``c`` is the compute the slowdown
    stretches, the rank's whole CPU time under ``--slow-by kernel``)."""
    reference = {r["seed"]: r for r in records if r["scenario"] == "none" and r["policy"] == "even"}
    for r in records:
        ref = reference.get(r["seed"])
        if ref is None:
            continue
        t_none, c = ref["t_step_s"], _stretched(ref, r)
        capacity = [ideal_step(t_none, c, f) for f in r["factors"]][warmup:]
        unmovable = _unmovable(ref, r, warmup)
        floor = ([floor_step(unmovable, f) for f in r["factors"]][warmup:]
                 if unmovable is not None else [0.0] * len(capacity))
        r["t_no_straggler_s"] = t_none
        r["t_capacity_s"] = statistics.median(capacity)
        if unmovable is not None:
            r["t_floor_s"] = statistics.median(floor)
        r["t_ideal_s"] = statistics.median(max(a, b) for a, b in zip(capacity, floor))
        r["ratio_to_ideal"] = r["t_step_s"] / r["t_ideal_s"]
        if len(ref["losses"]) == len(r["losses"]):
            r["max_loss_diff_vs_none"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    return records


def floor_step(unmovable: Sequence[float], factors) -> float:
    """The step no plan can beat under per-rank slowdowns ``factors``: the slowest rank's
    ``unmovable`` work (per rank, in seconds at its whole budget), ``F`` × longer."""
    return max(u * f for u, f in zip(unmovable, factors))


def _unmovable(ref: dict, record: dict, warmup: int) -> list[float] | None:
    """Per rank, the seconds its unmovable CPU work takes on its whole budget, from its
    seed's ``none``/``even`` run ``ref``: the median over the timed steps of all its threads'
    CPU time less its thread's CPU time in the timed layers, over the budget. Only where
    the kernel (or a neighbour) slows all of a rank's work, and the run recorded both
    (None otherwise: the floor does not bind where only the layers are slowed)."""
    kernel = ref.get("kernel") or {}
    if not (record.get("slow_by") == "kernel" or record["scenario"] == "noisy-neighbour") \
            or "movable_cpu_s" not in kernel:
        return None
    return [statistics.median(c - m for c, m in zip(cpu[warmup:], movable[warmup:]))
            / held[0] for cpu, movable, held in zip(kernel["cpu_s"], kernel["movable_cpu_s"],
                                                    kernel["held_cores"])]


def _stretched(ref: dict, record: dict) -> float:
    """``c`` of the ideal (module docstring) for ``record``, from its seed's ``none``/``even``
    run ``ref``: the kernel, or a neighbour, slows all the rank's CPU work, so all of it at its
    whole budget's pace (at most the whole step); the sleep emulation, the timed compute."""
    if record.get("slow_by") == "kernel" or record["scenario"] == "noisy-neighbour":
        budget = statistics.fmean(held[0] for held in ref["kernel"]["held_cores"])
        return min(ref["t_step_s"], ref["cpu_s_per_step"] / budget)
    return ref["compute_s_per_step"]


def neighbour_factors(records: list[dict], cfg) -> list[float]:
    """Per seed, the slowdown the noisy neighbour made as the ``even`` run measured it beside
    the ``none`` run, step by step (interleaved, so under the same load): the median over the
    timed steps it ran of ``1 + (t_even − t_none) / c``; beside the nominal 2 of the ideal."""
    by = {(r["seed"], r["scenario"], r["policy"]): r for r in records}
    out = []
    for seed in sorted({r["seed"] for r in records}):
        ref, even = by.get((seed, "none", "even")), by.get((seed, "noisy-neighbour", "even"))
        if ref is None or even is None:
            continue
        c = _stretched(ref, even)
        start = max(cfg.warmup, cfg.spike_at)
        pairs = list(zip(even["step_times_s"], ref["step_times_s"]))[start:]
        if pairs and c > 0:
            out.append(1.0 + statistics.median(a - b for a, b in pairs) / c)
    return out
