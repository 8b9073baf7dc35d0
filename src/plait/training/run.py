"""Train a small plait model on N ranks: ``train(cfg, ranks=2)`` (``plait train`` calls it).

One linear loop, nanoGPT-style. Every rank builds the same single-device
model from the same seed and makes it parallel with ``apply_tp``; every rank
reads the same batch (tensor parallelism: the model, not the data, is split;
the DLRM splits its batch inside), so every rank computes the same loss.
AdamW with a short warm-up and cosine decay; no gradient clipping (a norm
over sharded gradients would need its own all-reduce).

The transformers models (``hf-llama``, ``hf-mixtral``; :mod:`plait.train_hf`) are
made parallel by ``plait.parallelize(model, plan="auto")`` instead, and train on the
GPT's data with the GPT's loss.

``--dp N --tp M`` and ``--balance`` (:mod:`plait.train_parallel`): tensor parallelism
on each tp group of a ``dp × tp`` mesh, PyTorch's data parallelism across them, each
replica on its share of the batch's rows; the balancer stepped after every update.

Building blocks for benchmarks: ``build_gpt(cfg, group)`` (a plait-TP GPT or
MoE-GPT), ``train_steps(...)`` (N steps → per-step times and losses),
``evaluate_gpt`` / ``evaluate_dlrm`` (held-out loss and accuracy).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from .runtime.fields import help_meta as _h
from .data import CharCorpus, ClickLog
from .models import DLRM, GPT, DLRMConfig, GPTConfig
from .parallel import apply_tp
from .ops import explain
from .plan import ShardPlan
from .train_hf import (HF_MODELS, HF_PLAN_KINDS, build_hf, check_hf_plans, check_hf_sizes,
                       hf_logits_loss, hf_loss, require_transformers)
from .train_parallel import RankParallel, check_parallel, mesh_layout
from .train_resume import (SeededStream, check_checkpoint_flags, checkpoint_after,
                           checkpoint_note, resume_run)

__all__ = ["TrainConfig", "build_gpt", "build_dlrm", "build_hf", "train_steps", "gpt_loss",
           "dlrm_loss", "hf_loss", "evaluate_gpt", "evaluate_dlrm", "train_rank", "train"]

MODELS = ("gpt", "moe", "dlrm", *HF_MODELS)
# what an unset flag means, per model: tiny enough to train here in about a minute
PRESETS = {
    "gpt": dict(steps=400, batch_size=16, lr=3e-3, n_head=4),
    "moe": dict(steps=400, batch_size=16, lr=3e-3, n_head=4),
    "dlrm": dict(steps=600, batch_size=256, lr=1e-2, n_head=4),
    "hf-llama": dict(steps=300, batch_size=16, lr=3e-3, n_head=8, kv_heads=2),
    # measured on 2 loaded cores, 2 ranks: a step 0.22-0.40 s (llama), 0.35-0.46 s (mixtral)
    "hf-mixtral": dict(steps=150, batch_size=16, lr=3e-3, n_head=8, kv_heads=2),
}



@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = field(default="gpt", metadata=_h(
        "gpt, moe (a GPT whose MLPs are MoE), dlrm, or a transformers model built from a "
        "config: hf-llama (grouped-query attention), hf-mixtral (its MLPs are experts)"))
    steps: int | None = field(default=None, metadata=_h(
        "optimizer steps (default 400 for the GPTs, 300 for hf-llama, 150 for hf-mixtral, "
        "600 for dlrm)"))
    batch_size: int | None = field(default=None, metadata=_h("sequences (GPT, hf-*) or samples "
                                                             "(DLRM) per step (default 16 / 256)"))
    lr: float | None = field(default=None, metadata=_h("peak learning rate of AdamW (default 3e-3 "
                                                       "for the GPTs and hf-*, 1e-2 for dlrm)"))
    seq_len: int = field(default=64, metadata=_h("GPT, hf-*: characters per sequence"))
    n_layer: int = field(default=2, metadata=_h("GPT, hf-*: transformer blocks"))
    n_head: int | None = field(default=None, metadata=_h(
        "GPT, hf-*: attention (query) heads (default 4; 8 for hf-*)"))
    kv_heads: int | None = field(default=None, metadata=_h(
        "hf-*: key/value heads, each read by n_head / kv_heads query heads (default 2)"))
    n_embd: int = field(default=128, metadata=_h("GPT, hf-*: model width"))
    n_experts: int = field(default=4, metadata=_h("moe, hf-mixtral: experts per MoE layer"))
    top_k: int = field(default=2, metadata=_h("moe, hf-mixtral: experts per token"))
    overlap: bool = field(default=True, metadata=_h("fused compute–collective operators "
                                                    "(--no-overlap: the plain path)"))
    sequence_parallel: bool = field(default=False, metadata=_h("GPT: sequence-parallel "
                                                               "activations between linears"))
    chunks: str = field(default="auto", metadata=_h("pieces per fused operator: auto or a number"))
    microbatches: int = field(default=1, metadata=_h(
        "gpt: cut each batch into this many micro-batches whose blocks take turns, one's "
        "all-reduces on the wire while the next computes (fused, not sequence-parallel)"))
    plans: tuple[str, ...] = field(default=(), metadata=_h(
        "uneven partition plans, KIND=A:B:…, e.g. heads=3:1,mlp=320:192 (kinds: heads, mlp, "
        "experts, seq, tables, batch; hf-*: heads count KV-head groups)"))
    eval_batches: int = field(default=8, metadata=_h("held-out batches evaluated at the end"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data order"))
    dp: int = field(default=1, metadata=_h(
        "data-parallel replicas (gpt, hf-llama): each takes an equal share of every batch's "
        "rows; --dp × --tp must be the number of ranks"))
    tp: int | None = field(default=None, metadata=_h(
        "ranks in one tensor-parallel group (default: ranks / --dp)"))
    tp_across_hosts: bool = field(default=False, metadata=_h(
        "a tp group's ranks --dp apart, so tensor parallelism crosses hosts and each replica "
        "is consecutive ranks (default: a tp group is consecutive ranks, inside a host)"))
    balance: str = field(default="even", metadata=_h(
        "balancing policy run in the loop: even (no balancer), resize, migrate, semi "
        "(gpt, hf-llama; with --dp > 1 data parallelism is DDP: add --no-overlap unless "
        "--sequence-parallel)"))
    checkpoint_dir: str | None = field(default=None, metadata=_h(
        "save checkpoints (model, optimizer, step, data position, RNG states) under DIR"))
    checkpoint_every: int = field(default=50, metadata=_h("steps between checkpoints"))
    checkpoint_keep: int = field(default=2, metadata=_h("newest checkpoints kept"))
    resume: bool = field(default=False, metadata=_h(
        "continue from the newest checkpoint in --checkpoint-dir (none there: from step 0)"))
    extra: dict = field(default_factory=dict)  # where it ran (filled by the launcher)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        hf = self.model in HF_MODELS
        if self.kv_heads is not None and not hf:
            raise ValueError(f"--kv-heads applies to --model {' and '.join(HF_MODELS)}, not to "
                             f"{self.model}")
        for key, value in PRESETS[self.model].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        for name in ("steps", "batch_size", "seq_len", "n_layer", "n_head", "n_embd",
                     "n_experts", "top_k") + (("kv_heads",) if hf else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.eval_batches < 0:
            raise ValueError(f"--eval-batches must be 0 or more, got {self.eval_batches}")
        if self.chunks != "auto" and not (str(self.chunks).isdigit() and int(self.chunks) >= 1):
            raise ValueError(f"--chunks must be 'auto' or a positive number, got {self.chunks!r}")
        if self.sequence_parallel and self.model not in ("gpt", "moe"):
            raise ValueError(f"--sequence-parallel applies to the GPT models (gpt, moe), not "
                             f"to {self.model}")
        if self.microbatches < 1:
            raise ValueError(f"--microbatches must be positive, got {self.microbatches}")
        if self.microbatches > 1 and (self.model != "gpt" or self.sequence_parallel
                                      or not self.overlap):
            raise ValueError(f"--microbatches {self.microbatches} applies to --model gpt, fused "
                             "(not --no-overlap) and not --sequence-parallel")
        check_parallel(self)
        check_checkpoint_flags(self)
        self.shard_plans()  # refuse a malformed --plans now
        if hf:
            check_hf_sizes(self)
            require_transformers(self.model)

    @property
    def chunk_count(self):
        return "auto" if self.chunks == "auto" else int(self.chunks)

    def shard_plans(self) -> dict[str, ShardPlan]:
        plans = {}
        for entry in self.plans:
            kind, _, sizes = entry.partition("=")
            try:
                plans[kind.strip()] = ShardPlan(tuple(int(s) for s in sizes.split(":")))
            except ValueError:
                raise ValueError(f"cannot read --plans entry {entry!r}; write KIND=A:B, "
                                 "e.g. heads=3:1") from None
        return plans

    def check_plans(self, world: int) -> None:
        """Refuse, before anything starts, a plan that does not fit the model on ``world``
        ranks."""
        if self.model in HF_MODELS:
            allowed = HF_PLAN_KINDS[self.model]
            plans = self.shard_plans()
            for kind in plans:
                if kind not in allowed:
                    raise ValueError(f"--plans {kind}=… does not apply to --model {self.model} "
                                     f"(it takes {', '.join(allowed)})")
            check_hf_plans(self, plans, world)
            return
        gpt = self.gpt_config(97)
        dims = {"heads": (gpt.n_head, "heads"), "mlp": (gpt.mlp_ratio * gpt.n_embd, "columns"),
                "experts": (self.n_experts, "experts"), "seq": (self.seq_len, "positions"),
                "tables": (len(DLRMConfig().table_sizes), "tables"),
                "batch": (self.batch_size, "samples")}
        allowed = {"dlrm": ("tables", "batch"), "gpt": ("heads", "mlp", "seq"),
                   "moe": ("heads", "experts", "seq")}[self.model]
        for kind, plan in self.shard_plans().items():
            if kind not in allowed:
                raise ValueError(f"--plans {kind}=… does not apply to --model {self.model} "
                                 f"(it takes {', '.join(allowed)})")
            total, what = dims[kind]
            plan.check(total, world, what=what, layer=f"--plans {kind}",
                       allow_empty=kind in ("seq", "batch"))

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        experts = self.n_experts if self.model == "moe" else 0
        return GPTConfig(vocab_size=vocab_size, block_size=self.seq_len, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, n_experts=experts,
                         top_k=self.top_k, mlp_ratio=2 if experts else 4)


# --- models ------------------------------------------------------------------

def build_gpt(cfg: TrainConfig, group=None, vocab_size: int = 97) -> GPT:
    """The single-device GPT (or MoE-GPT) of ``cfg`` from its seed, made plait-TP on ``group``."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config(vocab_size))
    return apply_tp(model, group, cfg.shard_plans(), overlap=cfg.overlap,
                    sequence_parallel=cfg.sequence_parallel, chunks=cfg.chunk_count,
                    microbatches=cfg.microbatches)


