"""A split attention or MLP simulated rank by rank on one process, against its own forward.

For each rank: a copy of the module (float64 where it runs in float64) whose split linears
are plain linears holding that rank's share (``shard_of``, as plait's layers cut them; K/V
heads copied into sub-groups, per-head parameters cut with their heads), the row-parallel
outputs replaced by their sum over the simulated ranks (the all-reduce: passes until the
sums settle, rows may feed rows), and a backward whose row gradients are the same on every
rank (the all-reduce's backward). Multi-head latent attention's rotary-key gradient is
summed in a second backward pass (``sum_tail_grad``). ``check_dim`` tries the fused layers'
readings (blocks, then per head), with and without the head-count attributes set to a
rank's, and decides which parameters' gradients plait must sum; what fails is ``Refused``
(a ValueError naming the module). Pure: no process group.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ...nn._shard import shard_of
from ..dims import Dim
from .verdict import TOL, Refused, Verdict, first_tensor, relative_error, to_dtype

__all__ = ["Verdict", "check_dim", "dtype_for"]

_HEAD_ATTRS = ("num_heads", "n_heads", "num_attention_heads", "n_head", "n_local_heads",
               "num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_local_kv_heads",
               "n_kv_head")


# ------------------------------------------------------------------ a dim, rank by rank
class _Sim:
    """One dim's module, simulated on every rank in ``dtype`` (see the module docstring)."""

    def __init__(self, dim: Dim, module: nn.Module, captured: tuple, world: int, dtype):
        self.dim, self.module, self.world, self.dtype = dim, module, world, dtype
        self.args, self.kwargs = to_dtype(captured, dtype)
        self.tol = TOL.get(dtype, 1e-3)
        self.seed = 0

    def _rank_module(self, rank: int, attrs: dict, totals: dict, partials: dict,
                     detach_cols: bool, box: dict | None = None) -> nn.Module:
        m = copy.deepcopy(self.module).to(self.dtype).eval()  # no dropout in a comparison
        dim, prefix = self.dim, self.dim.name + "." if self.dim.name else ""
        for path in dim.cols + dim.rows:
            rel = path[len(prefix):]
            full = m.get_submodule(rel)
            local = _local_linear(full, dim, path, rank)
            if path in dim.rows:
                local.register_forward_hook(_row_hook(path, rank, totals, partials, full.bias))
            elif detach_cols:
                local.register_forward_pre_hook(lambda mod, a: (a[0].detach(), *a[1:]))
            _set(m, rel, local)
        for rel, tail in dim.tails.items():  # the rotary key's gradient, summed over ranks
            m.get_submodule(rel).register_forward_hook(
                lambda mod, a, out, tail=tail: out if box is None else
                _TailSum.apply(out, tail, box))
        for name, unit in dim.local.items():  # per-head parameters: this rank's heads
            full = getattr(m, name)
            setattr(m, name, nn.Parameter(shard_of(full.detach(), dim.plan, rank, 0, unit=unit)))
        for name, values in attrs.items():
            setattr(m, name, values[rank])
        if dim.groups_local is not None and hasattr(m, "num_key_value_groups"):
            m.num_key_value_groups = dim.groups_local
        return m

    def _reference(self, detach_cols: bool):
        m = copy.deepcopy(self.module).to(self.dtype).eval()
        if detach_cols:
            prefix = self.dim.name + "." if self.dim.name else ""
            for path in self.dim.cols:
                m.get_submodule(path[len(prefix):]).register_forward_pre_hook(
                    lambda mod, a: (a[0].detach(), *a[1:]))
        return m

    def _run(self, m: nn.Module, track: list | None = None):
        """``m`` on a copy of the recorded inputs; ``track``: the first floating tensor
        input is made a leaf that needs its gradient and appended to it."""
        args, kwargs = copy.deepcopy(self.args), copy.deepcopy(self.kwargs)
        if track is not None:
            x = next((a for a in list(args) + list(kwargs.values())
                      if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            if x is not None:
                x.requires_grad_(True)
            track.append(x)
        return m(*args, **kwargs)

    def forward(self, attrs: dict) -> tuple[float, str]:
        """The worst relative difference of the ranks' outputs, and why it failed to run."""
        with torch.no_grad():
            try:
                want = first_tensor(self._run(self._reference(False)))
            except Exception as err:  # noqa: BLE001
                raise Refused(f"{self.dim.name}: its forward does not replay on the inputs "
                               f"plait recorded ({type(err).__name__}: {_line(err)}), so its "
                               "split cannot be checked (parallelize(..., check=False) skips "
                               "the check)") from None
            try:
                outs = self._ranks(attrs, grad=False)
            except Exception as err:  # noqa: BLE001 - what fails here fails on the ranks
                return float("inf"), f"{type(err).__name__}: {_line(err)}"
        return max(relative_error(first_tensor(o), want) for o in outs), ""

    def _ranks(self, attrs: dict, grad: bool, detach_cols: bool = False, boxes=None):
        """Every rank's output: passes until the row-parallel sums settle (rows may feed rows)."""
        totals: dict = {}
        outs = []
        for _ in range(len(self.dim.rows) + 1):
            partials: dict = {}
            mods = [self._rank_module(r, attrs, totals, partials, detach_cols,
                                      None if boxes is None else boxes[r])
                    for r in range(self.world)]
            self.inputs: list = []
            outs = [self._run(m, self.inputs) for m in mods]
            totals = {p: sum(parts[r] for r in range(self.world)).detach()
                      for p, parts in partials.items()}
            self.mods = mods
        return outs

    def gradients(self, attrs: dict) -> dict[str, tuple]:
        """Per parameter of the module outside the split linears, and for its input (``""``):
        (the reference's gradient from the paths after the split, the whole reference
        gradient, each rank's)."""
        split = {p[len(self.dim.name) + 1 if self.dim.name else 0:] for p in
                 self.dim.cols + self.dim.rows} | set(self.dim.local)
        names = [n for n, p in self.module.named_parameters()
                 if p.requires_grad and not any(n == s or n.startswith(s + ".") for s in split)]
        with torch.no_grad():
            want = first_tensor(self._run(self._reference(False)))
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1),
                        dtype=want.dtype)
        ref_all = _grads(self._reference(False), self, g, names)
        ref_after = _grads(self._reference(True), self, g, names)
        boxes = [{"seen": None, "total": None} for _ in range(self.world)]
        for sweep in range(2 if self.dim.tails else 1):  # 1st: each rank's rotary-key gradient
            outs = self._ranks(attrs, grad=True, detach_cols=True, boxes=boxes)
            per_rank = [_grads_of(m, out, x, g, names)
                        for m, out, x in zip(self.mods, outs, self.inputs)]
            if self.dim.tails and sweep == 0:
                total = sum(b["seen"] for b in boxes)  # the all-reduce of plait's hook
                for b in boxes:
                    b["total"] = total
        return {n: (ref_after[n], ref_all[n], [r[n] for r in per_rank]) for n in ref_all}


