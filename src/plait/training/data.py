"""Training data that needs no download: stdlib source text, and a synthetic click log.

``CharCorpus``: character-level text from a fixed list of the Python standard
library's own source files (present wherever Python is), ASCII, with a fixed
97-symbol vocabulary (tab, newline and the 95 printable characters; anything
else reads as ``?``). The first 90 % is for training, the last 10 % held out.
Deterministic for a given Python version; every rank of a run reads the same.

``ClickLog``: a synthetic DLRM click log. Categorical features are bags of
1–3 ids drawn from a Zipf (power-law) distribution over each table's rows, as
in real click logs; the click is drawn from a planted logistic model (a dense
linear term, a per-row effect in every table and one pairwise interaction
between tables 0 and 1), so a model's loss falls for a reason and has a known
floor (``bayes_loss``: the loss of the true click probabilities).
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np
import torch

__all__ = ["CharCorpus", "ClickLog", "CHARS", "STDLIB_FILES"]

CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))

STDLIB_FILES = (
    "argparse.py", "ast.py", "collections/__init__.py", "dataclasses.py", "enum.py",
    "functools.py", "inspect.py", "json/decoder.py", "json/encoder.py", "logging/__init__.py",
    "os.py", "pathlib.py", "pathlib/__init__.py", "random.py", "shutil.py", "string.py",
    "subprocess.py", "textwrap.py", "threading.py", "typing.py", "unittest/case.py",
)
"""Read in this order, those that exist (pathlib is a package from Python 3.13)."""


class CharCorpus:
    """Token ids [N] of the stdlib corpus; ``split`` "train" (first 90 %) or "heldout"."""

    def __init__(self, ids: torch.Tensor, files: Sequence[str]):
        self.ids, self.files = ids, list(files)
        self.cut = int(0.9 * len(ids))

    @classmethod
    def load(cls, root: str | None = None, files: Sequence[str] = STDLIB_FILES) -> "CharCorpus":
        root = root or os.path.dirname(os.__file__)
        found = [f for f in files if os.path.isfile(os.path.join(root, f))]
        if not found:
            raise FileNotFoundError(f"none of the corpus files {list(files)} is under {root}")
        text = "\n".join(open(os.path.join(root, f), encoding="utf-8", errors="replace").read()
                         for f in found)
        return cls(torch.from_numpy(cls.encode(text)), found)

    @staticmethod
    def encode(text: str) -> np.ndarray:
        table = np.full(256, CHARS.index("?"), dtype=np.int64)
        table[[ord(c) for c in CHARS]] = np.arange(len(CHARS))
        return table[np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)]

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        return "".join(CHARS[int(i)] for i in ids)

    @property
    def vocab_size(self) -> int:
        return len(CHARS)

    def split(self, name: str) -> torch.Tensor:
        if name not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {name!r}")
        return self.ids[:self.cut] if name == "train" else self.ids[self.cut:]

    def batch(self, name: str, batch_size: int, seq_len: int,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) [B, S]: random windows of the split, y shifted by one."""
        data = self.split(name)
        if len(data) <= seq_len + 1:
            raise ValueError(f"the {name} split has {len(data)} tokens, too few for seq_len {seq_len}")
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        rows = starts.unsqueeze(1) + torch.arange(seq_len + 1)
        window = data[rows]  # [B, S + 1]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def batches(self, name: str, batch_size: int, seq_len: int, seed: int) -> Iterator:
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield self.batch(name, batch_size, seq_len, gen)


class ClickLog:
    """A synthetic click log over ``table_sizes`` tables with a planted logistic signal."""

    def __init__(self, table_sizes: Sequence[int], dense_features: int = 13, *,
                 zipf_exponent: float = 1.05, max_bag: int = 3, seed: int = 0):
        self.table_sizes, self.dense_features = list(table_sizes), dense_features
        self.max_bag = max_bag
        gen = torch.Generator().manual_seed(seed)
        self.popularity = []  # per table: Zipf probabilities over a random order of its rows
        for n in self.table_sizes:
            ranks = torch.randperm(n, generator=gen).double() + 1.0
            weights = ranks ** -zipf_exponent
            self.popularity.append(weights / weights.sum())
        t = len(self.table_sizes)
        self.dense_w = torch.randn(dense_features, generator=gen, dtype=torch.float64) * \
            (1.0 / dense_features ** 0.5)
        self.row_effect = [torch.randn(n, generator=gen, dtype=torch.float64) * (1.2 / t ** 0.5)
                           for n in self.table_sizes]
        pair = min(2, t)
        self.pair_vectors = [torch.randn(self.table_sizes[i], 2, generator=gen,
                                         dtype=torch.float64) for i in range(pair)]
        self.bias = -0.3

    def sample(self, batch_size: int, gen: torch.Generator):
        """(dense [B, F], indices T × [nnz], offsets T × [B], labels [B], true probabilities [B])."""
        dense = torch.randn(batch_size, self.dense_features, generator=gen, dtype=torch.float64)
        logit = dense @ self.dense_w + self.bias
        indices, offsets, means = [], [], []
        for t, probs in enumerate(self.popularity):
            lengths = torch.randint(1, self.max_bag + 1, (batch_size,), generator=gen)
            idx = torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=gen)
            bag = torch.repeat_interleave(torch.arange(batch_size), lengths)
            offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]))
            indices.append(idx)
            logit = logit + torch.zeros(batch_size, dtype=torch.float64).index_add(
                0, bag, self.row_effect[t][idx]) / lengths
            if t < len(self.pair_vectors):
                means.append(torch.zeros(batch_size, 2, dtype=torch.float64).index_add(
                    0, bag, self.pair_vectors[t][idx]) / lengths.unsqueeze(1))
        if len(means) == 2:
            logit = logit + (means[0] * means[1]).sum(1)
        probs = torch.sigmoid(logit)
        labels = torch.bernoulli(probs, generator=gen)
        return dense.float(), indices, offsets, labels.float(), probs.float()

    def batches(self, batch_size: int, seed: int) -> Iterator:
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield self.sample(batch_size, gen)

    @staticmethod
    def bayes_loss(labels: torch.Tensor, probs: torch.Tensor) -> float:
        """The cross-entropy of the true click probabilities: the floor any model can reach."""
        return float(torch.nn.functional.binary_cross_entropy(probs.double(), labels.double()))
