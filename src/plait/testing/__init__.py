"""What plait's tests (and a user's own) use to check a parallel model against one process.

- :mod:`~plait.testing.ranks`: ``run_ranks(fn, world, …)``, a function on every rank of a
  fresh process group with test-friendly timeouts, and ``raised`` for one-line refusals.
- :mod:`~plait.testing.tiny_hf`: tiny transformers models of many families, built from a
  config (no download), for the conformance sweep.
- :mod:`~plait.testing.conformance`: the sweep itself: every family and layout made parallel
  and compared with one process, or refused in one line.
"""

from .ranks import TEST_TIMEOUT_S, raised, run_ranks

__all__ = ["run_ranks", "raised", "TEST_TIMEOUT_S"]
