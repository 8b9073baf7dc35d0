"""plait.balance.migrate: training with two migrations at step boundaries computes what
single-process training computes, on 2 and 3 ranks, on the plain and the fused path (the fused
row-parallel layer's weight gradient deferred), with SGD (momentum), Adam and AdamW (amsgrad).

The reference is the same three ``nn.Linear`` layers in one process. Compared: every step's
loss; and, right after each migration and after training, every weight, its gradient and each
optimizer-state tensor (momentum, Adam's moments and ``max_exp_avg_sq``, ``step``) gathered
whole. Tolerance: float64 ≤ 1e-12 (each tensor relative to its largest entry; only the order of
the row-parallel sum differs, and agreement is ~1e-15); float32 ≤ 2e-6 (the same reordering in
float32 rounding, carried through 8 Adam steps; ~2e-7 seen).
"""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from plait.balance import migrate
from plait.balance.migrate import moved_units
from plait.nn import ColumnParallelLinear, RowParallelLinear, ShardPlan
from plait.testing import raised, run_ranks

N_STEPS = 8
LAYERS = ("fc", "proj", "qk")
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


def _reference(dtype):
    """The single-process model's layers, seeded."""
    torch.manual_seed(0)
    return nn.ModuleDict({"fc": nn.Linear(16, 24, dtype=dtype),
                          "proj": nn.Linear(24, 16, dtype=dtype),
                          "qk": nn.Linear(16, 24, dtype=dtype)})


def _ref_loss(ref, x, target):
    y = ref["proj"](torch.tanh(ref["fc"](x)))
    return (y - target).square().mean() + (ref["qk"](x) ** 2).sum() / (8 * 24)


class _Mlp(nn.Module):
    """Column → tanh → row (the output replicated), and a two-block column layer counted in
    heads of 2 (a fused-QKV-like layer) whose sharded output is summed over the group."""

    def __init__(self, ref, overlap):
        super().__init__()
        kw = dict(overlap=overlap, chunks=2)
        self.fc = ColumnParallelLinear.from_module(ref["fc"], **kw)
        self.proj = RowParallelLinear.from_module(ref["proj"], **kw)
        self.qk = ColumnParallelLinear.from_module(ref["qk"], unit=2, blocks=2, **kw)

    def forward(self, x, target):
        y = self.proj(torch.tanh(self.fc(x)))  # [B, 16], replicated
        local = (self.qk(x) ** 2).sum() / (8 * 24)  # this rank's share of a sum over ranks
        return (y - target).square().mean() + local, local


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, amsgrad=True, weight_decay=0.1)


def _errors(model, opt, ref, ref_opt):
    """Per tensor name, |migrated − reference| over the reference's largest entry: every
    parameter, its gradient and each optimizer-state tensor, gathered whole (a collective)."""
    out = {}
    for lname in LAYERS:
        layer = getattr(model, lname)
        for key, p in layer.named_parameters(recurse=False):
            rp = getattr(ref[lname], key)
            pairs = {key: (layer.gather_like(key, p), rp)}
            assert (p.grad is None) == (rp.grad is None), (lname, key)
            if p.grad is not None:
                pairs[f"{key}.grad"] = (layer.gather_like(key, p.grad), rp.grad)
            state, ref_state = opt.state[p], ref_opt.state[rp]
            assert sorted(state) == sorted(ref_state), (lname, key, sorted(state))
            for k, v in state.items():
                pairs[f"{key}.{k}"] = (layer.gather_like(key, v) if v.dim() else v, ref_state[k])
            for name, (got, want) in pairs.items():
                assert got.shape == want.shape, (lname, name, got.shape, want.shape)
                scale = max(float(want.detach().abs().max()), 1e-30)
                out[f"{lname}.{name}"] = float((got - want).detach().abs().max()) / scale
    return out


