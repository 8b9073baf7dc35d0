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
op (defined in)             forward                             backward
==========================  ==================================  ======================
all_reduce(x, g) (here)     Σ_ranks x                           regions' mappings
all_gather(x, g, dim, s)    concatenate every rank's x on dim   regions' mappings
  (regions)
reduce_scatter(x, g, d, s)  Σ_ranks x, this rank's rows of d    regions' mappings
  (regions)
matmul_all_reduce(x, w, g)  Σ_ranks x_r @ w_r  ([..., N])       dx = dy wᵀ, dw = xᵀ dy
  (matmul_all_reduce)
opaque(tensors, key)        a registered eager function         the function again,
                            (an expert-parallel dispatch)       differentiated
==========================  ==================================  ======================

``g``: a group's key (:func:`group_key`); ``s``: every rank's length along ``dim``.
Eager calls do not go through these ops (the dispatcher would cost every call a few
microseconds); code reaches them under ``torch.compiler.is_compiling()``.
"""

from __future__ import annotations


import torch

__all__ = ["group_key", "group_of", "define", "register_opaque", "opaque",
           "opaque_key", "constant_result", "recomputing"]

_GROUPS: dict[str, object] = {}  # a group's key -> the group object plait's contexts hold


def constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing ``torch._dynamo``
    (0.9 s, which every ``import plait.ops`` and every ``plait --help`` would pay): the mark
    that function sets (``tests/ops/test_compile.py`` checks it is still the same)."""
    fn._dynamo_marked_constant = True
    return fn


@constant_result
def group_key(group) -> str:
    """A string naming ``group`` (None: the default group) in a graph; the object itself is
    kept here for the op to find (a graph holds strings, not process groups)."""
    key = "" if group is None else group.group_name
    _GROUPS.setdefault(key, group)
    return key


def group_of(key: str):
    """The group object ``key`` names (as :func:`group_key` was given it)."""
    return _GROUPS[key]


_LIB = torch.library.Library("plait", "DEF")


def define(schema: str, kernel, fake) -> None:
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


define("all_reduce(Tensor x, str group) -> Tensor", _all_reduce,
        lambda x, group: torch.empty_like(x, memory_format=torch.contiguous_format))


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


@constant_result
def opaque_key(name: str, fn, like, *consts) -> str:
    """The key of ``fn(*tensors, *consts)`` as one opaque op (an operator called directly
    under compilation, its plain-Python arguments ``consts`` fixed in the graph: hashable
    values such as tuples of counts and a group's key); ``like(*tensors, *consts)``: an
    empty tensor of its output's shape. Registered once per distinct ``consts``."""
    key = f"{name}{consts!r}"
    if key not in _OPAQUE:
        register_opaque(key, lambda *t: fn(*t, *consts), lambda *t: like(*t, *consts))
    return key


def _opaque(inputs: list[torch.Tensor], key: str) -> torch.Tensor:
    with torch.no_grad():
        out = _OPAQUE[key][0](*inputs)
    return out.clone() if any(out.data_ptr() == t.data_ptr() for t in inputs) else \
        out.contiguous()


_RECOMPUTING = [0]  # opaque backwards running their function again, now


def recomputing() -> bool:
    """Whether an opaque op's backward is running its function again (its activations
    recomputed): what that function counts per call (routed tokens) it counted already."""
    return _RECOMPUTING[0] > 0


def _opaque_backward(inputs: list[torch.Tensor], dy: torch.Tensor, key: str
                     ) -> list[torch.Tensor]:
    fn = _OPAQUE[key][0]
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    _RECOMPUTING[0] += 1
    try:
        with _autograd_on(), torch.enable_grad():
            out = fn(*leaves)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, dy, allow_unused=True))
    finally:
        _RECOMPUTING[0] -= 1
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


define("opaque(Tensor[] inputs, str key) -> Tensor", _opaque,
        lambda inputs, key: _OPAQUE[key][1](*inputs))
define("opaque_backward(Tensor[] inputs, Tensor dy, str key) -> Tensor[]", _opaque_backward,
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
