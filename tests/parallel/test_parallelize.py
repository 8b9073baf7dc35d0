"""``plait.parallelize`` on a plain ``nn.Module`` (no transformers): styles, uneven shares, errors.

The model is written the way torchtitan's and transformers' are, with no parallel
code: grouped-query attention (8 query heads over 2 K/V heads, ``head_dim`` and
``num_key_value_groups`` on the module, a per-head RMS norm on q as Qwen3 has),
a gated MLP, LayerNorms, a vocabulary embedding and an LM head, biases on.
Against the same model on one process (float64, 1e-10: logits and every
gradient, gathered by name; the gathered weights bit for bit):

- torchtitan's sequence-parallel plan in PyTorch's styles: the embedding's
  lookups reduce-scattered along the sequence (``RowwiseParallel(input_layouts=
  Replicate(), output_layouts=Shard(1))``), the norms ``SequenceParallel()``, the
  attention's input gathered (``PrepareModuleInput``), the MLP's gathered inside
  its fused matmuls (``ColwiseParallel(input_layouts=Shard(1))``), both branches
  reduce-scattered back (``RowwiseParallel(output_layouts=Shard(1))``), the head
  gathering the sequence and its vocabulary; the sequence cut unevenly;
  The lone ``extra`` projection on the split stream: ``SequenceParallel()``;
- transformers' strings: ``"colwise"``/``"rowwise"``, ``"embedding_rowwise"``,
  ``"colwise_gather_output"``, ``"rowwise_split_input"`` on a lone projection,
  ``"replicated_with_grad_allreduce"`` on the per-head norm; heads cut [1, 1] of
  2 groups on 2 ranks, and into sub-groups (K/V heads copied) on 3; once over a
  1-D ``DeviceMesh`` (``mesh=``) instead of the default group; with the head's
  weight tied to the embedding's (both split by the same vocabulary rows, one
  parameter still);
- plait's own GPT under ``plan="auto"`` (the plan ``apply_tp`` gives it);
- on 2 ranks, a parallel MLP under ``torch.compile`` (compiled before its first step)
  gives the plain MLP's output and gradients;
- what it logs, once, on rank 0; and every mistake it refuses, naming the module;
- without processes: how KV-head groups are cut (hypothesis), how column/row pairs
  and their units are found, and how PyTorch's and transformers' styles read.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.nn import ColumnParallelLinear, ShardPlan
from plait.parallel import full_state_dict
from plait.testing import raised, run_ranks
from plait.nn.record import applied

TOL = 1e-10
V, D, H, KV, S = 40, 32, 8, 2, 7


class Attention(nn.Module):
    def __init__(self, d=D, heads=H, kv=KV):
        super().__init__()
        self.head_dim, self.num_key_value_groups = d // heads, heads // kv
        self.q_proj = nn.Linear(d, heads * self.head_dim)
        self.k_proj = nn.Linear(d, kv * self.head_dim)
        self.v_proj = nn.Linear(d, kv * self.head_dim)
        self.o_proj = nn.Linear(heads * self.head_dim, d)
        self.q_norm = nn.RMSNorm(self.head_dim)  # per head: sees only this rank's heads

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, h, S, hd]
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q = self.q_norm(q)
        k, v = (t.repeat_interleave(self.num_key_value_groups, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d=D, hidden=3 * D):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, hidden), nn.Linear(d, hidden)
        self.down_proj = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(D), Attention()
        self.norm2, self.mlp = nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Toy(nn.Module):
    def __init__(self, layers=2, tied=False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.extra = nn.Linear(D, D)  # a lone projection on the replicated stream
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.extra(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _toy(seed=0, **kw):
    torch.manual_seed(seed)
    model = Toy(**kw).double()
    with torch.no_grad():  # norms away from their identity init, so their gradients matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _torchtitan_plan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    seq = Shard(1)
    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "extra": SequenceParallel(),  # a replicated projection on each rank's share of the tokens
        "blocks.*.norm1": SequenceParallel(), "blocks.*.norm2": SequenceParallel(),
        "norm": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(seq,),
                                            desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.q_proj": ColwiseParallel(), "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.o_proj": RowwiseParallel(output_layouts=seq),
        "blocks.*.attn.q_norm": "replicated_with_grad_allreduce",
        "blocks.*.mlp.gate_proj": ColwiseParallel(input_layouts=seq),
        "blocks.*.mlp.up_proj": ColwiseParallel(input_layouts=seq),
        "blocks.*.mlp.down_proj": RowwiseParallel(output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }


def _plan(kind):
    if kind == "torchtitan":
        return _torchtitan_plan()
    attn, mlp = "blocks.*.attn", "blocks.*.mlp"
    return {"embed": "embedding_rowwise", "extra": "rowwise_split_input",
            **{f"{attn}.{p}_proj": "colwise" for p in "qkv"}, f"{attn}.o_proj": "rowwise",
            f"{attn}.q_norm": "replicated_with_grad_allreduce",
            f"{mlp}.gate_proj": "colwise", f"{mlp}.up_proj": "colwise",
            f"{mlp}.down_proj": "rowwise",
            "head": "colwise_gather_output"}


def _case(kind, shards, overlap, mesh=False):
    import plait
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ref = _toy(tied=kind.endswith("-tied"))
    shards = {k: ShardPlan(v) for k, v in shards.items()}
    where = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))} if mesh else {}
    par = plait.parallelize(copy.deepcopy(ref), _plan(kind.removesuffix("-tied")), shards=shards,
                            overlap=overlap, chunks=2, **where)
    ids = torch.randint(0, V, (3, S), generator=torch.Generator().manual_seed(1))
    want, got = ref(ids), par(ids)
    target = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(2))
    (want * target).sum().backward()
    (got * target).sum().backward()
    err = float((want - got).abs().max())
    grads = full_state_dict(par, grads=True)
    err = max([err] + [float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()])
    weights = full_state_dict(par)
    same = set(weights) == set(ref.state_dict()) and \
        all(torch.equal(weights[k], v) for k, v in ref.state_dict().items())
    return err, same, list(applied(par))[1:]


def _logged(kind):
    """The INFO records plait.parallel logs on this rank while parallelising."""
    import logging

    import plait

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("plait.parallel")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        plait.parallelize(_toy(), _plan(kind))
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records]


def _compiled():
    """An MLP made parallel, then ``torch.compile`` d before its first step (dynamo's own
    backend: graph capture without code generation), forward and backward against the
    plain MLP: the largest difference."""
    import plait

    torch.manual_seed(0)
    ref = MLP().double()
    par = plait.parallelize(copy.deepcopy(ref), {"gate_proj": "colwise", "up_proj": "colwise",
                                                 "down_proj": "rowwise"}, chunks=2)
    x = torch.randn(3, S, D, dtype=torch.float64)
    got, want = torch.compile(par, backend="eager")(x), ref(x)
    got.sum().backward()
    want.sum().backward()
    grads = full_state_dict(par, grads=True)
    return max([float((got - want).abs().max())] +
               [float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()])


def _gpt_auto():
    """plait's own GPT under ``plan="auto"`` (its apply_tp plan) against the plain GPT."""
    import plait
    from plait.models import GPT, GPTConfig

    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=V, block_size=S, n_layer=2, n_head=4, n_embd=D)).double()
    par = plait.parallelize(copy.deepcopy(ref), "auto", chunks=2)
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    (_, want), (_, got) = ref(ids, ids), par(ids, ids)
    want.backward()
    got.backward()
    grads = full_state_dict(par, grads=True)
    return max([float((want - got).abs())] +
               [float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()])


