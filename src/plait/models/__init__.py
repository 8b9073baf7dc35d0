"""Small models to train here in minutes, single-device and free of parallel code.

``plait.parallel.apply_tp`` makes them parallel. Their sizes (:mod:`.config`) import without
torch; the models load it on first use.
"""

import importlib

_WHERE = {"DLRM": "dlrm", "EmbeddingBagCollection": "dlrm", "GPT": "gpt",
          "MoEFeedForward": "moe", "GPTConfig": "config", "DLRMConfig": "config",
          "moe_gpt_config": "config"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
