"""``plait demo``: one rank turns slow part-way through training; the plain way against plait.

Every rank trains the same small GPT (same seed, same batches) four times in
one launch: the plain baseline (unfused operators, even shards, what Megatron
and PyTorch tensor parallelism do) and plait (fused operators, the ``semi``
balancer), each once without a straggler (the reference for its ideal) and
once with the last rank turning ``factor`` × slower at ``slow_from``. The end:
a side-by-side table (median step time after the slowdown, tokens/s, ratio to
the capacity-proportional ideal, held-out loss and accuracy) and a report
folder with the step-time plot, the loss curves, the balancer's decisions and
an HTML page.
"""

from __future__ import annotations

import html
import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ._fields import help_meta as _h
from .balance import PolicyConfig
from .bench.hetero import BalancedRun, factors_at, ideal_step
from .data import CharCorpus
from .runtime import rank_context
from .runtime.straggler import SlowSpec
from .runtime.timing import balanced_round
from .train import TrainConfig

__all__ = ["DemoConfig", "SYSTEMS", "run_demo", "demo", "summarize_demo", "write_demo_report"]

SYSTEMS = {"plain": (False, "even"), "plait": (True, "semi")}  # overlap, policy



@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    steps: int = field(default=60, metadata=_h("training steps per run"))
    slow_from: int = field(default=15, metadata=_h("the step the last rank turns slow"))
    factor: float = field(default=2.0, metadata=_h("how many times slower it turns"))
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
    spike_steps: int = field(default=12, metadata=_h(
        "semi: steps an imbalance must last to be migrated (before that: resized)"))
    out: str = field(default="reports/demo", metadata=_h("report folder"))
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 4 or not 0 < self.slow_from < self.steps - 2:
            raise ValueError(f"need --steps ≥ 4 and 0 < --slow-from < --steps − 2, got "
                             f"{self.steps}, {self.slow_from}")
        if not self.factor > 1.0:
            raise ValueError(f"--factor must be above 1 (a slower rank), got {self.factor}")
        self.train_config(True).gpt_config(97)
        PolicyConfig(spike_steps=self.spike_steps, confirm_steps=self.confirm_steps)  # refuse early

    def train_config(self, overlap: bool) -> TrainConfig:
        return TrainConfig(model="gpt", steps=self.steps, batch_size=self.batch_size, lr=self.lr,
                           seq_len=self.seq_len, n_layer=self.n_layer, n_head=self.n_head,
                           n_embd=self.n_embd, overlap=overlap, seed=self.seed, eval_batches=8)


def run_demo(cfg: DemoConfig) -> list[dict]:
    """What each rank runs: per system, a run without and one with the straggler, the four
    interleaved step by step (in balanced orders, each step started together), so that the
    load of a shared machine drifting hits them alike."""
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    corpus = CharCorpus.load()
    report = rank_context().report
    slow = [SlowSpec(rank=world - 1, factor=cfg.factor, from_step=cfg.slow_from)]
    runs = []
    for system, (overlap, policy) in SYSTEMS.items():
        for scenario, specs in (("none", []), ("slow", slow)):
            name = policy if scenario == "slow" else "even"
            policy_cfg = PolicyConfig(name=name, spike_steps=cfg.spike_steps,
                                      confirm_steps=cfg.confirm_steps)
            runs.append((system, scenario, name, overlap, specs,
                         BalancedRun(cfg.train_config(overlap), policy_cfg, specs, corpus)))
    for step in range(cfg.steps):
        for i, (system, scenario, *_, run) in enumerate(balanced_round(runs, step)):
            run.step(step, barrier=True)
            if rank == 0:
                report({"system": system, "scenario": scenario, "step": step,
                        "run": step * len(runs) + i, "of": cfg.steps * len(runs)})
    out = []
    for system, scenario, name, overlap, specs, run in runs:
        result = run.finish()
        out.append({"system": system, "scenario": scenario, "policy": name,
                    "overlap": overlap, "world_size": world, "times": result["times"],
                    "losses": result["losses"], "eval": result["eval"],
                    "compute_s_per_step": result["compute_s_per_step"],
                    "decisions": result["decisions"], "final_state": result["final_state"],
                    "monitor_s": result["monitor_s"],
                    "factors": [factors_at(specs, world, s) for s in range(cfg.steps)],
                    "link": cfg.extra.get("link", "loopback")})
    return out


def summarize_demo(records: list[dict], cfg: DemoConfig) -> list[dict]:
    """Per system: median step time after the slowdown (its first 3 steps left out), the
    ideal there, tokens/s, held-out figures, and the same run without the straggler."""
    rows = []
    tokens = cfg.batch_size * cfg.seq_len
    for system in SYSTEMS:
        none = next(r for r in records if r["system"] == system and r["scenario"] == "none")
        slow = next(r for r in records if r["system"] == system and r["scenario"] == "slow")
        after = slice(cfg.slow_from + 3, cfg.steps)
        t_none = statistics.median(none["times"][3:])
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


