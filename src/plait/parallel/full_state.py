"""Full state dicts in and out of a parallel model.

``full_state_dict(model)``: the plain model's state_dict from a parallel one, every sharded
tensor gathered, whatever made it parallel (plait's layers, ``plait.parallelize``'s extra
layers, FSDP2 or DDP around them). ``take_shares``: the reverse, a ``load_state_dict``
pre-hook that ``plait.parallelize`` puts on the model, so ``model.load_state_dict(full)``
and DCP's ``set_model_state_dict(model, full, options=StateDictOptions(
full_state_dict=True, broadcast_from_rank0=True))`` (which ends in ``load_state_dict``)
give each rank its share of every full tensor, as torchtitan users load one."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..nn import PLAIT_LAYERS
from ..nn.record import shards_of
from .data import unsharded
from .experts import ExpertParallelExperts
from .layers import VocabParallelEmbedding
from .layout import Layout, model_layouts

__all__ = ["full_state_dict", "take_shares"]


def full_state_dict(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's state_dict, every sharded tensor gathered (a collective: every rank
    calls it). It loads straight into the single-device model. ``grads``: the parameters'
    gradients instead, by the same names (zeros where there is none; no buffers).

    A sharded module is one with ``full_state_dict(grads)`` (plait's layers, and those
    ``plait.parallelize`` adds) or split in place (transformers' experts: its
    :func:`plait.nn.record.shards_of`).

    A data-parallel model: DDP's wrapper is read through its ``.module``; under FSDP2 the
    dp-sharded tensors are gathered over dp (``full_tensor``) and plait's layers over tp
    while their plain shards are back (``plait.parallel.unsharded``; not with ``grads``,
    which FSDP2 keeps on the sharded parameters only)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    if fsdp and grads:
        raise ValueError("full_state_dict(grads=True) of an FSDP2 model: its gradients are "
                         "dp-sharded DTensors that plait's layers do not gather")

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    if grads:
        state = {k: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                 for k, p in model.named_parameters()}
    else:
        state = {k: whole(v.detach()) for k, v in model.state_dict().items()}
    with unsharded(model) if fsdp else contextlib.nullcontext():
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            in_place = shards_of(module)
            if in_place is not None:
                state.update({prefix + k: v
                              for k, v in in_place.full_state_dict(grads).items()})
            elif _sharded(module):
                for key in [k for k in state if k.startswith(prefix)]:
                    del state[key]
                state.update({prefix + k: v for k, v in module.full_state_dict(grads).items()})
    return state


def _sharded(module: nn.Module) -> bool:
    return isinstance(module, PLAIT_LAYERS + (VocabParallelEmbedding, ExpertParallelExperts))


def take_shares(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """``load_state_dict`` pre-hook: each full-sized tensor of a sharded parameter or buffer
    in ``state_dict`` is replaced by this rank's share of it (its pieces, as plait's DCP
    checkpoints place them: :mod:`plait.parallel.layout`); a tensor of this rank's own
    shape (a parallel model's own ``state_dict``) is left as it is, and any other shape to
    ``load_state_dict``'s own size check. Into a model still on the meta device it refuses
    (``assign`` would put new parameters in place of plait's, their gradient hooks lost):
    ``plait.checkpoint.materialize(model, device)`` first, as torchtitan's ``to_empty``."""
    local = module.state_dict(keep_vars=True)
    for key, layout in model_layouts(module).items():
        full = state_dict.get(prefix + key)
        mine = local.get(key)
        if not torch.is_tensor(full) or mine is None or full.shape == mine.shape \
                or tuple(full.shape) != tuple(layout.global_shape):
            continue
        if mine.is_meta:
            raise ValueError(f"{prefix + key}: loading a full state dict into a parallel model "
                             "on the meta device would replace plait's parameters (and their "
                             "gradient hooks); call plait.checkpoint.materialize(model, "
                             "'cpu') first")
        state_dict[prefix + key] = _share(full, layout, mine)


def _share(full: torch.Tensor, layout: Layout, like: torch.Tensor) -> torch.Tensor:
    """This rank's share of ``full``: its pieces along ``layout.dim``, in local order."""
    out = full.new_empty(like.shape)
    for offsets, sizes, local in layout.boxes(written=False):
        piece = full.narrow(layout.dim, offsets[layout.dim], sizes[layout.dim])
        if layout.rows is not None:
            piece = piece.narrow(0, layout.rows[0], layout.rows[1])
        out.narrow(layout.dim, local, sizes[layout.dim]).copy_(piece)
    return out
