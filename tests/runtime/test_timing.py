"""The orders interleaved timing runs its functions in."""

from collections import Counter

import pytest

from plait.runtime.timing import balanced_orders


@pytest.mark.parametrize("n", range(1, 11))
def test_balanced_orders_place_and_follow_each_function_alike(n):
    """Over the whole design every function takes every place, and follows every other
    function, equally often; turning one order by a place each round fails the second."""
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    places = Counter((f, k) for order in orders for k, f in enumerate(order))
    after = Counter(pair for order in orders for pair in zip(order, order[1:]))
    assert len(places) == n * n and len(set(places.values())) == 1
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1


def test_a_function_follows_a_different_one_in_each_of_the_first_rounds():
    """The bench's nine variants over its seven rounds: none always after the same one
    (auto used to follow the plain path every round)."""
    orders = balanced_orders(9)[:7]
    for f in range(9):
        before = [order[order.index(f) - 1] for order in orders if order.index(f) > 0]
        assert max(Counter(before).values()) <= 2
