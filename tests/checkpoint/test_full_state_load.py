"""A full state dict in memory loaded into a parallel model, the ways torch users load one.

A transformers Llama (float64, 2 layers, 8 query heads over 4 KV heads) built on the meta
device, made parallel (2 ranks even; 3 ranks: KV groups [2, 1, 1], uneven MLP columns),
``plait.checkpoint.materialize(model, "cpu")``, then given the full state dict of the same
model built in one process, three ways:

- ``model.load_state_dict(full)`` (the pre-hook ``plait.parallelize`` adds takes each
  rank's share);
- DCP's ``set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True))``, the state dict on rank 0 only (torchtitan's way);
- ``plait.load_shards(model, full)``.

Each gives one process's loss and every parameter's gradient (gathered by name) within
1e-10; the parallel model's own ``state_dict`` loads back unchanged; into a model still on
the meta device the load is refused in one line naming ``materialize`` (``load_state_dict``
and ``load_shards`` alike).
"""

from __future__ import annotations

import pytest
import torch

from plait.testing import run_ranks
from plait.nn.record import applied

pytest.importorskip("transformers")

TOL = 1e-10
IDS = torch.arange(40).view(2, 20) % 256


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=64)


def _full():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).double()


def _figures(model) -> tuple[float, dict]:
    from plait import full_state_dict

    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    grads = full_state_dict(model, grads=True) if applied(model) else \
        {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    return float(loss.detach()), grads


def _on_meta():
    from transformers import LlamaForCausalLM

    import plait

    with torch.device("meta"):
        model = LlamaForCausalLM(_config()).double()
    return plait.parallelize(model, "auto")


def _load(how: str):
    import torch.distributed as dist

    import plait
    from plait.checkpoint import materialize

    full = _full().state_dict()
    model = _on_meta()
    if how == "meta":  # not materialized: refused, naming the call that works, both ways
        said = []
        for load in (model.load_state_dict, lambda sd: plait.load_shards(model, sd)):
            try:
                load(full)
            except ValueError as err:
                said.append(str(err))
        return said
    materialize(model, "cpu")
    if how == "load_state_dict":
        model.load_state_dict(full)
    elif how == "dcp":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict)
        given = full if dist.get_rank() == 0 else {}
        set_model_state_dict(model, given, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
    else:
        plait.load_shards(model, full)
    own = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(own)  # its own shards load back as they are
    same_own = all(torch.equal(own[k], v) for k, v in model.state_dict().items())
    loss, grads = _figures(model)
    return {"loss": loss, "grads": grads, "same_own": same_own}


@pytest.mark.parametrize("world", [2, 3])
def test_a_full_state_dict_loads_into_a_parallel_model_three_ways(world):
    loss, grads = _figures(_full())
    for how in ("load_state_dict", "dcp", "load_shards"):
        for seen in run_ranks(_load, world, how, timeout_s=120):
            assert seen["same_own"], how
            assert abs(seen["loss"] - loss) < TOL, (how, seen["loss"], loss)
            assert seen["grads"].keys() == grads.keys(), how
            worst = max(float((seen["grads"][k] - g).abs().max()) for k, g in grads.items())
            assert worst < TOL, (how, worst)


def test_a_model_still_on_meta_is_refused_in_one_line():
    for said in run_ranks(_load, 2, "meta", timeout_s=120):
        assert len(said) == 2, said  # load_state_dict and load_shards
        for message in said:
            assert "materialize(model, 'cpu')" in message and "\n" not in message, message
