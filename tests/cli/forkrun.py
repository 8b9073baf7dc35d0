"""Run many ``plait`` command lines as processes of their own, paying torch's import once.

``run_plait([{"argv": [...], "cwd": DIR, "env": {...}}, ...])`` starts
``python tests/cli/forkrun.py`` with the rows on its stdin. This interpreter imports every command
module (and so torch), then forks one child per row, a few at a time; each child is a
fresh process running ``plait.cli.main.main(argv)`` in its own folder, with its stdout
and stderr in files, exactly as ``python -m plait ARGV`` would run it but for the
interpreter's start. Each child leads a process group of its own, as a shell's job does. A
child that runs past ``timeout_s`` (the row's own, where it gives one) is killed with
everything it started (its process group). Prints one result per row: rc, stdout, stderr,
elapsed, cpu_s (the CPU seconds of the row's process, and of what it started and waited for),
timed_out, pid, signalled (seconds after its start, or None), left (the
processes of its group alive as it ended, ``"PID STATE COMMAND"``; with ``"wait_left_s": S``
in the row, those still alive S seconds later) and linger_s (how long after its end the last
of them lived, up to S).

A row may ask for a signal once the run has launched its ranks (its launch folder,
``$TMPDIR/plait-launch-PID-…``, holds the rank group's store) or printed a text:
``"signal": {"name": "SIGINT", "group": true, "after_s": 1.0, "when": "launched"}``
(``"when": "stdout:TEXT"`` for a text, ``"running:N:COMMAND"`` for N processes of its group
running COMMAND); ``group`` sends it to the whole process group (a terminal's Ctrl-C), else
to the plait process alone.
``"after": [i, …]``: the row starts once rows i, … have ended (an order among rows that
share a machine-wide state, e.g. network namespaces). ``wrap``: a command prefix for the
forking interpreter (e.g. an ``unshare``).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback


def run_plait(rows: list[dict], timeout_s: float = 120.0, parallel: int = 4,
              wrap: list[str] = ()) -> list[dict]:
    """Each row as its own ``plait`` process; its result: rc, stdout, stderr, elapsed (s),
    cpu_s, timed_out, pid, signalled, left. PLAIT_DEBUG and COLUMNS are taken out of the
    environment unless a row sets them. ``timeout_s`` (a row's) and the batch's 30 minutes end
    a hang: on a machine at load 10 a row that starts ranks took 148 s (a forkserver loading
    torch per row, 4 rows at a time), so they time nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("PLAIT_DEBUG", "COLUMNS")}
    # a row's TMPDIR, unless it sets one, is a folder of the batch's, removed after it: each
    # child ends with os._exit, so multiprocessing's pymp-* folder (its forkserver's socket)
    # is not removed by the child (measured: 6 left in /tmp by one suite run)
    with tempfile.TemporaryDirectory(prefix="forkrun-", ignore_cleanup_errors=True) as tmp:
        rows = [{**row, "env": {"TMPDIR": tmp, **row.get("env", {})}} for row in rows]
        proc = subprocess.run([*wrap, sys.executable, __file__], env=env, capture_output=True,
                              text=True, input=json.dumps({"rows": rows, "timeout_s": timeout_s,
                                                           "parallel": parallel}), timeout=1800)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _child(row: dict, out: str, err: str) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        # as plait started from a terminal: a suite started in the background by a script
        # (bash: `cmd &`, or nohup) hands every process SIGINT ignored, so Ctrl-C could not
        # reach the run under test
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(row["cwd"])
        os.environ.update(row.get("env", {}))
        tempfile.tempdir = None  # $TMPDIR as the row sets it, not as the parent found it
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        from plait.cli.main import main

        try:
            code = main(row["argv"])
        except SystemExit as exc:  # argparse's way out, as the interpreter would end
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _group_alive(pgid: int) -> list[str]:
    """``"PID STATE COMMAND"`` of each live process in process group ``pgid`` (not a zombie,
    nor one past releasing its memory)."""
    alive = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        # an empty command line: the process has let go of its memory, so it is ending
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X") and cmd:
            alive.append(f"{name} {fields[0]} {cmd}")
    return alive


def _launched(pid: int, tmp: str) -> bool:
    from plait.runtime.leftovers import LAUNCH_DIR_PREFIX

    return bool(glob.glob(os.path.join(tmp, f"{LAUNCH_DIR_PREFIX}{pid}-*", "store*")))


def _ready(row: dict, pid: int, out: str) -> bool:
    """Whether the row's run is where its signal is meant to find it: ranks launched
    (``"when": "launched"``, the default), a text on its stdout (``"when": "stdout:TEXT"``)
    or N processes of its group running a command line (``"when": "running:N:COMMAND"``)."""
    when = row["signal"].get("when", "launched")
    if when.startswith("running:"):
        count, command = when[len("running:"):].split(":", 1)
        return sum(line.split(" ", 2)[2] == command for line in _group_alive(pid)) >= int(count)
    if when.startswith("stdout:"):
        try:
            with open(out, errors="replace") as f:
                return when[len("stdout:"):] in f.read()
        except FileNotFoundError:  # the child has not opened it yet
            return False
    return _launched(pid, row.get("env", {}).get("TMPDIR", tempfile.gettempdir()))


