"""The small components of the training loop (:mod:`plait.training.loop`): straggler
emulation, the balancer, checkpoints and progress. Each is a
:class:`~plait.training.loop.Component`; a command lists the ones it needs."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch.distributed as dist

from .loop import Component

__all__ = ["Straggling", "Balancing", "Checkpointing", "Progress", "OnStep"]


class Straggling(Component):
    """The straggler emulation's step (:mod:`plait.runtime.slow.straggler`).

    Without ``straggler``: this rank's own (the launcher's ``--slow``), told each step. With
    one: a run's own, put in the rank's context for that run's steps only and taken out after
    them, so that runs interleaved step by step (``bench hetero``, ``plait demo``) each slow
    their own ranks. Its step is set before anything else of the step: with a kernel throttle
    it sets the host's CPU budget, which must hold before any rank starts the step."""

    def __init__(self, straggler=None, rank: int = 0):
        self.own, self.rank = straggler, rank

    def before_step(self, step: int) -> None:
        from ..runtime import rank_context

        if self.own is None:
            if dist.is_initialized():
                rank_context().straggler.set_step(step)
            return
        self.own.set_step(step)
        rank_context().straggler = self.own

    def after_step(self, record: dict) -> None:
        if self.own is not None:
            self._take_out()

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The run's straggler in the context for what runs inside (its evaluation)."""
        from ..runtime import rank_context

        rank_context().straggler = self.own
        try:
            yield
        finally:
            self._take_out()

    def _take_out(self) -> None:
        from ..runtime import rank_context
        from ..runtime.slow.straggler import Straggler

        rank_context().straggler = Straggler([], self.rank)


class Balancing(Component):
    """``plait.balance.Balancer.step`` after every update, inside the step's time (a migration
    is part of the step it follows); the step's decisions go into its record.
    ``after_migrate``: called after a step that migrated (DDP's reducer is rebuilt for the
    new shapes: ``plait.parallel.data.replanned``)."""

    def __init__(self, balancer, after_migrate: Callable[[], None] | None = None):
        self.balancer, self.after_migrate = balancer, after_migrate
        self.done: list = []

    def after_update(self, step: int) -> None:
        self.done = self.balancer.step(step)
        if self.after_migrate is not None and any(d.kind == "migrate" for d in self.done):
            self.after_migrate()

    def after_step(self, record: dict) -> None:
        if self.done:
            record["decisions"] = [d.to_json() for d in self.done]


class Checkpointing(Component):
    """A checkpoint every ``every`` steps and after the last of ``steps``, through ``ckpt``
    (a :class:`plait.checkpoint.Checkpointer`; every rank saves: a collective).

    ``state(steps_done, records)``: ``(extra_state, rank_state)`` saved beside the model and
    the optimizer, from the records of every step so far (``records``: those before this run
    resumed, then each step's); default ``({"step": steps_done}, None)``. ``blocking``: the
    save returns once written; else DCP writes in the background, waited for at the next save
    (or ``ckpt.wait()``)."""

    def __init__(self, ckpt, model, optimizer, *, every: int, steps: int,
                 state: Callable[[int, list], tuple[Any, Any]] | None = None,
                 blocking: bool = True, records: list[dict] = ()):
        self.ckpt, self.model, self.optimizer = ckpt, model, optimizer
        self.every, self.steps, self.state, self.blocking = every, steps, state, blocking
        self.records = list(records)

    def after_step(self, record: dict) -> None:
        self.records.append(record)
        done = record["step"] + 1
        if done % self.every and done != self.steps:
            return
        extra, own = self.state(done, self.records) if self.state else ({"step": done}, None)
        self.ckpt.save(done, self.model, self.optimizer, extra, rank_state=own,
                       blocking=self.blocking)


class Progress(Component):
    """Each step's rate (``{unit}_per_s``: ``per_step`` units over its time) into its record;
    rank 0 reports the step, its loss and rate to the launcher (a progress bar), which also
    tells the launcher's watchdog the run is alive."""

    def __init__(self, unit: str, per_step: float):
        from ..runtime import rank_context

        self.unit, self.per_step = unit, per_step
        initialised = dist.is_initialized()
        self.rank = dist.get_rank() if initialised else 0
        self.report = rank_context().report if initialised else (lambda payload: None)

    def after_step(self, record: dict) -> None:
        rate = record[f"{self.unit}_per_s"] = self.per_step / record["time_s"]
        if self.rank == 0:
            self.report({"step": record["step"], "loss": record["loss"], "rate": rate,
                         "unit": self.unit})


class OnStep(Component):
    """``fn(record)`` after every step (a test's or a caller's own look at the run)."""

    def __init__(self, fn: Callable[[dict], None]):
        self.fn = fn

    def after_step(self, record: dict) -> None:
        self.fn(record)
