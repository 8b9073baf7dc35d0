"""Tables of the collectives and fused operators: bench collectives and bench ops on the
emulated link, each PLAIT_COMM_PRIORITY, and both again on shared memory against gloo."""

from __future__ import annotations

import json
from statistics import median

from .runs import (Results, each, figures, fmt, generic_command, med, provenance, rate_Bps, table,
                   when)


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
