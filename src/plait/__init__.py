"""plait: fused compute–collective operators and heterogeneity-aware tensor parallelism."""

__version__ = "0.1.0"
__all__ = ["__version__", "parallelize", "full_state_dict", "from_pretrained", "load_shards"]


def __getattr__(name: str):
    # torch loads on first use, not on ``import plait`` (the CLI starts without it)
    if name in ("parallelize", "full_state_dict"):
        from . import parallel

        return getattr(parallel, name)
    if name in ("from_pretrained", "load_shards"):
        from . import checkpoint

        return getattr(checkpoint, name)
    if name in _SUBPACKAGES:  # plait.parallel.dp_tp_mesh after a bare ``import plait``
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


_SUBPACKAGES = ("parallel", "checkpoint", "nn", "ops", "balance", "runtime", "models", "plan",
                "perf")
