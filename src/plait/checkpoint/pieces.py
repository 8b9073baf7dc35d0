"""A rank's shard told to DCP as the boxes of the global tensor it really holds.

:class:`Pieces` implements DCP's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, the one DTensor implements): it
writes one chunk per written piece of its :class:`~plait.parallel.layout.Layout`,
with the piece's global offsets, and on load asks for every piece it holds, wherever
the saved chunks lie; DCP's resharding reads the overlaps. DCP's default planners only
hand a *tensor* to ``__get_tensor_shard__``, so :class:`SavePlanner` and
:class:`LoadPlanner` add that lookup for a :class:`Pieces` (a plain object, not a
tensor subclass: nothing dispatches on it). The state handed to DCP is flat
(``{"model.<name>": ...}``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

from ..parallel.layout import Layout

__all__ = ["Pieces", "SavePlanner", "LoadPlanner", "Staged"]


class Pieces:
    """``local`` (this rank's tensor) as the pieces of its global tensor ``layout`` names."""

    def __init__(self, local: torch.Tensor, layout: Layout):
        assert sum(p[2] for p in layout.pieces) <= local.shape[layout.dim], \
            (tuple(local.shape), layout)
        self.local, self.layout = local, layout

    def size(self) -> torch.Size:
        return torch.Size(self.layout.global_shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                              properties=props, size=self.size()))
                for offsets, sizes, _ in self.layout.boxes(written=True)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                for offsets, sizes, _ in self.layout.boxes(written=False)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The local view of the piece at ``index.offset`` (or of read chunk ``index.index``:
        a copied head is read into each of its copies, which share an offset)."""
        boxes = self.layout.boxes(written=False)
        if index.index is not None and index.index < len(boxes) \
                and boxes[index.index][0] == tuple(index.offset):
            found = boxes[index.index]
        else:
            found = next((b for b in boxes if b[0] == tuple(index.offset)), None)
            if found is None:
                raise ValueError(f"{index.fqn}: no local piece at global offset "
                                 f"{tuple(index.offset)}")
        offsets, sizes, local = found
        return self.local.narrow(self.layout.dim, local, sizes[self.layout.dim])


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner that finds the tensor of a :class:`Pieces` chunk."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that finds the local view of a :class:`Pieces` chunk.

    Its set-up (``_init_state_dict``, which makes meta tensors real) returns None for a
    value it does not know, a :class:`Pieces` among them: they are put back after it."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        assert all(k in self.state_dict for k in pieces), "a flat state stays flat"
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)


class Staged(AsyncStager):
    """``async_save``'s stager for a state already copied off the live tensors (the
    caller's snapshot): it hands the state on as it is, no second copy."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None
