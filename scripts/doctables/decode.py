"""The table of decoding (bench decode): per-token latency against one process."""

from __future__ import annotations

from .runs import Results, fmt, provenance, table


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
