"""``plait.from_pretrained(path, plan="auto")``: a transformers checkpoint as a tensor-parallel
model, built on the meta device, each rank reading only its shards.

    init_from_env()                                        # under torchrun
    model = plait.from_pretrained("ckpt/", plan="auto")    # every rank: its shards only
    model = plait.from_pretrained("ckpt/", mesh=plait.parallel.dp_tp_mesh(dp=2, tp=2))

The steps, each usable alone for any other model: build the model on the meta device (no
memory), :func:`plait.parallelize` it (shard-sized meta parameters: the plan, uneven
shares and the cross-rank check work on shapes), ``to_empty`` (this rank's shards,
allocated), :func:`~plait.checkpoint.shards.load_shards` (each piece read from its file),
then data parallelism around it on a ``dp × tp`` mesh. A rank's peak memory is its share of
the model plus one checkpoint file's mapping (``plait bench load`` measures it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from .shards import load_shards
from .sources import CheckpointFileError, SafetensorsDir

__all__ = ["from_pretrained", "materialize"]


def from_pretrained(path: str | os.PathLike, plan: Mapping[str, Any] | str = "auto", *,
                    dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    group=None, mesh=None, shards=None, overlap: bool = True, chunks="auto",
                    dp_kind: str | None = "auto", model_class=None) -> nn.Module:
    """The causal LM saved at ``path`` (``save_pretrained``: config.json and safetensors)
    made tensor-parallel by ``plan`` over ``group`` or ``mesh``, every rank reading only its
    shards; in eval mode, as transformers returns a loaded model. ``dtype``: the model's
    (default: the config's); ``model_class``: another class than the config's causal LM.
    The other arguments are :func:`plait.parallelize`'s. A missing or truncated file, or a
    tensor that does not fit, is one ``CheckpointFileError`` line, before any rank builds
    anything."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..parallel.apply import parallelize
    from ..parallel.data import data_parallel

    path = Path(path)
    store = SafetensorsDir(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise CheckpointFileError(f"{path / 'config.json'}: {str(err).splitlines()[0]}") from None
    dtype = dtype or _config_dtype(config)
    with torch.device("meta"):
        if model_class is None:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype)
    model = parallelize(model, plan, group=group, mesh=mesh, shards=shards, overlap=overlap,
                        chunks=chunks, dp_kind=None)
    materialize(model, device or _device(group, mesh))
    load_shards(model, store)
    _generation_config(model, path)
    model.eval()
    if mesh is not None and mesh.ndim == 2 and dp_kind is not None:
        return data_parallel(model, mesh, kind=dp_kind)
    return model


def materialize(model: nn.Module, device: str | torch.device) -> nn.Module:
    """``model.to_empty(device)``, keeping tied parameters one parameter (``to_empty``
    allocates each module's parameters anew, which would untie them)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, key))
    model.to_empty(device=device)
    for shared in owners.values():
        first, key = shared[0]
        for module, other in shared[1:]:
            setattr(module, other, getattr(first, key))
    return model


def _config_dtype(config) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _device(group, mesh) -> torch.device:
    if mesh is not None:
        return torch.device(mesh.device_type, torch.cuda.current_device()) \
            if mesh.device_type == "cuda" else torch.device("cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _generation_config(model: nn.Module, path: Path) -> None:
    if (path / "generation_config.json").exists() and hasattr(model, "generation_config"):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
