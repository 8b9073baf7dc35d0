"""Rewrite the tables in README.md and docs/*.md from the runs stored in docs/results/.

    python scripts/docs_tables.py            # rewrite every generated region
    python scripts/docs_tables.py --check    # exit 1 (and show the difference) where a region
                                             # is not what the stored JSON gives

A generated region is delimited in the Markdown by

    <!-- generated: KEY -->
    ...
    <!-- end generated -->

and KEY names one of the tables below (``--list`` prints them). Each run is a folder entry
docs/results/NAME/run-K.json (the command's own JSON) beside run-K.meta.json (the exact
command, when it ran, how long, the host), both written by scripts/results.sh. Every table
shows each run's figure (run 1, run 2, ...) and their median, and names the command and
the runs' dates; README's headline table takes a figure only once two runs have it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
REGION = re.compile(r"(<!-- generated: ([\w.-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)
DOCS = ("README.md", "docs/*.md", "docs/results/*.md")  # results pages: the runs' histories
MIN_RUNS_README = 2


# ---------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class Run:
    """One stored run of a headline command: its JSON and the sidecar that says how it ran."""

    k: int
    data: dict
    meta: dict


class Results:
    """The runs under one results folder, read once per command name."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._cache: dict[str, list[Run]] = {}

    def runs(self, name: str) -> list[Run]:
        if name not in self._cache:
            runs = []
            for path in sorted((self.folder / name).glob("run-*.json")):
                m = re.fullmatch(r"run-(\d+)\.json", path.name)
                if not m:
                    continue  # the sidecars
                meta_path = path.with_name(f"run-{m[1]}.meta.json")
                if not meta_path.exists():
                    raise SystemExit(f"{path} has no {meta_path.name}: the command that made it is unknown")
                runs.append(Run(int(m[1]), json.loads(path.read_text()), json.loads(meta_path.read_text())))
            self._cache[name] = sorted(runs, key=lambda r: r.k)
        return self._cache[name]


# ---------------------------------------------------------------------------- formatting


