"""Fill a parallel model's own shards from a full checkpoint, reading only those shards.

    model = plait.parallelize(model_on_meta, "auto")     # shard-sized meta parameters
    model.to_empty(device="cpu")                          # this rank's shards, allocated
    load_shards(model, "path/to/save_pretrained_dir")    # each piece read from its file

Where each of a rank's tensors sits in the full tensor is what plait's DCP checkpoints
write and read (:func:`plait.checkpoint.layout.model_layouts`: pieces along one dim); the
loader asks the source (:mod:`plait.checkpoint.sources`) for exactly those pieces, file by
file, so a rank reads its share and nothing else, and holds at most one file mapped at a
time besides its own tensors. Tensors no plan splits are read whole.

Buffers that are not in the checkpoint (transformers' rotary ``inv_freq``, a scaled
embedding's ``embed_scale``: non-persistent, computed at construction) hold nothing after
``to_empty``: a transformers model recomputes them with its own ``_init_weights`` (after the
loaded tensors are marked initialised, so it touches nothing else); they are filled with NaN
first, and one left NaN is refused, naming it. Any other model built on the meta device
must bring them itself (``buffers=``).

Every rank checks the whole checkpoint against the model before it reads a byte: a missing
tensor, a shape that differs, an unreadable conversion or a missing or truncated file is one
``CheckpointFileError`` line naming it, raised before any parameter changes.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn as nn

from .hf_names import Unsupported, named_sources
from .layout import Layout, model_layouts
from .sources import CheckpointFileError, SafetensorsDir, StateDictSource

__all__ = ["load_shards", "CheckpointFileError"]

log = logging.getLogger("plait.checkpoint")


def load_shards(model: nn.Module, source, *, buffers: Callable[[nn.Module], None] | None = None,
                strict: bool = True) -> dict:
    """Copy this rank's pieces of every tensor of ``model`` from ``source``: a transformers
    checkpoint directory (``save_pretrained``), a full ``state_dict``, or a source object.
    ``buffers(model)``: fills the non-persistent buffers the checkpoint lacks (default:
    transformers' own initialisation; refused for other models). ``strict``: a checkpoint
    tensor the model does not hold is an error too. Returns ``{"read_bytes", "tensors",
    "files"}``: what this rank read."""
    store = _store(source)
    sources = named_sources(model, store) if isinstance(store, SafetensorsDir) else \
        {name: store.leaf(name) for name in store.keys()}
    wanted = dict(model.state_dict(keep_vars=True))
    layouts = model_layouts(model)
    plan = _plan(wanted, layouts, sources, strict)
    read = 0
    with torch.no_grad():
        for file, items in _by_file(plan).items():
            opened = store.session(file) if file is not None else _nothing()
            with opened:
                for name, tensor, src in items:
                    read += _fill(tensor, src, layouts.get(name))
        for tensor in wanted.values():
            tensor._is_hf_initialized = True
        _fill_buffers(model, set(wanted), buffers)
    files = sorted({f for f in _by_file(plan) if f is not None})
    log.info("loaded %d tensors (%.1f MB read) from %d files", len(plan), read / 1e6, len(files))
    return {"read_bytes": read, "tensors": len(plan), "files": files}


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


def _by_file(plan: list) -> dict:
    """The plan's items grouped by the one file each reads (None: several, or in memory)."""
    groups: dict = {}
    for item in plan:
        files = item[2].files()
        key = next(iter(files)) if len(files) == 1 else None
        groups.setdefault(key, []).append(item)
    return groups


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


def _fill_buffers(model: nn.Module, loaded: set[str], buffers) -> None:
    """Non-persistent buffers: computed by ``buffers(model)`` or transformers' initialisation.
    Each is filled with 0, computed, then with 1 and computed again: a buffer the two
    passes leave different was not computed, and is refused (whatever its dtype)."""
    missing = {}
    for path, module in model.named_modules():
        for key, value in module.named_buffers(recurse=False):
            name = f"{path}.{key}" if path else key
            if name not in loaded and value is not None:
                missing[name] = (module, value)
    if not missing:
        return
    if buffers is None:
        if not hasattr(model, "_init_weights"):
            raise CheckpointFileError(
                f"{next(iter(missing))}: a buffer no checkpoint holds, built on the meta "
                "device: pass buffers=fn to compute it (or build the model with real buffers)")
        buffers = _transformers_init(list({id(m): m for m, _ in missing.values()}.values()))
    passes = []
    for mark in (0, 1):
        for _, value in missing.values():
            value.fill_(mark)
        buffers(model)
        passes.append([_bits(value) for _, value in missing.values()])
    left = [name for name, a, b in zip(missing, *passes) if not torch.equal(a, b)]
    if left:
        raise CheckpointFileError(f"{left[0]}: a buffer no checkpoint holds, which "
                                  f"{getattr(buffers, '__name__', 'buffers')} did not compute; "
                                  "pass buffers=fn")


def _transformers_init(modules: list[nn.Module]):
    """transformers' own ``_init_weights`` on ``modules`` (the loaded tensors are marked
    initialised, so it touches only what is not)."""
    def transformers_init(model: nn.Module) -> None:
        from transformers import initialization as init

        with init.guard_torch_init_functions():
            for module in modules:
                model._init_weights(module)
    return transformers_init


def _bits(value: torch.Tensor) -> torch.Tensor:
    flat = value.detach().contiguous().view(-1)
    return flat.view(torch.uint8).clone() if flat.dtype != torch.bool else flat.clone()
