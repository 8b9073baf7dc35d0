"""Every transformers causal LM whose config ships a tensor-parallel plan, through
``plait.parallelize(model, "auto")``, against the model on one process.

    .venv/bin/python scripts/hf_sweep.py [--ranks 2,3] [--only llama,gpt_neox] [--json FILE]
                                         [--merge] [--timeout S] [--docs]
    .venv/bin/python scripts/hf_sweep.py --docs-only   # docs/conformance.md from the JSON

For each architecture (``plait.testing.tiny_hf.tp_model_types()``): one launch of one
rank builds the tiny model and runs it (3 SGD steps, ``generate()``) in float64, else
float32; where it cannot, the architecture is "not-built" with the reason, and nothing of
plait runs. Then one launch per world size runs ``plait.testing.conformance.check`` on
every rank: exact, refused (one line, weights unchanged) or DIFFERENT/ERROR. Every launch
has a deadline (``--timeout``), so one hang costs that and the sweep goes on. Results go
to the JSON after every architecture; ``--merge`` replaces only the architectures run in
an existing JSON. ``--docs``: rewrite docs/conformance.md from the JSON at the end.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DEFAULT_JSON = ROOT / "docs" / "results" / "hf-sweep" / "sweep.json"
DOC = ROOT / "docs" / "conformance.md"
OUTCOMES = ("exact", "refused", "not-built", "DIFFERENT", "ERROR")


def _probe(model_type: str) -> tuple:
    """On one rank: (dtype name or None, why not built)."""
    from plait.testing.conformance import reference_dtype

    dtype, why = reference_dtype(model_type)
    return (None if dtype is None else str(dtype).removeprefix("torch."), why)


def _check(model_type: str, dtype: str) -> dict:
    from plait.testing.conformance import check

    return check(model_type, dtype)


def _preload() -> None:
    """transformers' shared modelling code in the launch server, not imported by every rank
    of every launch (2.6 s each here)."""
    ctx = importlib.import_module("plait.runtime.launch")._context()
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "plait.runtime",
                                "transformers.models.llama.modeling_llama",
                                "plait.testing.conformance"])


def _launch(fn, world: int, args: tuple, timeout_s: float):
    from plait.runtime import launch
    from plait.runtime.errors import RankError

    try:
        return launch(fn, world, args=args, timeout_s=60, threads=1, deadline_s=timeout_s,
                      env={"TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}), None
    except RankError as err:
        return None, " ".join(str(err).split())[:300]


def run_one(model_type: str, worlds: list[int], timeout_s: float) -> list[dict]:
    rows = []
    t0 = time.perf_counter()
    got, err = _launch(_probe, 1, (model_type,), timeout_s)
    dtype, why = got[0] if got else (None, f"its one-process run failed: {err}")
    probe_s = time.perf_counter() - t0
    for world in worlds:
        row = {"architecture": model_type, "world": world, "dtype": dtype}
        if dtype is None:
            rows.append({**row, "outcome": "not-built", "why": why, "seconds": round(probe_s, 1)})
            continue
        t0 = time.perf_counter()
        got, err = _launch(_check, world, (model_type, dtype), timeout_s)
        seconds = round(time.perf_counter() - t0, 1)
        if got is None:
            rows.append({**row, "outcome": "ERROR", "why": f"the launch failed: {err}",
                         "seconds": seconds})
            continue
        first = got[0]
        outcomes = {r["outcome"] for r in got}
        if len(outcomes) > 1:
            first = {**first, "outcome": "ERROR",
                     "why": f"the ranks disagree: {sorted(outcomes)}"}
        if first["outcome"] == "refused" and not (first["unchanged"] and first["one_line"]):
            first = {**first, "outcome": "ERROR", "why": "refused, but " + (
                "the model changed" if not first["unchanged"] else "in more than one line")
                + ": " + first["why"]}
        rows.append({**row, **first, "seconds": seconds})
    return rows


def _line(rows: list[dict]) -> str:
    parts = []
    for r in rows:
        what = r["outcome"]
        if what == "exact":
            what += f" ({max(r['errors'].values()):.1e})"
        elif what != "exact":
            what += f": {r.get('why', '')[:110]}"
        parts.append(f"{r['world']} ranks {what} [{r['seconds']:.0f} s]")
    return "; ".join(parts)


def _counts(results: list[dict], world: int) -> dict[str, int]:
    counts = {o: 0 for o in OUTCOMES}
    for r in results:
        if r["world"] == world:
            counts[r["outcome"]] += 1
    return counts


def _table(results: list[dict], worlds: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plait.parallelize(model, 'auto') against one process")
    table.add_column("architecture")
    for w in worlds:
        table.add_column(f"{w} ranks")
    table.add_column("why")
    by_arch: dict[str, dict[int, dict]] = {}
    for r in results:
        by_arch.setdefault(r["architecture"], {})[r["world"]] = r
    for arch, rows in by_arch.items():
        why = next((rows[w].get("why", "") for w in worlds if w in rows
                    and rows[w]["outcome"] != "exact"), "")
        table.add_row(arch, *[rows[w]["outcome"] if w in rows else "-" for w in worlds],
                      why[:90])
    console = Console(width=160)
    console.print(table)
    for w in worlds:
        console.print(f"{w} ranks: " + ", ".join(f"{n} {o}" for o, n in
                                                  _counts(results, w).items()))


def write_docs(data: dict, path: Path = DOC) -> str:
    """docs/conformance.md from the sweep's JSON (returned as well as written)."""
    text = render_docs(data)
    path.write_text(text)
    return text


