"""transformers' experts (a Mixtral made expert-parallel by ``plait.parallelize``) placed
anywhere with replicas: the same logits, gradients and decoded tokens as one process.

float64, 2 and 3 ranks. The experts move (``ExpertParallelExperts.place``) to a placement
``place_experts`` makes for a skewed load, hot experts copied: a prompt (every rank its
share of the tokens, the all-to-all path), one token (fewer tokens than ranks: each copy
computes its block of the rows routed to its expert, summed over the ranks), the weights'
gradients (each replicated expert's copies summed) and greedy decoding all equal the
single process's within 1e-10.
"""

from __future__ import annotations

import pytest
import torch

from plait.testing import run_ranks

pytest.importorskip("transformers")
IDS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
TOL = 1e-10


def _one():
    from plait.inference.decode import decode
    from plait.testing.tiny_hf import tiny_model

    model = tiny_model("mixtral")
    out = model(IDS)
    out.logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "experts" in n}
    tokens = decode(model.eval(), IDS, 6).tokens
    return out.logits.detach(), model(IDS[:, :1]).logits.detach(), grads, tokens


def _placed(world: int):
    import plait
    from plait.balance.experts import place_experts
    from plait.inference.decode import decode
    from plait.nn.placement import Homes
    from plait.parallel.experts import ExpertParallelExperts
    from plait.testing.tiny_hf import tiny_model

    model = tiny_model("mixtral")
    plait.parallelize(model, "auto")
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    experts = layers[0].num_experts
    loads = [50] + [1] * (experts - 1)  # one hot expert: copied on every rank
    placement = place_experts(loads, [1.0] * world)
    moved = [layer.place(Homes(placement.replicas, world)) for layer in layers]
    out = model(IDS)
    out.logits.square().mean().backward()
    state = plait.full_state_dict(model, grads=True)
    grads = {n: v for n, v in state.items() if "experts" in n}
    one = model(IDS[:, :1]).logits.detach()
    tokens = decode(model.eval(), IDS, 6).tokens
    return out.logits.detach(), one, grads, tokens, moved, placement.copies()


@pytest.mark.parametrize("world", [2, 3])
def test_placed_experts_compute_what_one_process_does(world):
    logits, one, grads, tokens = _one()
    got, got_one, got_grads, got_tokens, moved, copies = run_ranks(_placed, world, world,
                                                                   timeout_s=120)[0]
    assert copies >= 1 and all(m >= 1 for m in moved)
    assert float((got - logits).abs().max()) < TOL
    assert float((got_one - one).abs().max()) < TOL
    for name, g in grads.items():
        assert float((got_grads[name] - g).abs().max()) < TOL, name
    assert torch.equal(got_tokens, tokens)
