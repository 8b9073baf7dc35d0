"""Run many ``plait`` command lines as processes of their own, paying torch's import once.

``run_plait([{"argv": [...], "cwd": DIR, "env": {...}}, ...])`` starts
``python tests/cli/forkrun.py`` with the rows on its stdin. This interpreter imports every command
module (and so torch), then forks one child per row, a few at a time; each child is a
fresh process running ``plait.cli.main.main(argv)`` in its own folder, with its stdout
and stderr in files, exactly as ``python -m plait ARGV`` would run it but for the
interpreter's start. A child that runs past ``timeout_s`` is killed with everything it
started (its process group). Prints one result per row: rc, stdout, stderr, elapsed, timed_out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback


def run_plait(rows: list[dict], timeout_s: float = 25.0, parallel: int = 4) -> list[dict]:
    """Each row as its own ``plait`` process; its result: rc, stdout, stderr, elapsed (s),
    timed_out. PLAIT_DEBUG and COLUMNS are taken out of the environment unless a row sets them."""
    env = {k: v for k, v in os.environ.items() if k not in ("PLAIT_DEBUG", "COLUMNS")}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          input=json.dumps({"rows": rows, "timeout_s": timeout_s,
                                            "parallel": parallel}), timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _child(row: dict, out: str, err: str) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        os.chdir(row["cwd"])
        os.environ.update(row.get("env", {}))
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


def run_rows(rows: list[dict], timeout_s: float, parallel: int) -> list[dict]:
    scratch = tempfile.mkdtemp(prefix="plait-forkrun-")
    results: list[dict | None] = [None] * len(rows)
    running: dict[int, tuple[int, float]] = {}  # pid → (row, start)
    todo = list(range(len(rows)))
    while todo or running:
        while todo and len(running) < parallel:
            i = todo.pop(0)
            out, err = (os.path.join(scratch, f"{i}.{s}") for s in ("out", "err"))
            pid = os.fork()
            if pid == 0:
                _child(rows[i], out, err)
            running[pid] = (i, time.monotonic())
        time.sleep(0.02)
        for pid, (i, start) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - start
            timed_out = not done and elapsed > timeout_s
            if timed_out:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status = os.waitpid(pid, 0)
            if done or timed_out:
                del running[pid]
                read = lambda s: open(os.path.join(scratch, f"{i}.{s}"), errors="replace").read()
                results[i] = {"rc": os.waitstatus_to_exitcode(status), "stdout": read("out"),
                              "stderr": read("err"), "elapsed": elapsed, "timed_out": timed_out}
    shutil.rmtree(scratch, ignore_errors=True)
    return results


if __name__ == "__main__":
    from plait.cli.main import build_parser

    build_parser()  # imports every command module, torch with them, before the forks
    request = json.load(sys.stdin)
    json.dump(run_rows(request["rows"], request.get("timeout_s", 25.0),
                       request.get("parallel", 4)), sys.stdout)
