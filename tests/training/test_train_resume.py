"""``plait train --checkpoint-dir DIR --resume``: a run killed with SIGKILL and resumed goes on
with exactly the losses of a run never stopped; a resume on another number of ranks reshards.

1. SIGKILL, for real: ``plait train`` runs as a subprocess in a session of its own, is
   killed (SIGKILL) inside step 6 (counted from 0), once step-6 (the checkpoint of steps
   0-5) is published, and is resumed with ``--resume``. It is given
   ``--slow 0:1000000000@6``: from step 6 on, rank 0 emulates a device 10^9 × slower (it
   sleeps 10^9 × each piece's compute: hours), so the run waits inside step 6 for its kill
   however fast the machine is (a kill 0-0.3 s after a checkpoint let a fast machine
   finish first). The slowdown is sleeps only: every figure is the same as without it.
   The resumed run's ``log.json`` holds the whole trajectory (the steps before the
   checkpoint come from the checkpoint); every step's loss and learning rate must equal,
   bit for bit, those of a run never stopped (the CLI's float32, on CPU). Nothing of the
   killed run (its ranks, its forkserver) may be left running 60 s after the kill (they go
   in seconds: 3.7 s at load 11), and the resume starts only then. Measured: they did not
   die with it. Each rank holds the write end of the forkserver's "alive" pipe (CPython's
   forkserver hands it to every child), so the forkserver never sees the launcher go and
   the ranks' PR_SET_PDEATHSIG (tied to the forkserver) never fires: the ranks went on
   until they failed on the dead launcher's pipe or finished (7.2 s here; 60 s for a
   400-step run). The fix belongs in plait.runtime.launch (not this test's to make):
   whatever remains after 60 s is killed here, and the test fails.
2. A 2-rank checkpoint resumed on 3 ranks under an uneven plan (float64): the steps after
   it agree with the 2-rank run within 1e-10 (tensor parallelism sums in another order on
   3 ranks, so not bitwise), and the run says what it resharded.
3. Refusals: ``--resume`` without ``--checkpoint-dir``, ``--checkpoint-every 0``/``-1``, a
   directory holding another run's checkpoints without ``--resume`` (exit 2, one line), an
   empty directory with ``--resume`` (starts at step 0 and says so, as torchtitan does), and
   a checkpoint of another model (refused in one line by the checkpoint module).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from plait.checkpoint import SeededStream, rng_state, set_rng_state
from plait.cli.main import main as plait_main
from plait.runtime.errors import RankError
from plait.testing import run_ranks
from plait.training.config import TrainConfig
from plait.training.run import train_rank
from plait.training.resume import checkpoint_note

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt", "--n-layer", "1", "--n-head", "4", "--n-embd", "32", "--seq-len", "16",
        "--batch-size", "8", "--lr", "1e-2", "--eval-batches", "1"]
CLI_STEPS, CLI_EVERY = 14, 2
LEFT_S = 60.0  # rank 0 of a run left running sleeps for hours; the rest go in seconds
KILL_IN = 6  # the step the killed run waits in (a checkpoint step: step-6 is published first)
RUN_LIMIT_S = 240


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "plait", "train", *TINY, "--ranks", "2", "--no-progress",
            "--steps", str(CLI_STEPS), *args]


def _records(out: Path) -> list[dict]:
    return json.loads((out / "log.json").read_text())["records"]


def _session_processes(sid: int) -> list[str]:
    """Every process still in session ``sid`` (the killed run's: it was its leader)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # after ")": state, ppid, pgrp, session
                found.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:120]!r}")
        except (OSError, IndexError, ValueError):
            continue
    return found


