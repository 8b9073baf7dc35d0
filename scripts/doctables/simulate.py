"""Tables of plait's performance model: a simulated 16,384-GPU cluster, and the model's
error against published figures and this machine's measurements."""

from __future__ import annotations

from .runs import Results, each, figures, fmt, med, provenance, table


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
