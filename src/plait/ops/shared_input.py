"""Column-parallel matmuls that read one replicated input, with one input-gradient all-reduce.

Attention's q, k and v projections read the same ``x``, as an MLP's gate and up do. A
rank's input gradient is ``dx_r = Σ_j dy_j,r @ w_j,rᵀ`` and the whole one ``dx = Σ_r dx_r``:
the siblings' partial sums are added before one all-reduce (Megatron's "f" placed once),
not one all-reduce of ``[M, K]`` per layer (three for q/k/v, two for gate/up, as
``column_parallel_matmul`` and DTensor's ``ColwiseParallel`` make).

==========  ==========================  ==========================================
tensor      shape on rank r             note
==========  ==========================  ==========================================
x           [..., K]                    replicated: the same on every rank
w_j         [K, N_j,r]                  sibling j's column shard (N_j,r may differ)
y_j         [..., N_j,r]                local: ``x @ w_j``
dx          [..., K]                    ``all_reduce(Σ_j dy_j @ w_jᵀ)``
dw_j        [K, N_j,r]                  ``xᵀ @ dy_j``, local
==========  ==========================  ==========================================

``SharedInput.matmul``: the first sibling to read a tensor wraps it, the others reuse the
wrap; each sibling's backward leaves ``(dy_j, w_j)`` with it, and the wrap's backward (after
every sibling's) runs the summed dgrad as one fused ``matmul_all_reduce`` over
``[dy_0 | dy_1 | …] @ [w_0 | w_1 | …]ᵀ``, the weight gradients under its last pieces (the
siblings' own given ``wgrad_into``, and any a row-parallel layer deferred,
:mod:`plait.ops.deferred`). ``overlap=False``: one shared ``copy_to_region``.

``SharedInput.linear(x, params, index)``, for siblings with ``nn.Linear`` weights: the first
computes every sibling's output as one GEMM ``x @ [p_0; p_1; …]ᵀ`` (concatenated anew each
forward) and leaves the others their columns; the backward is one autograd node, the dgrad
fused as above and the weight gradients as one GEMM under its last pieces. A sibling whose
output never reaches the loss gets no gradient.

The wire schedule (dtype, M, K, pieces) is checked across ranks in the forward, once per wrap,
its gather under the first GEMM, as ``column_parallel_matmul`` does.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from .context import OpsContext, attempt, get_context
from .pieces import as_rows, compute_region, current_region, offsets, piece
from .deferred import accumulate, defer, run_deferred
from .matmul_all_reduce import (DGRAD, DgradCheck, _decide, _fused_forward, dgrad_check,
                               local_check, same_dgrad)
from .regions import copy_to_region

__all__ = ["SharedInput"]


class _Wrap:
    """One input, wrapped once: the siblings' (dy_j, w_jᵀ) as their backwards leave them."""

    def __init__(self, x: torch.Tensor, agreed=None, ops_ctx=None):
        self.x, self.version, self.agreed = weakref.ref(x), x._version, agreed
        self.ops_ctx = ops_ctx  # where a sibling defers its weight gradient
        self.metas, self.parts, self.done = None, [], False
        self.tensor = lambda: None  # the wrapped input (weakly: autograd's graph holds it)

    def holds(self, x: torch.Tensor):
        """The wrapped tensor if ``x`` is the tensor wrapped (unchanged, backward not yet
        run), else None."""
        if self.done or self.x() is not x or x._version != self.version:
            return None
        return self.tensor()

    def agree(self) -> None:
        """The backward's schedule, checked on every rank (once, after the first GEMM)."""
        if self.metas is None and self.agreed is not None:
            self.metas = self.agreed()
            same_dgrad(self.metas)


class _Enter(torch.autograd.Function):
    """Identity forward; backward: the siblings' summed dgrad, all-reduced in pieces."""

    @staticmethod
    def forward(ctx, x2, wrap, group, chunks, ops_ctx):
        ctx.set_materialize_grads(False)  # the siblings leave their dy with the wrap
        ctx.wrap, ctx.group, ctx.chunks, ctx.ops_ctx = wrap, group, chunks, ops_ctx
        ctx.region = current_region()
        return x2.view_as(x2)

    @staticmethod
    def backward(ctx, _none):
        wrap = ctx.wrap
        wrap.done, parts, wrap.parts = True, wrap.parts, []
        if not parts:  # no sibling's output reached the loss (the same on every rank)
            return None, None, None, None, None
        dy = torch.cat([d for d, _ in parts], dim=1) if len(parts) > 1 else parts[0][0]
        w = torch.cat([v for _, v in parts], dim=0) if len(parts) > 1 else parts[0][1]
        with compute_region(ctx.region):
            decision, transposed = _decide(DGRAD, wrap.metas, dy.element_size(), ctx.chunks,
                                           ctx.ops_ctx)
            dx = _fused_forward(dy.contiguous(), w, ctx.group, decision, transposed,
                                meanwhile=lambda: run_deferred(ctx.ops_ctx))  # [M, K]
        return dx, None, None, None, None


