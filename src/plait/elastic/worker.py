"""The elastic training worker: what every rank runs under ``torchrun``.

    torchrun --nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint H0:29400 \\
        --max-restarts 3 -m plait.elastic.worker --root DIR --steps 60 --checkpoint-every 5

Each incarnation (every restart of the workers by torchrun's agents) builds the GPT from
its seed, splits it over the world it finds (the balancer's static plan for that many
equal ranks: ``plait.balance.policy.static_plan``), loads the newest checkpoint under
``DIR/checkpoints`` (DCP reshards it onto the new plan), trains to ``--steps`` through the
training loop (:class:`plait.training.loop.Trainer`),
checkpoints every ``--checkpoint-every`` steps and evaluates the held-out loss at the
end. The batch of step ``s`` is drawn from a generator seeded by ``(seed, s)``, and the
learning rate is a function of ``s``, so a resumed run sees the same data and schedule
as an uninterrupted one.

Rank 0 of each incarnation writes ``DIR/logs/incarnation-<ns>.jsonl``: a ``start`` line
(world size, restart count, the step resumed from, the plans), one line per step (loss,
world size, restart count, wall-clock time) and an ``end`` line (held-out loss). Without
torchrun's variables it runs as one process (the plain model): the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from ..training.loop import Component

__all__ = ["parse_args", "train_config", "batch_at", "main", "HOLD_ENV"]

HOLD_ENV = "PLAIT_ELASTIC_HOLD_AT"
"""A step: the worker stops after it, before its checkpoint (which no rank can then
publish), and waits to be killed (the launcher's fault injection sets it on the host it
kills)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m plait.elastic.worker",
                                description="elastic GPT training (run under torchrun)")
    p.add_argument("--root", required=True, help="checkpoints/ and logs/ go here")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunks", default="2", help="pieces per fused operator, or auto (auto "
                   "calibrates the group first: about 30 s a restart on a loaded 2-core machine)")
    p.add_argument("--timeout", type=float, default=30.0, help="every collective's limit (s)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.checkpoint_every < 1:
        p.error(f"--steps and --checkpoint-every must be positive, got {args.steps} and "
                f"{args.checkpoint_every}")
    return args



def train_config(args: argparse.Namespace, world: int):
    """The run's :class:`~plait.training.config.TrainConfig` with plans for ``world`` equal
    ranks."""
    from ..balance.policy import static_plan
    from ..training.config import TrainConfig

    base = TrainConfig(model="gpt", steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                       seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd, eval_batches=args.eval_batches, seed=args.seed,
                       chunks=args.chunks)
    if world == 1:
        return base
    speeds = [1.0] * world
    mlp = base.gpt_config(97).mlp_ratio * args.n_embd
    plans = (f"heads={':'.join(map(str, static_plan(args.n_head, speeds).sizes))}",
             f"mlp={':'.join(map(str, static_plan(mlp, speeds).sizes))}")
    cfg = TrainConfig(**{**base.__dict__, "plans": plans})
    cfg.check_plans(world)
    return cfg


def batch_at(corpus, cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: the same on every rank, in every incarnation."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step + 1)
    return corpus.batch("train", cfg.batch_size, cfg.seq_len, gen)


class _Log:
    """Rank 0's JSONL log of this incarnation (nothing on the other ranks)."""

    def __init__(self, root: Path, enabled: bool):
        self.file = None
        if enabled:
            logs = root / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            self.file = open(logs / f"incarnation-{time.time_ns()}.jsonl", "a", buffering=1)

    def write(self, **record) -> None:
        if self.file is not None:
            self.file.write(json.dumps({**record, "time": time.time()}) + "\n")
            self.file.flush()


class _StepLog(Component):
    """Each step's line in rank 0's log; at ``HOLD_ENV``'s step, the wait for the kill."""

    def __init__(self, log: _Log, world_size: int, restart: int):
        self.log, self.world_size, self.restart = log, world_size, restart
        self.hold = int(os.environ.get(HOLD_ENV, "0"))

    def after_step(self, record: dict) -> None:
        done = record["step"] + 1
        self.log.write(event="step", step=done, loss=record["loss"],
                       world_size=self.world_size, restart=self.restart)
        if done == self.hold:
            while True:  # until the launcher's SIGKILL, or this worker's agent's end
                time.sleep(3600)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ..checkpoint import Checkpointer
    from ..runtime import init_from_env
    from ..runtime.launch import exit_with
    from ..training.components import Checkpointing
    from ..training.data import CharCorpus
    from ..training.loop import Trainer, cosine_schedule
    from ..training.models import build_gpt, evaluate_gpt, gpt_loss, make_optimizer

    exit_with(os.getppid())  # a worker ends with its agent (which ends with the launcher)
    started = time.time()
    torch.set_num_threads(1)
    topo = init_from_env(backend="gloo", timeout_s=args.timeout)
    joined = time.time()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    root = Path(args.root)
    cfg = train_config(args, topo.world_size)
    corpus = CharCorpus.load()
    model = build_gpt(cfg, vocab_size=corpus.vocab_size)
    optimizer = make_optimizer(model, cfg.lr)
    ckpt = Checkpointer(root / "checkpoints", keep=2, timeout_s=args.timeout)
    built = time.time()
    loaded = ckpt.load(model, optimizer)
    first = loaded.step if loaded is not None else 0
    log = _Log(root, topo.rank == 0)
    log.write(event="start", world_size=topo.world_size, restart=restart, resumed_from=first,
              saved_world_size=loaded.world_size if loaded else None, plans=list(cfg.plans),
              process_start=started, joined=joined, built=built)
    trainer = Trainer(model, optimizer, gpt_loss, schedule=cosine_schedule(args.steps, args.lr),
                      components=[_StepLog(log, topo.world_size, restart),
                                  Checkpointing(ckpt, model, optimizer,
                                                every=args.checkpoint_every, steps=args.steps)])
    trainer.run((batch_at(corpus, cfg, step) for step in range(first, args.steps)), args.steps,
                start=first)
    final = evaluate_gpt(model, corpus, cfg)
    log.write(event="end", world_size=topo.world_size, restart=restart, **final)
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
