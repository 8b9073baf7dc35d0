"""GPT, MoE-GPT and DLRM made parallel by apply_tp against the same single-device model.

Same initial weights (the parallel model is built ``from_module`` from a copy
of the reference), float64; loss and logits within 1e-10, every parameter's
gradient (gathered by name with ``full_state_dict(grads=True)``) within 1e-10.
2 and 4 ranks; even and uneven plans; fused (``chunks=2``) and plain;
tensor-parallel with and without sequence parallelism; the dense GPT also with
its batch in interleaved micro-batches (``microbatches``, more than the batch
has rows included).
"""

import copy

import pytest
import torch

from plait.models import DLRM, GPT, DLRMConfig, GPTConfig
from plait.nn import ShardPlan
from plait.parallel import apply_tp, full_state_dict
from plait.testing import raised, run_ranks

TOL = 1e-10


def _gpt_problem(experts, seed=0):
    cfg = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16, mlp_ratio=2,
                    n_experts=experts, top_k=2)
    torch.manual_seed(seed)
    ref = GPT(cfg).double()
    if experts:  # the default init routes almost uniformly; sharper routing tests more
        with torch.no_grad():
            for block in ref.blocks:
                block.mlp.router.weight.normal_()
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 7), generator=g)
    return ref, idx, targets


def _compare(ref, par, ref_out, par_out):
    """Largest difference of outputs and of any gradient; whether the weights round-trip."""
    err = max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(ref_out, par_out))
    grads = full_state_dict(par, grads=True)
    for name, p in ref.named_parameters():
        err = max(err, float((grads[name] - p.grad).abs().max()))
    weights = full_state_dict(par)
    exact = all(torch.equal(weights[k], v) for k, v in ref.state_dict().items())
    return err, exact and set(weights) == set(ref.state_dict())


def _gpt_case(experts, plans, overlap, sp, microbatches=1):
    ref, idx, targets = _gpt_problem(experts)
    par = apply_tp(copy.deepcopy(ref), plans={k: ShardPlan(v) for k, v in plans.items()},
                   overlap=overlap, sequence_parallel=sp, chunks=2, microbatches=microbatches)
    ref_out = ref(idx, targets)
    ref_out[1].backward()
    par_out = par(idx, targets)
    par_out[1].backward()
    return _compare(ref, par, ref_out, par_out)


def _dlrm_problem(plans, seed=0):
    cfg = DLRMConfig(dense_features=5, table_sizes=(13, 7, 9, 4, 11, 6)[:plans["tables_n"]],
                     embedding_dim=4, bottom=(8,), top=(8,))
    torch.manual_seed(seed)
    ref = DLRM(cfg).double()
    g = torch.Generator().manual_seed(seed + 1)
    batch = 9
    dense = torch.randn(batch, cfg.dense_features, generator=g, dtype=torch.float64)
    indices, offsets = [], []
    for n in cfg.table_sizes:
        lengths = torch.randint(1, 4, (batch,), generator=g)
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
        indices.append(torch.randint(0, n, (int(lengths.sum()),), generator=g))
    labels = torch.randint(0, 2, (batch,), generator=g).double()
    return ref, (dense, indices, offsets), labels


def _dlrm_case(plans, overlap):
    ref, inputs, labels = _dlrm_problem(plans)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    shard = {k: ShardPlan(v) for k, v in plans.items() if k != "tables_n"}
    par = apply_tp(copy.deepcopy(ref), plans=shard, overlap=overlap, chunks=2)
    ref_logits = ref(*inputs)
    ref_loss = bce(ref_logits, labels)
    ref_loss.backward()
    par_logits = par(*inputs)
    par_loss = bce(par_logits, labels)
    par_loss.backward()
    return _compare(ref, par, (ref_logits, ref_loss), (par_logits, par_loss))


def _run(cases):
    return [(_gpt_case if kind == "gpt" else _dlrm_case)(*args) for kind, args in cases]


