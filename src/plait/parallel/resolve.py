"""From a user's plan to ``{module path: style}`` and ``{kind or path: ShardPlan}``.

A plan is ``"auto"`` (the model's own: transformers' ``base_model_tp_plan`` and
``_tp_plan``, plus ``base_model_ep_plan`` for experts; plait's models their
``apply_tp`` plan) or a dict of module path → style. A path may hold ``*``
wildcards, each matching one path component (``"model.layers.*.mlp.up_proj"``),
or name a parameter (transformers' ``"…experts.gate_up_proj": "grouped_gemm"``:
its module's experts). A ``ShardPlan`` value in the plan is an uneven share for
the dim at that path or of that kind (``"heads"``, ``"mlp"``, ``"experts"``,
``"vocab"``, ``"columns"``, ``"seq"``, ``"tables"``, ``"batch"``), as
``shards=`` gives them.

Pure: the module tree in, paths and styles out. Every error names the entry.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Mapping

import torch.nn as nn

from ..plan import ShardPlan
from .styles import HF_PARAM_STYLES, ExpertsEP, ExpertsTP, LocalParams, Style, to_style

__all__ = ["KINDS", "auto_plan", "expand", "split_shards", "match"]

log = logging.getLogger("plait.parallel")

KINDS = ("heads", "mlp", "experts", "vocab", "columns", "seq", "tables", "batch")


def match(pattern: str, path: str) -> bool:
    """Whether ``path`` matches ``pattern``, component by component (``*`` is one component
    or a part of one, as in fnmatch)."""
    a, b = pattern.split("."), path.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(y, x) for x, y in zip(a, b))


def auto_plan(model: nn.Module) -> dict[str, Any]:
    """The model's own plan, every path from the model's root."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    own = getattr(model, "_tp_plan", None)
    if base is None and not own:
        from .own_plan import plait_plan

        plan = plait_plan(model)
        if plan is not None:
            return plan
        raise ValueError(f"plan='auto': {type(model).__name__} has no tensor-parallel plan of its "
                         "own (transformers' config.base_model_tp_plan or model._tp_plan); give a "
                         "plan: {module path: ColwiseParallel() | RowwiseParallel() | "
                         "'colwise' …}")
    modules = dict(model.named_modules())
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and prefix in modules else ""
    plan: dict[str, Any] = {}
    for key, style in (base or {}).items():
        plan[prefix + key] = style
    for key, style in (getattr(config, "base_model_ep_plan", None) or {}).items():
        plan.setdefault(prefix + key, style)
    plan.update(own or {})
    return plan


def split_shards(plan: Mapping[str, Any], shards: Mapping[str, ShardPlan] | None
                 ) -> tuple[dict[str, Any], dict[str, ShardPlan]]:
    """Styles and ShardPlans apart (a ShardPlan given both ways is refused)."""
    styles, out = {}, dict(shards or {})
    for key, value in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"plan keys are module paths, got {key!r}")
        if isinstance(value, ShardPlan):
            if key in out:
                raise ValueError(f"a ShardPlan for {key!r} is given both in plan and in shards")
            out[key] = value
        else:
            styles[key] = value
    bad = {k: type(v).__name__ for k, v in out.items() if not isinstance(v, ShardPlan)}
    if bad:
        raise TypeError(f"shards must be ShardPlan values, got {bad}")
    return styles, out


def expand(model: nn.Module, plan: Mapping[str, Any], *, strict: bool = True
           ) -> dict[str, Style]:
    """``{module path: style}`` for every module a plan entry matches."""
    modules = dict(model.named_modules())
    params = {name for name, _ in model.named_parameters()}
    found: dict[str, tuple[Style, str]] = {}
    param_styles: dict[str, tuple[str, str]] = {}  # owner module → (HF style, entry)
    for key, value in plan.items():
        hits = [p for p in modules if match(key, p)]
        if not hits:
            owners = sorted({p.rpartition(".")[0] for p in params if match(key, p)})
            if owners and isinstance(value, str) and value in HF_PARAM_STYLES:
                for owner in owners:
                    param_styles.setdefault(owner, (value, key))
                continue
            what = f"plan entry {key!r} ({value!r}) matches no module of {type(model).__name__}"
            if strict:
                near = [p for p in modules if p.split(".")[-1] == key.split(".")[-1]][:3]
                named = f" (modules of that name: {', '.join(near)})" if near else ""
                raise ValueError(what + named)
            log.info("%s; skipped", what)
            continue
        style = to_style(value, key)
        for path in hits:
            if path in found and found[path][0] != style:
                raise ValueError(f"{path} is matched by plan entries {found[path][1]!r} and "
                                 f"{key!r} with different styles")
            found[path] = (style, key)
    for owner, (value, key) in param_styles.items():
        if owner in found:
            if not isinstance(found[owner][0], (ExpertsEP, ExpertsTP, LocalParams)):
                raise ValueError(f"plan entry {key!r} ({value!r}) splits a parameter of {owner}, "
                                 f"whose own style {found[owner][0]} splits no parameter of its "
                                 "own (experts, local_params)")
            continue  # the module's own style (experts, local_params) splits its parameters
        if value != "grouped_gemm":
            raise ValueError(f"plan entry {key!r}: {value!r} on a parameter is supported only "
                             "inside an experts module with its own style (moe_tp_experts, "
                             "ep_dispatch_experts)")
        found[owner] = (ExpertsEP(), key)
    return {path: style for path, (style, _) in found.items()}


def check_shards(shards: Mapping[str, ShardPlan], used: set[str], model: nn.Module) -> None:
    """Every ShardPlan must name a kind or match a module that was split."""
    paths = [p for p, _ in model.named_modules()]
    unknown = sorted(k for k in shards if k not in KINDS and k not in used
                     and not any(match(k, p) for p in paths))
    if unknown:
        raise ValueError(f"shards {unknown} name neither a kind ({', '.join(KINDS)}) nor a "
                         "module of the model")
    unused = sorted(k for k in shards if k not in KINDS and k not in used)
    if unused:
        raise ValueError(f"shards {unused} name modules that no plan entry splits")


def shard_for(shards: Mapping[str, ShardPlan], used: set[str], names, kind: str
              ) -> ShardPlan | None:
    """The ShardPlan for the first of ``names`` (paths) a shards key matches, else ``kind``'s."""
    for name in names:
        for key, plan in shards.items():
            if key not in KINDS and match(key, name):
                used.add(key)
                return plan
    return shards.get(kind)