def render_docs(data: dict) -> str:
    results, worlds = data["results"], data["worlds"]
    by_arch: dict[str, dict[int, dict]] = {}
    for r in results:
        by_arch.setdefault(r["architecture"], {})[r["world"]] = r
    lines = [
        "# Conformance: every transformers architecture with a tensor-parallel plan",
        "",
        "<!-- generated by scripts/hf_sweep.py from docs/results/hf-sweep/sweep.json: "
        "do not edit by hand -->",
        "",
        f"`plait.parallelize(model, \"auto\")` on a tiny model (random weights, 2 layers, width "
        f"64, 4 heads over 2 KV heads, 4 experts, every dropout 0) of every causal-LM "
        f"architecture whose config in transformers {data['transformers']} ships a "
        f"tensor-parallel plan, against the same model on one process: 3 SGD steps (each "
        f"step's loss, every parameter's gradient gathered by name, the first logits) and "
        f"greedy `generate()` tokens, on 2 and 3 ranks. Exact: every relative error within "
        f"the bar of the precision the model computes in (float64 1e-9; float64 with float32 "
        f"inside, a norm's upcast or RoPE in complex64, 1e-5; float32, where a kernel takes no "
        f"float64, 2e-4), or within 10x the model's own noise at that step where larger (the "
        f"same steps from weights moved by one rounding of its precision: a router's top-k "
        f"flips, SGD amplifies); the first step is always held to the precision's bar. "
        f"Refused: one line naming the module, the model's weights, buffers and modules "
        f"unchanged. Not-built: the tiny model does not run on one CPU process, for reasons "
        f"outside plait. DIFFERENT (silently other numbers) and ERROR (accepted, then failed) "
        f"must be 0. The code: `plait.testing.conformance`, `plait.testing.tiny_hf`; what "
        f"`parallelize` checks before it changes a weight: `plait.parallel.exactness`.",
        "",
        f"Command: `{data['command']}` ({data['started'][:10]}, commit {data.get('commit', '?')}, "
        f"{data['total_s'] / 60:.0f} min on {data['host']['cores']} cores, torch "
        f"{data['torch']}).",
        "",
        "| outcome | " + " | ".join(f"{w} ranks" for w in worlds) + " |",
        "|---|" + "---|" * len(worlds),
    ]
    counts = {w: _counts(results, w) for w in worlds}
    for o in OUTCOMES:
        lines.append(f"| {o} | " + " | ".join(str(counts[w][o]) for w in worlds) + " |")
    lines += ["", "| architecture | computes in | " + " | ".join(f"{w} ranks" for w in worlds)
              + " | largest error, first step / all steps | why |",
              "|---|---|" + "---|" * len(worlds) + "---|---|"]
    for arch in sorted(by_arch):
        rows = by_arch[arch]
        why = []
        for w in worlds:
            r = rows.get(w)
            if r is not None and r["outcome"] != "exact" and r.get("why"):
                text = r["why"].replace("|", "\\|")
                if text not in why:
                    why.append(text)
        computes = next((r.get("precision") or r["dtype"] for r in rows.values()
                         if r.get("dtype")), "-")
        cells = [rows[w]["outcome"] if w in rows else "-" for w in worlds]
        first = [max(v[0] for v in r["per_step"].values() if v) for r in rows.values()
                 if r.get("per_step")]
        worst = [max(r["errors"].values()) for r in rows.values() if r.get("per_step")]
        errors = f"{max(first):.0e} / {max(worst):.0e}" if first else ""
        lines.append(f"| {arch} | {computes} | " + " | ".join(cells) + f" | {errors} | "
                     + "<br>".join(why) + " |")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "src/plait"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + (" (src/plait modified)" if dirty else "")


