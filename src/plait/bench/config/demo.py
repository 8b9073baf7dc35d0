"""``plait demo``'s settings (``DemoConfig``), the ``--quick`` preset and the warm-up every
median leaves out."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...balance.policy import PolicyConfig
from ...runtime.fields import help_meta as _h
from ...training.config import TrainConfig

__all__ = ["DemoConfig", "QUICK_DEMO", "WARMUP_STEPS"]


WARMUP_STEPS = 3  # left out of every median: the first steps pay for allocation and calibration


# ``plait demo --quick``: about a minute on two cores, set-up included; the balancer still
# resizes, then migrates, and 12 steps after its warm-up give the medians. chunks=2 is what
# auto picks for these shapes on 1 Gbit/s links, and skips the calibration auto runs first
# (18-28 s of a busy 2-core machine: a third of the minute).
QUICK_DEMO = dict(steps=20, slow_from=5, spike_steps=8, n_layer=1, n_embd=256, n_head=8,
                  batch_size=8, chunks="2")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    steps: int = field(default=60, metadata=_h("training steps per run"))
    # --slow RANK:FACTOR@FROM sets these three (cli.demo); slow_rank None: the last rank
    slow_from: int = 15
    factor: float = 2.0
    slow_rank: int | None = None
    n_layer: int = field(default=2, metadata=_h("transformer blocks"))
    n_head: int = field(default=16, metadata=_h("attention heads"))
    n_embd: int = field(default=512, metadata=_h("model width"))
    seq_len: int = field(default=64, metadata=_h("characters per sequence"))
    batch_size: int = field(default=16, metadata=_h("sequences per step"))
    lr: float = field(default=3e-3, metadata=_h("peak learning rate of AdamW"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data order"))
    confirm_steps: int = field(default=3, metadata=_h(
        "act on an imbalance once it has lasted this many steps (3: two of the monitor's "
        "readings, so one noisy reading of a shared machine passes)"))
    chunks: str = field(default="auto", metadata=_h(
        "pieces per fused operator: auto (calibrated on the ranks once, at the first fused "
        "step: seconds) or a number"))
    spike_steps: int = field(default=12, metadata=_h(
        "semi: steps an imbalance must last to be migrated (before that: resized)"))
    out: str = field(default="reports/demo", metadata=_h("report folder"))
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < WARMUP_STEPS + 2:
            raise ValueError(f"--steps must be at least {WARMUP_STEPS + 2} (a {WARMUP_STEPS}-step "
                             f"warm-up, then steps before and after the straggler), got {self.steps}")
        if not 0 < self.slow_from < self.steps - WARMUP_STEPS:
            raise ValueError(f"--slow …@{self.slow_from}: the step the rank turns slow must be "
                             f"above 0 and leave steps after its {WARMUP_STEPS}-step warm-up in "
                             f"--steps {self.steps} (at most {self.steps - WARMUP_STEPS - 1})")
        if not self.factor > 1.0:
            raise ValueError(f"--slow RANK:{self.factor:g}: the factor must be above 1 (a slower "
                             "rank)")
        self.train_config(True).gpt_config(97)
        PolicyConfig(spike_steps=self.spike_steps, confirm_steps=self.confirm_steps)  # refuse early

    def slowed(self, world: int) -> int:
        """The rank that turns slow on ``world`` ranks."""
        return world - 1 if self.slow_rank is None else self.slow_rank

    def train_config(self, overlap: bool) -> TrainConfig:
        return TrainConfig(model="gpt", steps=self.steps, batch_size=self.batch_size, lr=self.lr,
                           seq_len=self.seq_len, n_layer=self.n_layer, n_head=self.n_head,
                           n_embd=self.n_embd, overlap=overlap, seed=self.seed, eval_batches=8,
                           chunks=self.chunks)
