"""``plait bench experts``: MoE experts placed by routed load and rank speed, against even.

Every rank holds the same experts' weights (``experts`` × [H, F] and [F, H], one seed) and,
each step, computes what a placement gives it: for each expert replica it holds, its share
of the rows routed to that expert (:func:`plait.bench.config.experts.routed_loads`: the
same counts on every rank, from the seed), through ``gelu(x · W1) · W2``. That is the
expert work of one MoE step, timed on the rank's own core under its emulated slowdown
(``--slow``); the step's time is the slowest rank's. The all-to-alls that carry the rows
are not in it: this benchmark measures what a placement does to the ranks' expert work,
the term the balancer moves.

Policies, interleaved step by step (each step the same loads for all of them):

- ``even``: contiguous blocks of experts (an even expert-parallel plan); never moves.
- ``static``: placed once, after the warm-up, by the ranks' measured speeds, every expert
  assumed equally loaded (what a speed-only balancer does); no replicas.
- ``balanced``: :class:`plait.balance.experts.ExpertBalancer` fed each step's routed loads
  and the ranks' speeds (rows a second, measured), hot experts replicated.
- ``balanced-no-replicas``: the same, one copy of each expert.

Per step and policy: the step time, the ideal (all rows at the ranks' summed speeds), the
imbalance (slowest rank's time over the mean's) and the moves made. Rank speeds are each
rank's rows a second, the median of its last 5 steps; the ideal uses the same speeds.
``same_losses``: each policy's last placement applied to a small float64 ``plait.nn.MoE``
mid-training (its weights and AdamW state moved, hot experts copied) keeps the losses of
the layer left on even blocks.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import torch
import torch.distributed as dist

from ..balance.experts import (ExpertBalancer, ExpertPlacement, even_placement, ideal_time,
                               imbalance, moves, place_experts)
from ..runtime import rank_context
from ..runtime.placement import run_placed
from ..runtime.timing import balanced_round
from .config.experts import ExpertsBenchConfig, routed_loads

__all__ = ["bench_experts", "run_experts", "summarize_experts"]

SPEED_WINDOW = 5
"""Each rank's speed is the median of its last few steps' rows a second (as the speed
monitor's window does in training): one step's reading on a shared core is noise."""


class _Policy:
    """One policy's placement through the steps, and what it moved."""

    def __init__(self, name: str, cfg: ExpertsBenchConfig, world: int):
        self.name, self.cfg, self.world = name, cfg, world
        self.placement = even_placement(cfg.n_experts, world)
        self.balancer = None if not name.startswith("balanced") else ExpertBalancer(
            self.placement, max_replicas=1 if name.endswith("no-replicas") else None,
            threshold=0.08, confirm=3)  # training's settings (plait.balance.expert_moves)
        self.moves = 0

    def after(self, step: int, loads: list[int], speeds: list[float]) -> None:
        """Read the step's loads and speeds; re-place where the policy says."""
        if self.name == "static" and step == self.cfg.warmup - 1:
            new = place_experts([1.0] * self.cfg.n_experts, speeds, max_replicas=1,
                                current=self.placement)
            self.moves += moves(self.placement, new) > 0
            self.placement = new
        elif self.balancer is not None:
            new = self.balancer.observe(step, loads, speeds)
            if new is not None:
                self.placement = new
                self.moves += 1


def _rows(placement: ExpertPlacement, loads: list[int], rank: int) -> list[tuple[int, int]]:
    """(expert, rows) this rank computes: its replicas' shares, rounded so that the
    replicas of an expert sum to its load (the first replica takes the remainder)."""
    out = []
    for e, homes in enumerate(placement.replicas):
        counts = [int(loads[e] * share) for _, share in homes]
        counts[0] += loads[e] - sum(counts)
        out += [(e, n) for (r, _), n in zip(homes, counts) if r == rank and n]
    return out


def run_experts(cfg: ExpertsBenchConfig) -> list[dict]:
    """What each rank runs: every scenario, the policies interleaved step by step."""
    ctx = rank_context()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(cfg.seed)
    w1 = torch.randn(cfg.n_experts, cfg.hidden, cfg.ffn, generator=gen) * cfg.hidden ** -0.5
    w2 = torch.randn(cfg.n_experts, cfg.ffn, cfg.hidden, generator=gen) * cfg.ffn ** -0.5
    x = torch.randn(cfg.tokens * cfg.top_k, cfg.hidden, generator=gen)
    records = []
    for scenario in cfg.scenarios:
        policies = {name: _Policy(name, cfg, world) for name in cfg.policies}
        window = [deque(maxlen=SPEED_WINDOW) for _ in range(world)]  # rows/s, each rank
        for step in range(cfg.steps):
            loads = routed_loads(cfg, scenario, step)
            ctx.straggler.set_step(step)
            for name in balanced_round(list(policies), step):
                policy = policies[name]
                work = _rows(policy.placement, loads, rank)
                dist.barrier()  # each policy's step starts together
                start = time.perf_counter()
                with ctx.straggler.compute():
                    for e, n in work:
                        torch.nn.functional.gelu(x[:n] @ w1[e]) @ w2[e]
                mine = torch.tensor([time.perf_counter() - start, sum(n for _, n in work)],
                                    dtype=torch.float64)
                every = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(every, mine)  # the step's times and rows, every rank's
                times = [float(t[0]) for t in every]
                rows = [float(t[1]) for t in every]
                for r, (n, t) in enumerate(zip(rows, times)):
                    if n > 0 and t > 0:  # a rank with no rows this step says nothing new
                        window[r].append(n / t)
                known = [statistics.median(w) for w in window if w]
                now = [statistics.median(w) if w else min(known, default=1.0) for w in window]
                records.append({
                    "scenario": scenario, "policy": name, "step": step, "ranks": world,
                    "t_step_s": max(times), "t_ideal_s": ideal_time(rows, now) if sum(rows)
                    else 0.0, "imbalance": imbalance(times), "rows": rows,
                    "copies": policy.placement.copies(), "moves": policy.moves,
                    "warmup": step < cfg.warmup, "same_losses": None, **cfg.extra})
                policy.after(step, loads, now)
            ctx.report({"scenario": scenario, "step": step + 1, "of": cfg.steps})
        for name, policy in policies.items():  # the placement it ended on, applied exactly?
            same = _same_losses(cfg, policy.placement)
            for r in records:
                if (r["scenario"], r["policy"]) == (scenario, name):
                    r["same_losses"] = same
    return records if rank == 0 else []


def _same_losses(cfg: ExpertsBenchConfig, placement: ExpertPlacement) -> bool | None:
    """Whether a float64 ``plait.nn.MoE`` of ``cfg``'s experts, moved to ``placement`` after
    2 of 5 AdamW steps (its copies' gradients summed, its optimizer state moved), has the
    losses of the same layer left on even blocks (within 1e-10; every rank, a collective).
    None where the placement leaves a rank no expert (no layer holds it)."""
    from ..nn import MoE
    from ..nn.placement import Homes

    try:
        homes = Homes(placement.replicas, placement.world)
    except ValueError:
        return None
    rank = dist.get_rank()
    losses = []
    for moved in (False, True):
        layer = MoE(16, 16, cfg.n_experts, cfg.top_k, dtype=torch.float64, seed=cfg.seed,
                    chunks=1)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(cfg.seed * 31 + rank)
        run = []
        for step in range(5):
            if moved and step == 2:
                layer.place(homes, opt)
            x = torch.randn(32, 16, generator=gen, dtype=torch.float64)
            loss = layer(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            run.append(float(total))
        losses.append(run)
    return max(abs(a - b) for a, b in zip(*losses)) < 1e-10


def bench_experts(cfg: ExpertsBenchConfig, *, ranks: int, hosts: int = 0, link=None,
                  timeout_s=None, on_progress=None, slow=()) -> tuple[list[dict], str]:
    """``run_experts`` on ``ranks`` ranks; rank 0's records and where it ran."""
    if ranks < 2:
        raise ValueError("bench experts places experts over ranks: it needs --ranks 2 or more")
    if cfg.n_experts < ranks:
        raise ValueError(f"--n-experts {cfg.n_experts} leave some of the {ranks} ranks no expert")
    records, where = run_placed(run_experts, cfg, ranks=ranks, hosts=hosts, link=link,
                                timeout_s=timeout_s, on_progress=on_progress, slow=slow)
    return records, where


def summarize_experts(records: list[dict]) -> list[dict]:
    """Per (scenario, policy): medians of the timed steps, and the moves made."""
    out = []
    keys = dict.fromkeys((r["scenario"], r["policy"]) for r in records)
    for scenario, policy in keys:
        rows = [r for r in records if (r["scenario"], r["policy"]) == (scenario, policy)]
        timed = [r for r in rows if not r["warmup"]]
        out.append({"scenario": scenario, "policy": policy, "ranks": rows[0]["ranks"],
                    "t_step_s": statistics.median(r["t_step_s"] for r in timed),
                    "t_ideal_s": statistics.median(r["t_ideal_s"] for r in timed),
                    "ratio_to_ideal": statistics.median(r["t_step_s"] / r["t_ideal_s"]
                                                        for r in timed if r["t_ideal_s"]),
                    "imbalance": statistics.median(r["imbalance"] for r in timed),
                    "moves": rows[-1]["moves"], "copies": rows[-1]["copies"],
                    "same_losses": rows[-1]["same_losses"]})
    return out
