"""``plait demo``: one rank turns slow part-way through training; the plain way against plait.

Every rank trains the same small GPT (same seed, same batches) four times in
one launch: the plain baseline (unfused operators, even shards, what Megatron
and PyTorch tensor parallelism do) and plait (fused operators, the ``semi``
balancer), each once without a straggler (the reference for its ideal) and
once with rank ``slow_rank`` (default the last) turning ``factor`` × slower at
``slow_from`` (``--slow RANK:FACTOR@FROM``, as ``train`` and ``generate`` take it). The end:
a side-by-side table (median step time after the slowdown, tokens/s, ratio to
the capacity-proportional ideal, held-out loss and accuracy) and a report
folder with the step-time plot, the loss curves, the balancer's decisions and
an HTML page (:mod:`plait.bench.demo_report`).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch
import torch.distributed as dist

from ..balance import PolicyConfig
from ..runtime import rank_context
from ..runtime.placement import LOOPBACK
from ..runtime.slow.straggler import SlowSpec
from ..runtime.timing import balanced_round
from ..training.data import CharCorpus
from .balanced_run import BalancedRun
from .config.demo import QUICK_DEMO, WARMUP_STEPS, DemoConfig
from .hetero_ideal import ideal_step
from ..runtime.slow.scenarios import factors_at

__all__ = ["DemoConfig", "SYSTEMS", "QUICK_DEMO", "WARMUP_STEPS", "LOOPBACK", "run_demo", "demo",
           "summarize_demo"]

SYSTEMS = {"plain": (False, "even"), "plait": (True, "semi")}  # overlap, policy


def run_demo(cfg: DemoConfig) -> list[dict]:
    """What each rank runs: per system, a run without and one with the straggler, the four
    interleaved step by step (in balanced orders, each step started together), so that the
    load of a shared machine drifting hits them alike.

    Besides the step times (the slowest rank's), each record holds ``rank_compute_s``: per
    rank, per step, the compute the speed monitor timed (CPU: the thread's time plus the
    emulated slowness, so the machine's other load barely shows; CUDA: counted at the
    monitor's exchanges, every other step). It shows what the balancer sees and evens out."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    corpus = CharCorpus.load()
    report = rank_context().report
    slow = [SlowSpec(rank=cfg.slowed(world), factor=cfg.factor, from_step=cfg.slow_from)]
    runs = []
    for system, (overlap, policy) in SYSTEMS.items():
        for scenario, specs in (("none", []), ("slow", slow)):
            name = policy if scenario == "slow" else "even"
            policy_cfg = PolicyConfig(name=name, spike_steps=cfg.spike_steps,
                                      confirm_steps=cfg.confirm_steps)
            runs.append((system, scenario, name, overlap, specs,
                         BalancedRun(cfg.train_config(overlap), policy_cfg, specs, corpus)))
    compute = {id(run): [] for *_, run in runs}  # this rank's timed compute, step by step
    for step in range(cfg.steps):
        for i, (system, scenario, *_, run) in enumerate(balanced_round(runs, step)):
            before = run.balancer.monitor.compute_s
            run.step(step)
            compute[id(run)].append(run.balancer.monitor.compute_s - before)
            if rank == 0:
                report({"system": system, "scenario": scenario, "step": step,
                        "run": step * len(runs) + i, "of": cfg.steps * len(runs)})
    out = []
    for system, scenario, name, overlap, specs, run in runs:
        result = run.finish()
        ranks_compute = [None] * world
        dist.all_gather_object(ranks_compute, compute[id(run)])
        out.append({"system": system, "scenario": scenario, "policy": name,
                    "overlap": overlap, "world_size": world, "times": result["times"],
                    "rank_compute_s": ranks_compute,
                    "losses": result["losses"], "eval": result["eval"],
                    "compute_s_per_step": result["compute_s_per_step"],
                    "decisions": result["decisions"], "final_state": result["final_state"],
                    "monitor_s": result["monitor_s"],
                    "factors": [factors_at(specs, world, s) for s in range(cfg.steps)],
                    "link": cfg.extra.get("link", "loopback")})
    return out


def summarize_demo(records: list[dict], cfg: DemoConfig) -> list[dict]:
    """Per system: median step time after the slowdown (its first ``WARMUP_STEPS`` steps left
    out), the ideal there, tokens/s, held-out figures, and the same run without the straggler
    (median from step ``WARMUP_STEPS``)."""
    rows = []
    tokens = cfg.batch_size * cfg.seq_len
    after = slice(cfg.slow_from + WARMUP_STEPS, cfg.steps)
    for system in SYSTEMS:
        none = next(r for r in records if r["system"] == system and r["scenario"] == "none")
        slow = next(r for r in records if r["system"] == system and r["scenario"] == "slow")
        t_none = statistics.median(none["times"][WARMUP_STEPS:])
        c = none["compute_s_per_step"]
        ideal = statistics.median(ideal_step(t_none, c, f) for f in slow["factors"][after])
        t_slow = statistics.median(slow["times"][after])
        rows.append({"system": system, "policy": slow["policy"], "overlap": slow["overlap"],
                     "t_step_no_straggler_s": t_none, "t_step_s": t_slow, "t_ideal_s": ideal,
                     "ratio_to_ideal": t_slow / ideal, "tokens_per_s": tokens / t_slow,
                     "heldout_loss": slow["eval"]["heldout_loss"],
                     "heldout_acc": slow["eval"]["heldout_accuracy"],
                     "heldout_loss_no_straggler": none["eval"]["heldout_loss"],
                     "decisions": len(slow["decisions"]), "link": slow["link"],
                     "world_size": slow["world_size"]})
    plain, plait = rows
    plait["speedup_vs_plain"] = plain["t_step_s"] / plait["t_step_s"]
    return rows


def demo(cfg: DemoConfig, *, ranks: int, hosts: int = 0, link: str | None = "1gbit",
         timeout_s: float | None = None, on_progress=None) -> tuple[list[dict], str]:
    """Run the demo on ``ranks`` ranks: on an emulated cluster of ``hosts`` hosts with
    ``link`` links, or on loopback (``hosts=0``); rank 0's records and where they ran."""
    from ..runtime.placement import run_placed

    cfg = replace(cfg)
    if ranks < 2:
        raise ValueError("the demo needs at least 2 ranks (one of them turns slow)")
    if cfg.n_head < ranks:
        raise ValueError(f"--n-head {cfg.n_head} gives some of the {ranks} ranks no head")
    records, where = run_placed(run_demo, cfg, ranks=ranks, hosts=hosts, link=link,
                                timeout_s=timeout_s, on_progress=on_progress)
    return records, where if hosts else LOOPBACK
