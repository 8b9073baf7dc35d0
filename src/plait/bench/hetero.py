"""``plait bench hetero``: tensor parallelism with a slow rank, under each balancing policy.

Every rank trains the same small GPT (plait TP, fused operators) from the same
seed on the same batches, once per (seed, scenario, policy), all in one
launch; a seed's runs are interleaved step by step in balanced orders (see
:func:`run_hetero`). A scenario slows ranks through the runtime's straggler emulation (a
rank ``F`` × slower sleeps ``(F − 1)`` × each of its compute pieces):

- ``none``: no straggler, the reference;
- ``straggler-2x``: the last rank 2 × slower throughout;
- ``graded``: ranks 4 ×, 2 ×, 1 ×, 1 × slower (on 4 ranks; fewer ranks take the first ones);
- ``spike``: the last rank 3 × slower for ``spike_len`` steps from ``spike_at``, then normal;
- ``noisy-neighbour``: from ``spike_at`` on, a CPU-bound process (a Python busy loop,
  :class:`plait.runtime.cgroup.NoisyNeighbour`) runs on the last rank's host, inside its CPU
  budget, as another tenant's job would: nothing is emulated, the rank just gets less of its
  host. It needs hosts with a budget (``--hosts N --host-cpu CORES``). The runs are
  interleaved, so the neighbour runs only during its own run's steps: it is resumed
  (SIGCONT) before each such step and held (SIGSTOP) after it, and killed at the end. For the
  ideal its factor is 2, the fair share a single-threaded rank gets beside one busy loop; the
  record carries what it really took (``kernel.neighbour_cpu_s``, per step);
- a scenario file (``--scenario-file PATH``, :mod:`plait.runtime.scenario_file`): per-rank
  slowdowns that change with the step (gradual drift, jitter), run as one more scenario
  named by the file; every record of it carries the file (``scenario_file``).

On an emulated cluster with equal CPU budgets (``--hosts 4 --host-cpu 0.5``: each host a
real half core from the kernel, 4 × 0.5 = the 2 cores of the machine, so four ranks do not
fight over cores) the factors are, by default (``--slow-by sleep``), the sleep emulation on
top of the budgets. On a budgeted host the compute is timed by the wall clock
(``runtime.straggler.compute_clock``), so a rank ``F`` × slower sleeps ``F − 1`` × its
throttled compute, and the speed monitor counts that sleep once (it used to add it to a wall
time that already held it, and read the 4 × and 2 × ranks at 1/7 and 1/3: the 0.14 and 0.32
one graded run measured).

``--slow-by kernel`` makes the factors with the kernel instead: one rank per host
(``--hosts N``, N ranks), each host's ``--host-cpu`` budget (1 core where not given) its
full speed. Before every step, each rank sets its own host's cgroup cpu quota to the budget
÷ ``F_r`` of the run about to step (the ``none`` reference and the ranks at factor 1 get the
whole budget; :func:`plait.runtime.straggler.host_throttle`); then the barrier starts the
step on every rank. The slow host is then slow at everything it runs, not only where the
sleep emulation sleeps, and the monitor, timing by the wall clock on a budgeted host, sees it
as it is (by thread CPU time it would see nothing: waiting for the quota is not CPU time).
The budget is whole again after the steps; the cgroups go with the cluster. Each record
carries, per rank, the budget the kernel held each step to (read back from the cgroup), the
step's CPU time over its wall time and the periods the kernel throttled.

Per run: every step's time (the slowest rank's: forward, backward, update and
the balancer's own step, migrations included), the losses, the balancer's
decisions, and the held-out loss and next-token accuracy at the end.

The ideal: with per-step slowdowns ``F_r``, the capacity-proportional step
spreads the tensor-parallel compute ``c`` (what the emulation slows: the
``none`` run's measured compute per rank per step) in proportion to the speeds
``1/F_r``, so ``t_ideal = t_none − c + c · p / Σ_r (1/F_r)``: total work over
summed speeds, plus everything the emulation does not slow (communication,
attention, the replicated embedding and head, the optimizer). Each run's
``t_ideal_s`` is the median of that over its timed steps. Under ``--slow-by kernel``
everything a rank runs is slowed: a rank slowed ``F`` × is slow at its replicated work
too, and the fast ranks make up for it by taking more of the sharded work, which gives the
same formula with ``c`` the wall time of all the rank's CPU work on its whole budget: the
``none`` run's CPU time per rank per step (all of its threads, ``cpu_s_per_step``, the mean
over its timed steps: the first steps' allocations land on the run that steps first) over
the hosts' mean budget in cores, at most ``t_none``. That holds where the budget binds; on
a machine that gives a host less than its budget the kernel's ``F`` is not reached either.
A noisy neighbour, too, slows all the rank's work, so its ideal takes ``c`` the same way.

That capacity-proportional step (``t_capacity_s``) assumes a fast rank can take over any of
a slow one's work. Where the kernel or a neighbour slows all of it, the slow rank's
unmovable work (its replicated layers, the optimizer, its share of every collective's CPU,
Python) stays on it whatever the plan: the step can be no shorter than the slowest rank's
unmovable CPU time, ``F`` × its time on the whole budget (``t_floor_s``; per rank, from the
``none`` run: its CPU time, all threads, less its thread's CPU time in the timed layers,
over its budget). The ideal is the longer of the two, step by step. In two kernel-made
graded runs (4 hosts of half a core, 4 ×, 2 ×, 1 ×, 1 ×) a rank's unmovable CPU was 55-62 ms
of its 91-99 ms a step, so the 4 × host alone took 448 and 479 ms where the capacity step was
370 and 381 ms; migrated down to 1 head and 1 column, it spent 53-60 ms of CPU a step (the
median), its whole budget.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
import torch.distributed as dist

from ..runtime.fields import help_meta as _h
from ..balance import Balancer, PolicyConfig
from ..balance.policy import POLICIES
from ..data import CharCorpus
from ..runtime import rank_context
from ..ops.agree import attempt, gather_checked
from ..runtime.cgroup import NoisyNeighbour, cpu_budget, cpu_throttled
from ..runtime.scenario_file import Scenario, load_scenario
from ..runtime.straggler import SLOW_BY, SlowCurve, SlowSpec, Straggler, host_throttle
from ..runtime.timing import agreed_max, balanced_round
from ..train import TrainConfig, build_gpt, evaluate_gpt, gpt_loss, lr_at

__all__ = ["HeteroBenchConfig", "SCENARIOS", "DEFAULT_SCENARIOS", "ideal_step", "QUICK_HETERO",
           "scenario_specs", "run_hetero", "bench_hetero", "summarize_hetero", "plot_hetero", "train_balanced", "BalancedRun",
           "ratio_cell", "paired_gaps", "PAIRS"]

SCENARIOS = ("none", "straggler-2x", "graded", "spike", "noisy-neighbour")
# what runs without --scenarios: noisy-neighbour needs one rank per host, so it is asked for
DEFAULT_SCENARIOS = SCENARIOS[:4]
QUICK_HETERO = dict(steps=50, seeds=1)
# semi beside the policy that alone fits the scenario best: migrate what persists, resize a
# spike; and beside even with no straggler, where it makes no decision and computes the same:
# the gap two runs of the same work show, the noise floor of every other gap
PAIRS = (("none", "even"), ("straggler-2x", "migrate"), ("spike", "resize"),
         ("noisy-neighbour", "migrate"))



@dataclass(frozen=True, kw_only=True)
class HeteroBenchConfig:
    """Scenarios, policies, the model and the steps; each field's help is its CLI flag's help."""

    scenarios: tuple[str, ...] = field(default=DEFAULT_SCENARIOS, metadata=_h(
        "what to run: " + ", ".join(SCENARIOS) + "; default: " + ",".join(DEFAULT_SCENARIOS)
        + " (none: the reference every ratio needs; noisy-neighbour: one rank per host;"
        " may be empty with --scenario-file)"))
    scenario_file: str | None = field(default=None, metadata=_h(
        "a JSON scenario file (per-rank slowdowns by step: drift, jitter; see "
        "examples/scenarios/), run after --scenarios under its own name"))
    policies: tuple[str, ...] = field(default=POLICIES, metadata=_h(
        "balancing policies: " + ", ".join(POLICIES)))
    steps: int = field(default=100, metadata=_h("training steps per run"))
    warmup: int = field(default=5, metadata=_h("first steps left out of the median step time"))
    seeds: int = field(default=3, metadata=_h("seeds per run (held-out figures are their mean)"))
    spike_at: int = field(default=20, metadata=_h(
        "spike, noisy-neighbour: the step the slowdown (the neighbour) starts"))
    spike_len: int = field(default=8, metadata=_h("spike: how many steps it lasts"))
    n_layer: int = field(default=2, metadata=_h("transformer blocks"))
    n_head: int = field(default=16, metadata=_h("attention heads (the unit heads migrate in)"))
    n_embd: int = field(default=256, metadata=_h("model width"))
    seq_len: int = field(default=64, metadata=_h("characters per sequence"))
    batch_size: int = field(default=16, metadata=_h("sequences per step"))
    lr: float = field(default=3e-3, metadata=_h("peak learning rate of AdamW"))
    overlap: bool = field(default=True, metadata=_h("fused operators (--no-overlap: plain)"))
    every: int = field(default=2, metadata=_h("steps between the speed monitor's exchanges"))
    refresh: int = field(default=200, metadata=_h(
        "steps between ZERO-resizing's priority refreshes (a resized dim then chooses its "
        "skipped features anew, so they return)"))
    confirm_steps: int = field(default=3, metadata=_h(
        "act on an imbalance once it has lasted this many steps (3: two of the monitor's "
        "readings, so one noisy reading of a shared machine passes)"))
    spike_steps: int = field(default=12, metadata=_h(
        "semi: an imbalance lasting this many steps persists and is migrated (shorter ones "
        "are resized, then undone)"))
    eval_batches: int = field(default=8, metadata=_h("held-out batches at the end"))
    slow_by: str = field(default="sleep", metadata=_h(
        "how a rank F × slower is made: sleep (F − 1 × each compute piece's time) or kernel "
        "(its host's CPU budget ÷ F, a cgroup cpu quota set before every step; needs --hosts "
        "with one rank per host; --host-cpu is the full budget, default 1 core)"))
    extra: dict = field(default_factory=dict)  # where it ran (filled by the launcher)
    scenario: Scenario | None = field(default=None, init=False, repr=False, compare=False)
    """The scenario file, read and checked (None without one)."""

    def __post_init__(self) -> None:
        if self.slow_by not in SLOW_BY:
            raise ValueError(f"--slow-by {self.slow_by!r}: choose from {list(SLOW_BY)}")
        for name, known in (("scenarios", SCENARIOS), ("policies", POLICIES)):
            values = getattr(self, name)
            bad = [v for v in values if v not in known]
            if bad or not (values or name == "scenarios" and self.scenario_file):
                raise ValueError(f"--{name} {list(values)}: choose from {list(known)}")
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(f"--{name} names {', '.join(twice)} more than once")
        try:
            scenario = load_scenario(self.scenario_file) if self.scenario_file else None
        except OSError as err:  # a path the user gave: their mistake, refused as one
            raise ValueError(f"--scenario-file {self.scenario_file}: {err.strerror or err}") \
                from None
        if scenario is not None and scenario.name in SCENARIOS:
            raise ValueError(f"{self.scenario_file}: name {scenario.name!r} is a built-in "
                             f"scenario's; choose another")
        object.__setattr__(self, "scenario", scenario)
        for name in ("steps", "seeds", "spike_len", "n_layer", "n_head", "n_embd", "seq_len",
                     "batch_size", "every", "refresh", "spike_steps", "confirm_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.spike_at < 0:
            raise ValueError(f"--spike-at must be a step (≥ 0), got {self.spike_at}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--steps {self.steps} leaves no timed step after the "
                             f"{self.warmup} warm-up steps (--warmup): need --warmup in "
                             f"[0, --steps)")
        if self.neighbour and self.spike_at >= self.steps:
            raise ValueError(f"the noisy neighbour (from step {self.spike_at}, --spike-at) "
                             f"does not start within --steps {self.steps}")
        if "spike" in self.scenarios and self.spike_at + self.spike_len > self.steps:
            raise ValueError(f"the spike (steps {self.spike_at}–{self.spike_at + self.spike_len})"
                             f" does not end within --steps {self.steps}")
        self.train_config(0).gpt_config(97)  # n_embd a multiple of n_head

    def train_config(self, seed: int) -> TrainConfig:
        return TrainConfig(model="gpt", steps=self.steps, batch_size=self.batch_size, lr=self.lr,
                           seq_len=self.seq_len, n_layer=self.n_layer, n_head=self.n_head,
                           n_embd=self.n_embd, overlap=self.overlap, seed=seed,
                           eval_batches=self.eval_batches)

    def check_world(self, world: int) -> None:
        if world < 2:
            raise ValueError("bench hetero needs at least 2 ranks (one of them slowed)")
        if self.n_head < world:
            raise ValueError(f"--n-head {self.n_head} gives some of the {world} ranks no head")
        if self.scenario is not None:
            self.scenario.specs(world, self.steps)  # refuses a rank the group does not have

    def check_placement(self, ranks: int, hosts: int) -> bool:
        """Whether these runs need one rank per host (``--slow-by kernel``, the noisy
        neighbour); a ValueError saying so if ``hosts`` (0: loopback) does not give it."""
        needs = [why for why, needed in (
            ("--slow-by kernel sets each host's CPU budget from its rank's factor",
             self.slow_by == "kernel"),
            ("the noisy-neighbour scenario takes the last rank's host's cores",
             self.neighbour)) if needed]
        if needs and hosts != ranks:
            given = f"got --hosts {hosts}" if hosts else "got no --hosts (loopback)"
            raise ValueError(f"{needs[0]}, so it needs one rank per host: --hosts {ranks} for "
                             f"{ranks} ranks, {given}")
        return bool(needs)

    @property
    def neighbour(self) -> bool:
        """Whether a noisy-neighbour scenario runs (the same on every rank)."""
        return "noisy-neighbour" in self.scenarios

    def scenario_names(self) -> tuple[str, ...]:
        """``scenarios``, then the scenario file's name."""
        return self.scenarios + ((self.scenario.name,) if self.scenario else ())

    def runs(self) -> list[tuple[int, str, str]]:
        """(seed, scenario, policy) in the order they run; ``none`` runs only ``even`` and
        ``semi`` (the reference, and whether the default policy leaves a balanced group be)."""
        out = []
        for seed in range(self.seeds):
            for scenario in self.scenario_names():
                for policy in self.policies:
                    if scenario == "none" and policy not in ("even", "semi"):
                        continue
                    out.append((seed, scenario, policy))
        if "none" in self.scenarios and "even" not in self.policies:
            out = [(s, "none", "even") for s in range(self.seeds)] + out
        return out


