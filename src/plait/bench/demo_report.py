"""What ``plait demo`` leaves behind: ``demo.json``, ``step_time.png``, ``loss.png``,
``decisions.log`` and ``index.html``.

``step_time.png`` reads at a glance: its y axis is set by the steps after warm-up (a warm-up
step that took seconds is drawn as a ▲ at the top with its time beside it, not as a scale that
flattens every other step), and every mark has a legend entry: the warm-up band, the
straggler's onset, each of the balancer's decisions, the table's medians and the ideal. Its
lower plot is each rank's compute per step, what the balancer measures: a busy machine swings
the step times, not that.
"""

from __future__ import annotations

import html
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from .config.demo import WARMUP_STEPS, DemoConfig
from .report import counted

__all__ = ["write_demo_report", "busy_note", "cores_busy"]

_COLORS = {"plain": "tab:red", "plait": "tab:blue"}
_DECISION = {"resize": ("--", "resizes"), "migrate": ("-", "migrates"), "undo": (":", "undoes")}
_DECISION_COLOR = "tab:green"  # the balancer's decisions, apart from both systems' lines


def _top(series: list[list[float]], floor: float = 0.0) -> float:
    """The y axis's top: 15 % over the 98th percentile of the steps after warm-up, so that a
    warm-up step (seconds where the others take milliseconds) flattens no curve."""
    values = sorted(v for s in series for v in s[WARMUP_STEPS:])
    p98 = values[min(len(values) - 1, int(0.98 * len(values)))] if values else floor
    return 1.15 * max(p98, floor)


def _curve(ax, values: list[float], top: float, clipped: dict, *, note: bool,
           labelled: frozenset = frozenset(), **style) -> None:
    """Plot ``values`` (ms) cut at ``top``; a cut point gets a ▲ at the top and, with
    ``note``, its value beside it (stacked where several share a step; on the left of the
    steps in ``labelled``, whose mark has its label on the right)."""
    ax.plot(range(len(values)), [min(v, top) for v in values], **style)
    for x, v in enumerate(values):
        if v > top:
            ax.plot([x], [top], marker="^", ms=7, color=style["color"], clip_on=False, zorder=5)
            if note:
                k = clipped[x] = clipped.get(x, -1) + 1
                left = x in labelled
                ax.annotate(f"{v / 1e3:.1f} s", (x, top), xytext=(-6 if left else 6, -6 - 9 * k),
                            textcoords="offset points", fontsize=7, color=style["color"],
                            va="top", ha="right" if left else "left")


def _decision_marks(decisions: list[dict], slowed: int) -> list[tuple[int, str, str]]:
    """(step, kind, legend label) per step at which the balancer acted, one per kind (an
    action lands on every sharded dim at once); ``slowed``: the rank that turned slow."""
    widest: dict = {}  # (step, kind) → the decision on the widest dim, the one to name
    for d in decisions:
        key = (d["step"], d["kind"])
        if key not in widest or sum(d["sizes"]) > sum(widest[key]["sizes"]):
            widest[key] = d
    marks = []
    for d in widest.values():
        if d["kind"] == "resize" and d.get("fractions"):
            what = f"rank {slowed} keeps {d['fractions'][slowed]:.0%} of its work"
        elif d["kind"] == "migrate":
            what = f"{d['dim']} split {d['sizes']}"
        else:
            what = "back to its plan"
        verb = _DECISION.get(d["kind"], ("-", d["kind"]))[1]
        marks.append((d["step"], d["kind"], f"plait {verb} at step {d['step']}: {what}"))
    return marks


def _marks(ax, cfg: DemoConfig, marks: list, world: int, *, label: bool) -> None:
    """Warm-up band, the straggler's onset and the balancer's decisions; ``label``: in the
    legend and named inside the axes."""
    import matplotlib.transforms as mtransforms

    on_top = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    ax.axvspan(-0.5, WARMUP_STEPS - 0.5, color="0.88", zorder=0, label=(
        f"warm-up (steps 0–{WARMUP_STEPS - 1}): out of the medians and the y scale"
        if label else None))
    ax.axvline(cfg.slow_from, color="k", lw=1.2, label=(
        f"rank {cfg.slowed(world)} turns {cfg.factor:g}× slower (step {cfg.slow_from})" if label else None))
    texts = [(cfg.slow_from, f"{cfg.factor:g}× slower", "k")]
    for step, kind, text in marks:
        # a colour of their own: in plait's blue a migration read as plait's step-time line
        ax.axvline(step, color=_DECISION_COLOR, ls=_DECISION.get(kind, ("-",))[0], lw=1.2,
                   label=text if label else None)
        texts.append((step, kind, _DECISION_COLOR))
    if label:
        for x, text, color in texts[:8]:
            ax.annotate(text, (x, 0.9), xycoords=on_top, xytext=(3, 0),  # under a ▲
                        textcoords="offset points", rotation=90, va="top", ha="left",
                        fontsize=7, color=color,
                        bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5))