def _run(cases, compiled=False):
    first = _compiled() if compiled else None  # first: nothing made before it in this process
    return [_case(*case) for case in cases], _logged("strings"), first, _gpt_auto()


CASES = {
    2: [("torchtitan", {"seq": (5, 2)}, True), ("torchtitan", {"heads": (1, 1)}, False),
        ("strings", {"mlp": (70, 26), "vocab": (10, 30)}, True), ("strings", {}, False, True),
        ("strings-tied", {"vocab": (25, 15)}, True)],
    3: [("torchtitan", {"seq": (1, 4, 2), "heads": (1, 2, 1)}, True),
        ("strings", {"heads": (2, 1, 1), "extra": (20, 4, 8)}, False),
        ("strings-tied", {}, True)],
}


@pytest.mark.parametrize("world", [2, 3])
def test_plain_module_matches_one_process(world):
    results = run_ranks(_run, world, CASES[world], compiled=world == 2)
    for rank, (per_case, logged, compiled, gpt) in enumerate(results):
        assert compiled is None or compiled < TOL, compiled
        assert gpt < TOL, gpt
        for case, (err, same, notes) in zip(CASES[world], per_case):
            assert err < TOL, (case, err)
            assert same, case
        if rank:
            assert logged == [], logged  # once, on rank 0
        else:
            assert logged[0] == (f"Toy on {world} ranks: 2 attention (by heads), 2 MLP (by "
                                 "columns), 2 lone linear; also Replicated, VocabParallel; "
                                 "fused path"), logged
            assert any("head: column-parallel with its output gathered" in line
                       for line in logged), logged
    notes = [n for case in results[0][0] for n in case[2]]
    assert any("blocks.*.attn: gathers a tensor along dim 1" in n for n in notes), notes
    if world == 3:  # 2 KV heads, 3 ranks: sub-groups, K/V heads copied
        assert any("2 KV heads cut into 4 sub-groups of 2 query heads" in n for n in notes), notes