def _maybe_signal(row: dict, pid: int, out: str, state: dict, elapsed: float) -> None:
    """Send the row's signal once its run is ready and ``after_s`` more have passed."""
    ask = row.get("signal")
    if not ask or state.get("signalled") is not None:
        return
    if state.get("ready") is None:
        if elapsed < state.get("next_look", 0.0):
            return
        state["next_look"] = elapsed + 0.1
        if not _ready(row, pid, out):
            return
        state["ready"] = elapsed
    if elapsed - state["ready"] >= ask.get("after_s", 0.0):
        sig = signal.Signals[ask["name"]]
        try:
            os.killpg(pid, sig) if ask.get("group") else os.kill(pid, sig)
        except ProcessLookupError:
            return
        state["signalled"] = elapsed


WARM = ("torch", "plait.runtime.launch", "plait.training.run", "plait.training.dp_tp",
        "plait.training.report", "plait.training.resume", "plait.bench.demo",
        "plait.bench.demo_report", "plait.bench.decode", "plait.bench.ops",
        "plait.bench.collectives", "plait.bench.tp", "plait.bench.tp_dp", "plait.bench.hetero",
        "plait.bench.hetero_summary", "plait.bench.load", "plait.inference.generate",
        "plait.elastic.launcher")
"""What the commands import once their flags have passed: imported here once, not per row."""


def run_rows(rows: list[dict], timeout_s: float, parallel: int) -> list[dict]:
    scratch = tempfile.mkdtemp(prefix="plait-forkrun-")
    running: dict[int, tuple[int, float, dict]] = {}  # pid → (row, start, signal state)
    try:
        return _run_rows(rows, timeout_s, parallel, scratch, running)
    finally:  # where this interpreter fails, the rows it started end with it
        for pid in running:
            _kill_group(pid)
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_rows(rows: list[dict], timeout_s: float, parallel: int, scratch: str,
              running: dict) -> list[dict]:
    results: list[dict | None] = [None] * len(rows)
    ending: dict[int, tuple[int, float]] = {}  # pid → (row, when its linger ends): group left
    todo = list(range(len(rows)))
    path = lambda i, s: os.path.join(scratch, f"{i}.{s}")
    next_scan = 0.0
    while todo or running or ending:
        while len(running) < parallel:
            ready = [i for i in todo
                     if all(results[j] is not None for j in rows[i].get("after", ()))]
            if not ready:
                break
            i = ready[0]
            todo.remove(i)
            pid = os.fork()
            if pid == 0:
                _child(rows[i], path(i, "out"), path(i, "err"))
            running[pid] = (i, time.monotonic(), {})
        time.sleep(0.02)
        for pid, (i, start, state) in list(running.items()):
            done, status, usage = os.wait4(pid, os.WNOHANG)
            elapsed = time.monotonic() - start
            if not done:
                _maybe_signal(rows[i], pid, path(i, "out"), state, elapsed)
            timed_out = not done and elapsed > rows[i].get("timeout_s", timeout_s)
            if timed_out:
                _kill_group(pid)
                _, status, usage = os.wait4(pid, 0)
            if done or timed_out:
                del running[pid]
                read = lambda s: open(path(i, s), errors="replace").read()
                results[i] = {"rc": os.waitstatus_to_exitcode(status), "stdout": read("out"),
                              "stderr": read("err"), "elapsed": elapsed, "timed_out": timed_out,
                              "cpu_s": usage.ru_utime + usage.ru_stime,
                              "pid": pid, "signalled": state.get("signalled"), "left": None}
                ending[pid] = (i, time.monotonic() + rows[i].get("wait_left_s", 0.0))
        if ending and time.monotonic() >= next_scan:  # a scan of /proc: a few times a second
            next_scan = time.monotonic() + 0.25
            for pid, (i, until) in list(ending.items()):
                alive, now = _group_alive(pid), time.monotonic()
                if not alive or now >= until:
                    wait_s = rows[i].get("wait_left_s", 0.0)
                    results[i]["left"] = alive
                    results[i]["linger_s"] = wait_s - max(0.0, until - now)
                    del ending[pid]
                    if alive:  # recorded; now they go, as the timed-out rows' do
                        _kill_group(pid)
    return results


if __name__ == "__main__":
    import importlib

    from plait.cli.main import build_parser

    build_parser()  # every command module (they parse without torch)
    for name in WARM:  # and what their runs import, torch with it, before the forks
        importlib.import_module(name)
    request = json.load(sys.stdin)
    json.dump(run_rows(request["rows"], request.get("timeout_s", 120.0),
                       request.get("parallel", 4)), sys.stdout)
