"""A small GPT (nanoGPT-like), single-device and free of parallel code.

``plait.parallel.apply_tp`` makes it tensor-parallel by replacing its
modules: attention QKV column-parallel by heads, the output projection
row-parallel; the MLP's fc column-parallel, proj row-parallel; with
``n_experts > 0`` the MLPs are mixtures of experts (``plait.models.moe``),
made expert-parallel. The forward reads the head count from the tensors, so
it runs unchanged on a rank's share of the heads.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import GPTConfig, moe_gpt_config
from .moe import MoEFeedForward

__all__ = ["GPTConfig", "GPT", "CausalSelfAttention", "MLP", "Block", "moe_gpt_config"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # [q | k | v], heads in order
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.heads(x))          # [B, S, h·hd] → [B, S, D]

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before the output projection: [B, S, D] → [B, S, h·hd]."""
        qkv = self.qkv(x)                        # [B, S, 3·h·hd] (h: this module's heads)
        b, s, _ = qkv.shape
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2)  # [B, h, S, hd]
                   for t in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, -1)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.hidden(x))  # [B, S, D] → [B, S, 4D] → [B, S, D]

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before the output projection: [B, S, D] → [B, S, 4D]."""
        return F.gelu(self.fc(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        if cfg.n_experts:
            self.mlp = MoEFeedForward(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, cfg.n_experts,
                                      cfg.top_k)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for pre, proj in self.branches():
            y = pre(x)
            x = x + (y if proj is None else proj(y))
        return x

    def branches(self) -> list:
        """The block as its residual branches in order, each ``x = x + proj(pre(x))``
        (``proj`` None: ``pre`` is the whole branch). ``plait.nn`` runs them this way on
        micro-batches, with one micro-batch's projection on the wire under another's."""
        attn = (lambda x: self.attn.heads(self.ln_1(x)), self.attn.proj)
        if isinstance(self.mlp, MLP):
            return [attn, (lambda x: self.mlp.hidden(self.ln_2(x)), self.mlp.proj)]
        return [attn, (lambda x: self.mlp(self.ln_2(x)), None)]


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx [B, S] token ids → logits [B, S, V] (and the mean cross-entropy with targets)."""
        s = idx.shape[1]
        if s > self.cfg.block_size:
            raise ValueError(f"sequence of {s} is longer than block_size {self.cfg.block_size}")
        pos = torch.arange(s, device=idx.device)
        logits = self.run_blocks(self.wte(idx) + self.wpe(pos), self.head)  # [B, S, V]
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def run_blocks(self, x: torch.Tensor, then) -> torch.Tensor:
        """``then`` of the residual stream through every block ([B, S, D] in; ``then`` is
        row-wise). ``plait.nn`` may give a parallel model its own: micro-batches interleaved."""
        for block in self.blocks:
            x = block(x)
        return then(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The final LayerNorm and the LM head: [B, S, D] → logits [B, S, V]."""
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
