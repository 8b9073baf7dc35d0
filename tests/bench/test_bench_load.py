"""plait bench load at a tiny size (its memory figures at 2 GB are the benchmark's to show):
the records it writes, the loss against the whole load, and its refusals."""

import json

import pytest

from plait.bench.load import LoadBenchConfig
from plait.cli.main import main

pytest.importorskip("transformers")


def test_tiny_run_writes_every_rank_and_the_same_loss(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["bench", "load", "--size-gb", "0.01", "--worlds", "2", "--max-shard-mb", "1",
                 "--no-progress", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    records, summary = data["records"], data["meta"]["summary"]
    assert [(r["system"], r["world"]) for r in records] == [("whole", 1), ("plait", 2),
                                                            ("plait", 2)]
    assert summary["files"] > 1 and summary["model_bytes"] >= 0.01e9
    assert summary["bound_rss"] == pytest.approx(0.6 * summary["model_bytes"] + 0.5e9)
    for r in records[1:]:
        assert r["loss_diff"] < 1e-5, r
        assert r["peak_rss"] >= r["baseline_rss"] > 0 and 0 < r["own_bytes"] < r["model_bytes"]
        assert r["within_bound"] == (r["peak_rss"] <= summary["bound_rss"])
    text = capsys.readouterr().out
    assert "bound (GB)" in text and "whole" in text


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="--size-gb must be at least 0.01"):
        LoadBenchConfig(size_gb=0.001)
    with pytest.raises(ValueError, match="--worlds"):
        LoadBenchConfig(worlds=(0,))
    assert LoadBenchConfig(size_gb=2).llama()["num_hidden_layers"] >= 9  # ≥ 2 GB
