"""Scenario files: per-rank slowdowns over the steps of a run, written down and replayed.

A scenario file is a JSON object (``examples/scenarios/`` has four)::

    {"name": "drift",
     "about": "rank 1 slows from 1x to 2x over the run",
     "by": "run",
     "slow": [{"rank": 1, "factor": [[0, 1.0], [1, 2.0]]}]}

- ``name`` (optional): the scenario's name in tables and JSON; default the file's stem.
- ``about`` (optional): free text, kept in every record.
- ``by`` (optional): what the x of a factor's points counts: ``"step"`` (default: the
  training step, from 0) or ``"run"`` (the share of the run: 0 the first step, 1 the last,
  so one file fits a run of any length).
- ``slow``: a list of entries, each:

  - ``rank``: a rank (≥ 0), ``"last"``, or ``"all"`` (every rank, each its own jitter);
  - ``factor``: how many times slower the rank computes (≥ 1): a number, or points
    ``[[x, factor], …]`` (x increasing) joined by straight lines, flat outside them;
  - ``jitter`` (optional): ``{"amplitude": a, "kind": "random" | "periodic", "period": n,
    "seed": s, "phase": q}`` multiplies the factor by ``1 + a · u``, u in [−1, 1] (a in [0, 1),
    and the factor times ``1 − a`` at least 1: a slowdown emulated by sleeping cannot speed a
    rank up). ``random`` (default): u uniform, a new draw every ``period`` steps (default 1),
    from (``seed``, rank, step // period), the same in every process. ``periodic``: u =
    sin(2π (step + phase) / period), period ≥ 2 steps required; with ``"rank": "all"`` the
    default phase puts rank r r/p of a period after rank 0.

Entries for the same rank multiply. The file becomes :class:`~plait.runtime.slow.straggler.SlowCurve`
values, the straggler emulation's (``Scenario.specs(world, steps)``). A refusal is one line
naming the file and the field: ``drift.json: slow[0].factor[1][1] must be a number ≥ 1, got
0.5``. The x of the points is steps, not seconds: a run's steps are what the benchmark's
ideal and its interleaved runs share (seconds differ between policies).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

from .straggler import JITTERS, SlowCurve

__all__ = ["Scenario", "load_scenario", "parse_scenario", "BY"]

BY = ("step", "run")
_TOP = ("name", "about", "by", "slow")
_ENTRY = ("rank", "factor", "jitter")
_JITTER = ("amplitude", "kind", "period", "seed", "phase")


@dataclass(frozen=True)
class Scenario:
    """A parsed scenario file: ``entries`` are the checked ``slow`` entries, ``data`` the
    file's object as read (recorded with every run), ``source`` where it came from."""

    name: str
    about: str
    by: str
    entries: tuple[dict, ...]
    data: dict
    source: str

    def specs(self, world: int, steps: int) -> list[SlowCurve]:
        """The slowdowns on ``world`` ranks in a run of ``steps`` steps."""
        out = []
        for i, entry in enumerate(self.entries):
            rank = entry["rank"]
            if isinstance(rank, int) and rank >= world:
                raise ValueError(f"{self.source}: slow[{i}].rank {rank} is not one of the "
                                 f"{world} ranks (0..{world - 1})")
            ranks = (range(world) if rank == "all" else [world - 1] if rank == "last"
                     else [rank])
            scale = max(steps - 1, 0) if self.by == "run" else 1
            points = tuple((x * scale, f) for x, f in entry["factor"])
            if self.by == "run" and len(points) > 1 and steps < 2:
                points = points[:1]  # a one-step run has one x
            jitter = entry.get("jitter") or {}
            for r in ranks:
                phase = jitter.get("phase")
                if phase is None:
                    phase = (r * jitter.get("period", 1) / world) if rank == "all" else 0.0
                out.append(SlowCurve(rank=r, points=points,
                                     amplitude=jitter.get("amplitude", 0.0),
                                     jitter=jitter.get("kind", "random"),
                                     period=jitter.get("period", 1), phase=phase,
                                     seed=jitter.get("seed", 0)))
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "source": self.source, "file": self.data}


