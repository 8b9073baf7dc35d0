"""``plait train --model moe|hf-mixtral --balance migrate --slow 1:3`` on 2 ranks: experts
placed by routed load and rank speed inside the training loop, the losses of the run without.

As tests/training/test_train_balance.py: float64, every rank a virtual device (timed by its
products' FLOPs), so the speeds read (1, 1/3) exactly and the run decides the same way each
time. The MoE GPT and a transformers Mixtral train without a balancer, then under
``migrate``: the attention heads migrate by speed and each MoE layer's experts are placed
by the tokens routed to them and the speeds (``place`` decisions: hot experts replicated, their copies' gradients summed,
weights and AdamW state moved whole). Every step's loss equals the even run's within 1e-9.
"""

from dataclasses import replace

import pytest
import torch

from plait.runtime import launch, parse_slow
from plait.training.config import TrainConfig
from plait.training.run import train_rank

TOL = 1e-9
CONFIGS = {
    "moe": TrainConfig(model="moe", steps=16, n_layer=1, n_head=4, n_embd=64, seq_len=32,
                       batch_size=8, lr=1e-2, eval_batches=1, chunks="2", extra={"ranks": 2}),
    "hf-mixtral": TrainConfig(model="hf-mixtral", steps=16, n_layer=1, n_head=4, kv_heads=2,
                              n_embd=64, seq_len=32, batch_size=8, lr=1e-2, eval_batches=1,
                              chunks="2", extra={"ranks": 2}),
}
LAYER = {"moe": "blocks.0.mlp", "hf-mixtral": "model.layers.0.mlp.experts"}


def _even_then_balanced(name: str) -> dict:
    from plait.testing.virtual import VirtualDevice

    even = CONFIGS[name]
    device = VirtualDevice().install()
    torch.set_default_dtype(torch.float64)
    with device:
        return {"even": train_rank(even),
                "migrate": train_rank(replace(even, balance="migrate"))}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_experts_placed_while_training_keep_the_loss(name):
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    results = launch(_even_then_balanced, 2, args=(name,), slow=[parse_slow("1:3")],
                     timeout_s=120, threads=1, deadline_s=600)
    out = results[0]
    decisions = out["migrate"]["balance"]["decisions"]
    placed = [d for d in decisions if d["kind"] == "place"]
    assert placed and all(d["dim"] == LAYER[name] for d in placed), decisions
    assert [d["sizes"] for d in placed][-1][0] > [d["sizes"] for d in placed][-1][1]
    same = [{k: v for k, v in d.items() if k != "migration"} for d in decisions]
    assert same == [{k: v for k, v in d.items() if k != "migration"}
                    for d in results[1]["migrate"]["balance"]["decisions"]]
    even = [r["loss"] for r in out["even"]["records"]]
    moved = [r["loss"] for r in out["migrate"]["records"]]
    assert max(abs(a - b) for a, b in zip(even, moved)) < TOL, (even, moved)
