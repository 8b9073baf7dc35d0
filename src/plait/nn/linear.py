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

Straggler emulation and the speed monitor's timing wrap each layer's compute (``F.linear``
on the plain path, each local GEMM piece on the fused one; waiting is never compute).
ZERO-resizing, the plan and the state both layers share: :mod:`.linear_base`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import all_gather_matmul, column_parallel_matmul, matmul_reduce_scatter
from ..ops.context import attempt, refused
from ..ops.matmul_all_reduce import (InFlight, matmul_all_reduce, matmul_all_reduce_start,
                                     traced_column_matmul, traced_matmul_all_reduce)
from ..ops.shared_input import SharedInput
from ..ops.regions import copy_to_region, gather_for_matmul, reduce_from_region, reduce_scatter_region
from ._shard import _idle, compute_scope, mark_partial_grad, shard_of
from .linear_base import _hooked, _ParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "Started", "share_input"]


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
        if torch.compiler.is_compiling():
            return self._traced(x)
        if not torch.is_grad_enabled() and self._kept is None and not self.sequence_parallel:
            # no backward (a decoding step): a column-parallel forward moves no bytes, so
            # it is the local GEMM alone, with no cross-rank check to make (and, with
            # nothing timed or slowed, no region around it: a step makes a few dozen)
            if _idle(self.compute_timer):
                return F.linear(x, self.weight, self.bias)
            with compute_scope(x.device, self.compute_timer, self._work()):
                return F.linear(x, self.weight, self.bias)
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

    def _traced(self, x: torch.Tensor) -> torch.Tensor:
        """Under ``torch.compile`` (registered ops; no compute is timed): fused, the local
        GEMM whose backward's dgrad is the fused ``matmul_all_reduce`` (the siblings that
        read one input: one GEMM and one dgrad for all of them, as eager plait's shared
        input); else the GEMM after the region's entry (its backward all-reduce, shared by
        the siblings), or after the sequence's gather."""
        if self.overlap and not self.sequence_parallel and self.info.world > 1:
            if (together := self._together()) is not None:
                return self._traced_together(x, together)
            if self.shared_input is None and self._kept is None:
                y = traced_column_matmul(x, self.weight.t(), self.group, self.chunks)
                return y if self.bias is None else y + self.bias
        rows = self._rows()
        weight, bias = self.weight, self.bias
        if rows is not None:
            weight = weight.index_select(0, rows)
            bias = None if bias is None else bias.index_select(0, rows)
        if self.sequence_parallel:
            x = gather_for_matmul(x, self.group, self.seq_dim, self._seq_sizes(gathered=True))
        elif self.info.world > 1:
            x = self._entered(x)
        return self._impute(F.linear(x, weight, bias), rows)

    def _traced_together(self, x: torch.Tensor, weights: tuple) -> torch.Tensor:
        """The first sibling computes every sibling's output from ``x`` in one GEMM (its
        backward one fused dgrad over their concatenated weights); each takes its columns.
        The last drops what was kept: nothing is held between calls."""
        shared = self.shared_input
        if shared.traced_in is not x:
            y = traced_column_matmul(x, torch.cat(weights).t(), self.group, self.chunks)
            shared.traced_in = x
            shared.traced_out = y.split([w.shape[0] for w in weights], dim=-1)
        y = shared.traced_out[self.siblings.index(self)]
        if self is self.siblings[-1]:
            shared.traced_in = shared.traced_out = None
        return y if self.bias is None else y + self.bias

    def _entered(self, x: torch.Tensor) -> torch.Tensor:
        """``copy_to_region(x)`` once for the siblings that read one input (q/k/v; gate/up):
        their input gradients meet in one all-reduce, as eager plait's shared input has them
        (one a layer, not three). The last sibling drops what it kept: nothing is held
        between calls, and the traced graph sees the same empty slot every call."""
        shared = self.shared_input
        if shared is None:
            return copy_to_region(x, self.group)
        if shared.traced_in is not x:
            shared.traced_in, shared.traced_out = x, copy_to_region(x, self.group)
        out = shared.traced_out
        if self is self.siblings[-1]:
            shared.traced_in = shared.traced_out = None
        return out

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
        if torch.compiler.is_compiling():
            y = self._traced(x)
            return y if self.bias is None else y + self.bias
        if not torch.is_grad_enabled() and self.overlap and self._kept is None and \
                not self.sequence_parallel and self.info.world > 1 and _idle(self.compute_timer):
            # no backward, nothing timed or slowed (a decoding step): the operator alone
            bias = self.bias
            y = matmul_all_reduce(x, self.weight.t(), self.group, chunks=self.chunks)
            return y if bias is None else y + bias
        return self.start(x).finish()

    def start(self, x: torch.Tensor, chunks=None) -> "Started":
        """The forward, returned while its all-reduce may still be on the wire (fused,
        not sequence-parallel: the last pieces are); ``finish()`` gives ``forward(x)``.
        Every other path is done by the time it returns. ``chunks``: this call's pieces
        (default the layer's)."""
        if torch.compiler.is_compiling():
            return Started(InFlight(self._traced(x), []), self.bias)
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

    def _traced(self, x: torch.Tensor) -> torch.Tensor:
        """Under ``torch.compile``, without the bias: the fused operator as one registered
        op (its pieces, decision and check inside it), or the local GEMM then the plain
        reduction (or the sequence's reduce-scatter); no compute is timed."""
        weight = self.weight  # [N, K_r]
        if self._kept is not None:
            x, weight = x.index_select(-1, self._kept), weight.index_select(1, self._kept)
        if self.info.world == 1:
            return F.linear(x, weight)
        if self.sequence_parallel:
            return reduce_scatter_region(F.linear(x, weight), self.group, self.seq_dim,
                                         self._seq_sizes(gathered=False))
        if not self.overlap:
            return reduce_from_region(F.linear(x, weight), self.group)
        return traced_matmul_all_reduce(x, weight.t(), self.group, self.chunks)

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
