"""The balancer: speed monitor, one policy per sharded dim, and applying what they decide.

``Balancer(model, optimizer, group, PolicyConfig(name="semi"))`` once after
``apply_tp``; ``balancer.step(step)`` after every optimizer step (every rank:
it holds collectives). A dim is what one plan splits: the heads of a block's
attention (QKV and output projection together; with grouped-query attention its
KV-head groups, a group being more features in q and o than in k and v), the columns of its
MLP (fc and proj). Each dim has its own :class:`SemiPolicy` fed the group's shared speeds;
its actions are applied at the step boundary:

- ``resize``: every layer of the dim computes ``fractions[rank]`` of the
  features its plan splits, the same features in each (ZERO-resizing, lossy,
  no data moves);
- ``migrate``: the dim's layers move to the new plan with their gradients and
  optimizer state (``plait.balance.migrate``, exact); resizing ends;
- ``undo``: resizing ends.

After every applied decision the speed monitor restarts (its readings were taken under the
old plans) and the policies wait for new ones; a migration's cost (the slowest rank's seconds
over the dim's compute per step) is what the dim's policy weighs the next one by. The first
``warmup`` steps are not measured (first calls allocate and warm caches on some ranks more
than others). Every decision and its reason is kept in ``log`` (rank 0, of replica 0 under
data parallelism, also logs it at INFO on ``plait.balance``). Every ``refresh`` steps the
layers refresh the priority scores ZERO-resizing uses, and a resized dim chooses its
features anew (so skipped ones return once the kept ones settle). The speeds are identical
on every rank after each exchange and the policies are deterministic, so every rank takes
the same decision without another collective.

Under data parallelism (``dp_group``: the ranks in this rank's tp position, one per replica)
every replica of a tp group must hold the same plans, or data parallelism cannot reduce
their gradients. So each exchange's table (every tp rank's seconds and work per layer) is
combined over the dp group before anything is read from it: each figure the largest over
the replicas (one float64 ``all_reduce(MAX)``, exact, so every replica holds the same bits),
and a migration's cost likewise. A tp position is then as fast as its slowest replica, every
replica feeds its policies the same numbers and takes the same decisions. Resizing chooses
its features from the weights, which data parallelism keeps equal on every replica. After a
migration the caller re-applies data parallelism to the new shapes
(``plait.parallel.data.replanned``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..nn.linear_base import select_features
from ..nn.record import applied
from ..plan import ShardPlan
from .expert_moves import ExpertMoves
from .migrate import MigrationReport, migrate
from .policy import Action, PolicyConfig
from .semi import SemiPolicy
from .speed import SpeedMonitor

__all__ = ["Balancer", "Decision", "ReplicaMonitor"]

log = logging.getLogger("plait.balance")


@dataclass(frozen=True)
class Decision:
    """One applied action: the step, the dim, what was done and why, and a migration's cost."""

    step: int
    dim: str
    kind: str
    reason: str
    sizes: tuple[int, ...]
    fractions: tuple[float, ...] | None = None
    migration: MigrationReport | None = None

    def to_json(self) -> dict:
        out = {"step": self.step, "dim": self.dim, "kind": self.kind, "reason": self.reason,
               "sizes": list(self.sizes)}
        if self.fractions is not None:
            out["fractions"] = [round(f, 4) for f in self.fractions]
        if self.migration is not None:
            m = self.migration
            out["migration"] = {"bytes_moved": m.bytes_moved, "bytes_sent": m.bytes_sent,
                                "seconds": m.seconds}
        return out


