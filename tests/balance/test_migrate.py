"""plait.balance.migrate: training with a migration at a step boundary gives the losses of
training without it, on 2 and 4 ranks, with SGD (momentum), Adam and AdamW (amsgrad).

Tolerance: float64 ≤ 1e-6 and float32 ≤ 1e-5 per step's loss (the row-parallel sum runs in
another order after a migration; in practice float64 agrees to ~1e-15); the full weights and
the full optimizer state after training agree to the same tolerance.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from plait.balance import migrate
from plait.balance.migrate import moved_units
from plait.nn import ColumnParallelLinear, RowParallelLinear, ShardPlan
from plait.runtime.testing import run_ranks

N_STEPS = 8


class _Mlp(nn.Module):
    """Column → tanh → row (the output replicated), and a two-block column layer counted in
    heads of 2 (a fused-QKV-like layer) whose sharded output is summed over the group."""

    def __init__(self, dtype):
        super().__init__()
        self.fc = ColumnParallelLinear(16, 24, overlap=False, seed=1, dtype=dtype)
        self.proj = RowParallelLinear(24, 16, overlap=False, seed=2, dtype=dtype)
        self.qk = ColumnParallelLinear(16, 24, unit=2, blocks=2, overlap=False, seed=3, dtype=dtype)

    def forward(self, x, target):
        y = self.proj(torch.tanh(self.fc(x)))  # [B, 16], replicated
        local = (self.qk(x) ** 2).sum() / (8 * 24)  # this rank's share of a mean over ranks
        return (y - target).square().mean() + local, local


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, amsgrad=True, weight_decay=0.1)


def _train(dtype, opt_name, moves):
    torch.manual_seed(0)
    model = _Mlp(dtype)
    opt = _optimizer(opt_name, model.parameters())
    gen = torch.Generator().manual_seed(5)
    losses, reports = [], []
    for step in range(N_STEPS):
        if step in moves:
            reports.append(migrate(model, opt, moves[step]))
        x = torch.randn(8, 16, generator=gen, dtype=dtype)
        target = torch.randn(8, 16, generator=gen, dtype=dtype)
        loss, local = model(x, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        shared = local.detach().clone()
        dist.all_reduce(shared)
        losses.append(float(loss.detach() - local.detach() + shared))
    return model, opt, losses, reports


def _full_state(model, opt):
    """Every parameter and every optimizer-state tensor in full (a collective)."""
    out = {}
    for lname in ("fc", "proj", "qk"):
        layer = getattr(model, lname)
        for key, p in layer.named_parameters(recurse=False):
            out[f"{lname}.{key}"] = layer.gather_like(key, p)
            for k, v in opt.state[p].items():
                out[f"{lname}.{key}.{k}"] = layer.gather_like(key, v) if v.dim() else v.clone()
    return out


def _plans(world):
    if world == 2:
        first = {"fc": ShardPlan((18, 6)), "proj": ShardPlan((18, 6)), "qk": ShardPlan((4, 2))}
        second = {"fc": ShardPlan((5, 19)), "proj": ShardPlan((5, 19)), "qk": ShardPlan((1, 5))}
    else:
        first = {"fc": ShardPlan((9, 3, 6, 6)), "proj": ShardPlan((9, 3, 6, 6)),
                 "qk": ShardPlan((1, 2, 2, 1))}
        second = {"fc": ShardPlan((3, 3, 3, 15)), "proj": ShardPlan((3, 3, 3, 15)),
                  "qk": ShardPlan((3, 1, 1, 1))}
    return {3: first, 5: second}


def _compare_all():
    out = []
    cases = [(torch.float64, "sgd"), (torch.float64, "adam"), (torch.float64, "adamw"),
             (torch.float32, "adamw")]
    for dtype, opt_name in cases:
        ref_model, ref_opt, ref_losses, _ = _train(dtype, opt_name, {})
        model, opt, losses, reports = _train(dtype, opt_name, _plans(dist.get_world_size()))
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        want, got = _full_state(ref_model, ref_opt), _full_state(model, opt)
        state_err = max(float((want[k].double() - got[k].double()).abs().max()) for k in want)
        out.append((str(dtype), opt_name, loss_err, state_err, sorted(want) == sorted(got),
                    model.fc.plan.sizes, [(r.layers, r.bytes_moved, r.bytes_sent) for r in reports]))
    return out, _bytes_case() if dist.get_world_size() == 2 else None


@pytest.mark.parametrize("world", [2, 4])
def test_migration_leaves_training_unchanged(world):
    """Two migrations (steps 3 and 5) of three layers; on 2 ranks also the reported bytes."""
    both = run_ranks(_compare_all, world)
    results = [r[0] for r in both]
    if world == 2:
        _check_bytes(*both[0][1])
    for rank_results in results:
        for dtype, opt_name, loss_err, state_err, same_keys, fc_sizes, reports in rank_results:
            tol = 1e-6 if dtype == "torch.float64" else 1e-5
            assert loss_err <= tol and state_err <= tol, (dtype, opt_name, loss_err, state_err)
            assert same_keys and fc_sizes == _plans(world)[5]["fc"].sizes
            assert [r[0] for r in reports] == [("fc", "proj", "qk")] * 2
            assert all(r[1] > 0 and r[2] > r[1] for r in reports)
    reports = [[case[-1] for case in rank_results] for rank_results in results]
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


def test_migrate_refuses_before_any_collective():
    model = nn.Sequential(ColumnParallelLinear(16, 24), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no layer 'fc'.*can migrate: \\['0'\\]"):
        migrate(model, None, {"fc": ShardPlan((24,))})
    with pytest.raises(TypeError, match="layer '1' \\(Linear\\) cannot migrate"):
        migrate(model, None, {"1": ShardPlan((4,))})
    with pytest.raises(ValueError, match="name 2 ranks, but the group has 1"):
        migrate(model, None, {"0": ShardPlan((12, 12))})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model[0].weight]["odd"] = torch.zeros(3)
    with pytest.raises(ValueError, match="state 'odd' of 0.weight has shape \\(3,\\)"):
        migrate(model, opt, {"0": ShardPlan((24,))})
    report = migrate(model, None, {"0": ShardPlan((24,))})  # world 1: the plan is unchanged
    assert report.layers == () and report.bytes_moved == 0
