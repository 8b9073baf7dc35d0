"""README's headline table: one row per figure, its range over the stored runs, once two
runs have it."""

from __future__ import annotations

import re

from .runs import Results, each, figures, fmt, rate_Bps, table, when

MIN_RUNS_README = 2


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


def _load_peak(world):
    """(the largest rank's peak, the bound) in GB, on ``world`` ranks."""
    def get(r):
        peaks = [x["peak_rss"] for x in r.data["records"] if x["system"] == "plait"
                 and x["world"] == world]
        return (max(peaks) / 1e9, r.data["meta"]["summary"]["bound_rss"] / 1e9)
    return get


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
