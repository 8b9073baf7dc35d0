"""Fill a parallel model's own shards from a full checkpoint, reading only those shards.

    model = plait.parallelize(model_on_meta, "auto")     # shard-sized meta parameters
    model.to_empty(device="cpu")                          # this rank's shards, allocated
    load_shards(model, "path/to/save_pretrained_dir")    # each piece read from its file

Where each of a rank's tensors sits in the full tensor is what plait's DCP checkpoints
write and read (:func:`plait.parallel.layout.model_layouts`: pieces along one dim); the
loader asks the source (:mod:`plait.checkpoint.sources`) for exactly those pieces, so a rank
reads its share and nothing else, with one tensor's file mapped at a time (what the mapping
keeps resident is that tensor's pages, at most). Tensors no plan splits are read whole.

Buffers no checkpoint holds (non-persistent: transformers' rotary ``inv_freq``) are
:func:`plait.checkpoint.pretrained.materialize`'s to compute.

Every rank checks the whole checkpoint against the model before it reads a byte: a missing
tensor, a shape that differs, an unreadable conversion or a missing or truncated file is one
``CheckpointFileError`` line naming it, raised before any parameter changes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

import torch
import torch.nn as nn

from .hf_names import Unsupported, named_sources
from ..parallel.layout import Layout, model_layouts
from .sources import CheckpointFileError, SafetensorsDir, StateDictSource

__all__ = ["load_shards", "CheckpointFileError"]

log = logging.getLogger("plait.checkpoint")


def load_shards(model: nn.Module, source, *, strict: bool = True) -> dict:
    """Copy this rank's pieces of every tensor of ``model.state_dict()`` from ``source``: a
    transformers checkpoint directory (``save_pretrained``), a full ``state_dict``, or a
    source object. ``strict``: a checkpoint tensor the model does not hold is an error too.
    Returns ``{"read_bytes", "tensors", "files"}``: what this rank read. A model still on
    the meta device is refused (its tensors hold no memory to copy into): call
    :func:`~plait.checkpoint.pretrained.materialize` first."""
    state = model.state_dict(keep_vars=True)
    on_meta = next((name for name, t in state.items() if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(f"load_shards: {on_meta} is on the meta device (no memory to load "
                         "into); call plait.checkpoint.materialize(model, 'cpu') first")
    store = _store(source)
    sources = named_sources(model, store) if isinstance(store, SafetensorsDir) else \
        {name: store.leaf(name) for name in store.keys()}
    wanted = _one_name_each(state, sources)
    layouts = model_layouts(model)
    plan = _plan(wanted, layouts, sources, strict)
    read = 0
    with torch.no_grad():
        for name, tensor, src in plan:
            files = src.files()
            # one tensor's file mapped at a time: what the mapping keeps resident (the pages
            # its pieces touched; all of them for a split along dim 1) is one tensor's at most
            with store.session(next(iter(files))) if len(files) == 1 else _nothing():
                read += _fill(tensor, src, layouts.get(name))
    files = sorted({f for _, _, src in plan for f in src.files()})
    log.info("loaded %d tensors (%.1f MB read) from %d files", len(plan), read / 1e6, len(files))
    return {"read_bytes": read, "tensors": len(plan), "files": files}


def _one_name_each(state: dict, sources: dict) -> dict:
    """``state`` with each tensor once (tied ones share a tensor under several names), under
    the name the checkpoint holds it by where it holds one (transformers saves one)."""
    names: dict[int, list[str]] = {}
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    out = {}
    for group in names.values():
        name = next((n for n in group if n in sources), group[0])
        out[name] = state[name]
    return out


def _store(source):
    if isinstance(source, (str, os.PathLike)):
        return SafetensorsDir(Path(source))
    if isinstance(source, Mapping):
        return StateDictSource(dict(source))
    return source


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _plan(wanted: dict, layouts: dict[str, Layout], sources: dict, strict: bool) -> list:
    """``[(name, tensor, source)]``, every problem raised first (one line, the first one)."""
    problems = []
    for name, tensor in wanted.items():
        src = sources.get(name)
        want = layouts[name].global_shape if name in layouts else tuple(tensor.shape)
        if src is None:
            problems.append(f"{name}: not in the checkpoint")
        elif isinstance(src, Unsupported):
            problems.append(f"{name}: {src.why}")
        elif tuple(src.shape) != tuple(want):
            problems.append(f"{name}: the checkpoint holds {list(src.shape)}, the model "
                            f"{list(want)}")
    if strict:
        extra = sorted(set(sources) - set(wanted))
        if extra:
            problems.append(f"{extra[0]}: in the checkpoint but not in the model "
                            f"({len(extra)} such tensors; strict=False to leave them)")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointFileError(problems[0] + more)
    return [(name, tensor, sources[name]) for name, tensor in wanted.items()]


def _fill(tensor: torch.Tensor, src, layout: Layout | None) -> int:
    """Copy ``tensor``'s pieces from ``src``; the bytes read."""
    if layout is None:
        value = src.read(None, 0, 0)
        tensor.copy_(value)
        return value.numel() * value.element_size()
    read = 0
    for box_offsets, box_sizes, local in layout.boxes(written=False):
        value = src.read(layout.dim, box_offsets[layout.dim], box_sizes[layout.dim])
        if layout.rows is not None:
            value = value.narrow(0, layout.rows[0], layout.rows[1])
        tensor.narrow(layout.dim, local, box_sizes[layout.dim]).copy_(value)
        read += value.numel() * value.element_size()
    return read
