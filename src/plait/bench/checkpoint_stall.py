"""How long training waits for a checkpoint, blocking against asynchronous
(``plait bench checkpoint``; the command line is :mod:`plait.cli.bench_checkpoint`).

A GPT made tensor-parallel over every rank (by default ``plait bench tp``'s: 2 blocks,
8 heads, width 512, 16 sequences of 128 tokens, fused, 2 micro-batches; AdamW) trains
through the training loop (:class:`plait.training.loop.Trainer`).
``warmup`` steps, then ``plain_steps`` steps without checkpoints give the plain step
(median). Then ``checkpoints`` checkpoints of each kind, taking turns (blocking,
asynchronous, blocking, …) so that a slow stretch of a shared machine lands on both
kinds alike, ``every`` training steps after each. Per checkpoint, each figure the
slowest rank's:

- *stall*: the ``Checkpointer.save`` call, during which training waits. Blocking: the
  whole write, fsync and publication. Asynchronous: the CPU copy of the tensors and the
  start of DCP's writing thread.
- *async wait* (asynchronous only): ``Checkpointer.wait`` before the next (blocking)
  checkpoint, ``every`` steps later: how long its background write and publication
  still took then (with the agreement collective that ends a save). The blocking stall
  never includes it; an asynchronous save every ``every`` steps would wait that long.
- *interval extra*: the stall plus the ``every`` steps after it, minus as many plain
  steps: also counts what the background write costs the steps it overlaps. On a shared,
  loaded machine the step-to-step spread can swamp it (it comes out negative).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from functools import partial

from ..runtime.fields import help_meta as _h

__all__ = ["CheckpointBenchConfig", "KINDS", "QUICK_CHECKPOINT", "bench_checkpoint",
           "stall_records", "summarize_stall"]

KINDS = ("blocking", "async")  # the order of each turn
VOCAB = 97  # the characters of plait's corpus (bench tp's GPT)
QUICK_CHECKPOINT = dict(n_embd=256, batch_size=8, every=2, plain_steps=4)


@dataclass(frozen=True, kw_only=True)
class CheckpointBenchConfig:
    """The model, the checkpoints and the steps; each field's help is its CLI flag's help."""

    checkpoints: int = field(default=5, metadata=_h(
        "checkpoints of each kind, blocking and asynchronous taking turns (median reported)"))
    every: int = field(default=3, metadata=_h("training steps after each checkpoint"))
    warmup: int = field(default=2, metadata=_h("untimed training steps first"))
    plain_steps: int = field(default=6, metadata=_h(
        "steps timed without checkpoints; their median is the plain step"))
    n_layer: int = field(default=2, metadata=_h("transformer blocks"))
    n_head: int = field(default=8, metadata=_h("attention heads (split over the ranks)"))
    n_embd: int = field(default=512, metadata=_h("model width"))
    seq_len: int = field(default=128, metadata=_h("characters per sequence"))
    batch_size: int = field(default=16, metadata=_h("sequences per step (the same on every rank)"))
    microbatches: int = field(default=2, metadata=_h(
        "micro-batches interleaved through the blocks (1: off)"))
    lr: float = field(default=1e-3, metadata=_h("AdamW's learning rate (constant)"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data"))
    checkpoint_dir: str | None = field(default=None, metadata=_h(
        "folder in which a new folder holds the checkpoints, removed at the end (default: "
        "the system's temporary folder)"))
    extra: dict = field(default_factory=dict)  # where it ran (filled by the launcher)

    def __post_init__(self) -> None:
        for name in ("checkpoints", "every", "plain_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be 0 or more, got {self.warmup}")
        cfg = self.train_config()  # refuses bad sizes, lr and micro-batches by their flags
        cfg.gpt_config(VOCAB)  # and a width the heads do not divide
        if self.microbatches > self.batch_size:
            raise ValueError(f"--microbatches {self.microbatches} is more than --batch-size "
                             f"{self.batch_size} sequences")

    def train_config(self):
        from ..training.config import TrainConfig

        steps = self.warmup + self.plain_steps + 2 * self.checkpoints * self.every
        return TrainConfig(model="gpt", steps=steps, batch_size=self.batch_size, lr=self.lr,
                           seq_len=self.seq_len, n_layer=self.n_layer, n_head=self.n_head,
                           n_embd=self.n_embd, overlap=True, seed=self.seed,
                           microbatches=self.microbatches)

    def check_world(self, world: int) -> None:
        if self.n_head < world:
            raise ValueError(f"--n-head {self.n_head} leaves ranks without a head on {world} "
                             "ranks: give at least one head a rank")

    @property
    def progress_total(self) -> int:
        """Progress reports a run makes: the plain steps, then each checkpoint."""
        return 1 + len(KINDS) * self.checkpoints


def _rank_bench(cfg: CheckpointBenchConfig, root: str) -> dict:
    """One rank's part: every figure already the slowest rank's (seconds)."""
    import torch

    from ..checkpoint import Checkpointer
    from ..runtime import rank_context
    from ..runtime.timing import agreed_max, time_once
    from ..training.loop import Trainer
    from ..training.models import build_gpt, gpt_loss, make_optimizer

    ctx = rank_context()
    device = ctx.topology.device
    model = build_gpt(cfg.train_config(), vocab_size=VOCAB).to(device)
    opt = make_optimizer(model, cfg.lr)
    trainer = Trainer(model, opt, gpt_loss)  # a constant learning rate
    gen = torch.Generator().manual_seed(cfg.seed)  # the same batches on every rank

    def train_step() -> None:
        x = torch.randint(0, VOCAB, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        x = x.to(device)
        trainer.step(0, (x[:, :-1], x[:, 1:]))

    for _ in range(cfg.warmup):
        train_step()
    plain = [time_once(train_step, device) for _ in range(cfg.plain_steps)]
    ctx.report({"phase": "plain steps"})
    ckpt = Checkpointer(root, keep=2)
    step = cfg.warmup + cfg.plain_steps
    stalls = {kind: [] for kind in KINDS}
    after = {kind: [] for kind in KINDS}  # the `every` steps after each checkpoint
    waits = []
    for n in range(cfg.checkpoints):
        for kind in KINDS:
            if kind == "blocking" and n:
                waits.append(time_once(ckpt.wait, device))  # the last asynchronous save's
            stalls[kind].append(time_once(partial(
                ckpt.save, step, model, opt, {"step": step}, blocking=kind == "blocking"),
                device))
            after[kind].append([time_once(train_step, device) for _ in range(cfg.every)])
            step += cfg.every
            ctx.report({"kind": kind, "n": n, "of": cfg.checkpoints})
    waits.append(time_once(ckpt.wait, device))
    size = sum(f.stat().st_size for f in ckpt.latest().rglob("*") if f.is_file())
    slowest = partial(agreed_max, device=device)
    return {"plain_s": slowest(plain), "async_wait_s": slowest(waits),
            **{f"{kind}_stall_s": slowest(stalls[kind]) for kind in KINDS},
            **{f"{kind}_after_s": _chunks(slowest(sum(after[kind], [])), cfg.every)
               for kind in KINDS},
            "checkpoint_bytes": size, "world_size": ctx.topology.world_size, "link": ctx.link}


def _chunks(values: list[float], size: int) -> list[list[float]]:
    return [values[i:i + size] for i in range(0, len(values), size)]


def stall_records(raw: dict, cfg: CheckpointBenchConfig) -> list[dict]:
    """One record per checkpoint, in the order they were made, from a run's raw figures."""
    plain = statistics.median(raw["plain_s"])
    records = []
    for n in range(cfg.checkpoints):
        for kind in KINDS:
            stall, after = raw[f"{kind}_stall_s"][n], raw[f"{kind}_after_s"][n]
            records.append({
                "kind": kind, "checkpoint": n + 1, "stall_s": stall,
                "async_wait_s": raw["async_wait_s"][n] if kind == "async" else None,
                "steps_after_s": after,
                "interval_extra_s": stall + sum(after) - len(after) * plain,
                "world_size": raw["world_size"], "link": raw["link"]})
    return records


