"""``bench hetero``'s scenarios: which ranks are slow, by how much, at which step.

A scenario slows ranks through the runtime's straggler emulation (a rank ``F`` × slower
sleeps ``(F − 1)`` × each of its compute pieces, or, with ``--slow-by kernel``, its host's
CPU budget is divided by ``F``):

- ``none``: no straggler, the reference;
- ``straggler-2x``: the last rank 2 × slower throughout;
- ``graded``: ranks 4 ×, 2 ×, 1 ×, 1 × slower (on 4 ranks; fewer ranks take the first ones);
- ``spike``: the last rank 3 × slower for ``spike_len`` steps from ``spike_at``, then normal;
- ``noisy-neighbour``: from ``spike_at`` on, a CPU-bound process
  (:class:`plait.runtime.slow.cgroup.NoisyNeighbour`) runs on the last rank's host, inside its
  CPU budget, as another tenant's job would: nothing is emulated, the rank gets less of
  its host (:class:`Neighbour`);
- a scenario file (``--scenario-file PATH``, :mod:`plait.runtime.slow.scenario_file`): per-rank
  slowdowns that change with the step (drift, jitter), run under the file's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .straggler import SlowCurve, SlowSpec

__all__ = ["SCENARIOS", "DEFAULT_SCENARIOS", "scenario_specs", "Neighbour", "factors_at"]

SCENARIOS = ("none", "straggler-2x", "graded", "spike", "noisy-neighbour")
# what runs without --scenarios: noisy-neighbour needs one rank per host, so it is asked for
DEFAULT_SCENARIOS = SCENARIOS[:4]


def scenario_specs(scenario: str, world: int, cfg) -> list[SlowSpec | SlowCurve]:
    """The straggler specs of a scenario on ``world`` ranks (``cfg``: a
    :class:`~plait.bench.hetero.HeteroBenchConfig`)."""
    last = world - 1
    if cfg.scenario is not None and scenario == cfg.scenario.name:
        return cfg.scenario.specs(world, cfg.steps)
    if scenario == "none":
        return []
    if scenario == "straggler-2x":
        return [SlowSpec(rank=last, factor=2.0)]
    if scenario == "graded":
        return [SlowSpec(rank=r, factor=f) for r, f in enumerate((4.0, 2.0)[:max(1, world - 1)])]
    if scenario == "spike":
        return [SlowSpec(rank=last, factor=3.0, from_step=cfg.spike_at,
                         until_step=cfg.spike_at + cfg.spike_len)]
    if scenario == "noisy-neighbour":
        return [Neighbour(rank=last, from_step=cfg.spike_at)]
    raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


@dataclass(frozen=True)
class Neighbour:
    """``noisy-neighbour``: a busy loop on rank ``rank``'s host from step ``from_step`` on.
    Not emulated (the :class:`Straggler` skips it); ``factor_at`` is its nominal factor for
    the ideal, 2: the fair share of a single-threaded rank beside one busy loop."""

    rank: int
    from_step: int = 0

    def active(self, step: int) -> bool:
        return step >= self.from_step

    def factor_at(self, step: int) -> float:
        return 2.0 if self.active(step) else 1.0


def factors_at(specs: list[SlowSpec | SlowCurve | Neighbour], world: int,
               step: int) -> list[float]:
    factors = [1.0] * world
    for spec in specs:
        factors[spec.rank] *= spec.factor_at(step)
    return factors
