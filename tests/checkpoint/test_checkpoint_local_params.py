"""A checkpoint of a model whose attention has per-head parameters split in place.

transformers' ``local_params`` (granite_swa's attention sinks, one per query head) leaves
each rank its own heads' entries of a parameter that is no linear's. Saved on 2 and 3 ranks
(3: four heads in [2, 1, 1]) through ``plait.checkpoint.Checkpointer`` and read back whole by
``plait.checkpoint.full_tensors``, every tensor equals the plain model's (float64, exact).
Before the layouts knew such a parameter, every rank failed on save (``'_LocalShards'
object has no attribute 'dims'``).
"""

from __future__ import annotations

import pytest
import torch

from plait import checkpoint
from plait.testing import run_ranks

pytest.importorskip("transformers")


def _save(root: str):
    import plait
    from plait.testing.tiny_hf import tiny_model

    model = tiny_model("granite_swa")  # float64, one seed on every rank
    plait.parallelize(model, "auto")
    checkpoint.Checkpointer(root).save(1, model)
    return str(plait.parallel.applied(model))


@pytest.mark.parametrize("world", [2, 3])
def test_per_head_parameters_checkpoint_whole(tmp_path, world):
    from plait.testing.tiny_hf import tiny_model

    root = str(tmp_path / "ckpt")
    told = run_ranks(_save, world, root, timeout_s=120)[0]
    assert "sinks: each rank keeps its heads' entries" in told, told
    got = checkpoint.full_tensors(root)
    want = tiny_model("granite_swa").state_dict()
    sinks = [k for k in want if k.endswith("sinks")]
    assert sinks, "granite_swa's attention has no sinks: the test no longer tests them"
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
