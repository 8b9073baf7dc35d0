"""Data × tensor parallelism (``plait.parallel.data``) against one process on the global batch.

4 ranks, dp 2 × tp 2 on gloo: plait's tensor parallelism on each tp group,
PyTorch's data parallelism (``data_parallel``, "auto": FSDP2 where every
gradient goes through autograd, DDP where norms are summed over tp by hooks)
across them; each replica reads its half of a global batch of 4 sequences.
Every step's loss (the replicas' mean) equals a single-process model's on the
whole batch within 1e-9 (float64, 5 AdamW steps), and the weights at the end
too (gathered over tp, on every rank), for:

- plait's GPT (FSDP2), tp groups on consecutive ranks, in two calls
  (``parallelize(mesh=mesh["tp"])``, then ``data_parallel(model, mesh)``);
- plait's GPT with uneven MLP columns [40, 24] (agreed across dp), tp groups
  across hosts (``tp_inside_host=False``: ranks [0, 2], [1, 3]); 3 steps;
- plait's GPT sequence-parallel (``apply_tp``; DDP); 3 steps;
- a tiny transformers Llama (its own plan; FSDP2), in one call
  (``parallelize(mesh=mesh)``), its loss computed in float64 from the logits;
- blocks of one ``"rowwise_split_input"`` layer (FSDP2; their deferred weight
  gradients run before FSDP2 reduces each block); 3 steps;
- on 2 ranks, the degenerate meshes dp 2 × tp 1 and dp 1 × tp 2 (GPT, 3 steps).

Refused on every rank, with the same one line, before anything is wrapped:
replicas cut by different MLP plans ([40, 24] on ranks 0 and 1, even on 2 and
3); a parameter that only one tp position's replicas disagree on (the verdict
is shared over the tp axis); DDP on a fused row-parallel layer and FSDP2 on
sequence-parallel norms (each would lose a gradient); a model cut over another
group than the mesh's tp axis. Without processes: which ranks form the tp
and dp groups under both placements (hypothesis), which axis crosses hosts.
"""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from plait.nn import ShardPlan
from plait.parallel import MeshLayout, replica_mismatch, unsharded
from plait.testing import run_ranks

TOL = 1e-9
STEPS = 5
ROWS, SEQ = 4, 8  # the global batch


def _gpt():
    from plait.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=SEQ, n_layer=1, n_head=4, n_embd=16)).double()


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double()


