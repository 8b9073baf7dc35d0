"""plait.perf: performance model and cluster simulator (pure computation, numpy only).

Hardware catalog (hardware), alpha-beta collective costs (collectives), roofline
compute (compute), the fused-operator piece pipeline: its closed form for the
simulator (pipeline) and the piece-by-piece walk the operators' ``chunks="auto"``
decides with (pieces), heterogeneous ranks under each balancing policy (hetero),
calibration from benchmark JSON (calibrate), configs and presets (config,
presets), the discrete-event simulator (simulator) and its validation (validate).
"""

from .calibrate import (
    DEFAULT_PROFILE,
    MachineProfile,
    default_profile_path,
    fit_pipeline,
    fit_profile,
    load_profile,
    load_records,
)
from .collectives import bus_bandwidth, bus_factor, collective_time, hierarchical_time
from .compute import embedding_bag_time, gemm_time, gemv_time
from .config import ClusterConfig, ModelConfig, ParallelConfig, SimConfig, SpeedConfig, load_config
from .hardware import ACCELERATORS, LINKS, get_accelerator, get_link
from .hetero import POLICIES, plan_policy, policy_step_time, react, step_policy
from .pipeline import ChunkChoice, PipelineOverheads, best_chunks, choose_chunks, fused_time
from .simulator import SimResult, VariantResult, simulate

__all__ = [
    "ACCELERATORS", "LINKS", "get_accelerator", "get_link",
    "collective_time", "hierarchical_time", "bus_factor", "bus_bandwidth",
    "gemm_time", "gemv_time", "embedding_bag_time",
    "ChunkChoice", "PipelineOverheads", "choose_chunks", "best_chunks", "fused_time",
    "POLICIES", "plan_policy", "step_policy", "react", "policy_step_time",
    "MachineProfile", "DEFAULT_PROFILE", "default_profile_path", "load_profile", "load_records",
    "fit_profile", "fit_pipeline",
    "SpeedConfig", "ClusterConfig", "ModelConfig", "ParallelConfig", "SimConfig", "load_config",
    "SimResult", "VariantResult", "simulate",
]
