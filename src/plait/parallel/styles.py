"""The plan vocabulary: PyTorch's parallel styles, transformers' strings, plait's own, as one.

Every plan entry becomes one of the frozen styles below (``to_style``): what the module
does and how its input and output are laid out, in PyTorch's placements (``Replicate()``,
``Shard(d)``); a module's output is always this rank's plain local tensor, never a DTensor.

==========================================  =========================================
PyTorch / transformers                      plait style
==========================================  =========================================
ColwiseParallel(), "colwise",               Colwise(): weight rows split, output
"local_colwise", "unit_colwise"             features local (Shard(-1))
  output_layouts=Replicate(),               Colwise(output=Replicate()): output
  "colwise_rep", "colwise_gather_output"    gathered (an LM head)
  input_layouts=Shard(1)                    Colwise(input=Shard(1)): sequence-parallel
                                            input, gathered inside the fused matmul
"packed_colwise"                            Colwise(blocks=2): [gate | up] in one weight
RowwiseParallel(), "rowwise",               Rowwise(): weight columns split, output
"local_rowwise", "unit_rowwise"             summed over ranks (all-reduce)
  input_layouts=Replicate(),                Rowwise(input=Replicate()): the input is
  "rowwise_rep", "rowwise_split_input"      whole and cut locally
  output_layouts=Shard(1)                   Rowwise(output=Shard(1)): reduce-scattered
                                            along the sequence
RowwiseParallel() on nn.Embedding,          VocabParallel(): rows of the vocabulary
"embedding_rowwise"                         split, lookups summed
SequenceParallel(), "sequence_parallel"     SequenceParallel(): runs on its share of
                                            the sequence; parameter gradients summed
PrepareModuleInput / PrepareModuleOutput    Prepare(): moves tensors between layouts
"replicate", "ep_router"                    Replicated(): nothing changes
"replicated_with_grad_allreduce"            Replicated(grad_sum=True)
"moe_tp_experts"                            ExpertsTP(): every expert's FFN dim split
"ep_dispatch_experts", "grouped_gemm",      ExpertsEP(): whole experts per rank
"gather" (experts)
"local_params" (an attention module)        LocalParams(): its per-head parameters
                                            (sinks) split with its heads
"mla_kv_a_proj"                             SharedRope(): whole; the gradient of its
                                            rotary-key features summed over ranks
==========================================  =========================================

Unit heads (``unit_colwise``) need nothing extra: attention is split by whole heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = ["Colwise", "Rowwise", "VocabParallel", "SequenceParallel", "Prepare", "Replicated",
           "ExpertsTP", "ExpertsEP", "PlaitMoE", "TableParallel", "LocalParams", "SharedRope",
           "BatchParallel", "Style", "to_style", "layout_name", "HF_STYLES"]

REPLICATE, FEATURES = Replicate(), Shard(-1)


@dataclass(frozen=True)
class Colwise:
    """Column-parallel linear: ``input`` Replicate() or Shard(seq); ``output`` Shard(-1) or
    Replicate(); ``blocks``: equal blocks in the output ([gate | up]: 2), each split alike."""

    input: Placement = REPLICATE
    output: Placement = FEATURES
    blocks: int | None = None


@dataclass(frozen=True)
class Rowwise:
    """Row-parallel linear: ``input`` Shard(-1) or Replicate(); ``output`` Replicate() or
    Shard(seq)."""

    input: Placement = FEATURES
    output: Placement = REPLICATE


@dataclass(frozen=True)
class VocabParallel:
    """An nn.Embedding whose vocabulary rows are split; ``output`` Replicate() (all-reduce) or
    Shard(seq) (reduce-scatter)."""

    output: Placement = REPLICATE


@dataclass(frozen=True)
class SequenceParallel:
    """A module (a norm) that runs on this rank's share of dim ``seq_dim``; its parameters
    are replicated, their gradients summed over the group."""

    seq_dim: int = 1


@dataclass(frozen=True)
class Prepare:
    """Move a module's inputs (``args``, ``kwargs``) and outputs (``outputs``) between layouts:
    each a ``(have, want)`` pair of placements, or None to leave it."""

    args: tuple = ()
    kwargs: tuple = ()   # ((name, (have, want)), ...)
    outputs: tuple = ()


@dataclass(frozen=True)
class Replicated:
    """Left whole on every rank; ``grad_sum``: each rank's gradient is a partial sum."""

    grad_sum: bool = False


@dataclass(frozen=True)
class ExpertsTP:
    """transformers' fused experts (``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]):
    every expert's FFN dim F split over the ranks, outputs summed."""


