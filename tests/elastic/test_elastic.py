"""Elastic training: one torchrun agent per emulated host, one host killed, the others finish.

The end-to-end test runs 3 hosts (network namespaces where this machine can make them, CI
can; loopback otherwise, where the same agents and the same kill run unshaped), kills host 2
after step 5 and checks that the survivors re-formed a world of 2, resumed from the step-4
checkpoint and finished, with a held-out loss within 2 % of one process training the same
steps uninterrupted (the difference is only the order of float sums over 3, 2 and 1 ranks),
and that nothing of the run is left: no process, no namespace, no folder.
"""

import math
import os
import subprocess
import tempfile

import pytest

from plait.cli.elastic import parse_kill
from plait.elastic import ElasticConfig, run_elastic, run_reference, summarize
from plait.elastic.launcher import TMP_PREFIX, _alive
from plait.elastic.worker import batch_at, parse_args, train_config


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="host 0 holds the rendezvous store"):
        ElasticConfig(hosts=3, kill_host=0, kill_at=5)
    with pytest.raises(ValueError, match="both a host and a step"):
        ElasticConfig(hosts=3, kill_host=2)
    with pytest.raises(ValueError, match="kill step 60"):
        ElasticConfig(hosts=3, steps=60, kill_host=2, kill_at=60)
    assert ElasticConfig(hosts=3, kill_host=2, kill_at=5).nnodes_min == 2
    assert ElasticConfig(hosts=3).nnodes_min == 3
    assert parse_kill("2@20") == (2, 20)


def test_plan_follows_the_world_and_data_follows_the_step():
    args = parse_args(["--root", "x", "--n-head", "4", "--n-embd", "64"])
    assert train_config(args, 3).plans == ("heads=2:1:1", "mlp=86:85:85")
    assert train_config(args, 2).plans == ("heads=2:2", "mlp=128:128")
    assert train_config(args, 1).plans == ()
    from plait.training.data import CharCorpus

    corpus, cfg = CharCorpus.load(), train_config(args, 2)
    assert batch_at(corpus, cfg, 7)[0].equal(batch_at(corpus, cfg, 7)[0])
    assert not batch_at(corpus, cfg, 7)[0].equal(batch_at(corpus, cfg, 8)[0])


def test_summary_of_a_kill():
    def step(n, t, world):
        return {"event": "step", "step": n, "loss": 4.0 - n / 10, "world_size": world,
                "restart": 0 if world == 3 else 1, "time": t}
    first = [{"event": "start", "time": 0.0, "world_size": 3, "restart": 0, "resumed_from": 0},
             *(step(n, float(n), 3) for n in range(1, 7))]
    second = [{"event": "start", "time": 9.0, "world_size": 2, "restart": 1, "resumed_from": 4},
              *(step(n, 6.0 + n, 2) for n in range(5, 9)),
              {"event": "end", "time": 15.0, "world_size": 2, "heldout_loss": 3.1}]
    out = summarize([first, second], kill_time=6.5)
    assert out["worlds"] == [3, 2] and out["steps"] == 8 and out["heldout_loss"] == 3.1
    assert out["last_step_before_kill"] == 6 and out["resumed_from"] == 4
    assert out["steps_lost"] == 2
    assert out["restart_s"] == pytest.approx(2.5) and out["recovery_s"] == pytest.approx(4.5)
    assert out["losses"][5] == pytest.approx(3.5)  # the redone step: its last loss


def _leftovers(pid: int) -> tuple[list[str], list[str], list[int]]:
    """Namespaces, folders and worker or agent processes of runs made by ``pid``."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout \
        if os.geteuid() == 0 else ""
    spaces = [ln.split()[0] for ln in names.splitlines() if ln.startswith(f"plait-{pid}x")]
    root = tempfile.gettempdir()
    folders = [n for n in os.listdir(root) if n.startswith(f"{TMP_PREFIX}{pid}-")]
    procs = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f"{TMP_PREFIX}{pid}-".encode() in f.read() and _alive(int(entry)):
                    procs.append(int(entry))
        except (OSError, ValueError):
            continue
    return spaces, folders, procs


def test_training_survives_losing_a_host():
    cfg = ElasticConfig(hosts=3, link="1gbit", steps=12, checkpoint_every=4, kill_host=2,
                        kill_at=5, n_embd=32, seq_len=32, batch_size=8, eval_batches=4,
                        deadline_s=400)
    elastic_before = set(_torchelastic())
    result = run_elastic(cfg)
    assert result["worlds"][0] == 3 and result["final_world_size"] == 2, result
    assert result["steps"] == 12
    # the killed host waits for its kill after step 5 (and the others cannot do step 6
    # without it), so the kill lands there whatever the machine's speed or load; the
    # survivors resume from the last checkpoint published before it, step 4
    assert result["last_step_before_kill"] == 5, result
    assert result["resumed_from"] == 4 and result["steps_lost"] == 1, result
    assert result["recovery_s"] is not None and result["recovery_s"] > 0
    reference = run_reference(cfg)
    assert math.isfinite(result["heldout_loss"])
    assert result["heldout_loss"] == pytest.approx(reference["heldout_loss"], rel=0.02)
    assert all(not _alive(pid) for pid in result["killed_pids"])
    assert _leftovers(os.getpid()) == ([], [], [])
    assert set(_torchelastic()) - elastic_before == set()  # torchrun's log folders went too


def _torchelastic() -> list[str]:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("torchelastic_")]


def test_a_killed_launcher_takes_its_agents_and_workers_with_it(tmp_path):
    """SIGKILL of `plait elastic` (no clean-up of its own can run): its torchrun agents die with
    it (PR_SET_PDEATHSIG) and each worker with its agent, within seconds, though training
    had 100000 steps to go; `plait cluster clean` then removes the namespaces and the run's
    folder. (Before: the 3 agents and 3 workers trained on to step 111 and beyond.)"""
    import json
    import signal
    import sys
    import time
    from pathlib import Path

    proc = subprocess.Popen(
        [sys.executable, "-m", "plait", "elastic", "--hosts", "3", "--link", "1gbit",
         "--steps", "100000", "--checkpoint-every", "50", "--n-embd", "32", "--seq-len", "16",
         "--batch-size", "4", "--no-progress"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, stepped = time.monotonic() + 300, False
        while not stepped and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            for log in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}{proc.pid}-*/logs/*.jsonl"):
                lines = log.read_text().splitlines()
                stepped = stepped or any(json.loads(x).get("event") == "step" for x in lines
                                         if x.strip().endswith("}"))
        assert stepped, f"no step logged (exit {proc.poll()})"
        workers = _leftovers(proc.pid)[2]
        assert len(workers) >= 6, workers  # 3 agents and their workers, training
        proc.kill()
        proc.wait()
        end = time.monotonic() + 60  # ends the wait: they go in seconds
        while _leftovers(proc.pid)[2] and time.monotonic() < end:
            time.sleep(0.2)
        assert _leftovers(proc.pid)[2] == [], "agents or workers outlived the launcher"
        clean = subprocess.run([sys.executable, "-m", "plait", "cluster", "clean"],
                               capture_output=True, text=True, timeout=300)
        assert clean.returncode == 0, clean.stderr
        assert _leftovers(proc.pid) == ([], [], [])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