def scenario_specs(scenario: str, world: int,
                   cfg: HeteroBenchConfig) -> list[SlowSpec | SlowCurve]:
    """The straggler specs of a scenario on ``world`` ranks."""
    last = world - 1
    if cfg.scenario is not None and scenario == cfg.scenario.name:
        return cfg.scenario.specs(world, cfg.steps)
    if scenario == "none":
        return []
    if scenario == "straggler-2x":
        return [SlowSpec(rank=last, factor=2.0)]
    if scenario == "graded":
        return [SlowSpec(rank=r, factor=f) for r, f in enumerate((4.0, 2.0)[:max(1, world - 1)])]
    if scenario == "spike":
        return [SlowSpec(rank=last, factor=3.0, from_step=cfg.spike_at,
                         until_step=cfg.spike_at + cfg.spike_len)]
    if scenario == "noisy-neighbour":
        return [Neighbour(rank=last, from_step=cfg.spike_at)]
    raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")


@dataclass(frozen=True)
class Neighbour:
    """``noisy-neighbour``: a busy loop on rank ``rank``'s host from step ``from_step`` on.
    Not emulated (the :class:`Straggler` skips it); ``factor_at`` is its nominal factor for
    the ideal, 2: the fair share of a single-threaded rank beside one busy loop."""

    rank: int
    from_step: int = 0

    def active(self, step: int) -> bool:
        return step >= self.from_step

    def factor_at(self, step: int) -> float:
        return 2.0 if self.active(step) else 1.0


