"""tests/ops/test_one_rank_bad.py on shared memory: one rank handed a different ``chunks``
(``'auto'`` against an integer included), shape, dtype or ``requires_grad`` makes every
rank raise an error naming it within seconds, and the group goes on; on shared memory the
check rides in the header of the call that carries the data (a matmul_all_reduce at
``chunks="auto"`` makes one call, its product computed in its slot), so a rank on that
path and a rank on another must still meet and refuse together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
import test_one_rank_bad as cases  # noqa: E402


@pytest.mark.parametrize("world", [2, 3])
def test_one_bad_rank_is_refused_on_every_rank_on_shared_memory(world, monkeypatch):
    monkeypatch.setenv("PLAIT_TRANSPORT", "shm")  # the launcher hands it to every rank
    cases.test_one_bad_rank_is_refused_on_every_rank_and_the_group_goes_on(world)
