"""The expert balancer (SEMI's rule for experts) on given routings and speeds, no processes.

Fed the routing scenarios of ``plait bench experts`` step by step: jitter alone makes no
move; a hot expert is replicated once and the slowest rank ends within 5 % of the ideal;
a drifting skew is followed (a move after each turn of the ranking); a slow rank gets
fewer rows. The routings themselves: deterministic, every row counted once.
"""

from __future__ import annotations

from statistics import median

import pytest

from plait.balance.experts import (ExpertBalancer, even_placement, ideal_time, imbalance,
                                   moves)
from plait.bench.config.experts import ExpertsBenchConfig, routed_loads

CFG = ExpertsBenchConfig(steps=40, warmup=6)


def _run(scenario: str, speeds: list[float], max_replicas=None):
    """(the balancer, each step's slowest-rank time over the ideal, under the placement the
    step ran on)."""
    placement = even_placement(CFG.n_experts, len(speeds))
    balancer = ExpertBalancer(placement, max_replicas=max_replicas)
    ratios = []
    for step in range(CFG.steps):
        loads = routed_loads(CFG, scenario, step)
        ratios.append(max(balancer.placement.times(loads, speeds)) / ideal_time(loads, speeds))
        balancer.observe(step, loads, speeds)
    return balancer, ratios


def test_routings_are_deterministic_and_count_every_row():
    for scenario in ("uniform", "zipf", "hot", "drift"):
        loads = routed_loads(CFG, scenario, 3)
        assert loads == routed_loads(CFG, scenario, 3)
        assert sum(loads) == CFG.tokens * CFG.top_k and min(loads) >= 0
    hot = routed_loads(CFG, "hot", 0)
    assert max(hot) / sum(hot) == pytest.approx(CFG.hot_share, abs=0.03)
    assert routed_loads(CFG, "drift", 0) != routed_loads(CFG, "drift", CFG.drift_every)


def test_jitter_alone_makes_no_move():
    balancer, ratios = _run("uniform", [1.0, 1.0])
    assert balancer.log is None, balancer.log
    assert max(ratios) < 1.05  # a router's jitter on an even split


def test_a_hot_expert_is_replicated_and_the_ranks_end_near_the_ideal():
    balancer, ratios = _run("hot", [1.0, 1.0])
    assert len(balancer.log) == 1 and balancer.placement.copies() == 1
    assert max(ratios[CFG.warmup:]) <= 1.05
    alone, alone_ratios = _run("hot", [1.0, 1.0], max_replicas=1)
    assert alone.placement.copies() == 0
    # without a replica the hot expert (40 %) and one other (8.6 %) share a rank: 1.03 × the
    # ideal at best on 2 ranks (not the 1.4 × the issue expected); the replica does better
    assert median(alone_ratios[CFG.warmup:]) > median(ratios[CFG.warmup:])


def test_a_drifting_skew_is_followed():
    balancer, ratios = _run("drift", [1.0, 1.0])
    turns = (CFG.steps - 1) // CFG.drift_every
    moved_at = [m["step"] for m in balancer.log]
    for turn in range(1, turns + 1):  # a move within 4 steps of every turn of the ranking
        start = turn * CFG.drift_every
        assert any(start <= s < start + 4 for s in moved_at), (turn, moved_at)


def test_a_slow_rank_gets_fewer_rows():
    speeds = [1.0, 0.5]
    balancer, ratios = _run("zipf", speeds)
    loads = routed_loads(CFG, "zipf", CFG.steps - 1)
    mine = balancer.placement.loads(loads)
    assert mine[1] < mine[0]
    assert imbalance(balancer.placement.times(loads, speeds)) < 1.1
    assert max(ratios[CFG.warmup:]) <= 1.1


def test_moves_count_new_homes_only():
    even = even_placement(4, 2)
    assert moves(even, even) == 0
    swapped = type(even)(tuple(((1 - homes[0][0], 1.0),) for homes in even.replicas), 2)
    assert moves(even, swapped) == 4
