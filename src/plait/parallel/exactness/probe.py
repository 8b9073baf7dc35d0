"""Before the model changes: what every rank will compute, simulated on one process, against the
modules' own forward on one small batch.

A plan says which linears to cut; it cannot say how the code around them reads their
shares. A fused q/k/v weight may be three blocks of heads (``[q | k | v]``) or one block of
heads each ``[q k v]`` (GPT-NeoX, CodeGen); an attention module may view its q by a global
head count, normalise all heads together, or hold a per-head parameter; an activation may
have parameters; an embedding subclass may scale its lookups. Run on a rank's share, any of
these is a shape error at best and a silently different model at worst. So ``verify`` runs
the model once (ids ``[1, 16]``, eval mode, no gradient, the RNG untouched), keeps the inputs
of every module the plan touches, and in float64 on this process:

- each attention or MLP whose linears pair up (a *dim*): for every rank, a copy of the
  module with its linears cut as that rank's will be, the row-parallel outputs replaced by
  their sum over the simulated ranks (the all-reduce), must give the module's own output;
  and a backward through it must give every other parameter of the module the reference's
  gradient, on every rank or summed over them (then plait sums it: a per-head norm, an
  activation's parameters), else the model is refused. A fused column layer whose blocked
  cut does not match is tried per head (``[q k v]`` of each head together); an attention
  module that views by a global head count is tried with its head-count attributes set to
  the rank's (as torchtitan's ``apply_tp`` does);
- an embedding or linear whose class has its own forward: the same output as plait's layer
  computes (an embedding that scales its lookups by ``embed_scale`` keeps its scale);
- transformers' experts replaced by plait's expert-parallel layer: the same output as
  ``act(gate) · up`` then ``down``, weighted and summed; experts split by their FFN dim: the
  sum of the ranks' outputs.

The simulation of a split module is :mod:`.split`. What it decides
(:class:`Verdict`) the build and swap apply; what cannot run exactly is a
``ValueError`` naming the module, raised before any weight changes. A model that cannot be
run on example ids (no input embedding, weights on the meta device) is not checked, and
``applied(model)`` says so.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...nn._shard import shard_of
from ..dims import Dim
from .split import check_dim, dtype_for
from .verdict import TOL, Refused, Verdict, first_tensor, map_tensors, relative_error, to_dtype

__all__ = ["Verdict", "verify", "example_ids"]


# ------------------------------------------------------------------ running the model once
def example_ids(model: nn.Module) -> torch.Tensor | None:
    """Token ids ``[1, 16]`` for the model's input embedding, or None where it has none."""
    emb = None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        return None
    n = emb.num_embeddings
    return (torch.arange(16, device=emb.weight.device) * 7 + 3).remainder(n).unsqueeze(0)


def _capture(model: nn.Module, paths: list[str]) -> dict | None:
    """Each path's (args, kwargs) of its first call in one forward on example ids."""
    ids = example_ids(model)
    if ids is None or not paths:
        return None
    modules = dict(model.named_modules())
    seen: dict[str, tuple] = {}
    handles = []
    for path in paths:
        def hook(m, args, kwargs, path=path):
            if path not in seen:  # a snapshot: a cache object in kwargs changes later
                seen[path] = _snapshot((args, kwargs))
        handles.append(modules[path].register_forward_pre_hook(hook, with_kwargs=True))
    modes = {m: m.training for m in model.modules()}
    takes = _params(model.forward)
    kw = {"use_cache": False} if "use_cache" in takes or "**" in takes else {}
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model(ids, **kw)
    except Exception:  # noqa: BLE001 - a model that does not run on ids is not checked
        return None
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return seen


