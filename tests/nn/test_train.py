"""``plait train`` end to end on a tiny config: the loss is finite and falls; the report is written."""

import argparse
import json

import pytest

from plait.cli.train import register
from plait.train import TrainConfig, train
from plait.train_report import write_train_report


def _falls(losses, k=3):
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return all(l == l and abs(l) < 1e9 for l in losses) and last < first - 0.01, (first, last)


@pytest.mark.parametrize("model,extra", [
    ("gpt", dict(sequence_parallel=True, plans=("heads=3:1",))),
    ("gpt", dict(microbatches=2, plans=("mlp=96:32",))),
    ("moe", dict(plans=("experts=3:1",))),
    ("dlrm", dict(plans=("tables=5:3",))),
])
def test_train_smoke(model, extra, tmp_path):
    small = dict(n_layer=1, n_head=4, n_embd=32, seq_len=16, batch_size=8, lr=1e-2) \
        if model != "dlrm" else dict(batch_size=512, lr=3e-2)
    cfg = TrainConfig(model=model, steps=12, chunks="2", eval_batches=1, extra={"ranks": 2},
                      **small, **extra)
    result, where = train(cfg, ranks=2)
    ok, means = _falls([r["loss"] for r in result["records"]])
    assert ok, means
    summary = write_train_report(result, cfg, tmp_path, where, wall_s=1.0)
    log = json.loads((tmp_path / "log.json").read_text())
    assert len(log["records"]) == 12 and (tmp_path / "loss.png").stat().st_size > 1000
    assert 0 <= summary["heldout_accuracy"] <= 1 and summary["heldout_loss"] > 0
    assert any("fused" in line for line in summary["operator_paths"]), summary["operator_paths"]


def test_config_from_flags_and_its_errors():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--model", "moe", "--plans", "heads=3:1,experts=1:3",
                              "--no-overlap", "--steps", "5"])
    from plait.cli.args import dataclass_from_args

    cfg = dataclass_from_args(TrainConfig, args)
    assert cfg.steps == 5 and not cfg.overlap and cfg.batch_size == 16
    assert cfg.shard_plans()["experts"].sizes == (1, 3)
    with pytest.raises(ValueError, match="--model must be one of"):
        TrainConfig(model="bert")
    with pytest.raises(ValueError, match="cannot read --plans entry 'heads=3;1'"):
        TrainConfig(plans=("heads=3;1",))
    with pytest.raises(ValueError, match="--steps must be positive"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="sequence-parallel applies to the GPT models"):
        TrainConfig(model="dlrm", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"--plans heads: shard sizes \[4, 0\] leave rank 1 with no heads"):
        train(TrainConfig(plans=("heads=4:0",)), ranks=2)  # refused before any rank starts
    with pytest.raises(ValueError, match="--microbatches 2 applies to --model gpt, fused"):
        TrainConfig(model="moe", microbatches=2)
    with pytest.raises(ValueError, match="--microbatches 2 applies to --model gpt, fused"):
        TrainConfig(microbatches=2, overlap=False)
    with pytest.raises(ValueError, match="does not apply to --model dlrm"):
        TrainConfig(model="dlrm", plans=("heads=2:2",)).check_plans(2)
