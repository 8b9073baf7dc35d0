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
:mod:`plait.parallel.layers` and :mod:`plait.parallel.experts`.
"""

from ..nn.parallelize import full_state_dict
from .apply import parallelize
from .styles import (BatchParallel, Colwise, ExpertsEP, ExpertsTP, PlaitMoE,
                     Prepare, Replicated, Rowwise, SequenceParallel, TableParallel, VocabParallel)

__all__ = ["parallelize", "full_state_dict", "Colwise", "Rowwise", "VocabParallel",
           "SequenceParallel", "Prepare", "Replicated", "ExpertsTP",
           "ExpertsEP", "PlaitMoE", "TableParallel", "BatchParallel"]
