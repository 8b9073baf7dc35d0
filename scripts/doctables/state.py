"""Tables of a model's state: checkpoint stalls (bench checkpoint) and loading a model's
shards on each rank (bench load)."""

from __future__ import annotations

from statistics import median

from .runs import Results, Run, each, provenance, table


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