def _params(fn) -> set[str]:
    """The parameter names of ``fn`` ("**" where it takes any keyword)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    return {"**" if p.kind is p.VAR_KEYWORD else p.name for p in params}


def _snapshot(x):
    try:
        return copy.deepcopy(_detach(x))
    except Exception:  # noqa: BLE001 - an argument that does not copy is kept as it is
        return _detach(x)



def _detach(x):
    return map_tensors(x, lambda t: t.detach().clone())


def _extra_state(module: nn.Module, allowed=("weight", "bias")) -> list[str]:
    """Parameters and buffers beyond the base layer's, which plait's layer would drop."""
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return [n for n in names if n not in allowed]


def _check_embedding(path: str, module: nn.Embedding, captured: tuple, verdict: Verdict) -> None:
    if type(module).forward is nn.Embedding.forward and not _extra_state(module):
        return
    extra = _extra_state(module, ("weight", "embed_scale"))
    if extra:
        raise Refused(f"{path}: {type(module).__name__} holds {', '.join(extra)} beside its "
                       "weight, which plait's vocabulary-parallel embedding would drop: leave it "
                       "out of the plan")
    args, kwargs = captured
    ids = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
    with torch.no_grad():
        got = module(ids)
        plain = F.embedding(ids, module.weight, module.padding_idx)
        if relative_error(got, plain) == 0.0:
            return
        scale = getattr(module, "embed_scale", None)
        if scale is not None:
            s = torch.as_tensor(scale).to(module.weight.dtype)
            if relative_error(got, plain * s) == 0.0:
                verdict.scales[path] = torch.as_tensor(scale).detach().clone()
                verdict.notes.append((path, f"{type(module).__name__}: its lookups scaled by "
                                            "embed_scale, as its forward does"))
                return
    raise Refused(f"{path}: {type(module).__name__}'s forward is not nn.Embedding's lookup "
                   "(nor a lookup scaled by embed_scale); plait's vocabulary-parallel "
                   "embedding would not compute it: leave it out of the plan")


def _check_linear(path: str, module: nn.Linear, captured: tuple) -> None:
    extra = _extra_state(module)
    if extra:
        raise Refused(f"{path}: {type(module).__name__} holds {', '.join(extra)} beside its "
                       "weight and bias, which plait's parallel linear would drop: leave it out "
                       "of the plan")
    if type(module).forward is nn.Linear.forward:
        return
    args, kwargs = captured
    x = args[0] if args else next(iter(kwargs.values()))
    with torch.no_grad():
        got = module(x)
        plain = F.linear(x, module.weight, module.bias)
    if relative_error(first_tensor(got), plain) > TOL.get(plain.dtype, 1e-3):
        raise Refused(f"{path}: {type(module).__name__}'s forward is not nn.Linear's "
                       "(x·Wᵀ + b); plait's parallel linear would not compute it")


def _check_experts(path: str, module: nn.Module, captured: tuple, world: int, ep: bool,
                   plan=None) -> None:
    """Experts made expert-parallel: plait computes act(gate)·up then down per (token, expert),
    weighted and summed; split by FFN columns: the module's own forward on each share."""
    from ..layers import experts_shape

    e, h, f = experts_shape(module, path)
    dtype = dtype_for(module, captured)
    args, kwargs = to_dtype(captured, dtype)
    ref = copy.deepcopy(module).to(dtype).eval()
    names = ["hidden_states", "top_k_index", "top_k_weights"]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    if set(bound) != set(names):
        raise Refused(f"{path}: {type(module).__name__} is not called with (hidden_states, "
                       "top_k_index, top_k_weights), as plait's experts are")
    with torch.no_grad():
        want = first_tensor(ref(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
        if ep:
            act = getattr(module, "act_fn", None)
            if act is None:
                raise Refused(f"{path}: {type(module).__name__} has no act_fn; plait's "
                               "expert-parallel experts compute act(gate)·up, then down")
            got = _plain_experts(ref, act, **bound)
        else:
            from ...plan import ShardPlan

            plan = plan or ShardPlan.even(f, world)
            got = 0
            for r in range(world):
                m = copy.deepcopy(ref)
                t = getattr(ref, "is_transposed", False)
                m.gate_up_proj = nn.Parameter(shard_of(ref.gate_up_proj, plan, r, 2 if t else 1,
                                                       blocks=2))
                m.down_proj = nn.Parameter(shard_of(ref.down_proj, plan, r, 1 if t else 2))
                if hasattr(m, "intermediate_dim"):
                    m.intermediate_dim = plan.sizes[r]
                got = got + first_tensor(m(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
    err = relative_error(got, want)
    if err > TOL.get(dtype, 1e-3):
        how = ("act(gate)·up, then down, per expert" if ep else
               "its forward on each rank's FFN columns, summed")
        raise Refused(f"{path}: {type(module).__name__}'s forward differs from what plait "
                       f"computes ({how}) by {err:.1e}: leave its experts out of the plan")


def _plain_experts(m, act, hidden_states, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden_states)
    for slot in range(top_k_index.shape[-1]):
        for e in top_k_index[:, slot].unique().tolist():
            rows = (top_k_index[:, slot] == e).nonzero().squeeze(1)
            x = hidden_states[rows]
            transposed = getattr(m, "is_transposed", False)
            gate_up = x @ m.gate_up_proj[e] if transposed else F.linear(x, m.gate_up_proj[e])
            own = getattr(type(m), "_apply_gate", None)
            if own is not None:
                h = own(m, gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                h = act(gate) * up
            y = h @ m.down_proj[e] if transposed else F.linear(h, m.down_proj[e])
            out.index_add_(0, rows, y * top_k_weights[rows, slot, None].to(y.dtype))
    return out


# ------------------------------------------------------------------ the entry point
def _eager_experts(model: nn.Module):
    """transformers' experts default to torch's grouped GEMM, which takes no float64 on a
    CPU: a float64 model's own forward (the reference this check reads) runs its experts
    the eager way instead, and is set back after. Returns what sets it back."""
    impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    if impl != "grouped_mm" or setter is None or \
            not any(p.dtype == torch.float64 for p in model.parameters()):
        return lambda: None
    setter("eager")
    return lambda: setter(impl)


def verify(model: nn.Module, dims: list[Dim], world: int, kinds: dict, plans: dict,
           summed: set[str] = frozenset()) -> Verdict:
    """Check what ``parallelize`` is about to do (see the module docstring). ``kinds``: path →
    "embedding", "linear", "experts-ep" or "experts-tp" for the modules replaced; ``plans``:
    path → ShardPlan of one-module styles; ``summed``: parameters the plan already sums
    over the ranks (replicated_with_grad_allreduce)."""
    restore = _eager_experts(model)
    try:
        return _verify(model, dims, world, kinds, plans, summed)
    finally:
        restore()


def _verify(model: nn.Module, dims: list[Dim], world: int, kinds: dict, plans: dict,
            summed: set[str]) -> Verdict:
    verdict = Verdict()
    if any(p.is_meta for p in model.parameters()):
        verdict.checked = False
        verdict.notes.append(("", "not checked against the modules' own forward (weights on "
                                  "the meta device)"))
        return verdict
    paired = [d for d in dims if d.cols and d.rows]
    paths = sorted({d.name for d in paired} | set(kinds))
    captured = _capture(model, paths)
    if captured is None:
        verdict.checked = False
        verdict.notes.append(("", "not checked against the modules' own forward (the model "
                                  "does not run on example token ids)"))
        return verdict
    modules = dict(model.named_modules())
    try:
        for dim in paired:
            if dim.name in captured:
                check_dim(dim, modules[dim.name], captured[dim.name], world, verdict, summed)
        for path, kind in sorted(kinds.items()):
            if path not in captured:
                continue
            if kind == "embedding":
                _check_embedding(path, modules[path], captured[path], verdict)
            elif kind == "linear":
                _check_linear(path, modules[path], captured[path])
            else:
                _check_experts(path, modules[path], captured[path], world, kind == "experts-ep",
                               plans.get(path))
    except Refused as err:
        raise ValueError(str(err)) from None
    return verdict