# --- mistakes -------------------------------------------------------------------

class BadHeads(nn.Module):
    """An attention whose projections are not whole heads of its head_dim."""

    def __init__(self):
        super().__init__()
        self.head_dim = 5
        self.q_proj, self.o_proj = nn.Linear(8, 16), nn.Linear(15, 8)


class OneHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim, self.num_key_value_groups = 4, 1
        self.q_proj, self.k_proj, self.o_proj = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


def _mistakes():
    import plait
    from torch.distributed.tensor.parallel import ColwiseParallel

    def par(model, plan, **kw):
        return lambda: plait.parallelize(model, plan, **kw)

    attn = "blocks.0.attn"
    return raised({
        "nothing": par(_toy(), {"blocks.*.atn.q_proj": "colwise"}),
        "refused": par(_toy(), {f"{attn}.q_proj": "moe_identity_expert"}),
        "unknown": par(_toy(), {f"{attn}.q_proj": "colwize"}),
        "dtensor": par(_toy(), {f"{attn}.q_proj": ColwiseParallel(use_local_output=False)}),
        "not_linear": par(_toy(), {"blocks.0.norm1": "colwise"}),
        "not_heads": par(nn.ModuleDict({"a": BadHeads()}),
                         {"a.q_proj": "colwise", "a.o_proj": "rowwise"}),
        "one_head": par(nn.ModuleDict({"a": OneHead()}),
                        {"a.q_proj": "colwise", "a.k_proj": "colwise", "a.o_proj": "rowwise"}),
        "count": par(_toy(), _plan("strings"), shards={"heads": ShardPlan((2, 1))}),
        "kind": par(_toy(), _plan("strings"), shards={"hedas": ShardPlan((1, 1))}),
        "uneven": par(_toy(), _plan("strings"), shards={"blocks.1.mlp": ShardPlan((90, 7))}),
        "tied": par(_toy(tied=True), {"head": "colwise_gather_output"}),
        "twice": par(_toy(), {"blocks.*.attn.q_proj": "colwise",
                              "blocks.0.attn.q_proj": "rowwise"}),
        "plan": par(_toy(), "mine"),
        "empty": par(_toy(), {}),
        "dp_kind": par(_toy(), _plan("strings"), dp_kind="zero3"),
    })


