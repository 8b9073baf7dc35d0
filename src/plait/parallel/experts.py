"""transformers' fused experts made expert-parallel on plait's fused all-to-all operators.

Every rank holds whole experts (a :class:`~plait.plan.ShardPlan` over the
experts, uneven allowed) and the router stays replicated, so every rank
routes every token alike. The experts module gets the replicated tokens with
their routing (``top_k_index``, ``top_k_weights``); each rank takes an even
share of the tokens (``scatter_to_region``), sends each (token, expert) row to
the expert's owner while it multiplies (``all_to_all_matmul`` with
``gate_up_proj``), applies the experts' gate (``act(gate) · up``, or the class's own
``_apply_gate``), multiplies by ``down_proj`` while sending the rows back
(``matmul_all_to_all``), weighs and sums each token's rows, and the shares are
gathered back (``gather_from_region``).

============  =========================  =========================================
tensor        shape on rank r            note
============  =========================  =========================================
gate_up_proj  [E_r, 2F, H]               this rank's experts (state_dict keys kept)
down_proj     [E_r, H, F]
hidden        [T, H] in, [T, H] out      replicated; T_r = even share computed here
top_k_*       [T, k]                     routing, replicated
============  =========================  =========================================

Backward: the operators' own (dgrad fused with the reverse all-to-all); the
scatter's backward all-gathers the tokens' and routing weights' gradients, so
the replicated router gets its whole gradient on every rank. Fewer tokens than
ranks (decoding): every rank runs its experts on every token routed to them and
the outputs are summed, as experts split by their FFN dim are.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from ..nn._shard import GroupInfo, resolve_plan, shard_of, straggled
from ..nn.moe import RoutedLoad
from ..nn.placement import PlacedExperts, by_destination, copy_rows
from ..ops.library import constant_result, opaque, register_opaque
from ..ops.moe import all_to_all_matmul, matmul_all_to_all
from ..ops.pieces import even_sizes
from ..ops.regions import (copy_to_region, gather_from_region, reduce_from_region,
                           scatter_to_region)
from ..plan import ShardPlan
from ..runtime.compat import all_gather_into
from .layers import experts_shape

__all__ = ["ExpertParallelExperts"]


class ExpertParallelExperts(nn.Module, PlacedExperts):
    """Whole experts per rank of a transformers experts module; see the module docstring."""

    def __init__(self, experts: nn.Module, path: str, group=None, *,
                 plan: ShardPlan | None = None, overlap: bool = True, chunks="auto"):
        super().__init__()
        e, h, f = experts_shape(experts, path)
        self.info, self.group, self.path = GroupInfo(group), group, path
        self.num_experts, self.hidden, self.ffn = e, h, f
        self.plan = resolve_plan(plan, e, self.info, what="experts", layer=path)
        self.chunks = chunks if overlap else 1
        self.overlap = overlap
        self.act_fn = experts.act_fn
        self.transposed = bool(getattr(experts, "is_transposed", False))  # [E, in, out] already
        # the class's own gate (DeepSeek-V4 clamps gate and up before act(gate)·up), as
        # transformers' grouped and batched kernels call it, with the scalars it reads
        self._own_gate = getattr(type(experts), "_apply_gate", None)
        for name, value in vars(experts).items():
            plain = value is None or isinstance(value, (bool, int, float, str, tuple))
            if not name.startswith("_") and plain and not hasattr(self, name):
                setattr(self, name, value)
        self.routed = RoutedLoad(self.num_experts)  # tokens per expert, from the count exchange
        rank = self.info.rank
        self.gate_up_proj = nn.Parameter(shard_of(experts.gate_up_proj.detach(), self.plan, rank))
        self.down_proj = nn.Parameter(shard_of(experts.down_proj.detach(), self.plan, rank))
        self._placeable((self.gate_up_proj, self.down_proj))  # copies sum their gradients

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._own_gate is not None:
            return self._own_gate(self, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        weights = (self.gate_up_proj, self.down_proj)
        few = hidden_states.shape[0] < self.info.world  # a rank would have no tokens to send
        if torch.compiler.is_compiling():  # the token counts are data: the dispatch runs as one op
            if few:
                return opaque([hidden_states, top_k_index, top_k_weights,
                                               *weights], _opaque_key(self, "few"))
        elif few:
            return self._few_tokens(hidden_states, top_k_index, top_k_weights)
        x = scatter_to_region(hidden_states, self.group, 0)          # [T_r, H]
        w = scatter_to_region(top_k_weights, self.group, 0)          # [T_r, k]
        idx = _own_rows(top_k_index, self.info)                      # [T_r, k]
        if torch.compiler.is_compiling():
            out = opaque([x, idx, w, *weights], _opaque_key(self, "dispatch"))
        else:
            out = straggled(lambda x: self._dispatch_combine(x, idx, w), x)
        shares = even_sizes(hidden_states.shape[0], self.info.world)  # as scattered
        return gather_from_region(out, self.group, 0, shares)        # [T, H]

    def _dispatch_combine(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                          gate_up: torch.Tensor | None = None,
                          down: torch.Tensor | None = None):
        gate_up = self.gate_up_proj if gate_up is None else gate_up
        down = self.down_proj if down is None else down
        k = idx.shape[-1]
        flat = idx.reshape(-1)                                        # [T_r·k]
        order = torch.argsort(flat, stable=True)  # by expert, hence by owner rank
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)   # [E]
        send, recv, table = self._counts(counts)
        if self.placed:  # by destination, then expert: a copy's rows are a block of them
            order = by_destination(order, flat, table[self.info.rank], self.homes)
            token = order // k
        x_send = x.index_select(0, token)                             # [T_r·k, H]
        h = all_to_all_matmul(x_send, self._in_out(gate_up), send, recv,
                              self.group, chunks=self.chunks)         # [T_recv, 2F]
        h = self._apply_gate(h)                                       # [T_recv, F]
        y = matmul_all_to_all(h, self._in_out(down), send, recv, self.group,
                              chunks=self.chunks)                     # [T_r·k, H]
        y = y * w.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        return torch.zeros_like(x).index_add(0, token, y)

    def _few_tokens(self, hidden_states, top_k_index, top_k_weights,
                    gate_up: torch.Tensor | None = None,
                    down: torch.Tensor | None = None) -> torch.Tensor:
        """Fewer tokens than ranks (decoding one sequence on 3 ranks): every rank runs its own
        experts on every token routed to them, and the outputs are summed (all-reduce); the
        tokens' and weights' gradients are summed back the same way."""
        gate_up = self.gate_up_proj if gate_up is None else gate_up
        down = self.down_proj if down is None else down
        x = copy_to_region(hidden_states, self.group)                 # [T, H]
        w = copy_to_region(top_k_weights.to(x.dtype), self.group)     # [T, k]
        if not torch.compiler.is_compiling():  # every rank sees every token: no exchange
            self.routed.add_counts(torch.bincount(top_k_index.reshape(-1),
                                                  minlength=self.num_experts))
        if self.placed:
            return reduce_from_region(self._few_placed(x, top_k_index, w, gate_up, down),
                                      self.group)
        mine = self.plan.slice_of(self.info.rank)
        out = torch.zeros_like(x)
        for slot in range(top_k_index.shape[-1]):
            for e in top_k_index[:, slot].unique().tolist():
                if not mine.start <= e < mine.stop:
                    continue
                rows = (top_k_index[:, slot] == e).nonzero().squeeze(1)
                h = self._apply_gate(x[rows] @ self._in_out(gate_up)[e - mine.start])
                y = h @ self._in_out(down)[e - mine.start]
                out = out.index_add(0, rows, y * w[rows, slot, None])
        return reduce_from_region(out, self.group)

    def _few_placed(self, x, top_k_index, w, gate_up, down) -> torch.Tensor:
        """``_few_tokens``' sum on a placement: each copy of an expert computes its block of
        the rows routed to it (in token order), so the sum over ranks counts each row once."""
        rank, out = self.info.rank, torch.zeros_like(x)
        slots = self.homes.slots(rank)
        for e in top_k_index.unique().tolist():
            if e not in slots:
                continue
            hit = top_k_index == e                                     # [T, k]
            rows = copy_rows(hit.any(dim=1).nonzero().squeeze(1), e, self.homes, rank)
            if not rows.numel():
                continue
            i = slots.index(e)
            h = self._apply_gate(x[rows] @ self._in_out(gate_up)[i])
            y = h @ self._in_out(down)[i]
            weight = (w[rows] * hit[rows]).sum(dim=1, keepdim=True)   # its slot's weight
            out = out.index_add(0, rows, y * weight)
        return out

    def _in_out(self, w: torch.Tensor) -> torch.Tensor:
        """An experts weight as [E_r, in, out] (transformers stores [E, out, in] unless
        ``is_transposed``)."""
        return w if self.transposed else w.transpose(1, 2)

    def _counts(self, counts: torch.Tensor):
        """(send [W][E_d], recv [W][E_r], every rank's counts [W][E]) from every rank's
        per-expert token counts."""
        world = self.info.world
        everyone = counts.new_empty(world * counts.numel())
        all_gather_into(everyone, counts.contiguous(), group=self.group)
        table = everyone.view(world, -1).tolist()                     # [W][E]
        self.routed.add(table)
        return (*self._send_recv(table), table)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """``gate_up_proj`` and ``down_proj`` with every expert (a collective)."""
        def value(p):
            return p.detach() if not grads else \
                torch.zeros_like(p) if p.grad is None else p.grad.detach()
        return {name: self._whole(value(getattr(self, name)))
                for name in ("gate_up_proj", "down_proj")}

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, H={self.hidden}, F={self.ffn}, {self._where()}, "
                f"{'fused' if self.overlap else 'plain'}")


@constant_result
def _opaque_key(layer: ExpertParallelExperts, part: str) -> str:
    """The key of ``layer``'s ``part`` ("dispatch": the experts between scatter and gather;
    "few": fewer tokens than ranks) as one registered op (``plait.ops.library``)."""
    ref = weakref.ref(layer)
    run = {"dispatch": lambda *t: ref()._dispatch_combine(*t),
           "few": lambda *t: ref()._few_tokens(*t)}[part]
    return register_opaque(f"experts-{part}-{id(layer)}", run,
                           lambda x, *rest: torch.empty_like(x))


def _own_rows(t: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """This rank's even share of ``t``'s rows (as ``scatter_to_region`` cuts them)."""
    from ..ops.pieces import even_sizes, offsets

    at = offsets(even_sizes(t.shape[0], info.world))
    return t[at[info.rank]:at[info.rank + 1]]
