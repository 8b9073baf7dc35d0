"""What the tensor-parallel linear layers share (:class:`_ParallelLinear`): the plan, the
parameters cut from the full weight and gathered back, resharding to a new plan, and
ZERO-resizing.

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

from ..plan import ShardPlan
from ._shard import (GroupInfo, check_full, pieces, replace_data, resolve_plan, shard_of,
                     straggled, unshard)

__all__ = ["select_features"]


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
