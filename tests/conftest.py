"""The suite's settings, the emulated-cluster marker, and CI's rule that nothing skips.

``PLAIT_REQUIRE_ALL=1`` (``.ci/run`` sets it; CI runs as root with iproute2): a
test that skips fails instead, its skip reason in the failure, and a test
module that skips as it is collected is a collection error; a run of this
suite where no emulated cluster can be made stops at once (some tests take a
loopback branch there, and would pass). A broken CI machine (no root, no
``ip``, no CAP_SYS_NICE, a lost file) then fails the run instead of passing it
with fewer tests. Two ways to let a skip stand in CI:

- ``@pytest.mark.may_skip("why CI may lack it")`` on the test;
- a skip reason that starts with a key of :data:`MAY_SKIP_REASONS`, for optional
  dependencies that the ``test`` extra does not install (no test file to edit).

Without the variable a skip is a skip, as on any machine.
"""

import os
from pathlib import Path

# Before anything imports torch: OpenMP reads OMP_NUM_THREADS once, as torch loads, and a
# setting made after that left this process one thread per core (straggler emulation's
# clock, runtime.slow.straggler.compute_clock, follows the thread count). Nothing this file
# imports at its top imports torch; the test modules, collected after it, do.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Hypothesis fails an example that runs past its deadline (200 ms of wall time by default),
# and fails a test as flaky where a rerun comes in under it. On the shared CI machine a
# process gets as little as an eighth of a core (docs/cluster.md), so that measures the
# machine, not the code: no deadline anywhere. A test about speed says so in its own
# assertions; a hang still ends at the collective timeout or the run's deadline.
settings.register_profile("plait", deadline=None)
settings.load_profile("plait")

REQUIRE_ALL_ENV = "PLAIT_REQUIRE_ALL"

MAY_SKIP_REASONS = {
    "TorchRec does not import here":
        "TorchRec is optional (bench tp's comparison); the test extra does not install it",
}
"""Skip reasons (prefixes) that CI accepts, each with why."""

needs_netns = pytest.mark.netns
"""Needs root and iproute2 (an emulated cluster); skips elsewhere, saying which is missing."""

_cluster_missing: list[str | None] = []  # cluster_support(), asked once


def read_tbf(netns: str, dev: str) -> dict:
    """What the kernel holds for ``dev``'s root qdisc in ``netns`` (``tc -j -s qdisc``): its
    kind, and for a tbf its rate (bytes/s), burst (bytes) and latency (µs) as configured,
    and its counters since it was made: bytes, packets, drops, overlimits (packets it held
    back for want of tokens)."""
    import json
    import subprocess

    out = subprocess.run(["ip", "netns", "exec", netns, "tc", "-j", "-s", "qdisc", "show",
                          "dev", dev], capture_output=True, text=True, check=True).stdout
    [root] = [q for q in json.loads(out) if q.get("root")]
    return {"kind": root["kind"], **root.get("options", {}),
            **{k: root[k] for k in ("bytes", "packets", "drops", "overlimits")}}


def budgets_here() -> None:
    """Skip (a failure under PLAIT_REQUIRE_ALL, as for namespaces) where CPU budgets cannot be
    enforced: no writable cgroup cpu controller."""
    from plait.runtime.slow.cgroup import cpu_controller, cpu_support

    reason = cpu_support(cpu_controller())
    if reason is not None:
        pytest.skip(f"no CPU budgets here: {reason}")


def require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line("markers", "netns: needs root and iproute2 (emulated cluster)")
    config.addinivalue_line("markers", "may_skip(reason): CI accepts this test's skip, for the "
                                       f"reason given (see {REQUIRE_ALL_ENV} in tests/conftest.py)")
    # chunks="auto" reads a saved profile instead of calibrating in every launched group
    # (≈ 1 s each); tests/ops/test_calibration.py measures one for real.
    import tempfile

    from plait.perf.calibrate import DEFAULT_PROFILE

    # the suite's collectives take torch.distributed (gloo), whose cost model and timeouts
    # its tests were written against; tests/transport runs shared memory (and "auto") itself
    os.environ.setdefault("PLAIT_TRANSPORT", "gloo")
    config._plait_profile_dir = tempfile.mkdtemp(prefix="plait-test-")
    path = os.path.join(config._plait_profile_dir, "profile.json")
    DEFAULT_PROFILE.save(path)
    os.environ["PLAIT_PROFILE"] = path


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(getattr(config, "_plait_profile_dir", ""), ignore_errors=True)


def pytest_report_header(config):
    if require_all():
        return f"{REQUIRE_ALL_ENV}=1: a skipped test fails (tests/conftest.py)"
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("netns") is None:
        return
    if not _cluster_missing:
        from plait.runtime import cluster_support  # imports torch, as the test module did

        _cluster_missing.append(cluster_support())
    if _cluster_missing[0] is not None:
        pytest.skip(f"no emulated cluster here: {_cluster_missing[0]}")


def pytest_collection_finish(session):
    """Under the variable, a run of this suite needs the emulated cluster CI has: some tests
    (tests/cli) take a loopback branch without one, and would pass having tested less."""
    here = Path(__file__).resolve().parent
    if not require_all() or not any(Path(item.path).is_relative_to(here)
                                    for item in session.items):
        return  # e.g. test_ci_strict's tiny suite
    from plait.runtime import cluster_support

    missing = cluster_support()
    if missing is not None:
        raise pytest.UsageError(f"{REQUIRE_ALL_ENV}=1 (CI) needs an emulated cluster: {missing}")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def _refusal(reason: str, item=None) -> str | None:
    """Why CI refuses this skip, or None where it may stand."""
    if any(reason.startswith(allowed) for allowed in MAY_SKIP_REASONS):
        return None
    marker = item.get_closest_marker("may_skip") if item is not None else None
    if marker is not None:
        if marker.args and str(marker.args[0]).strip():
            return None
        return f"it is marked may_skip without a reason, and it skipped: {reason}"
    return (f"{REQUIRE_ALL_ENV}=1 (CI) forbids skipping, and this skipped: {reason}\n"
            "(if CI may lack what it needs, mark the test @pytest.mark.may_skip(\"why\"), or add "
            "the reason to MAY_SKIP_REASONS in tests/conftest.py)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and require_all():
        refusal = _refusal(_skip_reason(report), item)
        if refusal is not None:
            report.outcome = "failed"
            report.longrepr = refusal
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.skipped and require_all():  # a module-level skip or importorskip
        refusal = _refusal(_skip_reason(report))
        if refusal is not None:
            report.outcome = "failed"
            report.longrepr = refusal
    return report


@pytest.fixture(autouse=True)
def _plait_environment_restored():
    """A test that runs the command line in this process (``main([... "--transport",
    "shm"])``) sets what the ranks inherit (``PLAIT_TRANSPORT``); the next test starts from
    the suite's settings again, not from what the last one left."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("PLAIT_")}
    yield
    for key in [k for k in os.environ if k.startswith("PLAIT_") and k not in saved]:
        del os.environ[key]
    os.environ.update(saved)
