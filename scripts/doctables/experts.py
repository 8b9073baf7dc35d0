"""bench experts' table: each scenario and policy, every run's figure and their median."""

from __future__ import annotations

from .runs import Results, each, med, provenance, table


def experts_table(res: Results, name: str) -> str:
    """× ideal, imbalance, moves and replicas per (scenario, policy), every run's."""
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    keys = list(dict.fromkeys((r["scenario"], r["policy"])
                              for run in runs for r in run.data["meta"]["summary"]))
    rows = []
    for key in keys:
        got = [next((r for r in run.data["meta"]["summary"]
                     if (r["scenario"], r["policy"]) == key), None) for run in runs]

        def of(field):
            return [None if g is None else g[field] for g in got]

        ratio = of("ratio_to_ideal")
        same = {True: "yes", False: "**no**", None: "–"}
        rows.append([key[0], key[1], each(ratio, ".3f"), med(ratio, ".3f"),
                     each(of("imbalance"), ".3f"), each(of("moves"), "d"),
                     each(of("copies"), "d"),
                     ", ".join(same[g.get("same_losses") if g else None] for g in got)])
    caption = ("Each step, every rank computes the expert work the policy's placement gives "
               "it; a step is the slowest rank's, the ideal all the step's rows at the ranks' "
               "summed speeds (each the median of its last 5 steps' rows a second); medians "
               "over the steps after warm-up, policies interleaved step by step. The "
               "all-to-alls are not in it. Imbalance: the slowest rank's time over the mean "
               "rank's; moves: placements that changed; replicas: copies beyond one per "
               "expert at the end; same losses: that placement applied to a float64 MoE "
               "mid-training (weights and AdamW state moved) kept its losses within 1e-10.")
    head = ["scenario", "policy", "× ideal (each run)", "median", "imbalance", "moves",
            "replicas", "same losses"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)
