"""``plait bench hetero``'s settings (``HeteroBenchConfig``): the scenarios, the policies, the
GPT and the balancer's settings, and the runs they make."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...balance.policy import POLICIES
from ...runtime.fields import help_meta as _h
from ...runtime.slow.scenario_file import Scenario, load_scenario
from ...runtime.slow.straggler import SLOW_BY
from ...training.config import TrainConfig
from ...runtime.slow.scenarios import DEFAULT_SCENARIOS, SCENARIOS

__all__ = ["HeteroBenchConfig", "QUICK_HETERO"]


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
