"""plait.balance.policy: pure decisions, no processes.

Plans: every property-based case must cover the dim exactly, in whole quanta,
with every rank holding some work. The SEMI state machine is driven by speed
traces (noisy constant speeds, a spike, a persistent slowdown), fed either
directly or through a model of the speed monitor (an EMA shared every few steps).
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.balance import (PolicyConfig, SemiPolicy, ema, imbalance, resize_fraction,
                           resize_fractions, static_plan)
from plait.plan import ShardPlan

speeds_st = st.lists(st.floats(0.05, 1.0), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(speeds=speeds_st, quanta_per_rank=st.integers(1, 40), quantum=st.sampled_from([1, 8, 64]))
def test_static_plan_covers_the_dim_in_quanta(speeds, quanta_per_rank, quantum):
    total = quantum * quanta_per_rank * len(speeds)
    plan = static_plan(total, speeds, quantum)
    assert plan.world == len(speeds) and plan.total == total
    assert all(s % quantum == 0 and s >= quantum for s in plan.sizes)
    exact = [total * s / sum(speeds) for s in speeds]
    if all(e >= quantum for e in exact):  # nobody lifted to the minimum: within a quantum
        assert all(abs(n - e) < quantum for n, e in zip(plan.sizes, exact))


def test_static_plan_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="fewer than the 3 ranks"):
        static_plan(16, [1, 1, 1], quantum=8)
    with pytest.raises(ValueError, match="not a non-negative multiple of the quantum 8"):
        static_plan(100, [1, 1], quantum=8)
    with pytest.raises(ValueError, match="positive and finite"):
        static_plan(64, [1.0, 0.0])
    with pytest.raises(ValueError, match="positive and finite"):
        static_plan(64, [1.0, float("nan")])
    assert static_plan(16, [1, 1, 1], quantum=8, allow_empty=True).total == 16


@settings(max_examples=100, deadline=None)
@given(speeds=speeds_st, max_skip=st.floats(0.0, 0.9))
def test_resize_fractions_finish_with_the_fastest(speeds, max_skip):
    keep = resize_fractions(speeds, max_skip=max_skip)
    assert all(1 - max_skip - 1e-12 <= k <= 1.0 for k in keep)
    assert max(keep) == 1.0
    pace = min(1 / s for s in speeds)
    for k, s in zip(keep, speeds):  # finishes with the fastest unless clipped at max_skip
        assert k / s <= pace * (1 + 1e-9) or k == pytest.approx(1 - max_skip)


def test_resize_fraction_under_an_uneven_plan():
    assert resize_fraction([1.0, 0.5], 1) == 0.5
    # rank 0 holds 3/4 of the work at speed 1 (time 6), rank 1 1/4 at speed 0.5 (time 4):
    # now rank 0 is the one to shrink, to 4/6 of its share
    assert resize_fractions([1.0, 0.5], ShardPlan((6, 2))) == (4 / 6, 1.0)
    assert resize_fractions([1.0, 0.5], ShardPlan((4, 4)), max_skip=0.25) == (1.0, 0.75)
    assert imbalance([1.0, 0.5], ShardPlan((4, 4)), (1.0, 0.5)) == 1.0
    with pytest.raises(ValueError, match="rank 2 is outside"):
        resize_fraction([1.0, 0.5], 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="fast"), "unknown balancing policy 'fast'"),
    (dict(quantum=0), "quantum must be a positive integer, got 0"),
    (dict(spike_steps=2.5), "spike_steps must be a positive integer"),
    (dict(trigger=1.1, release=1.2), "release=1.2, trigger=1.1"),
    (dict(release=1.0), "need 1 < release"),
    (dict(max_skip=1.0), "max_skip must be in"),
])
def test_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyConfig(**kwargs)


def test_policy_refuses_a_dim_too_small_and_wrong_speeds():
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        SemiPolicy(PolicyConfig(quantum=8), total=24, world=4)
    policy = SemiPolicy(PolicyConfig(), total=64, world=2)
    with pytest.raises(ValueError, match="name 3 ranks, but the group has 2"):
        policy.step([1.0, 1.0, 1.0])


def _noisy(base, steps, noise, seed):
    rng = random.Random(seed)
    return [[s * (1 + rng.uniform(-noise, noise)) for s in base] for _ in range(steps)]


def _drive(policy, trace):
    return [(t, a) for t, a in enumerate(policy.step(s) for s in trace) if a.kind != "none"]


@settings(max_examples=15, deadline=None)
@given(world=st.integers(2, 4), seed=st.integers(0, 10**6), slow=st.floats(0.3, 0.7))
def test_semi_does_not_oscillate_on_noisy_constant_speeds(world, seed, slow):
    cfg = PolicyConfig()
    even = SemiPolicy(cfg, total=64 * world, world=world)
    assert _drive(even, _noisy([1.0] * world, 200, 0.04, seed)) == []
    base = [1.0] * world
    base[seed % world] = slow
    policy = SemiPolicy(cfg, total=64 * world, world=world)
    acts = _drive(policy, _noisy(base, 300, 0.04, seed))
    assert [a.kind for _, a in acts] == ["resize", "migrate"], acts
    assert acts[0][0] == 0 and acts[1][0] == cfg.spike_steps - 1
    assert policy.fractions is None and policy.plan == acts[1][1].plan != policy.even


def _monitored(true_speeds, every, alpha):
    """What SpeedMonitor reports: each window's mean speed, folded into an EMA every ``every``."""
    out, smoothed, window = [], list(true_speeds[0]), []
    for speeds in true_speeds:
        window.append(speeds)
        if len(window) == every:
            mean = [len(window) / sum(1 / w[r] for w in window) for r in range(len(speeds))]
            smoothed = [ema(p, m, alpha) for p, m in zip(smoothed, mean)]
            window = []
        top = max(smoothed)
        out.append([s / top for s in smoothed])
    return out


