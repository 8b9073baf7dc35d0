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
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..balance import PolicyConfig
from ..runtime import rank_context
from ..runtime.fields import help_meta as _h
from ..runtime.placement import LOOPBACK
from ..runtime.straggler import SlowSpec
from ..runtime.timing import balanced_round
from ..training.config import TrainConfig
from ..training.data import CharCorpus
from .balanced_run import BalancedRun
from .hetero_ideal import ideal_step
from .scenarios import factors_at

__all__ = ["DemoConfig", "SYSTEMS", "QUICK_DEMO", "WARMUP_STEPS", "LOOPBACK", "run_demo", "demo",
           "summarize_demo"]

SYSTEMS = {"plain": (False, "even"), "plait": (True, "semi")}  # overlap, policy
WARMUP_STEPS = 3  # left out of every median: the first steps pay for allocation and calibration
# ``plait demo --quick``: about a minute on two cores, set-up included; the balancer still
# resizes, then migrates, and 12 steps after its warm-up give the medians. chunks=2 is what
# auto picks for these shapes on 1 Gbit/s links, and skips the calibration auto runs first
# (18-28 s of a busy 2-core machine: a third of the minute).
QUICK_DEMO = dict(steps=20, slow_from=5, spike_steps=8, n_layer=1, n_embd=256, n_head=8,
                  batch_size=8, chunks="2")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    steps: int = field(default=60, metadata=_h("training steps per run"))
    # --slow RANK:FACTOR@FROM sets these three (cli.demo); slow_rank None: the last rank
    slow_from: int = 15
    factor: float = 2.0
    slow_rank: int | None = None
    n_layer: int = field(default=2, metadata=_h("transformer blocks"))
    n_head: int = field(default=16, metadata=_h("attention heads"))
    n_embd: int = field(default=512, metadata=_h("model width"))
    seq_len: int = field(default=64, metadata=_h("characters per sequence"))
    batch_size: int = field(default=16, metadata=_h("sequences per step"))
    lr: float = field(default=3e-3, metadata=_h("peak learning rate of AdamW"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data order"))
    confirm_steps: int = field(default=3, metadata=_h(
        "act on an imbalance once it has lasted this many steps (3: two of the monitor's "
        "readings, so one noisy reading of a shared machine passes)"))
    chunks: str = field(default="auto", metadata=_h(
        "pieces per fused operator: auto (calibrated on the ranks once, at the first fused "
        "step: seconds) or a number"))
    spike_steps: int = field(default=12, metadata=_h(
        "semi: steps an imbalance must last to be migrated (before that: resized)"))
    out: str = field(default="reports/demo", metadata=_h("report folder"))
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < WARMUP_STEPS + 2:
            raise ValueError(f"--steps must be at least {WARMUP_STEPS + 2} (a {WARMUP_STEPS}-step "
                             f"warm-up, then steps before and after the straggler), got {self.steps}")
        if not 0 < self.slow_from < self.steps - WARMUP_STEPS:
            raise ValueError(f"--slow …@{self.slow_from}: the step the rank turns slow must be "
                             f"above 0 and leave steps after its {WARMUP_STEPS}-step warm-up in "
                             f"--steps {self.steps} (at most {self.steps - WARMUP_STEPS - 1})")
        if not self.factor > 1.0:
            raise ValueError(f"--slow RANK:{self.factor:g}: the factor must be above 1 (a slower "
                             "rank)")
        self.train_config(True).gpt_config(97)
        PolicyConfig(spike_steps=self.spike_steps, confirm_steps=self.confirm_steps)  # refuse early


    def slowed(self, world: int) -> int:
        """The rank that turns slow on ``world`` ranks."""
        return world - 1 if self.slow_rank is None else self.slow_rank
    def train_config(self, overlap: bool) -> TrainConfig:
        return TrainConfig(model="gpt", steps=self.steps, batch_size=self.batch_size, lr=self.lr,
                           seq_len=self.seq_len, n_layer=self.n_layer, n_head=self.n_head,
                           n_embd=self.n_embd, overlap=overlap, seed=self.seed, eval_batches=8,
                           chunks=self.chunks)


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
