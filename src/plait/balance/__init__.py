"""Heterogeneity-aware tensor parallelism: measure each rank's speed, decide, move work.

- :mod:`.speed`: ``SpeedMonitor``, per-rank compute time in every layer, smoothed and shared.
- :mod:`.policy`: pure decisions: proportional plans, resize fractions, imbalance.
- :mod:`.semi`: the SEMI state machine that makes them step by step, one per sharded dim.
- :mod:`.migrate`: exact migration of layers, gradients and optimizer state to new plans.
- :mod:`.balancer`: ``Balancer``, all three wired into a training loop, one policy per dim.
- :mod:`.experts`: ``place_experts``, MoE experts placed and replicated by routed load and
  rank speed (pure).
"""

from .balancer import Balancer, Decision
from .experts import ExpertPlacement, place_experts
from .migrate import MigrationReport, migrate
from .policy import (POLICIES, Action, PolicyConfig, imbalance, resize_fraction, resize_fractions,
                     static_plan)
from .semi import SemiPolicy
from .speed import SpeedMonitor, ema, flag_stragglers, relative_speeds

__all__ = ["Balancer", "Decision", "SpeedMonitor", "ema", "relative_speeds", "flag_stragglers",
           "POLICIES", "PolicyConfig", "Action", "SemiPolicy", "static_plan", "resize_fraction",
           "resize_fractions", "imbalance", "MigrationReport", "migrate", "ExpertPlacement",
           "place_experts"]
