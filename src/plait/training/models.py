"""The models ``plait train`` trains, built from a :class:`TrainConfig` and its seed and made
parallel; their losses on a batch, and their held-out evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models import DLRM, GPT, DLRMConfig
from ..parallel import apply_tp
from .config import TrainConfig
from .data import CharCorpus, ClickLog
from .config import HF_MODELS
from .hf import build_hf, hf_logits_loss, hf_loss

__all__ = ["build_gpt", "build_dlrm", "build_hf", "make_optimizer", "gpt_loss", "dlrm_loss",
           "hf_loss", "evaluate_gpt", "evaluate_dlrm"]


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


def make_optimizer(model: torch.nn.Module, lr: float, name: str = "adamw"
                   ) -> torch.optim.Optimizer:
    """AdamW without weight decay (what plait trains with), or plain SGD (``name="sgd"``)."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    if name != "adamw":
        raise ValueError(f"optimizer {name!r}: choose adamw or sgd")
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)


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
