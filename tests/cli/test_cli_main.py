"""How ``plait`` ends and speaks: --version, --debug and PLAIT_DEBUG, one-line failures with
the rank and host, exit statuses, SIGTERM, deadlines, one log prefix, tables that never
cut a figure."""

import io
import logging
import os
import select
import signal
import subprocess
import sys
import time
from importlib.metadata import version

import pytest
from conftest import needs_netns
from forkrun import run_plait
from rich.console import Console

from plait.bench.report import print_summary, print_table
from plait.cli import main as cli_main
from plait.runtime import cluster_support
from plait.runtime.errors import RankError

NETNS = cluster_support() is None
# the peer of a killed rank, and the rank under a deadline, would sleep far past the row's
# limit: a run that waited for them instead of stopping them is told apart by its exit status
# and its own message, however long the machine takes to start it (an interpreter, torch and
# namespaces: 10-20 s at load)
LONG_S = 600
ROW_LIMIT_S = 300
RANK_SLEEP = "641.5"  # SIGTERM's test: its ranks' sleep, longer than any run; its mark in /proc
SELF_KILL = f'if [ "$RANK" = 1 ]; then kill -9 $$; else sleep {LONG_S}; fi'


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command line this file looks at, run at once (each its own process)."""
    root = tmp_path_factory.mktemp("cli")
    table = ["simulate", "--cluster", "h100-64", "--model", "llama3-70b", "--steps", "2"]
    rows = {
        "debug": (["--debug", "train", "--chunks", "0"], {}),
        "debug-env": (["train", "--chunks", "0"], {"PLAIT_DEBUG": "1"}),
        "log": (["cluster", "run", "--ranks", "1", "--", "true"], {}),
        "killed": (["cluster", "run", *(["--hosts", "2"] if NETNS else ["--ranks", "2"]),
                    "--", "sh", "-c", SELF_KILL], {}),
        "deadline": (["cluster", "run", "--ranks", "1", "--deadline", "1", "--", "sleep",
                      str(LONG_S)], {}),
        "table": (table, {"COLUMNS": "80"}),
    }
    results = run_plait([{"argv": argv, "cwd": str(root), "env": env}
                         for argv, env in rows.values()], timeout_s=ROW_LIMIT_S)
    return dict(zip(rows, results))


def test_version_prints_the_package_version():
    proc = subprocess.run([sys.executable, "-m", "plait", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"plait {version('plait')}\n"


@pytest.mark.parametrize("which", ["debug", "debug-env"])
def test_debug_adds_the_traceback_to_the_one_line(runs, which):
    result = runs[which]
    lines = result["stderr"].splitlines()
    assert result["rc"] == 2 and lines[0] == "Traceback (most recent call last):"
    assert "TrainConfig" in result["stderr"] and "ValueError" in result["stderr"]
    assert lines[-1].startswith("plait: error: --chunks must be")


def test_log_lines_have_one_prefix(runs):
    lines = runs["log"]["stderr"].splitlines()
    assert runs["log"]["rc"] == 0 and lines, runs["log"]
    assert all(line.startswith("plait: ") for line in lines), lines
    assert not any("plait.runtime" in line or "plait: plait:" in line for line in lines), lines


def test_formatter_keeps_one_prefix_and_names_foreign_loggers():
    fmt = cli_main._OnePrefix("%(message)s")

    def line(name, msg):
        return fmt.format(logging.LogRecord(name, logging.WARNING, __file__, 1, msg, (), None))

    assert line("plait.runtime", "plait: falling back") == "plait: falling back"
    assert line("plait.balance", "step 3") == "plait: step 3"
    assert line("torch.distributed", "plait: hello") == "plait: torch.distributed: hello"


def test_a_killed_rank_is_one_line_naming_rank_and_host(runs):
    result = runs["killed"]
    assert result["rc"] == 128 + signal.SIGKILL, result
    line = result["stderr"].splitlines()[-1]
    assert line.startswith("plait: rank 1") and "killed by SIGKILL" in line, line
    if NETNS:
        assert "rank 1 on host 1 (10.213.0.2)" in line
    assert not result["timed_out"] and result["elapsed"] < LONG_S, result  # rank 0 was stopped


def test_cluster_run_keeps_its_deadline(runs):
    result = runs["deadline"]
    assert result["rc"] == 124 and "1 s deadline" in result["stderr"], result
    assert not result["timed_out"] and result["elapsed"] < LONG_S, result


def test_simulate_table_never_cuts_a_figure_when_piped(runs):
    out = runs["table"]["stdout"]
    assert runs["table"]["rc"] == 0, runs["table"]
    assert "…" not in out
    assert "19194.56" in out and "54,629" in out and "15826.26" in out, out


@pytest.mark.parametrize("width", [100, 80, 60, 40])
def test_tables_fold_labels_never_figures(width):
    columns = ["fusion", "policy", "step ms", "tokens/s", "speedup", "comm", "wait", "skip", "MFU"]
    figures = ["19195.66", "13,984,177", "1.000x", "25.6%", "0.0%", "0.00%", "51.5%"]
    rows = [["unfused", "migrate", *figures], ["fused", "semi", *figures[:-1], "[red]62.4%[/red]"]]
    buf = io.StringIO()
    print_table("16384 x H100, llama3-70b", columns, rows, caption="simulated", labels=2,
                to=Console(file=buf, width=width, force_terminal=True, color_system=None))
    text = buf.getvalue()
    assert "…" not in text and all(f in text for f in figures + ["62.4%"]), text
    # too narrow even for the figures: wider than the terminal (which wraps), never cropped
    assert all(len(line) <= max(width, 70) for line in text.splitlines()), text
    if width >= 80:
        assert "unfused" in text and "migrate" in text  # room enough: labels stay whole


def test_piped_tables_keep_their_labels_whole():
    """Piped (a log): no terminal wraps, so the table is as wide as it needs, labels whole
    (bench ops' log folded 'matmul_all_reduce' into 'matm/ul_a/ll_r/educ/e')."""
    columns = ["op", "shape", *(f"figure {i}" for i in range(12))]
    rows = [["matmul_all_reduce", "1024×1024×1024", *(f"{i}.25" for i in range(12))]]
    buf = io.StringIO()
    print_table("wide", columns, rows, labels=2, to=Console(file=buf, width=80))
    text = buf.getvalue()
    assert "matmul_all_reduce" in text and "1024×1024×1024" in text, text


@pytest.mark.parametrize("argv,debug,verbose", [
    (["--debug", "bench", "hetero"], True, False), (["bench", "hetero", "--debug"], True, False),
    (["bench", "--debug", "tp"], True, False), (["train", "-v"], False, True),
    (["-v", "train", "--debug"], True, True), (["bench", "hetero"], False, False),
    (["cluster", "run", "--", "python", "x.py", "--debug"], False, False)])
def test_debug_and_verbose_go_before_or_after_the_command(argv, debug, verbose):
    """As torchrun users write them: ``plait train --debug`` as well as ``plait --debug
    train`` (a trial's ``--debug`` after the command was refused as unknown); a command
    ``cluster run`` starts keeps its own."""
    args = cli_main.build_parser().parse_args(argv)
    assert (args.debug, args.verbose) == (debug, verbose)


def test_summaries_read_without_python_reprs():
    """A benchmark's summary lines: figures rounded, lists and mappings without Python's
    quotes and braces (bench hetero printed ``{'spike/even': 0.0, ...}`` and 17-digit
    floats), brackets kept as text (rich would take ``[b]`` for markup)."""
    buf = io.StringIO()
    print_summary({"max_overhead": 0.0129512345, "acc_loss_pp": {"spike/resize": 0.40712},
                   "ratio_per_seed": [1.0123456, 0.98], "factors": [[1.0, 2.0], [1.0, 1.5]],
                   "all_agree": True, "note": "[b]kept[/b]"}, to=Console(file=buf, width=80))
    assert buf.getvalue().splitlines() == [
        "  max_overhead: 0.01295", "  acc_loss_pp: spike/resize 0.4071",
        "  ratio_per_seed: 1.012, 0.98", "  factors: [1, 2], [1, 1.5]", "  all_agree: True",
        "  note: [b]kept[/b]"]


def _main(monkeypatch, capsys, argv, error):
    def fail(args):
        raise error

    monkeypatch.setattr("plait.cli.train.run_train", fail)
    rc = cli_main.main(argv)
    return rc, capsys.readouterr().err


def test_rank_error_is_one_line_and_debug_shows_the_ranks_traceback(monkeypatch, capsys):
    monkeypatch.delenv("PLAIT_DEBUG", raising=False)
    dead = RankError(1, "died (killed by SIGKILL) before returning", "", -9,
                     host="host 1 (10.213.0.2)")
    rc, err = _main(monkeypatch, capsys, ["train"], dead)
    assert rc == 1 and err == ("plait: error: rank 1 on host 1 (10.213.0.2) died (killed by "
                               "SIGKILL) before returning; the other ranks were stopped (out of "
                               "memory? dmesg tells)\n")
    raised = RankError(0, "raised ZeroDivisionError: boom", "Traceback …\n  in step_fn\n",
                       host="loopback")
    rc, err = _main(monkeypatch, capsys, ["train"], raised)
    assert rc == 1 and err.count("\n") == 1 and "--debug" in err and "step_fn" not in err
    rc, err = _main(monkeypatch, capsys, ["--debug", "train"], raised)
    assert rc == 1 and "in step_fn" in err
    assert err.splitlines()[-1].startswith("plait: error: rank 0")


@pytest.mark.parametrize("error,status", [(RuntimeError("gloo: connection refused\nmore"), 1),
                                          (PermissionError(13, "Permission denied", "/x.json"), 1),
                                          (TypeError("steps must be int"), 2)])
def test_expected_failures_are_one_line(monkeypatch, capsys, error, status):
    monkeypatch.delenv("PLAIT_DEBUG", raising=False)
    rc, err = _main(monkeypatch, capsys, ["train"], error)
    assert rc == status and err.count("\n") == 1 and err.startswith("plait: error: "), err


def test_deadline_reaches_the_launcher(monkeypatch):
    seen = []
    monkeypatch.setenv("PLAIT_DEADLINE_S", "unset")  # restored afterwards
    monkeypatch.setattr("plait.cli.train.run_train",
                        lambda args: seen.append(os.environ["PLAIT_DEADLINE_S"]))
    assert cli_main.main(["train"]) == 0 and cli_main.main(["train", "--deadline", "0"]) == 0
    assert cli_main.main(["train", "--deadline", "90.5"]) == 0
    assert seen == ["3600", "0", "90.5"]


@needs_netns
def test_sigterm_stops_everything_and_says_so():
    proc = subprocess.Popen([sys.executable, "-m", "plait", "cluster", "run", "--hosts", "2", "--",
                             "sleep", RANK_SLEEP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "no word from plait in 60 s"
        assert "emulated cluster" in proc.stdout.readline()  # the ranks are starting
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # ends a hang: the stop takes seconds
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.splitlines()[-1] == ("plait: stopped by SIGTERM; everything it started has been "
                                    "stopped")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"plait-{proc.pid}x" not in names
    # a rank being killed shows its command line until it has let go of its memory: looked
    # for until none is left (milliseconds), 30 s at most against the ranks' 641.5 s sleep
    assert _gone_within(30.0, lambda: [pid for pid in os.listdir("/proc")
                                       if pid.isdigit() and RANK_SLEEP in _cmdline(pid)])


def _gone_within(limit_s: float, left) -> bool:
    end = time.monotonic() + limit_s
    while left():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