def factors_at(specs: list[SlowSpec | SlowCurve | Neighbour], world: int,
               step: int) -> list[float]:
    factors = [1.0] * world
    for spec in specs:
        factors[spec.rank] *= spec.factor_at(step)
    return factors


class BalancedRun:
    """One training run under a balancing policy, a step at a time, so that several runs
    can be interleaved step by step (``plait demo``) and load drift hits them alike. Each
    run carries its own straggler emulation, active only while it steps; with ``throttle``
    (``Straggler``'s: the kernel makes the slowdown) it sets this rank's host's CPU budget
    for each of its steps before the step starts. ``noisy``: this host's paused
    :class:`~plait.runtime.cgroup.NoisyNeighbour`, resumed for each of this run's steps
    that a :class:`Neighbour` in ``specs`` on this rank covers, held again after it.
    ``accounting`` (the same on every rank): record the kernel's figures of this host's
    cgroup per step (always with ``throttle``)."""

    def __init__(self, cfg: TrainConfig, policy: PolicyConfig, specs: list,
                 corpus: CharCorpus, *, every: int = 2, refresh: int = 200, throttle=None,
                 noisy=None, accounting: bool = False):
        self.cfg, self.corpus = cfg, corpus
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.straggler = Straggler([s for s in specs if not isinstance(s, Neighbour)],
                                   self.rank, throttle=throttle)
        self.neighbour = next((s for s in specs if isinstance(s, Neighbour)
                               and s.rank == self.rank), None)
        if self.neighbour is not None and noisy is None:
            raise ValueError("a noisy-neighbour run needs this host's neighbour (noisy=)")
        self.noisy = noisy
        accounting = accounting or throttle is not None
        self.cgroup = rank_context().host.cgroup if accounting else None
        self.model = build_gpt(cfg, vocab_size=corpus.vocab_size)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.balancer = Balancer(self.model, self.optimizer, None, policy, every=every,
                                 refresh=refresh)
        self.batches = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
        self.times: list[float] = []  # this rank's, per step (finish takes the slowest)
        self.cpu: list[float] = []  # this process's CPU time per step, all its threads
        self.movable_cpu: list[float] = []  # its thread CPU time in the timed layers, per step
        self.held: list[float] = []  # kernel: the budget the kernel held each step to (cores)
        self.throttled: list[int] = []  # kernel: periods the kernel throttled in each step
        self.neighbour_cpu: list[float] = []  # CPU seconds this host's neighbour took per step
        self.losses: list[float] = []

    def _slowed(self, fn):
        ctx = rank_context()
        ctx.straggler = self.straggler
        try:
            return fn()
        finally:
            ctx.straggler = Straggler([], self.rank)

    def step(self, step: int, *, barrier: bool = False) -> None:
        """One training step (every rank); ``barrier``: start it together, so its time is
        its own and not the wait for another run's step on a slower rank."""
        batch = next(self.batches)
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(step, self.cfg.steps, self.cfg.lr)
        self.straggler.set_step(step)  # kernel: this step's budget, before anyone starts it
        busy = self.neighbour is not None and self.neighbour.active(step)
        if busy:  # on this host from before the step starts until after it ends
            self.noisy.resume()
        try:
            self._step(step, batch, barrier)
        finally:
            if busy:
                self.noisy.pause()

    def _step(self, step: int, batch, barrier: bool) -> None:
        if barrier:
            dist.barrier()

        def run():
            if self.cgroup is not None:
                self.held.append(cpu_budget(self.cgroup))
                throttled = cpu_throttled(self.cgroup)
            # on the neighbour's host, every run's every step: held, it takes nothing
            neighbour = self.noisy.cpu_s() if self.noisy is not None else 0.0
            start, cpu = time.perf_counter(), time.process_time()
            movable = self.balancer.monitor.region_cpu_s
            loss = gpt_loss(self.model, batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.balancer.step(step)
            self.times.append(time.perf_counter() - start)
            self.cpu.append(time.process_time() - cpu)
            self.movable_cpu.append(self.balancer.monitor.region_cpu_s - movable)
            if self.cgroup is not None:
                self.throttled.append(cpu_throttled(self.cgroup) - throttled)
            self.neighbour_cpu.append(self.noisy.cpu_s() - neighbour
                                      if self.noisy is not None else 0.0)
            self.losses.append(loss.item())
        self._slowed(run)

    def finish(self) -> dict:
        """Evaluate and gather the figures (collectives: every rank, runs in the same order).
        Per-step times are the slowest rank's; the tensor-parallel compute per step is the
        mean rank's."""
        final = self._slowed(lambda: evaluate_gpt(self.model, self.corpus, self.cfg))
        steps = max(len(self.times), 1)
        compute = torch.tensor([self.balancer.monitor.compute_s / steps] + self.cpu,
                               dtype=torch.float64)
        dist.all_reduce(compute)
        compute /= self.world  # the mean rank's
        out = {"losses": self.losses, "eval": final,
               "compute_s_per_step": float(compute[0]),
               "cpu_s_steps": compute[1:].tolist(),
               "speeds": list(self.balancer.monitor.speeds()),
               "monitor_s": self.balancer.monitor.overhead_s,
               "decisions": [d.to_json() for d in self.balancer.log],
               "final_state": self.balancer.state(), "world": self.world}
        if self.cgroup is not None:  # per rank, per step: what the kernel did
            ranks = [None] * self.world
            dist.all_gather_object(ranks, (self.held, self.throttled,
                                           [c / max(t, 1e-12) for c, t in zip(self.cpu,
                                                                               self.times)],
                                           self.neighbour_cpu, self.cpu, self.movable_cpu))
            out["kernel"] = {"held_cores": [r[0] for r in ranks],
                             "throttled_periods": [r[1] for r in ranks],
                             "cpu_share": [r[2] for r in ranks],
                             "neighbour_cpu_s": [r[3] for r in ranks],
                             "cpu_s": [r[4] for r in ranks],
                             "movable_cpu_s": [r[5] for r in ranks]}
        out["times"] = agreed_max(self.times)
        return out


def train_balanced(cfg: TrainConfig, policy: PolicyConfig, specs: list[SlowSpec], corpus: CharCorpus, *,
                   every: int = 2, refresh: int = 200, on_step=None) -> dict:
    """One run on this rank: build, train ``cfg.steps`` steps under ``policy`` with ``specs``
    slowing ranks, evaluate (see :class:`BalancedRun`)."""
    run = BalancedRun(cfg, policy, specs, corpus, every=every, refresh=refresh)
    for step in range(cfg.steps):
        run.step(step)
        if on_step is not None:
            on_step(step)
    return run.finish()


def run_hetero(cfg: HeteroBenchConfig) -> list[dict]:
    """What each rank runs: every (seed, scenario, policy); rank 0's records are the result.

    A seed's runs are interleaved step by step, in the balanced orders of
    :func:`plait.runtime.timing.balanced_round` (each run in each place and after each
    other run equally often), every step started together: load on a shared machine that
    drifts lands on every policy of the seed alike, and the ratio to that seed's ``none``
    run compares runs that saw the same machine."""
    world = dist.get_world_size()
    torch.set_num_threads(1)
    corpus = CharCorpus.load()
    report = rank_context().report
    runs = cfg.runs()
    noisy = None
    setup, problem = attempt(lambda: _host_setup(cfg, world))
    throttle, neighbour = setup or (None, None)
    try:
        # a host without what its runs need stops every rank, not only its own
        gather_checked("bench hetero", None, problem, [], 0)
        if neighbour is not None:  # started now, held until its run's steps
            noisy = NoisyNeighbour(rank_context().host.cgroup).start()
            noisy.pause()
        return _run_seeds(cfg, world, corpus, report, runs, throttle, noisy)
    finally:
        if noisy is not None:
            noisy.stop()
        if throttle is not None:
            throttle(1.0)  # the host's whole budget again


def _host_setup(cfg: HeteroBenchConfig, world: int):
    """This rank's kernel throttle (``--slow-by kernel``, else None) and whether a
    noisy-neighbour run puts a neighbour on its host; refused where its host lacks a CPU
    budget that either needs."""
    throttle = _kernel_throttle() if cfg.slow_by == "kernel" else None
    rank = dist.get_rank()
    mine = [s for sc in cfg.scenario_names() for s in scenario_specs(sc, world, cfg)
            if isinstance(s, Neighbour) and s.rank == rank]
    if cfg.neighbour and rank_context().host.cgroup is None:
        raise ValueError("the noisy-neighbour scenario needs hosts with a CPU budget (--hosts N"
                         " --host-cpu CORES, one rank per host): the neighbour takes its "
                         f"host's cores; rank {rank}'s host has none")
    return throttle, (mine[0] if mine else None)


def _kernel_throttle():
    """This rank's host's throttle for ``--slow-by kernel``: its cgroup, its full budget read
    back from the kernel."""
    host = rank_context().host
    if host.cgroup is None:
        raise ValueError("--slow-by kernel needs hosts with a CPU budget (--hosts N "
                         "--host-cpu CORES, one rank per host); this rank's host has none")
    budget = cpu_budget(host.cgroup)
    if budget is None:
        raise ValueError(f"--slow-by kernel: host {host.index}'s cgroup {host.cgroup} has no "
                         "CPU limit to scale")
    return host_throttle(host.cgroup, budget)


def _run_seeds(cfg: HeteroBenchConfig, world: int, corpus, report, runs, throttle,
               noisy) -> list[dict]:
    out, done = [], 0
    for seed in sorted({s for s, _, _ in runs}):
        mine = [(sc, pol) for s, sc, pol in runs if s == seed]
        live = []
        for scenario, policy in mine:
            specs = scenario_specs(scenario, world, cfg)
            policy_cfg = PolicyConfig(name=policy, spike_steps=cfg.spike_steps,
                                      confirm_steps=cfg.confirm_steps)
            live.append((scenario, policy, specs,
                         BalancedRun(cfg.train_config(seed), policy_cfg, specs, corpus,
                                     every=cfg.every, refresh=cfg.refresh, throttle=throttle,
                                     noisy=noisy, accounting=cfg.neighbour)))
        for step in range(cfg.steps):
            for *_, run in balanced_round(live, step):
                run.step(step, barrier=True)
        if throttle is not None:
            throttle(1.0)  # evaluation (not timed) on the whole budget
        for scenario, policy, specs, run in live:
            out.append(_record(cfg, seed, scenario, policy, specs, run.finish(), world))
            done += 1
            if dist.get_rank() == 0:
                report({"run": done, "of": len(runs), "scenario": scenario, "policy": policy,
                        "seed": seed, "t_step_s": out[-1]["t_step_s"]})
    return with_ideal(out, cfg.warmup)


def _record(cfg: HeteroBenchConfig, seed: int, scenario: str, policy: str, specs, result: dict,
            world: int) -> dict:
    times = result.pop("times")
    timed = times[cfg.warmup:]
    return {"seed": seed, "scenario": scenario, "policy": policy, "world_size": world,
            "t_step_s": statistics.median(timed), "step_times_s": times,
            "losses": result["losses"], "heldout_loss": result["eval"]["heldout_loss"],
            "heldout_acc": result["eval"]["heldout_accuracy"],
            "compute_s_per_step": result["compute_s_per_step"],
            "cpu_s_per_step": statistics.fmean(result["cpu_s_steps"][cfg.warmup:]),
            "speeds": result["speeds"],
            # how the factors were made: a neighbour's are its own, nothing slept or throttled
            "slow_by": "neighbour" if scenario == "noisy-neighbour" else cfg.slow_by,
            "kernel": result.get("kernel"),
            "monitor_overhead": result["monitor_s"] / max(sum(times), 1e-12),
            "decisions": result["decisions"], "final_state": result["final_state"],
            "factors": [factors_at(specs, world, s) for s in range(cfg.steps)],
            "link": cfg.extra.get("link", "loopback"), "hosts": cfg.extra.get("hosts", 0),
            "host_cpu": cfg.extra.get("host_cpu"),
            "scenario_file": (cfg.scenario.to_json() if cfg.scenario is not None
                              and scenario == cfg.scenario.name else None),
            "model": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd,
                      "seq_len": cfg.seq_len, "batch_size": cfg.batch_size},
            "overlap": cfg.overlap, "interleaved": True}


