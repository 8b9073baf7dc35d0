"""What an elastic run's logs say: recovery time, steps lost, the final held-out loss.

Pure functions over the workers' JSONL logs (``plait.elastic.worker``): one list of
records per rank-0 incarnation, each record a dict with ``event`` (``start``, ``step``,
``end``) and ``time`` (seconds since the epoch).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_incarnations", "summarize"]


def read_incarnations(logs: Path) -> list[list[dict]]:
    """Every incarnation's records, oldest first (lines cut short by a kill are dropped)."""
    found = []
    for path in sorted(Path(logs).glob("incarnation-*.jsonl")):
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the last line of an incarnation killed while writing it
        if records:
            found.append(records)
    return sorted(found, key=lambda recs: recs[0]["time"])


def summarize(incarnations: list[list[dict]], kill_time: float | None = None) -> dict:
    """The run in figures.

    ``worlds``: each incarnation's world size; ``heldout_loss``: the last incarnation's;
    ``steps``: the last step logged. With ``kill_time`` (when the host was killed):
    ``last_step_before_kill``, ``resumed_from`` (the checkpoint the first incarnation
    after the kill loaded), ``steps_lost`` (their difference: steps done twice),
    ``restart_s`` (kill → that incarnation's log opened: the agents noticed, re-formed
    the world, the workers started and loaded the checkpoint), ``recovery_s`` (kill → its first step done)."""
    starts = [recs[0] for recs in incarnations if recs[0].get("event") == "start"]
    steps = [r for recs in incarnations for r in recs if r.get("event") == "step"]
    ends = [r for recs in incarnations for r in recs if r.get("event") == "end"]
    out = {"incarnations": len(incarnations), "worlds": [s["world_size"] for s in starts],
           "restarts": [s["restart"] for s in starts],
           "steps": max((r["step"] for r in steps), default=0),
           "heldout_loss": ends[-1]["heldout_loss"] if ends else None,
           "final_world_size": ends[-1]["world_size"] if ends else None,
           "losses": _last_loss_per_step(steps)}
    if kill_time is None:
        return out
    before = [r["step"] for r in steps if r["time"] <= kill_time]
    after = [recs for recs in incarnations if recs[0]["time"] > kill_time]
    out["last_step_before_kill"] = max(before, default=0)
    if not after:
        return out
    first = after[0]
    out["resumed_from"] = first[0]["resumed_from"]
    out["steps_lost"] = out["last_step_before_kill"] - out["resumed_from"]
    out["restart_s"] = first[0]["time"] - kill_time
    out["world_after_kill"] = first[0]["world_size"]
    first_step = next((r for r in first if r.get("event") == "step"), None)
    out["recovery_s"] = None if first_step is None else first_step["time"] - kill_time
    return out


def _last_loss_per_step(steps: list[dict]) -> dict[int, float]:
    """Step → loss of the last incarnation that did it (a step redone after a kill: once)."""
    losses: dict[int, float] = {}
    for record in steps:
        losses[record["step"]] = record["loss"]
    return dict(sorted(losses.items()))