def test_mistakes_are_refused_naming_the_module():
    seen = run_ranks(_mistakes, 2)[0]
    assert "plan entry 'blocks.*.atn.q_proj' ('colwise') matches no module of Toy" \
        in seen["nothing"]
    assert "'blocks.0.attn.q_proj': transformers' style 'moe_identity_expert'" in seen["refused"]
    assert "not supported by plait" in seen["refused"]
    assert "'colwize' is not a transformers plan style plait knows" in seen["unknown"]
    assert "ColwiseParallel(use_local_output=False) asks for a DTensor" in seen["dtensor"]
    assert seen["not_linear"].startswith("TypeError: blocks.0.norm1: Colwise splits an nn.Linear, "
                                         "but blocks.0.norm1 is a LayerNorm"), seen["not_linear"]
    assert "a.q_proj: 16 output features are not whole heads of head_dim 5" in seen["not_heads"]
    assert "a: 1 query heads cannot give each of 2 ranks a whole head" in seen["one_head"]
    assert "blocks.0.attn: a plan of 3 units does not count this attention's KV-head groups" \
        in seen["count"] and "it may count 2 or 4 or 8" in seen["count"]
    assert "shards ['hedas'] name neither a kind" in seen["kind"]
    assert "blocks.1.mlp.gate_proj: ColumnParallelLinear(32, 96): shard sizes [90, 7] sum to 97 " \
           "columns, but the dimension has 96" in seen["uneven"]
    assert "head.weight and embed.weight are one tied parameter" in seen["tied"] \
        or "embed.weight and head.weight are one tied parameter" in seen["tied"], seen["tied"]
    assert "blocks.0.attn.q_proj is matched by plan entries" in seen["twice"]
    assert "plan must be 'auto' or a dict" in seen["plan"]
    assert "the plan names no module to split" in seen["empty"]
    assert "dp_kind must be one of auto, fsdp, ddp or None, got 'zero3'" in seen["dp_kind"]


def _one_rank_differs():
    """Rank 1 alone calls parallelize differently: another plan, weights from another seed, a
    plan entry that matches nothing; every rank must raise (none may go on to a collective
    its peers never join)."""
    import plait

    import torch.distributed as dist

    one = dist.get_rank() == 1
    good = _plan("strings")
    fewer = {k: v for k, v in good.items() if "mlp" not in k}
    return raised({
        "plan": lambda: plait.parallelize(_toy(), fewer if one else good),
        "weights": lambda: plait.parallelize(_toy(seed=int(one)), good),
        "bad": lambda: plait.parallelize(_toy(), {"blocks.*.atn.q_proj": "colwise"} if one
                                         else good),
        # a second call on a model split in part: its shards differ by design, not a mistake
        "twice": lambda: plait.parallelize(plait.parallelize(_toy(), {
            k: v for k, v in good.items() if "mlp" in k}), {
            k: v for k, v in good.items() if "mlp" not in k}),
    })


def test_a_plan_or_model_that_differs_on_one_rank_is_refused_on_every_rank():
    for rank, seen in enumerate(run_ranks(_one_rank_differs, 2)):
        assert seen["plan"].startswith("ValueError: the ranks' plans differ: rank 0 has "
                                       "blocks.0.mlp"), (rank, seen["plan"])
        assert seen["weights"].startswith("ValueError: rank 1's weights differ from rank 0's ("
                                          ), (rank, seen["weights"])
        assert "build the model from one seed on every rank" in seen["weights"]
        assert seen["twice"] is None, (rank, seen["twice"])
        assert seen["bad"].startswith("ValueError: rank 1: plan entry 'blocks.*.atn.q_proj' "
                                      "('colwise') matches no module of Toy"), (rank, seen["bad"])


def test_without_a_process_group_it_is_an_error_not_a_world_of_one():
    import plait

    with pytest.raises(ValueError, match="plait.parallelize needs torch.distributed initialised"):
        plait.parallelize(_toy(), _plan("strings"))
    with pytest.raises(ValueError, match="plait's parallel layers need torch.distributed"):
        ColumnParallelLinear.from_module(nn.Linear(4, 4))


# --- decisions, without processes ------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(kv=st.integers(1, 8), groups=st.integers(1, 8), world=st.integers(1, 12))
def test_head_split_gives_every_rank_a_share_with_the_fewest_copies(kv, groups, world):
    from plait.parallel.dims import head_split

    try:
        m = head_split(kv * groups, kv, world)
    except ValueError as err:
        assert kv * groups < world, err  # refused only where there are fewer heads than ranks
        return
    assert groups % m == 0 and kv * m >= world  # sub-groups of whole query heads, enough of them
    assert all(kv * d < world for d in range(1, m) if groups % d == 0)  # and no more than needed
    assert head_split(kv * groups, kv, world, total=kv * m) == m


