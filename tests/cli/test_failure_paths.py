"""How ``plait`` ends when a run does not go to plan, on real runs: Ctrl-C and SIGINT (130,
one line, nothing left: processes, network namespaces, launch folders), a rank that raises
(1, one line naming it; its traceback with --debug), ``cluster run`` handing on a rank's
exit status, ``cluster status`` and ``clean`` before and after runs (a SIGKILLed one among
them), a tiny ``plait train`` that succeeds, and every count flag given -1 or 0.

The runs are rows of one tests/cli/forkrun.py batch (one torch import for all). Where this
machine can make network namespaces the batch runs in a mount namespace of its own with an
empty /run/netns: what ``cluster status`` lists is then exactly what these rows made, never
another run's on the same machine, and whatever a failing row leaves goes with the batch.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from forkrun import run_plait

from plait.cli import common
from plait.cli.main import build_parser, main
import plait.runtime.launch  # noqa: F401 - its module, whose _launch_once the sweep replaces
from plait.runtime import cluster_support
from plait.runtime.leftovers import LAUNCH_DIR_PREFIX
from plait.training.config import TrainConfig
from plait.training.run import train_rank

NETNS = cluster_support() is None and shutil.which("unshare") is not None
# a mount namespace whose /run/netns is an empty tmpfs of its own (see the module's doc)
PRIVATE_NETNS = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 'mkdir -p /run/netns && mount -t tmpfs plait-test /run/netns && exec "$@"', "sh"]
TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "4", "--seq-len", "16",
        "--batch-size", "4", "--eval-batches", "2", "--no-progress"]
TRAIN_STEPS = 8
# how long a row's processes may outlive it: a forkserver ends after its plait (its own exit,
# torch loaded, takes seconds; 22 s at load 10 here): a limit for processes left running
WAIT_LEFT_S = 180.0
DEAD_PID = 4194305
LONG_TRAIN = ["train", "--steps", "100000", *TINY, "--out", "o"]  # stopped long before its end
HOSTS = ["--hosts", "2"] if NETNS else []
INTERRUPTED = "plait: interrupted; everything it started has been stopped"
# torchrun-style: every rank writes what cluster run set it; rank 0 ends at once, rank 1 exits
# 3 once ranks 0 and 2 have written theirs, rank 2 would run 300 s (it must be stopped)
RANK_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
open(f"rank{rank}.env.part", "w").write(" ".join(f"{n}={os.environ[n]}" for n in names))
os.rename(f"rank{rank}.env.part", f"rank{rank}.env")
if os.environ.get("FAIL") and rank == 1:
    end = time.monotonic() + 300  # ends a hang: 3 interpreters start in seconds, at load too
    while not all(os.path.exists(f"rank{r}.env") for r in (0, 2)) and time.monotonic() < end:
        time.sleep(0.02)
    sys.exit(3)
if os.environ.get("FAIL") and rank == 2:
    time.sleep(300)
    open("rank2.done", "w").write("")
"""
# rank 0 starts a child of its own and waits on it; rank 1 exits 3 once that child runs. The
# child would sleep far longer than the row's processes are watched after its end (TREE_LEFT_S)
TREE_SCRIPT = ('if [ "$RANK" = 1 ]; then while [ ! -e child.started ]; do sleep 0.05; done; '
               'exit 3; fi; sleep 600 & touch child.started; wait')
TREE_LEFT_S = 30.0