class Balancer:
    """Measure, decide and apply, per sharded dim of a plait-TP model (see the module doc)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 group=None, config: PolicyConfig | None = None, *, every: int = 2,
                 window: int = 5, refresh: int = 200, warmup: int = 3, dp_group=None):
        if not isinstance(refresh, int) or isinstance(refresh, bool) or refresh < 1:
            raise ValueError(f"refresh must be a positive number of steps, got {refresh!r}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup must be a number of steps ≥ 0, got {warmup!r}")
        self.warmup = warmup
        self.model, self.optimizer, self.group = model, optimizer, group
        self.config = config or PolicyConfig()
        self.refresh = refresh
        dims = applied(model).dims
        if dims is None:
            raise TypeError(f"{type(model).__name__} has no sharded dims to balance: build it "
                            "with plait.nn.apply_tp (a GPT; MoE experts and DLRM tables are not "
                            "balanced yet)")
        modules = dict(model.named_modules())
        self.dims = {dim: [modules[name] for name in names] for dim, names in dims.items()}
        self.names = dict(dims)
        self.dp_group = dp_group if _size(dp_group) > 1 else None
        self.monitor = (SpeedMonitor(group, every=every, window=window) if self.dp_group is None
                        else ReplicaMonitor(group, self.dp_group, every=every, window=window))
        self.monitor.attach(model)
        self.rank, self.world = self.monitor.rank, self.monitor.world
        replica = 0 if self.dp_group is None else dist.get_rank(self.dp_group)
        self.logs = self.rank == 0 and replica == 0  # one rank of the whole job logs
        self.policies: dict[str, SemiPolicy] = {}
        for dim, layers in self.dims.items():
            plans = {layer.plan for layer in layers}
            if len(plans) != 1:
                raise ValueError(f"the layers of {dim} have different plans {plans}; one plan "
                                 "must split them together")
            units = {layer.features() // layer.unit for layer in layers}
            if len(units) != 1:  # e.g. grouped-query attention: q counts more per unit than k/v
                shapes = sorted({(layer.features(), layer.unit) for layer in layers})
                raise ValueError(f"the layers of {dim} split (features, unit) {shapes} on this "
                                 "rank: different numbers of plan units; resizing skips the "
                                 "same units (heads, KV-head groups) in each")
            policy = SemiPolicy(self.config, layers[0].plan.total, self.world)
            policy.plan = layers[0].plan  # start from the plan it was built with
            self.policies[dim] = policy
        self.log: list[Decision] = []
        self.steps = 0
        self.experts = ExpertMoves(model, optimizer) if self.config.name != "even" else None
        for layers in self.dims.values():
            for layer in layers:
                layer.refresh_priority()

    def step(self, step: int | None = None) -> list[Decision]:
        """End of a training step: share speeds when due, decide per dim, apply."""
        step = self.steps if step is None else step
        self.steps += 1
        if self.steps <= self.warmup:  # first calls (allocation, first-touch): not speeds
            self.monitor.discard()
            if self.experts:
                self.experts.discard()
            return []
        self.monitor.step()
        if self.steps % self.refresh == 0:
            for layers in self.dims.values():
                for layer in layers:
                    layer.refresh_priority()
                if layers[0].keep < 1.0:  # resized: the new scores choose anew, so the
                    _resize_dim(layers, layers[0].keep)  # skipped can return
        if self.config.name == "even":
            return []
        speeds, confidence = self.monitor.speeds(), self.monitor.confidence()
        fixed = self.monitor.fixed()
        done, waiting = [], []
        for dim, policy in self.policies.items():
            action = policy.step(speeds, confidence, self.monitor.recent(), fixed)
            if action.kind != "none":
                done.append(self._apply(step, dim, action))
            else:
                waiting.append(dim)
        if done:  # the restart below holds every dim's next decision: one that would repay
            for dim in waiting:  # its migration by then migrates now (SemiPolicy.join)
                action = self.policies[dim].join(self._restart_steps())
                if action.kind == "migrate":
                    done.append(self._apply(step, dim, action))
        if done:  # the readings so far were taken under the old plans
            self.monitor.restart()
        if self.experts:  # MoE layers: experts re-placed by routed load and these speeds
            for name, reason, slots in self.experts.step(step, speeds):
                decision = Decision(step, name, "place", reason, slots)
                self.log.append(decision)
                done.append(decision)
                if self.logs:
                    log.info("step %d %s: place %s", step, name, reason)
        return done

    def _restart_steps(self) -> int:
        """The fewest steps from a restart to readings confident enough to act on: the
        monitor's first exchange can come one step after it, then one every ``every``."""
        readings = math.ceil(self.config.min_confidence * self.monitor.window - 1e-9)
        return max(readings - 1, 0) * self.monitor.every + 1

    def _apply(self, step: int, dim: str, action: Action) -> Decision:
        layers = self.dims[dim]
        report = None
        if action.kind == "migrate":
            compute_s = self.monitor.step_seconds(self.names[dim])  # before the move
            report = migrate(self.model, self.optimizer,
                             {name: action.plan for name in self.names[dim]})
            self._note_cost(dim, report.seconds, compute_s)
        _resize_dim(layers, action.fractions[self.rank] if action.kind == "resize" else 1.0)
        decision = Decision(step, dim, action.kind, action.reason, layers[0].plan.sizes,
                            action.fractions, report)
        self.log.append(decision)
        if self.logs:  # every replica took the same decision
            log.info("step %d %s: %s %s", step, dim, action.kind, action.reason)
        return decision

    def _note_cost(self, dim: str, seconds: float, compute_s: float) -> None:
        """The dim's policy learns what the migration cost, in steps of the dim's compute:
        the slowest rank's seconds (one small all_reduce over the tp group and one over the
        dp group, so every rank of every replica holds the same figure and keeps deciding
        alike)."""
        cost = torch.tensor([seconds], dtype=torch.float64)
        if self.world > 1:
            cost = _max_over(cost, self.group)
        if self.dp_group is not None:
            cost = _max_over(cost, self.dp_group)
        if compute_s > 0:
            self.policies[dim].note_migration_cost(float(cost) / compute_s)

    def state(self) -> dict:
        """What each dim looks like now: its plan and this rank's kept share."""
        return {dim: {"sizes": list(layers[0].plan.sizes), "keep": layers[0].keep}
                for dim, layers in self.dims.items()}

    # --- checkpoints (DCP's Stateful protocol) ----------------------------------
    def state_dict(self) -> dict:
        """This rank's balancer as plain values and CPU tensors: each dim's policy (plan,
        resizing, counters, log), each of its layers' ZERO-resizing (the kept features, the
        priority scores and the weight snapshot they are measured from), the speed monitor's
        readings, the step count and the decisions taken. Every rank saves its own: the kept
        features and snapshots differ per rank."""
        return {"policy": self.config.name, "world": self.world, "steps": self.steps,
                "replicas": _size(self.dp_group),
                "dims": {dim: {"policy": _policy_state(self.policies[dim]),
                               "names": list(self.names[dim]),
                               "plan": list(layers[0].plan.sizes),
                               "layers": [_resize_state(layer) for layer in layers]}
                         for dim, layers in self.dims.items()},
                "monitor": _monitor_state(self.monitor),
                "experts": self.experts.state_dict() if self.experts else {},
                "log": [dataclasses.asdict(d) for d in self.log]}

    def load_state_dict(self, state: dict) -> list[str]:
        """Continue from :meth:`state_dict` of a balancer of the same policy over as many tp
        ranks and replicas and the same dims (every rank of the group, each its own state;
        a collective when it migrates). A dim whose layers hold another plan than the saved
        one is first moved to it, exactly (:func:`plait.balance.migrate`, optimizer state
        included; under data parallelism the caller then rebuilds it for the new shapes, as
        after any migration). Returns the dims moved. A state that does not fit raises a
        ValueError naming what differs, before anything changes."""
        mine = (self.config.name, self.world, _size(self.dp_group), sorted(self.dims))
        saved = (state["policy"], state["world"], state["replicas"], sorted(state["dims"]))
        if mine != saved:
            raise ValueError(f"a balancer state of (policy, ranks, replicas, dims) {saved} does "
                             f"not fit this balancer's {mine}")
        _check_monitor_state(self.monitor, state["monitor"])  # all checked before any change
        experts = state.get("experts") or {}
        if experts and (not self.experts or sorted(experts) != sorted(self.experts.layers)):
            raise ValueError(f"an experts state for layers {sorted(experts)} does not fit this "
                             f"model's {sorted(self.experts.layers) if self.experts else []}")
        for dim, policy in self.policies.items():
            policy_state = state["dims"][dim]["policy"]
            if list(state["dims"][dim]["names"]) != list(self.names[dim]):
                raise ValueError(f"{dim}: saved for layers {state['dims'][dim]['names']}, this "
                                 f"balancer's are {self.names[dim]}")
            _check_policy_state(policy, policy_state)
        moves = {dim: ShardPlan(tuple(s["plan"])) for dim, s in state["dims"].items()
                 if tuple(s["plan"]) != self.dims[dim][0].plan.sizes}
        if moves:
            migrate(self.model, self.optimizer,
                    {name: plan for dim, plan in moves.items() for name in self.names[dim]})
        for dim, layers in self.dims.items():
            _set_policy_state(self.policies[dim], state["dims"][dim]["policy"])
            for layer, saved_layer in zip(layers, state["dims"][dim]["layers"]):
                _set_resize_state(layer, saved_layer)
        _set_monitor_state(self.monitor, state["monitor"])
        self.steps = state["steps"]
        self.log = [_decision(d) for d in state["log"]]
        placed = self.experts.load_state_dict(experts) if experts else []
        return sorted(moves) + placed


