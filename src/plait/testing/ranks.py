"""A pytest helper: run a function on 2 (or 4) ranks and get each rank's result.

    from plait.testing import run_ranks

    def _sum_ranks():
        t = torch.tensor([dist.get_rank()])
        dist.all_reduce(t)
        return t.item()

    @pytest.mark.parametrize("world", [2, 4])
    def test_sum(world):
        assert run_ranks(_sum_ranks, world) == [sum(range(world))] * world

The function must be defined at module level (it is pickled by reference).
One thread per rank and a short collective timeout, so a broken test fails
in seconds instead of hanging the suite.
"""

from __future__ import annotations

from typing import Any, Callable

from ..runtime.launch import launch

__all__ = ["run_ranks", "raised", "TEST_TIMEOUT_S"]

TEST_TIMEOUT_S = 30.0


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = TEST_TIMEOUT_S, env: dict[str, str] | None = None,
              **kwargs: Any) -> list[Any]:
    """``launch(fn, world_size, args=args, kwargs=kwargs)`` with test-friendly settings;
    ``env``: the ranks' extra environment (``{"PLAIT_TRANSPORT": "shm"}``)."""
    return launch(fn, world_size, args=args, kwargs=kwargs, timeout_s=timeout_s, threads=1,
                  deadline_s=10 * timeout_s, env=env)


def raised(attempts: dict[str, Callable[[], Any]]) -> dict[str, str | None]:
    """Call each attempt; its ``"TypeError: message"`` / ``"ValueError: message"``, or None
    if it did not raise (for tests of construction-time errors, run on every rank)."""
    seen: dict[str, str | None] = {}
    for name, make in attempts.items():
        try:
            make()
            seen[name] = None
        except (TypeError, ValueError) as err:
            seen[name] = f"{type(err).__name__}: {err}"
    return seen
