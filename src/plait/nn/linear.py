"""Tensor-parallel linear layers: column-parallel and row-parallel, optionally sequence-parallel.

Weights are kept in ``nn.Linear``'s layout ``[out, in]`` (so a gathered
state_dict loads straight into an ``nn.Linear``) and handed to the operators,
which want ``[K, N]``, as a transposed view.

ColumnParallelLinear (plan over the output features):

==================  ======================  ==================================
tensor              shape on rank r         note
==================  ======================  ==================================
weight, bias        [N_r, K], [N_r]         N_r = blocks · plan.sizes[r] · unit
x                   [B, S, K]               replicated; [B, S_r, K] if sequence-parallel
y                   [B, S, N_r]
==================  ======================  ==================================

overlap=True: ``column_parallel_matmul`` (backward dgrad is a fused all-reduce)
or, sequence-parallel, ``all_gather_matmul``; overlap=False: the plain path
(``copy_to_region`` / ``gather_for_matmul``, then ``F.linear``).

RowParallelLinear (plan over the input features):

==================  ======================  ==================================
weight, bias        [N, K_r], [N]           bias replicated, added after the sum
x                   [B, S, K_r]
y                   [B, S, N]               replicated; [B, S_r, N] if sequence-parallel
==================  ======================  ==================================

overlap=True: ``matmul_all_reduce`` or ``matmul_reduce_scatter``; overlap=False:
``F.linear`` then ``reduce_from_region`` / ``reduce_scatter_region``. Fused and
not sequence-parallel, its weight gradient (the backward sends nothing) is
deferred to run under the next column-parallel layer's dgrad all-reduce
(:mod:`plait.ops.deferred`): it reaches ``weight.grad`` by the end of
``loss.backward()``, not through ``torch.autograd.grad``.

Straggler emulation and the speed monitor's timing wrap each layer's compute,
forward and backward: on the plain path ``F.linear`` as one region
(``_shard.straggled``), on the fused non-sequence-parallel path each local
GEMM piece inside the operator (``_shard.pieces``), so waiting for other ranks
is never counted as compute. The sequence-parallel fused operators are wrapped
whole (their exposed wire is counted).

ZERO-resizing (``resize(keep)``, set by ``plait.balance``): the layer computes
only ``keep`` of the features its plan splits, in whole plan units (an
attention layer skips whole heads), forward and backward: a
row-parallel layer ``keep`` of its reduction slice K_r (the features its shard
reads), a column-parallel one the same share of its output features (in every
block). The balancer resizes the layers of a dim together over the *same*
features (``resize(keep, kept=...)``): the hidden units of an MLP shard, the
head features of an attention shard, so the column-parallel layer skips exactly
the outputs the row-parallel one after it would not read, and the slow rank's
shard shrinks as a whole (the reduction dim of the pair). *Priority*: kept are
the features whose weights changed most between the last two
``refresh_priority()`` calls (before the first change is known, the largest in
magnitude); a skipped feature keeps its last score, so it returns once the kept
ones settle. *Imputation*: outputs and gradients stay full-shape; a skipped
feature contributes nothing to a row-parallel output, is zero in a
column-parallel output, and gets a zero gradient (the optimizer still sees the
whole tensor). Lossy by design: the balancer resizes a rank only while it is
slow. Both layers keep their fused path while resized (shards may differ per
rank).
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import all_gather_matmul, column_parallel_matmul, matmul_reduce_scatter
from ..ops.agree import attempt, refused
from ..ops.matmul_all_reduce import InFlight, matmul_all_reduce_start
from ..ops.shared_input import SharedInput
from ..ops.regions import copy_to_region, gather_for_matmul, reduce_from_region, reduce_scatter_region
from ..plan import ShardPlan
from ._shard import (GroupInfo, check_full, compute_scope, mark_partial_grad, pieces,
                     replace_data, resolve_plan, shard_of, straggled, unshard)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "Started", "select_features", "share_input"]


def _full_linear(in_features: int, out_features: int, bias: bool, seed: int, dtype, device):
    """nn.Linear's own initialisation, seeded, so every rank starts from the same full weight."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return layer.weight.detach().to(device), None if layer.bias is None else layer.bias.detach().to(device)


