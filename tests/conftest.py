import os

import pytest

from plait.runtime import cluster_support

needs_netns = pytest.mark.skipif(cluster_support() is not None,
                                 reason=f"no emulated cluster here: {cluster_support()}")


def pytest_configure(config):
    config.addinivalue_line("markers", "netns: needs root and iproute2 (emulated cluster)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