def build_dlrm(cfg: TrainConfig, group=None, dlrm: DLRMConfig | None = None) -> DLRM:
    torch.manual_seed(cfg.seed)
    model = DLRM(dlrm or DLRMConfig())
    return apply_tp(model, group, cfg.shard_plans(), overlap=cfg.overlap, chunks=cfg.chunk_count)


# --- the loop ----------------------------------------------------------------

def lr_at(step: int, steps: int, peak: float, warmup: int = 10) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator,
                loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], steps: int, *,
                peak_lr: float | None = None, on_step: Callable[[dict], None] | None = None,
                start: int = 0) -> list[dict]:
    """``steps`` optimizer steps; per step ``{"step", "loss", "time_s", "lr"}``.

    ``loss_fn(model, batch)`` returns the (replicated) loss. ``time_s`` is this
    rank's wall time for forward, backward and the update (not the data).
    """
    from .runtime import rank_context
    import torch.distributed as dist

    straggler = rank_context().straggler if dist.is_initialized() else None
    model.train()
    history = []
    for step in range(start, steps):  # a resumed run starts where its checkpoint left off
        batch = next(batches)
        if peak_lr is not None:
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step, steps, peak_lr)
        if straggler is not None:
            straggler.set_step(step)
        start = time.perf_counter()
        loss = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        record = {"step": step, "loss": loss.item(), "time_s": time.perf_counter() - start,
                  "lr": optimizer.param_groups[0]["lr"]}
        history.append(record)
        if on_step is not None:
            on_step(record)
    return history


