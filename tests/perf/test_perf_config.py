"""Config validation: every error names its field and value."""

import json
import sys

import pytest

from plait.perf.config import ClusterConfig, ModelConfig, ParallelConfig, SimConfig, load_config
from plait.perf.presets import CLUSTERS, MODELS


def test_unknown_gpu_and_links_name_the_field():
    with pytest.raises(ValueError, match=r"cluster\.gpu: unknown GPU 'H900'; known: A100"):
        ClusterConfig(gpu="H900")
    with pytest.raises(ValueError, match=r"cluster\.intra_link: unknown link 'nvlink9'"):
        ClusterConfig(intra_link="nvlink9")
    with pytest.raises(ValueError, match=r"cluster\.inter_link"):
        SimConfig.from_dict({"cluster": {"preset": "dgx-h100", "inter_link": "carrier-pigeon"}})
    with pytest.raises(ValueError, match=r"cluster\.speeds\.mixed"):
        SimConfig.from_dict({"cluster": {"preset": "h100-64", "speeds": {"mixed": {"B900": 0.5}}}})


def test_parallel_degrees_must_multiply_to_the_gpu_count():
    cluster = ClusterConfig(nodes=8)
    with pytest.raises(ValueError, match=r"tp=8 × dp=4 × ep=1 = 32 do not match 64 GPUs"):
        SimConfig(cluster=cluster, model=ModelConfig(heads=16), parallel=ParallelConfig(tp=8, dp=4))
    with pytest.raises(ValueError, match=r"parallel\.tp: must be a positive integer, got 0"):
        ParallelConfig(tp=0)


def test_model_and_sim_fields_are_checked():
    with pytest.raises(ValueError, match=r"model\.kind: unknown kind 'rnn'"):
        ModelConfig(kind="rnn")
    with pytest.raises(ValueError, match=r"model\.top_k=4 exceeds model\.experts=2"):
        ModelConfig(kind="moe", experts=2, top_k=4)
    with pytest.raises(ValueError, match=r"sim\.policies: unknown policy 'magic'"):
        SimConfig.from_dict({"policies": ["even", "magic"]})
    with pytest.raises(ValueError, match=r"parallel\.ep=2 needs model\.kind='moe'"):
        SimConfig.from_dict({"cluster": "dgx-h100", "model": "gpt-small",
                             "parallel": {"tp": 4, "dp": 1, "ep": 2}})
    with pytest.raises(ValueError, match=r"cluster: unknown fields \['colour'\]"):
        SimConfig.from_dict({"cluster": {"preset": "dgx-h100", "colour": "blue"}})
    with pytest.raises(ValueError, match=r"model\.preset: unknown preset 'gpt-9'"):
        SimConfig.from_dict({"model": "gpt-9"})


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
def test_every_cluster_preset_builds(cluster):
    cfg = SimConfig.from_dict({"cluster": cluster, "model": "gpt-small"})
    assert cfg.parallel.world == cfg.cluster.num_gpus


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_preset_builds(model):
    cfg = SimConfig.from_dict({"cluster": "h100-64", "model": model})
    assert cfg.model.kind in ("transformer", "moe", "dlrm")


def test_config_files(tmp_path):
    data = {"cluster": {"preset": "h100-64", "nodes": 4}, "model": "llama3-8b",
            "parallel": {"tp": 8, "dp": 4, "fsdp": True}, "steps": 3}
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(data))
    cfg = load_config(path)
    assert cfg.cluster.num_gpus == 32 and cfg.parallel.fsdp and cfg.steps == 3
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(bad)
    toml = tmp_path / "sim.toml"
    toml.write_text('steps = 2\n[cluster]\npreset = "dgx-a100"\n[model]\npreset = "gpt-small"\n')
    if sys.version_info >= (3, 11):
        assert load_config(toml).cluster.gpu == "A100"
    else:
        with pytest.raises(ValueError, match="tomllib"):
            load_config(toml)
