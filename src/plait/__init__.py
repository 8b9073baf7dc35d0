"""plait: fused compute–collective operators and heterogeneity-aware tensor parallelism."""

__version__ = "0.1.0"
__all__ = ["__version__"]
