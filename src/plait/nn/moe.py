"""Expert-parallel, dropless mixture of experts on ``all_to_all_matmul`` / ``matmul_all_to_all``.

Every rank routes its own tokens (top-k of a softmax router, weights
renormalised over the k), sends each token to the ranks owning its experts,
and gets the experts' outputs back. Dropless: an expert takes every token
routed to it, however uneven. Experts are split by a
:class:`~plait.plan.ShardPlan` over the experts (rank r owns experts
``plan.slice_of(r)``).

============  =======================  ===========================================
tensor        shape on rank r          note
============  =======================  ===========================================
router        [E, H] (nn.Linear)       replicated; gradient summed over ranks
w1, w2        [E_r, H, F], [E_r, F, H]  this rank's experts
x             [..., H]                 this rank's tokens (distinct on each rank),
                                       or replicated with ``replicated_input``
out           like x
============  =======================  ===========================================

``out[t] = Σ_j p_j(t) · gelu(x_t @ w1[e_j(t)]) @ w2[e_j(t)]`` over the top-k
experts ``e_j(t)`` with renormalised router probabilities ``p_j(t)``.

``replicated_input``: x is the same on every rank (tensor parallelism without
sequence parallelism); each rank then takes an even share of the tokens
(``scatter_to_region``) and the outputs are gathered back (``gather_from_region``).

The single-device twin is any module with ``router`` (nn.Linear, no bias),
``w1`` [E, H, F], ``w2`` [E, F, H] and ``top_k`` (``plait.models.moe.MoEFeedForward``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.agree import raise_together
from ..ops.context import attempt
from ..ops.moe import all_to_all_matmul, matmul_all_to_all
from ..ops.library import constant_result, opaque, recomputing, register_opaque
from ..ops.pieces import as_rows, even_sizes
from ..ops.regions import gather_from_region, scatter_to_region
from ..plan import ShardPlan
from ..runtime.compat import all_gather_into
from ._shard import (GroupInfo, check_full, compute_scope, mark_partial_grad, resolve_plan,
                     straggled)
from .placement import PlacedExperts, by_destination

__all__ = ["MoE", "RoutedLoad", "route_top_k", "experts_reference"]


def route_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k], experts [T, k]): softmax, top-k, renormalise."""
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


class RoutedLoad:
    """Tokens routed to each expert (the balancer's per-expert load), summed over every
    rank's count row as the layer's count exchange gathers them before its all-to-alls: the
    same on every rank, no collective of its own. A backward that runs the layer again (its
    activations recomputed under ``torch.compile``) is not counted twice."""

    def __init__(self, experts: int):
        self.tokens, self.calls = [0] * experts, 0
        self._held = None  # counts added as a tensor, read on the host only at ``take``

    def add(self, table: list[list[int]]) -> None:
        """``table[r][e]``: rank r's tokens for expert e in this call."""
        if recomputing():
            return
        for e, column in enumerate(zip(*table)):
            self.tokens[e] += sum(column)
        self.calls += 1

    def add_counts(self, counts: torch.Tensor) -> None:
        """This call's tokens per expert as a tensor, already the same on every rank (every
        rank saw every token): kept where it is, no device-to-host copy per call."""
        if recomputing():
            return
        self._held = counts if self._held is None else self._held + counts
        self.calls += 1

    def take(self) -> list[int]:
        """The tokens since the last ``take`` (and start again)."""
        out = self.tokens if self._held is None else \
            [a + b for a, b in zip(self.tokens, self._held.tolist())]
        self.tokens, self.calls, self._held = [0] * len(self.tokens), 0, None
        return out


def experts_reference(x2, weights, experts, w1, w2) -> torch.Tensor:
    """The single-device expert computation: [T, H] tokens, every expert in a loop."""
    out = torch.zeros_like(x2)
    for e in range(w1.shape[0]):
        token, slot = (experts == e).nonzero(as_tuple=True)
        if token.numel():
            h = F.gelu(x2[token] @ w1[e]) @ w2[e]  # [T_e, H]
            out = out.index_add(0, token, h * weights[token, slot].unsqueeze(1))
    return out


