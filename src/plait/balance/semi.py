"""``SemiPolicy``: the balancer's state machine for one sharded dim, step by step; pure (no
torch, no torch.distributed): it returns :class:`~plait.balance.policy.Action` values that
the balancer applies. The plans and fractions it asks for are :mod:`.policy`'s."""

from __future__ import annotations

import math
from typing import Sequence

from ..plan import ShardPlan
from .policy import (Action, PolicyConfig, check_fixed, check_speeds, imbalance, resize_fractions,
                     static_plan)

__all__ = ["SemiPolicy", "agreement", "BRIDGES"]

# the least share of an imbalance's height (in log) a resizing must take away to bridge it
BRIDGES = 1 / 3


class SemiPolicy:
    """The balancer's state machine for one layer (one sharded dim of ``total`` units).

    Call ``step(speeds, confidence)`` once per training step with the latest shared speeds
    and the monitor's confidence in them; apply the returned :class:`Action`. With
    ``name="semi"``: an imbalance at or above ``trigger`` (for ``confirm_steps``) is bridged
    by resizing; it is migrated to a proportional plan (exact; the resizing ends with it)
    once it has lasted ``spike_steps`` and long enough to repay the migration: an imbalance
    that has lasted ``a`` steps is expected to last about ``a`` more, so it migrates when
    ``a · saving ≥ 2 · cost`` (``saving``: the share of the dim's step compute the new plan
    saves over the current one; ``cost``: a migration, there and back, in steps of that
    compute, measured by the caller through :meth:`note_migration_cost`). Once the speeds
    are balanced (below ``release``) for ``settle_steps`` the resizing is undone, or the
    plan returns to even. An imbalance a resizing cannot bridge (:meth:`_bridges`) is not
    resized: it is migrated as soon as that repays, ``spike_steps`` or not; and a dim that
    would repay by the readings after another dim's decision migrates beside it
    (:meth:`join`). Readings under ``min_confidence`` (right after a plan change) are
    not acted on; an imbalance under way ages through them. The other names use the parts
    they say.

    Every plan remembers the speeds it was made for (its *basis*: equal speeds
    for the even plan). A plan in whole quanta cannot match its basis exactly, so
    the imbalance left on a migrated plan is not a new slowdown: only speeds that
    move away from the basis by ``trigger`` (``departure``) are resized or, if they
    persist, migrated again; so one imbalance is never both migrated and resized on top.
    An imbalance that has already given back over half its height (in log) is a spike
    ending, not persisting, and is not migrated however long the monitor's window
    stretches it; nor is one that any of the newest readings (``recent``) shows under
    ``trigger`` or under half its height (in log): the window's mean still holds a spike's
    readings for ``window`` readings after it ends, and a resize made part-way into the
    spike records too low a height for the receding test on the window to see it end.

    An imbalance counts (for resizing, migrating and its age) only while each of the newest
    readings also shows it, between the same two ranks, at ``trigger`` or more
    (:func:`agreement`): jitter with no persistent straggler pushes the window's mean over the
    trigger now and then, but seldom every newest reading with it in the same direction.

    A migration from a resizing is sized by readings floored, for the resized ranks, at
    those taken before it (:meth:`_sizing`), where the window had settled then; one sized
    by readings taken under resizing is checked by the first confident readings under the
    new plan (:meth:`_check_plan`): corrected by one more migration where they find it out
    of balance, else those readings become its basis.
    """

    def __init__(self, config: PolicyConfig, total: int, world: int):
        self.config, self.total, self.world = config, total, world
        self.even = ShardPlan.even(total, world, config.quantum)
        static_plan(total, [1.0] * world, config.quantum)  # refuse a dim too small for the group
        self.plan: ShardPlan = self.even
        self.basis: tuple[float, ...] = (1.0,) * world  # the speeds the plan was made for
        self.fixed: tuple[float, ...] = (0.0,) * world  # each rank's unmovable time, now
        self.basis_fixed: tuple[float, ...] | None = None  # the unmovable time a plan was made for
        self.fractions: tuple[float, ...] | None = None
        self.imbalanced_steps = 0  # consecutive steps the current plan was out of balance
        self.balanced_steps = 0  # consecutive steps the speeds were balanced
        self.back_steps = 0  # consecutive steps the speeds were back at the plan's basis
        self.peak = self.departure = 1.0  # the departure at its height this episode, and now
        self.fresh = 1.0  # the smallest departure among the newest readings
        self.done_static = False
        self.cost_steps = config.migrate_cost_steps  # one migration, in steps of compute
        # semi, after a migration sized by readings taken under resizing: the step its
        # imbalance began, until the first confident readings under the new plan check it
        self.check_since: int | None = None
        # the speeds that started the current resizing, read before any rank was resized
        self.before_resize: tuple[float, ...] | None = None
        self.before_fixed: tuple[float, ...] | None = None  # the unmovable time then
        # whether those speeds bound a migration's sizing from below (_sizing)
        self.floored = False
        self.log: list[tuple[int, Action]] = []
        self.steps = 0
        # this step: the sizing of a migration that persisted but did not yet repay (join)
        self.deferred: tuple[float, ...] | None = None

    def note_migration_cost(self, steps: float) -> None:
        """A migration of this dim took ``steps`` steps of its compute (measured)."""
        if not (steps >= 0.0 and math.isfinite(steps)):
            raise ValueError(f"a migration's cost is a finite number of steps ≥ 0, got {steps}")
        self.cost_steps = steps

    def step(self, speeds: Sequence[float], confidence: float = 1.0,
             recent: Sequence[Sequence[float]] | None = None,
             fixed: Sequence[float] | None = None) -> Action:
        """``recent``: the newest readings (``SpeedMonitor.recent()``), each one speed per
        rank; None: ``speeds`` are themselves the newest reading. ``fixed``: each rank's
        unmovable time (``SpeedMonitor.fixed()``, see the module doc); None: none. It shapes
        every plan and imbalance; departures from a plan's basis are in speeds alone. While
        resized the policy keeps those read before the resizing: read under it they hold the
        resizing's own work (choosing and gathering the kept features), which a migration
        ends (a kernel-throttled 2 × rank read 0.45 before resizing, 0.52 to 0.55 under it),
        and they are over the work done, not the dim's."""
        speeds = check_speeds(speeds, self.world)
        self.fixed = check_fixed(fixed, self.world)
        self.deferred = None
        if self.fractions is not None and self.before_fixed is not None:
            # read under resizing they hold the resizing's own work, which ends with it
            self.fixed = self.before_fixed
        recent = [speeds] if not recent else [check_speeds(r, self.world) for r in recent]
        cfg = self.config
        if confidence < cfg.min_confidence:  # right after a plan change: wait for readings
            self.steps += 1
            if self.imbalanced_steps:  # one under way ages; the next reading says if it ended
                self.imbalanced_steps += 1
            return Action("none", f"confidence {confidence:.2f} < {cfg.min_confidence}")
        if self.check_since is not None:
            action, used = self._check_plan(speeds)
            if action.kind != "none":  # the plan's basis: the speeds it was sized for
                return self._taken(action, used)
        raw = imbalance(speeds, fixed=self.fixed)  # on the even plan, whatever the plan
        on_plan = imbalance(speeds, self.plan, fixed=self.fixed)  # without resizing
        departure = imbalance([s / b for s, b in zip(speeds, self.basis)])
        # every newest reading on its own shows it too, on the same ranks: jitter pushes the
        # window's mean over the trigger now and then, but seldom each newest reading with it
        agree = agreement(speeds, recent, self.basis)
        moved = on_plan >= cfg.trigger and departure >= cfg.trigger and agree >= cfg.trigger
        self.imbalanced_steps = self.imbalanced_steps + 1 if moved else 0
        self.peak = max(self.peak, departure) if moved else 1.0
        self.departure = departure
        self.balanced_steps = self.balanced_steps + 1 if raw < cfg.release else 0
        self.back_steps = self.back_steps + 1 if departure < cfg.release else 0
        # the window lags: a slowdown that has ended fills it for `window` more readings
        self.fresh = min(imbalance([s / b for s, b in zip(r, self.basis)]) for r in recent)
        # the window has settled: each newest reading agrees with it (not a window that still
        # holds readings from before a slowdown's onset, or from before it moved)
        settled = all(imbalance([a / b for a, b in zip(r, speeds)]) < cfg.trigger
                      for r in recent)
        sizing = self._sizing(speeds)
        action = self._decide(speeds, raw, on_plan, moved, sizing)
        return self._taken(action, sizing if action.kind == "migrate" else speeds, settled)

    def _sizing(self, speeds: tuple[float, ...]) -> tuple[float, ...]:
        """The speeds a migration is sized by: ``speeds``, except that while resized a
        resized rank's reading counts for no less than its reading before the resizing
        (fastest = 1 again). A resized rank computes a narrower share, which costs more per
        unit, and does the resizing's own work on top, so it reads slow (a 2 × rank read
        0.36 to 0.46 under resizing, 0.49 to 0.54 before it). One that really got slower under the resizing is sized too fast, and
        the readings under the new plan depart from its basis: resized, then migrated again.
        Only readings from a settled window bound it (each newest reading within ``trigger``
        of the window's: not a window still holding readings from before a slowdown began or
        moved), and only until the resizing is redone because the speeds moved under it."""
        if self.fractions is None or not self.floored:
            return speeds
        floored = [max(s, b) if k < 1.0 else s
                   for s, b, k in zip(speeds, self.before_resize, self.fractions)]
        return tuple(v / max(floored) for v in floored)

    def _taken(self, action: Action, speeds: tuple[float, ...], settled: bool = False) -> Action:
        """Apply ``action`` to the state, log it unless it is none; the step is over.
        ``settled``: each newest reading agreed with the window's (a resizing that starts
        then is floored, :meth:`_sizing`)."""
        self._apply(action, speeds, settled)
        if action.kind != "none":
            self.log.append((self.steps, action))
        self.steps += 1
        return action

    # --- the rules, in priority order --------------------------------------
    def _decide(self, speeds, raw: float, on_plan: float, moved: bool,
                sizing: tuple[float, ...]) -> Action:
        """``sizing``: the speeds a migration is sized by (:meth:`_sizing`)."""
        cfg, name = self.config, self.config.name
        figures = (f"speeds {_fmt(speeds)}{self._unmoved()}, imbalance {on_plan:.2f} on plan "
                   f"{list(self.plan.sizes)}")
        if name == "even":
            return Action("none", "policy even never acts")
        if name == "static":
            if self.done_static or on_plan < cfg.trigger:
                return Action("none", "static: plan fixed" if self.done_static else figures)
            self.done_static = True
            return self._migrate(speeds, f"static: one proportional plan for {figures}")
        settled = self.balanced_steps >= cfg.settle_steps
        if self.fractions is not None and (settled or self.back_steps >= cfg.settle_steps):
            why = "balanced" if settled else "back at the plan's speeds"
            return Action("undo", f"{why} for {cfg.settle_steps} steps (< {cfg.release}): "
                                  f"{figures}")
        rose = self._rose(speeds)
        if rose >= cfg.trigger:
            return Action("undo", f"over: the resized ranks read {rose:.2f} × their speed when "
                                  f"the resizing began (≥ {cfg.trigger}); {figures}")
        if self.plan != self.even and settled and name in ("migrate", "semi"):
            return Action("migrate", f"slowdown over for {self.balanced_steps} steps: back to "
                                     f"the even plan; {figures}", plan=self.even)
        out = moved and raw >= cfg.release and self.imbalanced_steps >= cfg.confirm_steps
        # a slowdown that has given back over half its height (in log) is a spike ending, not
        # one that persists: the monitor's window only makes it look long
        receding = math.log(self.departure) < 0.5 * math.log(self.peak)
        # a resizing that cannot bridge it leaves nothing to wait for: migrate once that pays
        bridges, bridged = (self._bridges(speeds, on_plan) if name == "semi" and out
                            and self.fractions is None else (True, ""))
        persisted = (name == "semi" and not receding
                     and (self.imbalanced_steps >= cfg.spike_steps or not bridges))
        if persisted and (self.fresh < cfg.trigger or  # a newest reading says it is over
                          math.log(self.fresh) < 0.5 * math.log(self.peak)):
            persisted, figures = False, f"{figures}; newest readings depart {self.fresh:.2f}"
        if sizing != speeds:
            figures = f"{figures}; sized by {_fmt(sizing)} (no lower than before resizing)"
        if out and persisted:
            pays, why = self._pays(sizing)
            persisted, figures = pays, f"{figures}; {why}"
            self.deferred = None if pays else sizing
        if out and (name == "migrate" or persisted):
            why = "persisted" if name == "semi" else "policy migrate"
            action = self._migrate(sizing, f"{why} ({self.imbalanced_steps} steps): {figures}")
            if action.kind == "migrate":
                return action
        if self.fractions is not None:
            current = imbalance(speeds, self.plan, self.fractions, self.fixed)
            if current >= cfg.trigger and raw < cfg.release:  # the resizing is the imbalance
                return Action("undo", f"balanced again, and the resizing leaves {current:.2f}:"
                                      f" {figures}")
            if current >= cfg.trigger:
                return self._resize(speeds, current, f"speeds moved under the resizing; {figures}")
        elif out and name in ("resize", "semi"):
            if not bridges:
                return Action("none", f"{bridged}: waiting for a migration to repay its cost; "
                                      f"{figures}")
            kind = "a spike" if name == "semi" else "a slowdown"
            return self._resize(speeds, on_plan, f"bridging {kind}; {figures}")
        return Action("none", figures)

    def join(self, delay: int) -> Action:
        """Called after :meth:`step` returned none, when another dim acted at this step: the
        monitor restarts, so this dim's next decision is ``delay`` steps away, and an
        imbalance under way ages through them. If this step found it persisting but not yet
        repaying a migration, and it would repay ``delay`` steps older, migrate now, beside
        the other dim, rather than run that imbalance for ``delay`` more steps (in a
        kernel-made graded run the 4 × host otherwise kept 4 of 16 heads for 5 steps after
        its MLP columns had migrated)."""
        sizing, self.deferred = self.deferred, None
        if sizing is None:
            return Action("none", "nothing under way")
        pays, why = self._pays(sizing, self.imbalanced_steps + delay)
        if not pays:
            return Action("none", why)
        action = self._migrate(sizing, f"persisted ({self.imbalanced_steps} steps), joining "
                                       f"a migration: the next readings are {delay} steps "
                                       f"away; {why}")
        if action.kind == "migrate":
            self._apply(action, sizing, False)
            self.log.append((self.steps - 1, action))
        return action

    def _rose(self, speeds: tuple[float, ...]) -> float:
        """While resized: how much faster the resized ranks read than when the resizing
        began, the least of them (1 when not resized). A slowdown that ended shows here
        first: read under the resizing a rank is a little slow (a narrower GEMM and the
        resizing's own work), and the unmovable times kept from before the resizing were
        read during the slowdown, so the other tests can see the resizing as still needed
        (8 of 12 kernel-made spike runs stayed resized to the end without this)."""
        if self.fractions is None or self.before_resize is None:
            return 1.0
        return min(s / b for s, b, k in zip(speeds, self.before_resize, self.fractions)
                   if k < 1.0)

    def _pays(self, speeds, age: int | None = None, ways: int = 2) -> tuple[bool, str]:
        """Whether migrating now repays its cost there and back (``ways`` 2; 1: a
        correction, whose way back the first migration already paid for), if the imbalance
        lasts as long again as it has (``age``; the current one's if None; see the class
        doc), and the figures that say so."""
        def pace(plan):
            return max(n / s + f * self.total for n, s, f in zip(plan.sizes, speeds, self.fixed))

        age = self.imbalanced_steps if age is None else age
        target = static_plan(self.total, speeds, self.config.quantum, fixed=self.fixed)
        saving = 1.0 - pace(target) / pace(self.plan)
        gain = age * saving
        return gain >= ways * self.cost_steps, (
            f"{age} steps × saving {saving:.2f} = {gain:.2f} steps vs "
            f"{ways} × cost {self.cost_steps:.2f}")

    def _check_plan(self, speeds) -> tuple[Action, tuple[float, ...]]:
        """The first confident readings under a plan that was sized by readings taken under
        resizing. A resized rank computes a narrower share, which costs more per unit, so
        that plan gave the slow rank too little. The check undoes that bias and nothing
        else: each rank's reading counts only as far as it lies between the plan's basis
        and the readings that started the resizing (``before_resize``), and its unmovable
        time likewise: just after a migration a kernel-throttled 2 × rank read 0.60 where it
        read 0.49 to 0.52 before and after. Where the speeds so bounded find the plan
        ``trigger`` or more out of balance, and correcting repays one migration's cost over the imbalance's age, it is
        migrated once more, to the plan they give; otherwise they become its basis. Never a
        resize on top of it for the same imbalance. Returns the action and the speeds it
        judged by."""
        age, self.check_since = self.steps - self.check_since, None
        before, self.before_resize = self.before_resize, None
        before_fixed, self.before_fixed = self.before_fixed, None
        if before is not None:  # within [basis, before] rank by rank, fastest = 1 again
            bounded = _within(speeds, self.basis, before)
            speeds = tuple(v / max(bounded) for v in bounded)
        if before_fixed is not None and self.basis_fixed is not None:
            self.fixed = tuple(_within(self.fixed, self.basis_fixed, before_fixed))
        on_plan = imbalance(speeds, self.plan, fixed=self.fixed)
        figures = (f"readings under plan {list(self.plan.sizes)}"
                   f"{' (bounded by those before resizing)' if before is not None else ''}: "
                   f"speeds {_fmt(speeds)}{self._unmoved()}, imbalance {on_plan:.2f}")
        if on_plan >= self.config.trigger:
            pays, why = self._pays(speeds, age, ways=1)
            if pays:
                action = self._migrate(speeds, f"correcting a plan sized under resizing; "
                                               f"{figures}; {why}")
                if action.kind == "migrate":
                    return action, speeds
        self.basis, self.basis_fixed = tuple(speeds), self.fixed
        return Action("none", f"plan checked, these readings its basis; {figures}"), speeds

    def _resize(self, speeds, current: float, reason: str) -> Action:
        """New fractions, if they beat the ``current`` imbalance by the hysteresis ratio (so a
        resizing clipped at ``max_skip`` is not redone at every wiggle of the speeds).

        Only a rank whose speed has fallen from the plan's basis by ``trigger`` against the
        rank that fell least (:meth:`_slowed`) is resized: a resizing bridges a slowdown,
        and the others have none to bridge. Without that, the unmovable times alone could
        pick the ranks: in a kernel-made graded run, once the 4 × host had migrated down to
        1 column and waited, its unmovable time fell and semi resized the three fast hosts
        for the rest of the run."""
        cfg = self.config
        fractions = self._fractions(speeds)
        if all(f == 1.0 for f in fractions):
            if self.fractions is None:
                return Action("none", f"no rank that slowed needs resizing: {reason}")
            return Action("undo", f"no rank needs resizing: {reason}")
        after = imbalance(speeds, self.plan, fractions, self.fixed)
        if after * cfg.trigger / cfg.release > current:
            return Action("none", f"resizing to {_fmt(fractions)} would leave {after:.2f}; {reason}")
        return Action("resize", f"keep {_fmt(fractions)}: {reason}", fractions=fractions)

    def _bridges(self, speeds, current: float) -> tuple[bool, str]:
        """Whether resizing would bridge the ``current`` imbalance: take at least
        ``BRIDGES`` of its height (in log) away; and the figures. A host slow at everything
        is slow at its unmovable work too, which no resizing shortens: in kernel-made graded
        runs the bridging resizes took 0.17 to 0.25 of the height away, every other one
        0.52 to 1.0 (docs/results/balancing.md)."""
        fractions = self._fractions(speeds)
        after = imbalance(speeds, self.plan, fractions, self.fixed)
        taken = 1.0 - math.log(after) / math.log(current) if current > 1.0 else 1.0
        return taken >= BRIDGES, (f"resizing to {_fmt(fractions)} would leave {after:.2f} of "
                                  f"{current:.2f} ({taken:.2f} of its height)")

    def _fractions(self, speeds) -> tuple[float, ...]:
        """The resizing these speeds call for, on the ranks that slowed only."""
        return tuple(f if slow else 1.0 for f, slow in zip(
            resize_fractions(speeds, self.plan, self.config.max_skip, self.fixed),
            self._slowed(speeds)))

    def _slowed(self, speeds) -> list[bool]:
        """Per rank: its speed over the plan's basis is ``trigger`` or more below the
        highest rank's such ratio."""
        rel = [s / b for s, b in zip(speeds, self.basis)]
        return [max(rel) >= self.config.trigger * r for r in rel]

    def _unmoved(self) -> str:
        return f", unmovable {_fmt(self.fixed)}" if any(self.fixed) else ""

    def _migrate(self, speeds, reason: str) -> Action:
        plan = static_plan(self.total, speeds, self.config.quantum, fixed=self.fixed)
        if plan == self.plan:  # the plan already fits these speeds: they are its basis now
            self.basis, self.imbalanced_steps, self.peak = tuple(speeds), 0, 1.0
            self.basis_fixed = self.fixed
            return Action("none", f"proportional plan {list(plan.sizes)} is the current one; "
                                  f"{reason}")
        return Action("migrate", f"to {list(plan.sizes)}: {reason}", plan=plan)

    def _apply(self, action: Action, speeds: tuple[float, ...], settled: bool) -> None:
        if action.kind == "migrate":
            resized = self.fractions is not None and action.plan != self.even
            self.check_since = (self.steps - self.imbalanced_steps
                                if resized and self.config.name == "semi" else None)
            if self.check_since is None:
                self.before_resize = None
            self.plan, self.fractions, self.imbalanced_steps = action.plan, None, 0
            self.floored = False
            self.peak = 1.0
            self.basis = (1.0,) * self.world if action.plan == self.even else speeds
            self.basis_fixed = None if action.plan == self.even else self.fixed
            if self.check_since is None:
                self.before_fixed = None
        elif action.kind == "resize":
            if self.fractions is None:  # the resizing starts: these readings are unbiased
                self.before_resize, self.before_fixed = speeds, self.fixed
                self.floored = settled
            else:  # redone: the speeds moved under it, so they no longer bound a migration
                self.floored = False
            self.fractions = action.fractions
        elif action.kind == "undo":
            self.fractions, self.before_resize, self.before_fixed = None, None, None
            self.floored = False


def _within(values: Sequence[float], one: Sequence[float],
            other: Sequence[float]) -> list[float]:
    """Each value clamped between ``one`` and ``other`` (either way round), rank by rank."""
    return [min(max(v, min(a, b)), max(a, b)) for v, a, b in zip(values, one, other)]


def agreement(speeds: Sequence[float], recent: Sequence[Sequence[float]],
              basis: Sequence[float]) -> float:
    """The smallest departure, among the ``recent`` readings, between the two ranks that the
    window's ``speeds`` find furthest apart from ``basis`` (under 1 where a reading has them
    the other way round)."""
    rel = [s / b for s, b in zip(speeds, basis)]
    slow, fast = rel.index(min(rel)), rel.index(max(rel))
    return min((r[fast] / basis[fast]) / (r[slow] / basis[slow]) for r in recent)


def _fmt(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"
