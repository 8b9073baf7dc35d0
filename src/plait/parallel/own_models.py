"""``apply_tp``: plait's own models made parallel, as a plan for ``plait.parallelize``.

In the style of gpt-fast's ``tp.py`` and torchtitan's ``parallelize.py``: the
models in :mod:`plait.models` carry no parallel code; :mod:`plait.parallel.own_plan`
knows their shape (by duck typing: nothing here imports a model) and writes their plan,
which ``plait.parallel.parallelize`` applies as it applies any
model's: modules swapped in place, so the parallel model starts from exactly
the plain model's weights and keeps its forward signature and state_dict keys.

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
import torch.distributed as dist
import torch.nn as nn

from ..nn import MoE
from ..nn._shard import GroupInfo
from ..nn.record import record
from ..plan import ShardPlan
from .apply import parallelize
from .own_plan import plait_plan

__all__ = ["apply_tp", "parallelize_gpt", "parallelize_dlrm", "interleaved_blocks"]

log = logging.getLogger("plait.nn")

_KINDS = {"heads", "mlp", "experts", "seq", "tables", "batch"}


def apply_tp(model: nn.Module, group=None, plans: dict[str, ShardPlan] | None = None, *,
             overlap: bool = True, sequence_parallel: bool = False, chunks="auto",
             microbatches: int = 1) -> nn.Module:
    """Parallelise ``model`` in place (a GPT, MoE-GPT or DLRM from plait.models) and return it.

    Without torch.distributed initialised it returns the plain model unchanged (what a
    world of one computes; plait's own one-process references use it). Any other model:
    ``plait.parallelize(model, plan)``."""
    plan = plait_plan(model, sequence_parallel=sequence_parallel)
    if plan is None:
        raise TypeError(f"apply_tp does not know how to parallelise a {type(model).__name__}: it "
                        "expects a GPT (blocks with attn and mlp) or a DLRM (embeddings.bags); "
                        "for any other model use plait.parallelize(model, plan)")
    gpt = "" not in plan
    if gpt:
        _check_microbatches(model, microbatches, overlap, sequence_parallel)
    elif sequence_parallel or microbatches != 1:
        raise ValueError("sequence_parallel and microbatches apply to a GPT, not to a DLRM")
    plans = _plans(plans, model)
    if not (dist.is_available() and dist.is_initialized()):
        log.info("apply_tp: torch.distributed is not initialised; %s stays the plain model",
                 type(model).__name__)
        return model
    parallelize(model, plan, group=group, shards=plans, overlap=overlap, chunks=chunks)
    info = GroupInfo(group)
    if not gpt:
        tables = model.embeddings
        _log_once(info, model, f"DLRM: {len(tables.num_embeddings)} tables model-parallel "
                  f"(plan {list(tables.plan.sizes)}), MLPs data-parallel on {info.world} rank{'s' if info.world != 1 else ''} "
                  f"({'fused' if overlap else 'plain'} path)")
        return model
    moe = [b.mlp for b in model.blocks if isinstance(b.mlp, MoE)]
    experts = f", {moe[0].num_experts} experts per MLP expert-parallel" if moe else ""
    interleaved = ""
    if microbatches > 1 and info.world > 1:
        model.run_blocks = interleaved_blocks(model.blocks, microbatches)
        interleaved = f", {microbatches} micro-batches interleaved"
    _log_once(info, model, f"{'MoE-GPT' if moe else 'GPT'}: {len(model.blocks)} blocks "
              f"tensor-parallel on {info.world} rank{'s' if info.world != 1 else ''}{experts} ({'fused' if overlap else 'plain'} "
              f"path{', sequence-parallel' if sequence_parallel else ''}{interleaved})")
    return model


def parallelize_gpt(model: nn.Module, group=None, plans=None, **kw) -> nn.Module:
    """``apply_tp`` for a GPT or MoE-GPT (refusing any other model)."""
    if not hasattr(model, "blocks"):
        raise TypeError(f"parallelize_gpt expects a GPT, got {type(model).__name__}")
    return apply_tp(model, group, plans, **kw)


def parallelize_dlrm(model: nn.Module, group=None, plans=None, **kw) -> nn.Module:
    """``apply_tp`` for a DLRM (refusing any other model)."""
    if not hasattr(getattr(model, "embeddings", None), "bags"):
        raise TypeError(f"parallelize_dlrm expects a DLRM, got {type(model).__name__}")
    return apply_tp(model, group, plans, **kw)


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


def _log_once(info: GroupInfo, model: nn.Module, line: str) -> None:
    record(model, line=line)
    if info.rank == 0:
        log.info("%s", line)
