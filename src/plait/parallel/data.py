"""Data parallelism around plait's tensor parallelism, on a 2-D ``dp × tp`` DeviceMesh.

    mesh = plait.parallel.dp_tp_mesh(dp=2, tp=2)               # tp groups [0, 1], [2, 3]
    model = plait.parallelize(model, "auto", mesh=mesh["tp"])   # plait's TP in each tp group
    model = plait.parallel.data_parallel(model, mesh)           # PyTorch's DP across them
    # or both in one call: plait.parallelize(model, "auto", mesh=mesh)

As torchtitan does it: tensor parallelism on the ``tp`` axis first, then
PyTorch's own data parallelism on the ``dp`` axis; plait writes no gradient
all-reduce of its own. Each replica (one tp group) reads its own share of the
global batch; the dp axis averages the gradients, so the replicas stay equal
and the step is the global batch's.

Placement (:class:`MeshLayout`): ``tp_inside_host=True`` (the default) puts a
tp group on consecutive ranks, which torchrun and plait's emulated cluster put
on one host, so tensor parallelism's per-layer collectives stay on the fast
link and only the dp axis's once-per-step gradient reduction crosses hosts;
``tp_inside_host=False`` puts a tp group one rank per dp replica apart (the
other placement, for comparison).

Replicas in one tp position must hold the same shapes for data parallelism to
reduce their gradients: :func:`check_replicas` compares every replica's
``ShardPlan`` values and parameter shapes and refuses a difference, on every
rank, before anything is wrapped.

A change of plan (the balancer's migration, agreed across dp) re-cuts parameters to new
shapes; :func:`replanned` then checks the replicas again and rebuilds DDP's reducer for
the new shapes. FSDP2's sharding of the old shapes is not rebuilt: it is refused.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ..nn.linear import ColumnParallelLinear, RowParallelLinear
from ..nn.record import applied, is_partial
from ..ops.deferred import run_deferred
from ..plan import ShardPlan

__all__ = ["MeshLayout", "dp_tp_mesh", "data_parallel", "choose_kind", "unsharded",
           "check_replicas", "replica_signature", "replica_mismatch", "replanned", "DP_KINDS"]

log = logging.getLogger("plait.parallel")

DP_KINDS = ("auto", "fsdp", "ddp")


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """Which ranks form the tp groups and the dp groups of a ``dp × tp`` mesh."""

    dp: int
    """data-parallel replicas (each holds the whole model, cut over its tp group)"""
    tp: int
    """ranks in one tensor-parallel group"""
    tp_inside_host: bool = True
    """True: a tp group is ``tp`` consecutive ranks (one host, as torchrun numbers them);
    False: a tp group's ranks are ``dp`` apart, so it spans hosts and each dp group is
    consecutive"""

    def __post_init__(self) -> None:
        for name in ("dp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def grid(self) -> list[list[int]]:
        """``grid[d][t]``: the rank at dp index d and tp index t."""
        if self.tp_inside_host:
            return [[d * self.tp + t for t in range(self.tp)] for d in range(self.dp)]
        return [[t * self.dp + d for t in range(self.tp)] for d in range(self.dp)]

    def tp_groups(self) -> list[list[int]]:
        return self.grid()

    def dp_groups(self) -> list[list[int]]:
        grid = self.grid()
        return [[row[t] for row in grid] for t in range(self.tp)]

    def describe(self, hosts: int | None = None) -> str:
        """One line: the groups, and with ``hosts`` (ranks in contiguous blocks per host, as
        torchrun and the emulated cluster place them) which axis crosses hosts."""
        line = (f"dp {self.dp} × tp {self.tp}: tp groups {self.tp_groups()}, "
                f"dp groups {self.dp_groups()}")
        if hosts is None:
            return line
        if hosts < 1 or self.world_size % hosts:
            raise ValueError(f"{self.world_size} ranks do not split into {hosts} hosts evenly")
        per_host = self.world_size // hosts

        def crossing(groups):
            return any(len({r // per_host for r in g}) > 1 for g in groups)

        axes = [a for a, g in (("tp", self.tp_groups()), ("dp", self.dp_groups())) if crossing(g)]
        return f"{line}; across hosts: {', '.join(axes) or 'nothing'}"

    def mesh(self, device_type: str | None = None):
        """The ``("dp", "tp")`` DeviceMesh (a collective: every rank calls it)."""
        from torch.distributed.device_mesh import DeviceMesh

        if not dist.is_initialized():
            raise ValueError("a DeviceMesh needs torch.distributed initialised "
                             "(plait.runtime.init_from_env())")
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(f"dp {self.dp} × tp {self.tp} = {self.world_size} ranks, but the "
                             f"group has {world}")
        device_type = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        return DeviceMesh(device_type, torch.tensor(self.grid()), mesh_dim_names=("dp", "tp"))


def dp_tp_mesh(dp: int, tp: int, *, tp_inside_host: bool = True, device_type: str | None = None):
    """The ``("dp", "tp")`` DeviceMesh of :class:`MeshLayout` ``(dp, tp, tp_inside_host)``."""
    return MeshLayout(dp=dp, tp=tp, tp_inside_host=tp_inside_host).mesh(device_type)


# --- replicas agree ------------------------------------------------------------------------
def replica_signature(model: nn.Module) -> dict[str, dict[str, tuple[int, ...]]]:
    """What must be equal on every replica in one tp position: ``"plans"``, each ``ShardPlan``
    a module holds (``"<path>.<attr>"``: its sizes, the whole tp group's), and ``"shapes"``,
    each parameter's local shape."""
    plans = {}
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, ShardPlan):
                plans[f"{path}.{attr}" if path else attr] = value.sizes
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    return {"plans": plans, "shapes": shapes}


