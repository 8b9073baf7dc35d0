"""Checkpoints and resume for ``plait train`` (``--checkpoint-dir``, ``--checkpoint-every``,
``--checkpoint-keep``, ``--resume``).

A checkpoint (:mod:`plait.checkpoint`, asynchronous) holds the model, AdamW's state and
param groups (the learning rate included), and as plain state: the number of steps done
(the schedule's position: ``lr_at`` is a function of the step), every step's record so
far (so a resumed run's ``log.json`` holds the whole trajectory), the data stream's
generator state, and the random number generators (torch's CPU one, Python's, numpy's),
rank 0's in ``extra_state`` and each rank's own in ``rank_state``. A rank the saving run
did not have (resumed on more ranks) takes rank 0's: every rank draws the same batches.

Resumed on the same ranks and plans, a run continues bit-identically: the same batches,
the same numbers in the same order. On another world size or plan, DCP reshards the
tensors exactly, but the sums of tensor parallelism run in another order, so the losses
agree within float tolerance only (``docs/training.md``).
"""

from __future__ import annotations

from typing import Callable

from .checkpoint import Checkpointer, Loaded, SeededStream, latest, rng_state, set_rng_state
from .checkpoint.layout import module_plans

__all__ = ["SeededStream", "check_checkpoint_flags", "checkpoint_note", "resume_run",
           "checkpoint_after", "resharded_line"]

# the settings that decide the trajectory besides the model's shapes: a resumed run that
# changes one of them continues, and its first line says so
_TRAJECTORY = ("steps", "batch_size", "lr", "seq_len", "seed")


def check_checkpoint_flags(cfg) -> None:
    """Refuse impossible checkpoint flags (called by ``TrainConfig``)."""
    for name in ("checkpoint_every", "checkpoint_keep"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                             f"got {value!r}")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir DIR (the checkpoints to resume from)")


def checkpoint_note(cfg) -> str | None:
    """Before launching: what the run will do with ``--checkpoint-dir`` (a line to print), or
    a ValueError when DIR already holds checkpoints and ``--resume`` was not given (a new
    run would interleave its checkpoints with an old run's)."""
    if not cfg.checkpoint_dir:
        return None
    newest = latest(cfg.checkpoint_dir)
    if newest is None:
        return f"no checkpoint in {cfg.checkpoint_dir}: starting at step 0" if cfg.resume \
            else None
    if not cfg.resume:
        raise ValueError(f"{cfg.checkpoint_dir} already holds checkpoints (newest "
                         f"{newest.name}): pass --resume to continue from it, or choose "
                         "another --checkpoint-dir")
    return f"resuming from {newest}"


def resume_run(cfg, model, optimizer, stream: SeededStream
               ) -> tuple[Checkpointer | None, int, list[dict], str | None]:
    """On every rank: the run's Checkpointer (None without ``--checkpoint-dir``; making it
    is a collective), the first step to run, the records of the steps before it, and with
    ``--resume`` the line saying what was restored and resharded. Restores the model, the
    optimizer, the data stream and the RNGs from the newest checkpoint."""
    if not cfg.checkpoint_dir:
        return None, 0, [], None
    ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint_keep)
    found = ckpt.load(model, optimizer) if cfg.resume else None
    if found is None:
        return ckpt, 0, [], None
    own = found.rank_state if found.rank_state is not None else found.extra_state
    stream.load_state_dict(own["data"])
    set_rng_state(own["rng"])
    line = resharded_line(found, model)
    changed = [f"--{k.replace('_', '-')} {found.extra_state['config'].get(k)} -> "
               f"{getattr(cfg, k)}" for k in _TRAJECTORY
               if found.extra_state["config"].get(k) != getattr(cfg, k)]
    if changed:
        line += "; changed since the checkpoint: " + ", ".join(changed)
    return ckpt, found.step, list(found.extra_state["records"]), line


def checkpoint_after(on_step: Callable[[dict], None], cfg, ckpt: Checkpointer, model,
                     optimizer, stream: SeededStream, done: list[dict]
                     ) -> Callable[[dict], None]:
    """``on_step`` followed, every ``--checkpoint-every`` steps and after the last, by an
    asynchronous checkpoint of everything the next step depends on."""
    records = list(done)

    def step_then_save(record: dict) -> None:
        on_step(record)
        records.append(record)
        steps_done = record["step"] + 1
        if steps_done % cfg.checkpoint_every and steps_done != cfg.steps:
            return
        own = {"data": stream.state_dict(), "rng": rng_state()}
        extra = {**own, "step": steps_done, "records": [dict(r) for r in records],
                 "config": {k: getattr(cfg, k) for k in ("model", *_TRAJECTORY)}}
        ckpt.save(steps_done, model, optimizer, extra, rank_state=own, blocking=False)

    return step_then_save


def resharded_line(found: Loaded, model) -> str:
    """What a resume restored: the step, and the world size and plans it moved from and to."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    now = module_plans(model)
    head = f"resumed from {found.path} at step {found.step}"
    if found.world_size == world and found.plans == now:
        return f"{head} (the same {world} ranks and plans)"
    moves: dict[tuple[str, str], list[str]] = {}
    for name in sorted(set(found.plans) | set(now)):
        old, new = found.plans.get(name), now.get(name)
        if old != new:
            moves.setdefault((str(old), str(new)), []).append(name)
    parts = [f"{old} -> {new} ({_names(names)})" for (old, new), names in moves.items()]
    return (f"{head}: saved on {found.world_size} ranks, resharded onto {world}: "
            + ("; ".join(parts) or "the same plans"))


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
