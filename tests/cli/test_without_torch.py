"""The command line answers ``--help`` and refuses a wrong argument without importing torch.

Each run is a fresh interpreter in which ``import torch`` fails (``sys.modules["torch"] =
None``): a command that reached torch before answering exits 1 with ModuleNotFoundError,
one that did not exits as plait means it to (0 for help, 2 for a refusal). This decides
what is imported, not how long it takes (the time is in the closing notes of issue 52).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from plait.cli.commands import BENCHMARKS, COMMANDS

BLOCKED = ("import sys; sys.modules['torch'] = None\n"
           "from plait.cli.main import main\n"
           "raise SystemExit(main(sys.argv[1:]))\n")

HELPS = [[name] for name in COMMANDS] + [["bench", name] for name in BENCHMARKS] + \
    [["cluster", "status"]]

REFUSALS = [  # (argv, what the one line says)
    (["train", "--ranks", "0"], "--ranks: must be at least 1"),
    (["train", "--steps", "0"], "--steps must be positive"),
    (["train", "--model", "nope"], "--model must be one of"),
    (["train", "--n-head", "3"], "n_head 3"),
    (["demo", "--slow", "1:0.5@5"], "factor must be at least 1"),
    (["demo", "--slow-from", "3"], "unrecognized arguments"),
    (["generate", "--model", "./nope"], "no such file or directory"),
    (["generate", "--ranks", "9"], "cannot give each of 9 ranks a whole head"),
    (["generate", "--prompt-ids", "1 x"], "'x' is not a token id"),
    (["bench", "decode", "--systems", "foo"], "--systems foo"),
    (["bench", "ops", "--ops", "foo"], "--ops foo: no such operator"),
    (["bench", "tp", "--n-head", "7"], "n_head 7"),
    (["bench", "hetero", "--policies", "foo"], "--policies"),
    (["bench", "collectives", "--min-bytes", "0"], "--min-bytes 0"),
    (["bench", "load", "--size-gb", "0"], "--size-gb must be at least 0.01"),
    (["elastic", "--hosts", "0"], "--hosts must be positive"),
    (["bench", "nope"], "BENCHMARK 'nope' is not one of"),
    (["trian"], "did you mean train?"),
]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED, *argv], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv", HELPS, ids=" ".join)
def test_help_needs_no_torch(argv):
    done = _run([*argv, "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: plait" in done.stdout


@pytest.mark.parametrize("argv,says", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_refusal_needs_no_torch(argv, says):
    done = _run(argv)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), done.stderr
    assert says in lines[0]


def test_top_help_lists_every_command():
    done = _run(["--help"])
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in COMMANDS)
    bench = _run(["bench", "--help"])
    assert all(name in bench.stdout for name in BENCHMARKS)


def test_the_named_command_loads_alone():
    """``plait train …`` builds train's flags only: no other command's module is imported."""
    probe = ("import sys; sys.modules['torch'] = None\n"
             "from plait.cli.main import build_parser\n"
             "build_parser(['train', '--steps', '3']).parse_args(['train', '--steps', '3'])\n"
             "print(sorted(m for m in sys.modules if m.startswith('plait.cli.')))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout)  # a printed list of names
    assert "plait.cli.train" in loaded
    assert not [m for m in loaded if m.split(".")[-1] in COMMANDS and m != "plait.cli.train"]
