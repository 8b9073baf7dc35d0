"""Hardware catalog: accelerators and links, every figure with its source.

Peak rates are the vendors' *dense* figures (datasheets print sparse figures,
twice as large, with an asterisk; those are halved here).  "Efficiency" fields
turn a peak into what software reaches; each says where its number comes from
and which are plain assumptions.

Bandwidths are bytes per second **per direction, per GPU** (the figure that
nccl-tests' bus bandwidth is compared with).  Latencies are seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

__all__ = [
    "Accelerator",
    "Link",
    "ACCELERATORS",
    "LINKS",
    "DTYPE_BYTES",
    "get_accelerator",
    "get_link",
    "dtype_bytes",
]

T = 1e12
G = 1e9

DTYPE_BYTES: Mapping[str, int] = MappingProxyType(
    {"fp64": 8, "fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
)

# Achieved / peak of a large dense GEMM.  Flux README (bytedance/flux, "Performance"
# table): torch GEMM 4096x12288x6144 fp16 per rank = 618.5 GFLOP in 2.438 ms on
# A800 = 253.7 TFLOP/s of 312 peak -> 0.81.  Used for every NVIDIA part; the
# H800 rows of the same table are *validation* rows, never fitted.
_GEMM_EFF_NVIDIA = 0.81
_GEMM_EFF_SOURCE = "Flux README perf table, A800 torch GEMM row: 253.7/312 TFLOP/s"
# Assumption (no published figure used): streaming kernels reach ~90 % of HBM peak.
_MEM_EFF = 0.90
# Attention kernels (FlashAttention-2 class, what SDPA runs): "FlashAttention-3"
# (Shah et al., 2024) abstract: FA2 reaches "only 35% utilization on the H100";
# "FlashAttention-2" (Dao, 2023) abstract: "50-73% of the theoretical maximum
# FLOPs/s on A100" (range; midpoint 0.615 used).
_ATTN_EFF_HOPPER = 0.35
_ATTN_EFF_AMPERE = 0.615


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """One accelerator model.

    name: catalog key.
    peak_flops: dense peak FLOP/s per dtype ("bf16", "fp32", ...).
    mem_bw_Bps: peak memory bandwidth, bytes/s.
    mem_bytes: memory capacity, bytes.
    matmul_efficiency: achieved/peak for large GEMMs.
    mem_efficiency: achieved/peak for streaming (memory-bound) kernels.
    attention_efficiency: achieved/peak of fused attention kernels.
    launch_s: fixed cost of one kernel (launch + tail), seconds.
    source: where the figures come from.
    """

    name: str
    peak_flops: Mapping[str, float]
    mem_bw_Bps: float
    mem_bytes: float
    matmul_efficiency: float = _GEMM_EFF_NVIDIA
    mem_efficiency: float = _MEM_EFF
    attention_efficiency: float = _ATTN_EFF_HOPPER
    launch_s: float = 5e-6  # assumption: order of a CUDA kernel launch
    source: str = ""

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; ValueError naming the known dtypes."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise ValueError(
                f"{self.name}: no peak rate for dtype {dtype!r}; known: {sorted(self.peak_flops)}"
            ) from None


@dataclass(frozen=True, kw_only=True)
class Link:
    """One interconnect, as seen by one GPU.

    name: catalog key.
    bw_Bps: line rate per direction per GPU, bytes/s.
    efficiency: fraction of line rate a collective library reaches.
    latency_s: per-step latency of the bandwidth ("Simple") protocol.
    ll_latency_s: per-step latency of the low-latency protocol (half bandwidth).
    base_s: fixed cost of one collective call.
    mesh_links: 0 for a switched fabric; else the point-to-point links of a full
        mesh over which bw_Bps is spread (a group of k GPUs uses k-1 of them).
    source: where the figures come from.
    """

    name: str
    bw_Bps: float
    efficiency: float
    latency_s: float
    ll_latency_s: float
    base_s: float = 8.4e-6
    mesh_links: int = 0
    source: str = ""

    @property
    def effective_bw_Bps(self) -> float:
        return self.bw_Bps * self.efficiency

    def for_group(self, k: int) -> "Link":
        """This link as seen by a group of ``k`` GPUs (a mesh only lends k-1 links)."""
        if not self.mesh_links or k - 1 >= self.mesh_links:
            return self
        return dataclasses.replace(self, bw_Bps=self.bw_Bps * max(k - 1, 1) / self.mesh_links)


_NV_DS = "NVIDIA {} datasheet (dense figures = sparse/2)"
_A100 = {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T}
_H100 = {
    "fp64": 67 * T, "fp32": 67 * T, "tf32": 494.7 * T,
    "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T,
}


def _acc(**kw) -> Accelerator:
    kw["peak_flops"] = MappingProxyType(dict(kw["peak_flops"]))
    return Accelerator(**kw)


ACCELERATORS: Mapping[str, Accelerator] = MappingProxyType({
    "A100": _acc(name="A100", peak_flops=_A100, mem_bw_Bps=2039 * G, mem_bytes=80e9,
                 attention_efficiency=_ATTN_EFF_AMPERE,
                 source=_NV_DS.format("A100 80GB SXM4") + "; GEMM eff: " + _GEMM_EFF_SOURCE),
    "A800": _acc(name="A800", peak_flops=_A100, mem_bw_Bps=2039 * G, mem_bytes=80e9,
                 attention_efficiency=_ATTN_EFF_AMPERE,
                 source="A100 compute/memory with 8 NVLinks (export part); "
                        "astra-sim-alibabacloud CalbusBw.h A800_NVLINKS=8"),
    "H100": _acc(name="H100", peak_flops=_H100, mem_bw_Bps=3350 * G, mem_bytes=80e9,
                 source=_NV_DS.format("H100 SXM5") + "; GEMM eff: " + _GEMM_EFF_SOURCE),
    # torchtitan benchmarks (llama3_h100_202412_torchtitan.md, asyncTP_llama3_h100_
    # 2025-06_torchtitan.md): Grand Teton H100, 96 GB HBM2e at 2.4 TB/s, 500 W limit;
    # "the actual peak TFLOPs number is between SXM and NVL".  Range: SXM 989.4,
    # NVL 835.5 dense bf16 (H100 datasheet, NVL = 1,671/2); midpoint used.
    "H100-500W": _acc(name="H100-500W",
                      peak_flops={k: v * (989.4 + 835.5) / 2 / 989.4 for k, v in _H100.items()},
                      mem_bw_Bps=2400 * G, mem_bytes=96e9,
                      source="torchtitan H100 benchmark hardware notes; peak = midpoint of the "
                             "SXM..NVL range (H100 datasheet)"),
    "H800": _acc(name="H800", peak_flops=_H100, mem_bw_Bps=3350 * G, mem_bytes=80e9,
                 source="H100 SXM compute/memory with 8 NVLinks (export part); "
                        "astra-sim-alibabacloud CalbusBw.h H800_NVLINKS=8"),
    "H200": _acc(name="H200", peak_flops=_H100, mem_bw_Bps=4800 * G, mem_bytes=141e9,
                 source=_NV_DS.format("H200 SXM") + " (H100 compute, 141 GB HBM3e at 4.8 TB/s)"),
    "MI300X": _acc(
        name="MI300X",
        peak_flops={"fp64": 163.4 * T, "fp32": 163.4 * T, "tf32": 653.7 * T,
                    "bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T},
        mem_bw_Bps=5300 * G, mem_bytes=192e9,
        source="AMD Instinct MI300X datasheet (dense matrix peaks); GEMM efficiency "
               "assumed equal to the NVIDIA figure (no published AMD figure used)"),
    # Measured on plait's 2-vCPU AMD EPYC development VM with torch 2.x, 2 threads:
    # fp32 2048^3 matmul 132.7 GFLOP/s, bf16 1024^3 366 GFLOP/s, 256 MiB tensor copy
    # 38.6 GB/s counting read+write.  Measured figures, so efficiencies are 1.
    "CPU": _acc(name="CPU", peak_flops={"fp32": 132.7 * G, "bf16": 366 * G, "fp16": 366 * G,
                                        "fp64": 66 * G},
                mem_bw_Bps=38.6 * G, mem_bytes=23e9, matmul_efficiency=1.0,
                mem_efficiency=1.0, attention_efficiency=1.0, launch_s=2e-6,
                source="measured on the plait dev VM (2 vCPU AMD EPYC, torch matmul/copy)"),
})

# NCCL src/graph/tuning.cc, hwLat[...][Ring][LL / Simple] and baseLat[Ring]:
# NVLink 0.6 / 3.4 us, PCI 1.0 / 5.7 us, NET 2.7 / 14.0 us; base 8.4 us (Simple).
_NCCL_LAT = "NCCL src/graph/tuning.cc hwLat/baseLat tables (ring, LL and Simple)"
_NVL_LAT = dict(latency_s=3.4e-6, ll_latency_s=0.6e-6)
_PCI_LAT = dict(latency_s=5.7e-6, ll_latency_s=1.0e-6)
_NET_LAT = dict(latency_s=14.0e-6, ll_latency_s=2.7e-6)
# NCCL src/graph/topo.h effective per-NVLink bandwidth: SM80 20.0, SM90 20.6 GB/s,
# against 25 GB/s line rate per link per direction.
_TOPO = "NCCL src/graph/topo.h SM{}_NVLINK_BW={} GB/s per link of 25 GB/s; "


def _link(name: str, bw: float, eff: float, lat: dict, source: str, **kw) -> Link:
    return Link(name=name, bw_Bps=bw, efficiency=eff, source=source + "; " + _NCCL_LAT, **lat, **kw)


LINKS: Mapping[str, Link] = MappingProxyType({
    "nvlink3": _link("nvlink3", 12 * 25 * G, 20.0 / 25, _NVL_LAT,
                     _TOPO.format(80, 20.0) + "A100: 12 links, 600 GB/s bidirectional (datasheet)"),
    "nvlink3-a800": _link("nvlink3-a800", 8 * 25 * G, 20.0 / 25, _NVL_LAT,
                          _TOPO.format(80, 20.0) + "A800: 8 links, 400 GB/s bidirectional"),
    "nvlink4": _link("nvlink4", 18 * 25 * G, 20.6 / 25, _NVL_LAT,
                     _TOPO.format(90, 20.6) + "H100/H200: 18 links, 900 GB/s bidirectional"),
    "nvlink4-h800": _link("nvlink4-h800", 8 * 25 * G, 20.6 / 25, _NVL_LAT,
                          _TOPO.format(90, 20.6) + "H800: 8 links, 400 GB/s bidirectional"),
    "infinity-fabric": _link(
        "infinity-fabric", 7 * 64 * G, 0.80, _NVL_LAT,
        "AMD MI300X datasheet: 7 Infinity Fabric links, 128 GB/s bidirectional each, full "
        "mesh of 8; efficiency and latency assumed equal to NVLink's", mesh_links=7),
    "pcie4": _link("pcie4", 31.5 * G, 0.80, _PCI_LAT,
                   "PCIe 4.0 x16: 16 GT/s x16, 128b/130b = 31.5 GB/s per direction; "
                   "efficiency 0.8 as astra-sim-alibabacloud CalbusBw.h (A100_PCIE_BW 32*0.8)"),
    "pcie5": _link("pcie5", 63.0 * G, 0.80, _PCI_LAT,
                   "PCIe 5.0 x16: 32 GT/s x16 = 63 GB/s per direction; efficiency 0.8 as "
                   "astra-sim-alibabacloud CalbusBw.h (H100_PCIE_BW 64*0.8)"),
    "ib-hdr": _link("ib-hdr", 25 * G, 23.5 / 25, _NET_LAT,
                    "InfiniBand HDR 200 Gb/s per GPU NIC; astra-sim-alibabacloud CX6_BW 23.5 of 25"),
    "ib-ndr": _link("ib-ndr", 50 * G, 48.5 / 50, _NET_LAT,
                    "InfiniBand NDR 400 Gb/s per GPU NIC; astra-sim-alibabacloud CX7_BW 48.5 of 50"),
    "roce-200": _link("roce-200", 25 * G, 23.5 / 25, _NET_LAT,
                      "RoCE 200 GbE per GPU NIC (ConnectX-6 class, efficiency as ib-hdr)"),
    "roce-400": _link("roce-400", 50 * G, 48.5 / 50, _NET_LAT,
                      "RoCE 400 GbE per GPU NIC (ConnectX-7 class, efficiency as ib-ndr)"),
    "eth-100g": _link("eth-100g", 12.5 * G, 12.0 / 12.5, _NET_LAT,
                      "100 GbE; NCCL topo.h NET_BW 12.0 GB/s for 100 Gbit"),
    # TCP sockets: assumed 94 % goodput (typical iperf on GbE) and 50 us per step.
    "eth-25g": Link(name="eth-25g", bw_Bps=3.125 * G, efficiency=0.94, latency_s=50e-6,
                    ll_latency_s=50e-6, base_s=20e-6,
                    source="25 GbE line rate; TCP goodput and latency assumed"),
    "eth-10g": Link(name="eth-10g", bw_Bps=1.25 * G, efficiency=0.94, latency_s=50e-6,
                    ll_latency_s=50e-6, base_s=20e-6,
                    source="10 GbE line rate; TCP goodput and latency assumed"),
    "eth-1g": Link(name="eth-1g", bw_Bps=0.125 * G, efficiency=0.94, latency_s=100e-6,
                   ll_latency_s=100e-6, base_s=20e-6,
                   source="1 GbE line rate; TCP goodput and latency assumed"),
})


def _lookup(table: Mapping, kind: str, name: str, field_name: str):
    key = {k.lower(): k for k in table}.get(str(name).lower())
    if key is None:
        raise ValueError(f"{field_name}: unknown {kind} {name!r}; known: {', '.join(table)}")
    return table[key]


def get_accelerator(name: str, *, field_name: str = "gpu") -> Accelerator:
    """Catalog entry for ``name`` (case-insensitive); ValueError naming the field."""
    return _lookup(ACCELERATORS, "GPU", name, field_name)


def get_link(name: str, *, field_name: str = "link") -> Link:
    """Catalog entry for ``name`` (case-insensitive); ValueError naming the field."""
    return _lookup(LINKS, "link", name, field_name)


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None
