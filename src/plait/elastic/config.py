"""``plait elastic``'s settings (``ElasticConfig``): the hosts, the fault, the GPT and the
limits; what every worker is told (``worker_args``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.fields import help_meta as _h

__all__ = ["ElasticConfig"]


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    hosts: int = field(default=3, metadata=_h("emulated hosts, one torchrun agent each"))
    link: str = field(default="1gbit", metadata=_h("each host's link rate (tc), e.g. 1gbit"))
    steps: int = field(default=60, metadata=_h("optimizer steps of the whole run"))
    checkpoint_every: int = field(default=5, metadata=_h("checkpoint every this many steps"))
    kill_host: int | None = field(default=None, metadata=_h(
        "host whose processes get SIGKILL (not 0: it holds the rendezvous store)"))
    kill_at: int | None = field(default=None, metadata=_h("kill when this step is logged"))
    min_hosts: int | None = field(default=None, metadata=_h(
        "--nnodes MIN (default: hosts - 1 with a kill, else hosts)"))
    max_restarts: int = field(default=3, metadata=_h("torchrun --max-restarts"))
    n_layer: int = field(default=2, metadata=_h("GPT blocks"))
    n_head: int = field(default=4, metadata=_h("GPT heads"))
    n_embd: int = field(default=64, metadata=_h("GPT width"))
    seq_len: int = field(default=64, metadata=_h("characters per sequence"))
    batch_size: int = field(default=16, metadata=_h("sequences per step"))
    lr: float = field(default=3e-3, metadata=_h("peak learning rate"))
    eval_batches: int = field(default=8, metadata=_h("held-out batches at the end"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data"))
    chunks: str = field(default="2", metadata=_h(
        "pieces per fused operator, or auto (which calibrates the group at every restart)"))
    timeout_s: float = field(default=30.0, metadata=_h("every collective's limit (s)"))
    deadline_s: float = field(default=600.0, metadata=_h("stop everything after this long (s)"))

    def __post_init__(self) -> None:
        for name in ("hosts", "steps", "checkpoint_every", "n_layer", "n_head", "n_embd",
                     "seq_len", "batch_size", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.timeout_s <= 0 or self.deadline_s <= 0:
            raise ValueError(f"--timeout-s and --deadline-s must be positive, got "
                             f"{self.timeout_s}, {self.deadline_s}")
        if (self.kill_host is None) != (self.kill_at is None):
            raise ValueError(f"give both a host and a step to kill it at, got host "
                             f"{self.kill_host} and step {self.kill_at}")
        if self.kill_host is not None:
            if not 1 <= self.kill_host < self.hosts:
                raise ValueError(f"kill host {self.kill_host}: pick one of 1..{self.hosts - 1} "
                                 "(host 0 holds the rendezvous store)")
            if not 1 <= self.kill_at < self.steps:
                raise ValueError(f"kill step {self.kill_at} must be in 1..{self.steps - 1}")
        low = self.nnodes_min
        if not 1 <= low <= self.hosts:
            raise ValueError(f"--min-hosts (torchrun's --nnodes MIN) must be in "
                             f"1..{self.hosts}, got {low}")

    @property
    def nnodes_min(self) -> int:
        if self.min_hosts is not None:
            return self.min_hosts
        return self.hosts - 1 if self.kill_host is not None else self.hosts

    def worker_args(self, root: Path) -> list[str]:
        return ["--root", str(root), "--steps", str(self.steps),
                "--checkpoint-every", str(self.checkpoint_every), "--n-layer", str(self.n_layer),
                "--n-head", str(self.n_head), "--n-embd", str(self.n_embd),
                "--seq-len", str(self.seq_len), "--batch-size", str(self.batch_size),
                "--lr", repr(self.lr), "--eval-batches", str(self.eval_batches),
                "--seed", str(self.seed), "--chunks", self.chunks,
                "--timeout", repr(self.timeout_s)]