def load_scenario(path: str) -> Scenario:
    """Read and check a scenario file (see the module doc); ValueError names the field."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc.msg} at line {exc.lineno} column "
                         f"{exc.colno}") from None
    stem = os.path.splitext(os.path.basename(path))[0]
    return parse_scenario(data, source=path, default_name=stem)


def parse_scenario(data: Any, *, source: str = "scenario", default_name: str = "file") -> Scenario:
    """Check a scenario's object (a file's JSON) and build it; ValueError names the field."""
    def bad(field: str, problem: str) -> ValueError:
        return ValueError(f"{source}: {field} {problem}")

    if not isinstance(data, dict):
        raise bad("the file", f"must be a JSON object, got {type(data).__name__}")
    _known(data, _TOP, "the file", bad)
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name.strip() or "," in name:
        raise bad("name", f"must be a non-empty string without commas, got {name!r}")
    about = data.get("about", "")
    if not isinstance(about, str):
        raise bad("about", f"must be a string, got {about!r}")
    by = data.get("by", "step")
    if by not in BY:
        raise bad("by", f"must be one of {list(BY)}, got {by!r}")
    slow = data.get("slow")
    if not isinstance(slow, list) or not slow:
        raise bad("slow", f"must be a non-empty list of entries, got {slow!r}")
    entries = tuple(_entry(e, f"slow[{i}]", by, bad) for i, e in enumerate(slow))
    return Scenario(name=name.strip(), about=about, by=by, entries=entries, data=data,
                    source=source)


def _known(obj: dict, keys: tuple[str, ...], where: str, bad) -> None:
    for key in obj:
        if key not in keys:
            raise bad(where, f"has an unknown key {key!r}; known: {', '.join(keys)}")


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _entry(entry: Any, where: str, by: str, bad) -> dict:
    if not isinstance(entry, dict):
        raise bad(where, f"must be an object with rank and factor, got {entry!r}")
    _known(entry, _ENTRY, where, bad)
    rank = entry.get("rank")
    if rank not in ("all", "last") and not (
            isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0):
        raise bad(f"{where}.rank", f"must be a rank ≥ 0, \"last\" or \"all\", got {rank!r}")
    points = _points(entry.get("factor"), f"{where}.factor", by, bad)
    out = {"rank": rank, "factor": points}
    if "jitter" in entry:
        out["jitter"] = _jitter(entry["jitter"], f"{where}.jitter", min(f for _, f in points),
                                bad)
    return out


def _points(factor: Any, where: str, by: str, bad) -> tuple[tuple[float, float], ...]:
    if _number(factor):
        if factor < 1:
            raise bad(where, f"must be a number ≥ 1 (a slower rank), got {factor!r}")
        return ((0.0, float(factor)),)
    if not isinstance(factor, list) or not factor:
        raise bad(where, f"must be a number ≥ 1 or a list of [x, factor] points, got {factor!r}")
    points = []
    for i, point in enumerate(factor):
        if not (isinstance(point, list) and len(point) == 2):
            raise bad(f"{where}[{i}]", f"must be a pair [x, factor], got {point!r}")
        x, f = point
        top = "1 (by run)" if by == "run" else "any step"
        if not _number(x) or x < 0 or (by == "run" and x > 1):
            raise bad(f"{where}[{i}][0]", f"must be a number from 0 to {top}, got {x!r}")
        if points and x <= points[-1][0]:
            raise bad(f"{where}[{i}][0]", f"must be after the point before's {points[-1][0]:g}"
                                          f", got {x!r}")
        if not _number(f) or f < 1:
            raise bad(f"{where}[{i}][1]", f"must be a number ≥ 1 (a slower rank), got {f!r}")
        points.append((float(x), float(f)))
    return tuple(points)


def _jitter(jitter: Any, where: str, lowest: float, bad) -> dict:
    if not isinstance(jitter, dict):
        raise bad(where, f"must be an object with an amplitude, got {jitter!r}")
    _known(jitter, _JITTER, where, bad)
    amplitude = jitter.get("amplitude")
    if not _number(amplitude) or not 0 <= amplitude < 1:
        raise bad(f"{where}.amplitude", f"must be a number in [0, 1), got {amplitude!r}")
    if lowest * (1 - amplitude) < 1 - 1e-12:
        raise bad(f"{where}.amplitude", f"{amplitude:g} takes the factor {lowest:g} below 1 "
                                        f"({lowest:g} × {1 - amplitude:g}): a sleep cannot speed "
                                        "a rank up; raise the factor")
    kind = jitter.get("kind", "random")
    if kind not in JITTERS:
        raise bad(f"{where}.kind", f"must be one of {list(JITTERS)}, got {kind!r}")
    least = 2 if kind == "periodic" else 1
    if kind == "periodic" and "period" not in jitter:
        raise bad(f"{where}.period", "is needed by periodic jitter (steps per cycle, ≥ 2)")
    period = jitter.get("period", 1)
    if not isinstance(period, int) or isinstance(period, bool) or period < least:
        raise bad(f"{where}.period", f"must be a whole number of steps ≥ {least}, got "
                                     f"{period!r}")
    seed = jitter.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise bad(f"{where}.seed", f"must be an integer, got {seed!r}")
    out = {"amplitude": float(amplitude), "kind": kind, "period": period, "seed": seed}
    if "phase" in jitter:
        if not _number(jitter["phase"]):
            raise bad(f"{where}.phase", f"must be a number of steps, got {jitter['phase']!r}")
        out["phase"] = float(jitter["phase"])
    return out
