"""Rewrite the tables in README.md and docs/*.md from the runs stored in docs/results/.

    python scripts/docs_tables.py            # rewrite every generated region
    python scripts/docs_tables.py --check    # exit 1 (and show the difference) where a region
                                             # is not what the stored JSON gives

A generated region is delimited in the Markdown by

    <!-- generated: KEY -->
    ...
    <!-- end generated -->

and KEY names one of the tables below (``--list`` prints them). Each run is a folder entry
docs/results/NAME/run-K.json (the command's own JSON) beside run-K.meta.json (the exact
command, when it ran, how long, the host), both written by scripts/results.sh. Every table
shows each run's figure (run 1, run 2, ...) and their median, and names the command and
the runs' dates; README's headline table takes a figure only once two runs have it.

The tables are written by scripts/doctables/, a module per family of benchmarks (runs.py
reads the runs); this file maps each KEY to its table and rewrites the pages.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path
from typing import Callable

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # doctables beside this file, run as a script or loaded by the tests
    sys.path.insert(0, HERE)

from doctables.decode import decode_table  # noqa: E402
from doctables.experts import experts_table  # noqa: E402
from doctables.headline import headline_table  # noqa: E402
from doctables.hetero import hetero_table, settled  # noqa: E402,F401 (tests read settled here)
from doctables.ops import (collectives_table, ops_summary_table, ops_table,  # noqa: E402
                           priority_table, shm_collectives_table, shm_ops_table)
from doctables.runs import Results  # noqa: E402
from doctables.simulate import sim_table, validate_table  # noqa: E402
from doctables.state import checkpoint_table, load_table  # noqa: E402
from doctables.training import demo_table, placement_table, tp_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REGION = re.compile(r"(<!-- generated: ([\w.-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)
DOCS = ("README.md", "docs/*.md", "docs/results/*.md")  # results pages: the runs' histories

GENERATORS: dict[str, Callable[[Results], str]] = {
    "bench-load": load_table,
    "bench-collectives-quick": collectives_table,
    "bench-ops-quick": ops_table,
    "bench-ops-quick-summary": ops_summary_table,
    "comm-priority": priority_table,
    "simulate-h100-16k": sim_table,
    "simulate-validate": validate_table,
    "bench-tp-quick": tp_table,
    "bench-tp-hf-llama-compile": lambda res: tp_table(res, "bench-tp-hf-llama-compile"),
    "bench-hetero-quick": hetero_table,
    **{name: (lambda res, name=name: hetero_table(res, name)) for name in (
        "bench-hetero", "bench-hetero-kernel", "bench-hetero-graded", "bench-hetero-graded-kernel",
        "bench-hetero-drift", "bench-hetero-jitter", "bench-hetero-moving", "bench-hetero-two",
        "bench-hetero-noisy")},
    "demo": demo_table,
    "bench-checkpoint": checkpoint_table,
    "bench-tp-dp": placement_table,
    "bench-collectives-shm": shm_collectives_table,
    "bench-ops-shm": shm_ops_table,
    **{name: (lambda res, name=name: decode_table(res, name)) for name in (
        "bench-decode", "bench-decode-3", "bench-decode-slow", "bench-decode-hosts")},
    **{name: (lambda res, name=name: experts_table(res, name)) for name in (
        "bench-experts", "bench-experts-slow", "bench-experts-3")},
    "headline": headline_table,
}



def rebase_links(text: str, doc: Path, root: Path) -> str:
    """Generators write links as seen from docs/; a file elsewhere gets them rebased."""
    if doc.parent == root / "docs":
        return text
    if doc.parent == root / "docs" / "results":  # a results page, beside the runs' folders

        def beside(m: re.Match) -> str:
            target = m[1]
            return f"]({target[len('results/'):]})" if target.startswith("results/") \
                else f"](../{target})"
        return re.sub(r"\]\((?!https?:|#|/)([^)]+)\)", beside, text)
    return re.sub(r"\]\((?!https?:|#|/)([^)]+)\)", r"](docs/\1)", text)


def render(doc_text: str, doc: Path, root: Path, res: Results) -> str:
    def one(m: re.Match) -> str:
        key = m[2]
        if key not in GENERATORS:
            raise SystemExit(f"{doc.relative_to(root)}: unknown generated region {key!r} "
                             f"(known: {', '.join(sorted(GENERATORS))})")
        body = rebase_links(GENERATORS[key](res), doc, root).rstrip("\n")
        return f"{m[1]}{body}\n{m[4]}"
    return REGION.sub(one, doc_text)


def documents(root: Path) -> list[Path]:
    out = []
    for pattern in DOCS:
        out += sorted(root.glob(pattern))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 where a region is stale")
    ap.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this script's)")
    ap.add_argument("--list", action="store_true", help="list the region keys")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(sorted(GENERATORS)))
        return 0
    root = args.root.resolve()
    res = Results(root / "docs" / "results")
    stale = []
    for doc in documents(root):
        old = doc.read_text()
        new = render(old, doc, root, res)
        if new == old:
            continue
        stale.append(doc)
        if args.check:
            rel = str(doc.relative_to(root))
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                       rel, rel + " (from the JSON)", n=1))
        else:
            doc.write_text(new)
            print(f"rewrote {doc.relative_to(root)}")
    if args.check and stale:
        print(f"\n{len(stale)} file(s) differ from docs/results/: run python scripts/docs_tables.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