def summarize_stall(raw: dict, records: list[dict]) -> dict:
    """Medians over the checkpoints of each kind (seconds), the plain step and their ratio."""
    def median_of(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in records if r["kind"] == kind)

    out = {"plain_step_s": statistics.median(raw["plain_s"]),
           "checkpoints": sum(r["kind"] == KINDS[0] for r in records),
           "checkpoint_bytes": raw["checkpoint_bytes"]}
    for kind in KINDS:
        out[f"{kind}_stall_s"] = median_of(kind, "stall_s")
        out[f"{kind}_interval_extra_s"] = median_of(kind, "interval_extra_s")
    out["async_wait_s"] = median_of("async", "async_wait_s")
    out["blocking_over_async"] = out["blocking_stall_s"] / out["async_stall_s"]
    return out


def bench_checkpoint(cfg: CheckpointBenchConfig, *, ranks: int, hosts: int = 0,
                     link: str | None = None, timeout_s: float | None = None,
                     on_progress=None) -> tuple[list[dict], dict, str]:
    """Run the benchmark: (a record per checkpoint, the summary, where it ran).

    The checkpoints go to a new folder under ``cfg.checkpoint_dir`` (default: the system's
    temporary folder), removed when the run ends, however it ends."""
    from ..runtime.placement import run_placed

    cfg.check_world(ranks)
    root = tempfile.mkdtemp(prefix="plait-bench-checkpoint-", dir=cfg.checkpoint_dir)
    try:
        raw, where = run_placed(partial(_rank_bench, root=root), cfg, ranks=ranks, hosts=hosts,
                                link=link, timeout_s=timeout_s, on_progress=on_progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    records = stall_records(raw, cfg)
    return records, summarize_stall(raw, records), where
