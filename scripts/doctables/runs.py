"""The stored runs (docs/results/NAME/run-K.json beside run-K.meta.json) and how every
table writes their figures: each run's, their median, and the command and runs they came from."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Callable


@dataclass(frozen=True)
class Run:
    """One stored run of a headline command: its JSON and the sidecar that says how it ran."""

    k: int
    data: dict
    meta: dict


class Results:
    """The runs under one results folder, read once per command name."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._cache: dict[str, list[Run]] = {}

    def runs(self, name: str) -> list[Run]:
        if name not in self._cache:
            runs = []
            for path in sorted((self.folder / name).glob("run-*.json")):
                m = re.fullmatch(r"run-(\d+)\.json", path.name)
                if not m:
                    continue  # the sidecars
                meta_path = path.with_name(f"run-{m[1]}.meta.json")
                if not meta_path.exists():
                    raise SystemExit(f"{path} has no {meta_path.name}: the command that made it is unknown")
                runs.append(Run(int(m[1]), json.loads(path.read_text()), json.loads(meta_path.read_text())))
            self._cache[name] = sorted(runs, key=lambda r: r.k)
        return self._cache[name]


def fmt(value, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    return format(value, spec)


def each(values: list, spec: str) -> str:
    """Every run's figure, in run order: ``1.33, 1.31``."""
    return ", ".join(fmt(v, spec) for v in values) if values else "–"


def med(values: list, spec: str) -> str:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        return "–"
    mid = median(nums)
    return fmt(round(mid) if spec.endswith("d") else mid, spec)


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def generic_command(runs: list[Run]) -> str:
    """The runs' command with the run number as K (they differ in nothing else)."""
    cmd = runs[-1].meta["command"]
    return re.sub(r"run-\d+", "run-K", cmd)


def when(run: Run) -> str:
    started = run.meta.get("started") or run.data.get("meta", {}).get("time", "?")
    return started[:16].replace("T", " ") + " UTC"


def provenance(name: str, runs: list[Run]) -> str:
    if not runs:
        return (f"No run stored yet (`scripts/results.sh --only {name}` makes them). ")
    host = runs[-1].meta.get("host", {})
    lines = [f"`{generic_command(runs)}`" + (" (its `demo.json`)" if runs[-1].meta.get("json_from") else ""), ""]
    per_run = "; ".join(
        f"run {r.k}: {when(r)}, plait {r.meta.get('host', {}).get('commit', '?')}"
        + (" with local changes" if r.meta.get("host", {}).get("dirty") else "")
        + f", {r.meta.get('wall_s', '?')} s, load {str(r.meta.get('loadavg_before', '?')).split()[0]} before"
        + (f", exit {r.meta['exit']} (a check in its output failed)" if r.meta.get("exit") else "")
        for r in runs)
    lines.append(f"Runs ({len(runs)}) — {per_run}. Host: {host.get('cores', '?')} cores "
                 f"({host.get('cpu') or 'cpu unknown'}), torch {host.get('torch', '?')}, "
                 f"Python {host.get('python', '?')}. JSON: [docs/results/{name}/]({link_to(name)}).")
    return "\n".join(lines)


def link_to(name: str) -> str:
    """Relative link from a file in docs/ to a results folder (README's links are rebased)."""
    return f"results/{name}/"


def figures(runs: list[Run], get: Callable[[Run], object]) -> list:
    out = []
    for r in runs:
        try:
            out.append(get(r))
        except (KeyError, IndexError, TypeError, ZeroDivisionError, StopIteration):
            out.append(None)
    return out


def rate_Bps(link: str) -> float | None:
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", str(link).lower())
    if not m:
        return None
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8
