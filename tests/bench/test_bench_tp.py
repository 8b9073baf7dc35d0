"""plait bench tp: the same GPT under plait and PyTorch TP (and DLRM tables under plait's fused
and plain paths, and TorchRec where it is installed), same weights, same batches, same losses;
plait's embedding paths also against a single-process reference, on 2 and 3 ranks."""

import json

import pytest
import torch
import torch.nn as nn

from plait.bench.tp import SYSTEMS, TPBenchConfig, bench_tp, heads_contiguous_qkv, summarize_tp
from plait.bench.tp_dlrm import (EMB_SYSTEMS, PLAIT_EMB_SYSTEMS, EmbBenchConfig, _batches,
                                 batch_slice, initial_tables, torchrec_missing)
from plait.cli.main import main

# emb_chunks: plait-emb fused with 4 pieces whatever the cost model would say of so small a batch
TINY = dict(n_layer=2, n_head=4, n_embd=64, seq_len=32, batch_size=4, warmup=1, steps=4,
            compare_steps=5, emb_rows=500, emb_dim=8, emb_batch=64, emb_pool=4, emb_lr=100.0,
            emb_chunks=4)
# 3 ranks: 3 tables, 64 bags split 22/21/21; the GPT part as small as it goes (plait alone)
TINY_3 = dict(TINY, systems=("plait",), n_layer=1, n_head=3, n_embd=24, seq_len=8, batch_size=2,
              emb_tables=3)
KEYS = {"system", "t_step_s", "tokens_per_s", "max_loss_diff", "losses", "speedup_vs_pytorch_tp",
        "world_size", "link", "note"}


@pytest.fixture(scope="module")
def tiny_records():
    records, where = bench_tp(TPBenchConfig(**TINY), ranks=2, hosts=0)
    assert "loopback" in where
    return records


@pytest.fixture(scope="module")
def tiny_records_3():
    records, _ = bench_tp(TPBenchConfig(**TINY_3), ranks=3, hosts=0)
    return records