@dataclass(frozen=True)
class ExpertsEP:
    """transformers' fused experts, whole experts per rank: tokens go to their experts'
    owners and back through plait's fused all-to-all operators."""


@dataclass(frozen=True)
class PlaitMoE:
    """A plait MoE module (``router``, ``w1``, ``w2``, ``top_k``) made ``plait.nn.MoE``."""

    replicated_input: bool = True


@dataclass(frozen=True)
class TableParallel:
    """plait's DLRM tables (an ``EmbeddingBagCollection``) made ``ShardedEmbeddingBag``."""


@dataclass(frozen=True)
class SharedRope:
    """Multi-head latent attention's ``kv_a_proj_with_mqa``: left whole on every rank; the
    last ``qk_rope_head_dim`` features of its output (the rotary key every head reads) are
    read by a rank's heads only, so their gradient is summed over the ranks."""


@dataclass(frozen=True)
class LocalParams:
    """An attention module's own parameters with one entry per query head (sinks, a gate's
    bias): each rank keeps its heads' entries, as the attention's heads are split."""


@dataclass(frozen=True)
class BatchParallel:
    """The module's own computation is data-parallel: the batch (dim 0) is cut as the
    ``ShardedEmbeddingBag`` at ``tables`` cuts it, and the outputs gathered back; its other
    parameters' gradients are summed."""

    tables: str = field(default="embeddings")


Style = (Colwise | Rowwise | VocabParallel | SequenceParallel | Prepare | Replicated
         | ExpertsTP | ExpertsEP | PlaitMoE | TableParallel | BatchParallel | LocalParams
         | SharedRope)
_STYLES = (Colwise, Rowwise, VocabParallel, SequenceParallel, Prepare, Replicated,
           ExpertsTP, ExpertsEP, PlaitMoE, TableParallel, BatchParallel, LocalParams,
           SharedRope)

# transformers' plan strings (4.5x through 5.x names), as plait styles
HF_STYLES: dict[str, Any] = {
    "colwise": Colwise(), "local_colwise": Colwise(), "unit_colwise": Colwise(),
    "colwise_rep": Colwise(output=REPLICATE), "colwise_gather_output": Colwise(output=REPLICATE),
    "packed_colwise": Colwise(blocks=2),
    "rowwise": Rowwise(), "local_rowwise": Rowwise(), "unit_rowwise": Rowwise(),
    "rowwise_rep": Rowwise(input=REPLICATE), "rowwise_split_input": Rowwise(input=REPLICATE),
    "embedding_rowwise": VocabParallel(),
    "sequence_parallel": SequenceParallel(),
    "replicate": Replicated(), "ep_router": Replicated(),
    "replicated_with_grad_allreduce": Replicated(grad_sum=True),
    "moe_tp_experts": ExpertsTP(),
    "ep_dispatch_experts": ExpertsEP(), "grouped_gemm": ExpertsEP(), "gather": ExpertsEP(),
    "local_params": LocalParams(), "mla_kv_a_proj": SharedRope(),
}
# styles that name a parameter of an experts module: the module's own style decides
HF_PARAM_STYLES = {"grouped_gemm", "packed_colwise", "packed_rowwise", "local_packed_rowwise",
                   "local_colwise", "local_rowwise", "colwise", "rowwise"}
_HF_REFUSED = {
    "embedding_colwise": "an embedding split along its features; plait splits the vocabulary "
                         "(embedding_rowwise)",
    "megamoe_router": "DeepGEMM's MegaMoE", "megamoe_experts": "DeepGEMM's MegaMoE",
    "moe_identity_expert": "identity experts",
    "local": "an isolated (rank-local) module",
    "all_reduce": "a module whose output is a partial sum", "all_reduce_output":
    "a module whose output is a partial sum", "isolated": "an isolated (rank-local) module",
    "packed_rowwise": "a packed row-parallel weight outside an experts module",
    "local_packed_rowwise": "a packed row-parallel weight outside an experts module",
}


def layout_name(p: Placement | None) -> str:
    return "None" if p is None else "Replicate()" if p.is_replicate() else \
        f"Shard({p.dim})" if p.is_shard() else type(p).__name__ + "()"