class ReplicaMonitor(SpeedMonitor):
    """A :class:`SpeedMonitor` of one tp group whose readings are its tp position's slowest
    replica's: after the tp group's exchange, each figure of the table (every tp rank's
    seconds and work per layer, and its unmovable seconds) is the largest over ``dp_group``
    (the work is equal on every replica of one plan; the seconds are the slowest
    replica's). One more small collective per exchange."""

    def __init__(self, group, dp_group, *, every: int = 10, window: int = 5):
        super().__init__(group, every=every, window=window)
        self.dp_group = dp_group

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        return _max_over(super()._gather(local), self.dp_group)  # [p, 2·L + 1]


def _max_over(values: torch.Tensor, group) -> torch.Tensor:
    """``values`` (float64, CPU) element-wise the largest over ``group``; a max is exact, so
    every rank gets the same bits."""
    device = "cpu"
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    out = values.to(device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out.cpu()


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _resize_dim(layers, keep: float) -> None:
    """Every layer of a dim keeps the same plan units (heads; with grouped-query attention
    whole KV-head groups, which are more features in q than in k and v): the top ``keep`` of
    them by their priority summed over the layers (so the column-parallel layers skip what
    the row-parallel one after them skips); 1 ends the resizing without scoring anything."""
    if keep >= 1.0:
        for layer in layers:
            layer.resize(1.0)
        return
    score = sum(layer.priority().reshape(-1, layer.unit).sum(dim=1) for layer in layers)
    units = select_features(score, keep, 1)  # [n] plan units on this rank, or None: all
    for layer in layers:
        kept = None if units is None else (
            units[:, None] * layer.unit + torch.arange(layer.unit, device=units.device)
        ).reshape(-1)
        layer.resize(keep, kept=kept)


def _resize_state(layer) -> dict:
    """A layer's ZERO-resizing as CPU copies: its share, kept features and priority state."""
    def copy(t):
        return None if t is None else t.detach().to("cpu", copy=True)

    return {"keep": layer.keep, "kept": copy(layer._kept), "snapshot": copy(layer._snapshot),
            "scores": copy(layer._scores), "scored_by_change": layer._scored_by_change}


def _set_resize_state(layer, state: dict) -> None:
    device = layer.weight.device

    def put(t):
        return None if t is None else t.to(device, copy=True)

    if state["kept"] is None:
        layer.resize(1.0)
    else:
        layer.resize(state["keep"], kept=state["kept"])
    layer._snapshot, layer._scores = put(state["snapshot"]), put(state["scores"])
    layer._scored_by_change = state["scored_by_change"]


def _decision(plain: dict) -> Decision:
    report = plain["migration"]
    return Decision(**{**plain, "sizes": tuple(plain["sizes"]),
                       "migration": None if report is None else MigrationReport(**report)})


_MONITOR = ("every", "window", "keys", "world")
_MONITOR_COUNTS = ("_window_steps", "steps", "shares", "restarts", "overhead_s", "compute_s")


def _monitor_state(monitor: SpeedMonitor) -> dict:
    """The speed monitor as plain values: every rank's readings in the window, the seconds
    and work summed since the last exchange, the counters."""
    monitor._resolve_pending()
    return {**{k: getattr(monitor, k) for k in _MONITOR},
            **{k: getattr(monitor, k) for k in _MONITOR_COUNTS},
            "seconds": dict(monitor._seconds), "work": dict(monitor._work),
            "last_s": {k: list(v) for k, v in monitor._last_s.items()},
            "readings": {k: [list(q) for q in ranks] for k, ranks in monitor._readings.items()},
            "fixed": None if monitor._fixed is None else [list(q) for q in monitor._fixed],
            "outside": [monitor._outside_cpu, monitor._busy_cpu, monitor._busy_plain]}


def _check_monitor_state(monitor: SpeedMonitor, state: dict) -> None:
    mine, saved = ([getattr(monitor, k) for k in _MONITOR], [state[k] for k in _MONITOR])
    if mine != saved:
        raise ValueError(f"speed readings of (every, window, layers, ranks) {saved} do not fit "
                         f"this monitor's {mine}")


def _set_monitor_state(monitor: SpeedMonitor, state: dict) -> None:
    monitor._pending.clear()
    monitor._seconds, monitor._work = dict(state["seconds"]), dict(state["work"])
    monitor._last_s = {k: list(v) for k, v in state["last_s"].items()}
    monitor._readings = {k: [deque(q, maxlen=monitor.window) for q in ranks]
                         for k, ranks in state["readings"].items()}
    for k in _MONITOR_COUNTS:
        setattr(monitor, k, state[k])
    fixed = state.get("fixed")  # None: none yet, or an older save
    monitor._fixed = None if fixed is None else [deque(q, maxlen=monitor.window) for q in fixed]
    monitor._outside_cpu, monitor._busy_cpu, monitor._busy_plain = state.get("outside",
                                                                             (0.0,) * 3)
    monitor._begun = None


_POLICY_COUNTS = ("imbalanced_steps", "balanced_steps", "back_steps", "peak", "departure",
                  "fresh", "done_static", "cost_steps", "steps", "check_since")


def _policy_state(policy: SemiPolicy) -> dict:
    """A dim's policy as plain values: its plan and basis, the resizing, the counters, the
    log."""
    return {"name": policy.config.name, "total": policy.total, "world": policy.world,
            "plan": list(policy.plan.sizes), "basis": list(policy.basis),
            "fractions": None if policy.fractions is None else list(policy.fractions),
            "before_resize": (None if policy.before_resize is None
                              else list(policy.before_resize)),
            **{k: None if getattr(policy, k) is None else list(getattr(policy, k))
               for k in ("before_fixed", "basis_fixed")},
            "floored": policy.floored,
            **{k: getattr(policy, k) for k in _POLICY_COUNTS},
            "log": [(step, _plain_action(a)) for step, a in policy.log]}


def _check_policy_state(policy: SemiPolicy, state: dict) -> None:
    mine = (policy.config.name, policy.total, policy.world)
    saved = (state["name"], state["total"], state["world"])
    if mine != saved:
        raise ValueError(f"a policy state of (name, units, ranks) {saved} does not fit this "
                         f"policy's {mine}")


def _set_policy_state(policy: SemiPolicy, state: dict) -> None:
    policy.plan, policy.basis = ShardPlan(tuple(state["plan"])), tuple(state["basis"])
    policy.fractions = None if state["fractions"] is None else tuple(state["fractions"])
    before = state.get("before_resize")  # None: older saves
    policy.before_resize = None if before is None else tuple(before)
    for k in ("before_fixed", "basis_fixed"):  # None: older saves
        setattr(policy, k, None if state.get(k) is None else tuple(state[k]))
    policy.floored = bool(state.get("floored", state.get("floor")))  # older saves: a tuple or none
    for k in _POLICY_COUNTS:
        setattr(policy, k, state.get(k) if k == "check_since" else state[k])  # None: older saves
    policy.log = [(step, _action(a)) for step, a in state["log"]]


def _plain_action(action: Action) -> dict:
    return {"kind": action.kind, "reason": action.reason,
            "plan": None if action.plan is None else list(action.plan.sizes),
            "fractions": None if action.fractions is None else list(action.fractions)}


def _action(plain: dict) -> Action:
    return Action(plain["kind"], plain["reason"],
                  plan=None if plain["plan"] is None else ShardPlan(tuple(plain["plan"])),
                  fractions=None if plain["fractions"] is None else tuple(plain["fractions"]))
