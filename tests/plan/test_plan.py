"""ShardPlan: a pure value, tested without processes."""

import json

import pytest
from hypothesis import given, strategies as st

from plait.plan import ShardPlan


def test_even_offsets_and_slices():
    plan = ShardPlan.even(10, 3)
    assert plan.sizes == (4, 3, 3) and plan.offsets == (0, 4, 7, 10) and plan.total == 10
    assert plan.slice_of(1) == slice(4, 7) and plan.start_of(2) == 7 and plan.world == 3
    assert ShardPlan.even(12, 2, quantum=4).sizes == (8, 4)
    assert plan.owner_of(0) == 0 and plan.owner_of(6) == 1 and plan.owner_of(9) == 2
    assert ShardPlan((0, 3)).owner_of(0) == 1
    assert ShardPlan((2, 1)).scaled(64).sizes == (128, 64)


def test_proportional_follows_speeds_in_whole_quanta():
    assert ShardPlan.proportional(12, [2.0, 1.0]).sizes == (8, 4)
    assert ShardPlan.proportional(16, [3.0, 1.0], quantum=4).sizes == (12, 4)
    assert ShardPlan.proportional(4, [100.0, 1.0]).sizes == (3, 1)  # a slow rank keeps one
    assert ShardPlan.proportional(4, [100.0, 1.0], minimum=0).sizes == (4, 0)


@given(st.integers(0, 500), st.lists(st.floats(0.1, 10.0), min_size=1, max_size=8),
       st.sampled_from([1, 2, 4]))
def test_proportional_covers_the_dim(units, speeds, quantum):
    plan = ShardPlan.proportional(units * quantum, speeds, quantum=quantum)
    assert plan.total == units * quantum and plan.world == len(speeds)
    assert all(s % quantum == 0 for s in plan.sizes)
    if units >= len(speeds):
        assert min(plan.sizes) >= quantum
    free = ShardPlan.proportional(units * quantum, speeds, quantum=quantum, minimum=0)
    ideal = [units * s / sum(speeds) for s in speeds]  # largest remainder: within one quantum
    assert free.total == units * quantum
    assert all(abs(s // quantum - i) < 1 for s, i in zip(free.sizes, ideal))


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8))
def test_round_trips_through_json(sizes):
    plan = ShardPlan(tuple(sizes))
    assert ShardPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert ShardPlan(sizes) == plan  # a list is kept as a tuple: hashable, frozen


def test_checks_name_the_values():
    with pytest.raises(ValueError, match=r"shard sizes \[512, 512, 0\] leave rank 2 with no columns"):
        ShardPlan((512, 512, 0)).check(1024, 3, what="columns")
    with pytest.raises(ValueError, match=r"sum to 1000 columns, but the dimension has 1024"):
        ShardPlan((500, 500)).check(1024, 2, what="columns")
    with pytest.raises(ValueError, match="name 2 ranks, but the group has 4"):
        ShardPlan((2, 2)).check(4, 4)
    ShardPlan((4, 0)).check(4, 2, allow_empty=True)
    with pytest.raises(ValueError, match="negative"):
        ShardPlan((3, -1))
    with pytest.raises(TypeError, match="integers"):
        ShardPlan((1.5, 2))
    with pytest.raises(ValueError, match="not a non-negative multiple of the quantum 4"):
        ShardPlan.even(10, 2, quantum=4)
    with pytest.raises(ValueError, match="positive and finite"):
        ShardPlan.proportional(10, [1.0, 0.0])
    with pytest.raises(ValueError, match="outside"):
        ShardPlan((1, 1)).slice_of(2)
