"""``plait train --balance migrate --slow 1:3`` on 2 ranks: the balancer in the training loop.

One launch, rank 1 computing 3 × slower (runtime straggler emulation), float64 on every
rank. (2 × was too close to the trigger for this tiny GPT: its unmovable time, 1.23–1.30 of
its movable compute, left a 2 × rank an imbalance of 1.27–1.32 against the trigger's 1.2,
and a CI run made no decision in its 16 steps.) The GPT is trained without a balancer
(``--balance even``), then under ``migrate``. The migrate run decides at least once,
every decision a migration that gives rank 0 (the fast one) more of a dim; each decision is
in its step's record, in the result and in ``log.json``'s summary, and its step is marked on
``loss.png``'s step-time panel. Migration is exact (weights, gradients and AdamW's state move whole), so every step's loss equals the
even run's within 1e-9 (only the order of a few sums changes with the shard sizes).
"""

import json
from dataclasses import replace

import pytest
import torch

from plait.runtime import launch, parse_slow
from plait.train import TrainConfig, train_rank
from plait.train_report import write_train_report

TOL = 1e-9
EVEN = TrainConfig(model="gpt", steps=16, n_layer=1, n_head=4, n_embd=64, seq_len=32,
                   batch_size=8, lr=1e-2, eval_batches=1, chunks="2", extra={"ranks": 2})


def _even_then_migrate() -> dict:
    torch.set_default_dtype(torch.float64)
    return {"even": train_rank(EVEN), "migrate": train_rank(replace(EVEN, balance="migrate"))}


def test_migrate_decides_logs_and_keeps_the_loss(tmp_path):
    results = launch(_even_then_migrate, 2, slow=[parse_slow("1:3")], timeout_s=120,
                     threads=1, deadline_s=600)
    out = results[0]
    assert "balance" not in out["even"]  # even: no balancer at all
    decisions = out["migrate"]["balance"]["decisions"]
    assert decisions, out["migrate"]["balance"]
    for d in decisions:
        assert d["kind"] == "migrate" and d["sizes"][0] > d["sizes"][1], d
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