def _train(dtype, opt_name, overlap, moves):
    """The migrated model and its reference trained side by side on the same batches."""
    ref = _reference(dtype)
    model = _Mlp(ref, overlap)
    opt, ref_opt = _optimizer(opt_name, model.parameters()), _optimizer(opt_name, ref.parameters())
    gen = torch.Generator().manual_seed(5)
    loss_err, state_err, reports = 0.0, {}, []
    for step in range(N_STEPS):
        if step in moves:
            reports.append(migrate(model, opt, moves[step]))
            for name, err in _errors(model, opt, ref, ref_opt).items():  # the move alone
                state_err[f"after move {step}: {name}"] = err
        x = torch.randn(8, 16, generator=gen, dtype=dtype).requires_grad_()
        target = torch.randn(8, 16, generator=gen, dtype=dtype)
        loss, local = model(x, target)
        ref_loss = _ref_loss(ref, x, target)
        for o, lo in ((opt, loss), (ref_opt, ref_loss)):
            o.zero_grad()
            lo.backward()
            o.step()
        shared = local.detach().clone()
        dist.all_reduce(shared)
        full_loss = float(loss.detach() - local.detach() + shared)
        loss_err = max(loss_err, abs(full_loss - float(ref_loss.detach())))
    for name, err in _errors(model, opt, ref, ref_opt).items():
        state_err[f"end: {name}"] = err
    sizes = {lname: getattr(model, lname).plan.sizes for lname in LAYERS}
    return loss_err, state_err, sizes, [(r.layers, r.bytes_moved, r.bytes_sent) for r in reports]


def _plans(world):
    if world == 2:
        first = {"fc": ShardPlan((18, 6)), "proj": ShardPlan((18, 6)), "qk": ShardPlan((4, 2))}
        second = {"fc": ShardPlan((5, 19)), "proj": ShardPlan((5, 19)), "qk": ShardPlan((1, 5))}
    else:
        first = {"fc": ShardPlan((14, 2, 8)), "proj": ShardPlan((14, 2, 8)),
                 "qk": ShardPlan((1, 4, 1))}
        second = {"fc": ShardPlan((3, 9, 12)), "proj": ShardPlan((3, 9, 12)),
                  "qk": ShardPlan((3, 1, 2))}
    return {3: first, 5: second}


CASES = [(torch.float64, "sgd", False), (torch.float64, "sgd", True),
         (torch.float64, "adam", False), (torch.float64, "adam", True),
         (torch.float64, "adamw", False), (torch.float64, "adamw", True),
         (torch.float32, "adamw", True)]


def _compare_all():
    world = dist.get_world_size()
    out = [(str(dtype), opt_name, overlap, *_train(dtype, opt_name, overlap, _plans(world)))
           for dtype, opt_name, overlap in CASES]
    return out, _bytes_case() if world == 2 else None, _refusals()


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request):
    """One launch per world size for the tests below: (world, each rank's results)."""
    return request.param, run_ranks(_compare_all, request.param)


def test_migration_leaves_training_unchanged(ranks):
    """Two migrations (steps 3 and 5) of three layers, plain and fused, three optimizers:
    losses, weights, gradients and optimizer state equal single-process training's; on 2
    ranks also the reported bytes."""
    world, results = ranks
    if world == 2:
        _check_bytes(*results[0][1])
    want_sizes = {lname: plan.sizes for lname, plan in _plans(world)[5].items()}
    for rank, (rank_results, *_) in enumerate(results):
        for dtype, opt_name, overlap, loss_err, state_err, sizes, reports in rank_results:
            case = (rank, dtype, opt_name, "fused" if overlap else "plain")
            tol = TOL[getattr(torch, dtype.split(".")[1])]
            assert loss_err <= tol, (case, loss_err)
            worst = max(state_err, key=state_err.get)
            assert state_err[worst] <= tol, (case, worst, state_err[worst])
            assert sum(k.startswith("after move") for k in state_err) > 0
            assert sizes == want_sizes, (case, sizes)
            assert [r[0] for r in reports] == [LAYERS] * 2
            assert all(r[1] > 0 and r[2] > r[1] for r in reports)
    reports = [[case[-1] for case in rank_results] for rank_results, *_ in results]
    assert all(r == reports[0] for r in reports)  # every rank reports the same costs