class _Sibling(torch.autograd.Function):
    """``x @ w`` on the wrapped input; backward: (dy, wᵀ) left with the wrap, dw here or,
    given ``into``, deferred to run under the wrap's all-reduce."""

    @staticmethod
    def forward(ctx, xs, w, wrap, into):
        ctx.save_for_backward(xs, w)
        ctx.wrap, ctx.region, ctx.into = wrap, current_region(), into
        with piece():
            y = xs @ w  # [M, N_j]
        wrap.agree()  # its gather travelled under the GEMM
        return y

    @staticmethod
    def backward(ctx, dy):
        xs, w = ctx.saved_tensors
        dw = None
        if ctx.needs_input_grad[0]:
            ctx.wrap.parts.append((dy, w.t()))  # [M, N_j], [N_j, K]
        if ctx.needs_input_grad[1] and ctx.into is not None:
            param, region = ctx.into, ctx.region

            def wgrad():  # in the parameter's [N_j, K] layout
                with compute_region(region), piece():
                    accumulate(param, dy.t() @ xs)
            defer(ctx.wrap.ops_ctx, wgrad)  # a sibling's wrap is the fused path's: it has one
        elif ctx.needs_input_grad[1]:
            with compute_region(ctx.region), piece():
                dw = xs.t() @ dy  # [K, N_j]
        return None, dw, None, None


class _Outputs:
    """One ``_Together`` forward's outputs, each left for its sibling's own call to take."""

    def __init__(self, x: torch.Tensor, params: tuple, ys):
        self.x, self.version, self.params, self.ys = weakref.ref(x), x._version, params, list(ys)

    def take(self, x: torch.Tensor, params: tuple, index: int) -> torch.Tensor | None:
        """Sibling ``index``'s output if it was computed from ``x`` (unchanged) with these very
        weights and not taken yet, else None."""
        if self.x() is not x or x._version != self.version or len(params) != len(self.params) \
                or any(a is not b for a, b in zip(params, self.params)):
            return None
        y, self.ys[index] = self.ys[index], None
        return y

    def clear(self) -> None:
        self.ys = [None] * len(self.ys)


def _columns(y: torch.Tensor, widths) -> tuple[torch.Tensor, ...]:
    """``y.split(widths, dim=1)``, but each part its own tensor on ``y``'s storage rather than
    a view: autograd forbids modifying in place any of several views a Function returns,
    and the parts' columns are disjoint, so one changed in place changes no other."""
    cut = offsets(widths)
    return tuple(y.new_empty(0).set_(y.untyped_storage(), y.storage_offset() + lo,
                                     (y.shape[0], hi - lo), y.stride())
                 for lo, hi in zip(cut[:-1], cut[1:]))


