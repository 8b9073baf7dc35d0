"""Straggler emulation: the delay is proportional to the compute actually done."""

import time

import pytest
from hypothesis import given, strategies as st

from plait.runtime import SlowSpec, Straggler, parse_slow, validate_slow


@pytest.mark.parametrize("text, spec", [
    ("1:2", SlowSpec(rank=1, factor=2.0)),
    ("3:1.5@10-30", SlowSpec(rank=3, factor=1.5, from_step=10, until_step=30)),
    ("0:4@50", SlowSpec(rank=0, factor=4.0, from_step=50)),
])
def test_parse_slow(text, spec):
    assert parse_slow(text) == spec


@pytest.mark.parametrize("text", ["1", "a:2", "1:0.5", "1:2@30-10", "1:2@x"])
def test_bad_slow_is_refused(text):
    with pytest.raises(ValueError):
        parse_slow(text)


def test_slow_naming_a_missing_rank_is_refused():
    with pytest.raises(ValueError, match="rank 4, but there are only 4 ranks"):
        validate_slow([parse_slow("4:2")], 4)


@given(start=st.integers(0, 100), length=st.integers(1, 100), step=st.integers(0, 300))
def test_window(start, length, step):
    straggler = Straggler([SlowSpec(rank=0, factor=3.0, from_step=start, until_step=start + length)], 0)
    straggler.set_step(step)
    assert straggler.factor() == (3.0 if start <= step < start + length else 1.0)


def _busy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_delay_is_proportional_to_the_work_done():
    straggler = Straggler([SlowSpec(rank=0, factor=3.0)], rank=0)
    timings = {}
    for work in (0.02, 0.06):
        start = time.perf_counter()
        with straggler.compute():
            _busy(work)
        timings[work] = time.perf_counter() - start
    assert timings[0.02] == pytest.approx(0.06, rel=0.3)
    assert timings[0.06] == pytest.approx(0.18, rel=0.3)


def test_other_ranks_are_not_slowed():
    straggler = Straggler([SlowSpec(rank=1, factor=10.0)], rank=0)
    start = time.perf_counter()
    with straggler.compute():
        _busy(0.01)
    assert time.perf_counter() - start < 0.05
