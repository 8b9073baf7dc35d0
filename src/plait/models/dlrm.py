"""A small DLRM (Naumov et al., 2019), single-device and free of parallel code.

dense features → bottom MLP → one D-vector; each categorical feature → a
pooled embedding bag; the pairwise dot products of those T + 1 vectors (the
interaction) and the dense vector → top MLP → one click logit.
``plait.parallel.apply_tp`` makes the tables model-parallel
(``ShardedEmbeddingBag``, whole tables per rank) and the MLPs data-parallel.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import DLRMConfig

__all__ = ["DLRMConfig", "DLRM", "EmbeddingBagCollection"]


def _mlp(widths: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class EmbeddingBagCollection(nn.Module):
    """T sum-pooled tables of one D: ``forward(indices, offsets) → [B, T, D]``."""

    def __init__(self, table_sizes: Sequence[int], dim: int):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in table_sizes)
        for bag, n in zip(self.bags, table_sizes):
            nn.init.uniform_(bag.weight, -n ** -0.5, n ** -0.5)  # DLRM's initialisation

    def forward(self, indices: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([bag(i, o) for bag, i, o in zip(self.bags, indices, offsets)], dim=1)


class DLRM(nn.Module):
    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        self.cfg = cfg
        t, d = len(cfg.table_sizes), cfg.embedding_dim
        self.bottom = _mlp((cfg.dense_features, *cfg.bottom, d))
        self.embeddings = EmbeddingBagCollection(cfg.table_sizes, d)
        self.top = _mlp((d + (t + 1) * t // 2, *cfg.top, 1))
        rows, cols = torch.tril_indices(t + 1, t + 1, offset=-1)
        self.register_buffer("pairs", torch.stack([rows, cols]), persistent=False)

    def forward(self, dense: torch.Tensor, indices: Sequence[torch.Tensor],
                offsets: Sequence[torch.Tensor]) -> torch.Tensor:
        """dense [B, F], per table a bag per sample → click logits [B]."""
        x = F.relu(self.bottom(dense))                         # [B, D]
        emb = self.embeddings(indices, offsets)                # [B, T, D]
        z = torch.cat([x.unsqueeze(1), emb], dim=1)            # [B, T+1, D]
        dots = z @ z.transpose(1, 2)                           # [B, T+1, T+1]
        pairs = dots[:, self.pairs[0], self.pairs[1]]          # [B, (T+1)T/2]
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)  # [B]
