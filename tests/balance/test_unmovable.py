"""The speed monitor's unmovable time (``SpeedMonitor.fixed()``) and the plans the balancer
makes from it, on ranks that are virtual devices (:mod:`plait.testing.virtual`): a rank's
clock moves only by its matrix products' FLOPs, so every reading is a ratio of FLOP counts
known from the shapes and is checked to 1e-9, and the plan is ``static_plan``'s for it
exactly. A rank that also spends longer on work no plan moves is given less than its speed's
share. (On the CPU clock of 2 shared cores a rank's reading alone wandered by 0.1 and a
clean clone read 0.69 against 0.57 for a 1.5 × contrast: how well the real monitor reads is
``plait bench hetero``'s to measure.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from plait.nn import ColumnParallelLinear, RowParallelLinear
from plait.testing import run_ranks
from plait.nn.record import record

B, D, H = 64, 512, 1536  # batch rows, model width, the MLP's columns (the dim a plan splits)
EXTRA = 6  # the last rank's extra products outside the layers, each [B, D] @ [D, D]


def _gemm(m: int, k: int, n: int) -> int:
    """FLOPs of an [m, k] @ [k, n] product."""
    return 2 * m * k * n


# A training step's products, over all ranks (each rank does its 1/p of the sharded ones):
# the column layer's forward and weight gradient (its input needs no gradient), the row
# layer's forward, input and weight gradients: 5 of H·B·D. The replicated head (every rank,
# outside the timed layers): forward, input and weight gradients.
MOVABLE = 5 * _gemm(B, D, H)
EVAL = 2 * _gemm(B, D, H)  # an evaluation's forward: timed too (its work counts no step)
HEAD = 3 * _gemm(B, D, D)


def _model():
    """An MLP the plan splits (``H`` columns) and a replicated head, work no plan moves."""
    torch.manual_seed(0)
    model = nn.Sequential(ColumnParallelLinear(D, H, seed=0), RowParallelLinear(H, D, seed=1),
                          nn.Linear(D, D))
    record(model, dims={"mlp": ("0", "1")})
    return model


def _extra(rank: int, on: int, n: int) -> None:
    """On rank ``on``, ``n`` products outside the layers (unmovable work, as a rank slow at
    its replicated layers does)."""
    if rank == on:
        a, w = torch.ones(B, D), torch.ones(D, D)
        for _ in range(n):
            a @ w


def _measured(n_extra: int):
    """The monitor attached (every 2 steps, window 2), 4 steps with this rank's extra work;
    after each exchange the unmovable times. Rank 0 does the same extra work in an
    evaluation before each step, which begins no step."""
    from plait.balance import SpeedMonitor
    from plait.testing.virtual import VirtualDevice

    device = VirtualDevice().install()  # in this rank's process only
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = SpeedMonitor(every=2, window=2)
    monitor.attach(model)
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    readings = []
    with device:
        for _ in range(4):
            with torch.no_grad():  # not a training step: rank 0's work here is not counted
                model.eval()
                model(x)
                _extra(rank, 0, n_extra)
                model.train()
            loss = model(x).square().mean()
            _extra(rank, world - 1, n_extra)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if monitor.step():
                readings.append(monitor.fixed())
    return readings


@pytest.mark.parametrize("world", [2, 3])
def test_the_monitor_reads_a_ranks_extra_unmovable_work(world):
    """The last rank does extra products outside the layers each step. Every rank holds the
    same unmovable times: each rank's FLOPs outside the timed layers in a training step (the
    replicated head's, and the last rank's extra) over the step's whole movable compute at
    the fastest speed (every rank's timed FLOPs, the evaluation's forward included), exactly.
    Without the extra work every rank reads the head's share, exactly alike. Rank 0 does as
    much work in an evaluation before each step, which is not counted."""
    out = run_ranks(_measured, world, EXTRA)
    assert all(r == out[0] for r in out), out  # every rank holds the same figures
    whole = MOVABLE + EVAL
    want = [HEAD / whole] * (world - 1) + [(HEAD + EXTRA * _gemm(B, D, D)) / whole]
    assert len(out[0]) == 2, out
    for fixed in out[0]:
        assert fixed == pytest.approx(want, rel=1e-9), (fixed, want)
    alike = run_ranks(_measured, world, 0)[0]
    for fixed in alike:
        assert len(set(fixed)) == 1 and fixed[0] == pytest.approx(HEAD / whole, rel=1e-9), alike


def _balanced(n_extra: int):
    """Policy migrate on the MLP, the last rank emulated 2 × slower in the layers and doing
    ``n_extra`` products outside them each step: the decisions (step, kind, sizes) and the
    policy's basis (speeds) and unmovable times at the migration."""
    from plait.balance import Balancer, PolicyConfig
    from plait.testing.virtual import VirtualDevice
    from plait.runtime import SlowSpec, Straggler, rank_context

    device = VirtualDevice().install()  # in this rank's process only
    rank, world = dist.get_rank(), dist.get_world_size()
    slow = Straggler([SlowSpec(world - 1, 2.0)], rank)
    rank_context().straggler = slow
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    balancer = Balancer(model, opt, None, PolicyConfig(name="migrate"), every=2, window=2,
                        warmup=1)
    x = torch.randn(B, D, generator=torch.Generator().manual_seed(0))
    for step in range(4):
        slow.set_step(step)
        with device:
            loss = model(x).square().mean()
            _extra(rank, world - 1, n_extra)
            loss.backward()
        opt.step()
        opt.zero_grad()
        balancer.step(step)
    policy = balancer.policies["mlp"]
    return ([(d.step, d.kind, d.sizes) for d in balancer.log], policy.basis,
            policy.basis_fixed)


@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_slow_at_unmovable_work_too_is_given_less_than_its_speeds_share(world):
    """A rank 2 × slower in the layers that also spends extra time outside them (a device slow
    at everything) is migrated, at the first exchange after the warm-up step (step 2, the
    window half full), to the plan that finishes every rank together counting that time:
    ``static_plan`` with the unmovable times (the head's FLOPs, and the extra's, over the
    step's movable FLOPs at the fastest speed), less than its speed's share. Without the
    extra work the ranks read alike, exactly, and the plan is the one by speed alone."""
    from plait.balance import static_plan

    speeds = (1.0,) * (world - 1) + (0.5,)
    for n_extra in (EXTRA, 0):
        out = run_ranks(_balanced, world, n_extra)
        assert all(r == out[0] for r in out), out
        decisions, basis, fixed = out[0]
        want = [HEAD / MOVABLE] * (world - 1) + [(HEAD + n_extra * _gemm(B, D, D)) / MOVABLE]
        assert basis == pytest.approx(speeds, rel=1e-9), basis
        assert fixed == pytest.approx(want, rel=1e-9), (fixed, want)
        plan = static_plan(H, speeds, fixed=want).sizes
        assert decisions == [(2, "migrate", plan)], (decisions, plan)
        by_speed = static_plan(H, speeds).sizes
        if n_extra:
            assert plan[-1] < by_speed[-1], (plan, by_speed)
        else:  # alike: the plan by speed alone
            assert len(set(fixed)) == 1 and plan == by_speed, (fixed, plan, by_speed)
