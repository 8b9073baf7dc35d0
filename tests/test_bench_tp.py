"""plait bench tp: the same GPT under plait and PyTorch TP (and DLRM tables under plait and
TorchRec), same weights, same batches, same losses."""

import json

import pytest
import torch
import torch.nn as nn

from plait.bench.tp import SYSTEMS, TPBenchConfig, bench_tp, heads_contiguous_qkv, summarize_tp
from plait.bench.tp_dlrm import EMB_SYSTEMS, torchrec_missing
from plait.cli.main import main

TINY = dict(n_layer=2, n_head=4, n_embd=64, seq_len=32, batch_size=4, warmup=1, steps=4,
            compare_steps=5, emb_rows=500, emb_dim=8, emb_batch=64, emb_pool=4, emb_lr=100.0)
KEYS = {"system", "t_step_s", "tokens_per_s", "max_loss_diff", "losses", "speedup_vs_pytorch_tp",
        "world_size", "link", "note"}


@pytest.fixture(scope="module")
def tiny_records():
    records, where = bench_tp(TPBenchConfig(**TINY), ranks=2, hosts=0)
    assert "loopback" in where
    return records


def test_records_have_the_required_keys(tiny_records):
    gpt = [r for r in tiny_records if r["part"] == "gpt"]
    assert [r["system"] for r in gpt] == list(SYSTEMS)
    for r in gpt:
        assert KEYS <= set(r)
        assert r["world_size"] == 2 and r["link"] == "loopback"
        assert r["t_step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(TINY["batch_size"] * TINY["seq_len"] / r["t_step_s"])
        assert len(r["losses"]) == len(r["step_times_s"]) == TINY["warmup"] + TINY["steps"]


def test_plait_matches_pytorch_tp_loss_for_5_steps(tiny_records):
    by = {r["system"]: r for r in tiny_records if r["part"] == "gpt"}
    for name in ("plait", "plait-plain"):  # fp32: the same sums in another order at most
        assert by[name]["loss_diff_vs"] == "pytorch-tp" and by[name]["compare_steps"] == 5
        assert by[name]["max_loss_diff"] <= 1e-4
        assert by[name]["losses"][:5] == pytest.approx(by["pytorch-tp"]["losses"][:5], abs=1e-4)
    assert by["plait"]["losses"][-1] < by["plait"]["losses"][0]  # it trains
    summary = summarize_tp(tiny_records)
    assert summary["losses_agree_1e-4"] and summary["max_loss_diff"] <= 1e-4
    # plait ran its batch as 2 interleaved micro-batches, the others whole
    assert summary["plait_microbatches"] == 2 and by["plait-plain"]["microbatches"] == 1


def test_heads_contiguous_qkv_gives_each_rank_whole_heads():
    torch.manual_seed(0)
    qkv = nn.Linear(8, 24)
    q, k, v = qkv.weight.detach().clone().chunk(3)
    heads_contiguous_qkv(qkv, world=2)
    rank1 = qkv.weight.detach()[12:]  # what a contiguous Shard(0) gives rank 1
    assert torch.equal(rank1, torch.cat([q[4:], k[4:], v[4:]]))
    with pytest.raises(ValueError, match="3 × 5"):
        heads_contiguous_qkv(qkv, world=5)


def test_dlrm_embeddings_match_torchrec_or_say_why(tiny_records):
    emb = {r["system"]: r for r in tiny_records if r["part"] == "dlrm"}
    missing = torchrec_missing()
    if missing is not None:  # TorchRec is optional: the record says why it did not run
        assert emb["torchrec"]["skipped"] == missing
        pytest.skip(f"TorchRec does not import here: {missing}")
    assert set(emb) == set(EMB_SYSTEMS)
    for name in ("plait-emb", "plait-emb-plain"):
        assert KEYS - {"speedup_vs_pytorch_tp"} | {"speedup_vs_torchrec"} <= set(emb[name])
        assert emb[name]["loss_diff_vs"] == "torchrec"
        assert emb[name]["max_loss_diff"] <= 1e-5 * emb["torchrec"]["losses"][0]
    assert emb["plait-emb"]["losses"][-1] < emb["plait-emb"]["losses"][0]
    assert summarize_tp(tiny_records)["emb_max_loss_diff"] <= 1e-5


@pytest.mark.parametrize("kw, message", [
    (dict(systems=("megatron",)), "choose from"),
    (dict(optimizer="lamb"), "adamw or sgd"),
    (dict(n_embd=100, n_head=8), "does not divide into n_head"),
    (dict(steps=0), "positive"),
    (dict(microbatches=0), "--microbatches must be positive"),
])
def test_bad_configs_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        TPBenchConfig(**kw)


def test_heads_must_split_over_the_ranks():
    with pytest.raises(ValueError, match="multiple of the ranks"):
        bench_tp(TPBenchConfig(n_head=3, n_embd=48, dlrm=False), ranks=2)
    with pytest.raises(ValueError, match="split evenly"):
        bench_tp(TPBenchConfig(emb_tables=3), ranks=2)


def test_cli_writes_json(tmp_path):
    out = tmp_path / "tp.json"
    code = main(["bench", "tp", "--ranks", "2", "--systems", "plait,pytorch-tp", "--n-layer", "1",
                 "--n-head", "2", "--n-embd", "32", "--seq-len", "16", "--batch-size", "2",
                 "--warmup", "0", "--steps", "5", "--no-dlrm", "--no-progress", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert {r["system"] for r in data["records"]} == {"plait", "pytorch-tp"}
    assert data["meta"]["summary"]["losses_agree_1e-4"] is True


def test_without_torchrec_the_record_says_why(monkeypatch):
    import sys

    from plait.bench.tp import _dlrm_records

    monkeypatch.setitem(sys.modules, "torchrec", None)  # import torchrec → ImportError
    [record] = _dlrm_records(TPBenchConfig())
    assert record["part"] == "dlrm" and record["skipped"].startswith(("ImportError", "ModuleNotFoundError"))
    assert "skipped" in summarize_tp([record])["torchrec"]