def _rows(root: Path) -> dict[str, dict]:
    """Every run of this file: name → forkrun row; ``after`` names rows it waits for."""
    bad_profile = root / "bad-profile.json"
    bad_profile.write_text("{not json")
    story = root / "story-tmp"  # the TMPDIR of the story's last clean
    story.mkdir()
    rows = {
        "rank-raises": dict(argv=["train", "--steps", "2", *TINY, "--out", "t"],
                            env={"PLAIT_PROFILE": str(bad_profile)}),
        "rank-raises-debug": dict(argv=["--debug", "train", "--steps", "2", *TINY, "--out", "t"],
                                  env={"PLAIT_PROFILE": str(bad_profile)}),
        "train": dict(argv=["train", "--plans", "heads=3:1", "--steps", str(TRAIN_STEPS), *TINY,
                            "--out", "out"]),
        "sigint": dict(argv=["cluster", "run", *(HOSTS or ["--ranks", "2"]), "--", "sleep", "30"],
                       signal={"name": "SIGINT", "group": False, "after_s": 0.5,
                               "when": "running:2:sleep 30"}),
        "ctrl-c": dict(argv=[*LONG_TRAIN[:1], *HOSTS, *LONG_TRAIN[1:]],
                       signal={"name": "SIGINT", "group": True, "after_s": 1.0}),
        "exit-3": dict(argv=["cluster", "run", "--ranks", "3", *(["--hosts", "3"] if NETNS else []),
                             "--port", "29517", "--", sys.executable, "-c", RANK_SCRIPT],
                       env={"FAIL": "1"}),
        "all-ok": dict(argv=["cluster", "run", "--ranks", "3", "--", sys.executable, "-c",
                             RANK_SCRIPT]),
        "tree": dict(argv=["cluster", "run", "--ranks", "2", "--", "sh", "-c", TREE_SCRIPT]),
    }
    for name in ("rank-raises", "train", "sigint", "ctrl-c", "exit-3", "all-ok"):
        rows[name]["wait_left_s"] = WAIT_LEFT_S
    # a stopped rank's child left running would still be there; one stopped goes in well
    # under a second (a scan of /proc every 0.25 s ends the wait as soon as none is left)
    rows["tree"]["wait_left_s"] = TREE_LEFT_S
    if NETNS:  # the story: nothing, a run that ends well, one SIGKILLed, then status and clean
        rows |= {
            "status-empty": dict(argv=["cluster", "status"]),
            "clean-empty": dict(argv=["cluster", "clean"], after=["status-empty"]),
            "run-ok": dict(argv=["cluster", "run", "--hosts", "2", "--", "true"],
                           after=["clean-empty"]),
            "killed": dict(argv=["cluster", "run", "--hosts", "2", "--", "sleep", "30"],
                           signal={"name": "SIGKILL", "group": False, "after_s": 0.5,
                                   "when": "running:2:sleep 30"}, after=["clean-empty"],
                           wait_left_s=WAIT_LEFT_S),
        }
        for name in ("ctrl-c", "sigint", "exit-3"):
            rows[name]["after"] = ["clean-empty"]
        everything = [n for n in rows if n != "status-empty"]
        rows |= {
            "status-left": dict(argv=["cluster", "status"], after=everything),
            "clean": dict(argv=["cluster", "clean"], env={"TMPDIR": str(story)},
                          after=["status-left"]),
            "status-final": dict(argv=["cluster", "status"], after=["clean"]),
        }
        # what a launch SIGKILLed (or OOM-killed) leaves in its TMPDIR, made by a pid above
        # the kernel's limit (2^22): never running (tests/runtime/test_cluster.py kills a real one)
        (story / f"{LAUNCH_DIR_PREFIX}{DEAD_PID}-abc").mkdir()
    for name, row in rows.items():
        folder = root / name
        folder.mkdir()
        row["cwd"] = str(folder)
        row["env"] = {"TMPDIR": str(folder / "tmp"), **row.get("env", {})}
        Path(row["env"]["TMPDIR"]).mkdir(exist_ok=True)
    index = {name: i for i, name in enumerate(rows)}
    for row in rows.values():
        row["after"] = [index[n] for n in row.get("after", ())]
    return rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name → (result, the row's folder, its TMPDIR)."""
    root = tmp_path_factory.mktemp("failures")
    rows = _rows(root)
    # a row's limit ends a hang and times nothing: at load 10 here the train row took 148 s
    # and rank-raises 111 s (each row's forkserver loads torch, 4 rows at a time)
    results = run_plait(list(rows.values()), timeout_s=600, wrap=PRIVATE_NETNS if NETNS else [])
    return {name: (result, Path(row["cwd"]), Path(row["env"]["TMPDIR"]))
            for (name, row), result in zip(rows.items(), results)}


def _plait_leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("plait-"))


