"""What ``plait train`` leaves behind: ``log.json`` (every step, the held-out result) and ``loss.png``."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from .bench.report import write_json

__all__ = ["write_train_report", "smooth"]


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Exponential moving average, bias-corrected (TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** (i + 1)))
    return out


def write_train_report(result: dict, cfg, out: str | Path, where: str, wall_s: float) -> dict:
    """Write ``out/log.json`` and ``out/loss.png``; returns the summary stored in the log."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = result["records"]
    losses = [r["loss"] for r in records]
    head = max(1, len(losses) // 10)  # first and last tenth: one noisy batch proves nothing
    summary = {"first_loss": losses[0], "last_loss": losses[-1],
               "first_tenth_mean_loss": sum(losses[:head]) / head,
               "last_tenth_mean_loss": sum(losses[-head:]) / head,
               **result["eval"], "train_s": result["train_s"], "wall_s": wall_s,
               "unit": result["unit"], "params_per_rank": result["params_rank"],
               "parallel": result["parallel"], "parallel_notes": result.get("notes", []),
               "operator_paths": result["paths"], "where": where,
               "placement": result.get("placement", "")}
    if "balance" in result:  # --balance: the policy, every decision, the plans at the end
        summary["balance"] = result["balance"]
    if result.get("resumed"):  # --resume: the checkpoint, and what was resharded
        summary["resumed"] = result["resumed"]
    config = {k: v for k, v in asdict(cfg).items()}
    write_json(out / "log.json", records, {"command": "train", "config": config, "summary": summary})
    _plot(out / "loss.png", records, result["eval"], cfg, where)
    return summary


def _plot(path: Path, records: list[dict], final: dict, cfg, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = [r["loss"] for r in records]
    fig, (ax, ax_t) = plt.subplots(2, 1, figsize=(7, 6.4), dpi=110, sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    steps = list(range(len(losses)))
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1, label="training loss (per step)")
    ax.plot(steps, smooth(losses), color="tab:blue", lw=2, label="training loss (smoothed)")
    ax.scatter([len(losses) - 1], [final["heldout_loss"]], color="tab:red", zorder=3,
               label=f"held-out loss {final['heldout_loss']:.3f}")
    if "planted_model_loss" in final:
        ax.axhline(final["planted_model_loss"], color="gray", ls="--", lw=1,
                   label=f"planted model's loss {final['planted_model_loss']:.3f}")
    ax.set_ylabel("cross-entropy")
    path_kind = f"fused operators (chunks={cfg.chunks})" if cfg.overlap else "plain path"
    ax.set_title(f"plait train --model {cfg.model}: {cfg.extra.get('ranks', '')} ranks, "
                 f"{path_kind}", fontsize=10)
    ax.text(0.01, 0.01, where, transform=ax.transAxes, ha="left", va="bottom", fontsize=7,
            color="gray")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    _plot_step_times(ax_t, records, cfg)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_step_times(ax, records: list[dict], cfg) -> None:
    """Rank 0's step time per step, and each balancer decision as a line at its step."""
    steps = [r["step"] for r in records]
    times_ms = [1e3 * r["time_s"] for r in records]
    ax.plot(steps, times_ms, color="tab:gray", lw=1, label="step time (rank 0)")
    if len(times_ms) > 1:  # the first step (allocation, first touch) may run off the top
        ax.set_ylim(0, 1.1 * max(times_ms[1:]))
    colors = {"migrate": "tab:green", "resize": "tab:orange", "undo": "tab:purple"}
    labelled = set()
    for r in records:
        for d in r.get("decisions", ()):
            kind = d["kind"]
            ax.axvline(r["step"], color=colors.get(kind, "k"), lw=1, ls="--",
                       label=None if kind in labelled else f"balancer: {kind}")
            labelled.add(kind)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    balance = getattr(cfg, "balance", "even")
    ax.set_title(f"--balance {balance}" + ("" if balance != "even" else " (no balancer)"),
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right", framealpha=0.9)