def gpt_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return model(x, y)[1]


def dlrm_loss(model, batch) -> torch.Tensor:
    dense, indices, offsets, labels, _ = batch
    return F.binary_cross_entropy_with_logits(model(dense, indices, offsets), labels)


@torch.no_grad()
def evaluate_gpt(model, corpus: CharCorpus, cfg: TrainConfig) -> dict:
    """Held-out cross-entropy and next-token accuracy over ``cfg.eval_batches`` fixed batches
    (of plait's GPTs, or of the transformers model when ``cfg.model`` is ``hf-*``)."""
    forward = hf_logits_loss if cfg.model in HF_MODELS else (lambda m, x, y: m(x, y))
    model.eval()
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    losses, correct, total = [], 0, 0
    for _ in range(cfg.eval_batches):
        x, y = corpus.batch("heldout", cfg.batch_size, cfg.seq_len, gen)
        logits, loss = forward(model, x, y)
        losses.append(loss.item())
        correct += int((logits.argmax(-1) == y).sum())
        total += y.numel()
    model.train()
    return {"heldout_loss": sum(losses) / max(len(losses), 1),
            "heldout_accuracy": correct / max(total, 1)}


@torch.no_grad()
def evaluate_dlrm(model, log: ClickLog, cfg: TrainConfig) -> dict:
    """Held-out BCE, click accuracy and the planted model's loss (the floor) on fixed samples."""
    model.eval()
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    losses, bayes, correct, total = [], [], 0, 0
    for _ in range(cfg.eval_batches):
        dense, indices, offsets, labels, probs = log.sample(cfg.batch_size, gen)
        logits = model(dense, indices, offsets)
        losses.append(float(F.binary_cross_entropy_with_logits(logits, labels)))
        bayes.append(ClickLog.bayes_loss(labels, probs))
        correct += int(((logits > 0).float() == labels).sum())
        total += labels.numel()
    model.train()
    n = max(len(losses), 1)
    return {"heldout_loss": sum(losses) / n, "heldout_accuracy": correct / max(total, 1),
            "planted_model_loss": sum(bayes) / n}