def _netns_of(pid: int) -> list[str]:
    """Namespaces on this machine made by ``pid`` (none of this file's: they live and die
    in the batch's own /run/netns; this asks whether any leaked out of it)."""
    if shutil.which("ip") is None:
        return []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [n for n in names.split() if n.startswith(f"plait-{pid}x")]


@pytest.mark.parametrize("name", ["ctrl-c", "sigint"])
def test_interrupt_ends_with_130_one_line_and_nothing_left(runs, name):
    """Ctrl-C (SIGINT to the whole process group, ranks too) on a training run on emulated
    hosts, and SIGINT to the plait process alone while ``cluster run`` waits on its ranks."""
    result, folder, tmp = runs[name]
    assert result["signalled"] is not None, f"the run never launched its ranks: {result}"
    assert result["rc"] == 130, result
    assert result["stderr"] == INTERRUPTED + "\n", result["stderr"]
    # 0.4 s and 3.1 s at load 10; 40 s still fails a stop that waits out the ranks' 60 s
    # collective timeout, or a run that goes on
    assert result["elapsed"] - result["signalled"] < 40, result
    assert result["left"] == [], result["left"]
    assert _plait_leftovers(tmp) == [] and _netns_of(result["pid"]) == []
    assert not (folder / "o").exists(), "an interrupted train left its report folder"


def test_a_rank_that_raises_is_one_line_naming_it(runs):
    """A corrupt saved profile: rank 0 reads it (chunks=auto) and raises inside the run."""
    result, folder, tmp = runs["rank-raises"]
    assert result["rc"] == 1, result
    lines = result["stderr"].splitlines()
    assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"]
    # every rank reads the profile; the line names the first whose failure reached plait
    named = re.fullmatch(r"plait: error: rank ([01]) raised JSONDecodeError: .*; the other ranks "
                         r"were stopped \(--debug: the traceback on rank (\d)\)", lines[0])
    assert named and named[1] == named[2], lines
    assert result["left"] == [] and _plait_leftovers(tmp) == []
    assert not (folder / "t").exists(), "a failed train left an empty report folder"


def test_debug_adds_the_failed_ranks_traceback(runs):
    result, _, _ = runs["rank-raises-debug"]
    assert result["rc"] == 1, result
    err = result["stderr"]
    assert "Traceback (most recent call last):" in err, err
    last = re.fullmatch(r"plait: error: rank ([01]) raised JSONDecodeError: .*",
                        err.splitlines()[-1])
    assert last, err
    on_rank = err.split(f"--- traceback on rank {last[1]} ---\n", 1)
    assert len(on_rank) == 2, err
    assert "MachineProfile.load" in on_rank[1] and "json.decoder.JSONDecodeError" in on_rank[1], err