class _TailSum(torch.autograd.Function):
    """The simulated ranks' ``sum_tail_grad``: first pass, keep this rank's gradient of the
    last ``tail`` features; second pass, replace it by the sum over the ranks."""

    @staticmethod
    def forward(ctx, x, tail, box):
        ctx.tail, ctx.box = tail, box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad, box = grad.clone(), ctx.box
        if box["total"] is None:
            box["seen"] = grad[..., -ctx.tail:].clone()
        else:
            grad[..., -ctx.tail:] = box["total"]
        return grad, None, None


def _grads(m: nn.Module, sim: _Sim, g: torch.Tensor, names: list[str]) -> dict:
    track: list = []
    out = sim._run(m, track)
    return _grads_of(m, out, track[0], g, names)


def _grads_of(m: nn.Module, out, x, g: torch.Tensor, names: list[str]) -> dict:
    """The gradients of ``names`` (and of the input ``x``, as ``""``) for output gradient g."""
    params = dict(m.named_parameters())
    wrt = [params[n] for n in names] + ([x] if x is not None else [])
    got = torch.autograd.grad(first_tensor(out), wrt, g, allow_unused=True)
    return dict(zip(names + ([""] if x is not None else []), got))


def _row_hook(path, rank, totals, partials, bias):
    def hook(mod, args, out):
        partials.setdefault(path, {})[rank] = out
        if path not in totals:
            return out if bias is None else out + bias
        total = totals[path] + (0 if bias is None else bias.detach())
        return total + (out - out.detach())  # the all-reduce's backward: the same gradient
    return hook


