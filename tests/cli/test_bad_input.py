"""The command line refuses bad input before it works, not after: one line on stderr,
exit status 2 (plait.cli.main: 2 for a refused input, 1 for a failed run), nothing written,
within seconds.

Each row runs as a process of its own (tests/cli/forkrun.py forks one per row from an
interpreter that imported plait once, so 60 rows cost one torch import), in a folder of its
own that must hold afterwards exactly what the row put there.
"""

import os
from pathlib import Path

import pytest
from forkrun import run_plait

# "Within seconds", in what the machine's load cannot stretch: the row's own CPU seconds (a
# refusal in a process forked from one that imported torch: at most 0.06 s at load 11 here,
# while its wall time was up to 7.6 s at load 8, 4 rows at a time; plait simulate's own work
# is seconds of CPU). A row that starts ranks leaves its files or its output (checked below),
# and a row still running after ROW_LIMIT_S is a hang.
LIMIT_CPU_S = 1.0
ROW_LIMIT_S = 120.0
TIB = str(1 << 40)

# (id, argv, what the one line must say, files the row's folder starts with)
ROWS = [
    # plait train
    ("train-chunks-zero", ["train", "--chunks", "0"], "--chunks", ()),
    ("train-chunks-word", ["train", "--chunks", "many"], "--chunks", ()),
    ("train-out-proc", ["train", "--out", "/proc/plait-out"], "--out /proc/plait-out", ()),
    ("train-out-is-a-file", ["train", "--out", "taken"], "--out taken", ("taken",)),
    ("train-ranks-zero", ["train", "--ranks", "0"], "--ranks", ()),
    ("bench-collectives-shm-a-host-a-rank", ["bench", "collectives", "--transport", "shm,gloo",
                                             "--hosts", "2", "--quick"],
     "--transport shm: each of the 2 ranks is on a host of its own", ()),
    ("bench-ops-shm-one-rank", ["bench", "ops", "--transport", "shm", "--ranks", "1", "--quick"],
     "--transport shm: one rank has nothing to move", ()),
    ("generate-shm-one-rank", ["generate", "--transport", "shm", "--ranks", "1", "--prompt-ids", "1 2"],
     "--transport shm: one rank has nothing to move", ()),
    # plait generate: what the arguments and the files decide, before any rank starts
    ("generate-ranks-over-heads", ["generate", "--ranks", "9", "--prompt-ids", "1 2"],
     "--ranks 9: 8 query heads cannot give each of 9 ranks a whole head", ()),
    ("generate-model-missing", ["generate", "--model", "./nope", "--prompt-ids", "1 2"],
     "--model ./nope: no such file or directory", ()),
    ("generate-model-a-file", ["generate", "--model", "taken", "--prompt-ids", "1 2"],
     "--model taken: a file, not a checkpoint directory", ("taken",)),
    ("generate-model-empty-dir", ["generate", "--model", "empty", "--prompt-ids", "1 2"],
     "--model empty: no config.json in it", ("empty/",)),
    ("train-slow-file-missing", ["train", "--slow-file", "nosuch.json"], "nosuch.json", ()),
    ("train-slow-file-not-json", ["train", "--slow-file", "taken"], "taken", ("taken",)),
    ("train-ranks-negative", ["train", "--ranks", "-3"], "--ranks", ()),
    ("train-ranks-huge", ["train", "--ranks", "100000"], "--ranks", ()),
    ("train-ranks-word", ["train", "--ranks", "two"], "--ranks", ()),
    ("train-hosts-negative", ["train", "--hosts", "-1"], "--hosts", ()),
    ("train-hosts-huge", ["train", "--hosts", "100000"], "100000", ()),
    ("train-ranks-over-hosts", ["train", "--ranks", "3", "--hosts", "2"], "does not divide", ()),
    ("train-link-unknown", ["train", "--link", "fast"], "link rate", ()),
    ("train-timeout-zero", ["train", "--timeout", "0"], "--timeout", ()),
    ("train-timeout-nan", ["train", "--timeout", "nan"], "--timeout", ()),
    ("train-timeout-inf", ["train", "--timeout", "1e400"], "--timeout", ()),
    ("train-deadline-negative", ["train", "--deadline", "-1"], "--deadline", ()),
    ("train-model-unknown", ["train", "--model", "bert"], "--model", ()),
    ("train-steps-zero", ["train", "--steps", "0"], "--steps", ()),
    ("train-steps-float", ["train", "--steps", "1e3"], "--steps", ()),
    ("train-lr-nan", ["train", "--lr", "nan"], "--lr", ()),
    ("train-lr-negative", ["train", "--lr", "-0.1"], "--lr", ()),
    ("train-sp-dlrm", ["train", "--model", "dlrm", "--sequence-parallel"], "--sequence-parallel",
     ()),
    ("train-microbatches-plain", ["train", "--microbatches", "2", "--no-overlap"], "--microbatches",
     ()),
    ("train-slow-rank-missing", ["train", "--slow", "5:2"], "rank 5", ()),
    ("train-plans-garbled", ["train", "--plans", "heads=a:b"], "--plans", ()),
    ("train-unknown-flag", ["train", "--fast"], "unrecognized arguments: --fast", ()),
    # found by the ranks, after the report folder was made: the folder goes with the run
    ("train-plan-names-3-ranks", ["train", "--plans", "heads=3:1:1", "--out", "t", "--no-progress"],
     "name 3 ranks", ()),
    ("demo-out-proc", ["demo", "--quick", "--out", "/proc/plait-demo"], "--out /proc/plait-demo",
     ()),
    # plait bench
    ("collectives-json-proc", ["bench", "collectives", "--json", "/proc/plait.json"], "--json", ()),
    ("collectives-plot-proc", ["bench", "collectives", "--plot", "/proc/plait.png"], "--plot", ()),
    ("collectives-one-bad-of-two", ["bench", "collectives", "--json", "out/c.json",
                                    "--plot", "/dev/null/c.png"], "--plot /dev/null/c.png", ()),
    ("collectives-min-bytes-zero", ["bench", "collectives", "--min-bytes", "0"], "--min-bytes 0 must be above 0", ()),
    ("collectives-step-factor-one", ["bench", "collectives", "--step-factor", "1"], "step_factor",
     ()),
    ("collectives-unknown", ["bench", "collectives", "--collectives", "gossip"], "gossip", ()),
    ("collectives-max-bytes-huge", ["bench", "collectives", "--max-bytes", TIB], "--max-bytes", ()),
    ("collectives-timeout-negative", ["bench", "collectives", "--timeout", "-5"], "--timeout", ()),
    ("ops-unknown", ["bench", "ops", "--ops", "nosuch"], "nosuch", ()),
    ("ops-iters-zero", ["bench", "ops", "--iters", "0"], "iters", ()),
    ("ops-json-sys", ["bench", "ops", "--json", "/sys/plait.json"], "--json /sys/plait.json", ()),
    ("tp-plot", ["bench", "tp", "--plot", "tp.png"], "--plot tp.png", ()),
    ("checkpoint-zero", ["bench", "checkpoint", "--checkpoints", "0"], "--checkpoints", ()),
    ("checkpoint-json-proc", ["bench", "checkpoint", "--json", "/proc/c.json"], "--json", ()),
    ("tp-heads-uneven", ["bench", "tp", "--n-head", "3"], "n_head 3", ()),
    ("hetero-one-rank", ["bench", "hetero", "--ranks", "1"], "at least 2 ranks", ()),
    ("hetero-policy-unknown", ["bench", "hetero", "--policies", "fastest"], "fastest", ()),
    # a new user's trial read "--warmup must be in [0, --steps)" for a --steps they gave
    ("hetero-steps-under-warmup", ["bench", "hetero", "--steps", "3"],
     "--steps 3 leaves no timed step", ()),
    # refused before the progress bar shows (a trial saw "bench hetero 0/17" above the line)
    ("hetero-kernel-no-hosts", ["bench", "hetero", "--slow-by", "kernel"],
     "one rank per host: --hosts 4 for 4 ranks, got no --hosts", ()),
    ("hetero-neighbour-no-hosts", ["bench", "hetero", "--scenarios", "none,noisy-neighbour"],
     "noisy-neighbour scenario", ()),
    ("hetero-scenario-file-missing", ["bench", "hetero", "--scenario-file", "nosuch.json"],
     "--scenario-file nosuch.json: No such file", ()),
    ("bench-missing", ["bench"], "required", ()),
    ("bench-unknown", ["bench", "nccl"], "BENCHMARK 'nccl' is not one of collectives", ()),
    # plait simulate
    ("simulate-tp-zero", ["simulate", "--tp", "0"], "--tp", ()),
    ("simulate-dp-negative", ["simulate", "--dp", "-1"], "--dp", ()),
    ("simulate-ep-word", ["simulate", "--ep", "x"], "--ep", ()),
    ("simulate-steps-zero", ["simulate", "--steps", "0"], "--steps", ()),
    ("simulate-seed-negative", ["simulate", "--seed", "-1"], "--seed", ()),
    ("simulate-tp-mismatch", ["simulate", "--tp", "3"], "3", ()),
    ("simulate-cluster-unknown", ["simulate", "--cluster", "h900-8"], "h900-8", ()),
    ("simulate-model-unknown", ["simulate", "--model", "gpt-9"], "gpt-9", ()),
    ("simulate-policy-unknown", ["simulate", "--policies", "fastest"], "fastest", ()),
    ("simulate-json-proc", ["simulate", "--json", "/proc/plait.json"], "--json /proc/plait.json",
     ()),
    ("simulate-plot-is-a-folder", ["simulate", "--plot", "adir"], "--plot adir", ("adir/",)),
    ("simulate-config-missing", ["simulate", "--config", "nosuch.toml"], "--config nosuch.toml",
     ()),
    ("simulate-config-missing-json", ["simulate", "--config", "missing.json"],
     "--config missing.json: no such file", ()),
    ("simulate-config-is-a-folder", ["simulate", "--config", "conf"],
     "--config conf: is a folder", ("conf/",)),
    ("simulate-config-garbled", ["simulate", "--config", "garbled.json"],
     "garbled.json: not valid JSON", ("garbled.json",)),
    ("simulate-measurements-missing", ["simulate", "--validate", "--measurements", "no.json"],
     "--measurements no.json", ()),
    ("simulate-calibrate-and-validate", ["simulate", "--calibrate", "--validate"], "--calibrate",
     ()),
    ("simulate-profile-alone", ["simulate", "--profile", "p.json"], "--profile", ()),
    # plait cluster, plait demo, plait itself
    ("cluster-run-no-command", ["cluster", "run"], "no command", ()),
    ("cluster-run-port", ["cluster", "run", "--port", "70000", "--", "true"], "--port", ()),
    ("cluster-missing", ["cluster"], "required", ()),
    ("demo-ranks-zero", ["demo", "--ranks", "0"], "--ranks", ()),
    ("demo-timeout-negative", ["demo", "--timeout", "-1"], "--timeout", ()),
    ("no-command", [], "required", ()),
    ("unknown-command", ["serve"], "COMMAND 'serve' is not one of demo", ()),
]