class _Together(torch.autograd.Function):
    """Every sibling's forward as one GEMM, ``x @ [p_0; p_1; …]ᵀ`` split by columns;
    backward: the summed dgrad all-reduced in pieces, the weight gradients as one GEMM
    ``[dy_0 | dy_1 | …]ᵀ @ x`` under its last pieces, returned through autograd."""

    @staticmethod
    def forward(ctx, x2, wrap, group, chunks, ops_ctx, outs, *params):
        ctx.set_materialize_grads(False)  # a sibling whose output is unused sends no dy
        p = torch.cat(params)  # [Σ N_j, K]: a copy, so a later in-place update cannot reach it
        ctx.save_for_backward(x2)
        ctx.p, ctx.widths, ctx.outs = p, [q.shape[0] for q in params], outs
        ctx.wrap, ctx.group, ctx.chunks, ctx.ops_ctx = wrap, group, chunks, ops_ctx
        ctx.region = current_region()
        with piece():
            y = x2 @ p.t()  # [M, Σ N_j]
        if wrap is not None:
            wrap.agree()  # its gather travelled under the GEMM
        return _columns(y, ctx.widths)

    @staticmethod
    def backward(ctx, *dys):
        (x2,) = ctx.saved_tensors
        outs = ctx.outs()
        if outs is not None:  # untaken outputs hold this graph: let it go
            outs.clear()
        skip = (None,) * 6
        live = [j for j, d in enumerate(dys) if d is not None]
        if not live:
            return skip + (None,) * len(dys)
        cut = offsets(ctx.widths)
        dy = torch.cat([dys[j] for j in live], dim=1)  # [M, Σ live N_j]
        w = ctx.p if len(live) == len(dys) else \
            torch.cat([ctx.p[cut[j]:cut[j + 1]] for j in live])  # [Σ live N_j, K]
        dws = {}

        def wgrad():  # under the dgrad's last pieces, with what row-parallel layers deferred
            if any(ctx.needs_input_grad[6 + j] for j in live):
                with piece():
                    dw = dy.t() @ x2  # [Σ live N_j, K], each weight's rows in turn
                dws.update(zip(live, dw.split([ctx.widths[j] for j in live])))
            run_deferred(ctx.ops_ctx)
        with compute_region(ctx.region):
            if ctx.wrap is None:  # plain: x2 came through copy_to_region, whose backward
                with piece():    # all-reduces this dx
                    dx = dy @ w  # [M, K]
                wgrad()
            else:
                ctx.wrap.done = True
                decision, transposed = _decide(DGRAD, ctx.wrap.metas, dy.element_size(),
                                               ctx.chunks, ctx.ops_ctx)
                dx = _fused_forward(dy, w, ctx.group, decision, transposed, meanwhile=wgrad)
        return (dx,) + skip[1:] + tuple(dws.get(j) if ctx.needs_input_grad[6 + j] else None
                                        for j in range(len(dys)))


