"""What ``plait train`` leaves behind: ``log.json`` (every step, the held-out result) and
``loss.png``; and the step time a perfect balancer would reach (:func:`capacity_ideal`).

The capacity ideal, from the run itself (no reference run). Every step each rank records
what its speed monitor timed (``plait.balance.SpeedMonitor``'s compute regions, the places
the straggler emulation slows): ``compute_s`` (seconds, emulated sleeps included), ``work``
(weight elements multiplied) and ``slow`` (the emulation's factor ``F_r`` that step, known
in advance as ``bench hetero``'s are); ``time_max_s`` is the slowest rank's step. Over the
steps after the warm-up:

- each rank's unslowed speed ``σ_r``: the median of ``work · F_r / compute_s``;
- the full work ``W``: the most one tp group did in a step (ZERO-resizing does less);
- what compute does not explain, ``rest``: the median of ``time_max_s − max_r compute_s``
  (communication, attention, the replicated embedding and head, the optimizer);
- per step, ``ideal = rest + W / Σ_pos min_d σ_r / F_r``: the full work spread in
  proportion to the speeds (with ``--dp`` above 1 a tp position runs at its slowest
  replica's speed, as the agreed plans must); ``t_ideal_s`` is the median over the steps.

With equal ``σ_r = σ`` this is ``bench hetero``'s ``t_none − c + c · p / Σ_r 1/F_r``
(:func:`plait.bench.hetero_ideal.ideal_step`) with ``c = W / (p σ)``, the even share's unslowed
compute, and ``rest`` in place of ``t_none − c``. With no straggler (every ``F_r = 1``)
it is the run's own balanced capacity: ``× ideal`` above 1 is the imbalance of its plans
or of its ranks' real speeds.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from ..runtime.records import write_json

__all__ = ["write_train_report", "smooth", "capacity_ideal", "IDEAL_WARMUP", "IDEAL_KIND"]

IDEAL_WARMUP = 5  # first steps left out, as bench hetero's --warmup (allocation, first touch)
IDEAL_KIND = ("capacity, from this run: the monitor's per-rank compute and work per step and "
              "the emulation's known slowdowns (bench hetero's formula, no reference run)")


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average, bias-corrected (TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return out


def capacity_ideal(records: Sequence[dict], dp_groups: Sequence[Sequence[int]],
                   warmup: int = IDEAL_WARMUP) -> dict:
    """The capacity ideal of a run (see the module doc) from its records' ``compute_s``,
    ``work``, ``slow`` (each a list over ranks) and ``time_max_s``; ``dp_groups``: the ranks
    of each tp position (``[[0], [1]]`` for 2 ranks of tensor parallelism). Without such
    records after the warm-up, or without timed work, ``{"kind", "omitted": why}``."""
    rows = [r for r in records if "compute_s" in r][warmup:]
    if not rows:
        return {"kind": IDEAL_KIND, "omitted": f"no step after the first {warmup} carries the "
                                               "monitor's figures"}
    ranks = range(len(rows[0]["compute_s"]))
    replicas = len(dp_groups[0])
    work = max(sum(r["work"][pos[d]] for pos in dp_groups) for r in rows for d in range(replicas))
    if work <= 0:
        return {"kind": IDEAL_KIND, "omitted": "no timed compute (no plait layer with a "
                                               "compute timer)"}
    speeds = []
    for k in ranks:  # unslowed work per second; a rank never given work counts as the fastest
        each = [r["work"][k] * r["slow"][k] / r["compute_s"][k] for r in rows
                if r["work"][k] > 0 and r["compute_s"][k] > 0]
        speeds.append(statistics.median(each) if each else None)
    top = max(s for s in speeds if s is not None)
    speeds = [top if s is None else s for s in speeds]
    rest = statistics.median(r["time_max_s"] - max(r["compute_s"]) for r in rows)
    ideal_compute = [work / sum(min(speeds[k] / r["slow"][k] for k in pos) for pos in dp_groups)
                     for r in rows]
    t_step = statistics.median(r["time_max_s"] for r in rows)
    t_ideal = statistics.median(rest + c for c in ideal_compute)
    return {"kind": IDEAL_KIND, "warmup": warmup, "steps": len(rows), "t_step_s": t_step,
            "t_ideal_s": t_ideal, "ratio_to_ideal": t_step / t_ideal, "rest_s": rest,
            "ideal_compute_s": statistics.median(ideal_compute), "work_per_step": work,
            "unslowed_speed": speeds,
            "max_compute_s": statistics.median(max(r["compute_s"]) for r in rows)}


def write_train_report(result: dict, cfg, out: str | Path, where: str, wall_s: float,
                       load: Sequence[float] | None = None) -> dict:
    """Write ``out/log.json`` and ``out/loss.png``; returns the summary stored in the log.
    ``load``: the machine's load average (1 minute) before and after the run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = result["records"]
    losses = [r["loss"] for r in records]
    head = max(1, len(losses) // 10)  # first and last tenth: one noisy batch proves nothing
    summary = {"first_loss": losses[0], "last_loss": losses[-1],
               "first_tenth_mean_loss": sum(losses[:head]) / head,
               "last_tenth_mean_loss": sum(losses[-head:]) / head,
               **result["eval"], "train_s": result["train_s"], "wall_s": wall_s,
               "unit": result["unit"], "params_per_rank": result["params_rank"],
               "parallel": result["parallel"], "parallel_notes": result.get("notes", []),
               "operator_paths": result["paths"], "where": where,
               "placement": result.get("placement", "")}
    if load is not None:
        summary["load_avg_1min"] = list(load)
    if "balance" in result:  # --balance: the policy, every decision, the plans at the end
        summary["balance"] = result["balance"]
    if "ideal" in result:  # the capacity ideal and × ideal (capacity_ideal)
        summary["ideal"] = result["ideal"]
    if result.get("resumed"):  # --resume: the checkpoint, and what was resharded
        summary["resumed"] = result["resumed"]
    config = {k: v for k, v in asdict(cfg).items()}
    write_json(out / "log.json", records, {"command": "train", "config": config, "summary": summary})
    _plot(out / "loss.png", records, result["eval"], cfg, where, result.get("ideal", {}))
    return summary


def _plot(path: Path, records: list[dict], final: dict, cfg, where: str,
          ideal: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = [r["loss"] for r in records]
    fig, (ax, ax_t) = plt.subplots(2, 1, figsize=(7, 6.4), dpi=110, sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    steps = list(range(len(losses)))
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1, label="training loss (per step)")
    ax.plot(steps, smooth(losses), color="tab:blue", lw=2, label="training loss (smoothed)")
    ax.scatter([len(losses) - 1], [final["heldout_loss"]], color="tab:red", zorder=3,
               label=f"held-out loss {final['heldout_loss']:.3f}")
    if "planted_model_loss" in final:
        ax.axhline(final["planted_model_loss"], color="gray", ls="--", lw=1,
                   label=f"planted model's loss {final['planted_model_loss']:.3f}")
    ax.set_ylabel("cross-entropy")
    path_kind = f"fused operators (chunks={cfg.chunks})" if cfg.overlap else "plain path"
    ax.set_title(f"plait train --model {cfg.model}: {cfg.extra.get('ranks', '')} ranks, "
                 f"{path_kind}", fontsize=10)
    ax.text(0.01, 0.01, where, transform=ax.transAxes, ha="left", va="bottom", fontsize=7,
            color="gray")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    _plot_step_times(ax_t, records, cfg, ideal)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_step_times(ax, records: list[dict], cfg, ideal: dict) -> None:
    """Rank 0's step time per step, each balancer decision as a line at its step, and the
    capacity ideal."""
    steps = [r["step"] for r in records]
    times_ms = [1e3 * r["time_s"] for r in records]
    ax.plot(steps, times_ms, color="tab:gray", lw=1, label="step time (rank 0)")
    if len(times_ms) > 1:  # the first step (allocation, first touch) may run off the top
        ax.set_ylim(0, 1.1 * max(times_ms[1:]))
    if "t_ideal_s" in ideal:
        ax.axhline(1e3 * ideal["t_ideal_s"], color="k", ls=":", lw=1,
                   label=f"capacity ideal {1e3 * ideal['t_ideal_s']:.1f} ms")
    colors = {"migrate": "tab:green", "resize": "tab:orange", "undo": "tab:purple"}
    labelled = set()
    for r in records:
        for d in r.get("decisions", ()):
            kind = d["kind"]
            ax.axvline(r["step"], color=colors.get(kind, "k"), lw=1, ls="--",
                       label=None if kind in labelled else f"balancer: {kind}")
            labelled.add(kind)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    balance = getattr(cfg, "balance", "even")
    ax.set_title(f"--balance {balance}" + ("" if balance != "even" else " (no balancer)"),
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", framealpha=0.9)
