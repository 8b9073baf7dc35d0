"""``train(cfg, ranks=2)``: train a small model on N ranks (``plait train`` calls it).

One linear run, nanoGPT-style, through the one loop (:class:`plait.training.loop.Trainer`).
Every rank builds the same single-device model from the same seed and makes it parallel
(``apply_tp`` for plait's models, ``plait.parallelize(model, plan="auto")`` for the
transformers ones); every rank reads the same batch (tensor parallelism splits the model,
not the data; the DLRM splits its batch inside), so every rank computes the same loss.
AdamW with a short warm-up and cosine decay; no gradient clipping (a norm over sharded
gradients would need its own all-reduce). ``--dp N --tp M`` and ``--balance``: see
:mod:`plait.training.dp_tp`; checkpoints and resume: :mod:`plait.training.resume`.
"""

from __future__ import annotations

import time
from dataclasses import replace


from ..models import DLRMConfig
from ..ops import explain
from .components import Progress, Straggling
from .config import TrainConfig
from .data import CharCorpus, ClickLog
from .dp_tp import RankParallel, mesh_layout
from .config import HF_MODELS
from .loop import Trainer, cosine_schedule
from .models import (build_dlrm, build_gpt, build_hf, dlrm_loss, evaluate_dlrm, evaluate_gpt,
                     gpt_loss, hf_loss, make_optimizer)
from .resume import SeededStream, checkpoint_note, checkpointing, resume_run

__all__ = ["train_rank", "train"]


def train_rank(cfg: TrainConfig) -> dict:
    """What each rank runs: build, train, evaluate. Rank 0 reports progress."""
    import torch.distributed as dist

    from ..runtime import rank_context

    rank = dist.get_rank() if dist.is_initialized() else 0
    run = RankParallel(cfg)  # --dp × --tp, --balance
    if cfg.model == "dlrm":
        dlrm_cfg = DLRMConfig()
        model = run.wrap(build_dlrm(cfg, dlrm=dlrm_cfg))
        log = ClickLog(dlrm_cfg.table_sizes, dlrm_cfg.dense_features, seed=cfg.seed)
        stream = SeededStream(lambda gen: log.sample(cfg.batch_size, gen), cfg.seed + 1)
        batches = stream
        loss_fn, progress = dlrm_loss, Progress("samples", cfg.batch_size)
    else:
        corpus = CharCorpus.load()
        build, loss_fn = (build_hf, hf_loss) if cfg.model in HF_MODELS else (build_gpt, gpt_loss)
        model = run.wrap(build(cfg, run.tp_group, vocab_size=corpus.vocab_size))
        stream = SeededStream(lambda gen: corpus.batch("train", cfg.batch_size, cfg.seq_len,
                                                       gen), cfg.seed + 1)
        batches = run.replica_rows(stream)
        progress = Progress("tokens", cfg.batch_size * cfg.seq_len)
    optimizer = make_optimizer(model, cfg.lr)
    run.attach(model, optimizer)
    ckpt, first_step, done, resumed = resume_run(cfg, model, optimizer, stream, run)
    if resumed is not None and rank == 0:
        rank_context().report({"note": resumed, "step": first_step})
    components = [Straggling(), *run.components(), progress]
    if ckpt is not None:
        components.append(checkpointing(cfg, ckpt, model, optimizer, stream, done, run))
    trainer = Trainer(model, optimizer, loss_fn, schedule=cosine_schedule(cfg.steps, cfg.lr),
                      components=components)
    start = time.perf_counter()
    history = trainer.run(batches, cfg.steps, start=first_step)
    if ckpt is not None:
        ckpt.wait()  # the last asynchronous save published (or its error raised) before exit
    train_s = time.perf_counter() - start
    if cfg.model == "dlrm":
        final = evaluate_dlrm(model, log, cfg)
    else:
        final = evaluate_gpt(model, corpus, cfg)
    params = sum(p.numel() for p in model.parameters())  # this rank's share
    paths = explain() if dist.is_initialized() else "one process: no collectives"
    return run.report({"records": done + history, "resumed": resumed, "eval": final,
                       "train_s": train_s, "unit": progress.unit,
                       "params_rank": params, "paths": paths.splitlines()}, cfg.steps)


def train(cfg: TrainConfig, *, ranks: int = 2, hosts: int = 0, link: str | None = None,
          timeout_s: float | None = None, on_progress=None, slow=()) -> tuple[dict, str]:
    """Train on ``ranks`` ranks (loopback, or ``hosts`` emulated hosts at ``link``);
    rank 0's result and a line saying where it ran."""
    from ..runtime.placement import run_placed

    cfg = replace(cfg)  # validated
    cfg.check_plans(mesh_layout(cfg, ranks).tp)
    checkpoint_note(cfg)  # refuses a --checkpoint-dir that holds another run's checkpoints
    return run_placed(train_rank, cfg, ranks=ranks, hosts=hosts, link=link or "1gbit",
                      timeout_s=timeout_s, on_progress=on_progress, slow=slow)
