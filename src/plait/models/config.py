"""The small models' sizes (``GPTConfig``, ``DLRMConfig``), checked where they are made and
free of torch, so a command line refuses a size before it imports torch."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTConfig", "DLRMConfig", "moe_gpt_config"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 97    # plait.training.data.CHARS
    block_size: int = 64   # longest sequence
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    bias: bool = True
    n_experts: int = 0     # > 0: every MLP is a mixture of this many experts
    top_k: int = 2

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} (--n-embd) does not divide into n_head "
                             f"{self.n_head} (--n-head) heads of equal width")
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.mlp_ratio) < 1:
            raise ValueError(f"GPT sizes must be positive: {self}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_experts={self.n_experts}]")


def moe_gpt_config(**kw) -> GPTConfig:
    """A GPT whose MLPs are mixtures of experts (4 experts, top-2, each half an MLP wide)."""
    kw = {"n_experts": 4, "top_k": 2, "mlp_ratio": 2, **kw}
    return GPTConfig(**kw)


@dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    dense_features: int = 13
    table_sizes: tuple[int, ...] = (1000, 2000, 500, 4000, 1500, 800, 3000, 1200)
    embedding_dim: int = 16
    bottom: tuple[int, ...] = (64, 32)   # hidden widths; a last layer of embedding_dim is added
    top: tuple[int, ...] = (64, 32)      # hidden widths; a last layer of 1 is added

    def __post_init__(self) -> None:
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError(f"table_sizes {self.table_sizes} need at least one table of ≥ 1 row")
        if min(self.dense_features, self.embedding_dim) < 1:
            raise ValueError(f"dense_features and embedding_dim must be positive: {self}")
