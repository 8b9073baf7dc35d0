"""``plait train``'s capacity ideal (``plait.training.report.capacity_ideal``) and its × ideal.

By hand: two ranks, rank 1 2 × slower, each with 100 units of work a step: rank 0 computes
4 ms, rank 1 8 ms (its sleeps included) in a 10 ms step. Both ranks' unslowed speed is
100 / 4 ms; the full work 200 over the summed speeds 25 + 12.5 per ms is 5.33 ms of compute;
what compute does not explain is 10 − 8 = 2 ms; the ideal 7.33 ms, × ideal 1.36: what
``bench hetero``'s ``ideal_step(t_none = 2 + 4, c = 4, [1, 2])`` gives.

A run: one launch of 2 ranks, rank 1 3 × slower (straggler emulation), the same GPT under
``--balance even`` and then ``semi``, on ranks that are virtual devices (timed by their
products' FLOPs, :mod:`plait.testing.virtual`). Every step's record carries every rank's timed
compute, work and slowdown; the ideal recomputed here from those figures is the reported one,
and the figures are the balancer's own speed monitor's. Even's slowest rank computes exactly
2 × what the capacity needs (3 u against 2 · 3 u / 4); semi resizes at step 10 and migrates
at step 19 to the 3:1 plan, after which its slowest rank computes what the capacity needs.
How far × ideal (the step's wall time over the ideal) is above 1 for each policy is a
benchmark's figure (``plait bench hetero``), not this test's: a machine's load stretches
the wall time.
"""

import statistics
from dataclasses import replace

import pytest

from plait.balance import static_plan
from plait.bench.hetero_ideal import ideal_step
from plait.runtime import launch, parse_slow
from plait.training.config import TrainConfig
from plait.training.run import train_rank
from plait.training.report import capacity_ideal

CFG = TrainConfig(model="gpt", steps=36, n_layer=1, n_head=8, n_embd=64, seq_len=32,
                  batch_size=8, eval_batches=0, chunks="2", extra={"ranks": 2})


def _row(step, compute_ms, work, slow, time_ms):
    return {"step": step, "compute_s": [c / 1e3 for c in compute_ms], "work": work,
            "slow": slow, "time_max_s": time_ms / 1e3}


def test_ideal_by_hand_is_bench_heteros():
    warm = [_row(s, [40, 80], [100, 100], [1, 2], 500) for s in range(5)]  # left out
    rows = warm + [_row(s, [4, 8], [100, 100], [1, 2], 10) for s in range(5, 12)]
    ideal = capacity_ideal(rows, [[0], [1]])
    assert ideal["steps"] == 7
    assert ideal["rest_s"] == pytest.approx(2e-3)
    assert ideal["t_ideal_s"] == pytest.approx(2e-3 + 200 / (25e3 + 12.5e3))
    assert ideal["t_ideal_s"] == pytest.approx(ideal_step(6e-3, 4e-3, [1.0, 2.0]))
    assert ideal["ratio_to_ideal"] == pytest.approx(10 / 7.3333333, rel=1e-6)


def test_ideal_resized_steps_and_agreed_plans():
    # a resized step does less work: the full work is the most a tp group did
    rows = [_row(s, [4, 8], [100, 100 if s % 3 else 50], [1, 2], 10) for s in range(9)]
    assert capacity_ideal(rows, [[0], [1]], warmup=0)["work_per_step"] == 200
    # dp 2 × tp 2 (replicas [0, 1] and [2, 3]): position 1 runs at its slower replica's speed
    rows = [_row(s, [4, 4, 4, 8], [100] * 4, [1, 1, 1, 2], 10) for s in range(3)]
    ideal = capacity_ideal(rows, [[0, 2], [1, 3]], warmup=0)
    assert ideal["t_ideal_s"] == pytest.approx(2e-3 + 200 / (25e3 + 12.5e3))
    assert "omitted" in capacity_ideal(rows, [[0, 2], [1, 3]], warmup=3)


def _even_then_semi() -> dict:
    from plait.testing.virtual import VirtualDevice

    device = VirtualDevice().install()  # in this rank's process only
    with device:
        return {"even": train_rank(CFG), "semi": train_rank(replace(CFG, balance="semi"))}


def _by_hand(records: list[dict]) -> float:
    rows = [r for r in records if "compute_s" in r][5:]
    speed = [statistics.median(r["work"][k] * r["slow"][k] / r["compute_s"][k] for r in rows)
             for k in (0, 1)]
    rest = statistics.median(r["time_max_s"] - max(r["compute_s"]) for r in rows)
    work = max(sum(r["work"]) for r in rows)
    return statistics.median(rest + work / (speed[0] / r["slow"][0] + speed[1] / r["slow"][1])
                             for r in rows)


def test_train_reports_the_ideal_and_semi_comes_closer():
    results = launch(_even_then_semi, 2, slow=[parse_slow("1:3")], timeout_s=120,
                     threads=1, deadline_s=600)
    even, semi = results[0]["even"], results[0]["semi"]
    for run in (even, semi):
        ideal = run["ideal"]
        assert ideal["t_ideal_s"] == pytest.approx(_by_hand(run["records"]), rel=1e-9)
        assert ideal["steps"] == CFG.steps - 5
        assert all(r["slow"] == [1.0, 3.0] for r in run["records"])
        assert all(r["work"][0] > 0 and r["work"][1] > 0 for r in run["records"])
    # the tally times what the balancer's monitor times (every step's compute, eval none)
    for rank in (0, 1):
        mine = sum(r["compute_s"][rank] for r in semi["records"])
        monitor = results[rank]["semi"]["balance"]["compute_s_per_step"] * CFG.steps
        assert mine == pytest.approx(monitor, rel=1e-9), rank
    even_gap = even["ideal"]["max_compute_s"] / even["ideal"]["ideal_compute_s"]
    semi_gap = semi["ideal"]["max_compute_s"] / semi["ideal"]["ideal_compute_s"]
    assert even_gap == pytest.approx(2.0, rel=1e-9), even["ideal"]
    # balanced from step 20 on: more than half the 31 steps after the ideal's warm-up
    assert semi_gap == pytest.approx(1.0, rel=1e-9), semi["ideal"]
    units = {"blocks.0.attn": CFG.n_head, "blocks.0.mlp": 4 * CFG.n_embd}
    decisions = [(d["step"], d["dim"], d["kind"], d["sizes"], d.get("fractions"))
                 for d in semi["balance"]["decisions"]]
    assert decisions == [(10, dim, "resize", [n // 2] * 2, [1.0, 0.5]) for dim, n in units.items()
                         ] + [(19, dim, "migrate", list(static_plan(n, (1.0, 1 / 3)).sizes), None)
                              for dim, n in units.items()], decisions
    assert "balance" not in even
