"""A checkpoint saved on 3 ranks with uneven shards loads into a dp 2 × tp 2 model, and back.

Saved: the float64 GPT of ``_ckpt_gpt`` (10 heads of 4, 160 MLP columns, biases) trained
with AdamW on 3 ranks under heads [3, 5, 2] and columns [48, 80, 32]. Loaded, in one
4-rank launch, into the same GPT built from another seed, tensor-parallel on each tp group
of ``dp_tp_mesh(2, 2)`` (even plans) and made data-parallel by FSDP2 (parameters and AdamW
moments are DTensors sharded over dp by dim 0: plait's tp pieces cut to each dp rank's
rows) and by DDP (the wrapper's ``.module``): every parameter and optimizer-state tensor,
gathered over dp and tp, is bit-identical to what was saved, on every rank. Each of the
two then trains one step and saves from the 2 × 2 model; the plain model in this process
loads each of those checkpoints bit-identical to the 2 × 2 model's tensors at the save.
DDP's second replica writes none of plait's pieces (they come from ranks 0 and 1's files);
under FSDP2 every rank writes its own part. ``plait.full_state_dict`` of the FSDP2 model
(the export path) equals its gathered parameters.
"""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from plait import checkpoint
from plait.testing import run_ranks

from _ckpt_gpt import build, dp_tp, plain_full, same, train, trained_uneven, whole

KINDS = ("fsdp", "ddp")


def _save3(root):
    model, opt = trained_uneven()
    checkpoint.Checkpointer(root).save(3, model, opt)
    return whole(model, opt)


def _on_2x2(root3, roots):
    """Per kind: (its class, the tensors loaded from the 3-rank checkpoint, the tensors it
    saved after one more step, full_state_dict (FSDP2) or None)."""
    from plait.parallel import full_state_dict
    from plait.training.resume import resharded_line

    out = {}
    for kind in KINDS:
        model, opt = dp_tp(kind, seed=1)  # other weights: all must come from the checkpoint
        found = checkpoint.Checkpointer(root3).load(model, opt)
        assert found.step == 3 and found.world_size == 3
        line = resharded_line(found, model)  # names under the wrap are the plain model's
        assert line.endswith("saved on 3 ranks, resharded onto 4: [3, 5, 2] -> [5, 5] "
                             "(blocks.0.attn.proj, blocks.0.attn.qkv, blocks.1.attn.proj and 1 "
                             "more); [48, 80, 32] -> [80, 80] (blocks.0.mlp.fc, "
                             "blocks.0.mlp.proj, blocks.1.mlp.fc and 1 more)"), (kind, line)
        loaded = whole(model, opt)
        train(model, opt, 1)  # the same batch on both replicas
        checkpoint.Checkpointer(roots[kind]).save(4, model, opt)
        state = full_state_dict(model) if kind == "fsdp" else None
        out[kind] = (type(model).__name__, loaded, whole(model, opt), state)
    return out


def _writers(path, name):
    """The ranks whose files hold the chunks of DCP tensor ``name``."""
    data = FileSystemReader(path).read_metadata().storage_data
    return {int(info.relative_path.split("_")[2]) for index, info in data.items()
            if index.fqn == name}


def test_saved_on_3_ranks_loads_into_dp_tp_and_saves_for_one_process(tmp_path):
    root3 = str(tmp_path / "three")
    want = run_ranks(_save3, 3, root3)[0]
    roots = {kind: str(tmp_path / kind) for kind in KINDS}
    results = run_ranks(_on_2x2, 4, root3, roots, timeout_s=120)
    for r, out in enumerate(results):
        assert {k: v[0] for k, v in out.items()} == {"fsdp": "FSDPGPT",
                                                     "ddp": "DistributedDataParallel"}
        for kind, (_, loaded, _, _) in out.items():
            assert same(loaded, want) == [], (kind, r)
    for kind in KINDS:
        saved = results[0][kind][2]
        assert same(saved, want) != []  # one more step: other numbers
        model, opt = build(seed=2)  # this process: the plain GPT
        found = checkpoint.load(roots[kind], model, opt)
        assert (found.step, found.world_size) == (4, 4)
        assert same(plain_full(model, opt), saved) == [], kind
        step4 = roots[kind] + "/step-4"
        writers = _writers(step4, "model.blocks.0.attn.qkv.weight")
        writers |= _writers(step4, "optim.blocks.1.mlp.proj.weight.exp_avg")
        assert writers == ({0, 1} if kind == "ddp" else {0, 1, 2, 3}), (kind, writers)
    state = results[0]["fsdp"][3]
    params = {k: v for k, v in results[0]["fsdp"][2].items() if k in state}
    assert len(params) == len(dict(build(seed=2)[0].named_parameters()))
    assert [k for k, v in params.items() if not torch.equal(state[k], v)] == []
