"""Fused compute–collective operators (autograd-aware) and their chunk schedule.

Each operator returns what compute-then-collective returns, while each piece
of its result goes onto the wire as soon as it is computed. ``chunks="auto"``
lets the calibrated cost model choose the piece count or fall back to the
plain path; ``explain()`` says which path ran and why.
"""

from .context import Decision, OpsContext, explain, get_context
from .embedding import embedding_all_to_all
from .matmul_all_reduce import column_parallel_matmul, matmul_all_reduce
from .moe import all_to_all_matmul, matmul_all_to_all
from .sequence_parallel import all_gather_matmul, matmul_reduce_scatter

__all__ = [
    "Decision", "OpsContext", "explain", "get_context",
    "matmul_all_reduce", "column_parallel_matmul",
    "all_gather_matmul", "matmul_reduce_scatter",
    "embedding_all_to_all", "all_to_all_matmul", "matmul_all_to_all",
]
