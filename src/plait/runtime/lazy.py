"""A package's names loaded on first use (PEP 562), so ``plait``'s command line parses its
flags without importing torch (seconds) while ``from plait.runtime import launch`` still
works as an eager import would."""

from __future__ import annotations

import importlib
import sys
import types

__all__ = ["exports"]


def exports(package: str, where: dict[str, tuple[str, ...]]):
    """(``__getattr__``, ``__all__``) for ``package``: each name of ``where[module]`` comes
    from ``package.module`` when first read, then stays in the package's namespace.

    A name that is also its module's (``runtime.launch.launch``) keeps meaning the name, as
    after an eager ``from .launch import launch``: importing the submodule would otherwise
    set the package's attribute to the module."""
    module_of = {name: module for module, names in where.items() for name in names}

    def __getattr__(name: str):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    clashing = {name for name, module in module_of.items() if name == module}
    if clashing:
        sys.modules[package].__class__ = _keeping(clashing)
    return __getattr__, list(module_of)


def _keeping(names: set[str]) -> type:
    class Package(types.ModuleType):
        def __setattr__(self, name, value):
            if name in names and isinstance(value, types.ModuleType):
                value = getattr(value, name)  # the submodule's own name, not the submodule
            super().__setattr__(name, value)

    return Package
