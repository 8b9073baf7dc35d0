"""Exact migration: move layers to new plans at a step boundary, optimizer state included.

Every rank calls ``migrate(model, optimizer, {"blocks.0.mlp.fc": ShardPlan((5, 3))})``
with the same plans. For each named layer, every tensor that belongs to one of
its parameters (the parameter, its gradient, and each optimizer-state tensor
of the parameter's shape: SGD's ``momentum_buffer``, Adam's ``exp_avg`` and
``exp_avg_sq``, ``max_exp_avg_sq``, ...) is gathered whole under the old plan
and cut under the new one. Scalar state (Adam's ``step``) is the same on every
rank and stays. The parameters remain the same objects, so the optimizer and
any hooks keep them. Later steps compute what the unmigrated model would have,
up to the order of the sums over a row-parallel layer's reduction dim.

A layer takes part through five methods (``plait.nn.ColumnParallelLinear`` and
``RowParallelLinear`` have them): ``check_plan``, ``reshard`` (parameters and
gradients), ``gather_like`` and ``cut_like`` (other tensors that follow them),
``is_sharded`` (whether a parameter is split by the plan or replicated).

Cost, reported: ``bytes_moved`` counts the bytes whose owner changes (each
once, over the group; what a point-to-point migration must send), and
``bytes_sent`` what this implementation sends: it gathers each tensor whole,
so every rank sends its slice to every other, ``(p − 1) ×`` the tensor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from ..plan import ShardPlan

__all__ = ["MigrationReport", "migrate", "moved_units"]

_PROTOCOL = ("check_plan", "reshard", "gather_like", "cut_like", "is_sharded")


@dataclass(frozen=True)
class MigrationReport:
    """What a migration did: the layers moved, their old and new sizes, and its cost."""

    layers: tuple[str, ...]
    old_sizes: tuple[tuple[int, ...], ...]
    new_sizes: tuple[tuple[int, ...], ...]
    bytes_moved: int
    bytes_sent: int
    seconds: float  # this rank's wall time, all collectives included

    def __str__(self) -> str:
        moves = ", ".join(f"{n} {list(a)}→{list(b)}"
                          for n, a, b in zip(self.layers, self.old_sizes, self.new_sizes))
        return (f"migrated {moves or 'nothing'}: {self.bytes_moved} B changed owner, "
                f"{self.bytes_sent} B sent, {self.seconds * 1e3:.1f} ms")


def moved_units(old: ShardPlan, new: ShardPlan) -> int:
    """Units whose owner differs between two plans of the same dim."""
    if old.world != new.world or old.total != new.total:
        raise ValueError(f"plans {list(old.sizes)} and {list(new.sizes)} do not split the same "
                         f"dim over the same ranks")
    kept = 0
    for r in range(old.world):
        a, b = old.slice_of(r), new.slice_of(r)
        kept += max(0, min(a.stop, b.stop) - max(a.start, b.start))
    return old.total - kept


def migrate(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
            new_plans: Mapping[str, ShardPlan]) -> MigrationReport:
    """Move each named layer of ``model`` to its new plan, with its gradients and its
    ``optimizer`` state (a collective: every rank calls it with the same plans).

    Everything is checked before the first collective: an unknown name, a module
    that cannot migrate, a plan that does not fit, or optimizer state of a shape
    that cannot be told apart from its parameter's raises ValueError/TypeError.
    """
    start = time.perf_counter()
    todo = _checked(model, optimizer, new_plans)
    names, old_sizes, new_sizes = [], [], []
    moved = sent = 0
    for name, layer, plan in todo:
        if plan == layer.plan:
            continue
        old = layer.plan
        world, units = old.world, moved_units(old, plan)
        params = _params(layer)
        states = {key: _state_of(optimizer, p) for key, p in params.items()}
        full = {key: {k: layer.gather_like(key, v) for k, v in states[key].items()
                      if _follows(v, p)} for key, p in params.items()}
        for key, p in params.items():
            if layer.is_sharded(key):  # a replicated tensor (a row-parallel bias) moves nothing
                whole = p.numel() * p.element_size() * old.total // old.sizes[layer.info.rank]
                state = len(full[key])  # reshard gathers the gradient even when there is none
                moved += (1 + (p.grad is not None) + state) * whole * units // old.total
                sent += (2 + state) * whole * (world - 1)
        layer.reshard(plan)
        for key, p in params.items():
            for k, whole in full[key].items():
                states[key][k] = layer.cut_like(key, whole)
        names.append(name)
        old_sizes.append(old.sizes)
        new_sizes.append(plan.sizes)
    return MigrationReport(tuple(names), tuple(old_sizes), tuple(new_sizes), moved, sent,
                           time.perf_counter() - start)


def _checked(model, optimizer, new_plans):
    if not isinstance(new_plans, Mapping):
        raise TypeError(f"new_plans must map layer names to ShardPlans, got "
                        f"{type(new_plans).__name__}")
    modules = dict(model.named_modules())
    todo = []
    for name, plan in new_plans.items():
        if name not in modules:
            known = [n for n, m in modules.items() if _can_migrate(m)]
            raise ValueError(f"no layer {name!r} in the model; layers that can migrate: {known}")
        layer = modules[name]
        if not _can_migrate(layer):
            raise TypeError(f"layer {name!r} ({type(layer).__name__}) cannot migrate: it lacks "
                            f"{', '.join(m for m in _PROTOCOL if not hasattr(layer, m))}")
        plan = layer.check_plan(plan)
        for key, p in _params(layer).items():
            for k, v in _state_of(optimizer, p).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and not _follows(v, p):
                    raise ValueError(f"optimizer state {k!r} of {name}.{key} has shape "
                                     f"{tuple(v.shape)}, not the parameter's {tuple(p.shape)}: "
                                     f"cannot tell how it is sharded")
        todo.append((name, layer, plan))
    return todo


def _can_migrate(module) -> bool:
    return all(callable(getattr(module, m, None)) for m in _PROTOCOL)


def _params(layer) -> dict[str, torch.nn.Parameter]:
    return {key: p for key, p in layer.named_parameters(recurse=False)}


def _state_of(optimizer, param) -> dict:
    if optimizer is None:
        return {}
    return optimizer.state[param] if param in optimizer.state else {}


def _follows(value, param) -> bool:
    """A state tensor sharded as its parameter is: the parameter's shape, and not a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape

