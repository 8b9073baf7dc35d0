"""A transformers checkpoint's tensors under the names the model holds them by.

transformers 5 keeps some tensors in another form on disk than in the model: Mixtral's
experts are saved one by one (``block_sparse_moe.experts.3.w1.weight``) and held fused
(``mlp.experts.gate_up_proj`` [E, 2F, H]). Its own loader renames and merges them by the
model's conversion mapping (``transformers.conversion_mapping``); this module reads that
same mapping and builds, for each name the model holds, a source that reads the pieces
without merging the whole: a rename is the file's tensor itself; ``MergeModulelist`` is a
:class:`~plait.checkpoint.sources.Stacked` of the per-expert tensors, ``Concatenate`` a
:class:`~plait.checkpoint.sources.Joined` of those. A conversion made of other operations
(a transpose, a permutation for rotary) is refused where the model needs it, naming the
tensor and the operation: plait reads slices of what it can describe, and never guesses.
With a transformers that has no conversion mapping (4.x), names are taken as they are.
"""

from __future__ import annotations

from .sources import Joined, Stacked

__all__ = ["named_sources", "Unsupported"]


class Unsupported:
    """A model tensor the checkpoint holds in a form plait does not read by slices."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why


def named_sources(model, store) -> dict[str, object]:
    """``{name in model.state_dict(): source}`` for every tensor of ``store`` (a
    :class:`~plait.checkpoint.sources.SafetensorsDir`)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (Concatenate, MergeModulelist,
                                                     WeightConverter, dot_natural_key,
                                                     rename_source_key)
    except ImportError:
        return {name: store.leaf(name) for name in store.keys()}
    if not hasattr(model, "base_model_prefix"):  # not a transformers model: its own names
        return {name: store.leaf(name) for name in store.keys()}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    held = model.state_dict()  # names only (a meta model's tensors hold no data)
    out: dict[str, object] = {}
    merged: dict[str, dict[str, list[str]]] = {}  # target → source pattern → checkpoint names
    for name in store.keys():
        target, pattern = rename_source_key(name, renamings, converters,
                                            model.base_model_prefix, held)
        if pattern is None:
            out[target] = store.leaf(name)
        else:
            merged.setdefault(target, {}).setdefault(pattern, []).append(name)
    for target, by_pattern in merged.items():
        converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
        lists = [[store.leaf(n) for n in sorted(by_pattern[p], key=dot_natural_key)]
                 for p in converter.source_patterns if p in by_pattern]
        out[target] = _converted(target, lists, converter.operations,
                                 (MergeModulelist, Concatenate))
    return out


def _converted(target: str, lists: list[list], operations, known) -> object:
    """The source for ``operations`` applied to ``lists`` (one list of tensors per source
    pattern, in the converter's order), or :class:`Unsupported`."""
    merge, concat = known
    names = [type(op).__name__ for op in operations]
    parts: list = [p if len(p) > 1 else p[0] for p in lists]
    stacked = False
    for op in operations:
        if isinstance(op, merge) and not stacked:
            parts = [Stacked(p if isinstance(p, list) else [p], op.dim) for p in parts]
            stacked = True
        elif isinstance(op, concat) and len(parts) > 1:
            parts = [Joined(parts, op.dim)]
        else:
            return Unsupported(target, f"its checkpoint form is converted by {' then '.join(names)}"
                                       ", which plait's sharded loader does not read by slices")
    if len(parts) != 1:
        return Unsupported(target, f"{len(parts)} tensors are left after {' then '.join(names)}")
    return parts[0]
