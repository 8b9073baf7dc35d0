"""``plait.parallelize(model, plan)``: any PyTorch or transformers model on plait's layers.

    import plait
    from plait.runtime import init_from_env

    init_from_env()                                  # under torchrun
    model = plait.parallelize(model, plan="auto")    # the model's own plan (transformers)
    model = plait.parallelize(model, {               # or PyTorch's vocabulary
        "model.layers.*.self_attn.q_proj": ColwiseParallel(), ...,
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    }, shards={"heads": ShardPlan((3, 1))})          # uneven shares where wanted

The plan's vocabulary (PyTorch's styles, transformers' strings, plait's own) is
in :mod:`plait.parallel.styles`; how column/row pairs and attention heads are
found, in :mod:`plait.parallel.dims`; the extra layers, in
:mod:`plait.parallel.layers` and :mod:`plait.parallel.experts`; data parallelism
around the tensor parallelism on a ``dp × tp`` mesh, in :mod:`plait.parallel.data`:

    mesh = plait.parallel.dp_tp_mesh(dp=2, tp=2)         # tp groups [0, 1], [2, 3]
    model = plait.parallelize(model, "auto", mesh=mesh)   # TP on "tp", PyTorch's DP on "dp"

plait's own models (``plait.models``) are made parallel by their shape in
:mod:`plait.parallel.own_models` (``apply_tp``); the plain state_dict comes back from any
of them through :mod:`plait.parallel.full_state` (``full_state_dict``).
"""

from .apply import applied, parallelize
from .data import (MeshLayout, check_replicas, choose_kind, data_parallel, dp_tp_mesh,
                   replica_mismatch, replica_signature, unsharded)
from .full_state import full_state_dict
from .own_models import apply_tp, parallelize_dlrm, parallelize_gpt
from .styles import (BatchParallel, Colwise, ExpertsEP, ExpertsTP, PlaitMoE,
                     Prepare, Replicated, Rowwise, SequenceParallel, TableParallel, VocabParallel)

__all__ = ["parallelize", "applied", "full_state_dict", "apply_tp", "parallelize_gpt",
           "parallelize_dlrm", "Colwise", "Rowwise", "VocabParallel",
           "SequenceParallel", "Prepare", "Replicated", "ExpertsTP",
           "ExpertsEP", "PlaitMoE", "TableParallel", "BatchParallel",
           "MeshLayout", "dp_tp_mesh", "data_parallel", "choose_kind", "unsharded",
           "check_replicas", "replica_signature", "replica_mismatch"]
