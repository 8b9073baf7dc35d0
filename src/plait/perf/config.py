"""Typed configuration of a simulated cluster, model and parallel layout.

Keyword-only dataclasses; each field is documented (the text doubles as the
config-file reference) and validated in ``__post_init__`` with a ValueError
naming the field and its value.  ``SimConfig.from_dict`` reads the JSON/TOML
form, where ``cluster`` and ``model`` may name a preset (presets.py), as a
string or as ``{"preset": name, ...overrides}``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .hardware import DTYPE_BYTES, get_accelerator, get_link
from .hetero import POLICIES
from .presets import CLUSTERS, MODELS

__all__ = ["SpeedConfig", "ClusterConfig", "ModelConfig", "ParallelConfig", "SimConfig",
           "load_config", "MODEL_KINDS"]

MODEL_KINDS = ("transformer", "moe", "dlrm")


def _positive(obj, *names: str, prefix: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{prefix}.{name}: must be a positive integer, got {value!r}")


def _fraction(value, name: str, lo: float = 0.0, hi: float = 1.0) -> None:
    if not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ValueError(f"{name}: must be in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SpeedConfig:
    """Per-rank speed distribution.

    mixed: other GPU types and the fraction of nodes (or GPUs) that are of them, e.g. {"A100": 0.25}.
    mixed_per: "node" (whole nodes of one generation) or "gpu" (generations mixed inside
               nodes, so inside tensor-parallel groups).
    transient_prob: chance, per rank and step, that a transient slowdown starts.
    transient_slowdown: speed multiplier while slowed (0.5 = half speed).
    transient_steps: steps a slowdown lasts.
    jitter: standard deviation of a persistent per-rank log-normal speed factor.
    """

    mixed: Mapping[str, float] = field(default_factory=dict)
    mixed_per: str = "node"
    transient_prob: float = 0.0
    transient_slowdown: float = 0.5
    transient_steps: int = 2
    jitter: float = 0.0

    def __post_init__(self):
        p = "cluster.speeds"
        if not isinstance(self.mixed, Mapping):
            raise ValueError(f"{p}.mixed: must map GPU names to node fractions, got {self.mixed!r}")
        for gpu, frac in self.mixed.items():
            get_accelerator(gpu, field_name=f"{p}.mixed")
            _fraction(frac, f"{p}.mixed[{gpu!r}]")
        if sum(self.mixed.values()) > 1.0 + 1e-9:
            raise ValueError(f"{p}.mixed: fractions sum to {sum(self.mixed.values())} > 1")
        if self.mixed_per not in ("node", "gpu"):
            raise ValueError(f"{p}.mixed_per: must be 'node' or 'gpu', got {self.mixed_per!r}")
        _fraction(self.transient_prob, f"{p}.transient_prob")
        _fraction(self.transient_slowdown, f"{p}.transient_slowdown", 1e-3, 1.0)
        _positive(self, "transient_steps", prefix=p)
        _fraction(self.jitter, f"{p}.jitter", 0.0, 1.0)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The machines.

    gpu: accelerator type of every node not listed in speeds.mixed (hardware.ACCELERATORS).
    gpus_per_node: accelerators per node.
    nodes: number of nodes.
    intra_link: link between accelerators of one node (hardware.LINKS).
    inter_link: per-accelerator network link between nodes (hardware.LINKS).
    speeds: per-rank speed distribution (mixed generations, transient slowdowns).
    """

    gpu: str = "H100"
    gpus_per_node: int = 8
    nodes: int = 1
    intra_link: str = "nvlink4"
    inter_link: str = "ib-ndr"
    speeds: SpeedConfig = field(default_factory=SpeedConfig)

    def __post_init__(self):
        get_accelerator(self.gpu, field_name="cluster.gpu")
        get_link(self.intra_link, field_name="cluster.intra_link")
        get_link(self.inter_link, field_name="cluster.inter_link")
        _positive(self, "gpus_per_node", "nodes", prefix="cluster")

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model and one training step's batch.

    kind: "transformer" (dense decoder), "moe" (decoder with expert MLPs) or "dlrm".
    layers, hidden, ffn, heads, kv_heads: decoder shape (ffn = expert ffn for moe).
    seq_len: tokens per sequence.  vocab: vocabulary size.
    swiglu: gated MLP (three matrices) instead of two.
    experts, top_k: experts per MoE layer and experts per token.
    local_batch: sequences per data-parallel replica per step (dlrm: samples per rank).
    recompute: fraction of the forward recomputed in backward (full AC = 1).
    dtype: compute and activation dtype.
    tables, embedding_dim, pooling: DLRM embedding tables (total), row width, lookups per bag.
    dense_features, bottom_mlp, top_mlp: DLRM dense inputs and MLP widths.
    """

    kind: str = "transformer"
    layers: int = 12
    hidden: int = 768
    ffn: int = 3072
    heads: int = 12
    kv_heads: int = 12
    seq_len: int = 1024
    vocab: int = 50257
    swiglu: bool = False
    experts: int = 0
    top_k: int = 0
    local_batch: int = 8
    recompute: float = 0.0
    dtype: str = "bf16"
    tables: int = 0
    embedding_dim: int = 128
    pooling: int = 1
    dense_features: int = 13
    bottom_mlp: tuple[int, ...] = (512, 256, 128)
    top_mlp: tuple[int, ...] = (1024, 1024, 512, 256, 1)

    def __post_init__(self):
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model.kind: unknown kind {self.kind!r}; known: {', '.join(MODEL_KINDS)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model.dtype: unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        object.__setattr__(self, "bottom_mlp", tuple(self.bottom_mlp))
        object.__setattr__(self, "top_mlp", tuple(self.top_mlp))
        _fraction(self.recompute, "model.recompute")
        _positive(self, "local_batch", prefix="model")
        if self.kind == "dlrm":
            _positive(self, "tables", "embedding_dim", "pooling", "dense_features", prefix="model")
            return
        _positive(self, "layers", "hidden", "ffn", "heads", "kv_heads", "seq_len", "vocab", prefix="model")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden={self.hidden} is not a multiple of model.heads={self.heads}")
        if self.kind == "moe":
            _positive(self, "experts", "top_k", prefix="model")
            if self.top_k > self.experts:
                raise ValueError(f"model.top_k={self.top_k} exceeds model.experts={self.experts}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How ranks split the work; tp * dp * ep must equal the GPU count.

    tp: tensor-parallel degree (innermost: consecutive ranks, same node first).
    dp: data-parallel degree.
    ep: expert-parallel degree (moe only; experts split over ep ranks).
    fsdp: shard parameters over dp (all-gather per layer, reduce-scatter gradients)
          instead of replicating them (one gradient all-reduce).
    """

    tp: int = 1
    dp: int = 1
    ep: int = 1
    fsdp: bool = False

    def __post_init__(self):
        _positive(self, "tp", "dp", "ep", prefix="parallel")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.ep


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulation: cluster, model, layout and what to compare.

    steps: training steps simulated (the first is a warm-up for the balancers).
    seed: random seed of the speed distribution.
    policies: balancing policies to compare (hetero.POLICIES).
    max_chunks: largest piece count the fused operators may choose.
    chunks: fixed piece count for every fused pair (a system with a fixed decomposition,
            e.g. async TP's one piece per TP rank); None = chunks="auto".
    per_piece_overhead_s: fused-operator per-piece overhead; None = the GPU's launch cost x2.
    react_layers: forward layers before the balancer sees a step's slowdowns and
                  resizes (resize, semi); shards move only between steps.
    """

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    steps: int = 4
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    max_chunks: int = 16
    chunks: int | None = None
    per_piece_overhead_s: float | None = None
    react_layers: int = 1

    def __post_init__(self):
        _positive(self, "steps", "max_chunks", prefix="sim")
        if not isinstance(self.react_layers, int) or self.react_layers < 0:
            raise ValueError(f"sim.react_layers: must be an integer >= 0, got {self.react_layers!r}")
        if self.chunks is not None:
            _positive(self, "chunks", prefix="sim")
        if self.per_piece_overhead_s is not None and self.per_piece_overhead_s < 0:
            raise ValueError(f"sim.per_piece_overhead_s: must be >= 0, got {self.per_piece_overhead_s}")
        object.__setattr__(self, "policies", tuple(self.policies))
        for pol in self.policies:
            if pol not in POLICIES:
                raise ValueError(f"sim.policies: unknown policy {pol!r}; known: {', '.join(POLICIES)}")
        par, n = self.parallel, self.cluster.num_gpus
        if par.world != n:
            raise ValueError(
                f"parallel degrees tp={par.tp} × dp={par.dp} × ep={par.ep} = {par.world} do not "
                f"match {n} GPUs (cluster.nodes={self.cluster.nodes} × "
                f"cluster.gpus_per_node={self.cluster.gpus_per_node})")
        m = self.model
        if par.ep > 1 and m.kind != "moe":
            raise ValueError(f"parallel.ep={par.ep} needs model.kind='moe', got {m.kind!r}")
        if m.kind == "moe" and m.experts % par.ep:
            raise ValueError(f"model.experts={m.experts} is not divisible by parallel.ep={par.ep}")
        if m.kind == "dlrm" and par.tp > 1:
            raise ValueError(f"parallel.tp={par.tp}: dlrm is simulated with tp=1 (tables are sharded)")
        if m.kind != "dlrm" and m.heads % par.tp:
            raise ValueError(f"model.heads={m.heads} is not divisible by parallel.tp={par.tp}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SimConfig":
        data = dict(data)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"config: unknown sections/fields {sorted(unknown)}")
        cluster = _section(data.pop("cluster", "dgx-h100"), CLUSTERS, "cluster")
        speeds = cluster.pop("speeds", {}) or {}
        cluster_cfg = _build(ClusterConfig, dict(cluster, speeds=_build(SpeedConfig, speeds, "cluster.speeds")),
                             "cluster")
        model_cfg = _build(ModelConfig, _section(data.pop("model", "gpt-small"), MODELS, "model"), "model")
        par = dict(data.pop("parallel", {}) or {})
        for key in ("tp", "ep"):  # checked now: the default dp below divides by them
            value = par.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"parallel.{key}: must be a positive integer, got {value!r}")
        par.setdefault("tp", _default_tp(cluster_cfg, model_cfg, par))
        par.setdefault("ep", 1)
        par.setdefault("dp", max(1, cluster_cfg.num_gpus // (par["tp"] * par["ep"])))
        return cls(cluster=cluster_cfg, model=model_cfg, parallel=_build(ParallelConfig, par, "parallel"),
                   **data)


def _default_tp(cluster: ClusterConfig, model: ModelConfig, par: Mapping) -> int:
    if model.kind == "dlrm":
        return 1
    tp = min(cluster.gpus_per_node, model.heads)
    while cluster.num_gpus % (tp * par.get("ep", 1)) or model.heads % tp:
        tp -= 1
    return max(tp, 1)


def _section(value, presets: Mapping, name: str) -> dict:
    if isinstance(value, str):
        value = {"preset": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name}: must be a preset name or a table of fields, got {value!r}")
    value = dict(value)
    preset = value.pop("preset", None)
    if preset is None:
        return value
    if preset not in presets:
        raise ValueError(f"{name}.preset: unknown preset {preset!r}; known: {', '.join(presets)}")
    base = dict(presets[preset])
    return {**base, **value}


def _build(cls, fields: Mapping, name: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(fields) - known
    if unknown:
        raise ValueError(f"{name}: unknown fields {sorted(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**fields)


def load_config(path: str | Path) -> SimConfig:
    """SimConfig from a JSON file, or TOML (``.toml``, Python 3.11+ tomllib)."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{path}: TOML configs need Python 3.11+ (tomllib); use JSON") from None
        data = tomllib.loads(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    return SimConfig.from_dict(data)

