"""Heterogeneous ranks: per-rank speeds under each balancing policy.

A sharded operator has ``work_s`` seconds of work per rank at speed 1 when
split evenly over ``n`` ranks; rank i, of speed s_i, given a share w_i of the
work (sum w = 1) of which it computes a fraction k_i, takes

    t_i = work_s * n * w_i * k_i / s_i

and the collective that follows waits for the slowest: T = max_i t_i.
The ideal, perfectly balanced and exact, is work_s * n / sum(s).

Policies (names shared with plait.balance):
  even     equal shards; everyone waits for the slowest.
  static   shards proportional to speeds known up front (GPU generations).
  resize   ZERO-resizing: equal shards, ranks slower than the median skip part
           of their reduction dim (lossy, no data moved), at most ``max_skip``.
  migrate  exact: shards proportional to the last measured speeds; slices move
           (a cost) when the predicted benefit over ``horizon`` steps beats it.
  semi     SEMI-migration: migrate for the persistent part of the imbalance
           (an EMA of speeds), resize for transient spikes around it.

All functions work on numpy arrays whose last axis is the rank axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "POLICIES",
    "Plan",
    "BalanceState",
    "rank_times",
    "ideal_time",
    "plan_policy",
    "step_policy",
    "react",
    "policy_step_time",
]

POLICIES = ("even", "static", "resize", "migrate", "semi")


@dataclass(frozen=True)
class Plan:
    """shares: work fractions [..., n] summing to 1; keep: computed fraction in (0, 1]."""

    shares: np.ndarray
    keep: np.ndarray

    @property
    def skipped(self) -> np.ndarray:
        """Fraction of the total work dropped (ZERO-resizing's loss)."""
        return np.sum(self.shares * (1.0 - self.keep), axis=-1)


@dataclass(frozen=True)
class BalanceState:
    """What a policy carries between steps: current shards and a speed EMA."""

    shares: np.ndarray
    ema: np.ndarray


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown balancing policy {policy!r}; known: {', '.join(POLICIES)}")


def _proportional(speeds: np.ndarray) -> np.ndarray:
    return speeds / np.sum(speeds, axis=-1, keepdims=True)


def _resize_keep(speeds: np.ndarray, max_skip: float) -> np.ndarray:
    ref = np.median(speeds, axis=-1, keepdims=True)
    return np.clip(speeds / ref, 1.0 - max_skip, 1.0)


def rank_times(work_s, plan: Plan, speeds: np.ndarray) -> np.ndarray:
    """Per-rank seconds of the sharded work under ``plan`` at true ``speeds``."""
    work = np.asarray(work_s, dtype=float)[..., None]
    return work * speeds.shape[-1] * plan.shares * plan.keep / speeds


def ideal_time(work_s, speeds: np.ndarray) -> np.ndarray:
    """Balanced, exact: total work over total speed."""
    return work_s * speeds.shape[-1] / np.sum(speeds, axis=-1)


def plan_policy(policy: str, *, nominal: np.ndarray, measured: np.ndarray | None = None,
                persistent: np.ndarray | None = None, max_skip: float = 0.25) -> Plan:
    """The shards and kept fractions a policy asks for, before migration costs.

    nominal: speeds known up front; measured: last observed speeds;
    persistent: slow-moving estimate (EMA).  Missing estimates fall back in that order.
    """
    _check_policy(policy)
    measured = nominal if measured is None else measured
    persistent = measured if persistent is None else persistent
    even = np.full(nominal.shape, 1.0 / nominal.shape[-1])
    ones = np.ones(nominal.shape)
    if policy == "even":
        return Plan(even, ones)
    if policy == "static":
        return Plan(_proportional(nominal), ones)
    if policy == "resize":
        return Plan(even, _resize_keep(measured, max_skip))
    if policy == "migrate":
        return Plan(_proportional(measured), ones)
    return Plan(_proportional(persistent), _resize_keep(measured / persistent, max_skip))


def step_policy(policy: str, state: BalanceState | None, *, nominal: np.ndarray,
                measured: np.ndarray | None, work_s=1.0, move_s_per_share: float = 0.0,
                horizon: int = 10, ema: float = 0.2, max_skip: float = 0.25,
                ) -> tuple[Plan, BalanceState, np.ndarray]:
    """One step's decision: (plan, next state, seconds spent migrating [...]).

    work_s: the group's sharded work per step (seconds per rank at speed 1, even
    split).  migrate/semi move shards only where (old step time - new step time)
    * horizon, predicted from ``measured``, exceeds the migration time
    (move_s_per_share seconds per unit of total work moved).
    """
    _check_policy(policy)
    if state is None:
        state = BalanceState(_proportional(nominal), nominal.astype(float))
    est = nominal if measured is None else measured
    new_ema = est if measured is None else (1 - ema) * state.ema + ema * measured
    want = plan_policy(policy, nominal=nominal, measured=est, persistent=new_ema, max_skip=max_skip)
    moved_s = np.zeros(nominal.shape[:-1])
    if policy not in ("migrate", "semi"):
        return want, BalanceState(want.shares, new_ema), moved_s
    moved = 0.5 * np.sum(np.abs(want.shares - state.shares), axis=-1)
    scale = np.asarray(work_s, dtype=float) * nominal.shape[-1]
    t_old = np.max(state.shares * want.keep / est, axis=-1) * scale
    t_new = np.max(want.shares * want.keep / est, axis=-1) * scale
    go = (t_old - t_new) * horizon > moved * move_s_per_share
    shares = np.where(go[..., None], want.shares, state.shares)
    moved_s = np.where(go, moved * move_s_per_share, 0.0)
    return Plan(shares, want.keep), BalanceState(shares, new_ema), moved_s


def react(policy: str, plan: Plan, state: BalanceState, speeds_now: np.ndarray,
          max_skip: float = 0.25) -> Plan:
    """Within-step reaction: resizing needs no data movement, so resize and semi
    can re-decide the kept fractions as soon as a slowdown is seen; shards
    (static, migrate, semi's persistent part) stay until the next step."""
    if policy == "resize":
        return Plan(plan.shares, _resize_keep(speeds_now, max_skip))
    if policy == "semi":
        return Plan(plan.shares, _resize_keep(speeds_now / state.ema, max_skip))
    return plan


def policy_step_time(policy: str, work_s: float, speeds, *, nominal=None, measured=None,
                     max_skip: float = 0.25) -> dict:
    """One-shot comparison for a single group: step time, ideal and loss.

    Returns {"step_s", "ideal_s", "skipped", "shares"} for ``policy`` at true
    ``speeds`` (planning with ``nominal``/``measured``, default: the true speeds).
    """
    speeds = np.asarray(speeds, dtype=float)
    if np.any(speeds <= 0):
        raise ValueError(f"speeds must be > 0, got {speeds.tolist()}")
    nominal = speeds if nominal is None else np.asarray(nominal, dtype=float)
    plan = plan_policy(policy, nominal=nominal, measured=None if measured is None
                       else np.asarray(measured, dtype=float), max_skip=max_skip)
    return {
        "step_s": float(np.max(rank_times(work_s, plan, speeds))),
        "ideal_s": float(ideal_time(work_s, speeds)),
        "skipped": float(plan.skipped),
        "shares": plan.shares.tolist(),
    }