def _host() -> dict:
    import torch

    return {"cores": os.cpu_count(), "torch": torch.__version__, "machine": platform.machine()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3", help="world sizes, comma-separated")
    parser.add_argument("--only", default="", help="architectures (model types), comma-separated")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where the results go")
    parser.add_argument("--merge", action="store_true",
                        help="keep the JSON's other architectures, replace those run")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    parser.add_argument("--docs", action="store_true", help="rewrite docs/conformance.md")
    parser.add_argument("--docs-only", action="store_true",
                        help="only rewrite docs/conformance.md from the JSON")
    args = parser.parse_args(argv)
    out = Path(args.json)
    if args.docs_only:
        write_docs(json.loads(out.read_text()))
        return 0
    import torch
    import transformers

    from plait.testing.tiny_hf import tp_model_types

    worlds = [int(w) for w in args.ranks.split(",") if w]
    archs = [a for a in args.only.split(",") if a] or tp_model_types()
    _preload()
    old = json.loads(out.read_text()) if args.merge and out.exists() else None
    kept = [r for r in (old or {}).get("results", []) if r["architecture"] not in archs]
    data = {"command": "scripts/hf_sweep.py " + " ".join(argv if argv is not None
                                                           else sys.argv[1:]),
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "host": _host(), "commit": _commit(), "worlds": worlds, "results": kept,
            "total_s": 0.0}
    if old is not None:
        data["command"], data["worlds"] = old["command"], old["worlds"]
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, arch in enumerate(archs, 1):
        rows = run_one(arch, worlds, args.timeout)
        data["results"].append(rows)
        data["results"] = [r for x in data["results"]
                           for r in (x if isinstance(x, list) else [x])]
        data["total_s"] = round((old or {}).get("total_s", 0) * (old is not None)
                                + time.perf_counter() - start, 1)
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"[{i}/{len(archs)}] {arch}: {_line(rows)}", flush=True)
    data["results"].sort(key=lambda r: (r["architecture"], r["world"]))
    out.write_text(json.dumps(data, indent=1) + "\n")
    _table(data["results"], worlds)
    print(f"{len(archs)} architectures in {time.perf_counter() - start:.0f} s; JSON: {out}")
    if args.docs:
        write_docs(data)
    bad = [r for r in data["results"] if r["outcome"] in ("DIFFERENT", "ERROR")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