class MoE(nn.Module, PlacedExperts):
    """Dropless top-k MoE with experts spread over ``group`` by ``plan``; see the module docstring."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int = 2, group=None, *,
                 plan: ShardPlan | None = None, overlap: bool = True, chunks="auto",
                 replicated_input: bool = False, full_router: torch.Tensor | None = None,
                 full_w1: torch.Tensor | None = None, full_w2: torch.Tensor | None = None,
                 seed: int = 0, dtype=None, device=None):
        super().__init__()
        name = f"MoE(H={hidden}, F={ffn}, E={num_experts}, k={top_k})"
        if min(hidden, ffn, num_experts) < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"{name}: needs positive sizes and 1 ≤ top_k ≤ experts")
        check_full(name, "router weight", full_router, (num_experts, hidden))
        check_full(name, "w1", full_w1, (num_experts, hidden, ffn))
        check_full(name, "w2", full_w2, (num_experts, ffn, hidden))
        self.info = GroupInfo(group)
        self.group, self.hidden, self.ffn, self.num_experts, self.top_k = (
            group, hidden, ffn, num_experts, top_k)
        self.overlap, self.chunks, self.replicated_input = overlap, chunks, replicated_input
        self.plan = resolve_plan(plan, num_experts, self.info, what="experts", layer=name)
        self.routed = RoutedLoad(num_experts)  # on 2 ranks or more: the count exchange's
        if full_router is None or full_w1 is None or full_w2 is None:
            made = _init_full(hidden, ffn, num_experts, seed, dtype)
            full_router = made[0] if full_router is None else full_router
            full_w1 = made[1] if full_w1 is None else full_w1
            full_w2 = made[2] if full_w2 is None else full_w2
        dtype = dtype or full_w1.dtype
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        mine = self.plan.slice_of(self.info.rank)
        with torch.no_grad():
            self.router.weight.copy_(full_router)
        self.w1 = nn.Parameter(full_w1[mine].detach().to(dtype=dtype, device=device).clone())
        self.w2 = nn.Parameter(full_w2[mine].detach().to(dtype=dtype, device=device).clone())
        mark_partial_grad(self.router.weight, group)  # each rank routes only its own tokens
        self._placeable((self.w1, self.w2))  # ``place`` moves them; copies sum gradients

    @classmethod
    def from_module(cls, module, group=None, *, plan: ShardPlan | None = None, **kw):
        """The expert-parallel twin of a single-device MoE (``router``, ``w1``, ``w2``, ``top_k``)."""
        missing = [a for a in ("router", "w1", "w2", "top_k") if not hasattr(module, a)]
        if missing:
            raise TypeError(f"MoE.from_module needs a module with router, w1, w2 and top_k; "
                            f"{type(module).__name__} lacks {', '.join(missing)}")
        if getattr(module.router, "bias", None) is not None:
            raise ValueError("MoE.from_module: the router must have no bias")
        w1 = module.w1.detach()
        e, h, f = w1.shape
        return cls(h, f, e, module.top_k, group, plan=plan, full_router=module.router.weight.detach(),
                   full_w1=w1, full_w2=module.w2.detach(), dtype=w1.dtype, device=w1.device, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.info.world == 1:
            self._check(x)
            x2 = as_rows(x)  # [T, H]
            with compute_scope(x.device):
                weights, experts = route_top_k(self.router(x2), self.top_k)
                return experts_reference(x2, weights, experts, self.w1, self.w2).view(x.shape)
        x2 = as_rows(x) if isinstance(x, torch.Tensor) and x.dim() else x  # [T, H]
        x2_rows = x2.shape[0] if isinstance(x2, torch.Tensor) else 0
        if self.replicated_input:
            x2 = scatter_to_region(x2, self.group, 0)  # [T_r, H]: this rank's share
        if torch.compiler.is_compiling():  # the token counts are data: routing and dispatch run as one op
            out = opaque([x2, self.router.weight, self.w1, self.w2],
                                         _opaque_key(self))
        else:
            # the fused ops interleave the expert GEMMs and the wire, and the small count
            # exchange sits between routing and dispatch: the whole step is one scope
            out = straggled(self._expert_parallel, x2)
        if self.replicated_input:
            out = gather_from_region(out, self.group, 0, even_sizes(x2_rows, self.info.world))
        return out.view(x.shape)

    def _check(self, x) -> None:
        """x must be [..., H] in the layer's dtype (a ValueError/TypeError naming it if not)."""
        name = f"MoE(H={self.hidden}, E={self.num_experts})"
        if not isinstance(x, torch.Tensor) or x.dim() < 1:
            raise TypeError(f"{name}: x must be a tensor [..., H], got {type(x).__name__}")
        if x.shape[-1] != self.hidden:
            raise ValueError(f"{name}: x {tuple(x.shape)} has {x.shape[-1]} features, "
                             f"the layer takes H={self.hidden}")
        if x.dtype != self.w1.dtype:
            raise TypeError(f"{name}: x is {x.dtype}, the experts {self.w1.dtype}")

    def _expert_parallel(self, x2: torch.Tensor, router: torch.Tensor | None = None,
                         w1: torch.Tensor | None = None, w2: torch.Tensor | None = None
                         ) -> torch.Tensor:
        router = self.router.weight if router is None else router
        w1 = self.w1 if w1 is None else w1
        w2 = self.w2 if w2 is None else w2
        _, problem = attempt(lambda: self._check(x2))
        if problem is not None:  # join the count exchange, which refuses it on every rank
            self._counts(torch.zeros(self.num_experts, dtype=torch.int64,
                                     device=self.w1.device), problem)
        weights, experts = route_top_k(F.linear(x2, router), self.top_k)  # [T, k] each
        flat = experts.reshape(-1)                                     # [T·k]
        order = torch.argsort(flat, stable=True)  # by expert, hence by owner rank
        counts = torch.bincount(flat, minlength=self.num_experts)    # [E]
        send, recv, table = self._counts(counts)
        if self.placed:  # by destination, then expert: a copy's rows are a block of them
            order = by_destination(order, flat, table[self.info.rank], self.homes)
        token = order // self.top_k
        x_send = x2.index_select(0, token)                            # [T·k, H], (rank, expert)
        chunks = self.chunks if self.overlap else 1
        h = all_to_all_matmul(x_send, w1, send, recv, self.group, chunks=chunks)
        h = F.gelu(h)                                                 # [T_recv, F]
        y = matmul_all_to_all(h, w2, send, recv, self.group, chunks=chunks)  # [T·k, H]
        y = y * weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x2).index_add(0, token, y)

    def _counts(self, counts: torch.Tensor, problem: Exception | None = None
                ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """(send_counts [W][E_d], recv_counts [W][E_r], every rank's per-expert counts
        [W][E]) from every rank's per-expert counts; the same gather carries every rank's
        verdict on its input (each rank raises if any rank's was bad, before a token
        moves)."""
        row = torch.cat([counts.new_tensor([int(problem is not None)]), counts])  # [1 + E]
        everyone = row.new_empty(self.info.world * row.numel())
        all_gather_into(everyone, row, group=self.group)
        table = everyone.view(self.info.world, row.numel()).tolist()  # [W][1 + E]
        raise_together("MoE", self.group, any(row[0] for row in table), problem)
        table = [row[1:] for row in table]  # [W][E]
        self.routed.add(table)
        return (*self._send_recv(table), table)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """``router.weight``, ``w1``, ``w2`` with every expert (a collective); ``grads``: their
        gradients instead (zeros where there is none)."""
        def value(p):
            return p.detach() if not grads else \
                torch.zeros_like(p) if p.grad is None else p.grad.detach()
        return {"router.weight": value(self.router.weight).clone(),
                "w1": self._whole(value(self.w1)), "w2": self._whole(value(self.w2))}

    def extra_repr(self) -> str:
        return (f"H={self.hidden}, F={self.ffn}, experts={self.num_experts}, k={self.top_k}, "
                f"{self._where()}, {'fused' if self.overlap else 'plain'}"
                f"{', replicated_input' if self.replicated_input else ''}")


@constant_result
def _opaque_key(layer: MoE) -> str:
    """The key of ``layer``'s routing and dispatch as one registered op (plait.ops.library)."""
    ref = weakref.ref(layer)
    return register_opaque(f"moe-{id(layer)}", lambda *t: ref()._expert_parallel(*t),
                           lambda x, *rest: torch.empty_like(x))


def _init_full(hidden: int, ffn: int, experts: int, seed: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.get_default_dtype()
    router = torch.randn(experts, hidden, generator=gen, dtype=dtype) * hidden ** -0.5
    w1 = torch.randn(experts, hidden, ffn, generator=gen, dtype=dtype) * hidden ** -0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen, dtype=dtype) * ffn ** -0.5
    return router, w1, w2