def select_features(score: torch.Tensor, keep: float, unit: int = 1) -> torch.Tensor | None:
    """The features ZERO-resizing keeps: the ``keep`` share of whole units (``unit``
    consecutive features: a head) with the highest summed ``score``, sorted; ties in index
    order; None when everything is kept."""
    units = score.numel() // unit
    n = min(units, max(1, round(keep * units)))
    if n == units:
        return None
    per_unit = score.reshape(units, unit).sum(dim=1)
    top = torch.argsort(per_unit, descending=True, stable=True)[:n].sort().values
    return (top[:, None] * unit + torch.arange(unit, device=top.device)).reshape(-1)


class _ParallelLinear(nn.Module):
    """What both layers share: plan, parameters cut from the full weight, gathering them back."""

    shard_dim: int  # the dim of the [out, in] weight the plan splits
    default_unit_name: str

    def __init__(self, in_features: int, out_features: int, group=None, *, bias: bool = True,
                 plan: ShardPlan | None = None, unit: int = 1, blocks: int = 1,
                 unit_name: str | None = None, overlap: bool = True, chunks="auto",
                 sequence_parallel: bool = False, seq_dim: int = 1,
                 seq_plan: ShardPlan | None = None, full_weight: torch.Tensor | None = None,
                 full_bias: torch.Tensor | None = None, seed: int = 0, dtype=None, device=None):
        super().__init__()
        name = f"{type(self).__name__}({in_features}, {out_features})"
        if in_features < 1 or out_features < 1:
            raise ValueError(f"{name}: features must be positive")
        split = (out_features, in_features)[self.shard_dim]
        if unit < 1 or blocks < 1 or split % (unit * blocks):
            raise ValueError(f"{name}: the split dim has {split} features, which is not "
                             f"{blocks} block(s) of whole units of {unit}")
        check_full(name, "weight", full_weight, (out_features, in_features))
        check_full(name, "bias", full_bias, (out_features,))
        if full_bias is not None and not bias:
            raise ValueError(f"{name}: a bias was given to a layer built with bias=False")
        if seq_plan is not None and not isinstance(seq_plan, ShardPlan):
            raise TypeError(f"{name}: seq_plan must be a ShardPlan, got {type(seq_plan).__name__}")
        self.info = GroupInfo(group)
        if seq_plan is not None and seq_plan.world != self.info.world:
            raise ValueError(f"{name}: seq_plan {list(seq_plan.sizes)} names {seq_plan.world} "
                             f"ranks, but the group has {self.info.world}")
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.unit, self.blocks = unit, blocks
        self.unit_name = unit_name or self.default_unit_name
        self.plan = resolve_plan(plan, split // (unit * blocks), self.info, what=self.unit_name,
                                 layer=name)
        self.overlap, self.chunks = overlap, chunks
        self.compute_timer = None  # set by plait.balance.SpeedMonitor.attach
        self.keep = 1.0  # ZERO-resizing: the share of K this rank computes (resize)
        self._kept: torch.Tensor | None = None  # the split features computed, sorted; None: all
        self._snapshot: torch.Tensor | None = None  # the weight at the last priority refresh
        self._scores: torch.Tensor | None = None  # per split feature: how much it changed
        self._scored_by_change = False
        self.sequence_parallel, self.seq_dim, self.seq_plan = sequence_parallel, seq_dim, seq_plan
        if full_weight is None:
            full_weight, made_bias = _full_linear(in_features, out_features, bias, seed, dtype, device)
            full_bias = made_bias if full_bias is None else full_bias
        dtype = dtype or full_weight.dtype
        self.weight = nn.Parameter(self._cut(full_weight.to(dtype=dtype, device=device)))
        if bias:
            full_bias = torch.zeros(out_features, dtype=dtype) if full_bias is None else full_bias
            self.bias = nn.Parameter(self._cut_bias(full_bias.to(dtype=dtype, device=device)))
        else:
            self.register_parameter("bias", None)

    # --- building and gathering -------------------------------------------
    @classmethod
    def from_module(cls, linear: nn.Linear, group=None, *, plan: ShardPlan | None = None, **kw):
        """The sharded twin of ``linear``: the same full weights, cut by ``plan``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_module needs an nn.Linear, got "
                            f"{type(linear).__name__}")
        w = linear.weight.detach()
        return cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                   plan=plan, full_weight=w,
                   full_bias=None if linear.bias is None else linear.bias.detach(),
                   dtype=w.dtype, device=w.device, **kw)

    def _region(self, compute, x: torch.Tensor) -> torch.Tensor:
        """``compute(x)`` as this layer's compute region: straggler emulation and timing,
        forward and backward; the work counted is the weight elements multiplied."""
        return straggled(compute, x, self.compute_timer, self._work())

    def _pieces(self, compute, x: torch.Tensor) -> torch.Tensor:
        """A fused operator whose local pieces are this layer's compute region."""
        return pieces(compute, x, self.compute_timer, self._work())

    def _work(self) -> int:
        if self._kept is None:
            return self.weight.numel()
        return self.weight.numel() * len(self._kept) // self.features()

    # --- ZERO-resizing --------------------------------------------------------
    def features(self) -> int:
        """The features of this rank's shard that the plan splits (per block)."""
        return self.weight.shape[self.shard_dim] // (self.blocks if self.shard_dim == 0 else 1)

    def resize(self, keep: float, *, kept: torch.Tensor | None = None) -> None:
        """Compute only ``keep`` (0 < keep ≤ 1) of the split features from the next forward
        on, in whole plan units (heads of an attention layer); 1 computes everything.
        ``kept``: which features (indices into ``features()``), as the balancer gives the
        layers of one dim; default this layer's own highest-priority units (see the module
        docstring).
        """
        if not (isinstance(keep, (int, float)) and 0.0 < keep <= 1.0):
            raise ValueError(f"{type(self).__name__}: keep must be in (0, 1], got {keep!r}")
        f, units = self.features(), self.features() // self.unit
        n = min(units, max(1, round(keep * units))) * self.unit
        if n == f:
            self._kept, self.keep = None, 1.0
            return
        if kept is None:
            kept = select_features(self.priority(), keep, self.unit)
        kept = torch.as_tensor(kept, dtype=torch.long).sort().values
        whole = kept.view(-1, self.unit) if kept.numel() % self.unit == 0 else None
        if kept.numel() != n or kept.unique().numel() != n or kept[0] < 0 or kept[-1] >= f \
                or whole is None or not (whole - whole[:, :1] == torch.arange(self.unit)).all() \
                or (whole[:, 0] % self.unit).any():
            raise ValueError(f"{type(self).__name__}: kept must name {n} distinct features of "
                             f"0..{f - 1} in whole units of {self.unit} (keep {keep}), got "
                             f"{kept.tolist()}")
        self._kept, self.keep = kept.to(self.weight.device), n / f

    def priority(self) -> torch.Tensor:
        """Per split feature, its score (higher: keep first); summed over a dim's layers."""
        if not self._scored_by_change:
            self.refresh_priority()
        return self._scores

    def _per_feature(self, t: torch.Tensor) -> torch.Tensor:
        """A weight-shaped tensor's squared norm per split feature (summed over blocks)."""
        t = t.movedim(self.shard_dim, 0).float()
        return t.reshape(self.blocks if self.shard_dim == 0 else 1, self.features(), -1) \
            .pow(2).sum(dim=(0, 2))

    @torch.no_grad()
    def refresh_priority(self) -> None:
        """Score each split feature by how much its weights changed since the last refresh
        (those computed since; a skipped one keeps its score) and take a new snapshot."""
        w = self.weight.detach()
        if self._snapshot is None or self._snapshot.shape != w.shape:
            self._scores = self._per_feature(w)  # no history yet: magnitude
            self._scored_by_change = False
        else:
            change = self._per_feature(w - self._snapshot)
            if self._kept is None or self._scores is None:
                self._scores = change
            else:
                self._scores[self._kept] = change[self._kept]
            self._scored_by_change = True
        self._snapshot = w.clone()

    def _cut(self, full: torch.Tensor) -> torch.Tensor:
        return shard_of(full, self.plan, self.info.rank, self.shard_dim, blocks=self.blocks,
                        unit=self.unit)

    def _cut_bias(self, full: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """``{"weight", "bias"}`` in full, as an ``nn.Linear`` holds them (every rank calls it);
        ``grads``: their gradients instead (zeros where there is none)."""
        out = {"weight": self._gather(_value(self.weight, grads), self.shard_dim)}
        if self.bias is not None:
            out["bias"] = self._gather_bias(_value(self.bias, grads))
        return out

    def to_module(self) -> nn.Linear:
        """An ``nn.Linear`` with the full weights (a collective: every rank calls it)."""
        state = self.full_state_dict()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           dtype=self.weight.dtype, device=self.weight.device)
        linear.load_state_dict(state)
        return linear

    def reshard(self, plan: ShardPlan) -> None:
        """Move to ``plan`` exactly: gather the full weight (and gradient) and cut it anew.

        The parameters stay the same objects (an optimizer keeps them); their
        optimizer state is the caller's to move.
        """
        plan = self.check_plan(plan)
        full = self.full_state_dict()
        full_grads = self.full_state_dict(grads=True)  # always: every rank joins the same gathers
        self.plan = plan
        self._kept, self.keep, self._snapshot, self._scores = None, 1.0, None, None
        self._scored_by_change = False
        for key, value in full.items():
            param = getattr(self, key)
            had_grad = param.grad is not None
            replace_data(param, self._cut_key(key, value))
            if had_grad:
                param.grad = self._cut_key(key, full_grads[key])

    def check_plan(self, plan: ShardPlan) -> ShardPlan:
        """``plan`` if it fits this layer's split dim on its group; a ValueError naming why not."""
        name = f"{type(self).__name__}({self.in_features}, {self.out_features})"
        split = (self.out_features, self.in_features)[self.shard_dim]
        return resolve_plan(plan, split // (self.unit * self.blocks), self.info,
                            what=self.unit_name, layer=name)

    def gather_like(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from a per-rank tensor sharded as parameter ``key`` ("weight" or
        "bias") is, under the current plan (a collective; a replicated one is copied): how
        optimizer state follows its parameter through a ``reshard``."""
        return self._gather(local.detach(), self.shard_dim) if key == "weight" \
            else self._gather_bias(local.detach())

    def is_sharded(self, key: str) -> bool:
        """Whether parameter ``key`` is split by the plan (a row-parallel bias is replicated)."""
        return key == "weight" or self.shard_dim == 0

    def cut_like(self, key: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full`` as parameter ``key`` is cut under the current plan."""
        return self._cut_key(key, full)

    def _cut_key(self, key: str, full: torch.Tensor) -> torch.Tensor:
        return self._cut(full) if key == "weight" else self._cut_bias(full)

    def _gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        return unshard(local, self.plan, self.group, dim, blocks=self.blocks, unit=self.unit)

    def _gather_bias(self, local: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _seq_sizes(self, gathered: bool) -> list[int] | None:
        """Every rank's sequence length: the plan's, or None (as found for a gather, even
        for a reduce-scatter). The operator checks that they fit this rank's tensor, on
        every rank at once: a check here would raise on one rank and leave the others
        waiting in the operator's."""
        return None if self.seq_plan is None else list(self.seq_plan.sizes)

    def extra_repr(self) -> str:
        mode = "fused" if self.overlap else "plain"
        seq = ", sequence_parallel" if self.sequence_parallel else ""
        return (f"in={self.in_features}, out={self.out_features}, plan={list(self.plan.sizes)} "
                f"{self.unit_name}, bias={self.bias is not None}, {mode}{seq}")


def _hooked(param: torch.Tensor) -> bool:
    """Whether ``param`` has gradient hooks (``register_hook`` or post-accumulate ones)."""
    return bool(param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None))


def _value(param: torch.Tensor, grad: bool) -> torch.Tensor:
    if not grad:
        return param.detach()
    return torch.zeros_like(param) if param.grad is None else param.grad.detach()


class ColumnParallelLinear(_ParallelLinear):
    """``y_r = x @ W[:, cols_r] + b[cols_r]``; see the module docstring for shapes.

    ``blocks``: the output holds that many equal blocks (3 for a fused QKV), each
    split by the same plan; ``unit``: features per plan unit (the head dim when
    the plan counts heads).
    """

    shard_dim = 0
    default_unit_name = "columns"

    def _cut_bias(self, full: torch.Tensor) -> torch.Tensor:
        return shard_of(full, self.plan, self.info.rank, 0, blocks=self.blocks, unit=self.unit)

    def _gather_bias(self, local: torch.Tensor) -> torch.Tensor:
        return self._gather(local, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows()  # the output features computed: None (all) unless resized
        weight, bias = self.weight, self.bias
        if rows is not None:
            weight = weight.index_select(0, rows)
            bias = None if bias is None else bias.index_select(0, rows)
        w = weight.t()  # [K, N_r] (N_r kept)
        if self.info.world == 1:
            with compute_scope(x.device, self.compute_timer, self._work()):
                return self._impute(F.linear(x, weight, bias), rows)
        if self.sequence_parallel:
            sizes = self._seq_sizes(gathered=True)
            if self.overlap:  # the fused op: compute and wire interleaved
                y = self._region(lambda x: all_gather_matmul(  # [B, S, N_r]
                    x, w, self.group, self.seq_dim, sizes=sizes, chunks=self.chunks), x)
            else:
                x = gather_for_matmul(x, self.group, self.seq_dim, sizes)  # [B, S, K]
                y = self._region(lambda x: F.linear(x, weight), x)
        elif (together := self._together()) is not None:
            # every sibling's forward in one GEMM, one all-reduce of their summed dx
            index = self.siblings.index(self)
            y = self._pieces(lambda x: self.shared_input.linear(x, together, index), x)
        elif self.shared_input is not None:  # one all-reduce of the siblings' summed dx
            width = sum(s._width() for s in self.siblings)
            # a resized weight is a copy; a hooked one must get its gradient through autograd
            into = self.weight if self._kept is None and self.defer_wgrad and \
                not _hooked(self.weight) else None
            y = self._pieces(lambda x: self.shared_input.matmul(x, w, width=width,
                                                                wgrad_into=into), x)
        elif self.overlap:
            y = self._pieces(lambda x: column_parallel_matmul(x, w, self.group, chunks=self.chunks), x)
        else:
            x = copy_to_region(x, self.group)
            y = self._region(lambda x: F.linear(x, weight), x)
        return self._impute(y if bias is None else y + bias, rows)

    shared_input = None  # a plait.ops.SharedInput, set by share_input
    siblings: tuple = ()
    defer_wgrad = True  # sharing its input, the weight gradient runs under the all-reduce

    def _together(self) -> tuple | None:
        """The siblings' weights, when their forwards run as one GEMM: none resized (a
        resized weight is a copy of some rows), none hooked (a sibling whose output is
        unused would have its hooks called with None), all of one dtype; None if not
        shared."""
        if self.shared_input is None or len({s.weight.dtype for s in self.siblings}) != 1 or \
                any(s._kept is not None or _hooked(s.weight) for s in self.siblings):
            return None
        return tuple(s.weight for s in self.siblings)

    def _width(self) -> int:
        """The output features computed now (all, or the kept ones when resized)."""
        return self.weight.shape[0] if self._kept is None else len(self._rows())

    def _rows(self) -> torch.Tensor | None:
        """The weight rows of the kept features, in every block; None when not resized."""
        if self._kept is None:
            return None
        starts = torch.arange(self.blocks, device=self._kept.device) * self.features()
        return (starts[:, None] + self._kept[None, :]).reshape(-1)

    def _impute(self, y: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The full-shape output: the kept features where they belong, zeros elsewhere."""
        if rows is None:
            return y
        return y.new_zeros(*y.shape[:-1], self.weight.shape[0]).index_copy(-1, rows, y)


class RowParallelLinear(_ParallelLinear):
    """``y = Σ_r x_r @ W[rows_r, :] + b``; see the module docstring for shapes.

    ``unit``: input features per plan unit (the head dim when the plan counts
    heads, to match the column-parallel layer before it). Sequence-parallel,
    the bias is added on each rank's share of the sequence, so its gradient is
    summed over the group.
    """

    shard_dim = 1
    default_unit_name = "rows"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.sequence_parallel and self.bias is not None:
            mark_partial_grad(self.bias, self.group)

    def _cut_bias(self, full: torch.Tensor) -> torch.Tensor:
        return full.detach().clone()

    def _gather_bias(self, local: torch.Tensor) -> torch.Tensor:
        return local.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.start(x).finish()

    def start(self, x: torch.Tensor, chunks=None) -> "Started":
        """The forward, returned while its all-reduce may still be on the wire (fused,
        not sequence-parallel: the last pieces are); ``finish()`` gives ``forward(x)``.
        Every other path is done by the time it returns. ``chunks``: this call's pieces
        (default the layer's)."""
        weight = self.weight  # [N, K_r]; K_r kept only, when resized
        if self._kept is not None:
            x, weight = x.index_select(-1, self._kept), weight.index_select(1, self._kept)
        w = weight.t()  # [K_r, N]
        if self.info.world == 1:
            with compute_scope(x.device, self.compute_timer, self._work()):
                return Started(InFlight(F.linear(x, weight, self.bias), []))
        if self.sequence_parallel:
            sizes = self._seq_sizes(gathered=False)
            if self.overlap:
                y = self._region(lambda x: matmul_reduce_scatter(
                    x, w, self.group, self.seq_dim, sizes=sizes, chunks=self.chunks), x)  # [B, S_r, N]
            else:
                y, problem = attempt(lambda: self._plain_local(x, weight))
                with refused(problem):
                    y = reduce_scatter_region(x if y is None else y, self.group, self.seq_dim,
                                              sizes)
        elif self.overlap:
            into = self.weight if self._kept is None else None  # a resized weight is a copy
            chunks = self.chunks if chunks is None else chunks
            return Started(self._pieces(lambda x: matmul_all_reduce_start(
                x, w, self.group, chunks=chunks, wgrad_into=into), x), self.bias)
        else:
            y, problem = attempt(lambda: self._plain_local(x, weight))
            with refused(problem):  # refused on every rank, by the all-reduce's check
                y = reduce_from_region(x if y is None else y, self.group)
        return Started(InFlight(y, []), self.bias)  # nothing left on the wire

    def _plain_local(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The plain path's local GEMM, once x is known to fit (a ValueError/TypeError
        naming the mismatch if not, for every rank to raise)."""
        name = f"{type(self).__name__}({self.in_features}, {self.out_features})"
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TypeError(f"{name}: x must be a tensor [..., K_r], got {type(x).__name__}")
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"{name}: x {tuple(x.shape)} has {x.shape[-1]} features, but "
                             f"this rank's shard takes {weight.shape[1]}")
        if x.dtype != weight.dtype:
            raise TypeError(f"{name}: x is {x.dtype}, the weight {weight.dtype}")
        return self._region(lambda x: F.linear(x, weight), x)


class Started:
    """A row-parallel layer's forward begun: ``finish()`` waits for what is still on the wire
    (if anything) and adds the bias, giving what ``forward`` gives."""

    def __init__(self, flight: InFlight, bias: torch.Tensor | None = None):
        self._flight, self._bias = flight, bias

    def finish(self) -> torch.Tensor:
        y = self._flight.wait()
        return y if self._bias is None else y + self._bias


def share_input(layers, group=None, *, overlap: bool = True, chunks="auto") -> SharedInput | None:
    """Column-parallel ``layers`` that read one replicated input (q/k/v; gate/up): their
    input gradients' partial sums are added before one all-reduce, fused when ``overlap``
    (:mod:`plait.ops.shared_input`), instead of one all-reduce each. A layer still reading
    another tensor gets its own all-reduce. None (nothing shared) for fewer than two
    layers, one rank, or sequence-parallel layers (their input is gathered, not copied)."""
    layers = tuple(layers)
    if any(not isinstance(l, ColumnParallelLinear) for l in layers):
        raise TypeError("share_input takes ColumnParallelLinear layers, got "
                        f"{[type(l).__name__ for l in layers]}")
    if len(layers) < 2 or any(l.sequence_parallel or l.info.world == 1 for l in layers):
        return None
    shared = SharedInput(group, overlap=overlap, chunks=chunks)
    for layer in layers:
        layer.shared_input, layer.siblings = shared, layers
    return shared