def test_find_dims_pairs_columns_with_rows_by_whole_heads():
    from plait.parallel.dims import find_dims, resolve_plan_for
    from plait.parallel.resolve import expand

    model = _toy()
    model.blocks[0].mlp.gate_proj = nn.Linear(D, 6 * D)  # a packed [gate | up], 2 blocks
    del model.blocks[0].mlp.up_proj
    plan = {k: v for k, v in _plan("strings").items() if "up_proj" not in k}
    styles = expand(model, plan)
    modules = dict(model.named_modules())
    linears = {p: (s, modules[p]) for p, s in styles.items() if p not in ("embed",)
               and isinstance(modules[p], nn.Linear)}
    dims = {d.name: d for d in find_dims(linears, modules)}
    attn, mlp0 = dims["blocks.0.attn"], dims["blocks.0.mlp"]
    assert (attn.kind, attn.units, attn.heads) == ("heads", KV, (H, KV, D // H))
    hd, g = D // H, H // KV
    assert {p.rpartition(".")[2]: (c.unit, c.blocks) for p, c in attn.cuts.items()} == \
        {"q_proj": (g * hd, 1), "k_proj": (hd, 1), "v_proj": (hd, 1), "o_proj": (g * hd, 1)}
    assert (mlp0.kind, mlp0.units, mlp0.cuts["blocks.0.mlp.gate_proj"].blocks) == ("mlp", 3 * D, 2)
    assert (dims["extra"].kind, dims["extra"].units) == ("columns", D)
    assert (dims["head"].kind, dims["head"].units) == ("columns", V)
    resolve_plan_for(attn, None, 3)  # 2 KV heads, 3 ranks: 4 sub-groups, K/V copied twice
    assert (attn.plan.sizes, attn.groups_local, attn.cuts["blocks.0.attn.k_proj"].copies,
            attn.cuts["blocks.0.attn.q_proj"].unit) == ((2, 1, 1), g // 2, 2, g // 2 * hd)


def test_torch_and_transformers_styles_read_as_plait_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    from plait.parallel import styles as ps

    seq = Shard(1)
    assert ps.to_style(ColwiseParallel(), "a") == ps.Colwise() == ps.to_style("colwise", "a")
    assert ps.to_style(ColwiseParallel(input_layouts=seq, output_layouts=Replicate()), "a") == \
        ps.Colwise(input=seq, output=Replicate())
    assert ps.to_style("colwise_gather_output", "a") == ps.Colwise(output=Replicate())
    assert ps.to_style("packed_colwise", "a") == ps.Colwise(blocks=2)
    assert ps.to_style(RowwiseParallel(output_layouts=seq), "a") == ps.Rowwise(output=seq)
    assert ps.to_style("rowwise_split_input", "a") == ps.Rowwise(input=Replicate())
    assert ps.to_style(SequenceParallel(sequence_dim=2), "a") == ps.SequenceParallel(seq_dim=2)
    prepare = PrepareModuleInput(input_layouts=(seq, None),
                                 desired_input_layouts=(Replicate(), None),
                                 input_kwarg_layouts={"h": seq},
                                 desired_input_kwarg_layouts={"h": seq})
    assert ps.to_style(prepare, "a") == \
        ps.Prepare(args=((seq, Replicate()), None), kwargs=(("h", None),))
    assert ps.to_style("moe_tp_experts", "a") == ps.ExpertsTP()
    assert ps.to_style("ep_dispatch_experts", "a") == ps.to_style("grouped_gemm", "a") \
        == ps.ExpertsEP()
    refused = "'a': RowwiseParallel\\(output_layouts=Shard\\(-1\\)\\) is not"
    with pytest.raises(ValueError, match=refused):
        ps.to_style(RowwiseParallel(output_layouts=Shard(-1)), "a")
