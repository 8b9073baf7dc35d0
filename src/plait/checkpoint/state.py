"""The flat DCP state of a model and its optimizer: a snapshot to save, destinations to load.

Keys: ``model.<name>`` (parameters and persistent buffers, each once: a tied tensor is
saved under its first name), ``optim.<name>.<key>`` (AdamW's ``exp_avg``/``exp_avg_sq``,
cut like their parameter, and its scalar ``step``), ``optim_groups`` (the param groups'
hyper-parameters, pickled), ``extra`` (the caller's plain state, from rank 0) and
``rank_state.<r>`` (a rank's own plain state). A sharded tensor is a
:class:`~plait.checkpoint.pieces.Pieces`; a replicated one a plain tensor (DCP writes one
copy). A data-parallel model (DDP's wrapper, FSDP2's DTensors) is saved and loaded as
its plain model's names and full tensors: see :mod:`plait.checkpoint.replicas`.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn as nn

from ..parallel.layout import Layout, global_shapes, model_layouts
from .pieces import Pieces
from .replicas import dp_layout, is_dtensor, local, unwrap

__all__ = ["model_tensors", "model_shapes", "snapshot", "optimizer_index", "destinations",
           "apply", "pack", "unpack"]


def model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``({name: tensor}, {alias: name})``: the state_dict's tensors, each object once."""
    model, _ = unwrap(model)
    seen: dict[int, str] = {}
    tensors, aliases = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases[name] = seen[id(t)]
        else:
            seen[id(t)] = name
            tensors[name] = t
    return tensors, aliases


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Every tensor's full shape by name, a tied tensor under its first name only."""
    _, aliases = model_tensors(model)
    return {k: v for k, v in global_shapes(unwrap(model)[0]).items() if k not in aliases}


def pack(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _copy(t: torch.Tensor, layout: Layout | None):
    held = local(t.detach()).to("cpu", copy=True).contiguous()
    return held if layout is None else Pieces(held, layout)


def _held_layouts(model: nn.Module, tensors: dict[str, torch.Tensor],
                  writes: bool) -> dict[str, Layout]:
    """Every tensor's layout as this rank holds it (tp pieces, cut to its dp shard)."""
    layouts = model_layouts(model)
    out = {k: dp_layout(t, layouts.get(k), writes) for k, t in tensors.items()}
    return {k: v for k, v in out.items() if v is not None}


def _param_names(model: nn.Module) -> dict[int, str]:
    tensors, _ = model_tensors(model)
    return {id(t): name for name, t in tensors.items()}


def optimizer_index(model: nn.Module, optimizer) -> dict[str, dict[str, dict]]:
    """Per parameter name, per state key: ``{"kind": "param"}`` (shaped and cut like the
    parameter), ``{"kind": "tensor", "shape", "dtype"}`` (replicated), or
    ``{"kind": "object"}`` (a plain value)."""
    names = _param_names(model)
    out: dict[str, dict[str, dict]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not the model's")
            entry = {}
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() and v.shape == p.shape:
                    entry[key] = {"kind": "param", "dtype": str(v.dtype)}
                elif isinstance(v, torch.Tensor):
                    entry[key] = {"kind": "tensor", "shape": list(v.shape),
                                  "dtype": str(v.dtype)}
                else:
                    entry[key] = {"kind": "object"}
            out[names[id(p)]] = entry
    return out


def snapshot(model: nn.Module, optimizer=None, extra_state: Any = None,
             rank_state: Any = None, rank: int = 0) -> dict[str, Any]:
    """Copies (on the CPU) of everything a checkpoint holds, as DCP's flat state."""
    model, writes = unwrap(model)
    tensors, _ = model_tensors(model)
    layouts = _held_layouts(model, tensors, writes)
    state: dict[str, Any] = {f"model.{k}": _copy(t, layouts.get(k)) for k, t in tensors.items()}
    if optimizer is not None:
        by_id = {id(t): k for k, t in tensors.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = by_id[id(p)]
                for key, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        shaped = v.dim() and v.shape == p.shape
                        state[f"optim.{name}.{key}"] = _copy(v, layouts.get(name) if shaped
                                                             else None)
                    else:
                        state[f"optim.{name}.{key}"] = v
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state["optim_groups"] = pack(groups)
    if rank == 0:
        state["extra"] = pack(extra_state)
    if rank_state is not None:
        state[f"rank_state.{rank}"] = pack(rank_state)
    return state


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                               torch.bool)}


def destinations(model: nn.Module, manifest: dict, optimizer=None,
                 rank: int = 0) -> dict[str, Any]:
    """Fresh CPU tensors (wrapped as this model's pieces) for DCP to load into: nothing
    the model or optimizer holds is touched until :func:`apply`."""
    model, writes = unwrap(model)
    tensors, _ = model_tensors(model)
    layouts = _held_layouts(model, tensors, writes)
    state: dict[str, Any] = {}
    for k, t in tensors.items():
        held = torch.empty(local(t).shape, dtype=t.dtype)
        state[f"model.{k}"] = Pieces(held, layouts[k]) if k in layouts else held
    if optimizer is not None:
        for name, entry in manifest["optimizer"].items():
            t = tensors.get(name)
            if t is None:
                continue  # a table another rank holds
            for key, spec in entry.items():
                if spec["kind"] == "param":
                    held = torch.empty(local(t).shape, dtype=_DTYPES[spec["dtype"]])
                    value = Pieces(held, layouts[name]) if name in layouts else held
                elif spec["kind"] == "tensor":
                    value = torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]])
                else:
                    value = None
                state[f"optim.{name}.{key}"] = value
        state["optim_groups"] = b""
    state["extra"] = b""
    if rank < manifest.get("rank_states", 0):
        state[f"rank_state.{rank}"] = b""
    return state


def _like(p: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``held`` (this rank's part) on ``p``'s device, a DTensor placed like ``p`` if it is one."""
    if not is_dtensor(p):
        return held.to(p.device)
    out = torch.empty_like(p, dtype=held.dtype)
    local(out).copy_(held)
    return out


def _plain(value):
    return value.local if isinstance(value, Pieces) else value


@torch.no_grad()
def apply(model: nn.Module, loaded: dict[str, Any], manifest: dict, optimizer=None) -> None:
    """Copy what DCP loaded into the model's tensors and the optimizer's state (an FSDP2
    parameter's moments as DTensors placed like it)."""
    model, _ = unwrap(model)
    tensors, _ = model_tensors(model)
    for k, t in tensors.items():
        local(t).copy_(_plain(loaded[f"model.{k}"]))
    if optimizer is None:
        return
    for name, entry in manifest["optimizer"].items():
        p = tensors.get(name)
        if p is None:
            continue
        state = {}
        for key, spec in entry.items():
            value = _plain(loaded[f"optim.{name}.{key}"])
            state[key] = _like(p, value) if spec["kind"] == "param" else value
        optimizer.state[p] = state
    for group, saved in zip(optimizer.param_groups, unpack(loaded["optim_groups"])):
        group.update(saved)
