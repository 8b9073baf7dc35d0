"""``plait bench experts``' settings (``ExpertsBenchConfig``) and its routing, skewed on purpose.

Each scenario gives, per step, the tokens routed to each expert: ``tokens × top_k`` rows drawn
from a distribution over the experts (a seeded multinomial, so every step jitters as a real
router's counts do) that is

- ``uniform``: every expert alike (jitter alone: a balancer must make no move);
- ``zipf``: ``p_e ∝ 1 / (e + 1)^s`` (s = 1.2), the experts' order shuffled by the seed;
- ``hot``: one expert takes ``hot_share`` (40 %) of the rows, the rest share the remainder;
- ``drift``: the Zipf skew whose ranking turns by one expert every ``drift_every`` steps.

Pure and torch-free: the same loads on every rank from the seed, no round trip.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ...runtime.fields import help_meta as _h

__all__ = ["ExpertsBenchConfig", "SCENARIOS", "POLICIES", "QUICK_EXPERTS", "routed_loads"]

SCENARIOS = ("uniform", "zipf", "hot", "drift")
POLICIES = ("even", "static", "balanced", "balanced-no-replicas")
QUICK_EXPERTS = dict(steps=24, warmup=4, tokens=1024)


@dataclass(frozen=True, kw_only=True)
class ExpertsBenchConfig:
    n_experts: int = field(default=8, metadata=_h("experts in the layer"))
    top_k: int = field(default=2, metadata=_h("experts each token is routed to"))
    tokens: int = field(default=2048, metadata=_h("tokens a step (rows: tokens × top-k)"))
    hidden: int = field(default=256, metadata=_h("model width"))
    ffn: int = field(default=512, metadata=_h("each expert's hidden width"))
    steps: int = field(default=40, metadata=_h("steps per scenario and policy"))
    warmup: int = field(default=6, metadata=_h(
        "first steps left out of the medians (the balancer reads its first loads there)"))
    scenarios: tuple[str, ...] = field(default=SCENARIOS, metadata=_h(
        "routing: " + ", ".join(SCENARIOS)))
    policies: tuple[str, ...] = field(default=POLICIES, metadata=_h(
        "placements: even (contiguous blocks), static (by the ranks' speeds, loads assumed "
        "even), balanced (by routed load and speed, hot experts replicated), "
        "balanced-no-replicas (the same, one copy of each expert)"))
    zipf_s: float = field(default=1.2, metadata=_h("zipf: the skew's exponent"))
    hot_share: float = field(default=0.4, metadata=_h("hot: the hot expert's share of rows"))
    drift_every: int = field(default=8, metadata=_h("drift: steps between turns of the ranking"))
    seed: int = field(default=0, metadata=_h("the routing's seed"))
    extra: dict = field(default_factory=dict, metadata={"help": None})

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "tokens", "hidden", "ffn", "steps", "drift_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"--top-k {self.top_k} exceeds --n-experts {self.n_experts}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup {self.warmup} must leave timed steps in --steps "
                             f"{self.steps}")
        for name, known in (("scenarios", SCENARIOS), ("policies", POLICIES)):
            bad = [v for v in getattr(self, name) if v not in known]
            if bad or not getattr(self, name):
                raise ValueError(f"--{name} {','.join(bad) or '(none)'}: choose from "
                                 f"{', '.join(known)}")
        if not 0 < self.hot_share < 1:
            raise ValueError(f"--hot-share must be in (0, 1), got {self.hot_share}")
        if not self.zipf_s > 0:
            raise ValueError(f"--zipf-s must be above 0, got {self.zipf_s}")


def routed_loads(cfg: ExpertsBenchConfig, scenario: str, step: int) -> list[int]:
    """Rows routed to each expert at ``step`` of ``scenario`` (they sum to tokens × top-k)."""
    e = cfg.n_experts
    order = list(range(e))
    random.Random(cfg.seed).shuffle(order)  # which expert is hot: the seed's, not expert 0
    if scenario == "uniform":
        weights = [1.0] * e
    elif scenario in ("zipf", "drift"):
        turn = step // cfg.drift_every if scenario == "drift" else 0
        weights = [0.0] * e
        for place in range(e):  # the place-th most routed expert, the ranking turned
            weights[order[(place + turn) % e]] = 1.0 / (place + 1) ** cfg.zipf_s
    elif scenario == "hot":
        rest = (1 - cfg.hot_share) / (e - 1) if e > 1 else 0.0
        weights = [rest] * e
        weights[order[0]] = cfg.hot_share if e > 1 else 1.0
    else:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    draw = random.Random(cfg.seed * 1_000_003 + step * 7919 + SCENARIOS.index(scenario))
    rows = cfg.tokens * cfg.top_k
    picks = draw.choices(range(e), weights=weights, k=rows)  # the step's jitter
    counts = [0] * e
    for p in picks:
        counts[p] += 1
    return counts
