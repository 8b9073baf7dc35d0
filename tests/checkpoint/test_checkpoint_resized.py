"""A checkpoint saved on 3 ranks while uneven *and* ZERO-resized loads under any other layout.

Saved: the float64 GPT of ``_ckpt_gpt`` (10 heads of 4, 160 MLP columns, biases) trained
with AdamW on 3 ranks and moved to heads [3, 5, 2] and columns [48, 80, 32], then resized
as the balancer resizes a slow rank: rank 1 computes 3 of its 5 heads (q, k, v and the
output projection skip the same 2) and 40 of its 80 MLP columns (fc and proj alike), the
features chosen by the layers' priority scores. Two AdamW steps run resized (the skipped
features get no gradient: their moments only decay),
then the checkpoint is saved with the resizing in effect. Loaded into the GPT built from
another seed with a fresh optimizer: in one process (the plain GPT), on 2 ranks and on 4
ranks (even plans), and on a dp 2 × tp 2 mesh under DDP and under FSDP2. Every parameter
and optimizer-state tensor (exp_avg, exp_avg_sq, step), gathered whole, is bit-identical to
the 3-rank model's own tensors gathered at the save.
"""

import pytest
import torch

from plait import checkpoint
from plait.nn.linear_base import select_features
from plait.testing import run_ranks

from _ckpt_gpt import CFG, build, dp_tp, full, plain_full, rank, same, train, trained_uneven
from _ckpt_gpt import whole

# rank 1 (5 heads, 80 columns) keeps 3 heads and 40 columns
KEEP = {1: {"attn": 0.6, "mlp": 0.5}}


def _resize(model):
    """Resize each block's two dims on this rank as the balancer does: the layers of a dim
    keep the same plan units, chosen by their summed priority."""
    for block in model.blocks:
        for dim, layers in (("attn", (block.attn.qkv, block.attn.proj)),
                            ("mlp", (block.mlp.fc, block.mlp.proj))):
            keep = KEEP.get(rank(), {}).get(dim, 1.0)
            if keep == 1.0:
                continue
            score = sum(layer.priority().reshape(-1, layer.unit).sum(dim=1) for layer in layers)
            units = select_features(score, keep, 1)
            for layer in layers:
                kept = (units[:, None] * layer.unit + torch.arange(layer.unit)).reshape(-1)
                layer.resize(keep, kept=kept)


def _save(root):
    model, opt = trained_uneven()
    _resize(model)
    before = full(model, opt)
    train(model, opt, 2)
    keeps = [(b.attn.qkv.keep, b.attn.proj.keep, b.mlp.fc.keep, b.mlp.proj.keep)
             for b in model.blocks]
    checkpoint.Checkpointer(root).save(5, model, opt)
    after = full(model, opt)
    fc = model.blocks[0].mlp.fc
    skipped = [] if fc._kept is None else sorted(set(range(fc.features()))
                                                 - set(fc._kept.tolist()))
    return keeps, skipped, before, after


def _load_tp(root):
    model, opt = build(seed=1)  # other weights: everything must come from the checkpoint
    found = checkpoint.Checkpointer(root).load(model, opt)
    return found.step, found.world_size, full(model, opt)


def _load_4(root):
    """On 4 ranks: tp 4 (even), then dp 2 × tp 2 under DDP and under FSDP2."""
    out = {"tp4": _load_tp(root)[2]}
    for kind in ("ddp", "fsdp"):
        model, opt = dp_tp(kind, seed=1)
        found = checkpoint.Checkpointer(root).load(model, opt)
        assert (found.step, found.world_size) == (5, 3)
        out[kind] = whole(model, opt)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 3-rank launch: (root, every tensor at the save, whole)."""
    root = str(tmp_path_factory.mktemp("resized") / "ckpt")
    results = run_ranks(_save, 3, root)
    keeps = [r[0] for r in results]
    assert keeps[0] == keeps[2] == [(1.0,) * 4] * CFG.n_layer  # ranks 0 and 2 not resized
    assert keeps[1] == [(0.6, 0.6, 0.5, 0.5)] * CFG.n_layer
    _, skipped, before, want = results[0]
    assert results[1][1] and not skipped  # rank 1 skipped MLP columns, rank 0 none
    assert same(before, want) != []  # the resized steps moved the tensors
    return root, want


def test_resized_save_loads_in_one_process(saved):
    root, want = saved
    model, opt = build(seed=1)
    found = checkpoint.load(root, model, opt)
    assert (found.step, found.world_size) == (5, 3)
    assert same(plain_full(model, opt), want) == []


def test_resized_save_loads_on_2_ranks(saved):
    root, want = saved
    for r, (step, world, got) in enumerate(run_ranks(_load_tp, 2, root)):
        assert (step, world) == (5, 3)
        assert same(got, want) == [], r


def test_resized_save_loads_on_4_ranks_and_dp2_tp2(saved):
    root, want = saved
    for r, out in enumerate(run_ranks(_load_4, 4, root, timeout_s=120)):
        for layout, got in out.items():
            assert same(got, want) == [], (layout, r)
