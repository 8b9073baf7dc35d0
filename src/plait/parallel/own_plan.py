"""The plan of plait's own models (``plait.models``' GPT, MoE-GPT and DLRM), found by their
shape: ``plan="auto"`` for them, and what :func:`plait.parallel.own_models.apply_tp` applies.

Duck typing, as gpt-fast's ``tp.py`` knows its model: nothing here imports a model.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from .styles import (BatchParallel, Colwise, PlaitMoE, Prepare, Rowwise, SequenceParallel,
                     TableParallel)

__all__ = ["plait_plan"]


def plait_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict | None:
    """The plan of one of plait's own models, found by its shape (None for any other).

    GPT: QKV column-parallel by heads, the attention projection row-parallel by the same
    heads; MLP fc column-parallel, proj row-parallel; MoE MLPs expert-parallel.
    ``sequence_parallel``: the residual stream is cut along the sequence before the first
    block and gathered after the last; the LayerNorms between run on their share (their
    gradients summed), and the linears gather it (``all_gather_matmul``) and
    reduce-scatter it back (``matmul_reduce_scatter``) inside their fused operators.
    DLRM: the tables model-parallel, the rest of the model data-parallel over the batch.
    """
    if hasattr(model, "blocks") and all(hasattr(b, "attn") for b in model.blocks):
        seq, rep = Shard(1), Replicate()
        into, out = (seq, seq) if sequence_parallel else (rep, rep)
        plan: dict = {"blocks.*.attn.qkv": Colwise(input=into),
                      "blocks.*.attn.proj": Rowwise(output=out)}
        for i, block in enumerate(model.blocks):
            if hasattr(block.mlp, "router"):
                plan[f"blocks.{i}.mlp"] = PlaitMoE(replicated_input=not sequence_parallel)
            else:
                plan[f"blocks.{i}.mlp.fc"] = Colwise(input=into)
                plan[f"blocks.{i}.mlp.proj"] = Rowwise(output=out)
        n = len(model.blocks)
        if sequence_parallel and n:
            plan["blocks.*.ln_1"] = plan["blocks.*.ln_2"] = SequenceParallel()
            cut, gather = ((rep, seq),), ((seq, rep),)
            plan["blocks.0"] = Prepare(args=cut, outputs=gather if n == 1 else ())
            if n > 1:
                plan[f"blocks.{n - 1}"] = Prepare(outputs=gather)
        return plan
    if hasattr(getattr(model, "embeddings", None), "bags"):
        return {"embeddings": TableParallel(), "": BatchParallel(tables="embeddings")}
    return None
