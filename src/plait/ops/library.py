"""plait's collectives and fused operators as registered torch ops (``torch.ops.plait.*``), so
``torch.compile`` traces a parallel model as one graph, as it does PyTorch's functional
collectives (``torch.ops._c10d_functional``) and vLLM's (``torch.ops.vllm.all_reduce``).

Each op is functional (a new tensor out, its inputs untouched) with a fake implementation
that gives the output's shape, so a graph holds it as one node; its real implementation
is plait's eager code, run when the graph runs: the transport, the fused schedule and
its decision (fused or not, pieces), and the cross-rank check all happen inside the op,
per call, exactly as in eager mode (the same numbers). The ops are defined with
``torch.library.Library`` and one Python kernel each, not ``custom_op``, whose wrappers
cost a call about 20 µs more here; their autograd is a ``torch.autograd.Function``
around them (here, and :mod:`plait.ops.regions`'s mappings), which dynamo traces and
AOTAutograd turns into the backward graph.

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

__all__ = ["group_key", "group_of", "compiling", "register_opaque", "opaque",
           "matmul_all_reduce"]

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


_LIB = torch.library.Library("plait", "DEF")


def _define(schema: str, kernel, fake) -> None:
    """Op ``plait::<schema>``: ``kernel`` its implementation on every device, ``fake`` its
    output's shape under tracing."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"plait::{name}", fake, lib=_LIB)


def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    from .context import transport_of

    out = transport_of(group_of(group)).summed(x.contiguous())
    return out.clone() if out.data_ptr() == x.data_ptr() else out


def _all_gather(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    from .regions import gather_from_region

    with torch.no_grad():  # contiguous, as the fake says (a gather along dim > 0 is a view)
        return gather_from_region(x, group_of(group), dim, list(sizes)).contiguous()


def _gathered_like(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


def _reduce_scatter(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    from .regions import reduce_scatter_region

    with torch.no_grad():
        return reduce_scatter_region(x, group_of(group), dim, list(sizes)).contiguous()


def _scattered_like(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    import torch.distributed as dist

    shape = list(x.shape)
    shape[dim] = sizes[dist.get_rank(group_of(group))]
    return x.new_empty(shape)


def _matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, group: str, chunks: int
                       ) -> torch.Tensor:
    """Σ_ranks x_r @ w_r through plait's fused operator (``chunks`` 0: ``"auto"``);
    contiguous (a GEMV's product may be a transposed buffer)."""
    from .matmul_all_reduce import matmul_all_reduce as fused

    with torch.no_grad():
        out = fused(x, w, group_of(group), chunks="auto" if chunks == 0 else chunks)
    return out.contiguous()


_define("all_reduce(Tensor x, str group) -> Tensor", _all_reduce,
        lambda x, group: torch.empty_like(x, memory_format=torch.contiguous_format))
_define("all_gather(Tensor x, str group, int dim, int[] sizes) -> Tensor", _all_gather,
        _gathered_like)
_define("reduce_scatter(Tensor x, str group, int dim, int[] sizes) -> Tensor",
        _reduce_scatter, _scattered_like)
_define("matmul_all_reduce(Tensor x, Tensor w, str group, int chunks) -> Tensor",
        _matmul_all_reduce, lambda x, w, group, chunks: x.new_empty(*x.shape[:-1], w.shape[1]))


class _MatmulAllReduce(torch.autograd.Function):
    """dy is replicated (every rank computed the same loss from the sum): each rank's
    gradients are its own, and no bytes move."""

    @staticmethod
    def forward(ctx, x, w, group: str, chunks: int):
        ctx.save_for_backward(x, w)
        return torch.ops.plait.matmul_all_reduce(x, w, group, chunks)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w.t() if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])
        return dx, dw, None, None


def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, group, chunks) -> torch.Tensor:
    """``plait::matmul_all_reduce`` with its gradient (for traced code; ``chunks`` an int
    or ``"auto"``)."""
    return _MatmulAllReduce.apply(x, w, group_key(group), 0 if chunks == "auto" else int(chunks))


# --- an eager region as one op --------------------------------------------------------
# What holds data-dependent control flow (an expert-parallel dispatch: token counts known
# only when the router has run, the all-to-all splits they give) runs as one opaque op:
# its function, registered under a key, runs eagerly (its collectives and checks inside);
# its backward runs the function again with autograd on (the activations recomputed, as
# activation checkpointing does) and differentiates it: the same gradients as eager.
_OPAQUE: dict[str, tuple] = {}


def register_opaque(key: str, fn, like) -> str:
    """Run ``fn(*tensors)`` as ``opaque(tensors, key)`` under compilation; ``like(*tensors)``:
    an empty tensor of its output's shape and dtype. ``key``."""
    _OPAQUE[key] = (fn, like)
    return key


def _opaque(inputs: list[torch.Tensor], key: str) -> torch.Tensor:
    with torch.no_grad():
        out = _OPAQUE[key][0](*inputs)
    return out.clone() if any(out.data_ptr() == t.data_ptr() for t in inputs) else \
        out.contiguous()


def _opaque_backward(inputs: list[torch.Tensor], dy: torch.Tensor, key: str
                     ) -> list[torch.Tensor]:
    fn = _OPAQUE[key][0]
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


def _autograd_on():
    """Autograd's dispatch keys back on inside an op's kernel (a kernel runs below
    autograd), so a function can be differentiated there."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradFunctionality, C.DispatchKey.AutogradOther,
                C.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


_define("opaque(Tensor[] inputs, str key) -> Tensor", _opaque,
        lambda inputs, key: _OPAQUE[key][1](*inputs))
_define("opaque_backward(Tensor[] inputs, Tensor dy, str key) -> Tensor[]", _opaque_backward,
        lambda inputs, dy, key: [torch.empty_like(t, memory_format=torch.contiguous_format)
                                 for t in inputs])


class _Opaque(torch.autograd.Function):
    @staticmethod
    def forward(ctx, key: str, *tensors):
        ctx.key = key
        ctx.floating = [t.is_floating_point() for t in tensors]
        ctx.save_for_backward(*tensors)
        return torch.ops.plait.opaque(list(tensors), key)

    @staticmethod
    def backward(ctx, dy):
        grads = torch.ops.plait.opaque_backward(list(ctx.saved_tensors), dy, ctx.key)
        return (None, *[g if f else None for g, f in zip(grads, ctx.floating)])


def opaque(tensors: list[torch.Tensor], key: str) -> torch.Tensor:
    """``plait::opaque`` with its gradient (the function registered under ``key``)."""
    return _Opaque.apply(key, *tensors)
