"""The CUDA transport (torch's symmetric memory): which all-reduces it takes and which go to
NCCL, decided from the tensor alone (so every rank alike): float16 and sizes that are not a
multiple of 4 bytes go to NCCL (torch's kernels refuse them); and, where two GPUs are at
hand, a failed set-up falls back to NCCL with the reason, ranks whose sizes differ raise on
every rank, and two streams take turns on the one buffer.
"""

from __future__ import annotations

import pytest
import torch

from plait.transport.cuda import symm_mem_path


@pytest.mark.parametrize("dtype, numel, why", [
    (torch.float32, 1024, None),
    (torch.bfloat16, 1024, None),
    (torch.bfloat16, 1023, "not a multiple of 4"),
    (torch.float16, 1024, "float16"),
    (torch.float64, 1024, "float64"),
    (torch.float32, 1 << 20, "more than"),
])
def test_what_symmetric_memory_takes_and_what_goes_to_nccl(dtype, numel, why):
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    got = symm_mem_path(dtype, nbytes, capacity=1 << 20)
    assert (got is None) if why is None else (why in got), got


def _two_gpus():
    import torch.distributed as dist

    from plait.transport.select import choose

    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    transport = choose(None, "auto")
    seen = {"choice": transport.choice.name}
    x = torch.full((1000,), float(rank + 1), device="cuda")
    transport.all_reduce(x)
    seen["sum"] = x[0].item()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream: waits for the buffer's last user
        y = torch.full((2000,), 2.0, device="cuda")
        transport.all_reduce(y)
    torch.cuda.synchronize()
    seen["side"] = y[0].item()
    try:
        transport.all_reduce(torch.ones(500 + rank, device="cuda"))
        seen["sizes"] = None
    except ValueError as err:
        seen["sizes"] = str(err)
    return seen


@pytest.mark.may_skip("needs two CUDA devices (NCCL refuses two ranks on one GPU)")
def test_symmetric_memory_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from plait.runtime import launch

    for seen in launch(_two_gpus, 2, backend="nccl", threads=1, timeout_s=60):
        assert seen["choice"] in ("symm_mem", "nccl")
        assert seen["sum"] == 3.0 and seen["side"] == 4.0, seen
        assert seen["sizes"] is not None and "disagree" in seen["sizes"], seen
