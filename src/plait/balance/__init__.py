"""Heterogeneity-aware tensor parallelism: measure each rank's speed, decide, move work.

- :mod:`.speed`: ``SpeedMonitor``, per-rank compute time in every layer, smoothed and shared.
- :mod:`.policy`: pure decisions: proportional plans, resize fractions, imbalance.
- :mod:`.semi`: the SEMI state machine that makes them step by step, one per sharded dim.
- :mod:`.migrate`: exact migration of layers, gradients and optimizer state to new plans.
- :mod:`.balancer`: ``Balancer``, all three wired into a training loop, one policy per dim.
- :mod:`.experts`: ``place_experts``, MoE experts placed and replicated by routed load and
  rank speed (pure).
"""

from ..runtime.lazy import exports

_WHERE = {
    "balancer": ("Balancer", "Decision"),
    "experts": ("ExpertPlacement", "place_experts"),
    "migrate": ("MigrationReport", "migrate"),
    "policy": ("POLICIES", "Action", "PolicyConfig", "imbalance", "resize_fraction",
               "resize_fractions", "static_plan"),
    "semi": ("SemiPolicy",),
    "speed": ("SpeedMonitor", "ema", "flag_stragglers", "relative_speeds"),
}
__getattr__, __all__ = exports(__name__, _WHERE)  # torch loads on first use (the CLI parses)
