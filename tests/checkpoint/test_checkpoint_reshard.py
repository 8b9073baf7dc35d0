"""A checkpoint saved on 3 ranks with uneven shards loads under any other plan and world size.

Saved: a float64 GPT (10 heads of 4, 160 MLP columns, biases) trained with AdamW on 3 ranks,
moved at run time from the even plans to heads [3, 5, 2] and columns [48, 80, 32] (a fused
QKV weight's rank shard is three disjoint row ranges, a row-parallel weight's a column
range), then trained on. Loaded into a model built from another seed with a fresh
optimizer: on 2 ranks (even plans), on 4 ranks (even), and in one process (the plain
GPT). Every parameter and optimizer-state tensor (exp_avg, exp_avg_sq, step), compared
whole, is bit-identical to what was saved; so are the caller's extra and per-rank state.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from plait import checkpoint
from plait.testing import run_ranks

from _ckpt_gpt import build, full, plain_full, rank, same, trained_uneven


def _save(root):
    model, opt = trained_uneven()
    ckpt = checkpoint.Checkpointer(root)
    path = ckpt.save(3, model, opt, {"data_position": 12, "lr": [0.1, 0.2]},
                     rank_state={"rng": torch.get_rng_state(), "rank": rank()})
    checkpoint.export(model, Path(root) / "live.safetensors")  # gathered, rank 0 writes
    sizes = list(model.blocks[0].attn.qkv.plan.sizes), list(model.blocks[1].mlp.fc.plan.sizes)
    return str(path), sizes, full(model, opt)


def _load(root):
    model, opt = build(seed=1)  # other weights: everything must come from the checkpoint
    found = checkpoint.Checkpointer(root).load(model, opt)
    return (found.step, found.extra_state, found.rank_state, found.plans["blocks.0.attn.qkv"],
            list(model.blocks[0].attn.qkv.plan.sizes), full(model, opt))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 3-rank launch: (root, every tensor saved, whole)."""
    root = str(tmp_path_factory.mktemp("uneven") / "ckpt")
    path, sizes, want = run_ranks(_save, 3, root)[0]
    assert sizes == ([3, 5, 2], [48, 80, 32])
    assert path.endswith("step-3")
    return root, want


@pytest.mark.parametrize("world", [2, 4])
def test_saved_uneven_on_3_ranks_loads_on_other_world_sizes(saved, world):
    root, want = saved
    for r, (step, extra, mine, plan, now, got) in enumerate(run_ranks(_load, world, root)):
        assert (step, extra, plan) == (3, {"data_position": 12, "lr": [0.1, 0.2]}, [3, 5, 2])
        assert len(now) == world
        assert same(got, want) == [], (world, r)
        # rank r's own state where rank r saved one, None past the saving world
        assert (mine or {}).get("rank") == (r if r < 3 else None), (world, r)


def test_saved_uneven_on_3_ranks_loads_into_the_plain_model_and_exports(saved, tmp_path):
    root, want = saved
    model, opt = build(seed=1)  # this process: no torch.distributed, the plain GPT
    found = checkpoint.load(root, model, opt)
    assert found.step == 3 and found.world_size == 3
    assert same(plain_full(model, opt), want) == []
    assert any(k.endswith("exp_avg_sq") for k in want) and any(k.endswith(".step") for k in want)
    # export: from the live 3-rank model and from the checkpoint, one file each, that the
    # plain GPT loads with load_state_dict (strict)
    exported = checkpoint.export(root, tmp_path / "from-dir.pt")
    for state in (load_file(Path(root) / "live.safetensors"), torch.load(exported)):
        plain, _ = build(seed=2)
        plain.load_state_dict(state)
        params = dict(plain.named_parameters())
        assert [k for k in params if not torch.equal(params[k], want[k])] == []
