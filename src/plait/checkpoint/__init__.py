"""Sharded checkpoints of plait models through ``torch.distributed.checkpoint`` (DCP).

    from plait import checkpoint

    ckpt = checkpoint.Checkpointer("runs/a", keep=2)        # collective
    ckpt.save(step, model, optimizer, extra_state, blocking=False)
    ckpt.wait()
    found = ckpt.load(model, optimizer)                      # under any plan, any world size
    checkpoint.export("runs/a", "model.safetensors")         # one file, the plain model

Every rank writes its own shards (nobody gathers the model), DCP's files are the
format, and loading reshards: a checkpoint saved on 3 ranks with heads [3, 5, 2] loads on
2 ranks with an even split, or into the plain single-process model.

How shards are described to DCP. A plait shard is uneven, changes at run time (the
balancer migrates it), and may be several disjoint slices of the full tensor (a fused QKV
weight's shard is q-, k- and v-head rows). ``DTensor.from_local`` would place an uneven
shard at the even split's offset, and one DTensor is one box; so plait uses DCP's
checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), the hooks DTensor itself implements: a
:class:`~plait.checkpoint.pieces.Pieces` lists each contiguous slice as its own chunk with
its true global offsets (:mod:`plait.parallel.layout`), and DCP's own resharding reads the
overlaps on load (two small planner subclasses look the hooks up on objects).

A data-parallel model (DDP's wrapper, or FSDP2's DTensors sharded over dp) is saved and
loaded under its plain model's names: :mod:`plait.checkpoint.replicas`.

Nothing half-written is ever loaded: a save goes to ``.tmp-step-N``, rank 0 writes a
manifest (sha256 and size of every file, every tensor's full shape, the plans, plait's
version) and publishes with one ``os.rename``; a load verifies all of it first, on every
rank, before any parameter changes. See ``docs/checkpoints.md``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .checkpointer import Checkpointer, CheckpointError, Loaded
from .export import export, full_tensors
from .pretrained import from_pretrained, materialize
from .shards import load_shards
from .sources import CheckpointFileError
from .run_state import SeededStream, rng_state, set_rng_state
from .store import latest

__all__ = ["Checkpointer", "CheckpointError", "Loaded", "save", "load", "latest", "verify",
           "export", "full_tensors", "SeededStream", "rng_state", "set_rng_state",
           "from_pretrained", "materialize", "load_shards", "CheckpointFileError"]


def save(root: str | os.PathLike, step: int, model, optimizer=None, extra_state: Any = None,
         *, keep: int = 2, rank_state: Any = None) -> Path | None:
    """One blocking checkpoint of ``model`` (and ``optimizer``, ``extra_state``) as
    ``root/step-<step>`` (a collective; a training loop keeps one :class:`Checkpointer`)."""
    return Checkpointer(root, keep=keep).save(step, model, optimizer, extra_state,
                                              rank_state=rank_state)


def load(path: str | os.PathLike, model, optimizer=None) -> Loaded | None:
    """Restore from ``path``: a ``step-N`` directory, or a root (its newest; None if it
    has none). A collective. See :meth:`Checkpointer.load`."""
    path = Path(path)
    if path.name.startswith("step-"):
        return Checkpointer(path.parent).load(model, optimizer, path=path)
    return Checkpointer(path).load(model, optimizer)


def verify(path: str | os.PathLike, model=None) -> list[str]:
    """Every problem with the checkpoint at ``path`` (all files checked in this process;
    with ``model``, also whether it is that model's): empty when it is sound."""
    from .checkpointer import verify_problems

    manifest, problems = verify_problems(Path(path), None, None, 0, 1)
    if manifest is not None and model is not None and not problems:
        from .state import model_shapes
        from .store import model_problems

        problems = model_problems(path, manifest, model_shapes(model))
    return problems