def test_train_through_main_writes_what_the_run_computed(runs):
    """2 ranks, uneven heads: exit 0, log.json holds the flags and every step, its losses are
    one process's (float32: the ranks sum in another order; tests/training/test_train.py holds 2 and
    3 ranks to 1e-12 in float64), and the printed figures are the log's."""
    result, folder, _ = runs["train"]
    assert result["rc"] == 0, result
    assert "Traceback" not in result["stderr"] and result["left"] == [], result
    log = json.loads((folder / "out" / "log.json").read_text())
    config, summary, records = log["meta"]["config"], log["meta"]["summary"], log["records"]
    assert config["plans"] == ["heads=3:1"] and config["extra"]["ranks"] == 2
    assert (config["steps"], config["n_embd"], config["seq_len"]) == (TRAIN_STEPS, 32, 16)
    assert [r["step"] for r in records] == list(range(TRAIN_STEPS))
    assert "on 2 ranks" in summary["parallel"], summary["parallel"]
    one = train_rank(TrainConfig(**{**config, "plans": (), "extra": {}}))
    for got, want in zip(records, one["records"]):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), (records, one["records"])
    assert summary["heldout_loss"] == pytest.approx(one["eval"]["heldout_loss"], rel=1e-4)
    text = " ".join(result["stdout"].split())  # rich folds long lines at 80 columns
    assert (f"loss {summary['first_tenth_mean_loss']:.3f} → {summary['last_tenth_mean_loss']:.3f}"
            in text), text
    assert (f"held-out loss {summary['heldout_loss']:.3f}, accuracy "
            f"{summary['heldout_accuracy']:.3f}" in text), text
    assert f"{TRAIN_STEPS} steps in " in text and "wrote out/loss.png and out/log.json" in text
    assert (folder / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _rank_env(folder: Path, rank: int) -> dict[str, str]:
    return dict(item.split("=", 1) for item in (folder / f"rank{rank}.env").read_text().split())


def test_cluster_run_hands_on_a_ranks_exit_status(runs):
    result, folder, _ = runs["exit-3"]
    assert result["rc"] == 3, result
    where = " on host 1 (10.213.0.2)" if NETNS else ""
    assert result["stderr"].splitlines()[-1] == (f"plait: rank 1{where} exited with status 3; "
                                                 "the other ranks were stopped"), result["stderr"]
    # rank 2 was stopped, not waited for: 8.3 s at load 10 (3 hosts made, 3 interpreters
    # started) against the 300 s it would sleep
    assert result["elapsed"] < 120 and not (folder / "rank2.done").exists(), result
    assert result["left"] == [], result["left"]  # rank 2 was stopped, not left running
    envs = [_rank_env(folder, rank) for rank in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert {(e["WORLD_SIZE"], e["MASTER_PORT"], e["MASTER_ADDR"]) for e in envs} == {
        ("3", "29517", "10.213.0.1" if NETNS else "127.0.0.1")}
    assert [e["LOCAL_RANK"] for e in envs] == (["0", "0", "0"] if NETNS else ["0", "1", "2"])


def test_cluster_run_stops_what_a_stopped_rank_started(runs):
    result, folder, _ = runs["tree"]
    assert result["rc"] == 3 and (folder / "child.started").exists(), result
    assert result["left"] == [], result["left"]


def test_cluster_run_is_0_when_every_rank_is(runs):
    result, folder, _ = runs["all-ok"]
    assert result["rc"] == 0 and "error" not in result["stderr"], result
    assert "Traceback" not in result["stderr"] and result["left"] == [], result
    assert [_rank_env(folder, rank)["RANK"] for rank in range(3)] == ["0", "1", "2"]


@pytest.mark.skipif(not NETNS, reason=f"no emulated cluster here: {cluster_support()}")
def test_cluster_status_and_clean_before_and_after_runs(runs):
    """Nothing at first; a run that ended well, two interrupted, one whose rank failed leave
    nothing; a SIGKILLed run leaves its namespaces, which status names as gone and clean
    removes with a dead run's launch folder (and says so); then there is nothing again."""
    def out(name):
        result = runs[name][0]
        assert result["rc"] == 0, result
        return result["stdout"]

    assert out("status-empty") == "no plait namespaces\n"
    gone = "(what plait runs that are gone left; --all also removes a running one's)"
    assert out("clean-empty") == f"removed 0 {gone}\n"
    assert runs["run-ok"][0]["rc"] == 0, runs["run-ok"][0]
    killed, _, _ = runs["killed"]
    story = runs["clean"][2]
    assert killed["signalled"] is not None and killed["rc"] == -9, killed
    assert killed["left"] == [], killed["left"]  # its ranks ended with it (PDEATHSIG)
    pid = killed["pid"]
    listed = out("status-left").splitlines()
    names = sorted(line.split()[0] for line in listed)
    assert len(names) == 3 and all(re.fullmatch(rf"plait-{pid}x[0-9a-f]+-(sw|h0|h1)", n)
                                   for n in names), listed
    assert all(line.endswith(f"  (made by pid {pid}, gone)") for line in listed), listed
    cleaned = out("clean")
    head, tail = "removed 4: ", f" {gone}\n"
    assert cleaned.startswith(head) and cleaned.endswith(tail), cleaned
    removed = cleaned[len(head):-len(tail)].split(", ")
    assert sorted(r for r in removed if r.startswith("plait-")) == names, cleaned
    assert [r for r in removed if not r.startswith("plait-")] == [
        str(story / f"{LAUNCH_DIR_PREFIX}{DEAD_PID}-abc")], cleaned
    assert out("status-final") == "no plait namespaces\n"
    assert _plait_leftovers(story) == [], "clean left the launch folder"


# --- every count flag given -1 or 0 -------------------------------------------------------

COUNT_TYPES = (int, common.positive_int, common.non_negative_int)
ZERO_MEANS = {  # flags whose 0 is a setting, not a mistake
    "--hosts": "0 hosts: loopback",
    "--warmup": "no warm-up iterations",
    "--eval-batches": "no held-out evaluation",
    "--emb-chunks": "0: auto",
    "--pieces": "0: no in-flight pieces timed",
    "--spike-at": "a step index: the spike may start at step 0",
    "--max-restarts": "torchrun's own meaning: no restart, the first failure ends the run",
    "--eos-id": "a token id: 0 is one",
}
NOT_COUNTS = {"--seed": "a seed, not a count: torch takes any 64-bit integer"}
GAPS: dict = {}  # refused nowhere yet: strict xfails, to turn into passes where the fix lands
EXTRA = {"demo": ["--loopback"], "cluster run": ["--", "true"]}


def _count_flags() -> list[tuple[str, str, str]]:
    """(command, flag, value) for every whole-number flag of every command, from the parser."""
    cases = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.option_strings and action.type in COUNT_TYPES:
                flag = action.option_strings[-1]
                if flag not in NOT_COUNTS:
                    cases.extend((" ".join(path), flag, v)
                             for v in ("-1", "0") if v == "-1" or flag not in ZERO_MEANS)

    walk(build_parser(), [])
    return cases


COUNTS = _count_flags()


class _Launched(BaseException):
    """Raised where a command would start its ranks: it took the value."""


def test_the_sweep_covers_every_command():
    commands = {c for c, _, _ in COUNTS}
    assert commands >= {"train", "demo", "simulate", "cluster run", "bench collectives",
                        "bench ops", "bench tp", "bench hetero"}, commands
    assert len(COUNTS) > 100 and set(GAPS) <= set(COUNTS)


@pytest.mark.parametrize("command,flag,value", [
    pytest.param(*case, marks=pytest.mark.xfail(
        strict=True, reason=f"{case[0]} {case[1]} {case[2]} is taken and the ranks start: "
                            f"src/plait/{GAPS[case]} does not check it (not this test's file)"))
    if case in GAPS else case for case in COUNTS], ids=[" ".join(c) for c in COUNTS])
def test_a_count_of_minus_one_or_zero_is_refused_naming_it(command, flag, value, monkeypatch,
                                                           capsys, tmp_path):
    def launched(*args, **kwargs):
        raise _Launched()

    monkeypatch.setattr(sys.modules["plait.runtime.launch"], "_launch_once", launched)
    monkeypatch.setenv("PLAIT_DEADLINE_S", "")  # main() sets it; restored afterwards
    monkeypatch.delenv("PLAIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    argv = [*command.split(), flag, value, *EXTRA.get(command, [])]
    try:
        rc = main(argv)
    except _Launched:
        pytest.fail(f"plait {' '.join(argv)} started its ranks")
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and err.startswith("plait: error: "), err
    field = flag[2:].replace("-", "_")
    assert flag in err or field in err, f"the refusal does not name {flag}: {err}"
    assert list(tmp_path.iterdir()) == []


class _Rank:
    def __init__(self, pid):
        self.pid = pid

    def poll(self):
        return None

    def wait(self):
        return -9


def test_stopping_kills_each_parent_before_its_children(monkeypatch):
    """A shell whose child is killed first wakes and prints "Killed" under the run's one-line
    message (a CI run's last line); killed first itself, it prints nothing. Pids given in an
    order a set walks backwards: grandchild 10 under child 20 under rank 30."""
    from plait.cli import cluster

    me = os.getpid()
    tree = {me: [30], 30: [20, 21], 20: [10]}
    killed = []
    monkeypatch.setattr(cluster, "_children_of", lambda: tree)
    monkeypatch.setattr(cluster.os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(cluster.os, "waitpid", lambda pid, flags: (pid, 0))
    reaper = cluster._Subreaper.__new__(cluster._Subreaper)
    reaper.before = set()
    reaper.stop([_Rank(30)])
    assert sorted(killed) == [10, 20, 21, 30]
    assert killed.index(30) < killed.index(20) < killed.index(10), killed
