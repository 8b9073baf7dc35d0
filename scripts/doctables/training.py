"""Tables of training steps: plait against PyTorch TP (bench tp), the demo's straggler, and
two placements of dp × tp (bench tp --dp)."""

from __future__ import annotations

from .runs import Results, each, figures, med, provenance, table


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
