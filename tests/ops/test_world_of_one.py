"""Every operator in a world of one: the plain result, forward and backward, at any piece
count (nothing to communicate, so each falls back and says why). A GPU run under NCCL
found matmul_reduce_scatter raising here (scripts/device_check.py); gloo did the same."""

import torch
import torch.nn.functional as F

from plait.ops import (all_gather_matmul, all_to_all_matmul, column_parallel_matmul,
                       embedding_all_to_all, explain, matmul_all_reduce, matmul_all_to_all,
                       matmul_reduce_scatter)
from plait.testing import run_ranks

CHUNKS = (1, 2, "auto")


def _full(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(True)


def _gap(fused, plain, inputs):
    """Largest difference of the outputs and of each input's gradient."""
    out = fused(*inputs)
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
    got = [out] + list(torch.autograd.grad(out, inputs, g))
    twins = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref = plain(*twins)
    want = [ref] + list(torch.autograd.grad(ref, twins, g))
    return max(float((a - b).abs().max()) for a, b in zip(got, want))


def _every_operator():
    gaps = {}
    for chunks in CHUNKS:
        x, w = _full(1, 64, 32), _full(2, 32, 48)
        for fn in (matmul_all_reduce, all_gather_matmul, matmul_reduce_scatter,
                   column_parallel_matmul):
            gaps[fn.__name__, chunks] = _gap(lambda a, b: fn(a, b, chunks=chunks),
                                             torch.matmul, (x, w))
        tables = [_full(3, 20, 8), _full(4, 30, 8)]
        idx = [torch.tensor([1, 5, 7, 19, 0, 3]), torch.tensor([2, 29, 4, 4, 11, 0])]
        offs = [torch.tensor([0, 2, 3, 6])[:-1]] * 2
        gaps["embedding_all_to_all", chunks] = _gap(
            lambda *t: embedding_all_to_all(list(t), idx, offs, chunks=chunks),
            lambda *t: torch.stack([F.embedding_bag(i, tab, o, mode="sum")
                                    for tab, i, o in zip(t, idx, offs)], dim=1),
            tuple(tables))
        counts = [[5, 3]]  # one rank, two experts: 5 tokens to expert 0, 3 to expert 1
        tokens, w_in, w_out = _full(5, 8, 16), _full(6, 2, 16, 12), _full(7, 2, 12, 16)

        def expert_mm(t, w):
            return torch.cat([t[:5] @ w[0], t[5:] @ w[1]])
        gaps["all_to_all_matmul", chunks] = _gap(
            lambda t, w: all_to_all_matmul(t, w, counts, counts, chunks=chunks), expert_mm,
            (tokens, w_in))
        gaps["matmul_all_to_all", chunks] = _gap(
            lambda t, w: matmul_all_to_all(t, w, counts, counts, chunks=chunks), expert_mm,
            (_full(8, 8, 12), w_out))
    return gaps, explain()


def test_every_operator_in_a_world_of_one_is_the_plain_one_forward_and_backward():
    (gaps, why), = run_ranks(_every_operator, 1)
    assert len(gaps) == 7 * len(CHUNKS)
    assert max(gaps.values()) < 1e-12, {k: v for k, v in gaps.items() if v >= 1e-12}
    lines = why.splitlines()
    assert lines and all("one rank: nothing to communicate" in line for line in lines), why