def replica_mismatch(signatures: list[dict], ranks: list[int]) -> str | None:
    """The first difference between replicas' signatures (``ranks[i]`` holds
    ``signatures[i]``; plans before shapes, names in order), as one line, or None."""
    first = signatures[0]
    for what in ("plans", "shapes"):
        for sig, rank in zip(signatures[1:], ranks[1:]):
            mine, theirs = first[what], sig[what]
            for key in sorted(set(mine) | set(theirs)):
                if mine.get(key) == theirs.get(key):
                    continue
                show = [list(v) if v is not None else "nothing"
                        for v in (mine.get(key), theirs.get(key))]
                return (f"replicas disagree across the dp axis: {key} has {what[:-1]} {show[0]} "
                        f"on rank {ranks[0]} and {show[1]} on rank {rank} (same tp position); "
                        "data parallelism reduces each parameter over its dp group, so every "
                        "replica must be cut by the same ShardPlans: give each the same shards")
    return None


def check_replicas(model: nn.Module, mesh) -> None:
    """Refuse (``ValueError``, the same one line on every rank of the mesh) replicas whose
    plans or shapes differ across the dp axis. A collective over the dp groups and then the
    tp groups, so a difference in one tp position is refused in every one."""
    dp_group, tp_group = _groups(mesh)
    tp_group = _tp_group(model, tp_group)
    mine = replica_signature(model)
    signatures: list[Any] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(signatures, mine, group=dp_group)
    verdict = replica_mismatch(signatures, dist.get_process_group_ranks(dp_group))
    if tp_group is not None:
        verdicts: list[Any] = [None] * dist.get_world_size(tp_group)
        dist.all_gather_object(verdicts, verdict, group=tp_group)
        verdict = next((v for v in verdicts if v is not None), None)
    if verdict is not None:
        raise ValueError(verdict)


