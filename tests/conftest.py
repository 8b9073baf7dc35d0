import os

import pytest

from plait.runtime import cluster_support

needs_netns = pytest.mark.skipif(cluster_support() is not None,
                                 reason=f"no emulated cluster here: {cluster_support()}")


def pytest_configure(config):
    config.addinivalue_line("markers", "netns: needs root and iproute2 (emulated cluster)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # chunks="auto" reads a saved profile instead of calibrating in every launched group
    # (≈ 1 s each); tests/ops/test_calibration.py measures one for real.
    import tempfile

    from plait.perf.calibrate import DEFAULT_PROFILE

    config._plait_profile_dir = tempfile.mkdtemp(prefix="plait-test-")
    path = os.path.join(config._plait_profile_dir, "profile.json")
    DEFAULT_PROFILE.save(path)
    os.environ["PLAIT_PROFILE"] = path


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(getattr(config, "_plait_profile_dir", ""), ignore_errors=True)
