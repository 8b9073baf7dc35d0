"""Column/row pairs from a plan and the module tree, and how their shared dim is split.

A *dim* is what one ``ShardPlan`` splits: the column-parallel layers under one
parent module and the row-parallel layers that read their outputs (attention:
q/k/v and o; an MLP: gate/up and down). The plan counts:

- attention (the parent has an integer ``head_dim``, ``head_size`` or
  ``attention_head_size``): **KV-head groups**, each one
  K/V head and the ``g = heads / kv_heads`` query heads that read it, so every
  rank keeps the model's grouping (local q heads / local kv heads = g, which
  ``repeat_kv`` and SDPA's ``enable_gqa`` assume). Groups need not divide by the
  ranks: 3 groups on 2 ranks are [2, 1]. Where there are fewer KV heads than
  ranks, a group is cut into ``m`` sub-groups of ``g / m`` query heads, each with
  its own copy of the K/V head (transformers' unit_colwise does the same by
  replication); the plan then counts sub-groups (``kv_heads · m`` units), the
  copies' gradients are summed, and the attention module's
  ``num_key_value_groups`` becomes ``g / m``. A fused QKV weight (plait's GPT)
  is 3 blocks of heads.
- an MLP: the columns of the hidden dim (gate and up alike; a packed [gate | up]
  weight is 2 blocks).
- a lone column- or row-parallel layer: its own features (an LM head's vocabulary).

Pure: module sizes in, a :class:`Dim` out; nothing here talks to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.tensor import Replicate

from ..plan import ShardPlan, head_split
from .styles import Colwise, Rowwise

__all__ = ["Dim", "LayerCut", "find_dims", "head_split", "resolve_plan_for"]


@dataclass
class LayerCut:
    """How one linear layer of a dim is cut: ``unit`` features per plan unit, ``blocks``
    equal blocks along its split dim, ``copies``: each K/V head repeated that many times."""

    unit: int
    blocks: int = 1
    copies: int = 1


@dataclass
class Dim:
    name: str                      # the parent module's path (the balancer's dim name)
    kind: str                      # "heads", "mlp" or "columns"
    cols: list[str]
    rows: list[str]
    units: int = 0                 # units the plan must count (the default)
    cuts: dict[str, LayerCut] = field(default_factory=dict)
    heads: tuple[int, int, int] | None = None  # (q heads, kv heads, head_dim)
    plan: ShardPlan | None = None
    given: bool = False            # the plan came from shards= (not the even default)
    groups_local: int | None = None  # q heads per K/V head on every rank, when it changes
    note: str = ""
    local: dict[str, int] = field(default_factory=dict)  # per-head parameter → q heads a unit
    needs_check: str = ""          # a reading of the layers only the one-batch check confirms
    tails: dict[str, int] = field(default_factory=dict)  # whole linear → rotary-key features


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def find_dims(linears: dict[str, tuple[object, object]], modules: dict) -> list[Dim]:
    """Group ``{path: (style, nn.Linear)}`` (Colwise/Rowwise entries) into dims."""
    by_parent: dict[str, tuple[list[str], list[str]]] = {}
    for path, (style, _) in linears.items():
        cols, rows = by_parent.setdefault(_parent(path), ([], []))
        paired = (isinstance(style, Colwise) and style.output != Replicate()) or \
                 (isinstance(style, Rowwise) and style.input != Replicate())
        if not paired:  # gathers its output or cuts its input itself: a dim of its own
            by_parent[path] = ([path], []) if isinstance(style, Colwise) else ([], [path])
            continue
        (cols if isinstance(style, Colwise) else rows).append(path)
    dims = []
    for parent, (cols, rows) in by_parent.items():
        if not cols and not rows:
            continue
        layer = {p: linears[p][1] for p in cols + rows}
        head_dim = _head_dim(modules.get(parent))
        per_head = _per_head_widths(modules.get(parent), cols, rows, layer, linears)
        if head_dim is not None and cols and rows:
            dims.append(_attention(parent, cols, rows, layer, head_dim, linears))
        elif per_head is not None:
            dims.append(_latent_attention(parent, cols, rows, *per_head))
        else:
            dims.append(_columns(parent, cols, rows, layer, linears))
    return dims


def _per_head_widths(module, cols, rows, layer, linears):
    """(heads, {path: width a head}) where the module names a head count but no one head
    width, and every layer holds whole heads of its own width (multi-head latent attention:
    q of qk_head_dim, k/v of nope + v_head_dim, o of v_head_dim a head); else None."""
    if not (cols and rows) or any(linears[c][0].blocks not in (None, 1) for c in cols):
        return None
    heads = next((v for v in (getattr(module, n, None) for n in
                              ("num_heads", "num_attention_heads", "n_heads"))
                  if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
    if heads is None:
        return None
    widths = {c: divmod(layer[c].out_features, heads) for c in cols}
    widths.update({r: divmod(layer[r].in_features, heads) for r in rows})
    if any(rest or not w for w, rest in widths.values()):
        return None
    return heads, {p: w for p, (w, _) in widths.items()}


def _latent_attention(parent, cols, rows, heads: int, widths: dict[str, int]) -> Dim:
    """Attention whose layers each hold ``heads`` heads of their own width: the plan counts
    heads, every layer is cut by whole heads of its width (multi-head attention: no groups)."""
    width = widths[rows[0]]
    dim = Dim(parent, "heads", cols, rows, units=heads, heads=(heads, heads, width))
    for path in cols + rows:
        dim.cuts[path] = LayerCut(unit=widths[path])
    return dim


def _head_dim(module) -> int | None:
    """The attention module's head width, by the names models give it."""
    for name in ("head_dim", "head_size", "attention_head_size"):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _attention(parent, cols, rows, layer, hd, linears) -> Dim:
    ins = {layer[r].in_features for r in rows}
    if len(ins) != 1 or next(iter(ins)) % hd:
        raise ValueError(f"{parent}: the row-parallel {', '.join(rows)} read "
                         f"{sorted(ins)} features, not one count of whole heads of {hd}")
    n_q = next(iter(ins)) // hd
    n_kv, cuts, blocks = n_q, {}, {}
    for c in cols:
        out = layer[c].out_features
        heads, rest = divmod(out, hd)
        if rest:
            raise ValueError(f"{c}: {out} output features are not whole heads of head_dim {hd}")
        fixed = linears[c][0].blocks
        if fixed is not None or (heads % n_q == 0 and heads > n_q):
            b = fixed or heads // n_q
            if heads != b * n_q:
                raise ValueError(f"{c}: {heads} heads are not {b} blocks of the {n_q} heads "
                                 f"{', '.join(rows)} reads")
            blocks[c] = b
        elif heads == n_q:
            blocks[c] = 1
        elif n_q % heads == 0:
            if n_kv not in (n_q, heads):
                raise ValueError(f"{parent}: key/value projections with {n_kv} and {heads} heads")
            n_kv, blocks[c] = heads, None  # a K/V projection
        else:
            raise ValueError(f"{c}: {heads} heads neither match the {n_q} query heads "
                             f"{', '.join(rows)} reads nor divide them into KV-head groups")
    dim = Dim(parent, "heads", cols, rows, units=n_kv, heads=(n_q, n_kv, hd))
    if n_kv != n_q and any(b not in (None, 1) for b in blocks.values()):
        # b blocks of the query heads (q and a gate, Qwen3-Next) or a packed q/k/v whose
        # K/V blocks happen to sum to whole query blocks: only the check can tell
        dim.needs_check = (f"a packed weight with grouped-query heads ({n_q} q, {n_kv} kv) read "
                           "as blocks of query heads, unchecked; give q, k and v their own "
                           "layers or leave the check on")
    for c in cols:
        dim.cuts[c] = LayerCut(unit=hd) if blocks[c] is None else \
            LayerCut(unit=hd * (n_q // n_kv), blocks=blocks[c])
    for r in rows:
        dim.cuts[r] = LayerCut(unit=hd * (n_q // n_kv))
    return dim


def _columns(parent, cols, rows, layer, linears) -> Dim:
    kind = "mlp" if cols and rows else "columns"
    name = parent if cols and rows else (cols + rows)[0]
    if rows:
        ins = {layer[r].in_features for r in rows}
        if len(ins) != 1:
            raise ValueError(f"{parent}: the row-parallel {', '.join(rows)} read different "
                             f"widths {sorted(ins)}; one plan cannot split them together")
        width = next(iter(ins))
    else:
        width = None
    dim = Dim(name, kind, cols, rows)
    for c in cols:
        out, fixed = layer[c].out_features, linears[c][0].blocks
        w = width if width is not None else out // (fixed or 1)
        b = fixed or (out // w if out % w == 0 else 0)
        if b < 1 or out != b * w:
            raise ValueError(f"{c}: {out} output features are not whole blocks of the {w} "
                             f"features {', '.join(rows) or 'its blocks'} read")
        width = w
        dim.cuts[c] = LayerCut(unit=1, blocks=b)
    for r in rows:
        dim.cuts[r] = LayerCut(unit=1)
    dim.units = width
    return dim


def resolve_plan_for(dim: Dim, plan: ShardPlan | None, world: int) -> None:
    """Fix ``dim.plan`` (the given one or even) and, for attention, the K/V copies."""
    if dim.kind != "heads":
        dim.plan = plan or ShardPlan.even(dim.units, world)
        return
    n_q, n_kv, hd = dim.heads
    try:
        m = head_split(n_q, n_kv, world, None if plan is None else plan.total)
    except ValueError as err:
        raise ValueError(f"{dim.name}: {err}") from None
    dim.plan = plan or ShardPlan.even(n_kv * m, world)
    if m == 1:
        return
    g_local = n_q // n_kv // m
    for path, cut in dim.cuts.items():
        if cut.unit == hd and path in dim.cols and n_kv != n_q:
            cut.copies = m  # a K/V projection: each head copied into its m sub-groups
        else:
            cut.unit = g_local * hd
    dim.groups_local = g_local
    dim.note = (f"{n_kv} KV heads cut into {n_kv * m} sub-groups of {g_local} query heads "
                f"(each K/V head copied {m}×, gradients summed)")
