"""``bench hetero``'s summary: its records per (scenario, policy) over seeds, the figures the
table and ``docs/results`` show, and the step-time plot."""

from __future__ import annotations

import statistics

from .hetero_ideal import neighbour_factors

__all__ = ["PAIRS", "mean_over_seeds", "ratio_cell", "spike_reaction", "summarize_hetero",
           "paired_gaps", "plot_hetero"]

# semi beside the policy that alone fits the scenario best: migrate what persists, resize a
# spike; and beside even with no straggler, where it makes no decision and computes the same:
# the gap two runs of the same work show, the noise floor of every other gap
PAIRS = (("none", "even"), ("straggler-2x", "migrate"), ("spike", "resize"),
         ("noisy-neighbour", "migrate"))


def mean_over_seeds(records: list[dict]) -> list[dict]:
    """One row per (scenario, policy): medians of step times, means and spreads of held-out."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["scenario"], r["policy"]), []).append(r)
    rows = []
    for (scenario, policy), rs in groups.items():
        acc = [r["heldout_acc"] for r in rs]
        row = {"scenario": scenario, "policy": policy, "seeds": len(rs),
               "t_step_s": statistics.median(r["t_step_s"] for r in rs),
               "heldout_loss": statistics.mean(r["heldout_loss"] for r in rs),
               "heldout_acc": statistics.mean(acc), "heldout_acc_spread": max(acc) - min(acc),
               "decisions": sum(len(r["decisions"]) for r in rs) / len(rs)}
        for key in ("t_ideal_s", "t_capacity_s", "t_floor_s", "t_no_straggler_s",
                    "ratio_to_ideal", "max_loss_diff_vs_none"):
            values = [r[key] for r in rs if key in r]
            if values:
                row[key] = statistics.median(values) if key != "max_loss_diff_vs_none" else max(values)
        ratios = [r["ratio_to_ideal"] for r in sorted(rs, key=lambda r: r["seed"])
                  if "ratio_to_ideal" in r]
        if ratios:  # every seed's, in seed order, and their range
            row["ratio_per_seed"] = ratios
            row["ratio_spread"] = max(ratios) - min(ratios)
        row["decisions_per_seed"] = [len(r["decisions"])
                                     for r in sorted(rs, key=lambda r: r["seed"])]
        rows.append(row)
    return rows


def ratio_cell(row: dict) -> str:
    """The table's "× ideal": the median over seeds, then every seed's in seed order."""
    if "ratio_to_ideal" not in row:
        return "–"
    seeds = row.get("ratio_per_seed", [])
    each = " ".join(f"{r:.2f}" for r in seeds) if len(seeds) > 1 else ""
    return f"{row['ratio_to_ideal']:.2f}" + (f" ({each})" if each else "")


def spike_reaction(record: dict, spike_at: int, spike_len: int) -> dict:
    """Steps from the spike's start to the first decision, and from its end to the even plan
    (the last ``undo`` or migrate-back at or after the end)."""
    decisions = record["decisions"]
    react = [d["step"] for d in decisions if d["step"] >= spike_at]
    end = spike_at + spike_len
    back = [d["step"] for d in decisions if d["step"] >= end and d["kind"] in ("undo", "migrate")]
    balanced = record["final_state"]
    even = all(len(set(v["sizes"])) == 1 and v["keep"] == 1.0 for v in balanced.values())
    return {"react_steps": (react[0] - spike_at + 1) if react else None,
            "return_steps": (back[-1] - end + 1) if back and even else (0 if not decisions else None)}


def summarize_hetero(records: list[dict], cfg) -> dict:
    rows = {(r["scenario"], r["policy"]): r for r in mean_over_seeds(records)}
    out: dict = {}
    for policy in ("even", "semi"):
        row = rows.get(("straggler-2x", policy))
        if row and "ratio_to_ideal" in row:
            out[f"straggler-2x_{policy}_ratio_to_ideal"] = row["ratio_to_ideal"]
    row = rows.get(("straggler-2x", "migrate"))
    if row and "max_loss_diff_vs_none" in row:
        out["migrate_max_loss_diff_vs_none"] = row["max_loss_diff_vs_none"]
    base = rows.get(("none", "even"))
    for policy in ("resize", "semi"):
        row = rows.get(("straggler-2x", policy))
        if row and base:
            out[f"{policy}_acc_loss_pp"] = 100 * (base["heldout_acc"] - row["heldout_acc"])
    spikes = [spike_reaction(r, cfg.spike_at, cfg.spike_len) for r in records
              if r["scenario"] == "spike" and r["policy"] == "semi"]
    if spikes:
        out["spike_semi_react_steps"] = [s["react_steps"] for s in spikes]
        out["spike_semi_return_steps"] = [s["return_steps"] for s in spikes]
    out.update(_targets(rows, base))
    out.update(paired_gaps(records, cfg.warmup))
    factors = neighbour_factors(records, cfg)
    if factors:
        out["noisy-neighbour_even_factor_per_seed"] = factors
    out["max_monitor_overhead"] = max(r["monitor_overhead"] for r in records)
    return out


def _targets(rows: dict, base: dict | None) -> dict:
    """Per seed, what issue 22 asks of semi: its ratio and its decisions in every scenario
    (none and a jitter file: no decision), the gap to the policy of :data:`PAIRS`;
    and per scenario and policy, held-out accuracy below the ``none`` run (pp, the mean)."""
    out: dict = {}
    for scenario, other in PAIRS:
        semi, alone = rows.get((scenario, "semi")), rows.get((scenario, other))
        if semi and "ratio_per_seed" in semi:
            out[f"{scenario}_semi_ratio_per_seed"] = semi["ratio_per_seed"]
            if alone and "ratio_per_seed" in alone:
                out[f"{scenario}_semi_minus_{other}_per_seed"] = [
                    a - b for a, b in zip(semi["ratio_per_seed"], alone["ratio_per_seed"])]
    for (scenario, policy), row in rows.items():  # every scenario's semi: drift, jitter, …
        if policy == "semi":
            out[f"{scenario}_semi_decisions_per_seed"] = row["decisions_per_seed"]
            if "ratio_per_seed" in row:
                out[f"{scenario}_semi_ratio_per_seed"] = row["ratio_per_seed"]
    if base:
        out["acc_loss_pp"] = {f"{sc}/{pol}": round(100 * (base["heldout_acc"] - r["heldout_acc"]),
                                                   3)
                              for (sc, pol), r in rows.items() if (sc, pol) != ("none", "even")}
    return out


def paired_gaps(records: list[dict], warmup: int) -> dict:
    """Per seed, semi's gap to the policy of :data:`PAIRS` (migrate on ``straggler-2x``,
    resize on ``spike``, even on ``none``: the noise floor), paired by step: the median over
    the timed steps of ``(t_semi − t_other) / t_ideal``. The runs of a seed are interleaved step by step, so step i of each ran under
    the same load; the gap of the two medians takes each run's own noise as well."""
    by = {(r["seed"], r["scenario"], r["policy"]): r for r in records}
    out: dict = {}
    for scenario, other in PAIRS:
        gaps = []
        for seed in sorted({r["seed"] for r in records}):
            semi, alone = by.get((seed, scenario, "semi")), by.get((seed, scenario, other))
            if semi is None or alone is None or "t_ideal_s" not in semi:
                continue
            pairs = list(zip(semi["step_times_s"], alone["step_times_s"]))[warmup:]
            gaps.append(statistics.median(a - b for a, b in pairs) / semi["t_ideal_s"])
        if gaps:
            out[f"{scenario}_semi_minus_{other}_paired_per_seed"] = gaps
    return out


def plot_hetero(records: list[dict], path: str, scenario: str | None = None) -> None:
    """Step time per step per policy, one panel per scenario (seed 0): the policies reacting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed0 = [r for r in records if r["seed"] == 0 and (scenario is None or r["scenario"] == scenario)]
    scenarios = list(dict.fromkeys(r["scenario"] for r in seed0))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 3.6), squeeze=False)
    for ax, name in zip(axes[0], scenarios):
        top = 0.0
        for r in (r for r in seed0 if r["scenario"] == name):
            ax.plot([t * 1e3 for t in r["step_times_s"]], label=r["policy"], lw=1.2)
            top = max([top] + [t * 1e3 for t in r["step_times_s"][1:]])
        if top:  # the first step (allocation, first touch) may run off the top
            ax.set_ylim(0, 1.1 * top)
        ideal = next((r.get("t_ideal_s") for r in seed0 if r["scenario"] == name), None)
        if ideal:
            ax.axhline(ideal * 1e3, color="k", ls=":", lw=1, label="ideal (median)")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
