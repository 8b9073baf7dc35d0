"""plait bench checkpoint: blocking and asynchronous checkpoints in turns on 2 ranks, every
checkpoint's stall and the medians in the JSON, nothing left in the temporary folder; bad
input refused in one line; the JSON's figures reach README's headline and docs/checkpoints.md
through scripts/docs_tables.py."""

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--ranks", "2", "--checkpoints", "3", "--every", "1", "--warmup", "1",
        "--plain-steps", "1", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
        "--seq-len", "8", "--batch-size", "2", "--microbatches", "1"]
# (id, argv after "bench checkpoint", what the one line must say, files the folder starts with)
BAD = [
    ("checkpoints-zero", ["--checkpoints", "0"], "--checkpoints must be at least 1, got 0", ()),
    ("every-zero", ["--every", "0"], "--every must be at least 1, got 0", ()),
    ("heads-under-ranks", ["--ranks", "2", "--n-head", "1"], "--n-head 1", ()),
    ("plot", ["--plot", "c.png"], "--plot c.png", ()),
    ("dir-is-a-file", ["--checkpoint-dir", "taken"], "--checkpoint-dir taken", ("taken",)),
]


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny run as the user starts it: its own interpreter, which exits as it would (a
    forked one skips multiprocessing's clean-up), its temporary folder a new one."""
    root = tmp_path_factory.mktemp("bench-checkpoint")
    (root / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PLAIT_DEBUG", "COLUMNS")}
    done = subprocess.run([sys.executable, "-m", "plait", "bench", "checkpoint", *TINY,
                           "--no-progress", "--json", "out/c.json"], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**env, "TMPDIR": str(root / "tmp")})
    assert done.returncode == 0, done.stderr[-3000:]
    return root, done, json.loads((root / "out" / "c.json").read_text())


def test_every_checkpoint_in_turns_with_its_stall(good):
    _, result, data = good
    recs = data["records"]
    assert [r["kind"] for r in recs] == ["blocking", "async"] * 3
    assert [r["checkpoint"] for r in recs] == [1, 1, 2, 2, 3, 3]
    plain = data["meta"]["summary"]["plain_step_s"]
    assert plain > 0
    for r in recs:
        assert r["stall_s"] > 0 and len(r["steps_after_s"]) == 1
        assert r["world_size"] == 2 and r["link"] == "loopback"
        assert r["interval_extra_s"] == pytest.approx(r["stall_s"] + r["steps_after_s"][0] - plain)
        assert (r["async_wait_s"] is None) == (r["kind"] == "blocking")
        assert r["kind"] == "blocking" or r["async_wait_s"] > 0
    assert "median" in result.stdout and "async stall (ms)" in result.stdout
    print(f"\nstalls (ms): {[round(r['stall_s'] * 1e3) for r in recs]}, plain step "
          f"{plain * 1e3:.0f} ms")


def test_the_medians_are_over_the_checkpoints_of_each_kind(good):
    _, _, data = good
    s = data["meta"]["summary"]
    for kind in ("blocking", "async"):
        mine = [r for r in data["records"] if r["kind"] == kind]
        assert s[f"{kind}_stall_s"] == statistics.median(r["stall_s"] for r in mine)
        assert s[f"{kind}_interval_extra_s"] == statistics.median(
            r["interval_extra_s"] for r in mine)
    assert s["async_wait_s"] == statistics.median(
        r["async_wait_s"] for r in data["records"] if r["kind"] == "async")
    assert s["blocking_over_async"] == pytest.approx(s["blocking_stall_s"] / s["async_stall_s"])
    assert s["checkpoints"] == 3 and data["meta"]["config"]["every"] == 1


def test_a_checkpoint_holds_the_model_and_both_adamw_moments(good):
    from plait.models import GPT, GPTConfig

    _, _, data = good
    gpt = GPT(GPTConfig(vocab_size=97, block_size=8, n_layer=1, n_head=2, n_embd=32))
    numel = sum(p.numel() for p in gpt.parameters())
    assert data["meta"]["summary"]["checkpoint_bytes"] >= 3 * 4 * numel  # fp32 each


def test_nothing_is_left_in_the_temporary_folder(good):
    root = good[0]
    # torch keeps its compile cache (torchinductor_USER) there on purpose; nothing else stays
    left = [p.name for p in (root / "tmp").iterdir() if not p.name.startswith("torchinductor")]
    assert left == []
    assert [p for p in _tree(root) if not p.startswith("tmp")] == ["out", "out/c.json"]


@pytest.mark.parametrize("name,argv,says,files", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_in_one_line(name, argv, says, files, tmp_path, monkeypatch,
                                          capsys):
    from plait.cli.main import build_parser, main

    build_parser()  # the commands' imports (torch) once, outside the time the refusal takes
    for f in files:
        (tmp_path / f).write_text("already here\n")
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    rc = main(["bench", "checkpoint", *argv])  # refused before any rank starts, or it hangs
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait: error: ") and says in lines[0], lines
    assert rc == 2 and out == "" and time.monotonic() - start < 5
    assert _tree(tmp_path) == sorted(files)


def _docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables",
                                                  ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _row(root: Path) -> str:
    return next(line for line in (root / "README.md").read_text().splitlines()
                if "Checkpoint stall" in line)


def test_docs_tables_shows_the_runs_in_readme_and_docs(good, tmp_path):
    _, _, data = good
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    folder = tmp_path / "docs" / "results" / "bench-checkpoint"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    tables = _docs_tables()

    def store(k: int, async_ms: float, blocking_ms: float) -> None:
        summary = {**data["meta"]["summary"], "async_stall_s": async_ms / 1e3,
                   "blocking_stall_s": blocking_ms / 1e3}
        run = {**data, "meta": {**data["meta"], "summary": summary}}
        (folder / f"run-{k}.json").write_text(json.dumps(run))
        command = f"./run.sh bench checkpoint --no-progress --json {folder.name}/run-{k}.json"
        (folder / f"run-{k}.meta.json").write_text(json.dumps(
            {"name": "bench-checkpoint", "run": k, "command": command, "exit": 0,
             "started": "2026-12-04T23:00:00Z", "wall_s": 30.0, "loadavg_before": "1.5 1 1",
             "host": {"cores": 2, "torch": "2.13.0", "commit": "abc"}}))

    store(1, 97.0, 746.0)
    assert tables.main(["--root", str(tmp_path)]) == 0
    assert "| awaiting a second run (1 so far) |" in _row(tmp_path)
    store(2, 234.0, 1333.0)
    assert tables.main(["--root", str(tmp_path)]) == 0
    row = _row(tmp_path)
    assert "**97–234 ms vs 746–1333 ms**" in row and "| 97 vs 746, 234 vs 1333 |" in row
    assert "`./run.sh bench checkpoint`" in row
    page = (tmp_path / "docs" / "checkpoints.md").read_text()
    for kind in ("blocking", "async"):  # every checkpoint's stall, in ms, as the JSON has it
        stalls = [f"{r['stall_s'] * 1e3:.0f}" for r in data["records"] if r["kind"] == kind]
        assert f"[{', '.join(stalls)}]" in page
    assert "run 1: 2026-12-04 23:00 UTC" in page
    assert tables.main(["--check", "--root", str(tmp_path)]) == 0
