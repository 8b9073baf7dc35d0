"""The layers of plait's code (docs/design.md): data flows down, never up, and no circle.

Every import in ``src/plait`` (at the top of a module or inside a function: a lazy import
is an arrow too) is read from the source, without importing anything. A package may import
its own modules and the packages of the layers below its own, never a sibling of its own
layer nor anything above; ``models`` imports ``nn`` only. Nothing imports ``bench`` or
``cli`` but the command line. No module reaches itself again through the modules it imports.

The package root (``plait/__init__.py``) is the public surface: it imports nothing as it
loads (its names load on first use), so importing it (``plait.__version__``) is no arrow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "plait"

LAYERS: list[set[str]] = [
    {"__main__"},              # python -m plait
    {"cli"},                   # the command line
    {"bench", "elastic", "testing"},  # benchmarks, the elastic launcher; the test harnesses
    {"training", "inference"},  # THE training loop, its config, data, resume, report; decoding
    {"checkpoint"},            # DCP save/load, loading checkpoints slice by slice
    {"parallel"},              # parallelize(model, plan), apply_tp, data parallelism
    {"balance", "models"},     # the balancer; small models with no parallel code
    {"nn"},                    # layers that hold parameters
    {"ops"},                   # fused operators
    {"transport"},             # how bytes move
    {"perf"},                  # hardware catalog, cost model, simulator (pure)
    {"runtime", "plan"},       # process groups, launch, watchdog; the ShardPlan value
]
"""Top to bottom. A package may import packages of strictly lower layers."""

ONLY = {"models": {"nn"}}
"""Packages held to fewer than their layer allows (models carry no parallel code)."""

KNOWN_CYCLES: list[set[str]] = []
"""Cycles known and owned elsewhere; each must still exist (a fixed one is taken out)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module imported, line) for every import of plait in ``path``; ``from pkg import x``
    names the module ``pkg.x`` where that is a module."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "plait"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "plait":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            out += [(t, node.lineno) for t in subs]
            if len(subs) < len(node.names):
                out.append((target, node.lineno))
    return out


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    known = set(mods)
    return {name: [(t, line) for t, line in imports(path, known) if t != name]
            for name, path in mods.items()}


def package_of(module: str) -> str | None:
    """The top-level package of a plait module (None: the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_of(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"package plait.{package} is in no layer of tests/test_layering.py")


def back_arrows(edges: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import that goes up a layer, sideways to a sibling package, or past ``ONLY``."""
    out = []
    for source, targets in sorted(edges.items()):
        a = package_of(source)
        for target, line in targets:
            b = package_of(target)
            if a is None or b is None or a == b:
                continue  # the root's lazy surface; a package's own modules
            allowed = layer_of(b) > layer_of(a) and b in ONLY.get(a, {b})
            if not allowed:
                out.append(f"{source}:{line} imports {target} ({a} may not import {b})")
    return out


def cycles(edges: dict[str, list[tuple[str, int]]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm),
    the package root left out (it loads nothing as it is imported)."""
    nodes = [n for n in edges if n != "plait"]
    succ = {n: sorted({t for t, _ in edges[n] if t in edges and t != "plait"}) for n in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for node in nodes:
        if node not in index:
            visit(node)
    return found


def test_every_package_has_a_layer_and_the_root_holds_no_module():
    packages = {package_of(m) for m in modules()} - {None}
    for package in packages:
        layer_of(package)
    loose = sorted(p.name for p in SRC.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], loose


def test_data_flows_down_the_layers():
    assert back_arrows(graph()) == []


def test_no_module_imports_itself_back():
    found = cycles(graph())
    unknown = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert unknown == []
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert gone == [], "a known cycle is gone: take it out of KNOWN_CYCLES"


def test_the_package_root_imports_nothing_as_it_loads():
    tree = ast.parse((SRC / "__init__.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert top == []


@pytest.mark.parametrize("source,target", [
    ("plait.nn.linear", "plait.parallel.apply"),         # a layer reaching up
    ("plait.training.run", "plait.bench.placement"),     # the library importing bench
    ("plait.balance.policy", "plait.models.gpt"),        # siblings of one layer
    ("plait.models.gpt", "plait.ops.pieces"),            # models import nn only
    ("plait.checkpoint.store", "plait.cli.main"),        # anything importing the CLI
])
def test_a_back_arrow_is_caught(source, target):
    edges = graph()
    edges[source] = edges[source] + [(target, 1)]
    assert back_arrows(edges) == [f"{source}:1 imports {target} ({package_of(source)} may not "
                                  f"import {package_of(target)})"]


def test_a_circle_is_caught():
    edges = graph()
    edges["plait.runtime.dist"] = edges["plait.runtime.dist"] + [("plait.runtime.launch", 1)]
    assert {"plait.runtime.dist", "plait.runtime.launch"} <= set().union(
        *[c for c in cycles(edges) if c not in KNOWN_CYCLES])
