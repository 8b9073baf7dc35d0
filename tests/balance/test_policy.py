"""plait.balance.policy: pure decisions, no processes.

Plans: every property-based case must cover the dim exactly, in whole quanta,
with every rank holding some work. The SEMI state machine is driven by speed
traces (noisy constant speeds, a spike, a persistent slowdown), fed either
directly or through a model of the speed monitor (an EMA shared every few steps).
"""

import json
import os
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from plait.balance import (PolicyConfig, SemiPolicy, ema, imbalance, resize_fraction,
                           resize_fractions, static_plan)
from plait.balance.speed import window_speed
from plait.plan import ShardPlan

JITTER = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "scenarios",
                      "jitter.json")

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
@example(world=3, start=20, length=15, factor=3.0, seed=28)  # back exactly 20 steps after
def test_semi_bridges_a_spike_and_returns_to_even(world, start, length, factor, seed):
    """React within 10 steps of the spike's start, back to the even plan within 20 of its end
    (20 included: the longest, strongest spike drawn, 15 steps at 3 ×, was undone 20 steps
    after it ended in a CI run), through the monitor's lag (shared every 4 steps, EMA 0.5),
    with 3 % noise."""
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
    assert last[1].kind == "undo" and last[0] <= start + length + 20, acts
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


def _closed_loop(policy, true_speeds, every=2, window=5, *, warmup=0, recent=True,
                 resized_reads=1.0, fixed=None):
    """``policy`` fed as ``Balancer`` feeds it: the first ``warmup`` steps unmeasured and
    not decided on, then a ``SpeedMonitor`` model that takes one reading per rank every
    ``every`` steps (the window's speed, work over time), reports the trimmed mean of the
    last ``window`` readings (``window_speed``) with confidence ``readings / window`` and
    the newest 2 readings (``recent()``; not given if ``recent`` is False), and drops its
    readings whenever an action is applied (the plan changed). A rank resized to compute
    less than all its share reads ``resized_reads`` × its speed (a narrower GEMM costs more
    per unit). ``fixed``: each step's unmovable times, as the monitor reports them (None:
    none). Returns the actions."""
    readings, acts, since, steps = [], [], [], 0
    for t, speeds in enumerate(true_speeds):
        if t < warmup:
            continue
        steps += 1
        if policy.fractions is not None:
            speeds = [s * (resized_reads if f < 1 else 1.0)
                      for s, f in zip(speeds, policy.fractions)]
        since.append(speeds)
        if steps % every == 0:
            readings.append([len(since) / sum(1 / w[r] for w in since)
                             for r in range(len(speeds))])
            readings, since = readings[-window:], []
        seen = ([window_speed([r[i] for r in readings]) for i in range(len(speeds))]
                if readings else [1.0] * len(speeds))
        newest = [[s / max(r) for s in r] for r in readings[-2:]] if recent else None
        action = policy.step([s / max(seen) for s in seen], len(readings) / window, newest,
                             None if fixed is None else fixed[t])
        if action.kind != "none":
            acts.append((t, action))
            readings, since = [], []
    return acts


def _jitter(world, steps, seed, dip=0.7, chance=0.15, noise=0.05):
    """No straggler: 5 % noise, and now and then (``chance`` a step) one rank at random, never
    the one of the step before, reads ``dip`` for a step: a shared machine's jitter."""
    rng = random.Random(seed)
    trace = _noisy([1.0] * world, steps, noise, seed)
    last = None
    for t in range(steps):
        rank = rng.randrange(world) if rng.random() < chance else None
        if rank is not None and rank != last:
            trace[t][rank] *= dip
        last = rank
    return trace


