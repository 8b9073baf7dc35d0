"""``plait bench ops``' settings (``OpsBenchConfig``): the operators and the shapes each is
timed at (``--quick``'s and the full sweep)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["OpsBenchConfig", "OPS", "QUICK_SHAPES", "FULL_SHAPES"]

OPS = ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter",
       "embedding_all_to_all", "all_to_all_matmul", "matmul_all_to_all")
"""The operators benchmarked (``bench.ops.CASES`` holds a case for each)."""

_EMB = dict(tables=4, rows=50_000, dim=128, batch=4096)
_MOE = dict(tokens=4096, hidden=512, experts=2)
# Quick: K (or N) swept so that communication runs from about half to about twice the
# compute on the emulated 1 Gbit/s link with one thread per rank on this machine.
QUICK_SHAPES = {
    "matmul_all_reduce": [dict(m=1024, k=k, n=1024) for k in (1024, 2048, 4096)]
    + [dict(m=8, k=512, n=65536)],
    "all_gather_matmul": [dict(m=2048, k=1024, n=n) for n in (1024, 2048, 4096)],
    "matmul_reduce_scatter": [dict(m=2048, k=k, n=1024) for k in (1024, 2048, 4096)],
    "embedding_all_to_all": [dict(_EMB, pool=p) for p in (8, 32)],
    "all_to_all_matmul": [dict(_MOE, ffn=f) for f in (256, 1024)],
    "matmul_all_to_all": [dict(_MOE, ffn=f) for f in (256, 1024)],
}
FULL_SHAPES = {
    "matmul_all_reduce": [dict(m=1024, k=k, n=1024) for k in (256, 512, 1024, 2048, 4096, 8192)]
    + [dict(m=m, k=8192, n=16384) for m in (1, 4, 8)],
    "all_gather_matmul": [dict(m=2048, k=1024, n=n) for n in (256, 512, 1024, 2048, 4096, 8192)],
    "matmul_reduce_scatter": [dict(m=2048, k=k, n=1024) for k in (256, 512, 1024, 2048, 4096, 8192)],
    "embedding_all_to_all": [dict(_EMB, pool=p) for p in (4, 8, 16, 32, 64)],
    "all_to_all_matmul": [dict(_MOE, ffn=f) for f in (128, 256, 512, 1024, 2048)],
    "matmul_all_to_all": [dict(_MOE, ffn=f) for f in (128, 256, 512, 1024, 2048)],
}


@dataclass(frozen=True, kw_only=True)
class OpsBenchConfig:
    """What to sweep; each field's help is its CLI flag's help."""

    ops: tuple[str, ...] = field(default=tuple(QUICK_SHAPES), metadata={
        "help": "operators to run: " + ", ".join(OPS)})
    iters: int = field(default=11, metadata={"help": "timed iterations per variant (median reported)"})
    min_time_s: float = field(default=0.25, metadata={"help": (
        "seconds each variant is timed for at least: a shape whose call is short gets more "
        "rounds than --iters, up to 4 × (0: --iters exactly)")})
    warmup: int = field(default=1, metadata={"help": "untimed iterations per variant"})
    fixed_chunks: tuple[int, ...] = field(default=(1, 2, 4, 8), metadata={
        "help": "fixed piece counts timed beside auto"})
    quick: bool = field(default=True, metadata={"help": None})
    sweep: dict | None = field(default=None, metadata={"help": None})  # {op: [shape]}, for tests
    # --transport; () takes PLAIT_TRANSPORT's (auto where unset)
    transports: tuple[str, ...] = field(default=(), metadata={"help": None})
    extra: dict = field(default_factory=dict, metadata={"help": None})

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPS]
        if unknown:
            raise ValueError(f"--ops {','.join(unknown)}: no such operator; choose from "
                             f"{', '.join(OPS)}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError(f"need iters ≥ 1 and warmup ≥ 0, got {self.iters}, {self.warmup}")
        if not self.min_time_s >= 0:
            raise ValueError(f"--min-time-s must be 0 or more, got {self.min_time_s}")
        if any(int(c) < 1 for c in self.fixed_chunks):
            raise ValueError(f"fixed chunks must be positive, got {self.fixed_chunks}")

    def shapes(self) -> list[tuple[str, dict]]:
        table = self.sweep if self.sweep is not None else QUICK_SHAPES if self.quick else FULL_SHAPES
        return [(op, shape) for op in self.ops for shape in table.get(op, [])]