class SharedInput:
    """The column-parallel layers of one group that read one replicated input (q/k/v, or
    gate/up): ``matmul(x, w, width=…)`` is ``x @ w`` whose input gradient is summed with
    the other siblings' before one all-reduce; ``linear(x, params, index)`` does that too,
    every sibling's forward and weight gradient one GEMM (see the module docstring).

    ``overlap``: the summed dgrad runs fused (pieces on the wire as they are computed,
    ``chunks`` of them or ``"auto"``) or plain (one shared ``copy_to_region``).
    """

    def __init__(self, group=None, *, overlap: bool = True, chunks="auto",
                 ctx: OpsContext | None = None):
        self.group, self.overlap, self.chunks, self._ctx = group, overlap, chunks, ctx
        self._wrap = _Wrap(torch.empty(0))
        self._outs: _Outputs | None = None  # the last ``linear`` GEMM's untaken outputs
        self.wraps = 0  # inputs wrapped so far: one backward all-reduce each
        # under torch.compile, the siblings' one copy_to_region of their input, kept from the
        # first sibling's call to the last's (nn.linear.ColumnParallelLinear._entered)
        self.traced_in = self.traced_out = None

    def __getstate__(self) -> dict:  # torch.save(model): the wrap is one forward's, not state
        return {**self.__dict__, "_wrap": None, "_outs": None, "traced_in": None,
                "traced_out": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _wrap=_Wrap(torch.empty(0)), _outs=None)

    def linear(self, x: torch.Tensor, params, index: int) -> torch.Tensor:
        """``x @ params[index]ᵀ``, where ``params`` are every sibling's weight ([N_j, K],
        ``nn.Linear``'s layout; the same tuple from each sibling) and ``index`` is this
        one's. The first sibling to read ``x`` computes all of them as one GEMM
        ``x @ [p_0; p_1; …]ᵀ`` and leaves the others their columns; a sibling calling again
        on the same ``x``, or on another tensor, starts a GEMM (and an all-reduce) of its
        own. Backward, fused: the summed dgrad all-reduced in pieces and the weight
        gradients as one GEMM under its last pieces, returned through autograd (hooks and
        ``torch.autograd.grad`` see them); plain: one ``copy_to_region``, autograd's GEMMs.
        Under ``torch.no_grad()``, or for an x that needs no gradient: a local matmul."""
        if not (torch.is_grad_enabled() and x.requires_grad):
            with piece():
                return x @ params[index].t()
        y = None if self._outs is None else self._outs.take(x, params, index)
        if y is None:
            self._outs = self._together(x, params)
            y = self._outs.take(x, params, index)
        return y.reshape(*x.shape[:-1], y.shape[1]) if x.dim() != 2 else y

    def _together(self, x: torch.Tensor, params) -> _Outputs:
        """Every sibling's output from one GEMM (see ``linear``), the all-reduce agreed."""
        self.wraps += 1
        x2 = as_rows(x) if x.dim() != 2 else x  # [M, K]
        outs = _Outputs(x, params, ())  # the backward clears it (weakly held: no cycle)
        if not self.overlap:  # one copy_to_region: its backward all-reduces the summed dx
            outs.ys = list(_Together.apply(copy_to_region(x2, self.group), None, self.group,
                                           self.chunks, None, weakref.ref(outs), *params))
            return outs
        ctx = self._ctx or get_context(self.group)

        def row():  # the dgrad [M, Σ N_j] @ [Σ N_j, K], row-major
            for p in params:
                local_check("column_parallel_matmul", x2, p.t(), self.chunks)
            own = dgrad_check(x2, params[0].t(), self.chunks, True)
            return replace(own, K_r=sum(p.shape[0] for p in params), w_column_major=0).row()
        mine, problem = attempt(row)
        agreed = ctx.start_meta(DGRAD, DgradCheck.width(0), mine, problem)
        if problem is not None:
            agreed()  # raises on every rank
        self._wrap = _Wrap(x, agreed, ctx)  # for the agreement only: ``matmul`` wraps anew
        outs.ys = list(_Together.apply(x2, self._wrap, self.group, self.chunks, ctx,
                                       weakref.ref(outs), *params))
        return outs

    def matmul(self, x: torch.Tensor, w: torch.Tensor, *, width: int | None = None,
               wgrad_into: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w`` (x [..., K] replicated, w [K, N_r]). ``width``: every sibling's N_r
        summed (the backward's piece-count model; default this w's). ``wgrad_into``: the
        parameter ``p`` with ``w = p.t()``: the weight gradient is then deferred to run under
        the siblings' all-reduce and added to ``p.grad`` (fused path only; as
        ``matmul_all_reduce(wgrad_into=)``: ``torch.autograd.grad`` does not see it). Under
        ``torch.no_grad()``, or for an x that needs no gradient: a local matmul, no
        all-reduce."""
        if wgrad_into is not None and tuple(wgrad_into.shape) != (w.shape[1], w.shape[0]):
            raise ValueError(f"SharedInput.matmul: wgrad_into {tuple(wgrad_into.shape)} is not "
                             f"the transposed shape of w {tuple(w.shape)}")
        if not (torch.is_grad_enabled() and x.requires_grad):
            with piece():
                return x @ w
        xs = self._wrap.holds(x)  # [M, K], wrapped
        if xs is None:
            xs = self._enter(x, w, width or w.shape[1])
        if self.overlap:
            out = _Sibling.apply(xs, w, self._wrap, wgrad_into)
        else:
            with piece():
                out = xs @ w  # [M, N_j]; autograd adds the siblings' dx before the all-reduce
        return out.reshape(*x.shape[:-1], w.shape[1]) if x.dim() != 2 else out

    def _enter(self, x: torch.Tensor, w: torch.Tensor, width: int) -> torch.Tensor:
        """Wrap ``x`` as [M, K] (what every sibling's backward saves, so the weak reference
        lives as long as the graph does: under saved-tensor hooks, non-reentrant activation
        checkpointing or ``save_on_cpu``, the graph holds a copy instead, the reference dies
        and each sibling wraps its own: exact, one all-reduce each, as without sharing; a
        reviewer measured 3 wraps for q/k/v there): the backward's all-reduce is agreed here."""
        self.wraps += 1
        x2 = as_rows(x) if x.dim() != 2 else x  # [M, K]
        if not self.overlap:
            self._wrap = _Wrap(x)
            xs = copy_to_region(x2, self.group)
        else:
            ctx = self._ctx or get_context(self.group)

            def row():  # the dgrad [M, Σ N_j] @ [Σ N_j, K], row-major
                own = dgrad_check(x2, w, self.chunks, True)
                return replace(own, K_r=width, w_column_major=0).row()
            mine, problem = attempt(row)
            agreed = ctx.start_meta(DGRAD, DgradCheck.width(0), mine, problem)
            if problem is not None:
                agreed()  # raises on every rank
            self._wrap = _Wrap(x, agreed, ctx)
            xs = _Enter.apply(x2, self._wrap, self.group, self.chunks, ctx)
        self._wrap.tensor = weakref.ref(xs)
        return xs
