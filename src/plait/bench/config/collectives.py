"""``plait bench collectives``' settings (``CollectiveBenchConfig``): what it sweeps, with
nccl-tests' flags named beside each."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...transport.asked import TRANSPORTS

__all__ = ["CollectiveBenchConfig", "COLLECTIVES"]


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_uneven")


@dataclass(frozen=True, kw_only=True)
class CollectiveBenchConfig:
    """What to sweep; each field's help is its CLI flag's help."""

    collectives: tuple[str, ...] = field(default=COLLECTIVES, metadata={
        "help": "collectives to run: " + ", ".join(COLLECTIVES)})
    min_bytes: int = field(default=4 * 1024, metadata={
        "help": "smallest message in bytes (nccl-tests -b)"})
    max_bytes: int = field(default=16 * 1024 * 1024, metadata={
        "help": "largest message in bytes (nccl-tests -e)"})
    step_factor: int = field(default=4, metadata={
        "help": "multiply the size by this between points (nccl-tests -f)"})
    warmup: int = field(default=2, metadata={"help": "untimed iterations per point (nccl-tests -w)"})
    min_iters: int = field(default=3, metadata={"help": "fewest timed iterations per point"})
    max_iters: int = field(default=20, metadata={
        "help": "most timed iterations per point (nccl-tests -n); the median is reported"})
    budget_s: float = field(default=0.4, metadata={
        "help": "seconds to spend timing one point; sets the iteration count within the bounds"})
    dtype: str = field(default="float32", metadata={"help": "element type of the buffers"})
    pieces: int = field(default=8, metadata={
        "help": "also time the largest message as this many calls in flight at once, each a "
                "piece of it (0: don't): what the link carries when one call's algorithm "
                "does not use it"})
    # --transport; () takes PLAIT_TRANSPORT's (auto where unset)
    transports: tuple[str, ...] = field(default=(), metadata={"help": None})
    extra: dict = field(default_factory=dict, metadata={"help": None})  # labels for every record

    def __post_init__(self) -> None:
        unknown = [c for c in self.collectives if c not in COLLECTIVES]
        if unknown:
            raise ValueError(f"unknown collectives {unknown}; choose from {list(COLLECTIVES)}")
        if not 0 < self.min_bytes <= self.max_bytes:
            raise ValueError(f"--min-bytes {self.min_bytes} must be above 0 and at most "
                             f"--max-bytes {self.max_bytes}")
        if self.step_factor < 2:
            raise ValueError(f"step_factor must be at least 2, got {self.step_factor}")
        if not 1 <= self.min_iters <= self.max_iters:
            raise ValueError(f"need 1 ≤ min_iters ≤ max_iters, got {self.min_iters}, {self.max_iters}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be non-negative, got {self.warmup}")
        if self.pieces < 0:
            raise ValueError(f"pieces must be 0 (none) or more, got {self.pieces}")
        bad = [t for t in self.transports if t not in TRANSPORTS]
        if bad:
            raise ValueError(f"--transport {','.join(self.transports)}: choose from "
                             f"{', '.join(TRANSPORTS)} (a comma list runs each, interleaved)")
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, float64, bfloat16 or float16, got {self.dtype!r}")
