"""A single-device, dropless top-k mixture of experts: the MLP of the MoE-GPT.

``plait.nn.MoE.from_module`` makes it expert-parallel; both route with
``plait.nn.moe.route_top_k`` and compute with ``experts_reference``'s math.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..nn.moe import experts_reference, route_top_k

__all__ = ["MoEFeedForward"]


class MoEFeedForward(nn.Module):
    """``out[t] = Σ_j p_j(t) · gelu(x_t @ w1[e_j]) @ w2[e_j]`` over the top-k experts of token t."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, ffn) * 0.02)   # [E, H, F]
        self.w2 = nn.Parameter(torch.randn(num_experts, ffn, hidden) * 0.02)   # [E, F, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])                                  # [T, H]
        weights, experts = route_top_k(self.router(x2), self.top_k)     # [T, k] each
        return experts_reference(x2, weights, experts, self.w1, self.w2).view(x.shape)