# --- the wrap ------------------------------------------------------------------------------
def data_parallel(model: nn.Module, mesh, *, kind: str = "auto", **kwargs) -> nn.Module:
    """``model`` (made tensor-parallel on the mesh's ``"tp"`` axis) made data-parallel on its
    ``"dp"`` axis by PyTorch, and returned. ``mesh``: the 2-D ``("dp", "tp")`` mesh, or its
    ``"dp"`` axis; ``kwargs`` go to ``fully_shard`` or ``DistributedDataParallel``.

    ``kind="fsdp"``: FSDP2, in place, as torchtitan applies it: ``fully_shard`` on each
    element of the model's ``nn.ModuleList`` s (its blocks), then on the whole model; plait's
    deferred weight gradients (``plait.ops.deferred``) are run as each block's backward ends,
    before FSDP2 reduces the block (a root-level row-parallel layer's are not). Between
    steps the parameters are DTensors sharded over dp (``model.unshard()`` gives the plain
    tensors back inside :func:`unsharded`). ``"ddp"``: ``DistributedDataParallel`` over
    the dp group, a wrapper (the model is its ``.module``). ``"auto"``: whichever of the
    two sees every gradient of this model (:func:`choose_kind`).

    Replicas are checked first (:func:`check_replicas`). One replica (dp 1) is the model
    unchanged."""
    if kind not in DP_KINDS:
        raise ValueError(f"kind must be one of {', '.join(DP_KINDS)}, got {kind!r}")
    dp_group, _ = _groups(mesh)
    check_replicas(model, mesh)
    dp = dist.get_world_size(dp_group)
    if dp == 1:
        return model
    kind = choose_kind(model, kind)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for unit in _blocks(model):
            fully_shard(unit, mesh=_dp_mesh(mesh), **kwargs)
            # after FSDP2's own pre-forward hook: in the backward, between the block and
            # FSDP2's reduce-scatter of its gradients
            unit.register_forward_pre_hook(_flush_deferred_before_reduce, with_kwargs=True)
        wrapped = fully_shard(model, mesh=_dp_mesh(mesh), **kwargs)
    else:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, process_group=dp_group, **kwargs)
    if dist.get_rank() == 0:
        log.info("data parallelism: %s over %d replicas (dp groups of ranks like %s)",
                 "FSDP2 (fully_shard)" if kind == "fsdp" else "DDP", dp,
                 dist.get_process_group_ranks(dp_group))
    return wrapped


def replanned(model: nn.Module, mesh) -> None:
    """Data parallelism brought to the parameters' shapes after a change of plan (a migration
    that re-cut them, the same on every replica); every rank of the mesh calls it, after the
    same decisions. ``model``: what :func:`data_parallel` returned.

    The replicas are checked first (:func:`check_replicas`: a replica that holds another plan
    is refused on every rank, naming the layer). DDP: its reducer was built for the old
    shapes (buckets sized by them, hooks on the gradient accumulators the re-cut dropped), so
    it is built anew for the parameters as they are now, the way DDP rebuilds it when
    unpickled, with every setting it was made with; no value is broadcast (the replicas hold
    the same ones). FSDP2: ``ValueError`` (its sharding of each parameter over dp is not
    rebuilt). A model that is not data-parallel: only the check."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    ddp = isinstance(model, DistributedDataParallel)
    inner = model.module if ddp else model
    if any(isinstance(m, FSDPModule) for m in inner.modules()):
        raise ValueError("a change of plan under FSDP2 is not supported: fully_shard's "
                         "sharding of the old shapes is not rebuilt; use DDP "
                         "(data_parallel(kind='ddp')) to balance with data parallelism")
    check_replicas(inner, mesh)
    if ddp:
        _rebuild_reducer(model)


def _rebuild_reducer(ddp) -> None:
    """A new ``Reducer`` for the DDP wrapper's parameters as they are now (what DDP's own
    ``__setstate__`` does); the old one, freed, takes its hooks with it."""
    unusual = [what for what, on in (("mixed_precision", ddp.mixed_precision is not None),
                                     ("a python reducer", ddp._use_python_reducer),
                                     ("delayed all-reduce", bool(ddp._delay_all_reduce_params)))
               if on]
    if unusual:
        raise ValueError(f"cannot rebuild DDP's reducer after a change of plan with "
                         f"{', '.join(unusual)}; wrap with DDP's defaults for these")
    parameters, sparse = ddp._build_params_for_reducer()
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, sparse, names, ddp.static_graph)
    ddp._has_rebuilt_buckets = False
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[nn.Module]:
    """Inside: every FSDP2 unit of ``model`` holds its plain (tp-sharded) parameters, as in its
    forward (``named_parameters()``, each plait layer's ``full_state_dict()``; not
    ``model.state_dict()``, whose FSDP hook shards them again); outside: sharded over dp
    again. Any other model (DDP, or not data-parallel) is as it is."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()


