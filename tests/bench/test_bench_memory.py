"""The peak-memory probe the ops benchmark reports: counts what a call creates, while it lives."""

import torch

from plait.bench.memory import peak_bytes


def test_counts_live_tensors_and_their_peak():
    def two_then_one():
        a = torch.empty(1024)  # 4 KiB
        b = torch.empty(2048)  # 8 KiB, both alive: 12 KiB
        del a
        return b + 1  # b and the result: 16 KiB

    assert peak_bytes(two_then_one) == 16 * 1024


def test_views_in_place_and_out_ops_cost_nothing():
    x = torch.randn(256, 256)
    out = torch.empty(256, 256)
    assert peak_bytes(lambda: x[:, :128].t()) == 0
    assert peak_bytes(lambda: x.mul_(1.0)) == 0
    assert peak_bytes(lambda: torch.matmul(x, x, out=out)) == 0
    assert peak_bytes(lambda: x @ x) == 256 * 256 * 4
