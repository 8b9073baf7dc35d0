"""``plait train --balance migrate --slow 1:3`` on 2 ranks: the balancer in the training loop.

One launch, rank 1 computing 3 × slower (runtime straggler emulation), float64 on every
rank, every rank a virtual device (timed by its products' FLOPs, :mod:`plait.testing.virtual`),
so the speeds read (1, 1/3) exactly and when the balancer acts is known. The GPT is trained
without a balancer (``--balance even``), then under ``migrate``: 3 warm-up steps, an exchange
every 2 steps, the window of 5 half full after step 8 and the imbalance confirmed over 3
steps, both dims migrate at step 10 to the plan by speed (heads 3:1, columns 192:64; the
ranks' unmovable times are alike), and nothing else. Each decision is in its step's record,
in the result and in ``log.json``'s summary, and its step is marked on ``loss.png``'s
step-time panel. Migration is exact (weights, gradients and AdamW's state move whole), so
every step's loss equals the even run's within 1e-9 (only the order of a few sums changes
with the shard sizes), the 3 steps after the migration included.
"""

import json
from dataclasses import replace

import pytest
import torch

from plait.balance import static_plan
from plait.runtime import launch, parse_slow
from plait.training.config import TrainConfig
from plait.training.run import train_rank
from plait.training.report import write_train_report

TOL = 1e-9
EVEN = TrainConfig(model="gpt", steps=14, n_layer=1, n_head=4, n_embd=64, seq_len=32,
                   batch_size=8, lr=1e-2, eval_batches=1, chunks="2", extra={"ranks": 2})


def _even_then_migrate() -> dict:
    from plait.testing.virtual import VirtualDevice

    device = VirtualDevice().install()  # in this rank's process only
    torch.set_default_dtype(torch.float64)
    with device:
        return {"even": train_rank(EVEN),
                "migrate": train_rank(replace(EVEN, balance="migrate"))}


def test_migrate_decides_logs_and_keeps_the_loss(tmp_path):
    results = launch(_even_then_migrate, 2, slow=[parse_slow("1:3")], timeout_s=120,
                     threads=1, deadline_s=600)
    out = results[0]
    assert "balance" not in out["even"]  # even: no balancer at all
    decisions = out["migrate"]["balance"]["decisions"]
    units = {"blocks.0.attn": EVEN.n_head, "blocks.0.mlp": 4 * EVEN.n_embd}
    assert [(d["step"], d["dim"], d["kind"], d["sizes"]) for d in decisions] == [
        (10, dim, "migrate", list(static_plan(n, (1.0, 1 / 3)).sizes))
        for dim, n in units.items()], decisions
    logged = [d for r in out["migrate"]["records"] for d in r.get("decisions", ())]
    assert logged == decisions
    def agreed(ds):  # what every rank decides alike (a migration's seconds are its own)
        return [{k: v for k, v in d.items() if k != "migration"} for d in ds]

    assert agreed(results[1]["migrate"]["balance"]["decisions"]) == agreed(decisions)
    even = [r["loss"] for r in out["even"]["records"]]
    migrated = [r["loss"] for r in out["migrate"]["records"]]
    assert migrated == pytest.approx(even, rel=0, abs=TOL)

    cfg = replace(EVEN, balance="migrate")
    write_train_report(out["migrate"], cfg, tmp_path, "loopback", wall_s=1.0)
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["meta"]["summary"]["balance"]["decisions"] == decisions
    assert log["meta"]["config"]["balance"] == "migrate"
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