def _plot(records: list[dict], cfg: DemoConfig, rows: list[dict], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"plain": "tab:red", "plait": "tab:blue"}
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in records:
        style = "-" if r["scenario"] == "slow" else ":"
        label = f"{r['system']} ({'straggler' if r['scenario'] == 'slow' else 'no straggler'})"
        ax.plot([t * 1e3 for t in r["times"]], style, color=colors[r["system"]], lw=1.3,
                label=label)
        for d in r["decisions"] if r["scenario"] == "slow" else ():
            if d["kind"] == "migrate":
                ax.axvline(d["step"], color=colors[r["system"]], alpha=0.15, lw=3)
    for row in rows:
        ax.axhline(row["t_ideal_s"] * 1e3, color=colors[row["system"]], ls="--", lw=0.8,
                   label=f"{row['system']}: ideal with the straggler")
    ax.axvline(cfg.slow_from, color="k", lw=0.8)
    ax.text(cfg.slow_from + 0.5, ax.get_ylim()[1] * 0.95, f"rank turns {cfg.factor:g}× slower",
            fontsize=8, va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, slowest rank)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(folder / "step_time.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for r in records:
        style = "-" if r["scenario"] == "slow" else ":"
        ax.plot(r["losses"], style, color=colors[r["system"]], lw=1,
                label=f"{r['system']} ({r['scenario']})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=120)
    plt.close(fig)
    return ["step_time.png", "loss.png"]


def write_demo_report(records: list[dict], rows: list[dict], cfg: DemoConfig, where: str,
                      wall_s: float) -> Path:
    """The report folder: demo.json, the plots, decisions.log and index.html."""
    folder = Path(cfg.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo.json").write_text(json.dumps({"where": where, "wall_s": wall_s,
                                                  "summary": rows, "runs": records}, indent=1))
    plots = _plot(records, cfg, rows, folder)
    lines = [f"step {d['step']:>3} {d['dim']}: {d['kind']} {d['reason']}"
             for r in records if r["system"] == "plait" and r["scenario"] == "slow"
             for d in r["decisions"]]
    (folder / "decisions.log").write_text("\n".join(lines) + "\n")
    head = ["system", "path", "policy", "step (ms)", "no straggler (ms)", "ideal (ms)",
            "× ideal", "tokens/s", "held-out loss", "held-out acc"]
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            r["system"], "fused" if r["overlap"] else "unfused", r["policy"],
            f"{r['t_step_s'] * 1e3:.1f}", f"{r['t_step_no_straggler_s'] * 1e3:.1f}",
            f"{r['t_ideal_s'] * 1e3:.1f}", f"{r['ratio_to_ideal']:.2f}",
            f"{r['tokens_per_s']:,.0f}", f"{r['heldout_loss']:.3f}",
            f"{100 * r['heldout_acc']:.1f} %")) + "</tr>" for r in rows)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>plait demo</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}pre{{background:#f5f5f5;padding:1em;overflow:auto}}</style>
</head><body><h1>plait demo</h1>
<p>A {cfg.n_layer}-block GPT (width {cfg.n_embd}, {cfg.n_head} heads) trained with tensor
parallelism on {rows[0]['world_size']} ranks ({html.escape(where)}); from step {cfg.slow_from}
the last rank computes {cfg.factor:g}× slower. Step times are medians from step
{cfg.slow_from + 3} on, each step the slowest rank's. The ideal spreads the tensor-parallel
compute in proportion to the ranks' speeds and keeps everything else. Wall time {wall_s:.0f} s.</p>
<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{body}</table>
<p>plait against plain: {rows[1]['speedup_vs_plain']:.2f}× faster per step with the straggler.</p>
{''.join(f'<p><img src="{p}" style="max-width:100%"></p>' for p in plots)}
<h2>What the balancer decided</h2><pre>{html.escape(chr(10).join(lines) or 'nothing')}</pre>
</body></html>"""
    (folder / "index.html").write_text(page)
    return folder


def demo(cfg: DemoConfig, *, ranks: int, hosts: int = 0, link: str | None = "1gbit",
         timeout_s: float | None = None, on_progress=None) -> tuple[list[dict], str]:
    from .bench.placement import run_placed

    cfg = replace(cfg)
    if ranks < 2:
        raise ValueError("the demo needs at least 2 ranks (one of them turns slow)")
    if cfg.n_head < ranks:
        raise ValueError(f"--n-head {cfg.n_head} gives some of the {ranks} ranks no head")
    return run_placed(run_demo, cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=timeout_s,
                      on_progress=on_progress)