@settings(max_examples=15, deadline=None)
@given(world=st.integers(2, 4), start=st.integers(20, 40), length=st.integers(4, 15),
       factor=st.floats(2.0, 3.0), seed=st.integers(0, 10**6))
def test_semi_bridges_a_spike_and_returns_to_even(world, start, length, factor, seed):
    """React within 10 steps of the spike's start, back to the even plan within 20 of its end,
    through the monitor's lag (shared every 4 steps, EMA 0.5), with 3 % noise."""
    slow = seed % world
    trace = _noisy([1.0] * world, 100, 0.03, seed)
    for t in range(start, start + length):
        trace[t][slow] /= factor
    policy = SemiPolicy(PolicyConfig(), total=64 * world, world=world)
    acts = _drive(policy, _monitored(trace, every=4, alpha=0.5))
    kinds = [a.kind for _, a in acts]
    assert acts and kinds[0] == "resize" and start <= acts[0][0] < start + 10, acts
    assert "migrate" not in kinds  # a spike shorter than spike_steps moves no data
    last = acts[-1]
    assert last[1].kind == "undo" and last[0] < start + length + 20, acts
    assert policy.fractions is None and policy.plan == policy.even
    assert all(a.reason for _, a in acts)


def test_semi_migrates_what_persists_and_returns_to_even_after():
    cfg = PolicyConfig(spike_steps=10, settle_steps=5)
    trace = [[1.0, 1.0]] * 5 + [[1.0, 0.5]] * 40 + [[1.0, 1.0]] * 20
    policy = SemiPolicy(cfg, total=64, world=2)
    acts = _drive(policy, trace)
    assert [(t, a.kind) for t, a in acts] == [(5, "resize"), (14, "migrate"), (49, "migrate")]
    assert acts[1][1].plan.sizes == (43, 21) and acts[2][1].plan == policy.even
    assert "back to the even plan" in acts[2][1].reason
    assert [t for t, _ in policy.log] == [5, 14, 49]


@pytest.mark.parametrize("name, kinds", [
    ("even", []),
    ("static", ["migrate"]),
    ("resize", ["resize", "undo"]),
    ("migrate", ["migrate", "migrate"]),
])
def test_each_policy_uses_only_its_parts(name, kinds):
    trace = [[1.0, 1.0]] * 3 + [[1.0, 0.5]] * 40 + [[1.0, 1.0]] * 20
    policy = SemiPolicy(PolicyConfig(name=name), total=64, world=2)
    assert [a.kind for _, a in _drive(policy, trace)] == kinds


