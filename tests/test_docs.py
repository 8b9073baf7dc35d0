"""The README and docs/: short, self-contained, and every figure generated from a stored run.

The figures come from docs/results/NAME/run-K.json through scripts/docs_tables.py; these
tests check that the pages agree with that JSON, that a changed JSON changes the pages
(so the check can fail), and that no link leaves the repository or points nowhere.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "docs_tables.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "results").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
ABSOLUTE = re.compile(r"(?:^|[\s`'\"(\[=])(/(?:work|home|tmp|root|usr|etc|opt|var|mnt|srv)/[\w./-]*)")


def _tables():
    spec = importlib.util.spec_from_file_location("docs_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_every_docs_page_is_a_front_page():
    """A page says what a feature is, how to use it, what it promises and its figures; run
    histories go to the results pages beside the runs (docs/results/*.md), which may be long."""
    long = {p.name: n for p in sorted((ROOT / "docs").glob("*.md"))
            if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"pages over 300 lines (move their histories to docs/results/): {long}"


def test_every_module_docstring_is_a_front_page():
    """A module's docstring says what the module does and why, in at most 40 lines; the
    rest belongs in docs/ (figures) or commit messages (histories)."""
    import ast

    long = {}
    for path in sorted((ROOT / "src" / "plait").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and len(doc.splitlines()) > 40:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert not long, f"module docstrings over 40 lines: {long}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_outside_the_repository(page):
    text = page.read_text()
    for m in re.finditer(r"(?:\.\./)+[\w./#-]*", text):
        target = (page.parent / m[0].split("#")[0]).resolve()
        assert target == ROOT or ROOT in target.parents, \
            f"{page.name}: {m[0]!r} leaves the repository"
    found = ABSOLUTE.findall(text)
    assert not found, f"{page.name}: absolute paths {found}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_and_headings(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link {target!r} points to nothing"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name}: no heading #{anchor} in {dest.name}"


def test_generated_regions_match_the_stored_json():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, "stale tables: run python scripts/docs_tables.py\n" + done.stdout[-3000:]


def test_every_stored_run_names_its_command():
    for data in (ROOT / "docs" / "results").glob("*/run-*.json"):
        if data.name.endswith(".meta.json"):
            continue
        meta = json.loads(data.with_name(data.name.replace(".json", ".meta.json")).read_text())
        # the command, after the environment variables some runs set (PLAIT_COMM_PRIORITY=off)
        assert re.match(r"^([A-Z_]+=\S+ )*\./run\.sh ", meta["command"]), meta["command"]
        assert {"cores", "torch"} <= set(meta["host"]) and meta["started"]


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def _ops_runs(root: Path) -> list[Path]:
    return sorted((root / "docs" / "results" / "bench-ops-quick").glob("run-[0-9].json"))


def test_a_changed_json_changes_the_pages(tmp_path):
    root = _copy(tmp_path)
    runs = _ops_runs(root)
    if not runs:
        pytest.skip("no stored bench-ops-quick run")
    tables = _tables()
    assert tables.main(["--check", "--root", str(root)]) == 0
    data = json.loads(runs[0].read_text())
    data["meta"]["summary"]["median_speedup_balanced"] = 9.87
    runs[0].write_text(json.dumps(data))
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert tables.main(["--root", str(root)]) == 0
    assert "9.87" in (root / "docs" / "benchmarks.md").read_text()
    assert tables.main(["--check", "--root", str(root)]) == 0


def test_readme_takes_a_figure_only_from_two_runs(tmp_path):
    root = _copy(tmp_path)
    folder = root / "docs" / "results" / "bench-ops-quick"
    runs = _ops_runs(root)
    if not runs:
        pytest.skip("no stored bench-ops-quick run")
    for old in list(folder.glob("run-*.json")):
        old.unlink()
    data = json.loads(runs[0].read_text()) if runs[0].exists() else None
    data = data or json.loads((ROOT / "docs/results/bench-ops-quick" / runs[0].name).read_text())
    meta = json.loads((ROOT / "docs/results/bench-ops-quick" / runs[0].name.replace(".json", ".meta.json"))
                      .read_text())
    tables = _tables()

    def store(k: int, speedup: float) -> None:
        data["meta"]["summary"]["median_speedup_balanced"] = speedup
        (folder / f"run-{k}.json").write_text(json.dumps(data))
        (folder / f"run-{k}.meta.json").write_text(json.dumps({**meta, "run": k}))

    store(1, 1.11)
    tables.main(["--root", str(root)])
    assert "1.11" not in (root / "README.md").read_text()
    store(2, 1.22)
    tables.main(["--root", str(root)])
    readme = (root / "README.md").read_text()
    assert "1.11–1.22" in readme and "1.11, 1.22" in readme


def test_after_the_last_decision_takes_the_steps_that_follow_it_per_seed():
    settled = _tables().settled
    run = {"scenario": "straggler-2x", "policy": "semi", "t_ideal_s": 0.1,
           "step_times_s": [0.9, 0.3, 0.2, 0.12, 0.1, 0.11]}
    records = [{**run, "seed": 1, "decisions": [{"step": 1}, {"step": 2}]},
               {**run, "seed": 0, "decisions": [{"step": 4}]},
               {**run, "seed": 2, "decisions": []},  # never decided: nothing to settle
               {**run, "policy": "migrate", "seed": 0, "decisions": [{"step": 0}]}]
    assert settled(records, "straggler-2x", "semi") == [pytest.approx(1.1),
                                                        pytest.approx(1.1)]
    assert settled(records, "straggler-2x", "migrate") == [pytest.approx(1.2)]