def train_rank(cfg: TrainConfig) -> dict:
    """What each rank runs: build, train, evaluate. Rank 0 reports progress."""
    import torch.distributed as dist

    from .runtime import rank_context

    rank = dist.get_rank() if dist.is_initialized() else 0
    report = rank_context().report if dist.is_initialized() else (lambda payload: None)
    run = RankParallel(cfg)  # --dp × --tp, --balance
    if cfg.model == "dlrm":
        dlrm_cfg = DLRMConfig()
        model = run.wrap(build_dlrm(cfg, dlrm=dlrm_cfg))
        log = ClickLog(dlrm_cfg.table_sizes, dlrm_cfg.dense_features, seed=cfg.seed)
        stream = SeededStream(lambda gen: log.sample(cfg.batch_size, gen), cfg.seed + 1)
        batches = stream
        loss_fn, unit = dlrm_loss, "samples"
        per_step = cfg.batch_size
    else:
        corpus = CharCorpus.load()
        build, loss_fn = (build_hf, hf_loss) if cfg.model in HF_MODELS else (build_gpt, gpt_loss)
        model = run.wrap(build(cfg, run.tp_group, vocab_size=corpus.vocab_size))
        stream = SeededStream(lambda gen: corpus.batch("train", cfg.batch_size, cfg.seq_len,
                                                       gen), cfg.seed + 1)
        batches = run.replica_rows(stream)
        unit, per_step = "tokens", cfg.batch_size * cfg.seq_len
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    run.attach(model, optimizer)
    ckpt, first_step, done, resumed = resume_run(cfg, model, optimizer, stream, run)
    if resumed is not None and rank == 0:
        report({"note": resumed, "step": first_step})

    def on_step(record: dict) -> None:
        run.after_step(record)  # the balancer's step; the global batch's loss over dp
        record[f"{unit}_per_s"] = per_step / record["time_s"]
        if rank == 0:
            report({"step": record["step"], "loss": record["loss"],
                    "rate": record[f"{unit}_per_s"], "unit": unit})

    start = time.perf_counter()
    if ckpt is not None:
        on_step = checkpoint_after(on_step, cfg, ckpt, model, optimizer, stream, done,
                                   run)
    history = train_steps(model, optimizer, batches, loss_fn, cfg.steps, peak_lr=cfg.lr,
                          on_step=on_step, start=first_step)
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
                       "train_s": train_s, "unit": unit,
                       "params_rank": params, "paths": paths.splitlines()}, cfg.steps)


def train(cfg: TrainConfig, *, ranks: int = 2, hosts: int = 0, link: str | None = None,
          timeout_s: float | None = None, on_progress=None, slow=()) -> tuple[dict, str]:
    """Train on ``ranks`` ranks (loopback, or ``hosts`` emulated hosts at ``link``);
    rank 0's result and a line saying where it ran."""
    from .runtime.placement import run_placed

    cfg = replace(cfg)  # validated
    cfg.check_plans(mesh_layout(cfg, ranks).tp)
    checkpoint_note(cfg)  # refuses a --checkpoint-dir that holds another run's checkpoints
    return run_placed(train_rank, cfg, ranks=ranks, hosts=hosts, link=link or "1gbit",
                      timeout_s=timeout_s, on_progress=on_progress, slow=slow)
