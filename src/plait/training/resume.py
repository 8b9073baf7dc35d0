"""Checkpoints and resume for ``plait train`` (``--checkpoint-dir``, ``--checkpoint-every``,
``--checkpoint-keep``, ``--resume``).

A checkpoint (:mod:`plait.checkpoint`, asynchronous) holds the model, AdamW's state and
param groups (the learning rate included), and as plain state: the number of steps done
(the schedule's position: ``lr_at`` is a function of the step), every step's record so
far (so a resumed run's ``log.json`` holds the whole trajectory), the data stream's
generator state, and the random number generators (torch's CPU one, Python's, numpy's),
rank 0's in ``extra_state`` and each rank's own in ``rank_state``. A rank the saving run
did not have (resumed on more ranks) takes rank 0's: every rank draws the same batches.

With ``--balance``, each rank's balancer state goes into its ``rank_state`` too (its
``state_dict``: plans, ZERO-resizing, policy counters, the speed monitor's readings, the
decision log). Resumed on the same ranks, the balancer continues where it was: the layers
move back to its plans, resized ones skip the same features, and the same readings lead to
the same decisions. The readings are timings, which no run repeats exactly, so a balanced
run resumes exactly only as far as its next decisions fall as the uninterrupted run's did
(a straggler clearly over the trigger and resizing clipped at ``max_skip`` decide alike;
a migration's sizes follow the measured speeds). On another world size the balancer starts
afresh from the plans the model was built with, and the resume line says so.

Resumed on the same ranks and plans, a run continues bit-identically: the same batches,
the same numbers in the same order. On another world size or plan, DCP reshards the
tensors exactly, but the sums of tensor parallelism run in another order, so the losses
agree within float tolerance only (``docs/training.md``).
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from ..checkpoint import Checkpointer, Loaded, SeededStream, latest, rng_state, set_rng_state
from ..parallel.layout import module_plans
from ..checkpoint.replicas import unwrap
from .components import Checkpointing

__all__ = ["SeededStream", "checkpoint_note", "resume_run",
           "checkpointing", "restore_balancer", "resharded_line"]

# the settings that decide the trajectory besides the model's shapes: a resumed run that
# changes one of them continues, and its first line says so
_TRAJECTORY = ("steps", "batch_size", "lr", "seq_len", "seed")


def checkpoint_note(cfg) -> str | None:
    """Before launching: what the run will do with ``--checkpoint-dir`` (a line to print), or
    a ValueError when DIR already holds checkpoints and ``--resume`` was not given (a new
    run would interleave its checkpoints with an old run's)."""
    if not cfg.checkpoint_dir:
        return None
    _check_writable(cfg.checkpoint_dir)
    newest = latest(cfg.checkpoint_dir)
    if newest is None:
        return f"no checkpoint in {cfg.checkpoint_dir}: starting at step 0" if cfg.resume \
            else None
    if not cfg.resume:
        raise ValueError(f"{cfg.checkpoint_dir} already holds checkpoints (newest "
                         f"{newest.name}): pass --resume to continue from it, or choose "
                         "another --checkpoint-dir")
    return f"resuming from {newest}"


def _check_writable(folder: str) -> None:
    """Refuse, before any training, a --checkpoint-dir that cannot take a checkpoint (a new
    user's read-only folder trained every step, then failed at the first save)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".plait-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"--checkpoint-dir {folder} cannot hold checkpoints: "
                         f"{exc.strerror or exc}") from None


def resume_run(cfg, model, optimizer, stream: SeededStream, parallel=None
               ) -> tuple[Checkpointer | None, int, list[dict], str | None]:
    """On every rank: the run's Checkpointer (None without ``--checkpoint-dir``; making it
    is a collective), the first step to run, the records of the steps before it, and with
    ``--resume`` the line saying what was restored and resharded. Restores the model, the
    optimizer, the data stream and the RNGs from the newest checkpoint, and the balancer of
    ``parallel`` (``plait.training.dp_tp.RankParallel``; None: no balancer) when the
    checkpoint holds one that fits (:func:`restore_balancer`)."""
    if not cfg.checkpoint_dir:
        return None, 0, [], None
    ckpt = Checkpointer(cfg.checkpoint_dir, keep=cfg.checkpoint_keep)
    found = ckpt.load(model, optimizer) if cfg.resume else None
    if found is None:
        return ckpt, 0, [], None
    own = found.rank_state if found.rank_state is not None else found.extra_state
    stream.load_state_dict(own["data"])
    set_rng_state(own["rng"])
    balancer_note = restore_balancer(parallel, found)
    line = resharded_line(found, model) + (f"; {balancer_note}" if balancer_note else "")
    changed = [f"--{k.replace('_', '-')} {found.extra_state['config'].get(k)} -> "
               f"{getattr(cfg, k)}" for k in _TRAJECTORY
               if found.extra_state["config"].get(k) != getattr(cfg, k)]
    if changed:
        line += "; changed since the checkpoint: " + ", ".join(changed)
    return ckpt, found.step, list(found.extra_state["records"]), line


def checkpointing(cfg, ckpt: Checkpointer, model, optimizer, stream: SeededStream,
                  done: list[dict], parallel=None) -> Checkpointing:
    """The loop's checkpoint component: every ``--checkpoint-every`` steps and after the last,
    an asynchronous checkpoint of everything the next step depends on (the balancer of
    ``parallel`` included: each rank's own state, after its step)."""
    balancer = getattr(parallel, "balancer", None)

    def state(steps_done: int, records: list[dict]) -> tuple[dict, dict]:
        own = {"data": stream.state_dict(), "rng": rng_state()}
        extra = {**own, "step": steps_done, "records": [dict(r) for r in records],
                 "config": {k: getattr(cfg, k) for k in ("model", *_TRAJECTORY)}}
        if balancer is not None:  # this rank's own: its kept features, its snapshots
            own["balancer"] = balancer.state_dict()
        return extra, own

    return Checkpointing(ckpt, model, optimizer, every=cfg.checkpoint_every, steps=cfg.steps,
                         state=state, blocking=False, records=done)


def restore_balancer(parallel, found: Loaded) -> str | None:
    """Continue the balancer of ``parallel`` (if it has one) from this rank's state in
    ``found``: its plans (the layers move back to them exactly, and data parallelism is
    rebuilt for them), each layer's ZERO-resizing and priority scores, each policy's
    counters, the speed monitor's readings and the decision log; the same decisions follow
    from the same readings. It fits only a checkpoint of the same policy on the same ranks
    and replicas (a state on another world size names other ranks): otherwise the balancer
    starts afresh, from the plans the model was built with and no readings, and the line
    returned says so. Every rank of the run calls it (a collective when plans move)."""
    balancer = getattr(parallel, "balancer", None)
    if balancer is None:
        return None
    saved = (found.rank_state or {}).get("balancer")
    header = None if saved is None else (saved["policy"], saved["world"], saved["replicas"])
    everyone = _gathered(header)  # every rank decides alike: restore all, or none
    if any(h is None for h in everyone):
        return (f"the balancer starts afresh: the checkpoint holds no balancer state for "
                f"{sum(h is None for h in everyone)} of {len(everyone)} ranks")
    mine = (balancer.config.name, balancer.world,
            1 if balancer.dp_group is None else dist.get_world_size(balancer.dp_group))
    if any(h != mine for h in everyone):
        return (f"the balancer starts afresh: its state was saved for (policy, tp ranks, "
                f"replicas) {everyone[0]}, this run has {mine}")
    moved = balancer.load_state_dict(saved)
    if moved and getattr(parallel, "mesh", None) is not None:
        from ..parallel.data import replanned

        replanned(parallel.model, parallel.mesh)  # DDP's reducer for the saved shapes
    resized = [f"{dim} keeps {[round(f, 2) for f in policy.fractions]}"
               for dim, policy in balancer.policies.items() if policy.fractions is not None]
    return (f"balancer restored at its step {balancer.steps} ({len(balancer.log)} decisions"
            + (f"; moved back to the saved plans of {', '.join(moved)}" if moved else "")
            + (f"; resized: {', '.join(resized)}" if resized else "") + ")")


def _gathered(value) -> list:
    """``value`` of every rank, in rank order (a collective; one process: ``[value]``)."""
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def resharded_line(found: Loaded, model) -> str:
    """What a resume restored: the step, and the world size and plans it moved from and to."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    now = module_plans(unwrap(model)[0])  # a DDP wrapper's names as the manifest's
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
