"""Tensor-, sequence-, expert- and table-parallel layers that hold parameters and call plait.ops.

Every layer takes a partition plan (:class:`plait.plan.ShardPlan`; even by
default), is built ``from_module`` from its single-device twin with identical
weights, and gives the full weights back (``to_module`` / ``full_state_dict``).
Making a whole model parallel with them is :mod:`plait.parallel`'s work
(``plait.parallelize``, and ``plait.parallel.apply_tp`` for plait's own models).
"""

from ..plan import ShardPlan
from .embedding import ShardedEmbeddingBag
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import MoE

__all__ = ["ShardPlan", "ColumnParallelLinear", "RowParallelLinear", "ShardedEmbeddingBag", "MoE",
           "PLAIT_LAYERS"]

PLAIT_LAYERS = (ColumnParallelLinear, RowParallelLinear, ShardedEmbeddingBag, MoE)
"""plait's own layers: each holds its shard and gathers it back (``full_state_dict``)."""