def _wait_gone(sid: int, limit_s: float) -> list[str]:
    end = time.monotonic() + limit_s
    while (left := _session_processes(sid)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def test_sigkill_then_resume_continues_bit_identically(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "1000",  # no wrapping
           "TMPDIR": str(tmp_path)}  # what the SIGKILL leaves (a pymp-* folder): the test's
    # the run never stopped, started first: it runs while the other is being killed
    reference = subprocess.Popen(_cli(["--out", str(tmp_path / "full")]), env=env, cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ckpt = tmp_path / "ckpt"
    killed = subprocess.Popen(_cli(["--checkpoint-dir", str(ckpt), "--checkpoint-every",
                                    str(CLI_EVERY), "--out", str(tmp_path / "killed"),
                                    "--slow", f"0:1000000000@{KILL_IN}"]),
                              env=env, cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = KILL_IN
    end = time.monotonic() + RUN_LIMIT_S
    try:
        while not (ckpt / f"step-{target}").exists():
            assert killed.poll() is None, f"the run ended (status {killed.returncode}) first"
            assert time.monotonic() < end, f"no step-{target} within {RUN_LIMIT_S} s"
            time.sleep(0.05)
        running = _session_processes(killed.pid)  # it, its forkserver, 2 ranks at least
        os.kill(killed.pid, signal.SIGKILL)
        assert len(running) >= 4, running  # so the scan below does see ranks
    finally:
        if killed.poll() is None:
            os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
    killed_at = time.monotonic()
    left = _wait_gone(killed.pid, LEFT_S)
    print(f"SIGKILL after step-{target} was published; {len(running)} processes in its session "
          f"before, {len(left)} left {time.monotonic() - killed_at:.1f} s after")
    for line in left:  # never leave them running, whatever the outcome
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, f"the SIGKILLed plait train left processes running: {left}"
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "log.json").exists(), "it finished before the kill"
    newest = max(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))
    assert newest == target, newest  # the run went no further

    resumed = subprocess.run(_cli(["--checkpoint-dir", str(ckpt), "--checkpoint-every",
                                   str(CLI_EVERY), "--resume", "--out", str(tmp_path / "res")]),
                             env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=RUN_LIMIT_S)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    said = f"resumed from {ckpt}/step-{newest} at step {newest} (the same 2 ranks and plans)"
    assert said in " ".join(resumed.stdout.split()), resumed.stdout
    out, _ = reference.communicate(timeout=RUN_LIMIT_S)
    assert reference.returncode == 0, out[-2000:]

    full, res = _records(tmp_path / "full"), _records(tmp_path / "res")
    assert [r["step"] for r in res] == list(range(CLI_STEPS))
    for a, b in zip(full, res):  # step by step, bit for bit (float32 on CPU)
        assert (a["step"], a["loss"], a["lr"]) == (b["step"], b["loss"], b["lr"]), (a, b)
    summary = json.loads((tmp_path / "res" / "log.json").read_text())["meta"]["summary"]
    assert summary["resumed"].startswith(f"resumed from {ckpt}/step-{newest}")


# --- on another number of ranks, in float64, through the ranks' own function ----------

STEPS, EVERY = 8, 3
SIZES = dict(model="gpt", steps=STEPS, n_layer=1, n_head=4, n_embd=32, seq_len=16,
             batch_size=8, lr=1e-2, eval_batches=1, checkpoint_every=EVERY)


def _train64(cfg: TrainConfig) -> dict:
    torch.set_default_dtype(torch.float64)
    return train_rank(cfg)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A 2-rank float64 run that checkpointed at steps 3, 6 and 8; step-8 removed, as if it
    had been killed after step 6 was published."""
    ckpt = tmp_path_factory.mktemp("resume") / "ckpt"
    result = run_ranks(_train64, 2, TrainConfig(**SIZES, checkpoint_dir=str(ckpt)))[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-6", "step-8"]  # keep 2
    shutil.rmtree(ckpt / "step-8")
    yield ckpt, result
    shutil.rmtree(ckpt.parent, ignore_errors=True)


def _copy(two_rank_run, tmp_path) -> Path:
    """The fixture's checkpoints, copied: a resumed run writes its own into the directory."""
    return Path(shutil.copytree(two_rank_run[0], tmp_path / "ckpt"))


def test_resume_on_three_ranks_reshards(two_rank_run, tmp_path):
    ckpt, before = _copy(two_rank_run, tmp_path), two_rank_run[1]
    cfg = TrainConfig(**SIZES, checkpoint_dir=str(ckpt), resume=True, plans=("heads=2:1:1",))
    after = run_ranks(_train64, 3, cfg)[0]
    assert after["resumed"].startswith(f"resumed from {ckpt}/step-6 at step 6: saved on 2 "
                                       "ranks, resharded onto 3: [2, 2] -> [2, 1, 1]")
    old, new = before["records"], after["records"]
    assert [r["step"] for r in new] == list(range(STEPS))
    assert [r["loss"] for r in new[:6]] == [r["loss"] for r in old[:6]]  # from the checkpoint
    print("3 ranks against 2, relative difference of the losses after step 6:",
          [abs(b["loss"] - a["loss"]) / abs(a["loss"]) for a, b in zip(old[6:], new[6:])])
    for a, b in zip(old[6:], new[6:]):  # computed on 3 ranks: sums in another order
        assert a["lr"] == b["lr"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-10, abs=0.0)


def test_checkpoint_of_another_model_is_refused(two_rank_run, tmp_path):
    ckpt = _copy(two_rank_run, tmp_path)
    cfg = TrainConfig(**{**SIZES, "n_embd": 48}, checkpoint_dir=str(ckpt), resume=True)
    with pytest.raises(RankError) as err:
        run_ranks(_train64, 2, cfg)
    line = str(err.value).splitlines()[0]
    assert f"refusing to load {ckpt}/step-6: " in line and "a different model" in line, line


@pytest.mark.parametrize("argv, says", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/c", "--checkpoint-every", "0"], "--checkpoint-every must be"),
    (["--checkpoint-dir", "{tmp}/c", "--checkpoint-every", "-1"], "--checkpoint-every must be"),
    (["--checkpoint-dir", "{tmp}/c", "--checkpoint-keep", "0"], "--checkpoint-keep must be"),
    (["--checkpoint-dir", "{full}"], "already holds checkpoints (newest step-6): pass --resume"),
])
def test_refused_in_one_line(argv, says, tmp_path, two_rank_run, capsys):
    ckpt = _copy(two_rank_run, tmp_path)
    argv = [a.format(tmp=tmp_path, full=ckpt) for a in argv]
    assert plait_main(["train", *TINY, "--steps", "1", "--out", str(tmp_path / "out"),
                       *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "out").exists()


def test_resume_from_an_empty_directory_starts_at_step_0(tmp_path):
    cfg = TrainConfig(**SIZES, checkpoint_dir=str(tmp_path), resume=True)
    assert checkpoint_note(cfg) == f"no checkpoint in {tmp_path}: starting at step 0"
    missing = TrainConfig(**SIZES, checkpoint_dir=str(tmp_path / "not-yet"), resume=True)
    assert checkpoint_note(missing) == f"no checkpoint in {tmp_path}/not-yet: starting at step 0"


def test_a_directory_that_cannot_hold_checkpoints_is_refused_before_training(tmp_path):
    """Before: a read-only --checkpoint-dir trained every step, then failed at the first save.
    (A read-only mount, measured by hand: `--checkpoint-dir /ro` → `plait: error:
    --checkpoint-dir /ro cannot hold checkpoints: Read-only file system`, exit 2.)"""
    (tmp_path / "a-file").write_text("")
    cfg = TrainConfig(**SIZES, checkpoint_dir=str(tmp_path / "a-file" / "ck"))
    with pytest.raises(ValueError, match=r"--checkpoint-dir .*a-file/ck cannot hold checkpoints"):
        checkpoint_note(cfg)
    assert checkpoint_note(TrainConfig(**SIZES, checkpoint_dir=str(tmp_path / "ok"))) is None
    assert [p.name for p in (tmp_path / "ok").iterdir()] == []  # the probe leaves nothing


def test_rng_states_and_the_data_stream_come_back():
    import numpy as np

    stream = SeededStream(lambda gen: torch.randint(0, 1000, (4,), generator=gen), seed=3)
    next(stream)
    saved, position = rng_state(), stream.state_dict()
    draws = (torch.rand(3), random.random(), np.random.rand(), next(stream))
    torch.manual_seed(99), random.seed(99), np.random.seed(99), next(stream)
    set_rng_state(saved)
    stream.load_state_dict(position)
    again = (torch.rand(3), random.random(), np.random.rand(), next(stream))
    assert torch.equal(draws[0], again[0]) and draws[1:3] == again[1:3]
    assert torch.equal(draws[3], again[3]) and stream.drawn == 2
