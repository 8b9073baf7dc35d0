"""What the exactness dry run decides (:class:`Verdict`), what it refuses with
(:class:`Refused`), and the comparisons :mod:`.probe` and :mod:`.split` share."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["TOL", "Refused", "Verdict", "first_tensor", "map_tensors", "relative_error",
           "to_dtype"]

# the largest relative error a simulated module may show against its own forward
TOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 3e-2}


@dataclass
class Verdict:
    """What ``verify`` found: per-rank attribute values to set on a dim's module, parameters
    whose gradients are a rank's share (summed by plait), embeddings' scales, and notes."""

    # dim → attribute → its value on each rank
    attrs: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    partial: set[str] = field(default_factory=set)   # parameter names (model paths)
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding path → scale
    notes: list[tuple[str, str]] = field(default_factory=list)
    checked: bool = True


class Refused(ValueError):
    """A module the dry run cannot make exact: the message names it."""


def map_tensors(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(map_tensors(v, fn) for v in x)
    if isinstance(x, list):
        return [map_tensors(v, fn) for v in x]
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    return x


def to_dtype(x, dtype):
    return map_tensors(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


def first_tensor(out) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def relative_error(a, b, floor: float = 0.0) -> float:
    """max|a - b| / max(max|b|, floor)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    scale = max(float(b.detach().abs().max()), floor)
    return float((a.detach() - b.detach()).abs().max()) / (scale if scale > 0 else 1.0)
