"""CI's rule (tests/conftest.py): under the variable .ci/run sets, a skipped test fails.

Shown on a tiny suite of its own, run by pytest in a child with this suite's conftest as
a plugin (it imports no torch: about a second), once as .ci/run runs and once without.
"""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import MAY_SKIP_REASONS, REQUIRE_ALL_ENV

ROOT = Path(__file__).resolve().parents[1]

_TINY = '''
import pytest

@pytest.mark.skipif(True, reason="no widget here")
def test_marked_skip():
    pass

def test_skip_in_body():
    pytest.skip("the widget went away")

@pytest.mark.may_skip("widgets are optional")
def test_allowed_by_marker():
    pytest.skip("no widget here either")

@pytest.mark.may_skip("")
def test_marker_without_a_reason():
    pytest.skip("no reason to allow")

def test_allowed_by_reason():
    pytest.skip({allowed!r} + ": ModuleNotFoundError")

def test_runs():
    pass
'''

_TINY_MODULE_SKIP = 'import pytest\npytest.importorskip("plait_no_such_module")\n'


def _ci_env() -> dict[str, str]:
    """What .ci/run exports before it calls the README's command, exactly ``./test.sh``."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    assert lines[-1] == "./test.sh", lines
    return dict(re.fullmatch(r"export (\w+)=(\S+)", line).groups()
                for line in lines if line.startswith("export "))


def _start(tmp_path: Path, name: str, ci: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ALL_ENV} | ci
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    xml = tmp_path / f"{name}.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
           "-p", "no:hypothesispytest", "-q",  # hypothesis's plugin alone takes a second
           "--continue-on-collection-errors", f"--junitxml={xml}", "--rootdir", str(tmp_path),
           str(tmp_path / "tiny")]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), xml


def _outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """Test (or module, when its collection ended) → (passed|failure|error|skipped, message)."""
    seen = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = (case.get("name") or case.get("classname")).rpartition(".")[2]
        kids = [k for k in case if k.tag in ("failure", "error", "skipped")]
        seen[name] = ((kids[0].tag, (kids[0].get("message") or "") + (kids[0].text or ""))
                      if kids else ("passed", ""))
    return seen


def test_ci_run_turns_a_skip_into_a_failure(tmp_path):
    ci = _ci_env()
    assert ci.get(REQUIRE_ALL_ENV) == "1", f".ci/run does not export {REQUIRE_ALL_ENV}=1: {ci}"
    (tmp_path / "tiny").mkdir()
    allowed = next(iter(MAY_SKIP_REASONS))
    (tmp_path / "tiny" / "test_tiny.py").write_text(_TINY.format(allowed=allowed))
    (tmp_path / "tiny" / "test_tiny_module_skip.py").write_text(_TINY_MODULE_SKIP)
    runs = {"ci": _start(tmp_path, "ci", ci), "plain": _start(tmp_path, "plain", {})}
    out = {name: proc.communicate(timeout=300)[0] for name, (proc, _) in runs.items()}
    codes = {name: proc.returncode for name, (proc, _) in runs.items()}

    assert codes["plain"] == 0, out["plain"]
    plain = _outcomes(runs["plain"][1])
    assert {name: kind for name, (kind, _) in plain.items()} == {
        "test_marked_skip": "skipped", "test_skip_in_body": "skipped",
        "test_allowed_by_marker": "skipped", "test_marker_without_a_reason": "skipped",
        "test_allowed_by_reason": "skipped", "test_runs": "passed",
        "test_tiny_module_skip": "skipped"}, out["plain"]

    assert codes["ci"] == 1, out["ci"]
    ci_seen = _outcomes(runs["ci"][1])
    expected = {  # a skip before the test (a mark, a fixture) is an error, inside it a failure
        "test_marked_skip": ("error", "no widget here"),
        "test_skip_in_body": ("failure", "the widget went away"),
        "test_allowed_by_marker": ("skipped", "no widget here either"),
        "test_marker_without_a_reason": ("failure", "marked may_skip without a reason"),
        "test_allowed_by_reason": ("skipped", allowed),
        "test_runs": ("passed", ""),
        "test_tiny_module_skip": ("error", "plait_no_such_module"),
    }
    assert set(ci_seen) == set(expected), out["ci"]
    for name, (kind, words) in expected.items():
        assert ci_seen[name][0] == kind and words in ci_seen[name][1], (name, ci_seen[name])
    for name in ("test_marked_skip", "test_skip_in_body", "test_tiny_module_skip"):
        assert f"{REQUIRE_ALL_ENV}=1 (CI) forbids skipping" in ci_seen[name][1], ci_seen[name]


def test_ci_run_of_this_suite_needs_an_emulated_cluster(monkeypatch):
    import conftest
    import plait.runtime

    mine = SimpleNamespace(items=[SimpleNamespace(path=Path(__file__))])
    elsewhere = SimpleNamespace(items=[SimpleNamespace(path=Path("/elsewhere/test_x.py"))])
    monkeypatch.setattr(plait.runtime, "cluster_support", lambda: "'ip' is not installed")
    monkeypatch.delenv(REQUIRE_ALL_ENV, raising=False)
    conftest.pytest_collection_finish(mine)  # not CI: tests may take their loopback branch
    monkeypatch.setenv(REQUIRE_ALL_ENV, "1")
    conftest.pytest_collection_finish(elsewhere)  # not this suite (the tiny one above)
    with pytest.raises(pytest.UsageError, match="needs an emulated cluster: 'ip' is not"):
        conftest.pytest_collection_finish(mine)