class Lone(torch.nn.Module):
    """Blocks whose only split layer is row-parallel on a replicated input (transformers'
    ``"rowwise_split_input"``): no column-parallel layer after it in the backward runs its
    deferred weight gradient, so it is pending when the block's backward ends."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab)
        self.vocab = vocab

    def forward(self, ids):
        x = self.embed(ids)
        for proj in self.blocks:
            x = x + torch.tanh(proj(x))
        return self.head(x)


def _lone():
    torch.manual_seed(0)
    return Lone().double()


MODELS = {"gpt": _gpt, "llama": _llama, "lone": _lone}
PLANS = {"lone": {"blocks.*": "rowwise_split_input"}}


def _loss(name, model, ids):
    """The mean next-token cross-entropy, in float64 (transformers' own loss casts the logits
    to float32, which rounds a half-batch's mean differently from the whole batch's)."""
    if name == "gpt":
        return model(ids[:, :-1], ids[:, 1:])[1]
    logits = model(ids[:, :-1]) if name == "lone" else model(input_ids=ids[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _batch(step, vocab):
    """One of two fixed global batches (learnable in a few steps)."""
    g = torch.Generator().manual_seed(100 + step % 2)
    return torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)


def _tp(ref, mesh, shards=None, sp=False, plan="auto"):
    """A deep copy of ``ref`` made tensor-parallel on the mesh's tp axis (``sp``: plait's GPT
    sequence-parallel, by ``apply_tp``)."""
    import plait
    from plait.parallel import apply_tp

    shards = {k: ShardPlan(v) for k, v in (shards or {}).items()}
    model = copy.deepcopy(ref)
    if sp:
        return apply_tp(model, mesh.get_group("tp"), shards, sequence_parallel=True, chunks=2)
    return plait.parallelize(model, plan, mesh=mesh["tp"], shards=shards, chunks=2)


def _parallel(ref, mesh, one_call=False, **kw):
    """(the data × tensor parallel model, its tensor-parallel module): in two calls, or in one
    (``parallelize`` on the 2-D mesh)."""
    import plait
    from plait.parallel import data_parallel

    if one_call:
        model = plait.parallelize(copy.deepcopy(ref), kw.get("plan", "auto"), mesh=mesh, chunks=2)
        return model, getattr(model, "module", model)
    tp_model = _tp(ref, mesh, **kw)
    return data_parallel(tp_model, mesh), tp_model


def _train(name, dp, tp, inside=True, steps=STEPS, **kw):
    """(single-process losses, data × tensor parallel losses), the largest weight difference
    at the end, the data-parallel model's class."""
    import torch.distributed as dist

    from plait.parallel import dp_tp_mesh

    mesh = dp_tp_mesh(dp, tp, tp_inside_host=inside)
    ref = MODELS[name]()
    model, tp_model = _parallel(ref, mesh, plan=PLANS.get(name, "auto"), **kw)
    vocab = {"llama": lambda: ref.config.vocab_size, "lone": lambda: ref.vocab,
             "gpt": lambda: ref.cfg.vocab_size}[name]()
    replica = mesh.get_local_rank("dp")
    rows = slice(replica * ROWS // dp, (replica + 1) * ROWS // dp)  # this replica's share
    curves = []
    for m, share in ((ref, slice(None)), (model, rows)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses = []
        for step in range(steps):
            loss = _loss(name, m, _batch(step, vocab)[share])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen = loss.detach().clone()
            if m is model:  # the replicas' halves are equal in tokens: the mean is the batch's
                dist.all_reduce(seen, group=mesh.get_group("dp"))
                seen /= dp
            losses.append(float(seen))
        curves.append(losses)
    weights = _weights(model, tp_model)
    err = max(float((weights[k] - p.detach()).abs().max()) for k, p in ref.named_parameters())
    return curves, err, type(model).__name__


def _weights(model, tp_model):
    """The parameters, gathered over tp by plait's layers, by name. Not ``full_state_dict``:
    under FSDP2 ``state_dict()`` gives the dp-sharded DTensors, which plait's layers do not
    gather."""
    with unsharded(model):  # FSDP2: the plain (tp-sharded) tensors back, for a moment
        weights = {k: p.detach().clone() for k, p in tp_model.named_parameters()}
        for path, module in tp_model.named_modules():
            if path and hasattr(module, "full_state_dict"):
                weights = {k: v for k, v in weights.items() if not k.startswith(path + ".")}
                weights.update({f"{path}.{k}": v for k, v in module.full_state_dict().items()})
    return weights


def _refused():
    """Each attempt's error on this rank: plans that differ across dp; a parameter only one tp
    position's replicas disagree on; DDP on fused row-parallel layers; FSDP2 on
    sequence-parallel norms."""
    import torch.distributed as dist
    import torch.nn as nn

    import plait
    from plait.parallel import data_parallel, dp_tp_mesh
    from plait.testing import raised

    mesh = dp_tp_mesh(2, 2)
    rank = dist.get_rank()

    def plans():
        shards = {"mlp": ShardPlan((40, 24))} if rank < 2 else {}
        return plait.parallelize(_gpt(), "auto", mesh=mesh, shards=shards, chunks=2)

    def extra():
        model = plait.parallelize(_gpt(), "auto", mesh=mesh["tp"], chunks=2)
        if rank == 3:  # dp 1, tp 1: only the replicas at tp position 1 differ
            model.extra = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        return data_parallel(model, mesh)

    def kind(name, **kw):
        return lambda: data_parallel(_tp(_gpt(), mesh, **kw), mesh, kind=name)

    def group():  # tensor-parallel over all 4 ranks, then given the 2 × 2 mesh
        return data_parallel(plait.parallelize(_gpt(), "auto", chunks=2), mesh)

    return raised({"plans": plans, "extra": extra, "ddp": kind("ddp"),
                   "fsdp": kind("fsdp", sp=True), "group": group})


def _four_ranks():
    return {"gpt": _train("gpt", 2, 2),
            "gpt-uneven-across": _train("gpt", 2, 2, inside=False, shards={"mlp": (40, 24)},
                                        steps=3),
            "gpt-sp": _train("gpt", 2, 2, sp=True, steps=3),
            "llama": _train("llama", 2, 2, one_call=True),
            "lone": _train("lone", 2, 2, steps=3),
            "refused": _refused()}


def _two_ranks():
    return {"dp2-tp1": _train("gpt", 2, 1, steps=3), "dp1-tp2": _train("gpt", 1, 2, steps=3)}


def _check_curves(cases):
    for case, ((want, got), err, _) in cases.items():
        assert got == pytest.approx(want, rel=0, abs=TOL), (case, want, got)
        assert got[-1] < got[0], (case, got)  # it learns
        assert err < TOL, (case, err)


def test_dp_tp_matches_one_process_and_refuses_mismatched_plans():
    pytest.importorskip("transformers")
    results = run_ranks(_four_ranks, 4, timeout_s=60)
    for out in results:
        curves = {case: got for case, got in out.items() if case != "refused"}
        _check_curves(curves)
        # FSDP2 where every gradient goes through autograd; DDP where norms are summed by hooks
        assert {case: cls for case, (_, _, cls) in curves.items()} == {
            "gpt": "FSDPGPT", "gpt-uneven-across": "FSDPGPT",
            "gpt-sp": "DistributedDataParallel", "llama": "FSDPLlamaForCausalLM",
            "lone": "FSDPLone"}
        ddp, fsdp = out["refused"]["ddp"], out["refused"]["fsdp"]
        assert ddp.startswith("ValueError: data parallelism by DDP would lose gradients: fused "
                              "row-parallel layers (blocks.0.attn.proj, blocks.0.mlp.proj) add "
                              "their weight gradients outside autograd"), ddp
        assert ddp.endswith("use kind='fsdp'"), ddp
        assert fsdp.startswith("ValueError: data parallelism by FSDP would lose gradients: "
                               "blocks.0.ln_1.weight, blocks.0.ln_1.bias, blocks.0.attn.proj."
                               "bias and 3 more have their gradients summed over tp"), fsdp
        assert fsdp.endswith("use kind='ddp'"), fsdp
        assert "the model was made tensor-parallel over ranks [0, 1, 2, 3], but this mesh's " \
               "tp axis here is ranks" in out["refused"]["group"], out["refused"]["group"]
    lines = {name: {out["refused"][name] for out in results} for name in ("plans", "extra")}
    # the same one line on every rank
    assert all(len(seen) == 1 for seen in lines.values()), lines
    plans, extra = lines["plans"].pop(), lines["extra"].pop()
    assert plans.startswith("ValueError: replicas disagree across the dp axis: "
                            "blocks.0.mlp.fc.plan has plan [40, 24] on rank 0 and [32, 32] on "
                            "rank 2"), plans
    assert "extra has shape nothing on rank 1 and [2] on rank 3" in extra, extra
    assert "\n" not in plans + extra


def test_degenerate_meshes_match_one_process():
    _check_curves(run_ranks(_two_ranks, 2, timeout_s=60)[0])


@given(st.integers(1, 4), st.integers(1, 4), st.booleans())
def test_layout_groups_cover_every_rank_once(dp, tp, inside):
    layout = MeshLayout(dp=dp, tp=tp, tp_inside_host=inside)
    tp_groups, dp_groups = layout.tp_groups(), layout.dp_groups()
    assert sorted(r for g in tp_groups for r in g) == list(range(dp * tp))
    assert sorted(r for g in dp_groups for r in g) == list(range(dp * tp))
    assert all(len(set(a) & set(b)) == 1 for a in tp_groups for b in dp_groups)
    consecutive = all(g == list(range(g[0], g[0] + tp)) for g in tp_groups)
    assert consecutive == (inside or dp == 1 or tp == 1), (tp_groups, inside)


def test_layout_says_which_axis_crosses_hosts():
    inside, across = MeshLayout(dp=2, tp=2), MeshLayout(dp=2, tp=2, tp_inside_host=False)
    assert inside.describe(hosts=2) == ("dp 2 × tp 2: tp groups [[0, 1], [2, 3]], dp groups "
                                        "[[0, 2], [1, 3]]; across hosts: dp")
    assert across.describe(hosts=2).endswith("tp groups [[0, 2], [1, 3]], dp groups "
                                             "[[0, 1], [2, 3]]; across hosts: tp")
    assert inside.describe(hosts=1).endswith("across hosts: nothing")
    with pytest.raises(ValueError, match="4 ranks do not split into 3 hosts"):
        inside.describe(hosts=3)
    with pytest.raises(ValueError, match="dp must be a positive integer, got 0"):
        MeshLayout(dp=0, tp=2)


def test_replica_mismatch_names_the_first_difference():
    same = {"plans": {"b.plan": (2, 2)}, "shapes": {"a.weight": (2, 4), "b.weight": (2, 4)}}
    assert replica_mismatch([same, copy.deepcopy(same)], [0, 2]) is None
    # a plan is named before the shapes it makes
    cut = {"plans": {"b.plan": (3, 1)}, "shapes": {"a.weight": (2, 4), "b.weight": (3, 4)}}
    line = replica_mismatch([same, same, cut], [1, 3, 5])
    assert line.startswith("replicas disagree across the dp axis: b.plan has plan [2, 2] on "
                           "rank 1 and [3, 1] on rank 5 (same tp position)"), line