def _local_linear(full: nn.Linear, dim: Dim, path: str, rank: int) -> nn.Linear:
    """The plain linear rank ``rank`` computes for ``path``: its share of the weight (and of a
    column layer's bias; a row layer's bias is added once, after the sum)."""
    cut = dim.cuts[path]
    w, b = full.weight.detach(), None if full.bias is None else full.bias.detach()
    if path in dim.rows:
        w_r = shard_of(w, dim.plan, rank, 1, unit=cut.unit)
        b_r = None
    else:
        if cut.copies > 1:
            heads = w.shape[0] // cut.unit
            index = torch.arange(heads).repeat_interleave(cut.copies)
            rows = (index[:, None] * cut.unit + torch.arange(cut.unit)).reshape(-1)
            w = w.index_select(0, rows)
            b = None if b is None else b.index_select(0, rows)
        w_r = shard_of(w, dim.plan, rank, 0, blocks=cut.blocks, unit=cut.unit)
        b_r = None if b is None else shard_of(b, dim.plan, rank, 0, blocks=cut.blocks,
                                               unit=cut.unit)
    local = nn.Linear(w_r.shape[1], w_r.shape[0], bias=b_r is not None, dtype=w_r.dtype)
    with torch.no_grad():
        local.weight.copy_(w_r)
        if b_r is not None:
            local.bias.copy_(b_r)
    return local


def _set(root: nn.Module, rel: str, module: nn.Module) -> None:
    parent, _, name = rel.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


def _line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text[:160] if text else type(err).__name__


# ------------------------------------------------------------------ the checks
def _fused(dim: Dim) -> list[str]:
    return [p for p in dim.cols if dim.cuts[p].blocks > 1]


def _layouts(dim: Dim):
    """(name, apply) for each way of reading the fused column layers: as dims found them
    (blocks of heads or columns), then each unit's blocks together ([q k v] per head)."""
    fused = _fused(dim)
    yield "blocked", lambda: None
    if fused:
        saved = {p: (dim.cuts[p].blocks, dim.cuts[p].unit) for p in fused}

        def interleave():
            for p in fused:
                blocks, unit = saved[p]
                dim.cuts[p].blocks, dim.cuts[p].unit = 1, blocks * unit
        yield "interleaved", interleave

        def restore():
            for p in fused:
                dim.cuts[p].blocks, dim.cuts[p].unit = saved[p]
        yield None, restore


def _head_attrs(dim: Dim, module: nn.Module, world: int) -> dict[str, list[int]]:
    """The module's head-count attributes, each rank's local count (torchtitan's apply_tp)."""
    if dim.kind != "heads":
        return {}
    n_q, n_kv, _ = dim.heads
    per_unit_q = dim.cuts[dim.rows[0]].unit // dim.heads[2]
    local_kv = list(dim.plan.sizes)  # one K/V head a unit (a copy, under sub-groups)
    local_q = [u * per_unit_q for u in local_kv]
    attrs = {}
    for name in _HEAD_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value == n_q:
            attrs[name] = local_q
        elif value == n_kv:
            attrs[name] = local_kv
    return attrs


def _runs_in(module: nn.Module, captured: tuple, dtype) -> bool:
    """Whether the module's own forward runs in ``dtype`` (a kernel may take no float64)."""
    args, kwargs = to_dtype(captured, dtype)
    try:
        with torch.no_grad():
            copy.deepcopy(module).to(dtype)(*args, **kwargs)
        return True
    except Exception:  # noqa: BLE001
        return False


def dtype_for(module: nn.Module, captured: tuple):
    """float64 where the module runs in it (the comparison is then exact to 1e-6), else its
    own dtype (with that dtype's tolerance)."""
    if _runs_in(module, captured, torch.float64):
        return torch.float64
    return next((p.dtype for p in module.parameters()), torch.float32)


def _fits(dim: Dim, module: nn.Module) -> bool:
    """Whether the dim's plan counts its layers' features (else building the layers refuses
    it, with the sizes)."""
    prefix = dim.name + "." if dim.name else ""
    for path in dim.cols + dim.rows:
        layer, cut = module.get_submodule(path[len(prefix):]), dim.cuts[path]
        length = layer.in_features if path in dim.rows else layer.out_features * cut.copies
        if length != cut.blocks * dim.plan.total * cut.unit:
            return False
    return True


