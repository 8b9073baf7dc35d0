"""Tensor-, sequence-, expert- and table-parallel layers that hold parameters and call plait.ops.

Every layer takes a partition plan (:class:`plait.plan.ShardPlan`; even by
default), is built ``from_module`` from its single-device twin with identical
weights, and gives the full weights back (``to_module`` / ``full_state_dict``).
"""

from ..plan import ShardPlan
from .embedding import ShardedEmbeddingBag
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import MoE
from .parallelize import apply_tp, full_state_dict, parallelize_dlrm, parallelize_gpt

__all__ = ["ShardPlan", "ColumnParallelLinear", "RowParallelLinear", "ShardedEmbeddingBag", "MoE",
           "apply_tp", "parallelize_gpt", "parallelize_dlrm", "full_state_dict"]
