"""A run whose experts the balancer placed, resumed from a checkpoint, goes on with the losses
and the decisions of the run never stopped.

As tests/checkpoint/test_checkpoint_balancer.py, for the MoE GPT under ``--balance migrate``,
rank 1 3× slow, virtual devices, float64: the balancer places each MoE layer's experts by
the tokens routed to them (a copied hot expert) before the checkpoint of step 8 and again
after it. A run resumed from a copy of the checkpoints up to step 8 places the experts as
saved (weights and AdamW state moved, exactly), continues the rule from its saved readings,
and every step's loss (bit for bit) and every later decision equal the first run's. Before
the experts' state was saved, the resumed run started from the plan: its decisions differed,
and so did its losses, in the last digits a sum's order sets (checked by hand: step 14,
3.174798598949413 against 3.1747985989494145).
"""

import torch

from plait.runtime.launch import launch
from plait.runtime.slow.straggler import parse_slow
from plait.training.config import TrainConfig

from _resume import killed_then_resumed

STEPS, EVERY, RESUME_AT = 16, 4, 8
SIZES = dict(model="moe", steps=STEPS, n_layer=1, n_head=4, n_embd=64, seq_len=32,
             batch_size=8, lr=1e-2, eval_batches=0, chunks="2", balance="migrate",
             checkpoint_every=EVERY, checkpoint_keep=5)


def _train_rank(cfg: TrainConfig) -> dict:
    from plait.training.run import train_rank

    torch.set_default_dtype(torch.float64)
    out = train_rank(cfg)
    return {"records": out["records"], "resumed": out["resumed"],
            "decisions": out["balance"]["decisions"]}


def _killed_then_resumed(cfg: TrainConfig, resumed_dir: str):
    return killed_then_resumed(cfg, resumed_dir, _train_rank, EVERY, RESUME_AT)


def test_placed_experts_resume_with_their_placement(tmp_path):
    cfg = TrainConfig(**SIZES, checkpoint_dir=str(tmp_path / "ckpt"), extra={"ranks": 2})
    results = launch(_killed_then_resumed, 2, args=(cfg, str(tmp_path / "resumed")),
                     slow=[parse_slow("1:3")], threads=1, timeout_s=60, deadline_s=300)
    before, after = results[0]
    placed = [d["step"] for d in before["decisions"] if d["kind"] == "place"]
    assert any(s < RESUME_AT for s in placed) and any(s >= RESUME_AT for s in placed), placed
    assert "balancer restored" in after["resumed"], after["resumed"]
    old, new = before["records"], after["records"]
    for a, b in zip(old, new):
        assert (a["step"], a["loss"]) == (b["step"], b["loss"]), (a, b)
    assert after["decisions"] == before["decisions"]
