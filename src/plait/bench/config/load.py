"""``plait bench load``'s settings (``LoadBenchConfig``): the checkpoint's size and files, and
the world sizes it is loaded on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...runtime.fields import help_meta as _h

__all__ = ["LoadBenchConfig"]


@dataclass(frozen=True, kw_only=True)
class LoadBenchConfig:
    size_gb: float = field(default=2.0, metadata=_h("the model's float32 weights, GB (at least"
                                                    " 0.01)"))
    worlds: tuple[int, ...] = field(default=(2, 3), metadata=_h("world sizes to load on"))
    max_shard_mb: int = field(default=500, metadata=_h("save_pretrained's largest file, MB"))
    dir: str | None = field(default=None, metadata=_h(
        "where the checkpoint is written (default: a new temporary folder, removed after)"))

    def __post_init__(self) -> None:
        if not self.size_gb >= 0.01:
            raise ValueError(f"--size-gb must be at least 0.01, got {self.size_gb}")
        worlds = tuple(int(w) for w in self.worlds)
        if not worlds or any(w < 1 for w in worlds):
            raise ValueError(f"--worlds must be world sizes of at least 1, got {self.worlds}")
        object.__setattr__(self, "worlds", worlds)
        if self.max_shard_mb < 1:
            raise ValueError(f"--max-shard-mb must be at least 1, got {self.max_shard_mb}")

    def llama(self) -> dict:
        """The Llama config's fields for at least ``size_gb`` GB of float32 weights."""
        width, vocab = (2048, 32000) if self.size_gb >= 0.5 else (256, 4096)
        inter = width * 11 // 4
        per_layer = width * width * 2.5 + 3 * width * inter + 2 * width
        layers = max(1, math.ceil((self.size_gb * 1e9 / 4 - 2 * vocab * width) / per_layer))
        return dict(vocab_size=vocab, hidden_size=width, intermediate_size=inter,
                    num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                    max_position_embeddings=256, tie_word_embeddings=False)
