"""Every MoE layer's experts re-placed while training: routed load and rank speed in, moves out.

At each balancer step, each expert-parallel layer (``plait.nn.MoE``, or transformers' experts
made expert-parallel: ``nn.placement.PlacedExperts``) hands over the tokens
routed to each of its experts since the last step (``MoE.routed``: counted from the count
exchange its all-to-alls already make, the same on every rank) and the balancer's speed
monitor gives every rank's speed (agreed over the group). :class:`ExpertBalancer` (SEMI's
rule for experts: move when the predicted gain pays for the copies) decides per layer, and
``MoE.place`` moves the experts, their gradients and optimizer state, exactly. Every rank
feeds the same numbers to the same rule, so every rank takes the same decision without a
round trip of its own.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..nn.placement import Homes, PlacedExperts
from .experts import ExpertBalancer, ExpertPlacement

__all__ = ["ExpertMoves"]


class ExpertMoves:
    """The MoE layers of ``model`` (expert-parallel over 2 ranks or more) and each one's
    :class:`ExpertBalancer`; ``step`` returns ``(layer name, reason, experts per rank)`` for
    each layer it re-placed. A training step's routing swings more than a benchmark's
    skew, so a move needs a predicted gain of 8 % (``threshold``) three readings running
    (``confirm``). Serving reads once a request and acts on that one reading (``confirm``
    1, ``smoothing`` 1)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 threshold: float = 0.08, confirm: int = 3, smoothing: float = 0.5):
        self.optimizer = optimizer
        self.layers = {name: m for name, m in model.named_modules()
                       if isinstance(m, PlacedExperts) and m.info.world > 1}
        self.balancers = {name: ExpertBalancer(ExpertPlacement(m.homes.homes, m.homes.world),
                                               threshold=threshold, confirm=confirm,
                                               smoothing=smoothing)
                          for name, m in self.layers.items()}

    def __bool__(self) -> bool:
        return bool(self.layers)

    def discard(self) -> None:
        """Forget the loads counted so far (warm-up steps)."""
        for layer in self.layers.values():
            layer.routed.take()

    def step(self, step: int, speeds: Sequence[float]) -> list[tuple[str, str, tuple]]:
        done = []
        for name, layer in self.layers.items():
            loads = layer.routed.take()
            if not any(loads):
                continue
            balancer = self.balancers[name]
            new = balancer.observe(step, loads, speeds)
            if new is None:
                continue
            moved = layer.place(Homes(new.replicas, layer.info.world), self.optimizer)
            slots = tuple(len(layer.homes.slots(r)) for r in range(layer.info.world))
            split = "; ".join(f"expert {e} split " + "/".join(f"{s:.0%}" for _, s in copies)
                              for e, copies in enumerate(new.replicas) if len(copies) > 1)
            done.append((name, f"experts per rank {list(slots)}, {moved} moved"
                               f"{'; ' + split if split else ''}: predicted gain "
                               f"{balancer.log[-1]['gain']:.0%} at routed load "
                               f"{[round(x) for x in balancer.loads]}, speeds "
                               f"[{', '.join(f'{v:.2f}' for v in balancer.speeds)}]",
                         slots))
        return done

    # --- checkpoints (inside the balancer's state: plait.balance.Balancer.state_dict) ----------
    def state_dict(self) -> dict:
        """Each layer's placement and its rule's smoothed loads, speeds, streak and log (the
        same on every rank)."""
        return {name: {"homes": [[[r, s] for r, s in copies] for copies in layer.homes.homes],
                       "loads": self.balancers[name].loads,
                       "speeds": self.balancers[name].speeds,
                       "streak": self.balancers[name].streak, "log": self.balancers[name].log}
                for name, layer in self.layers.items()}

    def load_state_dict(self, state: dict) -> list[str]:
        """Place each layer as saved (``place``: weights and optimizer state move, exactly;
        a collective) and continue its rule; returns the layers moved. A state naming other
        layers is refused before anything moves."""
        if sorted(state) != sorted(self.layers):
            raise ValueError(f"an experts state for layers {sorted(state)} does not fit this "
                             f"model's {sorted(self.layers)}")
        moved = []
        for name, saved in state.items():
            layer = self.layers[name]
            homes = Homes(tuple(tuple((int(r), float(s)) for r, s in copies)
                                for copies in saved["homes"]), layer.info.world)
            if homes != layer.homes:
                layer.place(homes, self.optimizer)
                moved.append(name)
            balancer = self.balancers[name]
            balancer.placement = ExpertPlacement(homes.homes, homes.world)
            balancer.loads, balancer.speeds = saved["loads"], saved["speeds"]
            balancer.streak, balancer.log = saved["streak"], saved["log"]
        return moved
