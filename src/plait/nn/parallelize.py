"""Moved to plait.parallel (own_models, own_plan, full_state); kept until plait.parallel's
last lazy imports of it follow."""

from ..parallel.own_plan import plait_plan
from . import PLAIT_LAYERS

__all__ = ["plait_plan", "PLAIT_LAYERS"]