def fmt(value, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    return format(value, spec)


def each(values: list, spec: str) -> str:
    """Every run's figure, in run order: ``1.33, 1.31``."""
    return ", ".join(fmt(v, spec) for v in values) if values else "–"


def med(values: list, spec: str) -> str:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return "–"
    mid = median(nums)
    return fmt(round(mid) if spec.endswith("d") else mid, spec)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def generic_command(runs: list[Run]) -> str:
    """The runs' command with the run number as K (they differ in nothing else)."""
    cmd = runs[-1].meta["command"]
    return re.sub(r"run-\d+", "run-K", cmd)


def when(run: Run) -> str:
    started = run.meta.get("started") or run.data.get("meta", {}).get("time", "?")
    return started[:16].replace("T", " ") + " UTC"


def provenance(name: str, runs: list[Run]) -> str:
    if not runs:
        return (f"No run stored yet (`scripts/results.sh --only {name}` makes them). ")
    host = runs[-1].meta.get("host", {})
    lines = [f"`{generic_command(runs)}`" + (" (its `demo.json`)" if runs[-1].meta.get("json_from") else ""), ""]
    per_run = "; ".join(
        f"run {r.k}: {when(r)}, plait {r.meta.get('host', {}).get('commit', '?')}"
        + (" with local changes" if r.meta.get("host", {}).get("dirty") else "")
        + f", {r.meta.get('wall_s', '?')} s, load {str(r.meta.get('loadavg_before', '?')).split()[0]} before"
        + (f", exit {r.meta['exit']} (a check in its output failed)" if r.meta.get("exit") else "")
        for r in runs)
    lines.append(f"Runs ({len(runs)}) — {per_run}. Host: {host.get('cores', '?')} cores "
                 f"({host.get('cpu') or 'cpu unknown'}), torch {host.get('torch', '?')}, "
                 f"Python {host.get('python', '?')}. JSON: [docs/results/{name}/]({link_to(name)}).")
    return "\n".join(lines)


def link_to(name: str) -> str:
    """Relative link from a file in docs/ to a results folder (README's links are rebased)."""
    return f"results/{name}/"


def figures(runs: list[Run], get: Callable[[Run], object]) -> list:
    out = []
    for r in runs:
        try:
            out.append(get(r))
        except (KeyError, IndexError, TypeError, ZeroDivisionError, StopIteration):
            out.append(None)
    return out


def rate_Bps(link: str) -> float | None:
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", str(link).lower())
    if not m:
        return None
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


# ---------------------------------------------------------------------------- bench collectives


def collectives_table(res: Results) -> str:
    name = "bench-collectives-quick"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    top = max(r["bytes"] for r in runs[0].data["records"])
    link = runs[0].data["records"][0].get("link")
    rate = rate_Bps(link)
    rows = []
    for coll in dict.fromkeys(r["collective"] for r in runs[0].data["records"]):
        def pick(run, coll=coll):
            return next(x for x in run.data["records"] if x["collective"] == coll and x["bytes"] == top)
        t = figures(runs, lambda r: pick(r)["time_s"] * 1e3)
        bw = figures(runs, lambda r: pick(r)["busbw_GBps"])
        share = [b * 1e9 / rate if (b is not None and rate) else None for b in bw]
        wrong = figures(runs, lambda r: pick(r)["wrong"])
        # the same bytes as pieces all in flight (runs before issue 21 did not time them)
        pieces = figures(runs, lambda r: pick(r).get("pieces_link_share"))
        rows.append([coll, each(t, ".1f"), each(bw, ".3f"), each(share, ".0%"), med(share, ".0%"),
                     each(pieces, ".0%"), each(wrong, "d")])
    n = runs[0].data["records"][-1].get("pieces") or "–"
    head = [f"collective ({top / 2**20:.0f} MiB)", "time (ms)", "busbw (GB/s)",
            f"busbw / link ({link})", "median", f"as {n} pieces in flight / link", "#wrong"]
    return provenance(name, runs) + "\n\n" + table(head, rows)


# ---------------------------------------------------------------------------- bench ops


def shape_text(op: str, s: dict) -> str:
    if "m" in s:
        return f"{s['m']}×{s['k']}×{s['n']}"
    if "tables" in s:
        return f"{s['tables']} tables×{s['rows'] // 1000}k×{s['dim']}, batch {s['batch']}, pool {s['pool']}"
    if "tokens" in s:
        return f"{s['tokens']} tokens, H {s['hidden']}, {s['experts']} experts, F {s['ffn']}"
    return json.dumps(s, sort_keys=True)


def ops_key(rec: dict) -> str:
    return rec["op"] + json.dumps(rec["shape"], sort_keys=True)


def ops_table(res: Results) -> str:
    name = "bench-ops-quick"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for rec0 in runs[0].data["records"]:
        key = ops_key(rec0)

        def rec(run, key=key):
            return next(x for x in run.data["records"] if ops_key(x) == key)

        ms = lambda field: figures(runs, lambda r: rec(r)[field] * 1e3)  # noqa: E731
        speed = figures(runs, lambda r: rec(r)["speedup"])
        one_call = figures(runs, lambda r: rec(r)["speedup_one_call"])
        eff = figures(runs, lambda r: rec(r)["efficiency"])
        balanced = figures(runs, lambda r: 0.5 <= rec(r)["comm_ratio"] <= 2.0)
        mark = " ⚖" if sum(bool(b) for b in balanced) * 2 > len(runs) else ""
        pieces = figures(runs, lambda r: rec(r)["chunks"] if rec(r)["path"] == "fused" else "plain")
        best = figures(runs, lambda r: f"{rec(r)['best_fixed_chunks']}")
        rows.append([rec0["op"] + mark, shape_text(rec0["op"], rec0["shape"]),
                     each(ms("t_compute_s"), ".1f"), each(ms("t_comm_s"), ".1f"),
                     each(ms("t_unfused_one_call_s"), ".1f"), each(ms("t_unfused_pieces_s"), ".1f"),
                     each(ms("t_fused_s"), ".1f"), each(ms("t_limit_s"), ".1f"),
                     each(ms("t_beside_s"), ".1f"), each(pieces, ""),
                     each(speed, ".2f"), med(speed, ".2f"), each(one_call, ".2f"), med(one_call, ".2f"),
                     each(eff, ".2f"), med(eff, ".2f"), each(best, ""),
                     each(figures(runs, lambda r: rec(r)["auto_over_best_fixed"]), ".3f")])
    kind = runs[0].data["records"][0]["limit_kind"]
    head = ["operator", "shape", "compute", "comm", "unfused, one call", "unfused, pieces",
            "fused (auto)", f"limit ({kind})", "beside", "pieces", "speedup over the best unfused",
            "median", "over one call", "median", "efficiency", "median", "best fixed", "auto/best"]
    return provenance(name, runs) + "\n\n" + table(head, rows)


OPS_SUMMARY = [
    ("⚖ shapes (communication ½–2 × compute)", "balanced_shapes", "d"),
    ("median speedup over the best unfused (one call or pieces), ⚖", "median_speedup_balanced", ".2f"),
    ("median speedup over the one-call unfused, ⚖", "median_speedup_one_call_balanced", ".2f"),
    ("median efficiency (limit / fused), ⚖", "median_efficiency_balanced", ".3f"),
    ("rows faster than the physical limit (a bench bug; must be 0)", "beats_physical_limit", "d"),
    ("median efficiency against *beside*, ⚖", "median_efficiency_vs_beside_balanced", ".3f"),
    ("worst auto / unfused, all shapes", "worst_auto_over_unfused", ".2f"),
    ("auto / best fixed count, median", "median_auto_over_best_fixed", ".3f"),
    ("auto / best fixed count, worst", "worst_auto_over_best_fixed", ".3f"),
    ("auto / its own count timed as a fixed one, median", "median_auto_over_own_count", ".3f"),
]


def ops_summary_table(res: Results) -> str:
    name = "bench-ops-quick"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for label, field, spec in OPS_SUMMARY:
        vals = figures(runs, lambda r, f=field: r.data["meta"]["summary"][f])
        rows.append([label, each(vals, spec), med(vals, spec)])
    ok = figures(runs, lambda r: ("yes" if r.data["meta"]["summary"]["all_correct"] else "NO") + "; "
                 + ("yes" if r.data["meta"]["summary"]["fused_never_uses_more_memory"] else "no"))
    rows.append(["every result correct; fused memory ≤ plain", each(ok, ""), ""])
    head = ["figure"] + [f"runs {', '.join(str(r.k) for r in runs)}", "median"]
    return provenance(name, runs) + "\n\n" + table(head, rows)


def priority_table(res: Results) -> str:
    """bench ops under each PLAIT_COMM_PRIORITY, the runs taken in turns (results.sh rounds)."""
    settings = [("auto (default: nice -10 here)", "bench-ops-quick"),
                ("off", "comm-priority-off"), ("rt (SCHED_FIFO, the old default)", "comm-priority-rt")]
    rows, cmds, old = [], [], []
    for label, name in settings:
        runs = res.runs(name)
        if not runs:
            rows.append([label, "–", "–", "–", "–", "no run stored"])
            continue
        cmds.append(f"`{generic_command(runs)}`")
        if any("limit_kind" not in r.data["records"][0] for r in runs):
            old.append(label)
        eff = figures(runs, lambda r: r.data["meta"]["summary"]["median_efficiency_balanced"])
        spd = figures(runs, lambda r: r.data["meta"]["summary"]["median_speedup_balanced"])
        rows.append([label, each(eff, ".3f"), med(eff, ".3f"), each(spd, ".2f"), med(spd, ".2f"),
                     ", ".join(f"{when(r)} ({r.meta.get('wall_s', '?')} s)" for r in runs)])
    head = ["PLAIT_COMM_PRIORITY", "median efficiency, ⚖ shapes (each run)", "median",
            "median speedup, ⚖ (each run)", "median", "runs"]
    note = ("" if not old else "\n\nRuns of " + ", ".join(f"*{o}*" for o in old) + " predate issue 21's "
            "definitions: their efficiency is against the collective as measured, and their speedup "
            "against the one-call unfused path, so they compare with each other, not with the "
            "rows measured since.")
    return "Commands: " + "; ".join(cmds) + "\n\n" + table(head, rows) + note


# ---------------------------------------------------------------------------- simulate


def sim_table(res: Results) -> str:
    name = "simulate-h100-16k"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    cfg = runs[0].data["config"]
    base = lambda r: next(x for x in r.data["records"] if not x["fused"] and x["policy"] == "even")  # noqa: E731
    rows = []
    for rec0 in runs[0].data["records"]:
        def rec(run, f=rec0["fused"], p=rec0["policy"]):
            return next(x for x in run.data["records"] if x["fused"] == f and x["policy"] == p)
        step = figures(runs, lambda r: rec(r)["step_s"])
        speed = figures(runs, lambda r: base(r)["step_s"] / rec(r)["step_s"])
        rows.append(["fused" if rec0["fused"] else "unfused", rec0["policy"], each(step, ".2f"),
                     each(speed, ".3f"), each(figures(runs, lambda r: rec(r)["exposed_comm_share"]), ".1%"),
                     each(figures(runs, lambda r: rec(r)["wait_share"]), ".1%"),
                     each(figures(runs, lambda r: rec(r)["mfu"]), ".1%")])
    c, m, p = cfg["cluster"], cfg["model"], cfg["parallel"]
    gpus = c["gpus_per_node"] * c["nodes"]
    wall = figures(runs, lambda r: r.data["wall_s"])
    caption = (f"{gpus:,} × {c['gpu']} ({c['nodes']:,} nodes, {c['intra_link']} inside, {c['inter_link']} "
               f"between), {m['layers']}-layer transformer, hidden {m['hidden']}, sequence {m['seq_len']}; "
               f"tp {p['tp']} × dp {p['dp']}; no slow GPU in this preset, so the policies agree. "
               f"Simulating it took {each(wall, '.1f')} s here.")
    head = ["fusion", "policy", "step (s)", "× unfused, even", "exposed comm", "waiting", "MFU"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


# ---------------------------------------------------------------------------- bench tp


def tp_table(res: Results, name: str = "bench-tp-quick") -> str:
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    out = [provenance(name, runs)]
    for part, ref, unit in (("gpt", "pytorch-tp", "tokens/s"), ("hf-llama", "pytorch-tp", "tokens/s"),
                            ("dlrm", "torchrec", "samples/s")):
        recs0 = [x for x in runs[0].data["records"] if x.get("part", "gpt") == part]
        skipped = [x for x in recs0 if x.get("skipped")]
        if skipped:
            out.append(f"DLRM embeddings against TorchRec: skipped in run {runs[0].k} "
                       f"({skipped[0]['skipped'].split(':')[0]}); see below to install TorchRec.")
            continue
        if not recs0:
            continue
        key = f"speedup_vs_{ref.replace('-', '_')}"
        rows = []
        for rec0 in recs0:
            def rec(run, system=rec0["system"]):
                return next(x for x in run.data["records"]
                            if x["system"] == system and x.get("part", "gpt") == part)
            step = figures(runs, lambda r: rec(r)["t_step_s"] * 1e3)
            rate = figures(runs, lambda r: rec(r)["tokens_per_s"])
            speed = figures(runs, lambda r: rec(r)[key])
            diff = figures(runs, lambda r: rec(r)["max_loss_diff"])
            rows.append([rec0["system"], each(step, ".1f"), each(rate, ",.0f"), each(speed, ".2f"),
                         med(speed, ".2f"), each(diff, ".1e" if any(diff) else "g")])
        if part in ("gpt", "hf-llama"):
            m = recs0[0]["model"]
            kind = "GPT" if part == "gpt" else "transformers Llama"
            title = (f"{kind} {m['n_layer']} × {m['n_embd']}, {m['n_head']} heads, batch "
                     f"{m['batch_size']} × {m['seq_len']}")
            wire = figures(runs, lambda r: rec(r)["t_comm_link_s"] * 1e3)
            note = (f"The all-reduces alone take {med(wire, '.0f')} ms a step at the link rate: "
                    "the floor of the communication, which fusion can hide but not remove.")
        else:
            m = recs0[0].get("model", {})
            title = (f"DLRM embeddings, {m.get('tables', '?')} × {m.get('rows', '?'):,} × "
                     f"{m.get('dim', '?')}")
            note = ""
        comp = recs0[0].get("compare_steps", 5)
        head = [title, "step (ms)", unit, f"× {ref}", "median", f"max \\|Δloss\\|, {comp} steps"]
        out.append(table(head, rows) + ("\n\n" + note if note else ""))
    return "\n\n".join(out)


# ---------------------------------------------------------------------------- bench hetero


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


# ---------------------------------------------------------------------------- demo


def demo_table(res: Results) -> str:
    name = "demo"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for row0 in runs[0].data["summary"]:
        def row(run, system=row0["system"]):
            return next(x for x in run.data["summary"] if x["system"] == system)
        ms = lambda field: figures(runs, lambda r: row(r)[field] * 1e3)  # noqa: E731
        ratio = figures(runs, lambda r: row(r)["ratio_to_ideal"])
        rows.append([row0["system"], ("fused" if row0["overlap"] else "unfused") + ", " + row0["policy"],
                     each(ms("t_step_s"), ".1f"), each(ms("t_step_no_straggler_s"), ".1f"),
                     each(ms("t_ideal_s"), ".1f"), each(ratio, ".2f"),
                     each(figures(runs, lambda r: row(r)["tokens_per_s"]), ",.0f"),
                     each(figures(runs, lambda r: row(r)["heldout_loss"]), ".3f"),
                     each(figures(runs, lambda r: row(r)["decisions"]), "d")])
    speed = figures(runs, lambda r: next(x for x in r.data["summary"] if x["system"] == "plait")
                    ["speedup_vs_plain"])
    cfg = runs[0].data["config"]
    caption = (f"{runs[0].data['where']}; GPT {cfg['n_layer']} × {cfg['n_embd']} ({cfg['n_head']} heads), "
               f"{cfg['steps']} steps, the last rank {cfg['factor']:g} × slower from step "
               f"{cfg['slow_from']}. With the straggler plait runs {each(speed, '.2f')} × the plain "
               f"way (median {med(speed, '.2f')}).")
    head = ["system", "path, policy", "step (ms)", "no straggler", "ideal", "× ideal", "tokens/s",
            "held-out loss", "decisions"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


# ---------------------------------------------------------------------------- simulate --validate

VALIDATE_KINDS = {
    "published": "published figures (nccl-tests, Flux, SC'24, async-TP)",
    "local": "this machine: collectives and fused operators (fitted on other sizes and shapes)",
    "local-auto": "`chunks=\"auto\"` against the best fixed piece count",
}


def validate_table(res: Results) -> str:
    name = "simulate-validate"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for kind, label in VALIDATE_KINDS.items():
        err = figures(runs, lambda r, k=kind: r.data["summary"][k].get("rel_error"))
        n = figures(runs, lambda r, k=kind: r.data["summary"][k]["n"])
        ok = figures(runs, lambda r, k=kind: {True: "pass", False: "FAIL", None: "–"}[r.data["summary"][k]["pass"]])
        s0 = runs[0].data["summary"][kind]
        rows.append([label, each(n, "d"), s0.get("statistic", "–") + " rel. error",
                     each(err, ".1%"), med(err, ".1%"), fmt(s0["threshold"], ".0%"), each(ok, "")])
    head = ["check", "rows", "statistic", "result", "median", "limit", "verdict"]
    return provenance(name, runs) + "\n\n" + table(head, rows)


# ---------------------------------------------------------------------------- bench checkpoint


def _bracketed(run: Run, kind: str, key: str = "stall_s") -> str:
    """A run's median of one kind, every checkpoint's figure in brackets (ms)."""
    values = [r[key] * 1e3 for r in run.data["records"] if r["kind"] == kind]
    return f"{median(values):.0f} [{', '.join(f'{v:.0f}' for v in values)}]"


def checkpoint_table(res: Results) -> str:
    name = "bench-checkpoint"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for r in runs:
        s = r.data["meta"]["summary"]
        load = str(r.meta.get("loadavg_before", "?")).split()[0]
        rows.append([f"{r.k} ({load})", f"{s['plain_step_s'] * 1e3:.0f}",
                     _bracketed(r, "blocking"), _bracketed(r, "async"),
                     f"{s['blocking_over_async']:.1f}",
                     _bracketed(r, "async", "async_wait_s"),
                     f"{s['blocking_interval_extra_s'] * 1e3:.0f} / "
                     f"{s['async_interval_extra_s'] * 1e3:.0f}",
                     f"{s['checkpoint_bytes'] / 1e6:.0f}"])
    cfg, rec0 = runs[0].data["meta"]["config"], runs[0].data["records"][0]
    ratio = [r.data["meta"]["summary"]["blocking_over_async"] for r in runs]
    steps = f"{cfg['every']} step{'s' if cfg['every'] != 1 else ''}"
    caption = (f"GPT {cfg['n_layer']} × {cfg['n_embd']} ({cfg['n_head']} heads), batch "
               f"{cfg['batch_size']} × {cfg['seq_len']}, AdamW, {rec0['world_size']} ranks "
               f"(link: {rec0['link']}). Blocking and asynchronous checkpoints take turns, "
               f"{steps} after each. Every figure is the slowest rank's, in ms: "
               f"the median of the run's {cfg['checkpoints']} checkpoints of each kind, each "
               "checkpoint's in brackets. The blocking stall over the asynchronous one, run by "
               f"run: {each(ratio, '.1f')}.")
    head = ["run (load before)", "plain step", "blocking stall", "asynchronous stall",
            "blocking / async", f"async write left after {steps}",
            "interval extra, blocking / async", "checkpoint (MB)"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


# ---------------------------------------------------------------------------- README's headline


def _ops_summary(field):
    return lambda r: r.data["meta"]["summary"][field]


def _tp_speed(r):
    return next(x for x in r.data["records"] if x["system"] == "plait" and x.get("part", "gpt") == "gpt"
                )["speedup_vs_pytorch_tp"]


def _tp_speed_of(part):
    return lambda r: next(x for x in r.data["records"] if x["system"] == "plait"
                          and x.get("part") == part)["speedup_vs_pytorch_tp"]


def _collective_share(r):
    top = max(x["bytes"] for x in r.data["records"] if x["collective"] == "all_reduce")
    x = next(x for x in r.data["records"] if x["collective"] == "all_reduce" and x["bytes"] == top)
    return x["busbw_GBps"] * 1e9 / rate_Bps(x["link"])


def _hetero(policy):
    return lambda r: next(x for x in r.data["meta"]["table"]
                          if x["scenario"] == "straggler-2x" and x["policy"] == policy)["ratio_to_ideal"]


def _sim_speed(r):
    rec = {(x["fused"], x["policy"]): x["step_s"] for x in r.data["records"]}
    return rec[(False, "even")] / rec[(True, "even")]


def _checkpoint_stalls(r):
    s = r.data["meta"]["summary"]
    return (s["async_stall_s"] * 1e3, s["blocking_stall_s"] * 1e3)


def _placements(key):
    """A bench tp --dp run's (tp inside a host, tp across hosts) figure, in ms."""
    def get(r):
        by = {x["placement"]: x[key] for x in r.data["records"] if x.get("part") == "placement"
              and x["system"] == "plait"}
        return (by["tp-inside-host"] * 1e3, by["tp-across-hosts"] * 1e3)
    return get


def placement_table(res: Results) -> str:
    """bench tp --dp 2 --tp 2: each run's two placements, measured and predicted."""
    name = "bench-tp-dp"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for r in runs:
        load = str(r.meta.get("loadavg_before", "?")).split()[0]
        for x in (x for x in r.data["records"] if x.get("part") == "placement"):
            p = x["prediction"]
            rows.append([f"{r.k} ({load})", x["system"], x["placement"], f"{x['tp_groups']}",
                         x["across_hosts"], f"{x['t_step_s'] * 1e3:.0f}",
                         f"{x['predicted_step_s'] * 1e3:.0f}",
                         f"{p['compute_s'] * 1e3:.0f} + {(p['tp_part_s'] - p['compute_s']) * 1e3:.0f}"
                         f" + {p['dp_exposed_s'] * 1e3:.0f}",
                         f"{x['max_loss_diff_timed']:.1e}"])
    x = next(x for x in runs[0].data["records"] if x.get("part") == "placement")
    m = x["model"]
    caption = (f"GPT {m['n_layer']} × {m['n_embd']} ({m['n_head']} heads), global batch "
               f"{m['batch_size']} × {m['seq_len']}, dp {x['dp']} × tp {x['tp']} on "
               f"{x.get('hosts', 0)} emulated hosts ({x['link']}), tp by plait (fused), dp by "
               f"{x['dp_kind']}; median step over the timed steps, the placements' steps "
               "interleaved. Predicted: `plait.perf.placement` (`plait simulate --placements "
               "RUN.json`): compute at the rate measured for the model's step on a rank's "
               "tokens, tp all-reduces and dp gradient traffic on the links they cross.")
    head = ["run (load before)", "system", "placement", "tp groups", "across the slow link",
            "step (ms)", "predicted (ms)", "= compute + tp comm + dp exposed",
            "max \\|Δloss\\| between placements"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


def load_table(res: Results) -> str:
    """bench load: each run's ranks, their peak memory against the bound, the loss."""
    name = "bench-load"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for r in runs:
        for x in r.data["records"]:
            rows.append([str(r.k), x["system"], str(x["world"]), str(x.get("rank", "–")),
                         " ".join(map(str, x.get("kv_groups", []))) or "–",
                         f"{x['baseline_rss'] / 1e9:.2f}",
                         f"{x.get('own_bytes', x['model_bytes']) / 1e9:.2f}",
                         f"{x['peak_rss'] / 1e9:.2f}", f"{x['bound_rss'] / 1e9:.2f}",
                         f"{x['loss_diff']:.1e}"])
    s0 = runs[0].data["meta"]["summary"]
    m = s0["model"]
    caption = (f"A transformers Llama of {s0['model_bytes'] / 1e9:.2f} GB float32 ({m['num_hidden_layers']} "
               f"layers × {m['hidden_size']}, {m['num_attention_heads']} heads over "
               f"{m['num_key_value_heads']} KV heads, vocabulary {m['vocab_size']}), saved with "
               f"`save_pretrained` in {s0['files']} files; `whole`: transformers' own "
               "`from_pretrained` in one process (it maps the files and reads pages only as the "
               "forward touches them), `plait`: `plait.from_pretrained` on each rank. Peak = "
               "the process's peak resident memory (VmHWM) through the load and one forward, "
               "before = resident before loading, "
               "bound = 0.6 × the model's bytes + 0.5 GB; Δ loss against `whole`.")
    head = ["run", "system", "ranks", "rank", "KV groups", "before (GB)", "own tensors (GB)",
            "peak (GB)", "bound (GB)", "Δ loss"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


def _load_peak(world):
    """(the largest rank's peak, the bound) in GB, on ``world`` ranks."""
    def get(r):
        peaks = [x["peak_rss"] for x in r.data["records"] if x["system"] == "plait"
                 and x["world"] == world]
        return (max(peaks) / 1e9, r.data["meta"]["summary"]["bound_rss"] / 1e9)
    return get


# ---------------------------------------------------------------------------- transports


def shm_collectives_table(res: Results) -> str:
    """bench collectives --transport shm,gloo: per collective at the smallest and largest
    size, each transport's median time a run, gloo over shm, and shm's bus bandwidth over one
    core's copy bandwidth measured in the same run."""
    name = "bench-collectives-shm"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    recs = runs[0].data["records"]
    sizes = sorted({r["bytes"] for r in recs})
    rows = []
    for coll in dict.fromkeys(r["collective"] for r in recs):
        for nbytes in (sizes[0], sizes[-1]):
            def pick(run, t, coll=coll, nbytes=nbytes):
                return next((x for x in run.data["records"] if x["collective"] == coll
                             and x["bytes"] == nbytes and x["transport"] == t), None)
            shm = figures(runs, lambda r: pick(r, "shm")["time_us"])
            gloo = figures(runs, lambda r: pick(r, "gloo")["time_us"])
            ratio = [g / s if g and s else None for g, s in zip(gloo, shm)]
            copy = figures(runs, lambda r: pick(r, "shm")["busbw_over_copy"])
            wrong = figures(runs, lambda r: pick(r, "shm")["wrong"] + pick(r, "gloo")["wrong"])
            size = f"{nbytes / 2**10:.0f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.0f} MiB"
            rows.append([coll, size, each(shm, ".1f"), each(gloo, ".1f"), each(ratio, ".1f"),
                         each(copy, ".0%"), each(wrong, "d")])
    caption = ("2 ranks on this host, the transports taking turns at every size; time: the "
               "median of the timed iterations (µs); busbw / copy: shared memory's bus "
               "bandwidth over one core's `memcpy` of the same bytes, timed in the same run "
               "(the limit on one host).")
    head = ["collective", "size", "shm (µs)", "gloo (µs)", "gloo / shm", "shm busbw / copy",
            "#wrong"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


def shm_ops_table(res: Results) -> str:
    """bench ops --transport shm,gloo: per run, each transport's worst chunks="auto" over
    the unfused path, shm's median efficiency against the one-host limit, and gloo's
    unfused time over shm's fused one (median over shapes)."""
    name = "bench-ops-shm"
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for r in runs:
        s = r.data["meta"]["summary"]
        recs = r.data["records"]
        shm = [x for x in recs if x["transport"] == "shm"]
        eff = [x["efficiency"] for x in shm if x.get("efficiency") is not None]
        above = sum(1 for x in shm if x.get("beats_limit"))
        wrong = sum(1 for x in recs if not x.get("correct", True))
        rows.append([str(r.k), fmt(s["shm"]["worst_auto_over_unfused"], ".2f"),
                     fmt(s["gloo"]["worst_auto_over_unfused"], ".2f"),
                     fmt(median(eff), ".2f") if eff else "–", str(above),
                     fmt(s["gloo_unfused_over_shm_fused_median"], ".2f"),
                     fmt(s.get("gloo_unfused_over_shm_limit_median"), ".2f"),
                     fmt(s.get("gloo_unfused_over_shm_compute_median"), ".2f"),
                     str(wrong),
                     str(len(shm))])
    caption = ("2 ranks on this host, every shape on both transports in turns. Worst auto / "
               "unfused: over shapes, the largest median over rounds of the "
               "`chunks=\"auto\"` time over the unfused path's timed in the same round; "
               "efficiency: the one-host limit (the compute's fastest round plus "
               "one core's copy of the bytes: the core that computes moves them) over the "
               "fused time, median over shapes; "
               "above limit: shapes timed faster than it; gloo unfused / shm fused: median "
               "over shapes; at most: gloo's unfused time over shm's limit, median over "
               "shapes (a bound: no round beats the limit); were the collective free: gloo's "
               "unfused time over shm's compute alone in its median round, the statistic the "
               "fused time is, median over shapes: what the fused time reaches with a "
               "collective costing nothing (below 'at most', which takes the fastest round).")
    head = ["run", "shm: worst auto / unfused", "gloo: worst auto / unfused",
            "shm: median efficiency", "shm: above limit", "gloo unfused / shm fused",
            "at most", "were the collective free", "#wrong", "shapes"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


# ---------------------------------------------------------------------------- decoding


def decode_table(res: Results, name: str) -> str:
    """bench decode: every run's systems and batch sizes, per-token latency against one
    process, the capacity ideal where measured, and whether the tokens were one process's."""
    runs = res.runs(name)
    if not runs:
        return provenance(name, runs)
    rows = []
    for r in runs:
        timed = [x for x in r.data["records"] if "batch" in x]
        one = {x["batch"]: x["ms_per_token"] for x in timed if x["system"] == "one-process"}
        for x in timed:
            vs = x["ms_per_token"] / one[x["batch"]] if x["batch"] in one else None
            split = x.get("split", {}).get("sizes")
            rows.append([str(r.k), x["system"], str(x["batch"]), str(x["ranks_used"]),
                         str(x.get("threads", "–")),
                         x["transport"], f"{x['ms_per_token']:.2f}", f"{x['p99_ms']:.2f}",
                         f"{x['ttft_ms']:.1f}", f"{x['tokens_per_s']:,.0f}",
                         fmt(vs, ".2f") + ("×" if vs is not None else ""),
                         f"{x['ratio_to_ideal']:.2f}×" if "ratio_to_ideal" in x else "–",
                         "; ".join(f"{d} {'/'.join(map(str, v))}" for d, v in {
                             d.rsplit(".", 1)[-1]: v for d, v in split.items()}.items())
                         if split else "–",
                         {True: "yes", False: "**no**", None: "–"}[x["same_tokens"]]])
    c = runs[0].data["meta"]
    caption = (f"Where: {c.get('where', '–')}. Per-token latency: the median over every "
               "round's decoding steps, a step taking as long as its slowest rank; threads: "
               "in all (one process: as many as the ranks use cores); × one process: against "
               "the whole model on one rank (eager) in the same run; -compiled: a static KV "
               "cache and the step compiled; × ideal: "
               "against the capacity ideal (the even split's step less its slowest rank's "
               "compute in the split layers, plus all that work at the ranks' summed "
               "speeds).")
    head = ["run", "system", "batch", "ranks", "threads", "transport", "ms / token", "p99 ms",
            "TTFT ms",
            "tokens/s", "× one process", "× ideal", "split (KV groups / MLP columns)",
            "same tokens"]
    return provenance(name, runs) + "\n\n" + caption + "\n\n" + table(head, rows)


def _shm_4k(r):
    """(shm, gloo) median time of a 4 KiB all_reduce, µs."""
    def t(name):
        return next(x["time_us"] for x in r.data["records"] if x["collective"] == "all_reduce"
                    and x["bytes"] == 4096 and x["transport"] == name)
    return (t("shm"), t("gloo"))


def _decode_b1(r):
    """(plait-compiled, one-process-compiled) ms per token at batch 1 (the process on every
    core the ranks use)."""
    def t(name):
        return next(x["ms_per_token"] for x in r.data["records"] if x.get("batch") == 1
                    and x["system"] == name)
    return (t("plait-compiled"), t("one-process-compiled"))


# (what, results folder, how to read a run's figure, format, where the full table is); a
# figure that is a pair (a, b) reads "a vs b", each with its own range
HEADLINE = [
    ("Fused operators: median speedup over the best compute-then-collective (one call or the "
     "same pieces without overlap), ⚖ shapes (2 ranks, 1 Gbit/s)",
     "bench-ops-quick", _ops_summary("median_speedup_balanced"), ".2f", "×", "benchmarks.md#fused-operators-plait-bench-ops"),
    ("… over compute, then one collective call (pieces and overlap together), ⚖ shapes",
     "bench-ops-quick", _ops_summary("median_speedup_one_call_balanced"), ".2f", "×", "benchmarks.md#fused-operators-plait-bench-ops"),
    ("Fused operators: median efficiency (physical limit / fused time), ⚖ shapes",
     "bench-ops-quick", _ops_summary("median_efficiency_balanced"), ".2f", "", "benchmarks.md#fused-operators-plait-bench-ops"),
    ("GPT training step, plait against PyTorch TP (DTensor), same losses",
     "bench-tp-quick", _tp_speed, ".2f", "×", "benchmarks.md#plait-against-pytorch-tp-plait-bench-tp"),
    ("A transformers Llama (GQA) training step, plait against PyTorch TP (DTensor), same plan "
     "and losses", "bench-tp-hf-llama-quick", _tp_speed_of("hf-llama"), ".2f", "×",
     "benchmarks.md#plait-against-pytorch-tp-plait-bench-tp"),
    ("A 2 × straggler made by sleeping: step time / ideal, even shards (no balancing; median "
     "of 3 seeds a run)", "bench-hetero", _hetero("even"), ".2f", "×",
     "results/balancing.md#measured-plait-bench-hetero"),
    ("A 2 × straggler made by sleeping: step time / ideal, `semi` balancer (median of 3 seeds "
     "a run; each seed's in the docs)", "bench-hetero", _hetero("semi"), ".2f", "×",
     "results/balancing.md#measured-plait-bench-hetero"),
    ("… the same straggler made by the kernel (a host at half its CPU budget), `semi`",
     "bench-hetero-kernel", _hetero("semi"), ".2f", "×",
     "results/balancing.md#slow-hosts-made-by-the-kernel---slow-by-kernel"),
    ("The demo: plait (fused, `semi`) against plain TP with a straggler, step speed",
     "demo", lambda r: next(x for x in r.data["summary"] if x["system"] == "plait")["speedup_vs_plain"],
     ".2f", "×", "benchmarks.md#the-demo-plait-demo"),
    ("Elastic: 3 hosts, host 2 killed at step 20 of 60: kill → first step on the 2 survivors",
     "elastic-kill", lambda r: r.data["meta"]["summary"]["recovery_s"], ".1f", "s", "elastic.md"),
    ("… steps lost (checkpoint every 5), and held-out loss against the uninterrupted run",
     "elastic-kill", lambda r: (f'{r.data["meta"]["summary"]["steps_lost"]} lost; '
                                f'{100 * r.data["meta"]["summary"]["heldout_loss_diff"]:+.2f} %'),
     "", "", "elastic.md"),
    ("Checkpoint stall, asynchronous vs blocking save (bench tp's GPT; median of 5 "
     "checkpoints of each kind)", "bench-checkpoint", _checkpoint_stalls, ".0f", "ms",
     "checkpoints.md#the-stall-measured-plait-bench-checkpoint"),
    ("dp 2 × tp 2 on 2 hosts: step with tp inside a host vs tp across hosts, measured",
     "bench-tp-dp", _placements("t_step_s"), ".0f", "ms",
     "benchmarks.md#two-placements-of-dp--tp-bench-tp---dp-2---tp-2"),
    ("… the same two placements, predicted by plait's performance model",
     "bench-tp-dp", _placements("predicted_step_s"), ".0f", "ms",
     "benchmarks.md#two-placements-of-dp--tp-bench-tp---dp-2---tp-2"),
    ("A 2.1 GB transformers Llama built on meta, each of 2 ranks reading its shards: peak "
     "resident memory of the largest rank vs the bound (0.6 × model + 0.5 GB), same loss",
     "bench-load", _load_peak(2), ".2f", "GB", "loading.md#memory-measured-plait-bench-load"),
    ("2 ranks on one host: a 4 KiB all_reduce on shared memory vs gloo (loopback TCP)",
     "bench-collectives-shm", _shm_4k, ".1f", "µs", "transport.md#figures"),
    ("Decoding a transformers Llama (4 × 512, batch 1, static KV cache, compiled) on 2 ranks "
     "of one host vs one process on both cores, compiled alike, same tokens", "bench-decode",
     _decode_b1, ".2f", "ms/token", "decoding.md#figures"),
    ("Emulated link: all_reduce bus bandwidth / link rate, 16 MiB",
     "bench-collectives-quick", _collective_share, ".0%", "", "benchmarks.md#collectives-plait-bench-collectives"),
    ("Model: median error against this machine's measurements",
     "simulate-validate", lambda r: r.data["summary"]["local"]["rel_error"], ".1%", "", "simulator.md#validation"),
    ("Model, not measured: fused speedup predicted for Llama 3 70B on 16,384 H100s",
     "simulate-h100-16k", _sim_speed, ".2f", "×", "simulator.md#a-16384-gpu-cluster"),
]


def user_command(cmd: str) -> str:
    """The command as a reader types it: without the flags that only store the run."""
    cmd = re.sub(r" --no-progress", "", cmd)
    cmd = re.sub(r" --json \S+", "", cmd)
    cmd = re.sub(r" --out \S+", "", cmd)
    cmd = re.sub(r" --measurements( docs/results/\S+)+", " --measurements …", cmd)
    return cmd


def span(values: list, spec: str) -> str:
    """The range of ``values``: ``1.01–1.08``, or one figure where the ends agree."""
    lo, hi = fmt(min(values), spec), fmt(max(values), spec)
    return lo if lo == hi else f"{lo}–{hi}"


def headline_table(res: Results) -> str:
    """One row per headline figure; its value only once two runs have it (before that the row
    says how many runs there are, and the figure stays in docs/ alone)."""
    rows = []
    for what, name, get, spec, unit, where in HEADLINE:
        runs = res.runs(name)
        vals = [v for v in figures(runs, get) if v is not None]
        command = f"`{user_command(runs[-1].meta['command'])}`" if runs else f"`scripts/results.sh --only {name}`"
        if len(vals) < MIN_RUNS_README:
            rows.append([f"[{what}]({where})", f"awaiting a second run ({len(vals)} so far)", "–",
                         command, when(runs[-1])[:10] if runs else "–"])
            continue
        unit = f" {unit}" if unit else ""
        if isinstance(vals[0], tuple):  # a pair: each part's range, "a vs b"
            rng = " vs ".join(span([v[i] for v in vals], spec) + unit for i in range(2))
            every = ", ".join(" vs ".join(fmt(x, spec) for x in v) for v in vals)
        else:
            rng, every = span(vals, spec) + unit, each(vals, spec)
        rows.append([f"[{what}]({where})", f"**{rng}**", every, command, when(runs[-1])[:10]])
    return table(["figure", "range", "every run", "command", "date"], rows)


# ---------------------------------------------------------------------------- the registry

GENERATORS: dict[str, Callable[[Results], str]] = {
    "bench-load": load_table,
    "bench-collectives-quick": collectives_table,
    "bench-ops-quick": ops_table,
    "bench-ops-quick-summary": ops_summary_table,
    "comm-priority": priority_table,
    "simulate-h100-16k": sim_table,
    "simulate-validate": validate_table,
    "bench-tp-quick": tp_table,
    "bench-tp-hf-llama-compile": lambda res: tp_table(res, "bench-tp-hf-llama-compile"),
    "bench-hetero-quick": hetero_table,
    **{name: (lambda res, name=name: hetero_table(res, name)) for name in (
        "bench-hetero", "bench-hetero-kernel", "bench-hetero-graded", "bench-hetero-graded-kernel",
        "bench-hetero-drift", "bench-hetero-jitter", "bench-hetero-moving", "bench-hetero-two",
        "bench-hetero-noisy")},
    "demo": demo_table,
    "bench-checkpoint": checkpoint_table,
    "bench-tp-dp": placement_table,
    "bench-collectives-shm": shm_collectives_table,
    "bench-ops-shm": shm_ops_table,
    **{name: (lambda res, name=name: decode_table(res, name)) for name in (
        "bench-decode", "bench-decode-3", "bench-decode-slow", "bench-decode-hosts")},
    "headline": headline_table,
}


# ---------------------------------------------------------------------------- rewriting


def rebase_links(text: str, doc: Path, root: Path) -> str:
    """Generators write links as seen from docs/; a file elsewhere gets them rebased."""
    if doc.parent == root / "docs":
        return text
    if doc.parent == root / "docs" / "results":  # a results page, beside the runs' folders

        def beside(m: re.Match) -> str:
            target = m[1]
            return f"]({target[len('results/'):]})" if target.startswith("results/") \
                else f"](../{target})"
        return re.sub(r"\]\((?!https?:|#|/)([^)]+)\)", beside, text)
    return re.sub(r"\]\((?!https?:|#|/)([^)]+)\)", r"](docs/\1)", text)


def render(doc_text: str, doc: Path, root: Path, res: Results) -> str:
    def one(m: re.Match) -> str:
        key = m[2]
        if key not in GENERATORS:
            raise SystemExit(f"{doc.relative_to(root)}: unknown generated region {key!r} "
                             f"(known: {', '.join(sorted(GENERATORS))})")
        body = rebase_links(GENERATORS[key](res), doc, root).rstrip("\n")
        return f"{m[1]}{body}\n{m[4]}"
    return REGION.sub(one, doc_text)


def documents(root: Path) -> list[Path]:
    out = []
    for pattern in DOCS:
        out += sorted(root.glob(pattern))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a region is stale")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    ap.add_argument("--list", action="store_true", help="list the region keys")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(sorted(GENERATORS)))
        return 0
    root = args.root.resolve()
    res = Results(root / "docs" / "results")
    stale = []
    for doc in documents(root):
        old = doc.read_text()
        new = render(old, doc, root, res)
        if new == old:
            continue
        stale.append(doc)
        if args.check:
            rel = str(doc.relative_to(root))
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       rel, rel + " (from the JSON)", n=1))
        else:
            doc.write_text(new)
            print(f"rewrote {doc.relative_to(root)}")
    if args.check and stale:
        print(f"\n{len(stale)} file(s) differ from docs/results/: run python scripts/docs_tables.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
