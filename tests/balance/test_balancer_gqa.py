"""The balancer on grouped-query attention: a transformers Llama (8 query heads over 4 KV
heads, 2 layers, width 64, float64) made parallel by ``plait.parallelize`` on 2 ranks, whose
layer-0 attention dim (q, k, v and o projections, one plan in KV-head groups: a group is 2
query heads in q and o, 1 head in k and v), as ``plait.parallelize`` hands it to the
``Balancer`` in ``applied(model).dims``.

- resizing keeps the same KV-head groups in all four layers: q and o keep both query heads
  of each kept group, k and v its K/V head;
- migrating the dim as the balancer does (q, k, v, o to [3, 1] groups, with AdamW's state)
  changes no number: the next steps' losses equal the unmigrated model's within 1e-10.
"""

import copy

import pytest
import torch

from plait.testing import run_ranks
from plait.nn.record import applied

pytest.importorskip("transformers")

ATTN = "model.layers.0.self_attn"
LAYERS = tuple(f"{ATTN}.{p}_proj" for p in "qkvo")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double()


def _step(model, opt, step):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step % 2))
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def _gqa_dim():
    import plait
    from plait.balance import Balancer, PolicyConfig
    from plait.balance.policy import Action
    from plait.nn import ShardPlan

    ref = _llama()
    runs = {}
    for moved in (False, True):
        par = plait.parallelize(copy.deepcopy(ref), "auto", chunks=2)
        assert set(applied(par).dims[ATTN]) == set(LAYERS)  # the GQA dim, as parallelize found it
        opt = torch.optim.AdamW(par.parameters(), lr=3e-3)
        balancer = Balancer(par, opt, None, PolicyConfig(name="even"), warmup=0)
        layers = {n: par.get_submodule(n) for n in LAYERS}
        losses = [_step(par, opt, s) for s in range(3)]
        if moved:
            balancer._apply(3, ATTN, Action("migrate", "test", plan=ShardPlan((3, 1))))
        losses += [_step(par, opt, s) for s in range(3, 6)]
        runs[moved] = losses
        if not moved:  # the even plan, 2 groups a rank: keep one
            balancer._apply(6, ATTN, Action("resize", "test", fractions=(0.5, 0.5)))
            kept = {n: layer._kept.tolist() for n, layer in layers.items()}
            _step(par, opt, 6)  # the resized layers compute together
    sizes = {n: layer.plan.sizes for n, layer in layers.items()}
    units = {n: layer.unit for n, layer in layers.items()}
    return runs, sizes, units, kept


def test_balancer_moves_and_resizes_whole_kv_head_groups():
    results = run_ranks(_gqa_dim, 2)
    for runs, sizes, units, kept in results:
        assert set(sizes.values()) == {(3, 1)}, sizes
        errors = [abs(a - b) for a, b in zip(runs[True], runs[False])]
        assert len(errors) == 6 and max(errors) < 1e-10, errors
        hd = 64 // 8
        assert units == {LAYERS[0]: 2 * hd, LAYERS[1]: hd, LAYERS[2]: hd, LAYERS[3]: 2 * hd}
        groups = {n: sorted({i // units[n] for i in k}) for n, k in kept.items()}
        assert len({tuple(g) for g in groups.values()}) == 1, groups  # the same groups
        assert len(groups[LAYERS[0]]) == 1, groups  # one of the rank's 2 groups
        for n, k in kept.items():  # whole groups: every feature of each kept group
            assert len(k) == len(groups[n]) * units[n], (n, k)
