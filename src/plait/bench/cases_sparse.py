"""Benchmark cases for the all-to-all operators: DLRM embeddings and MoE dispatch/combine.

Each case is a :class:`plait.bench.case.Case`: ``compute`` (the
operator's local work alone), ``comm`` (its plain-path all_to_all alone, on
ready buffers), ``result`` (what the two give, one after the other) and
``run(chunks)``; ``flops`` and ``comm_bytes`` per rank. Routing is uneven and
the same on every rank (one shared seed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .case import SLOTS, Case, all_to_all_equal, all_to_all_pieces
from ..ops import all_to_all_matmul, embedding_all_to_all, matmul_all_to_all
from ..ops.context import transport_of

__all__ = ["SPARSE_CASES", "EmbeddingCase", "DispatchCase", "CombineCase"]


class _Base(Case):
    seed = 4321


class EmbeddingCase(_Base):
    """``tables`` tables of ``rows`` × ``dim`` per rank, global batch ``batch``, ``pool`` ids a bag."""

    op = "embedding_all_to_all"

    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        t, n, d, b, pool = (shape[k] for k in ("tables", "rows", "dim", "batch", "pool"))
        self.tables = [torch.randn(n, d, generator=self.gen, dtype=dtype) for _ in range(t)]
        self.indices = [torch.randint(0, n, (b * pool,), generator=self.gen) for _ in range(t)]
        self.offsets = [torch.arange(0, b * pool, pool) for _ in range(t)]
        self.pooled = [torch.empty(t, b, d, dtype=dtype) for _ in range(SLOTS)]
        self.recv = [torch.empty_like(p) for p in self.pooled]
        self.flops = 2.0 * t * b * pool * d  # one add per looked-up element (memory-bound)
        self.comm_bytes = (self.world - 1) / self.world * t * b * d * 4

    def result(self, slot=0):  # [B_r, T, D], tables by owner rank, as the operator returns it
        t, b, d = self.recv[slot].shape
        by_source = self.recv[slot].view(self.world, b // self.world, t, d)  # [W, B_r, T_s, D]
        return by_source.transpose(0, 1).reshape(b // self.world, self.world * t, d)

    def compute(self, slot=0):
        for t, table in enumerate(self.tables):
            self.pooled[slot][t] = F.embedding_bag(self.indices[t], table, self.offsets[t],
                                                   mode="sum")

    def comm(self, async_op=False, slot=0):  # [T, B, D] cut along B: each destination's rows
        send = self.pooled[slot].transpose(0, 1).contiguous()
        return all_to_all_equal(self.recv[slot].view_as(send), send, async_op=async_op)

    def run(self, chunks):
        return embedding_all_to_all(self.tables, self.indices, self.offsets, chunks=chunks)

    def comm_pieces(self, pieces, slot=0):
        send = self.pooled[slot].transpose(0, 1).contiguous()  # [B, T, D]
        rows = [send.shape[0] // self.world] * self.world
        return all_to_all_pieces(self.recv[slot].view_as(send), send, rows, rows, pieces)

    def received(self, slot=0):
        return self.recv[slot]

    def sent_bytes(self):  # each destination's bags of every table
        block = self.pooled[0].numel() // self.world * self.pooled[0].element_size()
        return [[0.0 if s == d else block for d in range(self.world)] for s in range(self.world)]


def _routing(world: int, experts: int, tokens: int) -> torch.Tensor:
    """``c[s][d][e]``: tokens rank s sends to expert e of rank d; skewed, same on every rank."""
    gen = torch.Generator().manual_seed(99)
    weights = torch.rand(world * experts, generator=gen) ** 3 + 0.05  # a few hot experts
    counts = torch.stack([torch.bincount(torch.multinomial(weights, tokens, True, generator=gen),
                                         minlength=world * experts) for _ in range(world)])
    return counts.view(world, world, experts)


class _MoE(_Base):
    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        tokens, h, f, e = (shape[k] for k in ("tokens", "hidden", "ffn", "experts"))
        counts = _routing(self.world, e, tokens)
        self.rows_table = counts.sum(2).tolist()  # [s][d]: tokens rank s sends rank d
        self.send_counts = counts[self.rank].tolist()
        self.recv_counts = counts[:, self.rank].tolist()
        self.t_send, self.t_recv = tokens, int(counts[:, self.rank].sum())
        self.h, self.f, self.e = h, f, e
        self.flops = 2.0 * self.t_recv * h * f
        remote = tokens - int(counts[self.rank, self.rank].sum())
        self.send_rows = [int(counts[self.rank, d].sum()) for d in range(self.world)]
        self.recv_rows = [int(counts[s, self.rank].sum()) for s in range(self.world)]
        self.remote = remote

    def _expert_matmuls(self, a, w, out):
        at = 0
        for s in range(self.world):
            for e in range(self.e):
                n = self.recv_counts[s][e]
                torch.matmul(a[at:at + n], w[e], out=out[at:at + n])
                at += n


class DispatchCase(_MoE):
    op = "all_to_all_matmul"
    comm_first = True

    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        self.x = torch.randn(self.t_send, self.h, generator=self.gen, dtype=dtype)
        self.w = torch.randn(self.e, self.h, self.f, generator=self.gen, dtype=dtype) / self.h ** 0.5
        self.arrived = [torch.randn(self.t_recv, self.h, generator=self.gen, dtype=dtype)
                        for _ in range(SLOTS)]
        self.y = [torch.empty(self.t_recv, self.f, dtype=dtype) for _ in range(SLOTS)]
        self.comm_bytes = self.remote * self.h * 4

    def result(self, slot=0):
        return self.y[slot]

    def compute(self, slot=0):
        self._expert_matmuls(self.arrived[slot], self.w, self.y[slot])

    def comm(self, async_op=False, slot=0):
        return transport_of(None).all_to_all(self.arrived[slot], self.x, self.recv_rows,
                                             self.send_rows, async_op=async_op)

    def run(self, chunks):
        return all_to_all_matmul(self.x, self.w, self.send_counts, self.recv_counts, chunks=chunks)

    def comm_pieces(self, pieces, slot=0):
        return all_to_all_pieces(self.arrived[slot], self.x, self.recv_rows, self.send_rows, pieces)

    def received(self, slot=0):
        return self.arrived[slot]

    def sent_bytes(self):  # the tokens, [H] each, to their experts' ranks
        size = self.h * self.x.element_size()
        return [[0.0 if s == d else n * size for d, n in enumerate(row)]
                for s, row in enumerate(self.rows_table)]


class CombineCase(_MoE):
    op = "matmul_all_to_all"

    def __init__(self, shape, dtype):
        super().__init__(shape, dtype)
        self.y = torch.randn(self.t_recv, self.f, generator=self.gen, dtype=dtype)
        self.w = torch.randn(self.e, self.f, self.h, generator=self.gen, dtype=dtype) / self.f ** 0.5
        self.out_local = [torch.empty(self.t_recv, self.h, dtype=dtype) for _ in range(SLOTS)]
        self.back = [torch.empty(self.t_send, self.h, dtype=dtype) for _ in range(SLOTS)]
        self.flops = 2.0 * self.t_recv * self.h * self.f
        self.comm_bytes = (self.t_recv - self.recv_counts_own()) * self.h * 4

    def recv_counts_own(self) -> int:
        return sum(self.recv_counts[self.rank])

    def result(self, slot=0):
        return self.back[slot]

    def compute(self, slot=0):
        self._expert_matmuls(self.y, self.w, self.out_local[slot])

    def comm(self, async_op=False, slot=0):
        return transport_of(None).all_to_all(self.back[slot], self.out_local[slot],
                                             self.send_rows, self.recv_rows, async_op=async_op)

    def run(self, chunks):
        return matmul_all_to_all(self.y, self.w, self.send_counts, self.recv_counts, chunks=chunks)

    def comm_pieces(self, pieces, slot=0):
        return all_to_all_pieces(self.back[slot], self.out_local[slot], self.send_rows,
                                 self.recv_rows, pieces)

    def received(self, slot=0):
        return self.back[slot]

    def sent_bytes(self):  # the experts' outputs, [H] each, back to the tokens' ranks
        size = self.h * self.y.element_size()
        return [[0.0 if s == d else self.rows_table[d][s] * size for d in range(self.world)]
                for s in range(self.world)]


SPARSE_CASES = {c.op: c for c in (EmbeddingCase, DispatchCase, CombineCase)}
