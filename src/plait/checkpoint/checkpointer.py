"""``Checkpointer``: save (blocking or asynchronous), publish, verify and load.

    ckpt = Checkpointer("runs/a", keep=2)            # collective: every rank builds one
    ckpt.save(step, model, optimizer, extra_state={"data": pos, "rng": rng}, blocking=False)
    ...                                              # training goes on while it writes
    ckpt.wait()                                      # before exit: the last one published
    found = ckpt.load(model, optimizer)              # the newest; None when there is none
    found.step, found.extra_state

Every collective runs on the checkpointer's own gloo group (``timeout_s``), so an
asynchronous save's planning and agreement, in DCP's background thread, never
interleave with training's collectives on the default group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from . import store
from ..parallel.layout import module_plans
from .pieces import LoadPlanner, SavePlanner, Staged
from .replicas import unwrap
from .state import (apply, destinations, model_shapes, model_tensors, optimizer_index,
                    snapshot, unpack)
from .writer import Writer

__all__ = ["Checkpointer", "CheckpointError", "Loaded"]

log = logging.getLogger("plait.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint not written, or refused on load: one line naming the file and why."""


@dataclass(frozen=True)
class Loaded:
    """What :meth:`Checkpointer.load` restored: the step, the caller's plain state (rank 0's
    ``extra_state``), this rank's ``rank_state`` (None if none was saved for this rank),
    the path, and the plans the checkpoint was saved under (``{module: sizes}``)."""

    step: int
    extra_state: Any
    rank_state: Any
    path: Path
    plans: dict
    world_size: int


# DCP's CheckpointException (every rank's failures, gathered) is a BaseException
_FAILURES = (Exception, CheckpointException)


class _Published:
    """Rank 0's outcome of publishing an asynchronous save: None (published) or the error."""

    def __init__(self):
        self._done, self._error = threading.Event(), None

    def set(self, error: str | None) -> None:
        self._error = error
        self._done.set()

    def get(self) -> str | None:
        self._done.wait()
        return self._error


