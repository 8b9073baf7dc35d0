"""Scenario files (``plait bench hetero --scenario-file``): the format, the factors it gives
step by step, and a run of the shipped jitter file on a persistent 2 × straggler (semi
migrates) through ``bench hetero`` on virtual devices. Semi under the jitter alone: tests/balance/test_policy.py."""

import json
import os
import statistics

import pytest

from plait.bench.hetero import HeteroBenchConfig
from plait.runtime.slow.scenarios import factors_at, scenario_specs
from plait.runtime import Straggler
from plait.runtime.slow.scenario_file import load_scenario, parse_scenario
from plait.runtime.slow.straggler import SlowCurve
from plait.testing import run_ranks

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "scenarios")
DRIFT, JITTER = (os.path.join(EXAMPLES, f"{n}.json") for n in ("drift", "jitter"))


def _write(tmp_path, data, name="scn.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_drift_file_slows_the_last_rank_linearly_from_1x_to_2x_over_any_run():
    scenario = load_scenario(DRIFT)
    assert scenario.name == "drift"
    for world, steps in ((2, 101), (4, 51)):
        specs = scenario.specs(world, steps)
        factors = [factors_at(specs, world, s) for s in range(steps)]
        assert all(f[:-1] == [1.0] * (world - 1) for f in factors)  # only the last rank
        last = [f[-1] for f in factors]
        assert last[0] == 1.0 and last[-1] == pytest.approx(2.0)
        assert last[(steps - 1) // 2] == pytest.approx(1.5)
        steps_up = [b - a for a, b in zip(last, last[1:])]
        assert all(d == pytest.approx(1.0 / (steps - 1)) for d in steps_up)  # linear


def test_jitter_file_jitters_every_rank_20_percent_with_no_persistent_straggler():
    scenario = load_scenario(JITTER)
    specs = scenario.specs(2, 2000)
    assert sorted(s.rank for s in specs) == [0, 1]
    per_rank = [[factors_at(specs, 2, s)[r] for s in range(2000)] for r in (0, 1)]
    for factors in per_rank:
        assert 1.0 <= min(factors) < 1.02 and 1.48 < max(factors) <= 1.5  # 1.25 × (1 ± 0.2)
        assert statistics.fmean(factors) == pytest.approx(1.25, abs=0.015)
        assert len(set(factors)) > 1900  # a new draw every step
    a, b = per_rank
    assert abs(statistics.fmean(a) - statistics.fmean(b)) < 0.02  # no rank slower for long
    assert abs(statistics.correlation(a, b)) < 0.1  # each rank its own draws
    for n in range(0, 2000, 100):  # nor over any 100 steps (sd of the gap 0.02)
        assert abs(statistics.fmean(a[n:n + 100]) - statistics.fmean(b[n:n + 100])) < 0.08
    again = load_scenario(JITTER).specs(2, 2000)  # the same draws in every process
    assert [c.factor_at(s) for c in again for s in range(50)] == [
        c.factor_at(s) for c in specs for s in range(50)]


def test_moving_and_two_stragglers_files():
    """moving.json: 2 × on the last rank, then on rank 0 from just past half-way, one rank
    slow at a time; two-stragglers.json: rank 1 2 ×, the last 1.5 × (3 ranks or more)."""
    moving = load_scenario(os.path.join(EXAMPLES, "moving.json"))
    for world, steps in ((2, 80), (3, 50)):
        specs = moving.specs(world, steps)
        factors = [factors_at(specs, world, s) for s in range(steps)]
        assert factors[0] == [1.0] * (world - 1) + [2.0] and factors[steps // 3] == factors[0]
        assert factors[-1] == [2.0] + [1.0] * (world - 1)
        assert factors[2 * steps // 3] == factors[-1]
        # one 2 × slowdown at a time, handed over in the steps around half-way
        assert all(sum(f) - world == pytest.approx(1.0) for f in factors)
    two = load_scenario(os.path.join(EXAMPLES, "two-stragglers.json"))
    assert [factors_at(two.specs(3, 10), 3, s) for s in (0, 9)] == [[1.0, 2.0, 1.5]] * 2


def test_periodic_jitter_and_points_by_step(tmp_path):
    path = _write(tmp_path, {"slow": [
        {"rank": "all", "factor": 1.5, "jitter": {"amplitude": 0.1, "kind": "periodic",
                                                   "period": 8}},
        {"rank": 0, "factor": [[10, 1.0], [20, 3.0]]}]})
    scenario = load_scenario(path)
    assert scenario.name == "scn"  # the file's stem
    specs = scenario.specs(2, 40)
    f = [factors_at(specs, 2, s) for s in range(40)]
    assert f[0][1] == pytest.approx(1.5) and f[2][1] == pytest.approx(1.5 * 0.9)  # sin(3π/2)
    assert f[2][1] == pytest.approx(f[10][1]) and f[2][1] == pytest.approx(f[18][1])
    assert f[2][0] == pytest.approx(1.5 * 1.1)  # rank 0 half a period ahead: sin(π/2)
    jitter0, ramp = (c for c in specs if c.rank == 0)
    assert [ramp.factor_at(s) for s in (0, 10, 15, 20, 39)] == [1.0, 1.0, 2.0, 3.0, 3.0]
    assert all(f[s][0] == pytest.approx(jitter0.factor_at(s) * ramp.factor_at(s))
               for s in range(40))  # one rank's curves multiply
    straggler = Straggler(specs, rank=0)
    for step in (0, 15, 39):
        straggler.set_step(step)
        assert straggler.factor() == pytest.approx(f[step][0])


@pytest.mark.parametrize("data, field", [
    ([], "the file must be a JSON object"),
    ({"slow": [{"rank": 1, "factor": 2}], "nmae": "x"}, "the file has an unknown key 'nmae'"),
    ({}, "slow must be a non-empty list"),
    ({"slow": [{"rank": -1, "factor": 2}]}, "slow[0].rank must be a rank"),
    ({"slow": [{"rank": "first", "factor": 2}]}, "slow[0].rank must be a rank"),
    ({"slow": [{"rank": 0, "factor": 0.5}]}, "slow[0].factor must be a number ≥ 1"),
    ({"slow": [{"rank": 0}]}, "slow[0].factor must be a number ≥ 1 or a list"),
    ({"slow": [{"rank": 0, "factor": [[0, 1], [5, 0.9]]}]}, "slow[0].factor[1][1] must be"),
    ({"slow": [{"rank": 0, "factor": [[5, 1], [5, 2]]}]}, "slow[0].factor[1][0] must be after"),
    ({"slow": [{"rank": 0, "factor": [[0, 1, 2]]}]}, "slow[0].factor[0] must be a pair"),
    ({"by": "run", "slow": [{"rank": 0, "factor": [[0, 1], [2, 2]]}]},
     "slow[0].factor[1][0] must be a number from 0 to 1"),
    ({"by": "second", "slow": [{"rank": 0, "factor": 2}]}, "by must be one of"),
    ({"slow": [{"rank": 0, "factor": 2, "speed": 1}]}, "slow[0] has an unknown key 'speed'"),
    ({"slow": [{"rank": 0, "factor": 1.1, "jitter": {"amplitude": 0.2}}]},
     "slow[0].jitter.amplitude 0.2 takes the factor 1.1 below 1"),
    ({"slow": [{"rank": 0, "factor": 2, "jitter": {"amplitude": 1.5}}]},
     "slow[0].jitter.amplitude must be a number in [0, 1)"),
    ({"slow": [{"rank": 0, "factor": 2, "jitter": {"amplitude": 0.1, "kind": "sine"}}]},
     "slow[0].jitter.kind must be one of"),
    ({"slow": [{"rank": 0, "factor": 2, "jitter": {"amplitude": 0.1, "kind": "periodic"}}]},
     "slow[0].jitter.period is needed"),
    ({"slow": [{"rank": 0, "factor": 2, "jitter": {"amplitude": 0.1, "period": 0}}]},
     "slow[0].jitter.period must be a whole number of steps ≥ 1"),
    ({"slow": [{"rank": 0, "factor": 2, "jitter": {"amplitude": 0.1, "seed": "x"}}]},
     "slow[0].jitter.seed must be an integer"),
    ({"name": "", "slow": [{"rank": 0, "factor": 2}]}, "name must be a non-empty string"),
])
def test_bad_files_are_refused_in_one_line_naming_the_field(tmp_path, data, field):
    path = _write(tmp_path, data)
    with pytest.raises(ValueError) as err:
        load_scenario(path)
    assert str(err.value).startswith(f"{path}: {field}"), str(err.value)
    assert "\n" not in str(err.value)


def test_what_only_a_run_can_refuse(tmp_path):
    with pytest.raises(ValueError, match=r"scn.json: not JSON: .* line 1 column"):
        load_scenario(_write(tmp_path, "{slow: 1}"))
    beyond = _write(tmp_path, {"slow": [{"rank": 3, "factor": 2}]})
    with pytest.raises(ValueError, match=r"slow\[0\].rank 3 is not one of the 2 ranks"):
        HeteroBenchConfig(scenario_file=beyond).check_world(2)
    HeteroBenchConfig(scenario_file=beyond).check_world(4)
    builtin = _write(tmp_path, {"name": "spike", "slow": [{"rank": 0, "factor": 2}]})
    with pytest.raises(ValueError, match="'spike' is a built-in scenario's"):
        HeteroBenchConfig(scenario_file=builtin)
    with pytest.raises(ValueError, match="--scenarios"):
        HeteroBenchConfig(scenarios=())  # empty only beside a file
    with pytest.raises(ValueError, match="below 1"):
        SlowCurve(rank=0, points=((0, 1.0),), amplitude=0.1)


def test_bench_hetero_runs_the_file_as_one_more_scenario_and_records_it():
    from plait.cli.main import build_parser

    args = build_parser().parse_args(["bench", "hetero", "--scenario-file", DRIFT])
    assert args.scenario_file == DRIFT  # the flag comes from HeteroBenchConfig's field
    cfg = HeteroBenchConfig(scenarios=("none",), policies=("even", "semi"), scenario_file=DRIFT,
                            steps=11, warmup=1)
    assert cfg.runs()[:4] == [(0, "none", "even"), (0, "none", "semi"), (0, "drift", "even"),
                              (0, "drift", "semi")] and len(cfg.runs()) == 4 * cfg.seeds
    specs = scenario_specs("drift", 2, cfg)
    assert [factors_at(specs, 2, s)[1] for s in (0, 5, 10)] == pytest.approx([1.0, 1.5, 2.0])
    assert cfg.scenario.to_json()["file"] == json.load(open(DRIFT))


def _control_run(control):
    """Rank side: bench hetero's run of a small GPT on 2 ranks, semi on the control file, the
    ranks virtual devices (timed by their products' FLOPs, :mod:`plait.testing.virtual`)."""
    from plait.testing.virtual import VirtualDevice
    from plait.bench.hetero import run_hetero

    device = VirtualDevice().install()  # in this rank's process only
    cfg = HeteroBenchConfig(scenarios=(), scenario_file=control, policies=("semi",), steps=20,
                            warmup=4, seeds=1, n_layer=1, n_head=4, n_embd=32, seq_len=16,
                            batch_size=8, eval_batches=1, spike_steps=12, confirm_steps=3)
    with device:
        records = run_hetero(cfg)
    return {record["scenario"]: record["decisions"] for record in records}


def test_the_jitter_file_on_a_2x_straggler_is_migrated_in_a_real_run(tmp_path):
    """The shipped jitter file on top of a 2 × last rank, run through ``bench hetero`` on
    ranks timed by FLOPs, so the readings are the file's draws and nothing else: semi
    resizes both dims at step 10 (4 warm-up steps, the window half full and the imbalance
    confirmed over 3 steps) and migrates them at step 19 (the imbalance has lasted
    spike_steps = 12 steps) to 3:1 heads and 85:43 columns (``static_plan`` for speeds
    (1, 0.5), which the readings came to); every rank decides alike. That semi makes no decision under the jitter alone, and
    migrates under it on a 2 × rank for 10 seeds of the file, is judged on the file's draws
    through the monitor's model (tests/balance/test_policy.py)."""
    from plait.balance import static_plan

    data = json.load(open(JITTER))
    data["name"] = "jitter-on-2x"
    data["slow"].append({"rank": "last", "factor": 2.0})
    out = run_ranks(_control_run, 2, _write(tmp_path, data))
    assert out[0] == out[1], out
    decisions = out[0]["jitter-on-2x"]
    units = {"blocks.0.attn": 4, "blocks.0.mlp": 128}
    want = [(10, dim, "resize", [n // 2] * 2) for dim, n in units.items()] + [
        (19, dim, "migrate", list(static_plan(n, (1.0, 0.5)).sizes)) for dim, n in units.items()]
    assert [(d["step"], d["dim"], d["kind"], d["sizes"]) for d in decisions] == want, decisions