def single_process_losses(cfg: EmbBenchConfig, steps: int) -> list[float]:
    """The same tables, batches and SGD in one process: plain ``nn.EmbeddingBag`` over the
    whole batch, the loss a mean over all of it."""
    bags = [nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="sum") for w in initial_tables(cfg)]
    opt = torch.optim.SGD([b.weight for b in bags], lr=cfg.lr)
    offsets = torch.arange(0, cfg.batch * cfg.pool, cfg.pool)
    losses = []
    for ids, target in _batches(cfg, steps):
        out = torch.stack([bag(i, offsets) for bag, i in zip(bags, ids)], dim=1)  # [B, T, D]
        loss = ((out - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


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


@pytest.mark.parametrize("records, world", [("tiny_records", 2), ("tiny_records_3", 3)])
def test_dlrm_plait_paths_match_a_single_process_reference(records, world, request):
    """Fused (4 pieces) and plain, whatever else is installed: every step's loss is the
    single-process one (fp32: the same sums in another order at most), and the two paths'
    are bit-identical (an all-to-all moves the same pooled rows either way)."""
    records = request.getfixturevalue(records)
    cfg = TPBenchConfig(**(TINY if world == 2 else TINY_3))
    emb = {r["system"]: r for r in records if r["part"] == "dlrm"}
    assert set(PLAIT_EMB_SYSTEMS) <= set(emb)
    reference = single_process_losses(cfg.emb_config(), cfg.total_steps)
    assert reference[-1] < 0.8 * reference[0]  # the tables move: later steps test the updates
    for name in PLAIT_EMB_SYSTEMS:
        r = emb[name]
        assert r["world_size"] == world and r["t_step_s"] > 0
        assert r["model"]["tables"] == cfg.emb_tables and r["model"]["batch"] == 64
        assert len(r["losses"]) == cfg.total_steps
        assert r["losses"] == pytest.approx(reference, rel=1e-5), name
    assert emb["plait-emb"]["path"] == "embedding_all_to_all: fused (4 pieces): chunks=4 asked for"
    assert emb["plait-emb-plain"]["path"].startswith("embedding_all_to_all: fallback (1 piece)")
    assert emb["plait-emb"]["losses"] == emb["plait-emb-plain"]["losses"]
    if torchrec_missing() is not None:  # each of plait's paths is the other's reference
        assert emb["plait-emb"]["loss_diff_vs"] == "plait-emb-plain"
        assert emb["plait-emb-plain"]["loss_diff_vs"] == "plait-emb"
        assert emb["plait-emb"]["max_loss_diff"] == 0.0
        summary = summarize_tp(records)
        assert summary["emb_loss_diff_vs"] == "plait-emb-plain" and summary["emb_max_loss_diff"] == 0
        assert summary["emb_fusion_speedup"] == pytest.approx(
            emb["plait-emb-plain"]["t_step_s"] / emb["plait-emb"]["t_step_s"])


def test_dlrm_embeddings_match_torchrec(tiny_records):
    emb = {r["system"]: r for r in tiny_records if r["part"] == "dlrm"}
    missing = torchrec_missing()
    if missing is not None:  # TorchRec is optional: the record says why it did not run
        assert emb["torchrec"]["skipped"] == missing
        assert summarize_tp(tiny_records)["torchrec"] == f"skipped: {missing}"
        pytest.skip(f"TorchRec does not import here: torchrec is not in the test extra "
                    f"(not installed: {missing})")
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
    (dict(emb_chunks=-1), "--emb-chunks must be ≥ 0"),
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

    from plait.bench.tp import _torchrec_skipped

    monkeypatch.setitem(sys.modules, "torchrec", None)  # import torchrec → ImportError
    missing = torchrec_missing()
    assert missing.startswith(("ImportError", "ModuleNotFoundError"))
    record = _torchrec_skipped(missing)
    assert record["part"] == "dlrm" and record["skipped"] == missing
    assert summarize_tp([record])["torchrec"] == f"skipped: {missing}"


@pytest.mark.parametrize("batch, world, shares", [(64, 2, [32, 32]), (64, 3, [22, 21, 21]),
                                                  (2, 3, [1, 1, 0])])
def test_each_rank_takes_the_bags_plaits_layer_leaves_it(batch, world, shares):
    """Where the batch does not split evenly, the target (and TorchRec's input) must be cut
    as plait's layer cuts its output: larger shares first."""
    cuts = [batch_slice(batch, world, r) for r in range(world)]
    assert [c.stop - c.start for c in cuts] == shares
    assert cuts[0].start == 0 and cuts[-1].stop == batch
    assert all(a.stop == b.start for a, b in zip(cuts, cuts[1:]))


# --- --model hf-llama: a transformers Llama (grouped-query attention) three ways ----------

HF_TINY = dict(model="hf-llama", n_layer=1, n_head=4, n_kv_head=2, n_embd=32, seq_len=16,
               batch_size=2, warmup=1, steps=4, compare_steps=5)


LAYER_LINEARS = [f"self_attn.{p}_proj" for p in "qkvo"] + \
    [f"mlp.{p}_proj" for p in ("gate", "up", "down")]


@pytest.fixture(scope="module")
def hf_records():
    records, where = bench_tp(TPBenchConfig(**HF_TINY), ranks=2, hosts=0)
    assert "loopback" in where
    return records


def test_hf_llama_three_ways_follow_the_same_losses(hf_records):
    """The same Llama under plait (fused, plain) and DTensor: every timed step's loss equal
    within 1e-5 (float32: the same sums in another order at most); no DLRM part."""
    assert [r["system"] for r in hf_records] == list(SYSTEMS)
    by = {r["system"]: r for r in hf_records}
    for r in hf_records:
        assert KEYS | {"max_loss_diff_timed", "part", "model"} <= set(r)
        assert r["part"] == "hf-llama" and r["world_size"] == 2 and r["t_step_s"] > 0
        assert r["model"] == dict(name="hf-llama", n_layer=1, n_head=4, n_embd=32, seq_len=16,
                                  batch_size=2, n_kv_head=2, ffn=256, vocab=128, plan="auto")
        assert len(r["losses"]) == len(r["step_times_s"]) == 5
        # DTensor all-reduces q, k, v, gate and up's input grads apiece; plait sums siblings'
        assert r["allreduce_per_step"] == (7 if r["system"] == "pytorch-tp" else 4) + 2
        assert r["microbatches"] == 1
        assert r["split_modules"] == sorted(["lm_head", "model.embed_tokens",
                                             *(f"model.layers.*.{m}" for m in LAYER_LINEARS)])
    for name in ("plait", "plait-plain"):
        assert by[name]["loss_diff_vs"] == "pytorch-tp"
        assert by[name]["max_loss_diff_timed"] <= 1e-5, by[name]["max_loss_diff_timed"]
        assert by[name]["losses"] == pytest.approx(by["pytorch-tp"]["losses"], abs=1e-5, rel=0)
    assert by["plait"]["losses"][-1] < by["plait"]["losses"][0] - 0.05  # it trains
    summary = summarize_tp(hf_records)
    assert summary["timed_losses_agree_1e-5"] and summary["losses_agree_1e-4"]
    assert summary["plait_speedup_vs_pytorch_tp"] == pytest.approx(
        by["pytorch-tp"]["t_step_s"] / by["plait"]["t_step_s"])


def test_hf_plan_in_pytorch_styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from plait.bench.tp_hf import build_llama, own_plan, torch_tp_plan

    cfg = TPBenchConfig(**HF_TINY)
    model = build_llama(cfg, vocab_size=97)
    plan = own_plan(model, "auto")
    torch_plan = torch_tp_plan(plan)
    assert set(torch_plan) == set(plan) and len(plan) == 9
    head, embed = torch_plan["lm_head"], torch_plan["model.embed_tokens"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    assert isinstance(embed, RowwiseParallel) and embed.input_layouts == (Replicate(),)
    o = torch_plan["model.layers.*.self_attn.o_proj"]
    assert isinstance(o, RowwiseParallel) and o.input_layouts == (Shard(-1),)
    assert isinstance(torch_plan["model.layers.*.self_attn.k_proj"], ColwiseParallel)
    layers = own_plan(model, "layers")
    assert sorted(layers) == sorted(k for k in plan if k.startswith("model.layers."))
    with pytest.raises(ValueError, match="'sequence_parallel' has no PyTorch style"):
        torch_tp_plan({"model.norm": "sequence_parallel"})


def test_cli_hf_llama_layers_plan(tmp_path):
    """Embedding and LM head replicated (``--hf-plan layers``) through the command line."""
    out = tmp_path / "tp.json"
    code = main(["bench", "tp", "--ranks", "2", "--model", "hf-llama", "--hf-plan", "layers",
                 "--n-layer", "1", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "32",
                 "--seq-len", "16", "--batch-size", "2", "--warmup", "0", "--steps", "3",
                 "--no-progress", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["system"] for r in data["records"]] == list(SYSTEMS)  # no DLRM part
    assert {r["system"]: r["allreduce_per_step"] for r in data["records"]} == \
        {"plait": 4, "plait-plain": 4, "pytorch-tp": 7}
    for r in data["records"]:  # what each system really split: the decoder layers' linears
        assert r["split_modules"] == sorted(f"model.layers.*.{m}" for m in LAYER_LINEARS)
    assert data["meta"]["summary"]["timed_losses_agree_1e-5"] is True


def test_cli_refuses_an_unknown_model_in_one_line(capsys):
    assert main(["bench", "tp", "--model", "bert", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["plait: error: --model 'bert': choose from gpt, hf-llama "
                   "(see: plait bench tp --help)"]


@pytest.mark.parametrize("kw, message", [
    (dict(n_kv_head=3), "not a multiple of --n-kv-head 3"),
    (dict(hf_plan="all"), "--hf-plan 'all': choose from auto, layers"),
    (dict(n_kv_head=0), "positive"),
])
def test_bad_hf_configs_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        TPBenchConfig(**{**HF_TINY, **kw})


def test_hf_kv_heads_must_split_over_the_ranks():
    with pytest.raises(ValueError, match="KV-head count must be a multiple of the ranks"):
        bench_tp(TPBenchConfig(**{**HF_TINY, "n_kv_head": 1}), ranks=2)


def test_model_defaults_per_model():
    assert (TPBenchConfig().n_layer, TPBenchConfig().n_embd) == (2, 512)
    hf = TPBenchConfig(model="hf-llama")
    assert (hf.n_layer, hf.n_embd, hf.n_kv_head) == (4, 256, 2) and not hf.runs_dlrm
