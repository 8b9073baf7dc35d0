"""``plait elastic``: train on emulated hosts under torchrun's elastic agents, kill one, go on.

    plait elastic --hosts 3 --link 1gbit --steps 60 --kill-host 2@20 --checkpoint-every 5
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..bench.report import console, print_table, write_json
from ..elastic.config import ElasticConfig
from .args import add_dataclass_args, dataclass_from_args
from .common import check_writable

__all__ = ["register", "run_elastic_command", "parse_kill"]


def parse_kill(text: str) -> tuple[int, int]:
    """``"2@20"`` → (host 2, step 20)."""
    host, sep, step = text.partition("@")
    if not sep or not host.strip().isdigit() or not step.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST@STEP, e.g. 2@20")
    return int(host), int(step)


def register(parser, _rest=None) -> None:
    parser.description = ("One torchrun agent per emulated host (network namespace), c10d "
                          "rendezvous on host 0, --nnodes MIN:MAX. --kill-host H@S kills every "
                          "process of host H when step S is logged; the survivors restart, "
                          "re-form a smaller world, load the last checkpoint under its plan and"
                          " finish. Prints the time from the kill to the survivors' first step,"
                          " the steps lost and the held-out loss beside an uninterrupted run's.")
    add_dataclass_args(parser, ElasticConfig, skip=("kill_host", "kill_at"))
    parser.add_argument("--kill-host", type=parse_kill, default=None, metavar="HOST@STEP",
                        dest="kill",
                        help="kill host HOST when step STEP is logged, e.g. 2@20")
    parser.add_argument("--reference", choices=("cluster", "process", "none"), default="cluster",
                        help="the uninterrupted run to compare with: the same hosts without the "
                             "kill (default), one process (the plain model), or none")
    parser.add_argument("--keep", metavar="DIR", default=None,
                        help="copy the workers' JSONL logs and the agents' output here")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write the figures as JSON (as every bench command does)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no line per step (the table at the end stays)")
    parser.set_defaults(func=run_elastic_command)


def run_elastic_command(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(ElasticConfig, args)
    if args.kill is not None:
        cfg = replace(cfg, kill_host=args.kill[0], kill_at=args.kill[1])
    if args.json:
        check_writable(args.json, "--json")
    from ..elastic.launcher import run_elastic, run_reference  # torch: once the flags passed

    quiet = args.no_progress

    def on_event(kind: str, record: dict) -> None:
        if quiet:
            return
        if kind == "kill":
            console.print(f"[bold red]killed host {record['host']}[/bold red] at step "
                          f"{record['step']} (pids {', '.join(map(str, record['pids']))})")
        else:
            console.print(f"step {record['step']:>4}  loss {record['loss']:.4f}  "
                          f"world {record['world_size']}  restart {record['restart']}")

    result = run_elastic(cfg, on_event=on_event, keep=args.keep)
    reference = None
    if args.reference == "cluster":
        if not quiet:
            console.print("the uninterrupted run, same hosts:")
        reference = run_elastic(replace(cfg, kill_host=None, kill_at=None, min_hosts=None))
    elif args.reference == "process":
        reference = run_reference(cfg)
    summary = _summary(cfg, result, reference, args.reference)
    _print(summary)
    if args.json:
        write_json(args.json, [summary], {"command": "elastic", "summary": summary})
        console.print(f"wrote {args.json}")
    return 0


def _summary(cfg: ElasticConfig, result: dict, reference: dict | None, how: str) -> dict:
    out = {"config": cfg.__dict__, "where": result["where"], "wall_s": result["wall_s"],
           **{k: result.get(k) for k in ("worlds", "restarts", "steps", "final_world_size",
                                         "last_step_before_kill", "resumed_from", "steps_lost",
                                         "restart_s", "recovery_s", "heldout_loss")},
           "reference": how}
    if reference is not None:
        out["reference_heldout_loss"] = reference["heldout_loss"]
        out["heldout_loss_diff"] = (result["heldout_loss"] / reference["heldout_loss"] - 1
                                    if result["heldout_loss"] and reference["heldout_loss"]
                                    else None)
    return out


def _fmt(value, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def _print(s: dict) -> None:
    rows = [("worlds (per incarnation)", " → ".join(map(str, s["worlds"]))),
            ("steps done", _fmt(s["steps"])),
            ("last step before the kill", _fmt(s["last_step_before_kill"])),
            ("resumed from checkpoint", _fmt(s["resumed_from"])),
            ("steps lost", _fmt(s["steps_lost"])),
            ("kill → survivors resumed (checkpoint loaded)", _fmt(s["restart_s"], " s")),
            ("kill → first step done on survivors", _fmt(s["recovery_s"], " s")),
            ("held-out loss", _fmt(s["heldout_loss"], digits=4))]
    if "reference_heldout_loss" in s:
        diff = s["heldout_loss_diff"]
        rows += [(f"held-out loss, uninterrupted ({s['reference']})",
                  _fmt(s["reference_heldout_loss"], digits=4)),
                 ("difference", "—" if diff is None else f"{100 * diff:+.3f} %")]
    print_table(f"plait elastic: {s['where']}", ["", "value"], rows)
    console.print(f"{s['wall_s']:.1f} s the run with the kill (without the reference)")
