"""plait's collectives and fused operators as registered torch ops (``torch.ops.plait.*``), so
``torch.compile`` traces a parallel model as one graph, as it does PyTorch's functional
collectives (``torch.ops._c10d_functional``) and vLLM's (``torch.ops.vllm.all_reduce``).

Each op is functional (a new tensor out, its inputs untouched) with a fake implementation
that gives the output's shape, so a graph holds it as one node; its real implementation
is plait's eager code, run when the graph runs: the transport, the fused schedule and
its decision (fused or not, pieces), and the cross-rank check all happen inside the op,
per call, exactly as in eager mode (the same numbers). The regions' autograd (what each
op's backward moves) is :mod:`plait.ops.regions`'s, written with these ops under
compilation, so AOTAutograd traces it into the backward graph.

==========================  ==================================  ======================
op                          forward                             backward (in regions)
==========================  ==================================  ======================
all_reduce(x, g)            Σ_ranks x                           —
all_gather(x, g, dim, s)    concatenate every rank's x on dim   —
reduce_scatter(x, g, d, s)  Σ_ranks x, this rank's rows of d    —
matmul_all_reduce(x, w, g)  Σ_ranks x_r @ w_r  ([..., N])       dx = dy wᵀ, dw = xᵀ dy
opaque(tensors, key)        a registered eager function         the function again,
                            (an expert-parallel dispatch)       differentiated
==========================  ==================================  ======================

``g``: a group's key (:func:`group_key`); ``s``: every rank's length along ``dim``.
Eager calls do not go through these ops (the dispatcher would cost every call a few
microseconds); code reaches them under ``torch.compiler.is_compiling()``.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["group_key", "group_of", "compiling", "register_opaque"]

_GROUPS: dict[str, object] = {}  # a group's key -> the group object plait's contexts hold


@torch.compiler.assume_constant_result
def group_key(group) -> str:
    """A string naming ``group`` (None: the default group) in a graph; the object itself is
    kept here for the op to find (a graph holds strings, not process groups)."""
    key = "" if group is None else group.group_name
    _GROUPS.setdefault(key, group)
    return key


def group_of(key: str):
    """The group object ``key`` names (as :func:`group_key` was given it)."""
    return _GROUPS[key]


def compiling() -> bool:
    """Whether the caller is being traced by ``torch.compile`` (False in eager mode)."""
    return torch.compiler.is_compiling()


@torch.library.custom_op("plait::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    from .context import transport_of

    out = transport_of(group_of(group)).summed(x.contiguous())
    return out.clone() if out.data_ptr() == x.data_ptr() else out


@all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("plait::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group: str, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    from .regions import gather_from_region

    with torch.no_grad():  # contiguous, as the fake says (a gather along dim > 0 is a view)
        return gather_from_region(x, group_of(group), dim, list(sizes)).contiguous()


@all_gather.register_fake
def _(x: torch.Tensor, group: str, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


@torch.library.custom_op("plait::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group: str, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    from .regions import reduce_scatter_region

    with torch.no_grad():
        return reduce_scatter_region(x, group_of(group), dim, list(sizes)).contiguous()


@reduce_scatter.register_fake
def _(x: torch.Tensor, group: str, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    import torch.distributed as dist

    shape = list(x.shape)
    shape[dim] = sizes[dist.get_rank(group_of(group))]
    return x.new_empty(shape)


@torch.library.custom_op("plait::matmul_all_reduce", mutates_args=())
def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, group: str, chunks: int
                      ) -> torch.Tensor:
    """Σ_ranks x_r @ w_r through plait's fused operator (``chunks`` 0: ``"auto"``)."""
    from .matmul_all_reduce import matmul_all_reduce as fused

    with torch.no_grad():  # contiguous (a GEMV's product may be a transposed buffer)
        return fused(x, w, group_of(group), chunks="auto" if chunks == 0 else chunks).contiguous()


@matmul_all_reduce.register_fake
def _(x: torch.Tensor, w: torch.Tensor, group: str, chunks: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[1])


def _mar_setup(ctx, inputs, output) -> None:
    x, w, _, _ = inputs
    ctx.save_for_backward(x, w)


def _mar_backward(ctx, dy):
    """dy is replicated (every rank computed the same loss from the sum): each rank's
    gradients are its own, no bytes move."""
    x, w = ctx.saved_tensors
    dx = dy @ w.t() if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:
        dw = x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])
    return dx, dw, None, None


matmul_all_reduce.register_autograd(_mar_backward, setup_context=_mar_setup)


# --- an eager region as one op --------------------------------------------------------
# What holds data-dependent control flow (an expert-parallel dispatch: token counts known
# only when the router has run, the all-to-all splits they give) runs as one opaque op:
# its function, registered under a key, runs eagerly (its collectives and checks inside);
# its backward runs the function again with autograd on (the activations recomputed, as
# activation checkpointing does) and differentiates it: the same gradients as eager.
_OPAQUE: dict[str, tuple] = {}


def register_opaque(key: str, fn, like) -> str:
    """Run ``fn(*tensors)`` as ``torch.ops.plait.opaque(tensors, key)`` under compilation;
    ``like(*tensors)``: an empty tensor of its output's shape and dtype. ``key``."""
    _OPAQUE[key] = (fn, like)
    return key


@torch.library.custom_op("plait::opaque", mutates_args=())
def opaque(inputs: list[torch.Tensor], key: str) -> torch.Tensor:
    fn, _ = _OPAQUE[key]
    with torch.no_grad():
        out = fn(*inputs)
    return out.clone() if any(out.data_ptr() == t.data_ptr() for t in inputs) else \
        out.contiguous()


@opaque.register_fake
def _(inputs: list[torch.Tensor], key: str) -> torch.Tensor:
    return _OPAQUE[key][1](*inputs)


@torch.library.custom_op("plait::opaque_backward", mutates_args=())
def opaque_backward(inputs: list[torch.Tensor], dy: torch.Tensor, key: str
                    ) -> list[torch.Tensor]:
    fn, _ = _OPAQUE[key]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with _autograd_on(), torch.enable_grad():
        out = fn(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, dy, allow_unused=True))
    result = []
    for t in leaves:
        g = next(grads) if t.requires_grad else None
        result.append(torch.zeros_like(t) if g is None else g.contiguous())
    return result


@opaque_backward.register_fake
def _(inputs: list[torch.Tensor], dy: torch.Tensor, key: str) -> list[torch.Tensor]:
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]


def _autograd_on():
    """Autograd's dispatch keys back on inside an op's implementation (a custom op runs below
    autograd), so a function can be differentiated there."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther,
                C.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


def _opaque_setup(ctx, inputs, output) -> None:
    tensors, key = inputs
    ctx.key = key
    ctx.floating = [t.is_floating_point() for t in tensors]
    ctx.save_for_backward(*tensors)


def _opaque_grad(ctx, dy):
    grads = torch.ops.plait.opaque_backward(list(ctx.saved_tensors), dy, ctx.key)
    return [g if f else None for g, f in zip(grads, ctx.floating)], None


opaque.register_autograd(_opaque_grad, setup_context=_opaque_setup)
