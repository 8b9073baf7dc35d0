"""What a training run needs, besides its model and optimizer, to resume exactly: its random
number generators and the position of its data stream.

    stream = SeededStream(lambda gen: corpus.batch("train", 16, 64, gen), seed=1)
    batch = next(stream)                      # the batches corpus.batches(..., seed=1) yields
    state = {"data": stream.state_dict(), "rng": rng_state()}
    ...                                       # saved as extra_state / rank_state, then loaded
    stream.load_state_dict(state["data"])
    set_rng_state(state["rng"])               # the next draw is the one the saved run made

A stream's position is its generator's state (plus a count, for the log), not a number of
batches to skip: resuming draws nothing twice and costs nothing at step 100,000.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["SeededStream", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This process's random number generators: torch's CPU generator, Python's ``random``,
    numpy's global one, and every CUDA device's when CUDA has been initialised."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA's only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class SeededStream:
    """An endless iterator of ``draw(generator)`` from a ``torch.Generator`` seeded with
    ``seed``, whose position can be saved and restored (``state_dict``/``load_state_dict``)."""

    def __init__(self, draw: Callable[[torch.Generator], Any], seed: int):
        self.draw = draw
        self.generator = torch.Generator().manual_seed(seed)
        self.drawn = 0

    def __iter__(self) -> "SeededStream":
        return self

    def __next__(self) -> Any:
        batch = self.draw(self.generator)
        self.drawn += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.drawn = state["drawn"]