@pytest.mark.parametrize("world", [2, 3, 4])
def test_semi_makes_no_decision_under_jitter_alone(world):
    """Through the monitor's window (trimmed mean of 5 readings, every 2 steps) and
    ``confirm_steps=3`` (what ``plait bench hetero`` runs): 10 seeds × 300 steps of jitter
    without a persistent straggler (5 % noise; a tenth of the steps, one rank 0.7×), no
    decision. (Not so with 0.5× dips in a tenth of the steps, 8 of 60 runs of 2 to 4 ranks
    resized, nor 0.7× in a quarter, 5 of 60.) Each reading taken alone (a window of one)
    and acted on at once (``confirm_steps=1``) resizes."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    for seed in range(10):
        trace = _jitter(world, 300, seed, dip=0.7, chance=0.1)
        assert _closed_loop(SemiPolicy(cfg, total=64 * world, world=world), trace) == [], seed
    hasty = PolicyConfig(confirm_steps=1, spike_steps=12)
    trace = _jitter(world, 300, 0, dip=0.7, chance=0.1)
    assert _closed_loop(SemiPolicy(hasty, total=64 * world, world=world), trace, window=1)



@pytest.mark.parametrize("world", [2, 3, 4])
def test_semi_makes_no_decision_under_the_shipped_jitter_file(world):
    """examples/scenarios/jitter.json (every rank 1.0-1.5 ×, a new draw every step), its own
    seed and 9 others, 1000 steps each, read as ``plait bench hetero`` reads it (a reading
    every 2 steps, a window of 5, ``confirm_steps=3``): no decision. The same draws on a 2 ×
    last rank: a resize, then a migration. (The run itself, on a shared machine, is not a
    fair judge of the first claim: a CI run's real load, 1.42 × on one rank, was rightly
    bridged by two resizes in the jitter run and missed by the interleaved run with none.)"""
    from plait.runtime.slow.scenarios import factors_at
    from plait.runtime.slow.scenario_file import parse_scenario

    data = json.load(open(JITTER))
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    for seed in [data["slow"][0]["jitter"]["seed"], *range(9)]:
        data["slow"][0]["jitter"]["seed"] = seed
        specs = parse_scenario(data).specs(world, 1000)
        factors = [factors_at(specs, world, s) for s in range(1000)]
        trace = [[1 / f for f in step] for step in factors]
        assert _closed_loop(SemiPolicy(cfg, total=64 * world, world=world), trace) == [], seed
        straggled = [[1 / (f * (2 if r == world - 1 else 1)) for r, f in enumerate(step)]
                     for step in factors[:100]]
        acts = _closed_loop(SemiPolicy(cfg, total=64 * world, world=world), straggled)
        kinds = [a.kind for _, a in acts]
        assert kinds[0] == "resize" and "migrate" in kinds, (seed, acts)

def test_semi_bridges_a_spike_by_resizing_and_undoes_it():
    """A 3× spike for 8 steps (as ``plait bench hetero``'s ``spike``): resized while it lasts,
    undone after it ends, never migrated."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    trace = _noisy([1.0, 1.0], 80, 0.03, 1)
    for t in range(20, 28):
        trace[t][1] /= 3.0
    policy = SemiPolicy(cfg, total=64, world=2)
    acts = _closed_loop(policy, trace)
    assert [a.kind for _, a in acts] == ["resize", "undo"], acts
    assert 20 <= acts[0][0] < 28 and acts[1][0] < 28 + 15, acts
    assert policy.fractions is None and policy.plan == policy.even


class _NoRise(SemiPolicy):
    """SEMI without the undo on resized ranks that read faster than when resizing began."""

    def _rose(self, speeds):
        return 1.0


@pytest.mark.parametrize("name", ["semi", "resize"])
def test_a_resizing_that_outlives_its_spike_is_undone(name):
    """The same spike, as the kernel-made bench runs read it: the slow rank's unmovable time
    doubled while it lasted (0.28 against 0.56 when the resizing began), and the resized
    rank reads 0.86 × its speed while resized (a narrower GEMM and the resizing's own
    work; 0.79-0.91 after those spikes ended). The policy keeps the unmovable times from
    before the resizing while resized, so by them the resizing still looks about right
    (1.1) and the ranks unresized 1.5 apart, and no other test ends it. Its resized rank
    reads well over its speed when the resizing began: the slowdown is over, and it is
    undone. Without that test it stays resized to the end (what 8 of those 12 runs did,
    losing 0.21-0.67 pp of held-out accuracy)."""
    cfg = PolicyConfig(name=name, confirm_steps=3, spike_steps=12)
    trace = _noisy([1.0, 1.0], 80, 0.03, 1)
    fixed = [[0.3, 0.3] for _ in trace]
    for t in range(20, 28):
        trace[t][1] /= 3.0
        fixed[t][1] = 0.6
    policy = SemiPolicy(cfg, total=64, world=2)
    acts = _closed_loop(policy, trace, resized_reads=0.86, fixed=fixed)
    assert [a.kind for _, a in acts] == ["resize", "undo"], acts
    assert acts[1][0] < 28 + 15 and "over:" in acts[1][1].reason, acts
    assert policy.fractions is None and policy.plan == policy.even
    stuck = _closed_loop(_NoRise(cfg, total=64, world=2), trace, resized_reads=0.86,
                         fixed=fixed)
    assert [a.kind for _, a in stuck] == ["resize"], stuck


@pytest.mark.parametrize("world", [2, 3])
def test_semi_migrates_a_persistent_straggler_once_its_resizing_undone(world):
    """A 2× straggler from step 10 to the end: resized (again as the window's reading
    settles from 0.67 to 0.5, on 2 ranks), then one migration, which ends the resizing; and
    nothing more: no resize on top of the migrated plan."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    trace = _noisy([1.0] * world, 150, 0.03, world)
    for t in range(10, 150):
        trace[t][world - 1] /= 2.0
    policy = SemiPolicy(cfg, total=64 * world, world=world)
    acts = _closed_loop(policy, trace)
    kinds = [a.kind for _, a in acts]
    assert kinds[-1] == "migrate" and set(kinds[:-1]) == {"resize"} and len(kinds) <= 3, acts
    assert policy.fractions is None and policy.plan.sizes[-1] < policy.even.sizes[-1]


class _Unfloored(SemiPolicy):
    """SEMI that sizes a migration from a resizing by the readings under it as they are,
    however far below those before the resizing (``_sizing``)."""

    def _sizing(self, speeds):
        return speeds


@pytest.mark.parametrize("world", [2, 3])
def test_semi_sizes_a_migration_from_resizing_by_the_readings_before_it(world):
    """A 2× straggler from the start (the window settled when the resizing starts, as in
    bench hetero's straggler-2x), read at 0.38 while resized (0.76 × its speed; 0.5
    otherwise): semi migrates once, straight to the plan of its true speed, with nothing
    after. Unfloored, the migration gives the slow rank too little (what the bench's logs
    showed: 702 to 752 of 1024 columns to the fast rank where 683 fit) and is corrected."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    trace = _noisy([1.0] * (world - 1) + [0.5], 150, 0.02, world)
    true_plan = static_plan(1024 * world, [1.0] * (world - 1) + [0.5])
    policy = SemiPolicy(cfg, total=1024 * world, world=world)
    acts = _closed_loop(policy, trace, warmup=6, resized_reads=0.76)
    kinds = [a.kind for _, a in acts]
    assert kinds[-1] == "migrate" and set(kinds[:-1]) == {"resize"}, acts
    moved = acts[-1][1].plan.sizes[-1]
    assert abs(moved - true_plan.sizes[-1]) <= 0.03 * true_plan.sizes[-1], acts
    assert "no lower than before resizing" in acts[-1][1].reason, acts
    unfloored = _closed_loop(_Unfloored(cfg, total=1024 * world, world=world), trace,
                             warmup=6, resized_reads=0.76)
    first = next(a for _, a in unfloored if a.kind == "migrate")
    assert first.plan.sizes[-1] < 0.9 * true_plan.sizes[-1], unfloored


class _Unchecked(_Unfloored):
    """SEMI without the check of a plan sized under resizing (nor the floor)."""

    def _apply(self, action, speeds, settled):
        super()._apply(action, speeds, settled)
        self.check_since = None


@pytest.mark.parametrize("world", [2, 3])
def test_semi_corrects_a_plan_sized_under_resizing_and_resizes_nothing_on_top(world):
    """A 2× straggler from step 10, read at 0.32 while resized (0.65 × its speed, as a quiet
    bench hetero run read it; 0.5 otherwise). Without the floor (a resizing that starts on a
    window still holding readings from before the onset has none), the migration sized from
    the readings under it gives the slow rank too little, and the first confident readings under
    that plan correct it, once, to the plan of its true speed; no resize on top, nothing
    after. Unchecked, the too-small plan is bridged by resizing the fast rank (what the
    bench's log showed: keep 0.80 on rank 0)."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    trace = _noisy([1.0] * world, 150, 0.02, world)
    for t in range(10, 150):
        trace[t][world - 1] /= 2.0
    true_plan = static_plan(1024 * world, [1.0] * (world - 1) + [0.5])
    policy = _Unfloored(cfg, total=1024 * world, world=world)
    acts = _closed_loop(policy, trace, resized_reads=0.65)
    kinds = [a.kind for _, a in acts]
    assert kinds[-2:] == ["migrate", "migrate"] and set(kinds[:-2]) == {"resize"}, acts
    first, fixed = (a.plan.sizes[-1] for _, a in acts[-2:])
    assert first < 0.9 * true_plan.sizes[-1] and "correcting" in acts[-1][1].reason
    assert abs(fixed - true_plan.sizes[-1]) <= 0.03 * true_plan.sizes[-1], acts
    assert acts[-1][0] - acts[-2][0] <= 8  # at the first confident readings (3 of 5, every 2)
    unchecked = _closed_loop(_Unchecked(cfg, total=1024 * world, world=world), trace,
                             resized_reads=0.65)
    assert any(a.kind == "resize" and a.fractions[0] < 1 for _, a in unchecked), unchecked


class _Unbounded(_Unfloored):
    """SEMI whose plan check takes the first readings under the new plan as they are: the
    readings before the resizing named by ``forget`` (``before_resize``: the speeds;
    ``before_fixed``: the unmovable times) are dropped before it bounds by them."""

    forget = "before_resize"

    def _check_plan(self, speeds):
        setattr(self, self.forget, None)
        return super()._check_plan(speeds)


@pytest.mark.parametrize("world", [2, 3])
def test_semi_plan_check_moves_no_further_than_the_readings_before_resizing(world):
    """What a kernel-throttled run of bench hetero logged (run 3, seed 0): a 2× rank read
    0.52 when the resizing started, 0.49 under it (the migration's basis), 0.60 on the first
    confident readings under the migrated plan, then 0.46. The check counts the 0.60 only as
    far as 0.52, which the plan fits: no correction, and 0.46 is no departure from 0.52, so
    nothing is resized on top. Unbounded, it corrected to the 0.60 plan and then resized the
    fast rank on top when the readings came back (what the run did)."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    fast = [1.0] * (world - 1)
    trace = ([(fast + [0.52], 1.0)] * 3 + [(fast + [0.49], 1.0)] * 9  # migrated at step 11
             + [([1.0] * world, 0.0)] * 3 + [(fast + [0.60], 1.0)]
             + [(fast + [0.46], 1.0)] * 40)

    def drive(policy):
        return [(t, a) for t, (speeds, conf) in enumerate(trace)
                if (a := policy.step(speeds, conf)).kind != "none"]

    policy = SemiPolicy(cfg, total=1024 * world, world=world)
    acts = drive(policy)
    assert [a.kind for _, a in acts] == ["resize", "migrate"], acts
    assert policy.basis[-1] == pytest.approx(0.52) and policy.fractions is None
    if world == 2:  # on 3 ranks a correction to the 0.60 plan would not repay its cost
        unbounded = drive(_Unbounded(cfg, total=1024 * world, world=world))
        kinds = [a.kind for _, a in unbounded]
        assert kinds[:3] == ["resize", "migrate", "migrate"] and "resize" in kinds[3:], unbounded


def test_semi_migrates_only_once_it_repays_the_migrations_cost():
    """A 1.3× straggler: the proportional plan [36, 28] saves 12.5 % of the dim's compute a
    step. At a
    cost of 0.25 steps a migration repays itself there and back (2 × 0.25) after 4 steps, so
    it migrates at spike_steps (5); at 3.6 steps (a measured cost) it waits until the
    imbalance has lasted 2 × 3.6 / 0.125 = 57.6 steps, resized meanwhile."""
    trace = [[1.0, 1 / 1.3]] * 100
    cheap = SemiPolicy(PolicyConfig(spike_steps=5, migrate_cost_steps=0.25), total=64, world=2)
    assert [(t, a.kind) for t, a in _drive(cheap, trace)] == [(0, "resize"), (4, "migrate")]
    dear = SemiPolicy(PolicyConfig(spike_steps=5), total=64, world=2)
    dear.note_migration_cost(3.6)
    acts = _drive(dear, trace)
    assert [(t, a.kind) for t, a in acts] == [(0, "resize"), (57, "migrate")], acts
    assert "58 steps × saving 0.12" in acts[1][1].reason
    with pytest.raises(ValueError, match="finite number of steps"):
        dear.note_migration_cost(float("nan"))


def test_semi_waits_for_confidence_after_a_plan_change():
    """Speeds read with confidence under min_confidence (0.5) are not acted on and start no
    imbalance; one under way ages through them (the next reading says whether it is over)."""
    policy = SemiPolicy(PolicyConfig(spike_steps=5, migrate_cost_steps=0.5), total=64, world=2)
    slow = [1.0, 0.5]
    assert [policy.step(slow, 1 / 3).kind for _ in range(10)] == ["none"] * 10
    assert [policy.step(slow, 2 / 3).kind for _ in range(2)] == ["resize", "none"]
    assert [policy.step(slow, 0.0).kind for _ in range(2)] == ["none", "none"]
    assert policy.step(slow, 2 / 3).kind == "migrate"  # 5 steps old
    with pytest.raises(ValueError, match="min_confidence"):
        PolicyConfig(min_confidence=1.5)


def test_semi_follows_a_straggler_that_moves_and_returns_to_even():
    """Rank 1 2× slow for 60 steps, then rank 0 for 60, then neither: each slowdown is
    bridged and migrated (the second plan the mirror of the first), and the plan returns to
    even when it ends (the window's readings, part slow and part not, are bridged by a
    resize while they settle, undone once they read balanced)."""
    trace = [[1.0, 0.5]] * 60 + [[0.5, 1.0]] * 60 + [[1.0, 1.0]] * 40
    policy = SemiPolicy(PolicyConfig(confirm_steps=3, spike_steps=12), total=64, world=2)
    acts = _closed_loop(policy, trace)
    kinds = [a.kind for _, a in acts]
    plans = [a.plan.sizes for _, a in acts if a.kind == "migrate"]
    assert plans == [(43, 21), (21, 43), (32, 32)], acts
    assert kinds[:4] == ["resize", "migrate", "resize", "migrate"], acts
    assert 60 <= acts[2][0] < 70 and acts[-1][0] >= 120 and acts[-1][1].kind == "migrate"
    assert policy.fractions is None and policy.plan == policy.even


def _bench_spike(seed, noise=0.2, length=8):
    """``plait bench hetero``'s ``spike``: the last of 2 ranks 3× slower for ``length`` steps
    from step 20 (its defaults ``--spike-at 20 --spike-len 8``), each step's speed off by up
    to ``noise`` (the issue measured 0.37–0.52 for a true 0.5 on a shared machine)."""
    trace = _noisy([1.0, 1.0], 60, noise, seed)
    for t in range(20, 20 + length):
        trace[t][1] /= 3.0
    return trace


def test_semi_does_not_migrate_a_spike_resized_part_way_in():
    """The bench's failure, replayed on its schedule (3 warm-up steps, an exchange every 2
    steps, a window of 5, confirm_steps 3, spike_steps 12): the resize at step 24 is made on
    a window only part-way into the spike (rank 1 at 0.57, not 1/3), so the height it records
    (1.77) is too low for the receding test once the spike ends, and the window, restarted
    by the resize, still holds spike readings at step 33 (0.65) when the imbalance, aged
    through the steps of low confidence, reaches 12 steps. Decided from the window alone it
    migrates there (33), as ``bench hetero`` seed 1 did, and back; the newest readings
    (both back under the trigger by then) keep it a resize, undone."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    trace = _bench_spike(61)  # the 20 %-noise trace that gives the bench's figures
    window_only = _closed_loop(SemiPolicy(cfg, total=64, world=2), trace, warmup=3,
                               recent=False)
    assert [(t, a.kind) for t, a in window_only][:2] == [(24, "resize"), (33, "migrate")], \
        window_only
    assert "speeds [1.00, 0.57]" in window_only[0][1].reason
    policy = SemiPolicy(cfg, total=64, world=2)
    acts = _closed_loop(policy, trace, warmup=3)
    kinds = [a.kind for _, a in acts]
    assert kinds[0] == "resize" and "migrate" not in kinds and kinds[-1] == "undo", acts
    assert acts[-1][0] < 28 + 15 and policy.plan == policy.even and policy.fractions is None


@pytest.mark.parametrize("warmup", [2, 3])
def test_semi_never_migrates_the_bench_spike_under_noise(warmup):
    """100 seeds of the bench's spike (6, 8 or 10 steps, 20 % noise a step), on either phase
    of the exchanges: never migrated (from the window alone 12 of these 600 runs were), and
    a 2× straggler that stays, with 10 % noise, is still migrated, once."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    for seed in range(100):
        for length in (6, 8, 10):
            acts = _closed_loop(SemiPolicy(cfg, total=64, world=2),
                                _bench_spike(seed, length=length), warmup=warmup)
            assert "migrate" not in [a.kind for _, a in acts], (seed, length, acts)
    for seed in range(20):
        trace = _noisy([1.0, 1.0], 100, 0.1, seed)
        for t in range(10, 100):
            trace[t][1] /= 2.0
        acts = _closed_loop(SemiPolicy(cfg, total=64, world=2), trace, warmup=warmup)
        assert [a.kind for _, a in acts].count("migrate") == 1, (seed, acts)


# --- unmovable time: what no plan moves ------------------------------------------------

def _best_split(total, speeds, fixed):
    """The smallest slowest-rank time over every split of ``total`` units (brute force)."""
    def splits(left, ranks):
        if ranks == 1:
            yield (left,)
            return
        for n in range(1, left - ranks + 2):
            for rest in splits(left - n, ranks - 1):
                yield (n,) + rest

    return min(max(n / s + f * total for n, s, f in zip(sizes, speeds, fixed))
               for sizes in splits(total, len(speeds)))


@pytest.mark.parametrize("world,total", [(2, 64), (3, 36)])
def test_static_plan_with_unmovable_time_is_the_best_split(world, total):
    """Rank r takes n_r / s_r + fixed_r · total: the plan's slowest rank is within one unit's
    time of the best of every split (brute force), over random speeds and unmovable times;
    by speeds alone it is not (a rank slow at everything keeps its slow unmovable work)."""
    rng = random.Random(world)
    worse = 0
    for _ in range(40):
        speeds = [1.0] + [rng.uniform(0.25, 1.0) for _ in range(world - 1)]
        fixed = [rng.uniform(0.0, 0.6) for _ in range(world)]
        best = _best_split(total, speeds, fixed)
        plan = static_plan(total, speeds, fixed=fixed)
        took = max(n / s + f * total for n, s, f in zip(plan.sizes, speeds, fixed))
        assert sum(plan.sizes) == total and took <= best + 1 / min(speeds) + 1e-9, (
            speeds, fixed, plan, took, best)
        assert imbalance(speeds, plan, fixed=fixed) == pytest.approx(
            max(n / s + f * total for n, s, f in zip(plan.sizes, speeds, fixed))
            / min(n / s + f * total for n, s, f in zip(plan.sizes, speeds, fixed)))
        by_speed = static_plan(total, speeds)
        worse += max(n / s + f * total for n, s, f in
                     zip(by_speed.sizes, speeds, fixed)) > best + 1 / min(speeds) + 1e-9
    assert worse >= 10, worse


def test_equal_unmovable_time_leaves_the_proportional_plan():
    """Every rank spending as long on unmovable work: the plan by speeds alone (the sleep
    emulation slows only the layers, so its runs read equal unmovable times)."""
    for speeds in ([1.0, 0.5], [1.0, 0.7, 0.4], [1.0, 1.0, 0.25, 0.5]):
        assert static_plan(1024, speeds, fixed=[0.3] * len(speeds)) == static_plan(1024, speeds)
    assert static_plan(1024, [1.0, 0.5], fixed=[0.24, 0.45]).sizes == (754, 270)  # a run logged it


def test_semi_keeps_the_unmovable_times_from_before_resizing_while_resized():
    """Read under resizing, unmovable times hold the resizing's own work, which the migration
    ends: semi sizes the migration by those read before the resizing started."""
    cfg = PolicyConfig(confirm_steps=1, spike_steps=6)
    policy = SemiPolicy(cfg, total=1024, world=2)
    acts = [(t, a) for t in range(12) if (a := policy.step(
        [1.0, 0.5], 1.0, fixed=[0.24, 0.45] if t == 0 else [0.25, 0.55])).kind != "none"]
    assert [a.kind for _, a in acts] == ["resize", "migrate"], acts
    assert acts[1][1].plan == static_plan(1024, [1.0, 0.5], fixed=[0.24, 0.45])
    assert acts[1][1].plan != static_plan(1024, [1.0, 0.5], fixed=[0.25, 0.55])
    assert policy.basis_fixed == (0.24, 0.45)
    policy.step([1.0, 0.5], 1.0, fixed=[0.25, 0.55])  # no longer resized: as read
    assert policy.fixed == (0.25, 0.55)
    with pytest.raises(ValueError, match="fixed times"):
        policy.step([1.0, 0.5], 1.0, fixed=[0.4])


class _UnboundedFixed(_Unbounded):
    """SEMI whose plan check takes the unmovable times under the new plan as they are."""

    forget = "before_fixed"


@pytest.mark.parametrize("world", [2, 3])
def test_semi_plan_check_bounds_unmovable_time_by_the_readings_before_resizing(world):
    """What a kernel-throttled run logged (2 ranks, 2 × rank 1): unmovable times 0.24 and
    0.42 when the resizing started (the migration is sized by these), then on the first
    confident readings under the migrated plan 0.27 and 0.29 (a throttled rank that now
    waits spends its quota at full speed; 0.25 here, low enough that correcting to it repays
    its cost), then 0.24 and 0.45 again. Bounded, the check keeps the plan; unbounded, it
    moves work back to the slow rank (what that run did: [768, 256] to [676, 348])."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    fast = [1.0] * (world - 1)

    def fixed(f_fast, f_slow):
        return [f_fast] * (world - 1) + [f_slow]

    trace = ([(fast + [0.51], 1.0, fixed(0.24, 0.42))] * 3
             + [(fast + [0.54], 1.0, fixed(0.25, 0.52))] * 9
             + [([1.0] * world, 0.0, None)] * 3 + [(fast + [0.53], 1.0, fixed(0.27, 0.25))]
             + [(fast + [0.50], 1.0, fixed(0.24, 0.45))] * 40)

    def drive(policy):
        return [(t, a) for t, (speeds, conf, f) in enumerate(trace)
                if (a := policy.step(speeds, conf, fixed=f)).kind != "none"]

    policy = SemiPolicy(cfg, total=1024 * world, world=world)
    acts = drive(policy)
    assert [a.kind for _, a in acts] == ["resize", "migrate"], acts
    by_speed = static_plan(1024 * world, fast + [0.54])
    assert acts[1][1].plan == static_plan(1024 * world, fast + [0.54], fixed=fixed(0.24, 0.42))
    assert acts[1][1].plan.sizes[-1] < 0.9 * by_speed.sizes[-1], (acts, by_speed)
    assert policy.basis_fixed[-1] == pytest.approx(0.42)  # 0.25, bounded by [0.42, 0.42]
    if world == 2:
        unbounded = drive(_UnboundedFixed(cfg, total=1024 * world, world=world))
        assert [a.kind for _, a in unbounded][:3] == ["resize", "migrate", "migrate"], unbounded
        assert unbounded[2][1].plan.sizes[-1] > acts[1][1].plan.sizes[-1], unbounded


class _AnyRank(SemiPolicy):
    """SEMI that may resize any rank the model picks, slowed or not."""

    def _slowed(self, speeds):
        return [True] * len(speeds)


def test_semi_resizes_only_a_rank_that_slowed():
    """What a kernel-made graded run logged (4 hosts at 4 ×, 2 ×, 1 ×, 1 ×): migrated, the
    4 × host held 1 column and read 0.22 against a basis of 0.26, and its unmovable time fell
    from 0.73 to 0.29 (it now waited). The model then found the other three the slow ones;
    resizing bridges a slowdown, and they had none: semi resizes nothing on top. Resizing
    any rank, it kept 0.50 on the other three for the rest of the run (what the run did:
    1.07 pp of held-out accuracy lost)."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    before = ([0.24, 0.59, 0.94, 1.0], 1.0, [0.73, 0.40, 0.22, 0.21])
    under = ([0.26, 0.74, 0.89, 1.0], 1.0, [0.73, 0.40, 0.22, 0.21])
    after = ([0.22, 0.72, 0.99, 1.0], 1.0, [0.29, 0.25, 0.27, 0.26])
    trace = [before] * 3 + [under] * 12 + [([1.0] * 4, 0.0, None)] * 3 + [after] * 30

    def drive(policy):
        return [(t, a) for t, (speeds, conf, fixed) in enumerate(trace)
                if (a := policy.step(speeds, conf, fixed=fixed)).kind != "none"]

    acts = drive(SemiPolicy(cfg, total=1024, world=4))
    # no bridge first: resizing could not bridge the 4 × host's slow unmovable work
    assert acts[0][1].kind == "migrate" and acts[0][0] < 12, acts
    assert "resize" not in [a.kind for _, a in acts], acts
    anyrank = drive(_AnyRank(cfg, total=1024, world=4))
    assert any(a.kind == "resize" and max(a.fractions[1:]) < 1 for _, a in anyrank[1:]), anyrank


@pytest.mark.parametrize("world", [2, 3])
def test_semi_does_not_bridge_what_a_resizing_cannot(world, monkeypatch):
    """A host slow at everything is slow at its unmovable work, which no resizing shortens:
    there semi migrates as soon as that repays its cost, with no resizing first; a slowdown
    of the layers alone it still bridges. Contrast: with no bar (BRIDGES 0) it resizes and
    waits ``spike_steps`` under the resizing."""
    import plait.balance.semi as semi_module

    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    slow_all = [1.0] * (world - 1) + [0.25], [0.2] * (world - 1) + [0.8]
    slow_layers = [1.0] * (world - 1) + [0.33], [0.25] * world

    def acts(speeds, fixed, steps=20):
        semi = SemiPolicy(cfg, total=1024, world=world)
        return [(t, a.kind) for t in range(steps)
                if (a := semi.step(speeds, 1.0, fixed=fixed)).kind != "none"]

    first = acts(*slow_all)
    assert first and first[0][1] == "migrate" and first[0][0] < cfg.spike_steps, first
    assert "resize" not in [k for _, k in first], first
    assert acts(*slow_layers)[0][1] == "resize"
    monkeypatch.setattr(semi_module, "BRIDGES", 0.0)
    assert acts(*slow_all)[:2] == [(2, "resize"), (11, "migrate")]


def _dims_loop(policies, speeds, fixed, steps, delay, join=True):
    """Several dims' policies fed as ``Balancer.step`` feeds them, on steady readings: every
    dim steps; where one acted, the others may join (``SemiPolicy.join``), and the readings
    restart (confidence 0 for ``delay`` steps). Returns each dim's (step, kind) actions."""
    acts = {name: [] for name in policies}
    quiet_until = 0
    for t in range(steps):
        conf = 1.0 if t >= quiet_until else 0.0
        done = {name: p.step(speeds, conf, fixed=fixed) for name, p in policies.items()}
        if any(a.kind != "none" for a in done.values()):
            if join:
                done = {name: a if a.kind != "none" else policies[name].join(delay)
                        for name, a in done.items()}
            quiet_until = t + 1 + delay
        for name, a in done.items():
            if a.kind != "none":
                acts[name].append((t, a.kind))
    return acts


def test_semi_migrates_a_dim_beside_another_if_it_would_repay_by_the_next_readings():
    """What a kernel-made graded run read (4 hosts at 4 ×, 2 ×, 1 ×, 1 ×; the 4 × host slow
    at its unmovable work too, so nothing is bridged): the MLP columns (1024) repay their
    migration a step before the heads (16: a coarser plan saves less). Alone, the heads then
    wait out the readings' restart (5 steps, at 4 of 16 heads on the 4 × host); joining,
    they migrate beside the columns. A dim with nothing under way does not join."""
    cfg = PolicyConfig(confirm_steps=3, spike_steps=12)
    speeds, fixed = (0.16, 0.52, 1.0, 0.88), (1.28, 0.41, 0.22, 0.21)

    def run(join):
        dims = {"heads": SemiPolicy(cfg, total=16, world=4),
                "cols": SemiPolicy(cfg, total=1024, world=4)}
        return _dims_loop(dims, speeds, fixed, 20, delay=5, join=join)

    alone = run(join=False)
    assert alone["cols"][0][1] == alone["heads"][0][1] == "migrate", alone
    assert alone["heads"][0][0] >= alone["cols"][0][0] + 5, alone
    joined = run(join=True)
    assert joined["heads"][0] == joined["cols"][0] == alone["cols"][0], joined
    idle = SemiPolicy(cfg, total=16, world=4)
    idle.step((1.0,) * 4, 1.0)
    assert idle.join(5).kind == "none"
