"""The training loop: one step of forward, backward and update, and the components around it.

Every command that trains runs :meth:`Trainer.step`: ``plait train``, the elastic worker,
``plait demo``, ``bench hetero``, ``bench tp`` (each system, the DLRM tables and the
placements of ``--dp``) and ``bench checkpoint``. What differs between them is a list of
small components (:mod:`plait.training.components`), called at three points of a step, as
torchtitan's ``train.py`` calls its checkpointer and metrics:

- ``before_step(step)``: before the step's clock starts (the straggler emulation's step,
  a kernel throttle, a barrier, readings taken before the step);
- ``after_backward(step)``: after the backward, before the update (the gradients);
- ``after_update(step)``: after the optimizer's update, inside the clock (the balancer's
  step: what it costs is part of the step);
- ``after_step(record)``: after the clock stops, in order (the balancer's decisions and the
  step tally into the record, the replicas' loss, progress, a checkpoint).

A step's ``record`` is ``{"step", "loss", "time_s", "lr"}``; ``time_s`` is this rank's wall
time for forward, backward, the update and the ``after_update`` components (not the data,
not ``before_step``). The loop adds nothing to the arithmetic: the same model, optimizer and
batches give the same losses bit for bit whichever components run.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, Sequence

import torch

__all__ = ["Component", "Trainer", "lr_at", "cosine_schedule"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def lr_at(step: int, steps: int, peak: float, warmup: int = 10) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def cosine_schedule(steps: int, peak: float) -> Callable[[int], float]:
    """``step -> lr_at(step, steps, peak)``: the schedule of ``plait train`` and its users."""
    return lambda step: lr_at(step, steps, peak)


class Component:
    """Something the loop calls around each step; a component overrides what it needs."""

    def before_step(self, step: int) -> None:
        """Before the step's clock starts."""

    def after_backward(self, step: int) -> None:
        """After the backward, before the update, inside the clock (the gradients as the
        update will read them)."""

    def after_update(self, step: int) -> None:
        """After the optimizer's update, inside the step's clock."""

    def after_step(self, record: dict) -> None:
        """After the clock stops; ``record`` may be changed (components run in order)."""


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``loss_fn(model, batch)`` (the replicated loss),
    one step at a time (:meth:`step`, for runs interleaved step by step) or ``steps`` in a row
    (:meth:`run`). ``schedule``: the learning rate of each step (None: the optimizer's own,
    unchanged); ``components``: what runs around each step (module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: LossFn, *, schedule: Callable[[int], float] | None = None,
                 components: Sequence[Component] = ()):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.schedule = schedule
        self.components = list(components)

    def step(self, step: int, batch) -> dict:
        """One optimizer step on ``batch`` as step number ``step``: its record."""
        if self.schedule is not None:
            lr = self.schedule(step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        for c in self.components:
            c.before_step(step)
        start = time.perf_counter()
        loss = self.loss_fn(self.model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for c in self.components:
            c.after_backward(step)
        self.optimizer.step()
        for c in self.components:
            c.after_update(step)
        value = loss.item()  # waits for the step's last kernel (CUDA): it is part of the step
        record = {"step": step, "loss": value, "time_s": time.perf_counter() - start,
                  "lr": self.optimizer.param_groups[0]["lr"]}
        for c in self.components:
            c.after_step(record)
        return record

    def run(self, batches: Iterable, steps: int, *, start: int = 0) -> list[dict]:
        """Steps ``start .. steps - 1`` (a resumed run starts where its checkpoint left off),
        each on the next of ``batches``: their records."""
        self.model.train()
        batches = iter(batches)
        return [self.step(step, next(batches)) for step in range(start, steps)]
