"""The scripts in examples/ run as their docstrings say.

examples/train_hf_llama.py under plain ``torchrun --nproc-per-node 2`` (``--standalone``
for a free port): it exits 0, prints its 10 steps, the loss falls, and every printed
loss is what the same script prints as one process (``python train_hf_llama.py``: a
world of one, the plain model's math). float32, printed to 5 decimals: equal within
2e-4 (measured: equal to the last digit). Both runs start at once (each is mostly
imports), and neither may leave a process behind.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "examples" / "train_hf_llama.py"
LIMIT_S = 240


def _start(*argv: str, tmp: Path) -> subprocess.Popen:
    # torchrun's agent leaves a torchrun_*/torchelastic_* log folder in $TMPDIR: the test's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group: torchrun's ranks go with it


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} ran past {LIMIT_S} s:\n{out}\n{err}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of it may outlive the test
        except ProcessLookupError:
            pass
    return proc.returncode, out, err


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)$", out, re.M)]


def test_train_hf_llama_runs_under_torchrun(tmp_path):
    assert len(LLAMA.read_text().splitlines()) < 30  # the README's promise: under 30 lines
    ranks = _start("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(LLAMA), tmp=tmp_path)
    alone = _start(str(LLAMA), tmp=tmp_path)
    (rc, out, err), (rc1, out1, err1) = _finish(ranks), _finish(alone)
    assert rc == 0, err[-3000:]
    assert rc1 == 0, err1[-3000:]
    losses, reference = _losses(out), _losses(out1)
    assert len(losses) == 10, out
    assert losses[-1] < losses[0] - 1.0, losses  # it learns its two batches
    assert losses == pytest.approx(reference, abs=2e-4, rel=0), (losses, reference)
