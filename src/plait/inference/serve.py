"""Serving: requests decoded one after another, the split moved between two requests when the
ranks' speeds no longer match it.

    served = serve(model, prompts, new_tokens=32, split="adaptive")   # every rank
    served[i].tokens, served[i].sizes, served[i].moved

Each request is one :func:`plait.inference.decode.decode` with a KV cache of its own, so
between two requests nothing is cached that a move would have to carry: the split dims
(``applied(model).dims``: an attention's KV-head groups, an MLP's columns) are moved there
by :func:`plait.inference.split.split_by_speed` (:func:`plait.balance.migrate`, exact), and
the next request's tokens are the ones it would have decoded without the move.

``split``:

- ``"even"``: as :func:`plait.parallelize` made it, never moved;
- ``"speed"``: sized once before the first request by a few measured decoding steps
  (:func:`plait.inference.split.measure_speeds`), then kept;
- ``"adaptive"``: ``"speed"``, and after every request the speeds its first
  ``timed_steps`` steps measured (the balancer's :class:`plait.balance.SpeedMonitor`: weight elements
  multiplied per second of each rank's own compute in the split layers, an emulated
  slowdown included; one exchange a request) size the split again where the shares by
  speed (in whole units, as they would be moved) are predicted to shorten some split dim's
  time by ``tolerance`` or more (:func:`predicted_gain`); expert layers are placed anew by
  the tokens the request routed to each expert and the speeds
  (:class:`plait.balance.expert_moves.ExpertMoves`).

Only the sampled steps are timed: a timed layer takes its timing path, which a decoding
step at batch 1 pays for in Python. The straggler emulation's step is the request's index,
so ``--slow 1:2@3`` makes rank 1 twice as slow from the fourth request on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .config import SPLITS

__all__ = ["SPLITS", "Served", "predicted_gain", "serve"]



@dataclass
class Served:
    """One request: its tokens and step times (this rank's), the split it ran on, and what
    was decided after it (the speeds measured, the predicted gain, whether the split moved)."""

    tokens: torch.Tensor
    ttft_s: float
    step_s: list[float]
    sizes: dict[str, tuple[int, ...]]
    speeds: tuple[float, ...] | None = None
    gain: float | None = None
    moved: bool = False
    placed: int = 0  # expert layers whose experts were placed anew after it
    extra: dict = field(default_factory=dict)


def predicted_gain(sizes: Sequence[int], speeds: Sequence[float],
                   to: Sequence[int] | None = None) -> float:
    """The share of a split dim's time saved by the shares ``to`` instead of ``sizes``: each
    rank computes its share at its speed, and the dim takes as long as its slowest rank
    (``max(size / speed)``). ``to`` None: shares exactly proportional to ``speeds``
    (``sum(sizes) / sum(speeds)``); whole units can do no better. 0 where nothing is saved."""
    if len(sizes) != len(speeds) or not sizes or (to is not None and len(to) != len(sizes)):
        raise ValueError(f"one share and one speed a rank: {list(sizes)}, {list(speeds)}")
    if any(v <= 0 for v in speeds):
        raise ValueError(f"speeds must be positive, got {list(speeds)}")
    now = max(s / v for s, v in zip(sizes, speeds))
    if now <= 0:
        return 0.0
    then = sum(sizes) / sum(speeds) if to is None else max(s / v for s, v in zip(to, speeds))
    return max(0.0, 1.0 - then / now)


def _gain(sizes: dict[str, tuple[int, ...]], speeds) -> float:
    """The largest gain over the split dims of moving each to its shares by ``speeds``
    (``static_plan``, in whole units: what :func:`split_by_speed` would move to)."""
    from ..balance import static_plan

    return max((predicted_gain(s, speeds, static_plan(sum(s), speeds).sizes)
                for s in sizes.values()), default=0.0)


class _Sampler:
    """The split layers timed during a request's first ``steps`` steps (the prefill's time
    forgotten), then left untimed; one exchange after the request gives every rank's speed."""

    def __init__(self, model, steps: int):
        from ..balance import SpeedMonitor

        self.model, self.steps = model, steps
        self.monitor = SpeedMonitor(every=1 << 30, window=1)  # shared once a request
        self.layers = {name: m for name, m in model.named_modules()
                       if hasattr(m, "compute_timer")}
        self.timers = {name: self.monitor.timer(name) for name in self.layers}
        self.seen = 0

    def start(self) -> None:
        self.seen = 0
        for name, layer in self.layers.items():
            layer.compute_timer = self.timers[name]

    def stop(self) -> None:
        for layer in self.layers.values():
            layer.compute_timer = None

    def on_step(self) -> None:
        if self.seen == 0:
            self.monitor.discard()  # the prefill reads the whole prompt
        elif self.seen <= self.steps:
            self.monitor.step()
        if self.seen == self.steps:
            self.stop()
        self.seen += 1

    def speeds(self) -> tuple[float, ...] | None:
        """Every rank's speed over the sampled steps (one exchange, every rank); None where
        the request had no step to sample (the same on every rank: one length)."""
        self.stop()
        if self.seen < 2:
            self.monitor.discard()
            return None
        self.monitor.share()
        speeds = self.monitor.speeds()
        self.monitor.restart()
        return speeds


def serve(model, prompts: Sequence[torch.Tensor], new_tokens: int, *, split: str = "even",
          tolerance: float = 0.05, timed_steps: int = 8, speed_steps: int = 8,
          speeds_of: Callable[[int, tuple], tuple] | None = None,
          on_request: Callable[[int, Served], None] | None = None, **decode_kw) -> list[Served]:
    """Decode ``prompts`` ([B, S] ids each) one after another on every rank of ``model``'s
    group; see the module doc. ``speeds_of(i, measured)``: the speeds to act on after request
    i (default: the measured ones; a test feeds its own). ``on_request(i, served)``: called
    after each request (every rank). ``decode_kw``: :func:`~plait.inference.decode.decode`'s."""
    from ..balance.expert_moves import ExpertMoves
    from ..runtime import rank_context
    from .decode import decode
    from .split import measure_speeds, split_by_speed, split_sizes

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    context = rank_context()
    straggler = getattr(context, "straggler", None) if context is not None else None
    if split != "even" and prompts:
        if straggler is not None:
            straggler.set_step(0)
        speeds, _, _ = measure_speeds(model, prompts[0][:1], speed_steps)
        split_by_speed(model, speeds)
    sampler = _Sampler(model, timed_steps) if split == "adaptive" else None
    # expert layers placed anew between requests by their routed loads and the speeds
    experts = ExpertMoves(model, None, threshold=max(tolerance, 1e-9), confirm=1,
                          smoothing=1.0) if sampler is not None else None
    served = []
    for i, prompt in enumerate(prompts):
        if straggler is not None:
            straggler.set_step(i)
        if sampler is not None:
            sampler.start()
        out = decode(model, prompt, new_tokens,
                     on_step=None if sampler is None else sampler.on_step, **decode_kw)
        done = Served(out.tokens, out.ttft_s, out.step_s, split_sizes(model))
        if sampler is not None and i + 1 < len(prompts):
            measured = sampler.speeds()
            speeds = measured if speeds_of is None or measured is None else \
                tuple(speeds_of(i, measured))
            if speeds is not None:
                done.speeds = tuple(speeds)
                done.gain = _gain(done.sizes, speeds)
                if done.gain >= tolerance:
                    split_by_speed(model, speeds)
                    done.moved = True
                done.placed = len(experts.step(i, speeds))
        elif sampler is not None:
            sampler.stop()
        served.append(done)
        if on_request is not None:
            on_request(i, done)
    return served
