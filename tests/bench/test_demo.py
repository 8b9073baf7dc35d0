"""``plait demo`` end to end on a tiny GPT (loopback): its figures against what the run must
produce, and its refusals.

The CLI run is checked for its structure (every run, figure, table line and file the report
must have), not for its timings. What the straggler does to the compute the balancer reads,
and when the balancer acts on it, is checked in a run of :func:`plait.bench.demo.run_demo` on ranks
that are virtual devices (:mod:`plait.testing.virtual`: timed by their products' FLOPs), where
both are exact: on a shared 2-core machine a step time swings by half its size.
"""

import html
import io
import json
import os
import statistics
import sys

import pytest

from plait.cli.demo import demo_config, demo_placement
from plait.cli.main import build_parser, main
from plait.bench.demo import LOOPBACK, QUICK_DEMO, WARMUP_STEPS, DemoConfig
from plait.testing import run_ranks

STEPS, SLOW_FROM, FACTOR = 8, 2, 3.0
SEQ_LEN, BATCH = 16, 4
TINY = ["--steps", str(STEPS), "--slow", f"1:{FACTOR:g}@{SLOW_FROM}",
        "--spike-steps", "5", "--n-embd", "64", "--n-head", "4", "--n-layer", "1",
        "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH)]
# the virtual run: slow from step 4, 11 steps, to the balancer's first decision at step 10
VIRTUAL = DemoConfig(steps=11, slow_from=4, factor=FACTOR, spike_steps=5, n_embd=32, n_head=4,
                     n_layer=1, seq_len=SEQ_LEN, batch_size=BATCH)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tiny demo on loopback, shared by the tests below: (exit code, stdout, folder, json)."""
    out = tmp_path_factory.mktemp("demo") / "report"
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:  # capsys is per test; this run is per module
        patch.setattr(sys, "stdout", stdout)
        code = main(["demo", "--loopback", "--no-progress", *TINY, "--out", str(out)])
    data = json.loads((out / "demo.json").read_text()) if code == 0 else None
    return code, stdout.getvalue(), out, data


def _runs(data):
    return {(r["system"], r["scenario"]): r for r in data["runs"]}


def test_demo_runs_every_system_and_scenario(run):
    code, text, out, data = run
    assert code == 0, text
    assert data["where"] == LOOPBACK and LOOPBACK in text
    assert data["config"]["steps"] == STEPS and data["config"]["slow_from"] == SLOW_FROM
    runs = _runs(data)
    assert sorted(runs) == [("plain", "none"), ("plain", "slow"), ("plait", "none"),
                            ("plait", "slow")]
    for (system, scenario), r in runs.items():
        assert r["overlap"] == (system == "plait") and r["world_size"] == 2
        assert len(r["times"]) == len(r["losses"]) == STEPS and min(r["times"]) > 0
        assert all(0 < loss < 10 for loss in r["losses"]), r["losses"]
        assert [len(c) for c in r["rank_compute_s"]] == [STEPS, STEPS]
        slow_factor = FACTOR if scenario == "slow" else 1.0
        assert [f[-1] for f in r["factors"]] == [1.0] * SLOW_FROM + [slow_factor] * (STEPS - SLOW_FROM)
        assert all(f[0] == 1.0 for f in r["factors"])
        if not (system, scenario) == ("plait", "slow"):
            assert r["decisions"] == [], (system, scenario)  # even shards never move


def test_the_decisions_log_lists_the_decisions(run):
    data = run[3]
    decisions = _runs(data)[("plait", "slow")]["decisions"]
    log = [line for line in (run[2] / "decisions.log").read_text().splitlines() if line]
    assert len(log) == len(decisions), (log, decisions)
    for line, d in zip(log, decisions):
        assert line.startswith(f"step {d['step']:>3}") and d["dim"] in line, (line, d)


def _demo_on_virtual_devices(cfg: DemoConfig) -> list[dict]:
    from plait.testing.virtual import VirtualDevice
    from plait.bench.demo import run_demo

    device = VirtualDevice().install()  # in this rank's process only
    with device:
        return run_demo(cfg)


@pytest.fixture(scope="module")
def virtual():
    """``run_demo(VIRTUAL)`` on 2 ranks timed by FLOPs: rank 0's records by (system, scenario)."""
    out = run_ranks(_demo_on_virtual_devices, 2, VIRTUAL)
    for key in ("rank_compute_s", "decisions", "losses"):  # the same on every rank
        assert [r[key] for r in out[0]] == [r[key] for r in out[1]], key
    return _runs({"runs": out[0]})


def test_the_straggler_turns_slow_at_its_step(virtual):
    """Under even shards rank 1's compute (what the monitor timed) is rank 0's before the
    onset and FACTOR × it from the onset on (the emulation waits (FACTOR − 1) × what the
    rank computed), exactly; without the straggler it is rank 0's throughout."""
    for system, scenario in (("plain", "slow"), ("plain", "none"), ("plait", "none")):
        compute = virtual[(system, scenario)]["rank_compute_s"]
        ratio = [c1 / c0 for c0, c1 in zip(*compute)]
        slowed = FACTOR if scenario == "slow" else 1.0
        want = [1.0] * VIRTUAL.slow_from + [slowed] * (VIRTUAL.steps - VIRTUAL.slow_from)
        assert ratio == pytest.approx(want, rel=1e-9), (system, scenario, ratio)


def test_plait_acts_on_the_straggler_after_its_onset(virtual):
    """semi's first decision: both dims resized at step 10, rank 1 keeping half (``max_skip``
    0.5 of the 2/3 its speed would skip). The balancer's 3 warm-up steps leave the exchanges
    after steps 4, 6, 8 (every 2); the third fills the window of 5 half (speeds (1, 1/3),
    the first reading's half-slow window trimmed away), and the imbalance is confirmed over
    3 steps at step 10. No decision before it, none in the other runs."""
    decisions = virtual[("plait", "slow")]["decisions"]
    assert [(d["step"], d["dim"], d["kind"], d["sizes"], d["fractions"]) for d in decisions] == [
        (10, "blocks.0.attn", "resize", [2, 2], [1.0, 0.5]),
        (10, "blocks.0.mlp", "resize", [64, 64], [1.0, 0.5])], decisions
    assert "speeds [1.00, 0.33]" in decisions[0]["reason"], decisions[0]
    for key in (("plain", "slow"), ("plain", "none"), ("plait", "none")):
        assert virtual[key]["decisions"] == [], key


def test_summary_follows_from_the_runs_and_matches_the_table(run):
    _, text, out, data = run
    runs = _runs(data)
    tokens = BATCH * SEQ_LEN
    after = slice(SLOW_FROM + WARMUP_STEPS, STEPS)
    rows = {row["system"]: row for row in data["summary"]}
    assert sorted(rows) == ["plain", "plait"]
    for system, row in rows.items():
        slow, none = runs[(system, "slow")], runs[(system, "none")]
        assert row["t_step_s"] == statistics.median(slow["times"][after])
        assert row["t_step_no_straggler_s"] == statistics.median(none["times"][WARMUP_STEPS:])
        assert row["tokens_per_s"] == pytest.approx(tokens / row["t_step_s"])
        assert row["ratio_to_ideal"] == pytest.approx(row["t_step_s"] / row["t_ideal_s"])
        assert row["t_ideal_s"] > row["t_step_no_straggler_s"] * 0.99  # a straggler costs ≥ 0
        assert row["decisions"] == len(slow["decisions"])
        assert row["heldout_loss"] == slow["eval"]["heldout_loss"] and row["link"] == "loopback"
        line = next(ln for ln in text.splitlines() if ln.lstrip("│┃ ").startswith(f"{system} "))
        for figure in (f"{row['t_step_s'] * 1e3:.1f}", f"{row['t_ideal_s'] * 1e3:.1f}",
                       f"{row['ratio_to_ideal']:.2f}", f"{row['heldout_loss']:.3f}"):
            assert figure in line, (figure, line)
        assert f"<td>{row['t_step_s'] * 1e3:.1f}</td>" in (out / "index.html").read_text()
    speedup = rows["plain"]["t_step_s"] / rows["plait"]["t_step_s"]
    assert rows["plait"]["speedup_vs_plain"] == pytest.approx(speedup)
    assert f"plait {speedup:.2f}× the plain way" in text


def test_report_files_are_written(run):
    out = run[2]
    for name in ("step_time.png", "loss.png"):
        head = (out / name).read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 20_000, name
    page = (out / "index.html").read_text()
    assert 'src="step_time.png"' in page and 'src="loss.png"' in page
    assert html.escape(LOOPBACK) in page


def _placement(*flags):
    return demo_placement(build_parser().parse_args(["demo", *flags]))


def test_demo_refuses_contradictory_placement_before_anything_starts(monkeypatch, capsys):
    import plait.bench.demo as bench  # what the command runs, once the flags have passed

    monkeypatch.setattr(bench, "demo", lambda *a, **k: pytest.fail("the demo started"))
    for flags, named in ((["--loopback", "--hosts", "2"], "--hosts 2"),
                         (["--loopback", "--link", "1gbit"], "--link 1gbit"),
                         (["--hosts", "0", "--link", "100mbit"], "--link 100mbit")):
        assert main(["demo", *flags]) == 2, flags
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("plait: error: ") and named in err, err
        assert ("--loopback" if "--loopback" in flags else "--hosts 0") in err
    assert _placement() == (2, 2, "1gbit")  # the demo's default: one emulated host per rank
    assert _placement("--loopback") == (2, 0, None)
    assert _placement("--hosts", "0", "--ranks", "3") == (3, 0, None)
    assert _placement("--link", "100mbit") == (2, 2, "100mbit")
    assert _placement("--ranks", "4", "--hosts", "2") == (4, 2, "1gbit")


def test_quick_is_a_preset_that_flags_override():
    quick = demo_config(build_parser().parse_args(["demo", "--quick"]))
    assert quick == DemoConfig(**QUICK_DEMO)
    assert quick.steps - quick.slow_from - WARMUP_STEPS >= 10  # the medians' window
    assert quick.slow_from + quick.spike_steps < quick.steps - 3  # migrates, then runs on
    steps = demo_config(build_parser().parse_args(["demo", "--quick", "--steps", "30"]))
    assert steps.steps == 30 and steps.n_embd == QUICK_DEMO["n_embd"]
    assert demo_config(build_parser().parse_args(["demo"])) == DemoConfig()


def test_slow_is_the_vocabulary_train_and_generate_take():
    cfg = demo_config(build_parser().parse_args(["demo", "--ranks", "3", "--slow", "0:3@4"]))
    assert (cfg.slow_rank, cfg.factor, cfg.slow_from, cfg.slowed(3)) == (0, 3.0, 4, 0)
    default = demo_config(build_parser().parse_args(["demo", "--slow", "1:3"]))
    assert (default.slowed(2), default.factor, default.slow_from) == (1, 3.0, 15)


def test_demo_refuses_what_cannot_work(capsys):
    with pytest.raises(ValueError, match="@7"):
        DemoConfig(steps=10, slow_from=7)  # no step left after the warm-up
    with pytest.raises(ValueError, match="factor"):
        DemoConfig(factor=1.0)
    # the old flags, and a prefix of a flag, are refused (exit 2), not matched
    for old in (["--slow-from", "5"], ["--factor", "3"], ["--slo", "1:2@5"]):
        assert main(["demo", *old]) == 2
        err = capsys.readouterr().err
        assert "unrecognized arguments" in err and "(see: plait demo --help)" in err, err
        assert ("did you mean --slow?" in err) == (old[0] != "--factor"), err
    assert main(["demo", "--slow", "1:0.5@5"]) == 2
    assert "--slow factor must be at least 1" in capsys.readouterr().err
    assert main(["demo", "--slow", "2:2@5"]) == 2  # 2 ranks: 0 and 1
    assert "only 2 ranks" in capsys.readouterr().err
    assert main(["demo", "--slow", "1:2@5-9"]) == 2
    assert "to the end" in capsys.readouterr().err
    with pytest.raises(ValueError, match="chunks"):
        DemoConfig(chunks="two")
    assert main(["demo", "--loopback", "--ranks", "1"]) == 2
    assert "at least 2 ranks" in capsys.readouterr().err
    assert main(["bench", "hetero", "--scenarios", "slow"]) == 2


def test_the_report_names_the_rank_that_turned_slow():
    from plait.bench.demo_report import _decision_marks

    resize = {"step": 7, "kind": "resize", "dim": "mlp", "sizes": [3, 1],
              "fractions": [0.4, 1.0]}
    for slowed, share in ((0, "40%"), (1, "100%")):
        (step, kind, label), = _decision_marks([resize], slowed)
        assert (step, kind) == (7, "resize") and f"rank {slowed} keeps {share}" in label, label


def test_the_busy_note_reads_what_other_programs_take_now():
    from plait.bench.demo_report import busy_note, cores_busy

    busy = cores_busy(0.05)
    assert busy is not None and 0 <= busy <= os.cpu_count() + 1e-9
    assert busy_note(None, 2) is None and busy_note(0.9, 2) is None
    assert "1.5 of this machine's 2 cores busy" in busy_note(1.5, 2)
