"""``parallelize(model, plan)``: replace a model's modules in place with plait's parallel layers.

Three passes, so that a bad plan raises before the model changes: resolve
(the plan to styles per module path, the column/row pairs to dims, every dim's
``ShardPlan``), build (every new layer ``from_module``, cut from the module's own
weights), swap (set the new modules, then the hooks that move tensors between
layouts and sum replicated parameters' gradients). What runs unfused, and why,
is logged once on rank 0 and kept in ``plait.parallel.applied(model)``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate

from ..nn._shard import GroupInfo, mark_partial_grad
from ..nn.embedding import ShardedEmbeddingBag
from ..nn.linear import ColumnParallelLinear, RowParallelLinear, share_input
from ..nn.moe import MoE
from ..nn.record import Applied, record
from ..nn.record import applied as recorded
from ..ops.context import get_context
from ..ops.regions import gather_from_region, scatter_to_region
from ..plan import ShardPlan
from .agreed import agree, describe
from .data import DP_KINDS, data_parallel
from .dims import Dim, find_dims, resolve_plan_for
from .experts import ExpertParallelExperts
from .full_state import take_shares
from .layers import (CopiedHeadsLinear, VocabParallelEmbedding, experts_shape, shard_experts_ffn,
                     shard_local_params, sum_tail_grad)
from .exactness import Verdict, verify
from .resolve import auto_plan, check_shards, expand, shard_for, split_shards
from .styles import (BatchParallel, Colwise, ExpertsEP, ExpertsTP, LocalParams, PlaitMoE,
                     Prepare, Replicated, Rowwise, SequenceParallel, SharedRope,
                     TableParallel, VocabParallel, layout_name)

__all__ = ["parallelize", "applied"]

log = logging.getLogger("plait.parallel")

_UNIT_NAMES = {"mlp": "columns", "columns": "columns"}
_KIND_NAMES = {"heads": "attention (by heads)", "mlp": "MLP (by columns)", "columns": "lone linear"}
_UNITS = {"heads": "KV-head groups or sub-groups", "mlp": "hidden columns", "columns": "columns"}


def parallelize(model: nn.Module, plan: Mapping[str, Any] | str = "auto", *, group=None,
                mesh=None, shards: Mapping[str, ShardPlan] | None = None, overlap: bool = True,
                chunks="auto", dp_kind: str | None = "auto", check: bool = True) -> nn.Module:
    """Make ``model`` tensor-parallel over ``group`` (or the ``"tp"`` dim of ``mesh``) in place
    and return it. Every rank calls it with the same plan, on the same full model.

    A 2-D ``("dp", "tp")`` mesh (``plait.parallel.dp_tp_mesh``): tensor-parallel on ``"tp"``,
    then data-parallel on ``"dp"`` by PyTorch (``plait.parallel.data_parallel(model, mesh,
    kind=dp_kind)``: ``"auto"``, ``"fsdp"`` or ``"ddp"``, whose wrapper is returned; None:
    tensor parallelism only, the dp axis left to the caller).

    ``plan``: ``"auto"`` (the model's own), or ``{module path (``*`` wildcards): style}``
    with PyTorch's ``ColwiseParallel()``/``RowwiseParallel()``/``SequenceParallel()``/
    ``PrepareModuleInput(...)``/``PrepareModuleOutput(...)``, transformers' plan strings
    (``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``,
    ``"moe_tp_experts"``, ``"ep_dispatch_experts"``, …) or plait's styles
    (:mod:`plait.parallel.styles`); a ``ShardPlan`` value is an uneven share, as in
    ``shards``: ``{kind or module path: ShardPlan}``, kinds "heads" (attention:
    KV-head groups), "mlp" (hidden columns), "experts", "vocab", "columns", "seq".
    ``overlap``: plait's fused compute–collective operators (False: compute, then the
    collective); ``chunks``: their pieces ("auto": the cost model's choice).
    ``check``: before any weight changes, run the model once on example token ids and
    simulate every rank's share of each split module on this process against the module's
    own forward and backward (:mod:`plait.parallel.exactness`): a fused q/k/v read per head, an
    attention that views by a global head count, a per-head norm's or an activation's
    parameters, a scaled embedding are handled; what cannot be split exactly is refused.

    The model keeps its forward signature, its ``state_dict`` keys (each rank holds its
    shard; ``plait.nn.full_state_dict(model)`` gathers the whole) and its methods
    (``generate``). ``applied(model).dims`` names the dims ``plait.balance.Balancer`` moves.
    """
    group = _group(group, mesh)
    if dp_kind is not None and dp_kind not in DP_KINDS:
        raise ValueError(f"dp_kind must be one of {', '.join(DP_KINDS)} or None, got {dp_kind!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("plait.parallelize needs torch.distributed initialised (under torchrun: "
                         "plait.runtime.init_from_env() or "
                         "torch.distributed.init_process_group()); without a process group "
                         "there is nothing to split the model over")
    info = GroupInfo(group)
    auto = isinstance(plan, str)
    if auto and plan != "auto":
        raise ValueError(f"plan must be 'auto' or a dict of module path → style, got {plan!r}")
    raw = auto_plan(model) if auto else plan
    if not isinstance(raw, Mapping):
        raise TypeError(f"plan must be 'auto' or a dict of module path → style, got "
                        f"{type(raw).__name__}")
    styles, shard_plans = split_shards(raw, shards)
    if not styles:
        raise ValueError("the plan names no module to split: an empty plan would leave every "
                         "rank a whole copy of the model (give plan='auto' or module path → "
                         "style entries)")
    run = _Run(model, group, info, shard_plans, overlap, chunks, check)
    mine = problem = None
    try:
        run.resolve(expand(model, styles, strict=not auto))
        if info.world > 1:
            mine = describe(model, run.styles, run.dims, run.plans)
    except (ValueError, TypeError, RuntimeError) as err:  # raised on every rank, once compared
        problem = err
    agree(mine, problem, group)
    built = run.build()
    run.swap(built)
    # model.load_state_dict(full) (and DCP's full-state-dict load) takes this rank's shares
    model.register_load_state_dict_pre_hook(take_shares)
    # the operators' context is made on first use, collectively; made here, eagerly, a
    # model compiled (torch.compile) before its first step does not trace its making
    get_context(group)
    if _has_dp(mesh) and dp_kind is not None:
        return data_parallel(model, mesh, kind=dp_kind)
    return model


@dataclass
class _Run:
    model: nn.Module
    group: Any
    info: GroupInfo
    shards: Mapping[str, ShardPlan]
    overlap: bool
    chunks: Any
    check: bool = True
    verdict: Verdict = field(default_factory=Verdict)
    styles: dict = field(default_factory=dict)
    dims: list = field(default_factory=list)
    plans: dict = field(default_factory=dict)   # path → ShardPlan for one-module styles
    used: set = field(default_factory=set)
    notes: list = field(default_factory=list)
    ties: list = field(default_factory=list)    # (embedding, [heads]) sharing one weight

    # --- resolve: nothing changes yet ------------------------------------------
    def resolve(self, styles: dict) -> None:
        modules = dict(self.model.named_modules())
        linears = {}
        for path, style in styles.items():
            module = modules[path]
            if isinstance(style, Rowwise) and isinstance(module, nn.Embedding):
                if style.input != Replicate():
                    raise ValueError(f"{path}: RowwiseParallel on an nn.Embedding takes the ids "
                                     f"replicated (input_layouts=Replicate()), got "
                                     f"{layout_name(style.input)}")
                style = VocabParallel(output=style.output)
            elif isinstance(style, (Colwise, Rowwise)):
                if not isinstance(module, nn.Linear):
                    raise TypeError(f"{path}: {type(style).__name__} splits an nn.Linear, but "
                                    f"{path} is a {type(module).__name__}")
                packed = isinstance(style, Colwise) and (style.blocks or 1) > 1
                if packed and style.output == Replicate():
                    raise ValueError(f"{path}: a packed weight's output cannot be gathered whole")
                linears[path] = (style, module)
            self._check_module(path, style, module)
            styles[path] = style
        self.styles = styles
        self.dims = find_dims(linears, modules)
        for dim in self.dims:
            plan = shard_for(self.shards, self.used, [dim.name, *dim.cols, *dim.rows], dim.kind)
            dim.given = plan is not None
            try:
                resolve_plan_for(dim, plan, self.info.world)
            except ValueError as err:
                raise ValueError(str(err) if str(err).startswith(dim.name) else
                                 f"{dim.name}: {err}") from None
        for path, style in styles.items():
            kind = {VocabParallel: "vocab", ExpertsTP: "experts", ExpertsEP: "experts",
                    PlaitMoE: "experts", TableParallel: "tables"}.get(type(style))
            if kind is not None:
                self.plans[path] = shard_for(self.shards, self.used, [path], kind)
        check_shards(self.shards, self.used, self.model)
        self._check_tied(modules)
        for path, style in styles.items():
            if isinstance(style, LocalParams):
                self._local_params(path, modules[path])
            elif isinstance(style, SharedRope):
                self._shared_rope(path, modules)
        if not (self.check and self.info.world > 1):
            self.verdict = Verdict(checked=False)
        else:
            summed = {f"{path}.{name}" if path else name
                      for path, style in self.styles.items()
                      if isinstance(style, SequenceParallel) or
                      (isinstance(style, Replicated) and style.grad_sum)
                      for name, _ in modules[path].named_parameters()}
            self.verdict = verify(self.model, self.dims, self.info.world,
                                  self._replaced(modules), self.plans, summed)
        self.notes.extend(self.verdict.notes)
        for dim in self.dims:  # unchecked, copied K/V heads need a module that is told
            if dim.needs_check and not self.verdict.checked:
                raise ValueError(f"{dim.name}: {dim.needs_check}")
            told = hasattr(modules[dim.name], "num_key_value_groups")
            if dim.groups_local is not None and not told and not self.verdict.checked:
                raise ValueError(f"{dim.name}: {dim.note}, but the module has no "
                                 "num_key_value_groups to tell its forward (and it was not "
                                 "checked on one batch)")

    def _local_params(self, path: str, module: nn.Module) -> None:
        """transformers' local_params on an attention module: its own per-head parameters
        (sinks, a gate's bias) split with its heads."""
        dim = next((d for d in self.dims if d.name == path and d.kind == "heads"), None)
        if dim is None:
            raise ValueError(f"{path}: local_params splits an attention module's per-head "
                             f"parameters with its heads, but {path} is not split by heads")
        n_q, _, hd = dim.heads
        for name, param in module.named_parameters(recurse=False):
            if param.dim() == 0 or param.shape[0] != n_q:
                raise ValueError(f"{path}.{name}: local_params splits per-head parameters "
                                 f"([{n_q} query heads, ...]), got {tuple(param.shape)}")
            dim.local[name] = dim.cuts[dim.rows[0]].unit // hd

    def _shared_rope(self, path: str, modules: dict) -> None:
        """transformers' mla_kv_a_proj: the latent K/V projection stays whole; its rotary-key
        features (the parent's qk_rope_head_dim, last) get their gradient summed."""
        dim = next((d for d in self.dims if d.kind == "heads" and d.name
                    and path.startswith(d.name + ".")), None)
        tail = getattr(modules.get(dim.name) if dim else None, "qk_rope_head_dim", None)
        if not isinstance(modules[path], nn.Linear) or dim is None or not isinstance(tail, int):
            raise ValueError(f"{path}: mla_kv_a_proj takes a linear inside an attention split by "
                             "heads whose module names qk_rope_head_dim (its rotary-key "
                             "features, last in the output)")
        dim.tails[path[len(dim.name) + 1:]] = tail

    def _replaced(self, modules: dict) -> dict[str, str]:
        """The modules plait replaces by layers of its own, by what ``verify`` checks."""
        kinds = {}
        for path, style in self.styles.items():
            if isinstance(style, VocabParallel):
                kinds[path] = "embedding"
            elif isinstance(style, (Colwise, Rowwise)):
                kinds[path] = "linear"
            elif isinstance(style, (ExpertsEP, ExpertsTP)):
                kinds[path] = "experts-ep" if isinstance(style, ExpertsEP) else "experts-tp"
        return kinds

    def _check_module(self, path: str, style, module: nn.Module) -> None:
        if isinstance(style, VocabParallel) and not isinstance(module, nn.Embedding):
            raise TypeError(f"{path}: embedding_rowwise splits an nn.Embedding, got "
                            f"{type(module).__name__}")
        if isinstance(style, (ExpertsTP, ExpertsEP)):
            experts_shape(module, path)

    def _check_tied(self, modules: dict) -> None:
        """A parameter shared by a module that is replaced and one that is not would come apart;
        an embedding split by vocabulary rows and LM heads split by the same rows stay tied."""
        replaced = {p for p, s in self.styles.items()
                    if isinstance(s, (Colwise, Rowwise, VocabParallel, ExpertsEP, PlaitMoE,
                                      TableParallel))}
        owners: dict[int, list[str]] = {}
        for path, module in modules.items():
            for name, param in module.named_parameters(recurse=False):
                owners.setdefault(id(param), []).append(f"{path}.{name}" if path else name)
        for names in owners.values():
            split = [n for n in names if n.rpartition(".")[0] in replaced]
            if split and len(names) > 1 and not self._vocab_tie(names):
                raise ValueError(f"{' and '.join(names)} are one tied parameter (tie_word_"
                                 f"embeddings?); plait splits {', '.join(split)} into a layer of "
                                 "its own, which would untie them: untie the model, leave them out "
                                 "of the plan, or split the embedding by vocabulary rows "
                                 "(embedding_rowwise) and the head by the same rows (colwise)")

    def _vocab_tie(self, names: list[str]) -> bool:
        """Whether ``names`` are one embedding split by vocabulary rows (VocabParallel) and lone
        column-parallel heads: one [V, D] weight cut alike, kept one parameter (``swap``)."""
        paths = [n.rpartition(".")[0] for n in names]
        if any(n.rpartition(".")[2] != "weight" for n in names):
            return False
        embeds = [p for p in paths if isinstance(self.styles.get(p), VocabParallel)]
        heads = {p: d for d in self.dims for p in d.cols if p in paths and not d.rows
                 and d.cuts[p].blocks == 1}
        if len(embeds) != 1 or len(embeds) + len(heads) != len(paths):
            return False
        embed = embeds[0]
        plans = {d.plan for d in heads.values() if d.given} | \
            ({self.plans[embed]} if self.plans.get(embed) is not None else set())
        if len(plans) > 1:
            raise ValueError(f"{' and '.join(names)} are one tied parameter, but their shards "
                             f"differ: {sorted(list(p.sizes) for p in plans)}")
        plan = plans.pop() if plans else next(iter(heads.values())).plan
        self.plans[embed] = plan
        for d in heads.values():
            d.plan = plan
        self.ties.append((embed, list(heads)))
        return True

    # --- build: the new layers, from the modules' own weights --------------------
    def build(self) -> dict[str, nn.Module]:
        modules = dict(self.model.named_modules())
        built = {}
        for dim in self.dims:
            for path in dim.cols + dim.rows:
                built[path] = _at(path, lambda: self._linear(path, modules[path], dim))
        for path, style in self.styles.items():
            plan, module = self.plans.get(path), modules[path]
            if isinstance(style, VocabParallel):
                seq = style.output.dim if style.output.is_shard() else None
                built[path] = _at(path, lambda: VocabParallelEmbedding(
                    module, self.group, plan=plan, seq_dim=seq, seq_plan=self.shards.get("seq"),
                    scale=self.verdict.scales.get(path)))
                self._note(path, "vocabulary-parallel embedding, lookups summed by a plain "
                           + ("all-reduce" if seq is None else "reduce-scatter"))
            elif isinstance(style, ExpertsEP):
                built[path] = _at(path, lambda: ExpertParallelExperts(
                    module, path, self.group, plan=plan, overlap=self.overlap, chunks=self.chunks))
            elif isinstance(style, PlaitMoE):
                built[path] = _at(path, lambda: MoE.from_module(
                    module, self.group, plan=plan, overlap=self.overlap, chunks=self.chunks,
                    replicated_input=style.replicated_input))
            elif isinstance(style, TableParallel):
                built[path] = _at(path, lambda: ShardedEmbeddingBag.from_module(
                    module, self.group, plan=plan, batch_plan=self.shards.get("batch"),
                    overlap=self.overlap, chunks=self.chunks))
        return built

    def _linear(self, path: str, linear: nn.Linear, dim: Dim) -> nn.Module:
        style, cut = self.styles[path], dim.cuts[path]
        if isinstance(style, Colwise):
            sp = style.input.is_shard()
        else:
            sp = style.output.is_shard()
        seq = (style.input if isinstance(style, Colwise) else style.output).dim if sp else 1
        kw = dict(plan=dim.plan, unit=cut.unit, overlap=self.overlap, chunks=self.chunks,
                  sequence_parallel=sp, seq_dim=seq,
                  seq_plan=self.shards.get("seq") if sp else None)
        if cut.copies > 1:
            return CopiedHeadsLinear.from_module(linear, self.group, copies=cut.copies, **kw)
        unit_name = _UNIT_NAMES.get(dim.kind) or \
            ("heads" if dim.heads[0] == dim.heads[1] else "KV-head groups")
        if isinstance(style, Colwise):
            return ColumnParallelLinear.from_module(linear, self.group, blocks=cut.blocks,
                                                    unit_name=unit_name, **kw)
        return RowParallelLinear.from_module(linear, self.group, unit_name=unit_name, **kw)

    # --- swap: the model changes ----------------------------------------------
    def swap(self, built: dict[str, nn.Module]) -> None:
        for path, module in built.items():
            _set(self.model, path, module)
        for path, style in self.styles.items():
            if isinstance(style, ExpertsTP):  # in place: the experts keep their class and kernels
                modules = dict(self.model.named_modules())
                _at(path, lambda: shard_experts_ffn(modules[path], path, self.group,
                                                    self.plans.get(path)))
                self._note(path, "experts split by their FFN dim (transformers' experts kernels), "
                           "outputs summed by a plain all-reduce")
        modules = dict(self.model.named_modules())
        for dim in self.dims:
            for rel, tail in dim.tails.items():
                sum_tail_grad(modules[f"{dim.name}.{rel}"], tail, self.group)
                self._note(f"{dim.name}.{rel}", f"whole; the gradient of its last {tail} "
                           "features (the rotary key every head reads) summed over the ranks")
            if dim.local:
                shard_local_params(modules[dim.name], dim.local, dim.plan, self.group)
                self._note(dim.name, f"{', '.join(dim.local)}: each rank keeps its heads' "
                           "entries (local_params)")
        for embed, heads in self.ties:  # one [V_r, D] shard, cut alike: one parameter again
            for head in heads:
                assert modules[head].weight.is_meta or \
                    torch.equal(modules[head].weight, modules[embed].weight), (embed, head)
                modules[head].weight = modules[embed].weight
            self._note(embed, f"tied to {', '.join(heads)}: one parameter, split by the same "
                       "vocabulary rows")
        for dim in self.dims:
            self._hook_dim(dim, modules)
            self._share_inputs(dim, modules)
        for path, style in self.styles.items():
            self._hook(path, style, modules[path])
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name in sorted(self.verdict.partial):  # used on a rank's share: a partial sum
            mark_partial_grad(params[name], self.group)
            self._note(name.rpartition(".")[0], "gradient summed over the ranks (it is applied "
                       "to a rank's share of the heads or columns)")
        self._record(modules)

    def _hook_dim(self, dim: Dim, modules: dict) -> None:
        if dim.groups_local is not None:
            modules[dim.name].num_key_value_groups = dim.groups_local
            self._note(dim.name, dim.note)
        for name, per_rank in self.verdict.attrs.get(dim.name, {}).items():
            setattr(modules[dim.name], name, per_rank[self.info.rank])
        for path in dim.cols + dim.rows:
            style, layer = self.styles[path], modules[path]
            if isinstance(style, Colwise) and style.output == Replicate():
                sizes = [s * dim.cuts[path].unit for s in dim.plan.sizes]
                layer.register_forward_hook(
                    lambda m, a, out, sizes=sizes: gather_from_region(out, self.group, -1, sizes))
                self._note(path, "column-parallel with its output gathered (plain all-gather): "
                           "no row-parallel layer reads its share")
            elif isinstance(style, Rowwise) and style.input == Replicate():
                sizes = [s * dim.cuts[path].unit for s in dim.plan.sizes]
                layer.register_forward_pre_hook(
                    lambda m, args, sizes=sizes: (scatter_to_region(args[0], self.group, -1, sizes),
                                                  *args[1:]))
                self._note(path, "row-parallel on a replicated input, cut locally")
            elif not dim.rows or not dim.cols:
                self._note(path, f"{'column' if dim.cols else 'row'}-parallel without a "
                           f"{'row' if dim.cols else 'column'}-parallel partner under its module: "
                           "its features stay split as an even cut")

    def _share_inputs(self, dim: Dim, modules: dict) -> None:
        """Column-parallel siblings under one module (q/k/v, gate/up) sum their input
        gradients before one all-reduce; one that reads another tensor keeps its own. Only
        siblings of one input width are grouped: the first to read a tensor computes all of
        the group's outputs from it (multi-head latent attention's q_b, kv_b and a gate read
        three tensors, two of one width)."""
        by_parent: dict[tuple[str, int], list[str]] = {}
        for path in dim.cols:
            style, layer = self.styles[path], modules[path]
            if style.input == Replicate() and isinstance(layer, ColumnParallelLinear):
                by_parent.setdefault((path.rpartition(".")[0], layer.in_features), []).append(path)
        for paths in by_parent.values():
            if share_input([modules[p] for p in paths], self.group, overlap=self.overlap,
                           chunks=self.chunks) is not None:
                names = ", ".join(p.rpartition(".")[2] for p in paths)
                self._note(paths[0].rpartition(".")[0] or paths[0],
                           f"{names}: their input gradients summed before one "
                           f"{'fused' if self.overlap else 'plain'} all-reduce")

    def _hook(self, path: str, style, module: nn.Module) -> None:
        group = self.group
        if isinstance(style, (SequenceParallel, Replicated)):
            if isinstance(style, SequenceParallel) or style.grad_sum:
                for param in module.parameters():
                    mark_partial_grad(param, group)
        elif isinstance(style, Prepare):
            self._prepare(path, style, module)
        elif isinstance(style, BatchParallel):
            self._batch_parallel(path, style, module)

    def _prepare(self, path: str, style: Prepare, module: nn.Module) -> None:
        seq = self.shards.get("seq")
        move = _Mover(self.group, None if seq is None else list(seq.sizes))
        kwargs = dict(style.kwargs)
        if any(style.args) or kwargs:
            def enter(m, args, kw):
                args = tuple(move(a, p) for a, p in zip(args, style.args)) + \
                    tuple(args[len(style.args):])
                return args, {k: move(v, kwargs.get(k)) for k, v in kw.items()}
            module.register_forward_pre_hook(enter, with_kwargs=True)
        if any(style.outputs):
            def leave(m, args, out):
                if isinstance(out, tuple):
                    return tuple(move(o, p) for o, p in zip(out, style.outputs)) + \
                        tuple(out[len(style.outputs):])
                return move(out, style.outputs[0])
            module.register_forward_hook(leave)
        for pair in list(style.args) + list(kwargs.values()) + list(style.outputs):
            if pair is not None and pair[0].is_shard() and pair[1].is_replicate():
                self._note(path, f"gathers a tensor along dim {pair[0].dim} (plain all-gather; "
                           "ColwiseParallel(input_layouts=Shard(d)) fuses the gather into the "
                           "matmul)")

    def _batch_parallel(self, path: str, style: BatchParallel, module: nn.Module) -> None:
        from ..nn import PLAIT_LAYERS

        tables = dict(module.named_modules())[style.tables]
        inside = {id(p) for m in module.modules() if isinstance(m, PLAIT_LAYERS)
                  for p in m.parameters()}
        for param in module.parameters():
            if id(param) not in inside:
                mark_partial_grad(param, self.group)  # each rank saw its share of the batch
        split: dict[str, list[int]] = {}
        group = self.group

        def cut(m, args):
            first, *rest = args
            split["sizes"] = tables._shares(first.shape[0])  # the scatter checks them
            return (scatter_to_region(first, group, 0, split["sizes"]), *rest)

        if self.info.world > 1:
            module.register_forward_pre_hook(cut)
            module.register_forward_hook(
                lambda m, a, out: gather_from_region(out, group, 0, split["sizes"]))

    def _note(self, path: str, what: str) -> None:
        self.notes.append((path, what))

    def _record(self, modules: dict) -> None:
        """The model's record (:mod:`plait.nn.record`): the balancer's dims, the group, and one
    summary, logged once on rank 0."""
        dims, kept = {}, recorded(self.model).dims or {}
        for dim in self.dims:
            if not (dim.cols and dim.rows) or dim.groups_local is not None or dim.local:
                continue
            # grouped-query heads too: q and o count 2+ heads a KV group, k and v one, and the
            # balancer resizes and migrates whole groups (tests/balance/test_balancer_gqa.py)
            dims[dim.name] = tuple(dim.cols + dim.rows)
        # the balancer's dims; the group plait.parallel.data checks the replicas against
        record(self.model, dims={**kept, **dims}, group=self.group)
        kinds = {kind: sum(d.kind == kind for d in self.dims) for kind in _KIND_NAMES}
        counted = ", ".join(f"{n} {_KIND_NAMES[k]}" for k, n in kinds.items() if n) or "no linears"
        others = sorted({type(s).__name__ for s in self.styles.values()
                         if not isinstance(s, (Colwise, Rowwise))})
        line = (f"{type(self.model).__name__} on {self.info.world} ranks: {counted}"
                f"{'; also ' + ', '.join(others) if others else ''}; "
                f"{'fused' if self.overlap else 'plain'} path")
        for dim in self.dims:  # what a user asked unevenly (or 3 heads over 2 ranks) shows
            if len(set(dim.plan.sizes)) > 1:
                self._note(dim.name, f"{_KIND_NAMES[dim.kind]} split {list(dim.plan.sizes)} "
                           f"({_UNITS.get(dim.kind, 'units')} per rank)")
        if self.info.world > 1:  # which transport the group's collectives take, and why
            choice = get_context(self.group).mover().choice  # every rank makes this call
            self._note("collectives", f"{choice.name} ({choice.reason})")
        notes = _grouped(self.notes)
        record(self.model, line=line, notes=notes)
        if self.info.rank == 0:
            log.info("%s", line)
            for note in notes:
                log.info("  %s", note)


class _Mover:
    """One tensor from one layout to another: a gather or a scatter along the sharded dim."""

    def __init__(self, group, seq_sizes):
        self.group, self.sizes = group, seq_sizes

    def __call__(self, x, pair):
        if pair is None or not hasattr(x, "shape"):
            return x
        have, want = pair
        if have.is_shard() and want.is_replicate():
            return gather_from_region(x, self.group, have.dim, self.sizes)
        if have.is_replicate() and want.is_shard():
            return scatter_to_region(x, self.group, want.dim, self.sizes)
        raise ValueError(f"moving a tensor from {layout_name(have)} to {layout_name(want)} is "
                         "not supported (plait gathers Shard(d) → Replicate() and cuts "
                         "Replicate() → Shard(d))")


def applied(model: nn.Module) -> Applied:
    """What ``parallelize`` did to ``model`` (:func:`plait.nn.record.applied`): its one-line
    summary, then each note (which path runs fused or plain and why, siblings sharing an
    all-reduce, uneven splits, the transport), as logged on rank 0, with ``dims`` and
    ``group``; empty for a model ``parallelize`` never saw. ``print`` shows it a line each."""
    return recorded(model)


def _grouped(notes: list[tuple[str, str]]) -> list[str]:
    """Each reason once, with the paths that share it written with ``*`` for layer numbers."""
    seen: dict[str, list[str]] = {}
    for path, what in notes:
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)
        paths = seen.setdefault(what, [])
        if pattern not in paths:
            paths.append(pattern)
    return [f"{', '.join(p for p in paths if p)}: {what}" if any(paths) else what
            for what, paths in seen.items()]


def _at(path: str, make):
    """``make()``, its ValueError/TypeError naming ``path``."""
    try:
        return make()
    except (ValueError, TypeError) as err:
        if str(err).startswith(path + ":") and path:
            raise
        raise type(err)(f"{path}: {err}" if path else str(err)) from None


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    setattr(owner, name, module)


def _has_dp(mesh) -> bool:
    return mesh is not None and mesh.ndim == 2 and set(mesh.mesh_dim_names or ()) == {"dp", "tp"}


def _group(group, mesh):
    if mesh is None:
        return group
    if group is not None:
        raise ValueError("give group or mesh, not both")
    if mesh.ndim == 1:
        return mesh.get_group()
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        return mesh.get_group("tp")
    raise ValueError(f"mesh has {mesh.ndim} dims {names}; plait splits over a 1-D mesh or the "
                     "dim named 'tp'")
