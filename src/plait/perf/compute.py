"""Compute costs as a roofline: max(FLOPs / rate, bytes / bandwidth) + launch.

rate = peak(dtype) * matmul_efficiency and bandwidth = mem_bw * mem_efficiency
(hardware.Accelerator).  A calibrated MachineProfile's ``compute_flops`` can
stand in for the rate via ``flops_rate``.
"""

from __future__ import annotations

from .hardware import Accelerator, dtype_bytes

__all__ = [
    "gemm_flops",
    "roofline_time",
    "gemm_time",
    "gemv_time",
    "embedding_bag_time",
]


def gemm_flops(m: int, k: int, n: int) -> float:
    """FLOPs of [m, k] @ [k, n]."""
    return 2.0 * m * k * n


def roofline_time(flops: float, nbytes: float, acc: Accelerator, dtype: str = "bf16", *,
                  flops_rate: float | None = None, launches: int = 1) -> float:
    """Seconds for a kernel doing ``flops`` and moving ``nbytes`` of memory."""
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops}, {nbytes}")
    rate = flops_rate if flops_rate is not None else acc.flops(dtype) * acc.matmul_efficiency
    bw = acc.mem_bw_Bps * acc.mem_efficiency
    return max(flops / rate, nbytes / bw) + launches * acc.launch_s


def gemm_time(m: int, k: int, n: int, acc: Accelerator, dtype: str = "bf16", *,
              flops_rate: float | None = None) -> float:
    """[m, k] @ [k, n]: reads both operands once and writes the output once."""
    if min(m, k, n) <= 0:
        return 0.0
    nbytes = (m * k + k * n + m * n) * dtype_bytes(dtype)
    return roofline_time(gemm_flops(m, k, n), nbytes, acc, dtype, flops_rate=flops_rate)


def gemv_time(k: int, n: int, acc: Accelerator, dtype: str = "bf16", *, batch: int = 1,
              flops_rate: float | None = None) -> float:
    """[batch, k] @ [k, n] with small batch: bound by reading the [k, n] weight."""
    return gemm_time(batch, k, n, acc, dtype, flops_rate=flops_rate)


def embedding_bag_time(*, lookups: int, dim: int, acc: Accelerator, dtype: str = "fp32",
                       bags: int | None = None) -> float:
    """Pooled lookups: ``lookups`` rows of ``dim`` read, summed into ``bags`` outputs.

    Memory-bound: each looked-up row is read once; each bag is written once.
    """
    if lookups <= 0:
        return 0.0
    bags = lookups if bags is None else bags
    row = dim * dtype_bytes(dtype)
    flops = float(lookups) * dim  # one add per element
    return roofline_time(flops, (lookups + bags) * row, acc, dtype)
