"""Published figures the model is validated against, each with its source.

Where a source gives a range, both ends are stored and the comparison uses the
midpoint (``Reference.value``).  None of these numbers is used to set a model
constant, except those marked ``role="calibration"``, which are shown beside
the validation rows but never counted in its error.

Each row carries its own ``tolerance``: the relative error the model may have on
it, set by how precise the source is (an exact table entry, an "about", a
range), so that one row far off is not hidden by a median of the others.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Reference", "REFERENCES"]


@dataclass(frozen=True, kw_only=True)
class Reference:
    """case: row name; low/high: the published value or range; unit; source; role;
    tolerance: the relative error (of the midpoint) the model may have on this row."""

    case: str
    low: float
    high: float
    unit: str
    source: str
    role: str = "validation"
    note: str = ""
    tolerance: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.tolerance < 1 or self.low > self.high:
            raise ValueError(f"{self.case}: tolerance {self.tolerance} must be in (0, 1) and "
                             f"low {self.low} <= high {self.high}")

    @property
    def value(self) -> float:
        return (self.low + self.high) / 2


def _ref(case, value, unit, source, **kw) -> Reference:
    lo, hi = value if isinstance(value, tuple) else (value, value)
    return Reference(case=case, low=lo, high=hi, unit=unit, source=source, **kw)


_NCCL212 = ("NVIDIA/nccl-tests issue #212 'H100 all reduce performance is poor', NCCL "
            "maintainer comment 2024-05-06: 450 GB/s line rate, ~370 GB/s effective NVLink "
            "bandwidth seen as busBw with NCCL_ALGO=RING or non-allreduce operations")
_FLUX = ("bytedance/flux README 'Performance' table (8 GPUs, TP=8, fp16, M=4096 K=12288 "
         "N=49152)")
_SC24 = ("Punniyamurthy, Hamidouche, Beckmann, 'Optimizing Distributed ML Communication with "
         "Fused Computation-Collective Operations', SC'24 (abstract/evaluation)")
_ASYNC = ("pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (async TP "
          "vs vanilla TP, bf16 rows; Grand Teton H100, 500 W)")

REFERENCES = {r.case: r for r in (
    # "~370 GB/s" from a maintainer: an about, so 10 %
    _ref("nccl-tests all_reduce busbw, 8xH100, ring, 8 GiB", 370.0, "GB/s", _NCCL212,
         tolerance=0.10),
    _ref("nccl-tests all_gather busbw, 8xH100, 8 GiB", 370.0, "GB/s", _NCCL212, tolerance=0.10),
    # "~200 GB/s" read off a user's plot on one HPE system: the default 25 %
    _ref("nccl-tests all_reduce busbw, 8xA100 (NVSwitch), 1 GiB", 200.0, "GB/s",
         "NVIDIA/nccl-tests issue #149 'Expected bandwidth results? A100 GPUs over NVLink' "
         "(HPE Apollo 6500, 8xA100 80GB): 'busbw of ~200 GB/s' up to 1 GiB"),
    # calibration rows set a constant: a miss past 5 % means that constant moved
    _ref("Flux AG+GEMM 8xA800, torch total", 3.099, "ms", _FLUX + ", A800 row", role="calibration",
         note="its torch GEMM column sets the GEMM efficiency (hardware.py)", tolerance=0.05),
    _ref("Flux GEMM+RS 8xA800, torch total", 3.100, "ms", _FLUX + ", A800 row", role="calibration",
         tolerance=0.05),
    # measured table entries, same shapes as the model's: 10 %
    _ref("Flux AG+GEMM 8xH800, torch (unfused) total", 1.429, "ms", _FLUX + ", AG+Gemm(H800) row",
         tolerance=0.10),
    _ref("Flux AG+GEMM 8xH800, fused total", 0.957, "ms", _FLUX + ", AG+Gemm(H800) row",
         tolerance=0.10),
    _ref("Flux GEMM+RS 8xH800, torch (unfused) total", 1.408, "ms", _FLUX + ", Gemm+RS(H800) row",
         tolerance=0.10),
    _ref("Flux GEMM+RS 8xH800, fused total", 0.932, "ms", _FLUX + ", Gemm+RS(H800) row",
         tolerance=0.10),
    # the paper's and torchtitan's figures come from shapes and systems the model only
    # approximates (plait's shapes, a simulated cluster): the default 25 %
    _ref("SC'24 fused operators, 4 GPUs: lower combined time", (12.0, 20.0), "%", _SC24,
         note="range 12-20 %, compared to its midpoint; shapes are plait's (paper's not encoded)"),
    _ref("SC'24 DLRM at 128 nodes (simulated): lower training time", 21.0, "%", _SC24,
         note="'up to 21 %'; plait's dlrm preset on 128 nodes x 8 MI300X"),
    _ref("async TP Llama 3 8B, 64xH100 (FSDP 8, TP 8): throughput gain", 4809.4 / 4378 * 100 - 100,
         "%", _ASYNC + ": 4378 -> 4809.4 tokens/s"),
    _ref("async TP Llama 3 70B, 256xH100 (FSDP 32, TP 8): throughput gain", 652.4 / 597.3 * 100 - 100,
         "%", _ASYNC + ": 597.3 -> 652.4 tokens/s"),
)}
