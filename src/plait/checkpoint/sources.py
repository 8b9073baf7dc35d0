"""Where a rank's slices come from: a checkpoint's tensors read one contiguous range at a time.

A *source* answers ``shape(name)`` and ``read(name, dim, start, length)``: rows
``[start, start + length)`` of dim ``dim`` of the full tensor ``name`` (``dim`` None: all
of it), and nothing else. :func:`plait.checkpoint.shards.load_shards` asks it for exactly
the pieces a rank holds (:mod:`plait.parallel.layout`), so a rank reads only its share.

- :class:`SafetensorsDir`: a transformers checkpoint directory (``save_pretrained``: one
  ``model.safetensors``, or shards and ``model.safetensors.index.json``), read with
  safetensors' slice reads (``safe_open(...).get_slice(name)[...]``). Every file is opened,
  its header checked, before any tensor is read: a missing or truncated file is refused in
  one line naming it. A file is mapped while one tensor's pieces are read
  (:meth:`SafetensorsDir.session`) and unmapped after, so what the mapping holds resident is
  one tensor's pages at most.
- :class:`StateDictSource`: a plain full ``state_dict`` in memory (small models).
- :class:`Stacked` and :class:`Joined`: a tensor the checkpoint keeps as several
  (transformers' per-expert ``experts.<e>.w1.weight`` of a model that holds one fused
  ``experts.gate_up_proj``), read by the pieces of its parts: an expert-parallel rank
  reads only its experts, a rank holding FFN columns only its columns of each.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch

__all__ = ["CheckpointFileError", "SafetensorsDir", "StateDictSource", "Stacked", "Joined",
           "Leaf"]


class CheckpointFileError(ValueError):
    """A checkpoint that cannot be read: one line naming the file (or tensor) and why."""


def _narrow(tensor: torch.Tensor, dim: int | None, start: int, length: int) -> torch.Tensor:
    return tensor if dim is None else tensor.narrow(dim, start, length)


class Leaf:
    """One tensor of one file: ``name`` in ``file``, of ``shape``."""

    def __init__(self, store: "SafetensorsDir", name: str, file: str, shape: Sequence[int]):
        self.store, self.name, self.file, self.shape = store, name, file, tuple(shape)

    def read(self, dim: int | None, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        if dim is not None:
            index[dim] = slice(start, start + length)
        with self.store.mapped(self.file) as handle:
            return handle.get_slice(self.name)[tuple(index)]

    def files(self) -> set[str]:
        return {self.file}


class Stacked:
    """``torch.stack(parts, dim)`` without holding it: a read along ``dim`` takes whole parts,
    along another dim the same range of each part."""

    def __init__(self, parts: Sequence, dim: int):
        shapes = {p.shape for p in parts}
        assert len(shapes) == 1, shapes
        self.parts, self.dim = list(parts), dim
        one = list(next(iter(shapes)))
        self.shape = tuple(one[:dim] + [len(parts)] + one[dim:])

    def read(self, dim: int | None, start: int, length: int) -> torch.Tensor:
        if dim is None:
            return torch.stack([p.read(None, 0, 0) for p in self.parts], self.dim)
        if dim == self.dim:
            return torch.stack([p.read(None, 0, 0) for p in self.parts[start:start + length]],
                               self.dim)
        inner = dim if dim < self.dim else dim - 1
        return torch.stack([p.read(inner, start, length) for p in self.parts], self.dim)

    def files(self) -> set[str]:
        return set().union(*(p.files() for p in self.parts))


class Joined:
    """``torch.cat(parts, dim)`` without holding it: a read along ``dim`` takes only the parts
    (and the rows of each) that the range covers."""

    def __init__(self, parts: Sequence, dim: int):
        self.parts, self.dim = list(parts), dim
        first = list(self.parts[0].shape)
        first[dim] = sum(p.shape[dim] for p in self.parts)
        self.shape = tuple(first)

    def read(self, dim: int | None, start: int, length: int) -> torch.Tensor:
        if dim != self.dim:
            return torch.cat([p.read(dim, start, length) for p in self.parts], self.dim)
        out, offset = [], 0
        for part in self.parts:
            size = part.shape[dim]
            lo, hi = max(start, offset), min(start + length, offset + size)
            if lo < hi:
                out.append(part.read(dim, lo - offset, hi - lo))
            offset += size
        return torch.cat(out, dim)

    def files(self) -> set[str]:
        return set().union(*(p.files() for p in self.parts))


class SafetensorsDir:
    """A transformers checkpoint directory, read by slices; see the module doc."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointFileError(f"{self.path}: no such checkpoint directory")
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise CheckpointFileError(f"{index}: not a safetensors index ({err})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointFileError(f"{self.path}: no model.safetensors or "
                                          "model.safetensors.index.json in it")
            weight_map = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.file_of: dict[str, str] = {}
        for name in files:
            file = self.path / name
            if not file.exists():
                raise CheckpointFileError(f"{file}: missing (the index names it)")
            try:
                with safe_open(file, framework="pt") as handle:
                    for key in handle.keys():
                        self.shapes[key] = tuple(handle.get_slice(key).get_shape())
                        self.file_of[key] = name
            except SafetensorError as err:
                raise CheckpointFileError(f"{file}: truncated or not a safetensors file "
                                          f"({err})") from None
        if weight_map is not None:
            lost = sorted(k for k, f in weight_map.items() if self.file_of.get(k) != f)
            if lost:
                raise CheckpointFileError(f"{self.path / weight_map[lost[0]]}: does not hold "
                                          f"{lost[0]}, which the index says it does "
                                          f"({len(lost)} such tensors)")
        self._open: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.shapes)

    def leaf(self, name: str) -> Leaf:
        return Leaf(self, name, self.file_of[name], self.shapes[name])

    @contextlib.contextmanager
    def session(self, file: str) -> Iterator[None]:
        """Keep ``file`` mapped while a tensor's pieces are read; unmapped on leaving."""
        from safetensors import safe_open

        with safe_open(self.path / file, framework="pt") as handle:
            self._open[file] = handle
            try:
                yield
            finally:
                del self._open[file]

    @contextlib.contextmanager
    def mapped(self, file: str):
        """The open handle of ``file``: the session's, or one for this read only."""
        handle = self._open.get(file)
        if handle is not None:
            yield handle
            return
        from safetensors import safe_open

        with safe_open(self.path / file, framework="pt") as handle:
            yield handle


class StateDictSource:
    """A full ``state_dict`` in memory, read by the same ranges."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state = state_dict

    def keys(self) -> list[str]:
        return list(self.state)

    def leaf(self, name: str) -> "_InMemory":
        return _InMemory(self.state[name])


class _InMemory:
    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.shape = tensor, tuple(tensor.shape)

    def read(self, dim: int | None, start: int, length: int) -> torch.Tensor:
        return _narrow(self.tensor, dim, start, length)

    def files(self) -> set[str]:
        return set()