def test_moved_units():
    assert moved_units(ShardPlan((12, 12)), ShardPlan((18, 6))) == 6
    assert moved_units(ShardPlan((12, 12)), ShardPlan((12, 12))) == 0
    assert moved_units(ShardPlan((6, 6, 6, 6)), ShardPlan((9, 3, 6, 6))) == 3  # 6..8: 1 → 0
    with pytest.raises(ValueError, match="do not split the same dim"):
        moved_units(ShardPlan((1, 1)), ShardPlan((1, 2)))


def _bytes_case():
    """SGD with momentum, fp64, 2 ranks: fc's weight [24, 16], bias [24]; 6 columns move."""
    model = nn.Sequential(ColumnParallelLinear(16, 24, overlap=False, dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16, dtype=torch.float64)).sum().backward()
    opt.step()
    report = migrate(model, opt, {"0": ShardPlan((18, 6))})
    same = migrate(model, opt, {"0": ShardPlan((18, 6))})
    return report.bytes_moved, report.bytes_sent, same.layers, str(report)


def _check_bytes(moved, sent, again, text):
    per_column = (16 + 1) * 8  # a weight row and its bias element, float64
    assert moved == 3 * 6 * per_column  # weight, gradient, momentum
    assert sent == 3 * 24 * per_column * 1  # each tensor whole, to the one other rank
    assert again == () and "0 [12, 12]→[18, 6]" in text


def _refusals():
    """Each bad call on every rank (raised before any collective), then an unchanged plan
    (nothing moves) and a real move whose gathered weights equal those before it."""
    world = dist.get_world_size()
    model = nn.Sequential(ColumnParallelLinear(16, 24, dtype=torch.float64), nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model[0].weight]["odd"] = torch.zeros(3)
    seen = raised({
        "unknown name": lambda: migrate(model, None, {"fc": ShardPlan.even(24, world)}),
        "not a plait layer": lambda: migrate(model, None, {"1": ShardPlan((4,))}),
        "plan for another group": lambda: migrate(model, None,
                                                  {"0": ShardPlan.even(24, world + 1)}),
        "state of another shape": lambda: migrate(model, opt, {"0": ShardPlan.even(24, world)}),
    })
    del opt.state[model[0].weight]["odd"]
    before = model[0].full_state_dict()
    same = migrate(model, opt, {"0": ShardPlan.even(24, world)})
    moved = migrate(model, opt, {"0": ShardPlan((25 - world,) + (1,) * (world - 1))})
    after = model[0].full_state_dict()
    exact = all(torch.equal(before[k], after[k]) for k in before)
    return seen, (same.layers, same.bytes_moved), (moved.layers, exact)


def test_migrate_refuses_before_any_collective(ranks):
    """Every rank refuses each bad call, naming what is wrong, and the next good calls work:
    no rank was left inside a collective."""
    world, results = ranks
    for rank, (*_, (seen, same, moved)) in enumerate(results):
        assert re.fullmatch(r"ValueError: no layer 'fc' in the model; layers that can migrate: "
                            r"\['0'\]", seen["unknown name"]), (rank, seen)
        assert seen["not a plait layer"].startswith(
            "TypeError: layer '1' (Linear) cannot migrate"), (rank, seen)
        assert f"name {world + 1} ranks, but the group has {world}" in \
            seen["plan for another group"], (rank, seen)
        assert seen["state of another shape"].startswith(
            "ValueError: optimizer state 'odd' of 0.weight has shape (3,)"), (rank, seen)
        assert same == ((), 0), (rank, same)  # the plan it has: nothing moves
        assert moved == (("0",), True), (rank, moved)