def ideal_step(t_none: float, compute: float, factors) -> float:
    """The capacity-proportional step under per-rank slowdowns ``factors``: the
    tensor-parallel ``compute`` spread in proportion to the speeds ``1/F_r``, the rest as in
    the no-straggler step ``t_none``."""
    return t_none - compute + compute * len(factors) / sum(1.0 / f for f in factors)


def with_ideal(records: list[dict], warmup: int) -> list[dict]:
    """Add ``t_no_straggler_s``, ``t_ideal_s`` and ``ratio_to_ideal`` from each seed's
    ``none``/``even`` run (see the module docstring: ``c`` is the compute the slowdown
    stretches, the rank's whole CPU time under ``--slow-by kernel``)."""
    reference = {r["seed"]: r for r in records if r["scenario"] == "none" and r["policy"] == "even"}
    for r in records:
        ref = reference.get(r["seed"])
        if ref is None:
            continue
        t_none, c = ref["t_step_s"], _stretched(ref, r)
        capacity = [ideal_step(t_none, c, f) for f in r["factors"]][warmup:]
        unmovable = _unmovable(ref, r, warmup)
        floor = ([floor_step(unmovable, f) for f in r["factors"]][warmup:]
                 if unmovable is not None else [0.0] * len(capacity))
        r["t_no_straggler_s"] = t_none
        r["t_capacity_s"] = statistics.median(capacity)
        if unmovable is not None:
            r["t_floor_s"] = statistics.median(floor)
        r["t_ideal_s"] = statistics.median(max(a, b) for a, b in zip(capacity, floor))
        r["ratio_to_ideal"] = r["t_step_s"] / r["t_ideal_s"]
        if len(ref["losses"]) == len(r["losses"]):
            r["max_loss_diff_vs_none"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    return records


def floor_step(unmovable: Sequence[float], factors) -> float:
    """The step no plan can beat under per-rank slowdowns ``factors``: the slowest rank's
    ``unmovable`` work (per rank, in seconds at its whole budget), ``F`` × longer."""
    return max(u * f for u, f in zip(unmovable, factors))


def _unmovable(ref: dict, record: dict, warmup: int) -> list[float] | None:
    """Per rank, the seconds its unmovable CPU work takes on its whole budget, from its
    seed's ``none``/``even`` run ``ref``: the median over the timed steps of all its threads'
    CPU time less its thread's CPU time in the timed layers, over the budget. Only where
    the kernel (or a neighbour) slows all of a rank's work, and the run recorded both
    (None otherwise: the floor does not bind where only the layers are slowed)."""
    kernel = ref.get("kernel") or {}
    if not (record.get("slow_by") == "kernel" or record["scenario"] == "noisy-neighbour") \
            or "movable_cpu_s" not in kernel:
        return None
    return [statistics.median(c - m for c, m in zip(cpu[warmup:], movable[warmup:]))
            / held[0] for cpu, movable, held in zip(kernel["cpu_s"], kernel["movable_cpu_s"],
                                                    kernel["held_cores"])]


def _stretched(ref: dict, record: dict) -> float:
    """``c`` of the ideal (module docstring) for ``record``, from its seed's ``none``/``even``
    run ``ref``: the kernel, or a neighbour, slows all the rank's CPU work, so all of it at its
    whole budget's pace (at most the whole step); the sleep emulation, the timed compute."""
    if record.get("slow_by") == "kernel" or record["scenario"] == "noisy-neighbour":
        budget = statistics.fmean(held[0] for held in ref["kernel"]["held_cores"])
        return min(ref["t_step_s"], ref["cpu_s_per_step"] / budget)
    return ref["compute_s_per_step"]


def neighbour_factors(records: list[dict], cfg: HeteroBenchConfig) -> list[float]:
    """Per seed, the slowdown the noisy neighbour made as the ``even`` run measured it beside
    the ``none`` run, step by step (interleaved, so under the same load): the median over the
    timed steps it ran of ``1 + (t_even − t_none) / c``; beside the nominal 2 of the ideal."""
    by = {(r["seed"], r["scenario"], r["policy"]): r for r in records}
    out = []
    for seed in sorted({r["seed"] for r in records}):
        ref, even = by.get((seed, "none", "even")), by.get((seed, "noisy-neighbour", "even"))
        if ref is None or even is None:
            continue
        c = _stretched(ref, even)
        start = max(cfg.warmup, cfg.spike_at)
        pairs = list(zip(even["step_times_s"], ref["step_times_s"]))[start:]
        if pairs and c > 0:
            out.append(1.0 + statistics.median(a - b for a, b in pairs) / c)
    return out


def mean_over_seeds(records: list[dict]) -> list[dict]:
    """One row per (scenario, policy): medians of step times, means and spreads of held-out."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["scenario"], r["policy"]), []).append(r)
    rows = []
    for (scenario, policy), rs in groups.items():
        acc = [r["heldout_acc"] for r in rs]
        row = {"scenario": scenario, "policy": policy, "seeds": len(rs),
               "t_step_s": statistics.median(r["t_step_s"] for r in rs),
               "heldout_loss": statistics.mean(r["heldout_loss"] for r in rs),
               "heldout_acc": statistics.mean(acc), "heldout_acc_spread": max(acc) - min(acc),
               "decisions": sum(len(r["decisions"]) for r in rs) / len(rs)}
        for key in ("t_ideal_s", "t_capacity_s", "t_floor_s", "t_no_straggler_s",
                    "ratio_to_ideal", "max_loss_diff_vs_none"):
            values = [r[key] for r in rs if key in r]
            if values:
                row[key] = statistics.median(values) if key != "max_loss_diff_vs_none" else max(values)
        ratios = [r["ratio_to_ideal"] for r in sorted(rs, key=lambda r: r["seed"])
                  if "ratio_to_ideal" in r]
        if ratios:  # every seed's, in seed order, and their range
            row["ratio_per_seed"] = ratios
            row["ratio_spread"] = max(ratios) - min(ratios)
        row["decisions_per_seed"] = [len(r["decisions"])
                                     for r in sorted(rs, key=lambda r: r["seed"])]
        rows.append(row)
    return rows


def ratio_cell(row: dict) -> str:
    """The table's "× ideal": the median over seeds, then every seed's in seed order."""
    if "ratio_to_ideal" not in row:
        return "–"
    seeds = row.get("ratio_per_seed", [])
    each = " ".join(f"{r:.2f}" for r in seeds) if len(seeds) > 1 else ""
    return f"{row['ratio_to_ideal']:.2f}" + (f" ({each})" if each else "")


def spike_reaction(record: dict, spike_at: int, spike_len: int) -> dict:
    """Steps from the spike's start to the first decision, and from its end to the even plan
    (the last ``undo`` or migrate-back at or after the end)."""
    decisions = record["decisions"]
    react = [d["step"] for d in decisions if d["step"] >= spike_at]
    end = spike_at + spike_len
    back = [d["step"] for d in decisions if d["step"] >= end and d["kind"] in ("undo", "migrate")]
    balanced = record["final_state"]
    even = all(len(set(v["sizes"])) == 1 and v["keep"] == 1.0 for v in balanced.values())
    return {"react_steps": (react[0] - spike_at + 1) if react else None,
            "return_steps": (back[-1] - end + 1) if back and even else (0 if not decisions else None)}


def summarize_hetero(records: list[dict], cfg: HeteroBenchConfig) -> dict:
    rows = {(r["scenario"], r["policy"]): r for r in mean_over_seeds(records)}
    out: dict = {}
    for policy in ("even", "semi"):
        row = rows.get(("straggler-2x", policy))
        if row and "ratio_to_ideal" in row:
            out[f"straggler-2x_{policy}_ratio_to_ideal"] = row["ratio_to_ideal"]
    row = rows.get(("straggler-2x", "migrate"))
    if row and "max_loss_diff_vs_none" in row:
        out["migrate_max_loss_diff_vs_none"] = row["max_loss_diff_vs_none"]
    base = rows.get(("none", "even"))
    for policy in ("resize", "semi"):
        row = rows.get(("straggler-2x", policy))
        if row and base:
            out[f"{policy}_acc_loss_pp"] = 100 * (base["heldout_acc"] - row["heldout_acc"])
    spikes = [spike_reaction(r, cfg.spike_at, cfg.spike_len) for r in records
              if r["scenario"] == "spike" and r["policy"] == "semi"]
    if spikes:
        out["spike_semi_react_steps"] = [s["react_steps"] for s in spikes]
        out["spike_semi_return_steps"] = [s["return_steps"] for s in spikes]
    out.update(_targets(rows, base))
    out.update(paired_gaps(records, cfg.warmup))
    factors = neighbour_factors(records, cfg)
    if factors:
        out["noisy-neighbour_even_factor_per_seed"] = factors
    out["max_monitor_overhead"] = max(r["monitor_overhead"] for r in records)
    return out


def _targets(rows: dict, base: dict | None) -> dict:
    """Per seed, what issue 22 asks of semi: its ratio and its decisions in every scenario
    (none and a jitter file: no decision), the gap to the policy of :data:`PAIRS`;
    and per scenario and policy, held-out accuracy below the ``none`` run (pp, the mean)."""
    out: dict = {}
    for scenario, other in PAIRS:
        semi, alone = rows.get((scenario, "semi")), rows.get((scenario, other))
        if semi and "ratio_per_seed" in semi:
            out[f"{scenario}_semi_ratio_per_seed"] = semi["ratio_per_seed"]
            if alone and "ratio_per_seed" in alone:
                out[f"{scenario}_semi_minus_{other}_per_seed"] = [
                    a - b for a, b in zip(semi["ratio_per_seed"], alone["ratio_per_seed"])]
    for (scenario, policy), row in rows.items():  # every scenario's semi: drift, jitter, …
        if policy == "semi":
            out[f"{scenario}_semi_decisions_per_seed"] = row["decisions_per_seed"]
            if "ratio_per_seed" in row:
                out[f"{scenario}_semi_ratio_per_seed"] = row["ratio_per_seed"]
    if base:
        out["acc_loss_pp"] = {f"{sc}/{pol}": round(100 * (base["heldout_acc"] - r["heldout_acc"]),
                                                   3)
                              for (sc, pol), r in rows.items() if (sc, pol) != ("none", "even")}
    return out


def paired_gaps(records: list[dict], warmup: int) -> dict:
    """Per seed, semi's gap to the policy of :data:`PAIRS` (migrate on ``straggler-2x``,
    resize on ``spike``, even on ``none``: the noise floor), paired by step: the median over
    the timed steps of ``(t_semi − t_other) / t_ideal``. The runs of a seed are interleaved step by step, so step i of each ran under
    the same load; the gap of the two medians takes each run's own noise as well."""
    by = {(r["seed"], r["scenario"], r["policy"]): r for r in records}
    out: dict = {}
    for scenario, other in PAIRS:
        gaps = []
        for seed in sorted({r["seed"] for r in records}):
            semi, alone = by.get((seed, scenario, "semi")), by.get((seed, scenario, other))
            if semi is None or alone is None or "t_ideal_s" not in semi:
                continue
            pairs = list(zip(semi["step_times_s"], alone["step_times_s"]))[warmup:]
            gaps.append(statistics.median(a - b for a, b in pairs) / semi["t_ideal_s"])
        if gaps:
            out[f"{scenario}_semi_minus_{other}_paired_per_seed"] = gaps
    return out


