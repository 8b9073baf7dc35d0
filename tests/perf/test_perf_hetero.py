"""Heterogeneous ranks under each balancing policy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.perf.hetero import POLICIES, BalanceState, plan_policy, policy_step_time, step_policy

speeds_st = st.lists(st.floats(0.1, 4.0), min_size=2, max_size=16)


@settings(max_examples=80, deadline=None)
@given(speeds=speeds_st)
def test_even_waits_for_the_slowest_and_static_reaches_the_ideal(speeds):
    even = policy_step_time("even", 1.0, speeds)
    assert even["step_s"] == pytest.approx(1.0 / min(speeds))
    static = policy_step_time("static", 1.0, speeds)
    assert static["step_s"] == pytest.approx(static["ideal_s"])
    assert static["step_s"] <= even["step_s"] * (1 + 1e-9)
    assert static["skipped"] == 0.0 and sum(static["shares"]) == pytest.approx(1.0)


@settings(max_examples=80, deadline=None)
@given(speeds=speeds_st, max_skip=st.floats(0.0, 0.9))
def test_resize_is_lossy_but_bounded_and_never_slower_than_even(speeds, max_skip):
    r = policy_step_time("resize", 1.0, speeds, max_skip=max_skip)
    e = policy_step_time("even", 1.0, speeds)
    assert r["step_s"] <= e["step_s"] * (1 + 1e-9)
    assert 0.0 <= r["skipped"] <= max_skip / len(speeds) * (len(speeds) - 1) + 1e-9


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="even, static, resize, migrate, semi"):
        policy_step_time("greedy", 1.0, [1.0, 1.0])


def test_static_uses_nominal_speeds_only():
    true = np.array([1.0, 1.0, 1.0, 0.5])  # a transient spike static does not know about
    r = policy_step_time("static", 1.0, true, nominal=np.ones(4))
    assert r["step_s"] == pytest.approx(2.0)


def test_migrate_moves_only_when_it_pays_off():
    nominal, measured = np.ones(4), np.array([1.0, 1.0, 1.0, 0.5])
    _, state, cost = step_policy("migrate", None, nominal=nominal, measured=measured, work_s=1.0,
                                 move_s_per_share=1e-3)
    assert cost > 0 and state.shares[-1] < 0.25
    plan, state2, cost2 = step_policy("migrate", None, nominal=nominal, measured=measured,
                                      work_s=1e-6, move_s_per_share=10.0)
    assert cost2 == 0 and np.allclose(plan.shares, 0.25)  # too expensive for the benefit


def test_semi_resizes_spikes_and_migrates_persistent_imbalance():
    nominal = np.ones(4)
    state = BalanceState(np.full(4, 0.25), np.array([1.0, 1.0, 1.0, 0.5]))  # persistent slow rank
    spike = np.array([1.0, 0.5, 1.0, 0.5])  # rank 1 stalls this step only
    plan, _, _ = step_policy("semi", state, nominal=nominal, measured=spike, work_s=1.0,
                             move_s_per_share=1e-4, ema=0.0)
    assert plan.shares[3] < plan.shares[0]  # persistent part migrated
    assert plan.keep[1] < 1.0 and plan.keep[0] == 1.0  # transient part resized
    assert set(POLICIES) == {"even", "static", "resize", "migrate", "semi"}


def test_plans_broadcast_over_groups():
    speeds = np.random.default_rng(0).uniform(0.5, 1.5, (3, 5, 8))
    for pol in POLICIES:
        plan = plan_policy(pol, nominal=speeds)
        assert plan.shares.shape == speeds.shape
        assert np.allclose(plan.shares.sum(-1), 1.0)
