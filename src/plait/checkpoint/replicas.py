"""Data-parallel replicas of a plait model, as a checkpoint sees them.

Two wraps from :func:`plait.parallel.data_parallel`, two ways to hold the model:

- DDP: a wrapper (the model is its ``.module``); every replica holds the same tensors,
  so only dp rank 0 writes plait's pieces (every replica reads all it holds on load).
- FSDP2 (``fully_shard``, in place): between steps every parameter, and AdamW's moments
  made ``zeros_like`` it, is a ``DTensor`` on the 1-D dp mesh with placement ``Shard(0)``:
  dp rank d holds rows ``[d · c, min((d + 1) · c, n))`` of the tensor plait's tp layer
  holds (``c = ceil(n / dp)``, ``torch.chunk``'s split). Its pieces are plait's tp pieces
  cut to those rows (:func:`~plait.parallel.layout.rows_of`), so each dp rank writes
  its own part and no box is written twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..parallel.layout import Layout, rows_of

__all__ = ["unwrap", "local", "dp_layout", "is_dtensor"]


def unwrap(model: nn.Module) -> tuple[nn.Module, bool]:
    """``(the model whose state_dict names are the plain model's, whether this rank writes
    replicated pieces)``: a DDP wrapper's ``.module``, written by dp rank 0 only."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, dist.get_rank(model.process_group) == 0
    return model, True


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (a DTensor's local shard, a view of its storage)."""
    return t.to_local() if is_dtensor(t) else t


def _dp_rows(t) -> tuple[int, int]:
    """``(first row, rows)`` of an FSDP2 parameter's local shard within the tp-local tensor."""
    from torch.distributed.tensor import Shard

    placements, mesh = tuple(t.placements), t.device_mesh
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise TypeError(f"plait.checkpoint reads DTensors sharded over one dp axis by dim 0 "
                        f"(FSDP2's Shard(0)), got placements {placements} on a {mesh.ndim}-D "
                        "mesh")
    n, dp = t.shape[0], mesh.size()
    chunk = -(-n // dp)
    start = min(mesh.get_local_rank() * chunk, n)
    rows = t.to_local().shape[0]
    assert rows == min(chunk, n - start), (tuple(t.shape), dp, start, rows)
    return start, rows


def dp_layout(t: torch.Tensor, layout: Layout | None, writes: bool) -> Layout | None:
    """``layout`` (this tensor's tp pieces; None: held whole by the tp group) as this dp rank
    holds ``t``: cut to its FSDP2 rows, or, on a replica that does not write (DDP's dp rank
    > 0), every piece read but none written. None: a plain tensor DCP writes once."""
    if is_dtensor(t):
        start, rows = _dp_rows(t)
        return rows_of(layout, tuple(t.shape), start, rows)
    if layout is not None and not writes:
        return Layout(layout.global_shape, layout.dim,
                      tuple((a, b, n, False) for a, b, n, _ in layout.pieces), layout.rows)
    return layout