@contextlib.contextmanager
def quiet(distributed: bool):
    """DCP warns on every call in one process that it assumes one process: it is meant."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _one_line(err: BaseException) -> str:
    """An exception as one line; DCP's CheckpointException as its first failing rank's."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"rank {rank}: {_one_line(inner)}"
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class Checkpointer:
    """Checkpoints of one run under ``root`` (see the module docstring).

    ``keep``: published checkpoints kept (the newest). ``on_error``: ``"raise"`` a
    :class:`CheckpointError` when a save fails (every rank), or ``"warn"``: log it and go on
    (the previous checkpoint stays). ``timeout_s``: every collective's limit."""

    def __init__(self, root: str | os.PathLike, *, keep: int = 2, on_error: str = "raise",
                 timeout_s: float = 600.0, thread_count: int = 1):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.root, self.keep, self.on_error = Path(root), keep, on_error
        self.thread_count = thread_count
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) \
            if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self._pending = None  # an async save: (step, tmp, manifest, future, _Published)

    # --- agreement -----------------------------------------------------------
    def _gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _barrier(self) -> None:
        self._gather(None)

    def _agree(self, problems: list[str]) -> str | None:
        """The first problem any rank found (in rank order), the same on every rank."""
        everyone = self._gather(problems)
        return next((p for found in everyone for p in found), None)

    def _clear_tmp(self) -> None:
        if self.rank == 0:
            gone = store.clear_tmp(self.root)
            if gone:
                log.info("checkpoint: removed unfinished %s under %s", ", ".join(gone), self.root)
        self._barrier()

    # --- save ----------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer=None, extra_state: Any = None,
             *, rank_state: Any = None, blocking: bool = True) -> Path | None:
        """Checkpoint ``model`` (and ``optimizer``, ``extra_state``: plain values, rank 0's
        kept; ``rank_state``: each rank's own) as step ``step`` (every rank calls it).

        Blocking: returns the published ``step-N`` once it is on disk. Not blocking: copies
        the tensors to the CPU, starts DCP's ``async_save`` and returns None at once; rank 0
        publishes the checkpoint as soon as every rank's write has finished, and the next
        ``save``, ``wait`` or ``load`` reports the outcome (a failed save's
        :class:`CheckpointError` is raised there)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        self.wait()
        self._clear_tmp()
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
        self._barrier()
        tmp = store.tmp_dir(self.root, step)
        manifest = self._manifest(step, model, optimizer, rank_state is not None)
        state = snapshot(model, optimizer, extra_state, rank_state, self.rank)
        writer = Writer(tmp, thread_count=self.thread_count)
        if blocking:
            try:
                with quiet(self.distributed):
                    dcp.save(state, storage_writer=writer, planner=SavePlanner(),
                             process_group=self.group, no_dist=not self.distributed)
                error = None
            except _FAILURES as err:  # noqa: BLE001 - every rank reports it, as one line
                error = _one_line(err)
            return self._finish(step, tmp, manifest, error)
        future = dcp.async_save(state, storage_writer=writer, planner=SavePlanner(),
                                process_group=self.group, async_stager=Staged(),
                                no_dist=not self.distributed)
        published = _Published()
        if self.rank == 0:  # DCP's write succeeds on rank 0 only once every rank's has
            future.add_done_callback(lambda f: published.set(
                None if f.exception() is not None else self._publish(step, tmp, manifest)))
        self._pending = (step, tmp, manifest, future, published)
        return None

    def _manifest(self, step, model, optimizer, rank_states: bool) -> dict:
        """The manifest (without its files), every rank's tensors in it (a collective:
        a ShardedEmbeddingBag table and its optimizer state live on its owner only)."""
        from .. import __version__

        tensors, aliases = model_tensors(model)
        shapes = model_shapes(model)
        dtypes, index = {}, {}
        local_index = None if optimizer is None else optimizer_index(model, optimizer)
        for their_dtypes, their_index in self._gather(
                ({k: str(t.dtype) for k, t in tensors.items()}, local_index)):
            dtypes.update(their_dtypes)
            index.update(their_index or {})
        return {"format": store.FORMAT, "plait_version": __version__,
                "torch_version": torch.__version__, "step": step, "world_size": self.world,
                "params": {k: {"shape": v, "dtype": dtypes.get(k)} for k, v in shapes.items()},
                "aliases": aliases, "plans": module_plans(unwrap(model)[0]),
                "optimizer": None if optimizer is None else dict(sorted(index.items())),
                "param_groups": None if optimizer is None else len(optimizer.param_groups),
                "rank_states": self.world if rank_states else 0}

    def _publish(self, step: int, tmp: Path, manifest: dict) -> str | None:
        """Rank 0: publish ``tmp`` as ``step-N`` and prune; an error as one line, or None."""
        try:
            final = store.final_dir(self.root, step)
            store.publish(tmp, final, manifest)
            store.prune(self.root, self.keep)
            return None
        except _FAILURES as err:  # noqa: BLE001 - reported on every rank by _finish
            return _one_line(err)

    def _finish(self, step: int, tmp: Path, manifest: dict | None,
                error: str | None) -> Path | None:
        """Agree on the outcome; with ``manifest``, rank 0 publishes first when its write
        succeeded (DCP's write returns on rank 0 only after every rank's succeeded)."""
        if self.rank == 0 and error is None and manifest is not None:
            error = self._publish(step, tmp, manifest)
        first = self._agree([error] if error else [])
        if first is None:
            return store.final_dir(self.root, step)
        if self.rank == 0:
            store.clear_tmp(self.root)
        line = (f"checkpoint step {step} was not saved ({first}); "
                f"{store.latest(self.root) or 'no earlier checkpoint'} is intact")
        if self.on_error == "raise":
            raise CheckpointError(line)
        if self.rank == 0:
            log.warning("%s", line)
        return None

    def wait(self) -> Path | None:
        """Finish the pending asynchronous save (if any): its published path, or its error
        (raised, or warned, on every rank). Every rank calls it."""
        if self._pending is None:
            return None
        step, tmp, manifest, future, published = self._pending
        self._pending = None
        try:
            future.result()
            error = None
        except _FAILURES as err:  # noqa: BLE001
            error = _one_line(err)
        if self.rank == 0 and error is None:
            error = published.get()  # rank 0's done-callback published it (or failed to)
        return self._finish(step, tmp, None, error)

    def close(self) -> None:
        self.wait()

    # --- load ----------------------------------------------------------------
    def latest(self) -> Path | None:
        return store.latest(self.root)

    def load(self, model: torch.nn.Module, optimizer=None, *,
             path: str | os.PathLike | None = None) -> Loaded | None:
        """Restore ``model`` (and ``optimizer``) from ``path`` (default: the newest
        checkpoint under the root; None if there is none), under the model's current plans
        and world size (DCP reshards). Verified first, on every rank: the manifest, every
        file's size and sha256 (shared out over the ranks), the model's names and full
        shapes; the first problem is raised as a :class:`CheckpointError` on every rank
        before anything is overwritten."""
        self.wait()
        self._clear_tmp()
        path = Path(path) if path is not None else self.latest()
        if path is None:
            return None
        return load_verified(path, model, optimizer, self)


def verify_problems(path: Path, model: torch.nn.Module | None, optimizer, rank: int,
                    world: int) -> tuple[dict | None, list[str]]:
    """This rank's share of the checks (see :meth:`Checkpointer.load`)."""
    manifest, why = store.read_manifest(path)
    if manifest is None:
        return None, [why]
    problems = store.file_problems(path, manifest, (rank, world))
    if model is not None and not problems:
        problems = store.model_problems(path, manifest, model_shapes(model))
    if optimizer is not None and not problems:
        if manifest.get("optimizer") is None:
            problems = [f"{path}: holds no optimizer state, but an optimizer was given"]
        elif manifest.get("param_groups") != len(optimizer.param_groups):
            problems = [f"{path}: saved with {manifest.get('param_groups')} optimizer param "
                        f"groups, this optimizer has {len(optimizer.param_groups)}"]
    return manifest, problems


def load_verified(path: Path, model, optimizer, ckpt: Checkpointer) -> Loaded:
    manifest, problems = verify_problems(path, model, optimizer, ckpt.rank, ckpt.world)
    first = ckpt._agree(problems)
    if first is not None:
        # a problem of the checkpoint as a whole names it already: name it once
        raise CheckpointError(f"refusing to load {path}: {first.removeprefix(f'{path}: ')}")
    state = destinations(model, manifest, optimizer, ckpt.rank)
    try:
        with quiet(ckpt.distributed):
            dcp.load(state, storage_reader=FileSystemReader(path), planner=LoadPlanner(),
                     process_group=ckpt.group, no_dist=not ckpt.distributed)
        error = None
    except _FAILURES as err:  # noqa: BLE001 - agreed below: no rank applies a partial load
        error = _one_line(err)
    first = ckpt._agree([error] if error else [])
    if first is not None:
        raise CheckpointError(f"could not load {path}: {first}")
    apply(model, state, manifest, optimizer)
    rank_key = f"rank_state.{ckpt.rank}"
    return Loaded(step=manifest["step"], extra_state=unpack(state["extra"]),
                  rank_state=unpack(state[rank_key]) if rank_key in state else None,
                  path=path, plans=manifest["plans"], world_size=manifest["world_size"])