def plot_hetero(records: list[dict], path: str, scenario: str | None = None) -> None:
    """Step time per step per policy, one panel per scenario (seed 0): the policies reacting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed0 = [r for r in records if r["seed"] == 0 and (scenario is None or r["scenario"] == scenario)]
    scenarios = list(dict.fromkeys(r["scenario"] for r in seed0))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 3.6), squeeze=False)
    for ax, name in zip(axes[0], scenarios):
        top = 0.0
        for r in (r for r in seed0 if r["scenario"] == name):
            ax.plot([t * 1e3 for t in r["step_times_s"]], label=r["policy"], lw=1.2)
            top = max([top] + [t * 1e3 for t in r["step_times_s"][1:]])
        if top:  # the first step (allocation, first touch) may run off the top
            ax.set_ylim(0, 1.1 * top)
        ideal = next((r.get("t_ideal_s") for r in seed0 if r["scenario"] == name), None)
        if ideal:
            ax.axhline(ideal * 1e3, color="k", ls=":", lw=1, label="ideal (median)")
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("step time (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_hetero(cfg: HeteroBenchConfig, *, ranks: int, hosts: int = 0,
                 link: str | None = "1gbit", timeout_s: float | None = None,
                 on_progress=None,
                 host_cpu: float | list[float] | None = None) -> tuple[list[dict], str]:
    """Every run on ``ranks`` ranks over ``hosts`` emulated hosts (0: loopback); ``host_cpu``
    as in :func:`plait.runtime.placement.run_placed`. ``--slow-by kernel`` needs one rank per
    host, and gives each host 1 core where no budget is given; so does the noisy-neighbour
    scenario (a neighbour on a host with two ranks would slow both)."""
    from ..runtime.placement import HOST_CPU_ENV, run_placed

    cfg = replace(cfg)
    cfg.check_world(ranks)
    if cfg.check_placement(ranks, hosts) and host_cpu is None \
            and not os.environ.get(HOST_CPU_ENV):
        host_cpu = 1.0
    records, where = run_placed(run_hetero, cfg, ranks=ranks, hosts=hosts, link=link,
                                timeout_s=timeout_s, on_progress=on_progress, host_cpu=host_cpu)
    if cfg.slow_by == "kernel":  # the budget above is the whole; a slowed host gets less
        where += "; --slow-by kernel: a host F × slower is held to its budget ÷ F each step"
    return records, where