@settings(max_examples=10, deadline=None)
@given(world=st.integers(2, 4), length=st.integers(40, 60), seed=st.integers(0, 10**6))
def test_semi_migrates_a_long_slowdown_and_returns_to_even_within_20_steps(world, length, seed):
    start, slow = 20, seed % world
    trace = _noisy([1.0] * world, start + length + 40, 0.03, seed)
    for t in range(start, start + length):
        trace[t][slow] /= 2.0
    policy = SemiPolicy(PolicyConfig(), total=64 * world, world=world)
    acts = _drive(policy, _monitored(trace, every=4, alpha=0.5))
    kinds = [a.kind for _, a in acts]
    assert kinds[0] == "resize" and acts[0][0] < start + 10, acts
    assert kinds.count("migrate") == 2, acts  # there, and back
    back = acts[-1]
    assert back[1].plan == policy.even and back[0] < start + length + 20, acts
    assert policy.fractions is None


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), noise=st.floats(0.0, 0.04))
def test_semi_leaves_a_migrated_plans_quantization_alone(seed, noise):
    """16 heads on 4 ranks, one 2× slower: no plan in whole heads balances it (the
    proportional one leaves ~1.25), but that residual is the plan's, not a new slowdown: semi
    migrates once and then neither resizes the fast ranks nor migrates again.

    Readings are off by up to ``noise`` each, and so is the basis the migration kept, so
    two ranks can depart from it by ((1 + noise) / (1 - noise))²: under the trigger (1.2)
    only for noise below 4.56 %. At 4.88 % (seed 32) a departure of 1.2 was real by the
    policy's own rule, and it resized as it should."""
    base = [1.0, 1.0, 1.0, 0.5]
    policy = SemiPolicy(PolicyConfig(spike_steps=12), total=16, world=4)
    acts = _drive(policy, _noisy(base, 150, noise, seed))
    assert [a.kind for _, a in acts] == ["resize", "migrate"], acts
    assert imbalance(base, policy.plan) >= policy.config.trigger  # the residual is real
    # and a real departure from the migrated plan's speeds is still bridged
    spike = _drive(policy, [[1.0, 0.4, 1.0, 0.5]] * 3)
    assert spike and spike[0][1].kind == "resize"


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), length=st.integers(9, 10))
def test_semi_does_not_migrate_a_spike_the_monitor_stretches(seed, length):
    """A 3× spike of 9–10 steps seen through the monitor (every 2 steps, EMA 0.5) reads as
    imbalanced for longer than spike_steps=12; it is receding by then, so it is resized and
    undone, never migrated; a 2× slowdown that stays is still migrated."""
    cfg = PolicyConfig(spike_steps=12)
    trace = _noisy([1.0, 1.0], 80, 0.03, seed)
    for t in range(20, 20 + length):
        trace[t][1] /= 3.0
    seen = _monitored(trace, every=2, alpha=0.5)
    assert sum(imbalance(s) >= cfg.trigger for s in seen) >= cfg.spike_steps  # looks long
    kinds = [a.kind for _, a in _drive(SemiPolicy(cfg, total=64, world=2), seen)]
    assert "resize" in kinds and "migrate" not in kinds and kinds[-1] == "undo", kinds
    stays = _noisy([1.0, 1.0], 80, 0.03, seed)
    for t in range(20, 80):
        stays[t][1] /= 2.0
    kinds = [a.kind for _, a in _drive(SemiPolicy(cfg, total=64, world=2),
                                       _monitored(stays, every=2, alpha=0.5))]
    assert kinds[:1] == ["resize"] and "migrate" in kinds, kinds


def test_confirm_steps_lets_one_noisy_reading_pass():
    trace = [[1.0, 1.0]] * 5 + [[1.0, 0.7]] * 2 + [[1.0, 1.0]] * 10 + [[1.0, 0.5]] * 6
    eager = _drive(SemiPolicy(PolicyConfig(), total=64, world=2), trace)
    assert eager[0][0] == 5 and eager[0][1].kind == "resize"
    patient = _drive(SemiPolicy(PolicyConfig(confirm_steps=3), total=64, world=2), trace)
    assert [(t, a.kind) for t, a in patient] == [(19, "resize")]
    with pytest.raises(ValueError, match="confirm_steps must be a positive integer"):
        PolicyConfig(confirm_steps=0)