def choose_kind(model: nn.Module, kind: str = "auto") -> str:
    """``"fsdp"`` or ``"ddp"`` for this tensor-parallel model, or ``ValueError`` saying why
    neither would see every gradient. Two of plait's gradient paths bypass one of them
    (measured, dp 2 × tp 2, gloo, float64: the loss left a single process's by about
    1e-3 within 4 steps):

    - a fused row-parallel layer (``overlap=True``, not sequence-parallel) adds its weight
      gradient to ``.grad`` outside autograd (deferred under the next collective,
      ``plait.ops.deferred``): DDP, which reduces what autograd accumulates, never sees it;
    - a replicated parameter whose gradient plait sums over tp (sequence-parallel norms,
      ``replicated_with_grad_allreduce``, a batch-parallel MLP) does so by a hook on the
      Parameter, which ``fully_shard`` replaces: FSDP2 loses the sum.
    """
    deferred = [path for path, m in model.named_modules()
                if isinstance(m, RowParallelLinear) and m.overlap and not m.sequence_parallel
                and m.info.world > 1]
    # column-parallel siblings sharing one fused input-grad all-reduce defer theirs too once
    # resized or hooked (SharedInput's one-GEMM path returns them through autograd, but a
    # balancer may resize a sibling after the choice is made)
    siblings = [path for path, m in model.named_modules()
                if isinstance(m, ColumnParallelLinear) and m.shared_input is not None
                and m.shared_input.overlap and m.defer_wgrad]
    summed = [name for name, p in model.named_parameters() if is_partial(p)]
    layers = " and ".join([f"fused row-parallel layers ({_few(deferred)})"] * bool(deferred) +
                          [f"column-parallel siblings sharing a fused all-reduce "
                           f"({_few(siblings)})"] * bool(siblings))
    why_not = {"ddp": layers and (f"{layers} add their weight gradients outside autograd, where "
                                  "DDP does not see them"),
               "fsdp": summed and (f"{_few(summed)} have their gradients summed over tp by a "
                                   "hook on the parameter, which fully_shard replaces")}
    if kind == "auto":
        kind = "fsdp" if not why_not["fsdp"] else "ddp"
    if why_not[kind]:
        other = {"ddp": "fsdp", "fsdp": "ddp"}[kind]
        fix = (f"kind='{other}'" if not why_not[other] else
               "overlap=False (its row-parallel layers then return their gradients through "
               "autograd) with kind='ddp'")
        raise ValueError(f"data parallelism by {kind.upper()} would lose gradients: "
                         f"{why_not[kind]}; use {fix}")
    return kind


class _FlushDeferred(torch.autograd.Function):
    """Identity; its backward runs the weight gradients plait deferred
    (``plait.ops.deferred``) before the gradient leaves the block, so that FSDP2, which
    reduces a block's ``.grad`` once its input's gradient is done, reduces them too."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        run_deferred()
        return grad


def _flush_deferred_before_reduce(module: nn.Module, args: tuple, kwargs: dict):
    def flushed(a):
        return _FlushDeferred.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a

    return tuple(flushed(a) for a in args), {k: flushed(v) for k, v in kwargs.items()}


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The elements of the model's outermost ``nn.ModuleList`` s (a transformer's blocks)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                units.extend(m for m in child if any(True for _ in m.parameters()))
            else:
                visit(child)

    visit(model)
    return units


def _dp_mesh(mesh):
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh
    return mesh["dp"] if "dp" in names else mesh


def _tp_group(model: nn.Module, mesh_tp):
    """The tp group the model was cut over (``parallelize`` records it), checked against the
    mesh's ``"tp"`` axis where there is one."""
    done = applied(model)
    if not done.cut:
        return mesh_tp
    cut = done.group or dist.group.WORLD  # None: the default group
    if mesh_tp is None:
        return cut
    ranks = [dist.get_process_group_ranks(g) for g in (cut, mesh_tp)]
    if ranks[0] != ranks[1]:
        raise ValueError(f"the model was made tensor-parallel over ranks {ranks[0]}, but this "
                         f"mesh's tp axis here is ranks {ranks[1]}: make it parallel over "
                         "mesh['tp'] of the same mesh")
    return mesh_tp


def _groups(mesh):
    """(dp group, tp group or None) of a 2-D ``("dp", "tp")`` mesh or a 1-D dp mesh."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        return mesh.get_group(), None
    if mesh.ndim == 2 and set(names) == {"dp", "tp"}:
        return mesh.get_group("dp"), mesh.get_group("tp")
    raise ValueError(f"data parallelism takes a 2-D mesh with dims ('dp', 'tp') or its 'dp' "
                     f"axis, got a {mesh.ndim}-D mesh with dims {names}")
