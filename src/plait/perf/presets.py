"""Named clusters and models for ``plait simulate --cluster/--model``.

Plain dicts of ModelConfig / ClusterConfig fields, so a config file can start
from a preset and override fields.  Model shapes are the published
architectures (Llama 3 model card; Mixtral paper); batch sizes and
recomputation follow the torchtitan benchmark each preset is used against.
"""

from __future__ import annotations

from types import MappingProxyType

__all__ = ["CLUSTERS", "MODELS"]

_H100 = dict(gpu="H100", gpus_per_node=8, intra_link="nvlink4", inter_link="ib-ndr")

CLUSTERS = MappingProxyType({
    "dgx-h100": dict(_H100, nodes=1),
    "dgx-a100": dict(gpu="A100", gpus_per_node=8, nodes=1, intra_link="nvlink3", inter_link="ib-hdr"),
    "hgx-h800": dict(gpu="H800", gpus_per_node=8, nodes=1, intra_link="nvlink4-h800",
                     inter_link="roce-200"),
    "mi300x-node": dict(gpu="MI300X", gpus_per_node=8, nodes=1, intra_link="infinity-fabric",
                        inter_link="roce-400"),
    "mi300x-4gpu": dict(gpu="MI300X", gpus_per_node=4, nodes=1, intra_link="infinity-fabric",
                        inter_link="roce-400"),
    "h100-64": dict(_H100, nodes=8),
    "h100-256": dict(_H100, nodes=32),
    "h100-1024": dict(_H100, nodes=128),
    "h100-16k": dict(_H100, nodes=2048),
    "mi300x-128n": dict(gpu="MI300X", gpus_per_node=8, nodes=128, intra_link="infinity-fabric",
                        inter_link="roce-400"),
    # one node in four is an older generation; shared machines with transient stalls
    "mixed-a100-h100": dict(_H100, nodes=16, speeds=dict(mixed={"A100": 0.25})),
    # generations mixed inside servers (repairs, pooled spares): inside TP groups
    "mixed-in-node": dict(_H100, nodes=16, speeds=dict(mixed={"A100": 0.125}, mixed_per="gpu")),
    "h100-flaky": dict(_H100, nodes=16, speeds=dict(transient_prob=0.02, transient_slowdown=0.5,
                                                    transient_steps=3, jitter=0.03)),
    # plait's emulated cluster on one CPU machine: 4 ranks over a 1 Gbit/s bridge
    "cpu-4": dict(gpu="CPU", gpus_per_node=4, nodes=1, intra_link="eth-1g", inter_link="eth-1g"),
})

_LLAMA = dict(kind="transformer", heads=32, kv_heads=8, seq_len=8192, vocab=128256, swiglu=True,
              dtype="bf16")

MODELS = MappingProxyType({
    "gpt-small": dict(kind="transformer", layers=12, hidden=768, ffn=3072, heads=12, kv_heads=12,
                      seq_len=1024, vocab=50257, swiglu=False, local_batch=8, dtype="bf16"),
    # Llama 3 8B: 32 layers, d 4096, ffn 14336, 32 heads / 8 KV heads; torchtitan
    # asyncTP benchmark: local batch 12, per-op selective AC (about half the
    # forward recomputed).
    "llama3-8b": dict(_LLAMA, layers=32, hidden=4096, ffn=14336, local_batch=12, recompute=0.5),
    # Llama 3 70B: 80 layers, d 8192, ffn 28672, 64 heads / 8 KV; full AC, batch 16.
    "llama3-70b": dict(_LLAMA, layers=80, hidden=8192, ffn=28672, heads=64, local_batch=16,
                       recompute=1.0),
    # Mixtral 8x7B: 32 layers, d 4096, 8 experts of ffn 14336, top-2.
    "mixtral-8x7b": dict(_LLAMA, kind="moe", layers=32, hidden=4096, ffn=14336, seq_len=4096,
                         vocab=32000, experts=8, top_k=2, local_batch=8, recompute=1.0),
    # A DLRM of the DCNv2/MLPerf family, weak-scaled: tables per rank fixed.
    "dlrm": dict(kind="dlrm", tables=64, embedding_dim=128, pooling=32, local_batch=4096,
                 dense_features=13, bottom_mlp=(512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1),
                 dtype="fp32"),
})
