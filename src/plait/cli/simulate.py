"""``plait simulate``: predict step time, exposed communication, and what fusion
and each balancing policy save; ``--validate`` shows the model beside
measurements and published figures; ``--calibrate`` fits this machine's profile;
``--placements`` predicts the two placements of a ``bench tp --dp N --tp M`` run.

Everything here is a thin shell over plait.perf; nothing is unreachable from Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import sys
from pathlib import Path

from .common import (check_outputs, check_readable, check_writable, non_negative_int,
                     positive_int)

__all__ = ["register", "run"]

_DEFAULT_MEASUREMENTS = "reports/bench/*.json"


def register(p, _rest=None) -> None:
    """``plait simulate``'s flags."""
    p.description = ("Predict step time, exposed communication, and what fusion and each "
                     "balancing policy save; --validate shows the model beside measurements and"
                     " published figures; --calibrate fits this machine's profile.")
    p.add_argument("--cluster", metavar="PRESET", help="cluster preset (see --list)")
    p.add_argument("--model", metavar="PRESET", help="model preset (see --list)")
    p.add_argument("--config", metavar="PATH", help="JSON (or TOML on 3.11+) SimConfig file")
    for deg in ("tp", "dp", "ep"):
        p.add_argument(f"--{deg}", type=positive_int,
                       help=f"{deg} degree (default: from the config/preset)")
    p.add_argument("--fsdp", action="store_true", default=None, help="shard parameters over dp")
    p.add_argument("--steps", type=positive_int, help="steps to simulate (first is warm-up)")
    p.add_argument("--seed", type=non_negative_int, help="seed of the speed distribution")
    p.add_argument("--policies", help="comma-separated balancing policies to compare")
    p.add_argument("--validate", action="store_true",
                   help="print predictions next to local measurements and published figures")
    p.add_argument("--measurements", nargs="+", metavar="PATH",
                   help=f"bench JSON files for local rows / calibration (default: {_DEFAULT_MEASUREMENTS})")
    p.add_argument("--calibrate", action="store_true",
                   help="fit this machine's profile from --measurements and save it")
    p.add_argument("--profile", metavar="PATH", help="profile path (default: $PLAIT_PROFILE or "
                                                     "~/.cache/plait/profile.json)")
    p.add_argument("--json", metavar="PATH", help="write the records as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    p.add_argument("--list", action="store_true", help="list presets, GPUs and links")
    p.add_argument("--placements", metavar="PATH",
                   help="a `plait bench tp --dp N --tp M --json` file: each placement's step "
                        "predicted (plait.perf.placement) from the figures that run measured, "
                        "beside its measured step")
    p.add_argument("--link", metavar="RATE",
                   help="with --placements: predict at this link rate between hosts instead "
                        "(e.g. 10gbit)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``plait simulate``; returns the exit status."""
    from plait.bench.report import console  # 120 columns when piped, so tables stay whole
    try:
        if getattr(args, "list", False):
            return _list(console)
        _check_flags(args)
        if args.calibrate:
            return _calibrate(args, console)
        if args.validate:
            return _validate(args, console)
        if args.placements:
            return _placements(args, console)
        return _simulate(args, console)
    except (ValueError, FileNotFoundError) as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return 2


def _check_flags(args) -> None:
    """Refuse contradictory flags, missing inputs and unwritable outputs before any work."""
    if args.calibrate and args.validate:
        raise ValueError("--calibrate and --validate are two different jobs; run one, then "
                         "the other")
    if args.calibrate and (args.json or args.plot):
        raise ValueError("--calibrate writes a profile (--profile PATH), not --json or --plot")
    if args.profile and not args.calibrate:
        raise ValueError("--profile names where --calibrate saves the profile; add --calibrate "
                         "(the operators read it from $PLAIT_PROFILE)")
    if args.placements and (args.calibrate or args.validate):
        raise ValueError("--placements predicts a bench tp run's placements; run it apart from "
                         "--calibrate and --validate")
    if args.link and not args.placements:
        raise ValueError("--link goes with --placements (the rate between emulated hosts)")
    if args.placements and args.plot:
        raise ValueError("--placements prints a table and writes --json, not --plot")
    check_readable(args.config, "--config")
    check_readable(args.placements, "--placements")
    for path in args.measurements or ():
        check_readable(path, "--measurements")
    check_outputs(args, "json", "plot")
    if args.calibrate:
        check_writable(args.profile, "--profile")


def _measurement_paths(args) -> list[str]:
    if args.measurements:
        return list(args.measurements)
    return sorted(glob.glob(_DEFAULT_MEASUREMENTS))


def _list(console) -> int:
    from rich.table import Table

    from plait.perf.hardware import ACCELERATORS, LINKS
    from plait.perf.presets import CLUSTERS, MODELS

    t = Table("kind", "names")
    t.add_row("cluster presets", ", ".join(CLUSTERS))
    t.add_row("model presets", ", ".join(MODELS))
    t.add_row("GPUs", ", ".join(ACCELERATORS))
    t.add_row("links", ", ".join(LINKS))
    console.print(t)
    return 0


def _calibrate(args, console) -> int:
    from plait.perf.calibrate import default_profile_path, fit_profile, load_calibration, load_records

    paths = _measurement_paths(args)
    if not paths:
        raise ValueError("no benchmark JSON to calibrate from; run `plait bench collectives --json "
                         "reports/bench/collectives.json` and `plait bench ops --json reports/bench/ops.json`")
    prof = fit_profile(load_records(paths), measured=load_calibration(paths))
    out = prof.save(args.profile or default_profile_path())
    console.print(f"latency {prof.latency_s * 1e6:.1f} us/step, base {prof.base_latency_s * 1e6:.1f} us, "
                  f"bandwidth {prof.bandwidth_Bps / 1e9:.3f} GB/s, compute {prof.compute_flops / 1e9:.1f} "
                  f"GFLOP/s, per-piece overhead {prof.per_piece_overhead_s * 1e6:.1f} us "
                  f"(fit error {prof.fit_rel_error:.1%}, link {prof.link!r})")
    console.print(f"profile saved to {out}")
    return 0


def _build_config(args):
    from plait.perf.config import SimConfig, load_config

    data = {}
    if args.config:
        cfg = load_config(args.config)  # validates the file on its own first
        data = dataclasses.asdict(cfg)
    if args.cluster:
        data["cluster"] = args.cluster
    if args.model:
        data["model"] = args.model
    data.setdefault("cluster", "dgx-h100")
    data.setdefault("model", "llama3-8b")
    par = dict(data.get("parallel", {})) if not (args.cluster or args.model) else {}
    for key in ("tp", "dp", "ep", "fsdp"):
        if getattr(args, key) is not None:
            par[key] = getattr(args, key)
    data["parallel"] = par
    for key in ("steps", "seed"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    if args.policies:
        data["policies"] = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    return SimConfig.from_dict(data)


def _simulate(args, console) -> int:
    from plait.bench.report import print_table
    from plait.perf.simulator import simulate

    cfg = _build_config(args)
    res = simulate(cfg)
    base = res.get(fused=False, policy=cfg.policies[0])
    c, par = cfg.cluster, cfg.parallel
    unit = "samples/s" if cfg.model.kind == "dlrm" else "tokens/s"
    shape = "dlrm" if cfg.model.kind == "dlrm" else f"{cfg.model.kind} {cfg.model.layers}L"
    print_table(f"{c.num_gpus} x {c.gpu} ({c.nodes} nodes), {shape}, tp={par.tp} dp={par.dp} "
                f"ep={par.ep}{' fsdp' if par.fsdp else ''} - simulated in {res.wall_s:.1f} s",
                ["fusion", "policy", "step ms", unit, "speedup", "comm", "wait", "skip", "MFU"],
                [["fused" if v.fused else "unfused", v.policy, f"{v.step_s * 1e3:.2f}",
                  f"{v.throughput:,.0f}", f"{base.step_s / v.step_s:.3f}x",
                  f"{v.exposed_comm_share:.1%}", f"{v.wait_share:.1%}", f"{v.skipped:.2%}",
                  f"{v.mfu:.1%}"] for v in res.variants], labels=2, to=console)
    console.print("comm = exposed communication, wait = waiting for slower peers (shares of the "
                  "step); skip = work dropped by resizing", soft_wrap=True, highlight=False)
    if len(cfg.policies) > 1 and all(
            len({round(v.step_s, 12) for v in res.variants if v.fused == fused}) == 1
            for fused in (False, True)):
        console.print("every policy gives the same step: this cluster's ranks all run at one "
                      "speed (no jitter, no slowdowns, one GPU generation), so no policy moves "
                      "work; a cluster whose speeds differ (--config: cluster.speeds) compares "
                      "them", soft_wrap=True, highlight=False)
    records = [{k: (float(x) if isinstance(x, float) else x) for k, x in dataclasses.asdict(v).items()}
               for v in res.variants]
    if args.json:
        _write_json(args.json, {"config": dataclasses.asdict(cfg), "records": records,
                                "wall_s": res.wall_s})
        console.print(f"wrote {args.json}")
    if args.plot:
        _plot_variants(args.plot, res, cfg)
        console.print(f"wrote {args.plot}")
    return 0


def _validate(args, console) -> int:
    from rich.markup import escape
    from rich.table import Table

    from plait.perf.calibrate import load_records
    from plait.perf.validate import NO_LOCAL_HINT, local_rows, published_rows, summarize

    rows = published_rows()
    paths = _measurement_paths(args)
    if paths:
        local = local_rows(load_records(paths))
        rows += local
        if not local:
            console.print(f"local rows: the files {paths} hold no usable records")
    else:
        console.print(NO_LOCAL_HINT, soft_wrap=True, markup=False, highlight=False)
    summary = summarize(rows)
    sources: dict[str, int] = {}
    t = Table(title="plait.perf validation")
    for col in ("case", "predicted", "reference", "unit", "rel. error", "kind", "src"):
        t.add_column(col, overflow="fold", justify="right" if col in ("predicted", "reference",
                                                                      "rel. error") else "left")
    for r in rows:
        n = sources.setdefault(r.source, len(sources) + 1)
        kind = r.kind if r.role == "validation" else f"{r.kind} ({r.role}: not counted)"
        t.add_row(escape(r.case), f"{r.predicted:.4g}", f"{r.reference:.4g}", r.unit,
                  f"{r.rel_error:.1%}", kind, escape(f"[{n}]"))
    console.print(t)
    for source, n in sources.items():
        notes = sorted({r.note for r in rows if r.source == source and r.note})
        console.print(f"[{n}] {source}" + "".join(f"\n    {x}" for x in notes[:3]),
                      highlight=False, markup=False, soft_wrap=True)
    failed = False
    for kind, s in summary.items():
        if s["n"] == 0:
            console.print(f"{kind}: no rows")
            continue
        ok = "PASS" if s["pass"] else "FAIL"
        failed |= not s["pass"]
        console.print(f"{kind}: {s['statistic']} relative error {s['rel_error']:.1%} over {s['n']} rows "
                      f"(limit {s['threshold']:.0%}) {ok}")
    if args.json:
        _write_json(args.json, {"records": [r.to_dict() for r in rows], "summary": summary})
        console.print(f"wrote {args.json}")
    if args.plot:
        _plot_validation(args.plot, rows)
        console.print(f"wrote {args.plot}")
    return 1 if failed else 0


def _placements(args, console) -> int:
    """Each placement record of a ``bench tp --dp N --tp M`` JSON predicted again from the
    figures it recorded (``--link``: at another rate), printed beside its measured step."""
    from plait.bench.tp_dp import print_placements
    from plait.perf.placement import Hardware, StepWork, predict_placement
    from plait.runtime import parse_rate

    try:
        data = json.loads(Path(args.placements).read_text())
    except ValueError as e:
        raise ValueError(f"--placements {args.placements}: not valid JSON ({e})") from None
    records = [r for r in (data.get("records", []) if isinstance(data, dict) else data)
               if isinstance(r, dict) and r.get("part") == "placement"]
    if not records:
        raise ValueError(f"--placements {args.placements} holds no placement records; write one "
                         "with `plait bench tp --dp 2 --tp 2 --ranks 4 --hosts 2 --json PATH`")
    rate = parse_rate(args.link) if args.link else None
    if args.link and rate is None:
        raise ValueError(f"--link {args.link}: give a rate (e.g. 1gbit)")
    for r in records:
        hw = Hardware(**r["hardware"])
        if rate is not None:
            hw = dataclasses.replace(hw, inter_Bps=rate / 8 if hw.hosts > 1 else None)
            r["link_predicted"] = args.link
        predicted = predict_placement(StepWork(**r["work"]), hw, r["placement"])
        r.update(predicted_step_s=predicted.step_s, prediction=predicted.to_dict(),
                 hardware=dataclasses.asdict(hw), across_hosts=(
                     predicted.across_hosts if hw.hosts > 1 else r["across_hosts"]))
    print_placements(records, to=console)
    if args.link:
        console.print(f"predicted at --link {args.link}; measured at {records[0]['link']}",
                      highlight=False)
    if args.json:
        _write_json(args.json, {"records": records, "source": str(args.placements)})
        console.print(f"wrote {args.json}")
    return 0


def _write_json(path: str, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=float) + "\n")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_variants(path: str, res, cfg) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, fused in enumerate((False, True)):
        vs = [v for v in res.variants if v.fused == fused]
        xs = [j + (i - 0.5) * width for j in range(len(vs))]
        ax.bar(xs, [v.step_s * 1e3 for v in vs], width, label="fused" if fused else "unfused")
    ax.set_xticks(range(len(cfg.policies)), cfg.policies)
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{cfg.cluster.num_gpus} x {cfg.cluster.gpu}: {cfg.model.kind}")
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_validation(path: str, rows) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.5))
    colors = {"published": "tab:blue", "local": "tab:green", "local-auto": "tab:orange"}
    ax.barh([r.case[:55] for r in rows], [100 * r.rel_error for r in rows],
            color=[colors.get(r.kind, "gray") if r.role == "validation" else "lightgray" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("relative error (%)")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
