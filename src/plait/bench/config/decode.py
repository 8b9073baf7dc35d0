"""``plait bench decode``'s settings (``DecodeBenchConfig``) and the systems it compares."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...runtime.fields import help_meta as _h
from ...runtime.slow.straggler import SLOW_BY

__all__ = ["DecodeBenchConfig", "SYSTEMS", "COMPILED", "ALONE", "DEFAULT_SYSTEMS"]


SYSTEMS = ("plait", "plait-plain", "pytorch-tp", "one-process", "plait-speed",
           "plait-gather-checks", "one-process-compiled", "plait-compiled")


COMPILED = ("one-process-compiled", "plait-compiled")


ALONE = ("one-process", "one-process-compiled")


DEFAULT_SYSTEMS = SYSTEMS[:4]


@dataclass(frozen=True, kw_only=True)
class DecodeBenchConfig:
    n_layer: int = field(default=4, metadata=_h("decoder layers"))
    n_embd: int = field(default=512, metadata=_h("hidden width"))
    n_head: int = field(default=8, metadata=_h("query heads"))
    n_kv_head: int = field(default=4, metadata=_h("key/value heads"))
    vocab_size: int = field(default=1024, metadata=_h("vocabulary"))
    prompt_len: int = field(default=16, metadata=_h("prompt tokens"))
    new_tokens: int = field(default=48, metadata=_h("tokens decoded after the prompt"))
    batch_sizes: tuple[int, ...] = field(default=(1, 4, 16, 64), metadata=_h(
        "batch sizes (prompts decoded at once)"))
    systems: tuple[str, ...] = field(default=DEFAULT_SYSTEMS, metadata=_h(
        "systems: " + ", ".join(SYSTEMS) + " (plait-gather-checks: plait with every "
        "cross-rank check a gloo gather of its own, PLAIT_CHECKS=gather)"))
    split: str = field(default="even", metadata=_h(
        "even, or speed: also run plait with every split dim sized by each rank's speed "
        "measured at each batch size (plait-speed), beside the even split"))
    speed_steps: int = field(default=8, metadata=_h("decoding steps timed to measure speeds"))
    slow_by: str = field(default="sleep", metadata=_h(
        "how --slow RANK:F makes a rank F × slower: sleep (F − 1 × each split layer's compute "
        "time) or kernel (its host's CPU budget ÷ F, a cgroup cpu quota; needs --hosts equal "
        "to --ranks; --host-cpu is the full budget, default 1 core)"))
    compile: bool = field(default=False, metadata=_h(
        "also run one-process-compiled and plait-compiled: a static KV cache and the step "
        "compiled (torch.compile, fullgraph), as decoding users run it"))
    rounds: int = field(default=3, metadata=_h("rounds: every system decodes once a round"))
    seed: int = field(default=0, metadata=_h("weights' and prompts' seed"))
    extra: dict = field(default_factory=dict, metadata={"help": None})  # where it ran

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        if not self.systems or any(not s for s in self.systems):
            raise ValueError(f"--systems needs one or more of {', '.join(SYSTEMS)}, "
                             f"got {','.join(self.systems)!r}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ValueError(f"--systems {','.join(unknown)}: choose from {', '.join(SYSTEMS)}")
        for name in ("n_layer", "n_embd", "n_head", "n_kv_head", "vocab_size", "prompt_len",
                     "new_tokens", "rounds", "speed_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(self, name)}")
        if self.slow_by not in SLOW_BY:
            raise ValueError(f"--slow-by must be sleep or kernel, got {self.slow_by!r}")
        if self.split not in ("even", "speed"):
            raise ValueError(f"--split must be even or speed, got {self.split!r}")
        if self.split == "speed" and "plait-speed" not in self.systems:
            object.__setattr__(self, "systems", (*self.systems, "plait-speed"))
        if self.compile:
            more = tuple(s for s in COMPILED if s not in self.systems)
            object.__setattr__(self, "systems", (*self.systems, *more))
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch-sizes must be at least 1 each, got {self.batch_sizes}")
        if self.n_head % self.n_kv_head or self.n_embd % self.n_head:
            raise ValueError(f"--n-head {self.n_head} must be a multiple of --n-kv-head "
                             f"{self.n_kv_head} and divide --n-embd {self.n_embd}")
