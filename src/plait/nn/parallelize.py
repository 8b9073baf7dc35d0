"""Make a plain model parallel by replacing its modules with plait.nn layers built ``from_module``.

In the style of gpt-fast's ``tp.py`` and torchtitan's ``parallelize.py``: the
models in :mod:`plait.models` carry no parallel code; this module knows their
shape (by duck typing: nothing here imports a model) and swaps modules in
place, so the parallel model starts from exactly the plain model's weights and
keeps its forward signature and state_dict keys.

GPT (``blocks`` of ``attn``/``mlp``): QKV column-parallel by heads, attention
output row-parallel by the same heads; MLP fc column-parallel, proj
row-parallel; MoE MLPs expert-parallel. Input and output stay replicated: every
rank computes the same loss. ``sequence_parallel``: the residual stream
between the blocks' linears is split along the sequence (scattered before the
first block, gathered after the last); the LayerNorms inside then see a share
of the tokens, so their gradients are summed over the group. ``microbatches``
(dense GPT, fused, not sequence-parallel): the batch is cut into that many
micro-batches that go through the blocks' residual branches in turn, each
branch's row-parallel projection left on the wire (``RowParallelLinear.start``)
while the next micro-batch computes its branch, and waited for only when that
micro-batch's turn comes again. A branch's all-reduce depends on all of its
own compute, so within one micro-batch its last piece is always exposed;
across micro-batches it is not. The result is the same function of the same
weights (rows are independent until the loss).

DLRM (``embeddings`` with ``bags``, dense MLPs): tables model-parallel
(``ShardedEmbeddingBag``, whole tables per rank), the MLPs data-parallel over
the batch (each rank its ``batch_sizes`` share; gradients summed over the
group), the logits gathered back, so the model still maps the whole batch to
the whole batch's logits on every rank.

``plans``: ``{"heads" | "mlp" | "experts" | "seq" | "tables" | "batch": ShardPlan}``,
or per module (``"blocks.1.attn"``, ``"blocks.1.mlp"``); missing ones are even.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..ops.regions import gather_from_region, scatter_to_region
from ..plan import ShardPlan
from ._shard import GroupInfo, mark_partial_grad
from .embedding import ShardedEmbeddingBag
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import MoE

__all__ = ["apply_tp", "parallelize_gpt", "parallelize_dlrm", "full_state_dict", "PLAIT_LAYERS"]

log = logging.getLogger("plait.nn")

PLAIT_LAYERS = (ColumnParallelLinear, RowParallelLinear, ShardedEmbeddingBag, MoE)
_KINDS = {"heads", "mlp", "experts", "seq", "tables", "batch"}


def apply_tp(model: nn.Module, group=None, plans: dict[str, ShardPlan] | None = None, *,
             overlap: bool = True, sequence_parallel: bool = False, chunks="auto",
             microbatches: int = 1) -> nn.Module:
    """Parallelise ``model`` in place (a GPT, MoE-GPT or DLRM from plait.models) and return it."""
    if hasattr(model, "blocks") and all(hasattr(b, "attn") for b in model.blocks):
        return parallelize_gpt(model, group, plans, overlap=overlap,
                               sequence_parallel=sequence_parallel, chunks=chunks,
                               microbatches=microbatches)
    if hasattr(getattr(model, "embeddings", None), "bags"):
        if sequence_parallel or microbatches != 1:
            raise ValueError("sequence_parallel and microbatches apply to a GPT, not to a DLRM")
        return parallelize_dlrm(model, group, plans, overlap=overlap, chunks=chunks)
    raise TypeError(f"apply_tp does not know how to parallelise a {type(model).__name__}: it "
                    "expects a GPT (blocks with attn and mlp) or a DLRM (embeddings.bags)")


def _plans(plans, model: nn.Module) -> dict[str, ShardPlan]:
    plans = dict(plans or {})
    paths = {name for name, _ in model.named_modules()}
    unknown = sorted(k for k in plans if k not in _KINDS and k not in paths)
    if unknown:
        raise ValueError(f"plans {unknown} name neither a kind ({', '.join(sorted(_KINDS))}) nor "
                         "a module of the model")
    bad = {k: type(v).__name__ for k, v in plans.items() if not isinstance(v, ShardPlan)}
    if bad:
        raise TypeError(f"plans must be ShardPlan values, got {bad}")
    return plans


def parallelize_gpt(model: nn.Module, group=None, plans=None, *, overlap: bool = True,
                    sequence_parallel: bool = False, chunks="auto",
                    microbatches: int = 1) -> nn.Module:
    plans = _plans(plans, model)
    info = GroupInfo(group)
    _check_microbatches(model, microbatches, overlap, sequence_parallel)
    seq = plans.get("seq")
    common = dict(overlap=overlap, chunks=chunks, sequence_parallel=sequence_parallel,
                  seq_plan=seq)
    dims: dict[str, tuple[str, ...]] = {}  # a sharded dim → the layers its plan splits together
    for i, block in enumerate(model.blocks):
        attn, heads = block.attn, plans.get(f"blocks.{i}.attn", plans.get("heads"))
        attn.qkv = ColumnParallelLinear.from_module(attn.qkv, group, plan=heads, blocks=3,
                                                    unit=attn.head_dim, unit_name="heads", **common)
        attn.proj = RowParallelLinear.from_module(attn.proj, group, plan=heads, unit=attn.head_dim,
                                                  unit_name="heads", **common)
        dims[f"blocks.{i}.attn"] = (f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj")
        mlp = block.mlp
        if hasattr(mlp, "router"):
            block.mlp = MoE.from_module(mlp, group, plan=plans.get(f"blocks.{i}.mlp",
                                                                   plans.get("experts")),
                                        overlap=overlap, chunks=chunks,
                                        replicated_input=not sequence_parallel)
        else:
            cols = plans.get(f"blocks.{i}.mlp", plans.get("mlp"))
            mlp.fc = ColumnParallelLinear.from_module(mlp.fc, group, plan=cols, **common)
            mlp.proj = RowParallelLinear.from_module(mlp.proj, group, plan=cols, **common)
            dims[f"blocks.{i}.mlp"] = (f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.proj")
        if sequence_parallel:
            for param in _unsharded_params(block):
                mark_partial_grad(param, group)
    model._plait_dims = dims
    if sequence_parallel and info.world > 1 and len(model.blocks):
        _split_sequence(model.blocks[0], model.blocks[-1], group, seq)
    moe = [b.mlp for b in model.blocks if isinstance(b.mlp, MoE)]
    experts = f", {moe[0].num_experts} experts per MLP expert-parallel" if moe else ""
    interleaved = ""
    if microbatches > 1 and info.world > 1:
        model.run_blocks = interleaved_blocks(model.blocks, microbatches)
        interleaved = f", {microbatches} micro-batches interleaved"
    _log_once(info, model, f"{'MoE-GPT' if moe else 'GPT'}: {len(model.blocks)} blocks "
              f"tensor-parallel on {info.world} ranks{experts} ({'fused' if overlap else 'plain'} "
              f"path{', sequence-parallel' if sequence_parallel else ''}{interleaved})")
    return model


def _check_microbatches(model: nn.Module, microbatches, overlap: bool,
                        sequence_parallel: bool) -> None:
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if microbatches == 1:
        return
    why = ("sequence_parallel is set" if sequence_parallel else
           "overlap=False (nothing is left on the wire to hide)" if not overlap else
           "the model has no run_blocks" if not hasattr(model, "run_blocks") else
           "its MLPs are mixtures of experts" if any(hasattr(b.mlp, "router") for b in model.blocks)
           else None)
    if why is not None:
        raise ValueError(f"microbatches={microbatches} interleaves dense, fused, "
                         f"non-sequence-parallel GPT blocks, but {why}")


def interleaved_blocks(blocks, parts: int):
    """``run_blocks`` for ``blocks`` on up to ``parts`` micro-batches (cut along the batch).

    Each micro-batch in turn computes its next residual branch and starts that branch's
    projection (its all-reduce goes on the wire); it waits for the branch before only
    when its turn comes again, after the other micro-batches have computed theirs, and
    runs ``then`` (the model's head) on its share while the next one's last all-reduce
    travels. The other micro-batches' compute hides an all-reduce, so with
    ``chunks="auto"`` it goes out whole, saving the pieces' overhead; only the last
    branch's, with nothing but a head to hide under, keeps the layer's pieces.
    """
    def run_blocks(x: torch.Tensor, then) -> torch.Tensor:
        branches = [branch for block in blocks for branch in block.branches()]
        if not branches:
            return then(x)
        xs = list(x.chunk(parts))  # fewer when the batch has fewer rows
        started = [None] * len(xs)
        for j, (pre, proj) in enumerate(branches):
            whole = j < len(branches) - 1 and proj.chunks == "auto"
            for i in range(len(xs)):
                if started[i] is not None:
                    xs[i] = xs[i] + started[i].finish()
                started[i] = proj.start(pre(xs[i]), chunks=1 if whole else None)
        return torch.cat([then(x + s.finish()) for x, s in zip(xs, started)])

    return run_blocks


def _unsharded_params(module: nn.Module):
    """Parameters of ``module`` outside any plait layer (LayerNorms and the like)."""
    inside = {id(p) for m in module.modules() if isinstance(m, PLAIT_LAYERS) for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in inside]


def _split_sequence(first: nn.Module, last: nn.Module, group, seq: ShardPlan | None) -> None:
    """Scatter the residual stream [B, S, D] along S before ``first``, gather it after ``last``."""
    # even, or the plan's: the scatter checks that they fit, on every rank at once; the
    # gather finds what the scatter left
    sizes = None if seq is None else list(seq.sizes)

    def scatter(module, args):
        return (scatter_to_region(args[0], group, 1, sizes), *args[1:])

    def gather(module, args, out):
        return gather_from_region(out, group, 1, sizes)

    first.register_forward_pre_hook(scatter)
    last.register_forward_hook(gather)


def parallelize_dlrm(model: nn.Module, group=None, plans=None, *, overlap: bool = True,
                     chunks="auto") -> nn.Module:
    plans = _plans(plans, model)
    info = GroupInfo(group)
    tables = ShardedEmbeddingBag.from_module(model.embeddings, group, plan=plans.get("tables"),
                                             batch_plan=plans.get("batch"), overlap=overlap,
                                             chunks=chunks)
    model.embeddings = tables
    for param in _unsharded_params(model):
        mark_partial_grad(param, group)  # data-parallel MLPs: each rank saw its batch share

    split: dict[str, list[int]] = {}

    def split_batch(module, args):
        dense, *rest = args
        split["sizes"] = tables._shares(dense.shape[0])  # the scatter checks them
        return (scatter_to_region(dense, group, 0, split["sizes"]), *rest)

    def gather_logits(module, args, out):
        return gather_from_region(out, group, 0, split["sizes"])

    if info.world > 1:
        model.register_forward_pre_hook(split_batch)
        model.register_forward_hook(gather_logits)
    _log_once(info, model, f"DLRM: {len(tables.num_embeddings)} tables model-parallel "
              f"(plan {list(tables.plan.sizes)}), MLPs data-parallel on {info.world} ranks "
              f"({'fused' if overlap else 'plain'} path)")
    return model


def full_state_dict(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """The plain model's state_dict, every sharded tensor gathered (a collective: every rank
    calls it). It loads straight into the single-device model. ``grads``: the parameters'
    gradients instead, by the same names (zeros where there is none; no buffers)."""
    if grads:
        state = {k: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                 for k, p in model.named_parameters()}
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, PLAIT_LAYERS):
            prefix = f"{name}." if name else ""
            for key in [k for k in state if k.startswith(prefix)]:
                del state[key]
            state.update({prefix + k: v for k, v in module.full_state_dict(grads).items()})
    return state


def _log_once(info: GroupInfo, model: nn.Module, line: str) -> None:
    model._plait_parallel = line
    if info.rank == 0:
        log.info("%s", line)
