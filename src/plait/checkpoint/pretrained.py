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
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from .shards import load_shards
from .sources import CheckpointFileError, SafetensorsDir

__all__ = ["from_pretrained", "materialize"]


def from_pretrained(path: str | os.PathLike, plan: Mapping[str, Any] | str = "auto", *,
                    dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                    group=None, mesh=None, shards=None, overlap: bool = True, chunks="auto",
                    dp_kind: str | None = "auto", model_class=None, **config_kwargs) -> nn.Module:
    """The causal LM saved at ``path`` (``save_pretrained``: config.json and safetensors)
    made tensor-parallel by ``plan`` over ``group`` or ``mesh``, every rank reading only its
    shards; in eval mode, as transformers returns a loaded model. ``dtype``: the model's
    (default: the config's); ``model_class``: another class than the config's causal LM;
    ``config_kwargs`` change the config as transformers' ``from_pretrained`` takes them
    (``experts_implementation="eager"``, ``attn_implementation="sdpa"``).
    The other arguments are :func:`plait.parallelize`'s. A missing or truncated file, or a
    tensor that does not fit, is one ``CheckpointFileError`` line, before any rank builds
    anything."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..parallel.apply import parallelize
    from ..parallel.data import data_parallel

    path = Path(path)
    store = SafetensorsDir(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, **config_kwargs)
    except (OSError, ValueError) as err:
        raise CheckpointFileError(f"{path / 'config.json'}: {str(err).splitlines()[0]}") from None
    dtype = dtype or _config_dtype(config)
    with torch.device("meta"):
        if model_class is None:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        else:
            model = model_class._from_config(config, dtype=dtype)
    if dtype == torch.float64 and getattr(config, "_experts_implementation", None) == "grouped_mm":
        model.set_experts_implementation("eager")  # torch's grouped GEMM takes no float64 here
    model = parallelize(model, plan, group=group, mesh=mesh, shards=shards, overlap=overlap,
                        chunks=chunks, dp_kind=None)
    materialize(model, device or _device(group, mesh))
    load_shards(model, store)
    _generation_config(model, path)
    model.eval()
    if mesh is not None and mesh.ndim == 2 and dp_kind is not None:
        return data_parallel(model, mesh, kind=dp_kind)
    return model


def materialize(model: nn.Module, device: str | torch.device, *,
                buffers: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """``model.to_empty(device)``: this rank's tensors allocated, to be filled by a loader
    (:func:`~plait.checkpoint.shards.load_shards`, ``plait.checkpoint.load``), and the
    buffers no checkpoint holds computed (non-persistent ones: transformers' rotary
    ``inv_freq``) by ``buffers(model)``, default transformers' own ``_init_weights`` on
    their modules; another model built on the meta device must pass ``buffers``.

    Each
    parameter the same object with its gradient hooks (copied K/V heads' sum, a replicated
    parameter's all-reduce) and attributes. Plain ``to_empty`` makes new parameters on a
    change of device, and even swapping them in place leaves the hooks behind with the old
    storage (autograd keeps them there): both would drop them silently. So the tensors are
    swapped in place, and each one's hooks registered again and attributes set again."""
    kept = [(t, dict(vars(t)), list((t._backward_hooks or {}).values()))
            for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()]
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    for tensor, attributes, hooks in kept:
        for key, value in attributes.items():
            setattr(tensor, key, value)
        if hooks:
            tensor._backward_hooks = OrderedDict()
            for hook in hooks:
                tensor.register_hook(hook)
    with torch.no_grad():
        _fill_buffers(model, buffers)
    return model


def _fill_buffers(model: nn.Module, buffers) -> None:
    """Non-persistent buffers: computed by ``buffers(model)`` or transformers' initialisation.
    Each is filled with 0, computed, then with 1 and computed again: a buffer the two
    passes leave different was not computed, and is refused (whatever its dtype)."""
    saved = set(model.state_dict())
    missing = {}
    for path, module in model.named_modules():
        for key, value in module.named_buffers(recurse=False):
            name = f"{path}.{key}" if path else key
            if name not in saved and value is not None:
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
    """transformers' own ``_init_weights`` on ``modules``, the ones holding such buffers (it
    also draws their parameters, which the load then overwrites)."""
    def transformers_init(model: nn.Module) -> None:
        from transformers import initialization as init

        with init.guard_torch_init_functions():
            for module in modules:
                model._init_weights(module)
    return transformers_init


def _bits(value: torch.Tensor) -> torch.Tensor:
    flat = value.detach().contiguous().view(-1)
    return flat.view(torch.uint8).clone() if flat.dtype != torch.bool else flat.clone()


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
