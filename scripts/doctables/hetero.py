"""Tables of balancing (bench hetero): each scenario and policy against the ideal step, and
the checks issue 22 asks of ``semi``, seed by seed."""

from __future__ import annotations

from statistics import median

from .runs import Results, Run, each, figures, fmt, med, provenance, table


def hetero_table(res: Results, name: str = "bench-hetero-quick") -> str:
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    seeds = max(int(x.get("seeds", 1)) for x in runs[0].data["meta"]["table"])
    rows = []
    for row0 in runs[0].data["meta"]["table"]:
        def row(run, sc=row0["scenario"], po=row0["policy"]):
            return next(x for x in run.data["meta"]["table"] if x["scenario"] == sc and x["policy"] == po)
        ms = lambda field: figures(runs, lambda r: row(r)[field] * 1e3)  # noqa: E731
        ratio = figures(runs, lambda r: row(r)["ratio_to_ideal"])
        cells = [row0["scenario"], row0["policy"], each(ms("t_step_s"), ".1f"),
                 each(ms("t_ideal_s"), ".1f"), each(ratio, ".2f")]
        if seeds > 1:  # every seed's ratio, run by run
            per_seed = figures(runs, lambda r: row(r)["ratio_per_seed"])
            cells.append("; ".join(each(v, ".2f") for v in per_seed if v))
            decisions = figures(runs, lambda r: row(r)["decisions_per_seed"])
            last = "; ".join(each(v, ".0f") for v in decisions if v)
        else:
            cells.append(med(ratio, ".2f"))
            last = each(figures(runs, lambda r: row(r)["decisions"]), ".0f")
        rows.append(cells + [each(figures(runs, lambda r: row(r)["heldout_loss"]), ".3f"),
                             each(figures(runs, lambda r: 100 * row(r)["heldout_acc"]), ".1f"),
                             last])
    r0 = runs[0].data["records"][0]
    caption = (f"{r0.get('world_size', '?')} ranks; where: {runs[0].data['meta'].get('where', '?')}. "
               f"Held-out accuracy in %.")
    if seeds > 1:
        caption += (f" {seeds} seeds a run: step, ideal and held-out figures are medians (means) "
                    f"over them; runs are separated by ';' in the per-seed columns.")
        head = ["scenario", "policy", "step (ms)", "ideal (ms)", "× ideal (median of seeds)",
                "× ideal, each seed", "held-out loss", "held-out acc", "decisions, each seed"]
        out = table(head, rows) + "\n\n" + hetero_checks(runs)
    else:
        head = ["scenario", "policy", "step (ms)", "ideal (ms)", "× ideal", "median",
                "held-out loss", "held-out acc", "decisions"]
        out = table(head, rows) + "\n\n" + hetero_checks(runs)
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + out


def hetero_checks(runs: list[Run]) -> str:
    """What issue 22 asks of semi, seed by seed, run by run (the summary bench hetero
    writes); only the checks whose scenarios the runs have."""
    checks = [("straggler-2x: semi × ideal (≤ 1.10)", "straggler-2x_semi_ratio_per_seed", ".2f"),
              ("straggler-2x: semi − migrate (≤ 0.03)", "straggler-2x_semi_minus_migrate_per_seed",
               "+.3f"),
              ("straggler-2x: semi − migrate, paired by step",
               "straggler-2x_semi_minus_migrate_paired_per_seed", "+.3f"),
              ("spike: semi − resize (≤ 0.03)", "spike_semi_minus_resize_per_seed", "+.3f"),
              ("spike: semi − resize, paired by step", "spike_semi_minus_resize_paired_per_seed",
               "+.3f"),
              ("graded: semi × ideal (≤ 1.15)", "graded_semi_ratio_per_seed", ".2f"),
              ("drift: semi × ideal (≤ 1.10)", "drift_semi_ratio_per_seed", ".2f"),
              ("jitter: semi × ideal (≤ 1.10)", "jitter_semi_ratio_per_seed", ".2f"),
              ("jitter: semi's decisions (0)", "jitter_semi_decisions_per_seed", ".0f"),
              ("moving: semi × ideal", "moving_semi_ratio_per_seed", ".2f"),
              ("two-stragglers: semi × ideal", "two-stragglers_semi_ratio_per_seed", ".2f"),
              ("noisy-neighbour: semi × ideal", "noisy-neighbour_semi_ratio_per_seed", ".2f"),
              ("noisy-neighbour: semi − migrate", "noisy-neighbour_semi_minus_migrate_per_seed",
               "+.3f"),
              ("noisy-neighbour: semi − migrate, paired by step",
               "noisy-neighbour_semi_minus_migrate_paired_per_seed", "+.3f"),
              ("noisy-neighbour: its slowdown as even measured it (nominal 2)",
               "noisy-neighbour_even_factor_per_seed", ".2f"),
              ("none: semi's decisions (0)", "none_semi_decisions_per_seed", ".0f"),
              ("none: semi × ideal (it computes what none/even does: the noise)",
               "none_semi_ratio_per_seed", ".2f"),
              ("none: semi − even, paired by step (the same work: the noise floor)",
               "none_semi_minus_even_paired_per_seed", "+.3f")]
    rows = []
    for what, key, spec in checks:
        values = figures(runs, lambda r, key=key: _summary(r, key))
        if any(v is not None for v in values):
            rows.append([what] + [each(v, spec) if v else "–" for v in values])
    for scenario in ("straggler-2x", "graded", "noisy-neighbour"):  # what persists
        for policy in ("migrate", "semi"):
            values = [settled(r.data["records"], scenario, policy) for r in runs]
            if any(values):
                rows.append([f"{scenario}: {policy} × ideal after its last decision"]
                            + [each(v, ".2f") if v else "–" for v in values])
    acc = figures(runs, lambda r: max(r.data["meta"]["summary"]["acc_loss_pp"].values()))
    rows.append(["held-out accuracy lost, worst scenario and policy (mean over seeds; ≤ 0.5 pp)"]
                + [fmt(v, ".2f") for v in acc])
    return table(["check, each seed"] + [f"run {r.k}" for r in runs], rows)


def _summary(run: Run, key: str):
    """A figure of a hetero run's summary; a paired gap its summary predates (runs before
    the noise floor was reported), computed from its records as bench hetero does."""
    summary = run.data["meta"]["summary"]
    if key not in summary and key.endswith("_paired_per_seed"):
        from plait.bench.hetero import HeteroBenchConfig
        from plait.bench.hetero_summary import paired_gaps

        return paired_gaps(run.data["records"], HeteroBenchConfig.warmup)[key]
    return summary[key]


def settled(records: list[dict], scenario: str, policy: str) -> list[float]:
    """Per seed, the run's median step after its last decision over its ideal: what its
    plan reaches once the policy is done (where the ideal counts work no plan moves, this
    is as near as tensor-parallel balancing got)."""
    out = []
    for r in sorted((r for r in records if (r["scenario"], r["policy"]) == (scenario, policy)),
                    key=lambda r: r["seed"]):
        if not r["decisions"] or "t_ideal_s" not in r:
            continue
        after = r["step_times_s"][max(d["step"] for d in r["decisions"]) + 1:]
        if after:
            out.append(median(after) / r["t_ideal_s"])
    return out
