"""``export``: one file holding the full model, loadable with ``load_state_dict``.

From a live model (a collective: ``plait.full_state_dict`` gathers it, rank 0 writes) or
from a checkpoint directory (in the calling process alone: the checkpoint is verified,
then DCP reads every chunk of every model tensor into full tensors). safetensors when the
path ends in ``.safetensors`` (refused, saying so, if the package is missing), else
``torch.save``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from . import store
from .checkpointer import CheckpointError, quiet

__all__ = ["export", "full_tensors"]


def full_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint at ``path`` (a ``step-N``, or a directory of
    them: the newest), whole, as the single-device model's state_dict names them."""
    path = Path(path)
    if not (path / store.MANIFEST).is_file() and store.latest(path) is not None:
        path = store.latest(path)
    manifest, why = store.read_manifest(path)
    problems = [why] if manifest is None else store.file_problems(path, manifest)
    if problems:
        raise CheckpointError(f"refusing to export {path}: {problems[0]}")
    reader = FileSystemReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.items()
             if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with quiet(False):
        dcp.load(state, storage_reader=reader,
                 planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    out = {k[len("model."):]: v for k, v in state.items()}
    for alias, name in manifest.get("aliases", {}).items():
        out[alias] = out[name].clone()
    return dict(sorted(out.items()))


def export(source, path: str | os.PathLike) -> Path | None:
    """Write the full model of ``source`` (an ``nn.Module``, possibly plait-parallel, or a
    checkpoint path) to the single file ``path``; returns ``path`` where it was written
    (rank 0 of a live parallel model; None on the other ranks)."""
    path = Path(path)
    if isinstance(source, torch.nn.Module):
        from ..parallel.full_state import full_state_dict

        state = full_state_dict(source)
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return None
        state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    else:
        state = full_tensors(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise CheckpointError(f"{path}: safetensors is not installed ({err}); export to a "
                                  "path without .safetensors for torch.save") from err
        save_file({k: v.clone() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    return path