def _setup(folder: Path, files) -> None:
    folder.mkdir()
    for name in files:
        if name.endswith("/"):
            (folder / name).mkdir()
        else:
            (folder / name).write_text("already here\n")


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    rows = []
    for name, argv, _, files in ROWS:
        _setup(root / name, files)
        rows.append({"argv": argv, "cwd": str(root / name), "env": {"HOME": str(root / name)}})
    out = run_plait(rows, timeout_s=ROW_LIMIT_S)
    return {name: (result, root / name) for (name, *_), result in zip(ROWS, out)}


def test_rows_are_many_and_named_once():
    assert len(ROWS) >= 30 and len({r[0] for r in ROWS}) == len(ROWS)
    assert {r[1][0] for r in ROWS if r[1]} >= {"train", "bench", "simulate", "cluster", "demo"}


@pytest.mark.parametrize("name,argv,says,files", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_refused_in_one_line(results, name, argv, says, files):
    result, folder = results[name]
    assert not result["timed_out"], f"still working after {ROW_LIMIT_S:g} s: {result}"
    lines = result["stderr"].splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{result['stderr']}"
    assert lines[0].startswith("plait: error: ") and says in lines[0], lines[0]
    assert result["rc"] == 2, result
    assert result["stdout"] == "", result["stdout"]
    assert result["cpu_s"] < LIMIT_CPU_S, result
    assert _tree(folder) == sorted(f.rstrip("/") for f in files), "the refused run wrote files"
    for path in argv:
        if path.startswith(("/proc/", "/sys/", "/dev/null/")):
            assert not os.path.exists(path)
