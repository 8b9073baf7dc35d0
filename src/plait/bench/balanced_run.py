"""One training run under a balancing policy, a step at a time: ``bench hetero`` and
``plait demo`` interleave several of them step by step, so load drift hits them alike.

Each run is the training loop (:class:`plait.training.loop.Trainer`) with its own
components: its straggler emulation (active only while it steps; with a kernel throttle it
sets this rank's host's CPU budget for each step before the step starts), a paused noisy
neighbour resumed for its own steps, a barrier that starts every step together (so a step's
time is its own and not the wait for another run's step on a slower rank), the balancer,
and the figures ``bench hetero`` reports per step (:class:`_Figures`).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..balance import Balancer, PolicyConfig
from ..runtime import rank_context
from ..runtime.slow.cgroup import cpu_budget, cpu_throttled
from ..runtime.slow.straggler import Straggler
from ..runtime.timing import agreed_max
from ..training.components import Balancing, Straggling
from ..training.config import TrainConfig
from ..training.data import CharCorpus
from ..training.loop import Component, Trainer, cosine_schedule
from ..training.models import build_gpt, evaluate_gpt, gpt_loss, make_optimizer
from ..runtime.slow.scenarios import Neighbour

__all__ = ["BalancedRun"]


class _NeighbourTurn(Component):
    """This host's paused neighbour, resumed from before each step its :class:`Neighbour`
    covers until after it."""

    def __init__(self, neighbour: Neighbour | None, noisy):
        self.neighbour, self.noisy, self.busy = neighbour, noisy, False

    def before_step(self, step: int) -> None:
        self.busy = self.neighbour is not None and self.neighbour.active(step)
        if self.busy:
            self.noisy.resume()

    def after_step(self, record: dict) -> None:
        if self.busy:
            self.noisy.pause()


class _Barrier(Component):
    def before_step(self, step: int) -> None:
        dist.barrier()


class _Figures(Component):
    """Per step, this rank's: time, CPU time of the process (all its threads), thread CPU
    time in the timed layers (the monitor's ``region_cpu_s``), loss; with ``cgroup``, the
    budget the kernel held the step to and the periods it throttled; with ``noisy``, the CPU
    seconds the host's neighbour took. Readings end right after the balancer's step (place
    this component after :class:`~plait.training.components.Balancing`)."""

    def __init__(self, monitor, cgroup, noisy):
        self.monitor, self.cgroup, self.noisy = monitor, cgroup, noisy
        self.times: list[float] = []  # this rank's, per step (finish takes the slowest)
        self.cpu: list[float] = []
        self.movable_cpu: list[float] = []
        self.held: list[float] = []  # cores
        self.throttled: list[int] = []
        self.neighbour_cpu: list[float] = []
        self.losses: list[float] = []

    def before_step(self, step: int) -> None:
        if self.cgroup is not None:
            self.held.append(cpu_budget(self.cgroup))
            self._throttled = cpu_throttled(self.cgroup)
        # on the neighbour's host, every run's every step: held, it takes nothing
        self._neighbour = self.noisy.cpu_s() if self.noisy is not None else 0.0
        self._cpu, self._movable = time.process_time(), self.monitor.region_cpu_s

    def after_update(self, step: int) -> None:
        self.cpu.append(time.process_time() - self._cpu)
        self.movable_cpu.append(self.monitor.region_cpu_s - self._movable)
        if self.cgroup is not None:
            self.throttled.append(cpu_throttled(self.cgroup) - self._throttled)
        self.neighbour_cpu.append(self.noisy.cpu_s() - self._neighbour
                                  if self.noisy is not None else 0.0)

    def after_step(self, record: dict) -> None:
        self.times.append(record["time_s"])
        self.losses.append(record["loss"])


class BalancedRun:
    """A GPT of ``cfg`` trained under ``policy`` with ``specs`` slowing ranks (every rank
    makes one, in the same order). ``throttle``: the straggler's kernel throttle
    (``--slow-by kernel``); ``noisy``: this host's paused
    :class:`~plait.runtime.slow.cgroup.NoisyNeighbour`, resumed for each of this run's steps that
    a :class:`Neighbour` in ``specs`` on this rank covers; ``accounting`` (the same on every
    rank): record the kernel's figures of this host's cgroup per step (always with
    ``throttle``)."""

    def __init__(self, cfg: TrainConfig, policy: PolicyConfig, specs: list,
                 corpus: CharCorpus, *, every: int = 2, refresh: int = 200, throttle=None,
                 noisy=None, accounting: bool = False):
        self.cfg, self.corpus = cfg, corpus
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        straggler = Straggler([s for s in specs if not isinstance(s, Neighbour)], self.rank,
                              throttle=throttle)
        neighbour = next((s for s in specs if isinstance(s, Neighbour) and s.rank == self.rank),
                         None)
        if neighbour is not None and noisy is None:
            raise ValueError("a noisy-neighbour run needs this host's neighbour (noisy=)")
        accounting = accounting or throttle is not None
        cgroup = rank_context().host.cgroup if accounting else None
        self.model = build_gpt(cfg, vocab_size=corpus.vocab_size)
        optimizer = make_optimizer(self.model, cfg.lr)
        self.balancer = Balancer(self.model, optimizer, None, policy, every=every,
                                 refresh=refresh)
        self.batches = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
        self.straggling = Straggling(straggler, self.rank)
        self.figures = _Figures(self.balancer.monitor, cgroup, noisy)
        self.trainer = Trainer(self.model, optimizer, gpt_loss,
                               schedule=cosine_schedule(cfg.steps, cfg.lr),
                               components=[self.straggling, _NeighbourTurn(neighbour, noisy),
                                           _Barrier(), Balancing(self.balancer), self.figures])

    def step(self, step: int) -> None:
        """Training step ``step`` (every rank; started together)."""
        self.trainer.step(step, next(self.batches))

    def finish(self) -> dict:
        """Evaluate and gather the figures (collectives: every rank, runs in the same order).
        Per-step times are the slowest rank's; the tensor-parallel compute per step is the
        mean rank's."""
        with self.straggling.installed():
            final = evaluate_gpt(self.model, self.corpus, self.cfg)
        f = self.figures
        steps = max(len(f.times), 1)
        compute = torch.tensor([self.balancer.monitor.compute_s / steps] + f.cpu,
                               dtype=torch.float64)
        dist.all_reduce(compute)
        compute /= self.world  # the mean rank's
        out = {"losses": f.losses, "eval": final,
               "compute_s_per_step": float(compute[0]),
               "cpu_s_steps": compute[1:].tolist(),
               "speeds": list(self.balancer.monitor.speeds()),
               "monitor_s": self.balancer.monitor.overhead_s,
               "decisions": [d.to_json() for d in self.balancer.log],
               "final_state": self.balancer.state(), "world": self.world}
        if f.cgroup is not None:  # per rank, per step: what the kernel did
            ranks = [None] * self.world
            share = [c / max(t, 1e-12) for c, t in zip(f.cpu, f.times)]
            dist.all_gather_object(ranks, (f.held, f.throttled, share, f.neighbour_cpu,
                                           f.cpu, f.movable_cpu))
            out["kernel"] = {"held_cores": [r[0] for r in ranks],
                             "throttled_periods": [r[1] for r in ranks],
                             "cpu_share": [r[2] for r in ranks],
                             "neighbour_cpu_s": [r[3] for r in ranks],
                             "cpu_s": [r[4] for r in ranks],
                             "movable_cpu_s": [r[5] for r in ranks]}
        out["times"] = agreed_max(f.times)
        return out