def to_style(value: Any, where: str) -> Style:
    """A plan entry's value as a plait style; a TypeError/ValueError naming ``where`` if plait
    cannot run it."""
    if isinstance(value, _STYLES):
        return value
    if isinstance(value, str):
        if value in HF_STYLES:
            return HF_STYLES[value]
        why = _HF_REFUSED.get(value)
        if why is not None:
            raise ValueError(f"plan entry {where!r}: transformers' style {value!r} ({why}) is not "
                             "supported by plait")
        raise ValueError(f"plan entry {where!r}: {value!r} is not a transformers plan style "
                         f"plait knows ({', '.join(sorted(HF_STYLES))})")
    return _from_torch(value, where)


def _from_torch(value: Any, where: str) -> Style:
    from torch.distributed.tensor import parallel as tp

    if isinstance(value, tp.ColwiseParallel):
        _local_output(value, where, "ColwiseParallel")
        style = Colwise(input=_one(value.input_layouts, where),
                        output=_one(value.output_layouts, where))
        _check_layouts(where, "ColwiseParallel", style.input, (REPLICATE, "seq"), "input_layouts")
        _check_layouts(where, "ColwiseParallel", style.output, (FEATURES, REPLICATE),
                       "output_layouts")
        return style
    if isinstance(value, tp.RowwiseParallel):
        _local_output(value, where, "RowwiseParallel")
        style = Rowwise(input=_one(value.input_layouts, where),
                        output=_one(value.output_layouts, where))
        _check_layouts(where, "RowwiseParallel", style.input, (FEATURES, REPLICATE),
                       "input_layouts")
        _check_layouts(where, "RowwiseParallel", style.output, (REPLICATE, "seq"), "output_layouts")
        return style
    if isinstance(value, tp.SequenceParallel):
        (seq,) = value.sequence_sharding
        return SequenceParallel(seq_dim=seq.dim)
    if isinstance(value, tp.PrepareModuleInputOutput):
        a = _from_torch(value.prepare_module_input, where)
        b = _from_torch(value.prepare_module_output, where)
        return Prepare(args=a.args, kwargs=a.kwargs, outputs=b.outputs)
    if isinstance(value, tp.PrepareModuleInput):
        args = _pairs(value.input_layouts or (), value.desired_input_layouts or (), where)
        kwargs = tuple((k, pair) for k, pair in zip(value.input_kwarg_layouts, _pairs(
            tuple(value.input_kwarg_layouts.values()),
            tuple(value.desired_input_kwarg_layouts.get(k) for k in value.input_kwarg_layouts),
            where)))
        return Prepare(args=args, kwargs=kwargs)
    if isinstance(value, tp.PrepareModuleOutput):
        return Prepare(outputs=_pairs(value.output_layouts, value.desired_output_layouts, where))
    if isinstance(value, tp.ParallelStyle):
        raise ValueError(f"plan entry {where!r}: {type(value).__name__} is not a parallel style "
                         "plait supports (ColwiseParallel, RowwiseParallel, SequenceParallel, "
                         "PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)")
    raise TypeError(f"plan entry {where!r}: {type(value).__name__} {value!r} is neither a "
                    "PyTorch parallel style, a transformers plan string, a plait style nor a "
                    "ShardPlan")


def _local_output(value, where: str, name: str) -> None:
    if not value.use_local_output:
        raise ValueError(f"plan entry {where!r}: {name}(use_local_output=False) asks for a DTensor "
                         "output; plait's layers give local tensors (use_local_output=True), so "
                         "code after it must not rely on DTensor (e.g. loss_parallel)")


def _one(layouts, where: str) -> Placement:
    if len(layouts) != 1:
        raise ValueError(f"plan entry {where!r}: a linear layer takes one layout, got {layouts}")
    return layouts[0]


def _check_layouts(where: str, name: str, got: Placement, allowed, what: str) -> None:
    seq = "seq" in allowed and got.is_shard() and got.dim not in (-1,)
    if got in allowed or seq:
        return
    names = [layout_name(a) if a != "seq" else "Shard(seq dim)" for a in allowed]
    raise ValueError(f"plan entry {where!r}: {name}({what}={layout_name(got)}) is not supported by "
                     f"plait; it takes {' or '.join(names)}")


def _pairs(have, want, where: str) -> tuple:
    """(have, want) per tensor, None where either is None or they are equal."""
    if len(have) != len(want):
        raise ValueError(f"plan entry {where!r}: {len(have)} layouts but {len(want)} desired ones")
    out = []
    for a, b in zip(have, want):
        for p in (a, b):
            if p is not None and not (p.is_replicate() or p.is_shard()):
                raise ValueError(f"plan entry {where!r}: layout {layout_name(p)} is not supported "
                                 "(plait moves Replicate() and Shard(d) tensors)")
        out.append(None if a is None or b is None or a == b else (a, b))
    return tuple(out)
