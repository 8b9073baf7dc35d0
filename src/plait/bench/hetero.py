"""``plait bench hetero``: tensor parallelism with a slow rank, under each balancing policy.

Every rank trains the same small GPT (plait TP, fused operators) from the same seed on the
same batches, once per (seed, scenario, policy), all in one launch, each run through the
training loop (:class:`plait.bench.balanced_run.BalancedRun`). A seed's runs are
interleaved step by step in balanced orders (each run in each place and after each other
run equally often, :func:`plait.runtime.timing.balanced_round`), every step started
together, so load on a shared machine that drifts lands on every policy of the seed alike.

The scenarios (:mod:`plait.bench.scenarios`) slow ranks by sleeping (``--slow-by sleep``,
``(F − 1)`` × each compute piece, on top of any host CPU budget) or by the kernel
(``--slow-by kernel``: one rank per host, and before every step each host's cgroup CPU
quota is set to its budget ÷ ``F``, so the slow host is slow at everything it runs; each
record then carries, per rank and step, the budget the kernel held, the CPU share and the
throttled periods). ``noisy-neighbour`` puts a real busy loop on the last rank's host,
resumed only for its own run's steps.

Per run: every step's time (the slowest rank's: forward, backward, update and the
balancer's own step, migrations included), the losses, the balancer's decisions, the
held-out loss and accuracy, and the ratio to the ideal step
(:mod:`plait.bench.hetero_ideal`); the summary and the plot: :mod:`plait.bench.hetero_summary`.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ..balance import PolicyConfig
from ..balance.policy import POLICIES
from ..ops.agree import attempt, gather_checked
from ..runtime import rank_context
from ..runtime.cgroup import NoisyNeighbour, cpu_budget
from ..runtime.fields import help_meta as _h
from ..runtime.scenario_file import Scenario, load_scenario
from ..runtime.straggler import SLOW_BY, host_throttle
from ..runtime.timing import balanced_round
from ..training.config import TrainConfig
from ..training.data import CharCorpus
from .balanced_run import BalancedRun
from .hetero_ideal import with_ideal
from .scenarios import DEFAULT_SCENARIOS, SCENARIOS, Neighbour, factors_at, scenario_specs

__all__ = ["HeteroBenchConfig", "QUICK_HETERO", "run_hetero", "bench_hetero"]

QUICK_HETERO = dict(steps=50, seeds=1)


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
                run.step(step)
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
