"""What plait did to a model, in one object on it: ``applied(model)``.

``plait.parallelize`` and ``plait.nn.apply_tp`` record there the one-line summary, each note
(which path runs fused or plain and why, siblings sharing an all-reduce, uneven splits, the
transport), the sharded dims the balancer moves (``dims``: a dim's name → the linears that
share its plan) and the tensor-parallel group the model was cut over (``group``). It lives
here, under the balancer and the parallel layer, so every layer that reads it can.

Two marks on the model's parts are kept here too: a parameter whose gradient a hook sums
over tp (``mark_partial``/``is_partial``: data parallelism refuses FSDP2 for it) and a
module split in place (``set_shards``/``shards_of``: how ``full_state_dict`` and the
checkpoint layouts gather it back).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from ..plan import ShardPlan

__all__ = ["Applied", "InPlaceShards", "applied", "is_partial", "mark_partial", "record",
           "set_shards", "shards_of"]

_ATTR = "_plait"  # the one attribute plait sets on a user's model
_PARTIAL = "_partial_by_plait"  # on a parameter: its gradient is summed over tp by a hook
_SHARDS = "_shards_by_plait"  # on a module split in place: its InPlaceShards
_UNSET = object()


class Applied(list):
    """The summary line, then each note: a list, printed as text a line each; ``dims`` (None
    where nothing was recorded) and ``group`` (``cut``: whether one was recorded; None is
    the default group)."""

    def __init__(self, lines=(), dims: dict | None = None, group=_UNSET):
        super().__init__(lines)
        self.dims = dims
        self.group = None if group is _UNSET else group
        self.cut = group is not _UNSET

    def __str__(self) -> str:
        return "\n".join(self) if self else "not made parallel by plait.parallelize"


def applied(model: nn.Module) -> Applied:
    """What ``parallelize`` (or ``apply_tp``) did to ``model``; empty for a model neither
    saw. ``print`` shows it a line each."""
    done = getattr(model, _ATTR, None)
    return Applied() if done is None else done


def record(model: nn.Module, *, line: str | None = None, notes=None, dims: dict | None = None,
           group=_UNSET) -> Applied:
    """Set what is given on ``model``'s record (made on first use); returns it."""
    done = getattr(model, _ATTR, None)
    if done is None:
        done = Applied()
        setattr(model, _ATTR, done)
    if line is not None:
        done[:1] = [line]
    if notes is not None:
        done[1:] = list(notes)
    if dims is not None:
        done.dims = dims
    if group is not _UNSET:
        done.group, done.cut = group, True
    return done


class InPlaceShards(Protocol):
    """A module's parameters split in place (``plait.parallel.layers``): the plan and group
    they were split by, and the full tensors gathered back (a collective)."""

    plan: ShardPlan
    group: object  # a ProcessGroup; None is the default group
    dims: dict[str, tuple[int, int, int]]  # parameter → (split dim, blocks, elements a unit)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]: ...


def mark_partial(param: nn.Parameter) -> None:
    """Note that ``param``'s gradient is summed over tp by a hook on it."""
    setattr(param, _PARTIAL, True)


def is_partial(param: nn.Parameter) -> bool:
    """Whether ``param``'s gradient is summed over tp by a hook (``mark_partial``)."""
    return getattr(param, _PARTIAL, False)


def set_shards(module: nn.Module, shards: InPlaceShards) -> None:
    """Note how ``module``, split in place, is gathered back."""
    setattr(module, _SHARDS, shards)


def shards_of(module: nn.Module) -> InPlaceShards | None:
    """How ``module`` is gathered back where it was split in place (``set_shards``), else None."""
    return getattr(module, _SHARDS, None)