def check_dim(dim: Dim, module: nn.Module, captured: tuple, world: int, verdict: Verdict,
               summed) -> None:
    if not _fits(dim, module):
        return
    sim = _Sim(dim, module, captured, world, dtype_for(module, captured))
    adapt = _head_attrs(dim, module, world)
    tried = []
    chosen = None
    for layout, apply in _layouts(dim):
        apply()
        if layout is None:
            break
        for attrs in ({}, adapt) if adapt else ({},):
            err, why = sim.forward(attrs)
            tried.append((layout, attrs, err, why))
            if err <= sim.tol:
                chosen = (layout, attrs)
                break
        if chosen:
            break
    if chosen is None:
        raise Refused(_why_not(dim, module, tried))
    layout, attrs = chosen
    if attrs:
        verdict.attrs[dim.name] = attrs
        names = ", ".join(attrs)
        verdict.notes.append((dim.name, f"{names} set to this rank's heads (the module views "
                                         "its q/k/v by them)"))
    if layout == "interleaved":
        verdict.notes.append((dim.name, f"{', '.join(_fused(dim) or dim.cols)}: each head's "
                                        "blocks kept together ([q k v] per head)"))
    _check_grads(dim, module, sim, attrs, verdict, summed)


def _why_not(dim: Dim, module: nn.Module, tried: list) -> str:
    layout, attrs, err, why = min(tried, key=lambda t: t[2])
    cls = type(module).__name__
    fused = _fused(dim)
    if why:
        what = f"its forward fails on a rank's share ({why})"
    else:
        what = f"its forward on a rank's share differs from its own by {err:.1e} (relative)"
    hint = ""
    if fused:
        hint = (f"; {', '.join(fused)} is a fused weight read neither as blocks nor per head: "
                "pass shards=/a plan that gathers it (colwise_gather_output) or split q, k, v")
    elif dim.kind == "heads":
        hint = ("; it may normalise or mix all heads together or read a global head count: "
                "give a plan that gathers its q/k/v (colwise_gather_output) or leave it whole")
    by = "heads" if dim.kind == "heads" else "columns"
    return f"{dim.name} ({cls}) cannot be split by {by}: {what}{hint}"


def _check_grads(dim: Dim, module: nn.Module, sim: _Sim, attrs: dict, verdict: Verdict,
                 summed) -> None:
    try:
        grads = sim.gradients(attrs)
    except Exception as err:  # noqa: BLE001
        raise Refused(f"{dim.name}: its backward fails on a rank's share ({_line(err)})") \
            from None
    prefix = dim.name + "." if dim.name else ""
    for name, (after, whole, ranks) in grads.items():
        if whole is None:
            continue
        if name == "":  # the input: the column layers sum what they send back; the rest
            filled = [r if r is not None else torch.zeros_like(whole) for r in ranks]
            want = after if after is not None else torch.zeros_like(whole)
            scale = float(whole.abs().max())
            if not all(relative_error(r, want, scale) <= sim.tol for r in filled):
                raise Refused(f"{dim.name}: its input's gradient through a path outside its "
                               "split linears is not whole on a rank (a replicated layer "
                               "feeding a rank's share of the heads or columns)")
            continue
        zero = lambda t: t is None or float(t.abs().max()) == 0.0  # noqa: E731
        if all(zero(r) for r in ranks) and zero(after):
            continue  # used only before the split: the column layers sum its gradient
        after = after if after is not None else torch.zeros_like(whole)
        filled = [r if r is not None else torch.zeros_like(whole) for r in ranks]
        scale = float(whole.abs().max())
        whole_on_each = all(relative_error(r, after, scale) <= sim.tol for r in filled)
        if whole_on_each and prefix + name not in summed:
            continue  # the part after the split is whole on every rank; before it, too
        if relative_error(sum(filled), after, scale) <= sim.tol:
            if float((whole - after).abs().max()) > sim.tol * scale:
                raise Refused(f"{prefix}{name}: used both before and after the split of "
                               f"{dim.name}: its gradient would be part whole, part a share")
            if prefix + name not in summed:
                verdict.partial.add(prefix + name)
            continue
        if whole_on_each:
            raise Refused(f"{prefix}{name}: the plan sums its gradient over the ranks "
                           "(replicated_with_grad_allreduce), but every rank computes it whole")
        raise Refused(f"{prefix}{name}: its gradient on a rank's share of {dim.name} is "
                       "neither the whole nor a part of it")
