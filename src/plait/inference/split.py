"""Shares sized by measured speed before serving: a few decoding steps timed, then every
split dim moved to the shares that finish every rank together.

    speeds, _, _ = measure_speeds(model, prompt, steps=8)  # every rank; an exchange a step
    moved = split_by_speed(model, speeds)                 # {dim: sizes}, exact

The speed of a rank is the balancer's (:class:`plait.balance.SpeedMonitor`): weight
elements multiplied per second of its own compute in the split layers, the straggler
emulation's sleeps or the kernel's throttling included, so a rank given fewer heads is
not mistaken for a faster one. Each split dim (``applied(model).dims``: an attention's
KV-head groups, an MLP's columns) then takes ``static_plan(units, speeds)`` and is moved
there by :func:`plait.balance.migrate`, which moves weights exactly: the tokens decoded
after the move are the tokens decoded before it would have been.

The capacity ideal of a decoding step (:func:`decode_ideal`) is the same as a training
step's: what the step spends outside the split layers' compute, plus the whole work of
those layers over the ranks' summed speeds.
"""

from __future__ import annotations

import torch

from ..nn.record import applied

__all__ = ["measure_speeds", "split_by_speed", "split_sizes", "decode_ideal"]


def measure_speeds(model, prompt: torch.Tensor, steps: int = 8):
    """Decode ``steps`` tokens after ``prompt`` with the split layers timed (every rank).
    Returns the relative speeds (fastest 1) and, per rank, its compute per token in those
    layers (seconds) and its work per token (weight elements multiplied): what
    :func:`decode_ideal` takes."""
    import torch.distributed as dist

    from ..balance import SpeedMonitor
    from .decode import decode

    monitor = SpeedMonitor(every=1, window=max(steps - 1, 1))
    names = monitor.attach(model)
    layers = [model.get_submodule(name) for name in names]
    seen: list[float] = []

    def on_step():  # the prefill reads the whole prompt: not a decoding step's figure
        if seen:
            monitor.step()
        else:
            monitor.discard()
        seen.append(monitor.compute_s)

    try:
        decode(model, prompt, steps + 1, on_step=on_step, eos_token_id=None)  # every step
    finally:
        for layer in layers:
            layer.compute_timer = None
    mine = ((seen[-1] - seen[0]) / steps, float(sum(layer._work() for layer in layers)))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return monitor.speeds(), [c for c, _ in every], [w for _, w in every]


def split_by_speed(model, speeds) -> dict[str, tuple[int, ...]]:
    """Move every split dim of ``model`` to shares proportional to ``speeds`` (every rank,
    the same speeds); ``{dim: sizes}``."""
    from ..balance import migrate, static_plan

    dims = applied(model).dims or {}
    modules = dict(model.named_modules())
    moved = {}
    for dim, names in dims.items():
        plan = static_plan(modules[names[0]].plan.total, speeds)
        migrate(model, None, {name: plan for name in names})
        moved[dim] = plan.sizes
    return moved


def split_sizes(model) -> dict[str, tuple[int, ...]]:
    """Each split dim's shares (``applied(model).dims``: an attention's KV-head groups, an
    MLP's columns), as its first module's plan holds them."""
    modules = dict(model.named_modules())
    return {dim: tuple(modules[names[0]].plan.sizes)
            for dim, names in (applied(model).dims or {}).items()}


def decode_ideal(step_s: float, compute_s: list[float], work: list[float]) -> float:
    """The step a perfect split reaches: ``step_s − max(compute_s)`` (what the step spends
    outside the split layers' compute: attention, norms, collectives) plus the layers' whole
    ``sum(work)`` at the ranks' summed speeds, each rank's ``work[r] / compute_s[r]``."""
    speeds = [w / c for w, c in zip(work, compute_s) if c > 0]
    rest = step_s - max(compute_s)
    return rest + sum(work) / sum(speeds)
