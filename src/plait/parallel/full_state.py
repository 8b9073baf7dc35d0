"""``full_state_dict(model)``: the plain model's state_dict from a parallel one, every sharded
tensor gathered, whatever made it parallel (plait's layers, ``plait.parallelize``'s extra
layers, FSDP2 or DDP around them)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..nn import PLAIT_LAYERS
from .data import unsharded
from .experts import ExpertParallelExperts
from .layers import VocabParallelEmbedding

__all__ = ["full_state_dict"]


def full_state_dict(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's state_dict, every sharded tensor gathered (a collective: every rank
    calls it). It loads straight into the single-device model. ``grads``: the parameters'
    gradients instead, by the same names (zeros where there is none; no buffers).

    A sharded module is one with ``full_state_dict(grads)`` (plait's layers, and those
    ``plait.parallelize`` adds) or split in place (``_plait_shards``: transformers' experts).

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
            in_place = getattr(module, "_plait_shards", None)
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