def _plot_steps(records: list[dict], cfg: DemoConfig, rows: list[dict], folder: Path, where: str,
                plt) -> None:
    world = records[0]["world_size"]
    slow_plait = next(r for r in records if r["system"] == "plait" and r["scenario"] == "slow")
    marks = _decision_marks(slow_plait["decisions"], cfg.slowed(world))
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    times = {(r["system"], r["scenario"]): [t * 1e3 for t in r["times"]] for r in records}
    top = _top(list(times.values()), max(row["t_step_s"] for row in rows) * 1e3)
    clipped: dict = {}
    labelled = frozenset([cfg.slow_from, *(step for step, *_ in marks)])
    for (system, scenario), ms in times.items():
        slow = scenario == "slow"
        _curve(ax, ms, top, clipped, note=True, labelled=labelled, color=_COLORS[system],
               ls="-" if slow else ":",
               lw=1.4 if slow else 1.0, alpha=1.0 if slow else 0.8,
               label=f"{system}, {'with the straggler' if slow else 'no straggler'}")
    window = (cfg.slow_from + WARMUP_STEPS, cfg.steps - 1)
    for row in rows:
        c = _COLORS[row["system"]]
        ax.hlines(row["t_step_s"] * 1e3, *window, color=c, lw=4, alpha=0.45,
                  label=f"{row['system']}: median {row['t_step_s'] * 1e3:.0f} ms (the table's)")
        ax.hlines(row["t_ideal_s"] * 1e3, *window, color=c, lw=1, ls="--",
                  label=f"{row['system']}: ideal {row['t_ideal_s'] * 1e3:.0f} ms")
    _marks(ax, cfg, marks, world, label=True)
    if clipped:
        ax.plot([], [], "^", color="0.4", label="off the scale (its time beside it)")
    ax.set_ylim(0, top)
    ax.tick_params(labelbottom=True)
    ax.set_ylabel("step time (ms, slowest rank)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    plain, plait = rows
    ax.set_title(f"steps {window[0]}–{window[1]}: plain {plain['t_step_s'] * 1e3:.0f} ms a step, "
                 f"plait {plait['t_step_s'] * 1e3:.0f} ms ({plait['speedup_vs_plain']:.2f}× "
                 "the plain way's speed)", fontsize=10)
    _plot_compute(bx, records, cfg, marks, world)
    fig.suptitle(f"plait demo: GPT {cfg.n_layer}×{cfg.n_embd} on {counted(world, 'rank')}, rank {cfg.slowed(world)} "
                 f"{cfg.factor:g}× slower from step {cfg.slow_from}\n{where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(folder / "step_time.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def _plot_compute(bx, records: list[dict], cfg: DemoConfig, marks: list, world: int) -> None:
    """What the balancer sees: the first and the slow rank's timed compute per step."""
    from matplotlib.ticker import MaxNLocator

    slow = [r for r in records if r["scenario"] == "slow"]
    series = {(r["system"], rank): [t * 1e3 for t in r["rank_compute_s"][rank]]
              for r in slow for rank in (1 if cfg.slowed(world) == 0 else 0, cfg.slowed(world))}
    top = _top(list(series.values()))
    _marks(bx, cfg, marks, world, label=False)
    for (system, rank), ms in series.items():
        straggler = rank == cfg.slowed(world)
        _curve(bx, ms, top, {}, note=False, color=_COLORS[system], ls="-" if straggler else "--",
               lw=1.6 if straggler else 1.0,
               label=f"{system}: rank {rank}" + (" (the straggler)" if straggler else ""))
    bx.set_ylim(0, top)
    bx.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.set_xlabel("step")
    bx.set_ylabel("compute (ms per step)")
    bx.set_title("each rank's compute per step, with the straggler: even shards leave rank "
                 f"{cfg.slowed(world)} {cfg.factor:g}× behind; plait evens it out", fontsize=9)
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def _plot_loss(records: list[dict], cfg: DemoConfig, folder: Path, plt) -> None:
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(11, 3.6))
    world = records[0]["world_size"]
    ax.axvline(cfg.slow_from, color="k", lw=1.2,
               label=f"rank {cfg.slowed(world)} turns {cfg.factor:g}× slower (step {cfg.slow_from})")
    for i, r in enumerate(records):
        slow = r["scenario"] == "slow"
        name = f"{r['system']}, {'with the straggler' if slow else 'no straggler'}"
        ax.plot(r["losses"], "-" if slow else ":", color=_COLORS[r["system"]], lw=1.2,
                label=name)
        ax.plot([len(r["losses"]) + 0.4 * i], [r["eval"]["heldout_loss"]], "o" if slow else "s",
                color=_COLORS[r["system"]], ms=6, mfc="white" if not slow else None,
                label=f"{name}: held-out {r['eval']['heldout_loss']:.3f}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("training loss (lines; same seed and batches, so they overlap until the "
                 "balancer acts) and held-out loss at the end (markers)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def _plot(records: list[dict], cfg: DemoConfig, rows: list[dict], folder: Path,
          where: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _plot_steps(records, cfg, rows, folder, where, plt)
    _plot_loss(records, cfg, folder, plt)
    return ["step_time.png", "loss.png"]


def cores_busy(seconds: float = 0.5) -> float | None:
    """How many cores other programs keep busy now: the non-idle share of ``/proc/stat``'s
    CPU time over ``seconds``, times the cores (None where there is no /proc/stat). Not the
    1-minute load average, which a minute after set-up or a previous run still counts them."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    spent = total1 - total0
    return None if spent <= 0 else (1 - (idle1 - idle0) / spent) * (os.cpu_count() or 1)


def busy_note(busy: float | None, cores: int) -> str | None:
    """A line for a machine whose other programs kept over half its cores busy when the
    demo started (:func:`cores_busy`): its step times swing with them."""
    if busy is None or busy <= cores / 2:
        return None
    return (f"other programs kept {busy:.1f} of this machine's {cores} cores busy when the demo "
            "started: step times swing with them; each rank's compute (the lower plot) does not")


def write_demo_report(records: list[dict], rows: list[dict], cfg: DemoConfig, where: str,
                      wall_s: float, *, load: float | None = None,
                      busy: float | None = None) -> Path:
    """The report folder: demo.json, the plots, decisions.log and index.html; ``load``: the
    machine's 1-minute load average before the demo started, ``busy``: the cores other
    programs kept busy then (:func:`cores_busy`)."""
    folder = Path(cfg.out)
    folder.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    (folder / "demo.json").write_text(json.dumps(
        {"where": where, "wall_s": wall_s, "load_before": load, "busy_before": busy,
         "cores": cores,
         "config": asdict(cfg), "summary": rows, "runs": records}, indent=1))
    plots = _plot(records, cfg, rows, folder, where)
    lines = [f"step {d['step']:>3} {d['dim']}: {d['kind']} {d['reason']}"
             for r in records if r["system"] == "plait" and r["scenario"] == "slow"
             for d in r["decisions"]]
    (folder / "decisions.log").write_text("\n".join(lines) + "\n")
    page = _page(rows, cfg, where, wall_s, busy_note(busy, cores), plots, lines)
    (folder / "index.html").write_text(page)
    return folder


def _page(rows: list[dict], cfg: DemoConfig, where: str, wall_s: float, busy: str | None,
          plots: list[str], lines: list[str]) -> str:
    head = ["system", "path", "policy", "step (ms)", "no straggler (ms)", "ideal (ms)",
            "× ideal", "tokens/s", "held-out loss", "held-out acc"]
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            r["system"], "fused" if r["overlap"] else "unfused", r["policy"],
            f"{r['t_step_s'] * 1e3:.1f}", f"{r['t_step_no_straggler_s'] * 1e3:.1f}",
            f"{r['t_ideal_s'] * 1e3:.1f}", f"{r['ratio_to_ideal']:.2f}",
            f"{r['tokens_per_s']:,.0f}", f"{r['heldout_loss']:.3f}",
            f"{100 * r['heldout_acc']:.1f} %")) + "</tr>" for r in rows)
    warn = f"<p><b>Note:</b> {html.escape(busy)}.</p>" if busy else ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>plait demo</title>
<style>body{{font-family:sans-serif;max-width:70em;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}pre{{background:#f5f5f5;padding:1em;overflow:auto}}</style>
</head><body><h1>plait demo</h1>
<p>A {cfg.n_layer}-block GPT (width {cfg.n_embd}, {cfg.n_head} heads) trained with tensor
parallelism on {rows[0]['world_size']} ranks ({html.escape(where)}); from step {cfg.slow_from}
rank {cfg.slowed(rows[0]['world_size'])} computes {cfg.factor:g}× slower. Step times are medians from step
{cfg.slow_from + WARMUP_STEPS} on (the straggler's first {WARMUP_STEPS} steps, while the balancer
confirms it, left out), each step the slowest rank's; without the straggler, from step
{WARMUP_STEPS}. The ideal spreads the tensor-parallel compute in proportion to the ranks'
speeds and keeps everything else. Wall time {wall_s:.0f} s.</p>
<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{body}</table>
<p>With the straggler, plait's step speed is {rows[1]['speedup_vs_plain']:.2f}× the plain
way's.</p>{warn}
<p>Upper plot: each step's time, the medians the table gives and the ideal. Lower plot: each
rank's compute per step (what the balancer measures): under even shards the straggler stays
{cfg.factor:g}× behind; plait's decisions bring it back to the others.</p>
{''.join(f'<p><img src="{p}" style="max-width:100%"></p>' for p in plots)}
<h2>What the balancer decided</h2><pre>{html.escape(chr(10).join(lines) or 'nothing')}</pre>
</body></html>"""