def _cases(world):
    heads = {2: [3, 1], 4: [1, 1, 1, 1]}[world]       # of 4 heads
    mlp = {2: [20, 12], 4: [4, 12, 8, 8]}[world]      # of 32 columns
    seq = {2: [5, 2], 4: [1, 3, 2, 1]}[world]         # of S = 7
    experts = {2: [3, 1], 4: [1, 1, 1, 1]}[world]     # of 4 experts
    tables = {2: (5, [2, 3], [7, 2]), 4: (6, [1, 2, 2, 1], [2, 3, 0, 4])}[world]
    uneven = {"heads": heads, "mlp": mlp}
    cases = [("gpt", (0, {}, True, False)), ("gpt", (0, {}, False, True)),
             ("gpt", (0, uneven, True, True)), ("gpt", (0, {**uneven, "seq": seq}, False, False)),
             ("gpt", (0, {**uneven, "seq": seq}, True, True)),
             ("gpt", (4, {}, True, False)), ("gpt", (4, {"experts": experts}, False, True)),
             ("gpt", (4, {"heads": heads, "experts": experts}, True, True)),
             ("gpt", (0, {}, True, False, 2)), ("gpt", (0, uneven, True, False, 3))]
    n, table_plan, batch_plan = tables
    cases += [("dlrm", ({"tables_n": n}, True)),
              ("dlrm", ({"tables_n": n, "tables": table_plan, "batch": batch_plan}, True)),
              ("dlrm", ({"tables_n": n, "tables": table_plan, "batch": batch_plan}, False))]
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_models_match_single_device(world):
    cases = _cases(world)
    for per_rank in run_ranks(_run, world, cases):
        for case, (err, exact) in zip(cases, per_rank):
            assert err < TOL, (case, err)
            assert exact, case


def _bad_plans():
    ref, _, _ = _gpt_problem(0)
    seen = {}
    for name, plans in {"heads": {"heads": ShardPlan((4, 0))}, "typo": {"head": ShardPlan((2, 2))},
                        "mlp": {"mlp": ShardPlan((16, 15))}}.items():
        try:
            apply_tp(copy.deepcopy(ref), plans=plans)
            seen[name] = None
        except (TypeError, ValueError) as err:
            seen[name] = str(err)
    return seen


def _bad_microbatches():
    gpt, _, _ = _gpt_problem(0)
    moe, _, _ = _gpt_problem(4)
    return raised({
        "zero": lambda: apply_tp(copy.deepcopy(gpt), microbatches=0),
        "sp": lambda: apply_tp(copy.deepcopy(gpt), microbatches=2, sequence_parallel=True),
        "plain": lambda: apply_tp(copy.deepcopy(gpt), microbatches=2, overlap=False),
        "moe": lambda: apply_tp(copy.deepcopy(moe), microbatches=2),
    })


def test_apply_tp_refuses_microbatches_it_cannot_interleave():
    seen = run_ranks(_bad_microbatches, 2)[0]
    assert "microbatches must be a positive integer, got 0" in seen["zero"]
    assert "but sequence_parallel is set" in seen["sp"]
    assert "but overlap=False" in seen["plain"]
    assert "its MLPs are mixtures of experts" in seen["moe"]


def _schedule(parts):
    """The order in which the interleaved blocks start and finish their projections."""
    from plait.nn import linear

    events = []
    start, finish = linear.RowParallelLinear.start, linear.Started.finish
    mb = {}

    def logged_start(self, x, chunks=None):
        started = start(self, x, chunks)
        mb[id(started)] = len([e for e in events if e[0] == "start"]) % parts
        events.append(("start", mb[id(started)]))
        return started

    def logged_finish(self):
        events.append(("finish", mb[id(self)]))
        return finish(self)

    linear.RowParallelLinear.start, linear.Started.finish = logged_start, logged_finish
    ref, idx, targets = _gpt_problem(0)
    par = apply_tp(copy.deepcopy(ref), chunks=2, microbatches=parts)
    par(idx, targets)[1].backward()
    return events


def test_microbatches_take_turns_at_the_wire():
    """Micro-batch 1 starts its branch's all-reduce before micro-batch 0's is waited for:
    each all-reduce is on the wire while the other micro-batch computes."""
    events = run_ranks(_schedule, 2, 2)[0]
    branches = 2 * 2  # blocks × (attention, MLP)
    expect = [("start", 0), ("start", 1)]
    for _ in range(branches - 1):
        expect += [("finish", 0), ("start", 0), ("finish", 1), ("start", 1)]
    assert events == expect + [("finish", 0), ("finish", 1)]


def test_apply_tp_refuses_bad_plans():
    seen = run_ranks(_bad_plans, 2)[0]
    assert "shard sizes [4, 0] leave rank 1 with no heads" in seen["heads"]
    assert "plans ['head'] name neither a kind" in seen["typo"]
    assert "sum to 31 columns, but the dimension has 32" in seen["mlp"]



def test_one_process_without_a_group_changes_nothing():
    for experts in (0, 4):
        ref, idx, targets = _gpt_problem(experts)
        par = apply_tp(copy.deepcopy(ref), sequence_parallel=True)
        assert torch.equal(ref(idx, targets)[1], par(idx, targets)[1])
    ref, inputs, _ = _dlrm_problem({"tables_n": 3})
    assert torch.equal(ref(*inputs), apply_tp(copy.deepcopy(ref))(*inputs))
