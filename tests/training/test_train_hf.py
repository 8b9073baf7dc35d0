"""``plait train --model hf-llama|hf-mixtral``: the CLI's training loop on 2 and 3 ranks against
the same transformers model trained in one process, written out here from transformers'
own classes (the config, the seed, the char corpus's batches, AdamW and the schedule).

float64: tensor parallelism changes only the order of a few sums, so every step's loss and
the held-out loss agree within 1e-9 (relative). Cases: the default Llama shape (8 query
heads over 2 KV heads) on 2 ranks; on 3 ranks, the 2 KV-head groups cut into 4 sub-groups
and split unevenly ``--plans heads=1:2:1,mlp=30:20:14``; Mixtral expert-parallel on 2 ranks
with ``--plans experts=3:1``. Then ``plait train --model hf-llama`` through ``main`` with
tiny sizes, end to end (log.json, loss.png), and the inputs it refuses in one line.
"""

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from plait.cli.main import main
from plait.training.data import CharCorpus
from plait.testing import run_ranks
from plait.training.config import TrainConfig
from plait.training.loop import lr_at
from plait.training.models import build_hf
from plait.training.run import train_rank

pytest.importorskip("transformers")

SIZES = dict(steps=5, n_layer=1, n_embd=32, seq_len=16, batch_size=4, lr=1e-2, eval_batches=2,
             chunks="2")
CASES = {  # ranks → the configs trained in one launch (each launch imports transformers anew)
    2: [dict(model="hf-llama", **SIZES),
        dict(model="hf-mixtral", plans=("experts=3:1",), **SIZES)],
    3: [dict(model="hf-llama", plans=("heads=1:2:1", "mlp=30:20:14"), **SIZES)],
}
SHARDS = {  # (ranks, model) → {parameter of layer 0: its rows on each rank}: --plans reached it
    (2, "hf-llama"): {"self_attn.q_proj.weight": [16, 16], "mlp.gate_proj.weight": [32, 32]},
    (2, "hf-mixtral"): {"self_attn.q_proj.weight": [16, 16], "mlp.experts.": [3, 1]},
    (3, "hf-llama"): {"self_attn.q_proj.weight": [8, 16, 8], "mlp.gate_proj.weight": [30, 20, 14]},
}
RTOL = 1e-9


def _train_on_rank(cfgs: list[TrainConfig]) -> list[dict]:
    torch.set_default_dtype(torch.float64)
    results = [train_rank(cfg) for cfg in cfgs]
    for cfg, result in zip(cfgs, results):  # the model train_rank builds, built again
        model = build_hf(cfg, vocab_size=CharCorpus.load().vocab_size)
        result["rows"] = {name.partition("layers.0.")[2]: p.shape[0]
                          for name, p in model.named_parameters() if "layers.0." in name}
    return results


def _transformers_model(cfg: TrainConfig, vocab: int) -> torch.nn.Module:
    """The model the CLI should build, from the flags' meaning: width, layers, 8 query heads
    over ``kv_heads`` K/V heads, MLP (per expert) 2 × width, Mixtral's experts and top-k."""
    import transformers

    sizes = dict(vocab_size=vocab, hidden_size=cfg.n_embd, intermediate_size=2 * cfg.n_embd,
                 num_hidden_layers=cfg.n_layer, num_attention_heads=8, num_key_value_heads=2,
                 max_position_embeddings=cfg.seq_len, tie_word_embeddings=False)
    torch.manual_seed(cfg.seed)
    if cfg.model == "hf-llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).double()
    config = transformers.MixtralConfig(**sizes, num_local_experts=cfg.n_experts,
                                        num_experts_per_tok=cfg.top_k,
                                        experts_implementation="eager")  # float64 on CPU
    return transformers.MixtralForCausalLM(config).double()


def _reference(cfg: TrainConfig) -> tuple[list[float], float, float]:
    """Every step's loss, the held-out loss and accuracy of the run in this process."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        corpus = CharCorpus.load()
        model = _transformers_model(cfg, corpus.vocab_size)
        batches = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        losses = []
        for step in range(cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg.steps, cfg.lr)
            x, y = next(batches)
            logits = model(input_ids=x).logits  # every position scored, as the GPT's loss
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        gen = torch.Generator().manual_seed(10_000 + cfg.seed)
        held, correct = [], 0
        with torch.no_grad():
            for _ in range(cfg.eval_batches):
                x, y = corpus.batch("heldout", cfg.batch_size, cfg.seq_len, gen)
                logits = model(input_ids=x).logits
                held.append(float(F.cross_entropy(logits.flatten(0, 1), y.flatten())))
                correct += int((logits.argmax(-1) == y).sum())
        return losses, sum(held) / len(held), correct / (cfg.eval_batches * y.numel())
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("ranks", sorted(CASES))
def test_train_loop_matches_one_process(ranks):
    cfgs = [TrainConfig(extra={"ranks": ranks}, **fields) for fields in CASES[ranks]]
    for cfg in cfgs:
        cfg.check_plans(ranks)
    results = run_ranks(_train_on_rank, ranks, cfgs)
    for i, cfg in enumerate(cfgs):
        _check(cfg, ranks, [rank_results[i] for rank_results in results])


def _check(cfg: TrainConfig, ranks: int, results: list[dict]) -> None:
    want, want_loss, want_acc = _reference(cfg)
    assert sum(want[:2]) / 2 > math.log(97) - 0.5, want  # it starts untrained
    assert want[-1] < want[0] - 0.2, want  # and learns (the parity below is not of a no-op)
    name = "LlamaForCausalLM" if cfg.model == "hf-llama" else "MixtralForCausalLM"
    tokens = cfg.eval_batches * cfg.batch_size * cfg.seq_len
    for rank, result in enumerate(results):
        got = [r["loss"] for r in result["records"]]
        assert len(got) == cfg.steps, (cfg.model, rank, got)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
        assert worst <= RTOL, f"{cfg.model} rank {rank}: loss {worst:.2e} off: {got} {want}"
        assert result["eval"]["heldout_loss"] == pytest.approx(want_loss, rel=RTOL)
        # a prediction decided by a near-tie may flip on the last bit: one token
        assert abs(result["eval"]["heldout_accuracy"] - want_acc) <= 1 / tokens
        assert result["parallel"].startswith(f"{name} on {ranks} ranks"), result["parallel"]
        assert any("fused" in line for line in result["paths"]), result["paths"]
    for param, want_rows in SHARDS[ranks, cfg.model].items():  # [rows on rank 0, 1, …]
        got_rows = [next(n for p, n in r["rows"].items() if p.startswith(param)) for r in results]
        assert got_rows == want_rows, (cfg.model, param, got_rows, results[0]["rows"])
    if ranks == 3:  # 2 KV heads on 3 ranks: each group cut in 2 sub-groups, K/V copied
        assert any("sub-groups" in note for note in results[0]["notes"]), results[0]["notes"]


def test_cli_trains_hf_llama_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    steps = 4
    rc = main(["train", "--model", "hf-llama", "--ranks", "2", "--steps", str(steps),
               "--n-layer", "1", "--n-embd", "32", "--seq-len", "16", "--batch-size", "4",
               "--eval-batches", "1", "--plans", "heads=1:1", "--out", "run", "--no-progress"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    config, summary = log["meta"]["config"], log["meta"]["summary"]
    assert [r["step"] for r in log["records"]] == list(range(steps))
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in log["records"])
    assert config["model"] == "hf-llama" and config["n_head"] == 8 and config["kv_heads"] == 2
    assert summary["parallel"].startswith("LlamaForCausalLM on 2 ranks"), summary["parallel"]
    assert 0 <= summary["heldout_accuracy"] <= 1 and math.isfinite(summary["heldout_loss"])
    assert summary["first_loss"] == log["records"][0]["loss"]
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    said = " ".join(out.out.split())  # rich wraps lines to the terminal's width
    assert "held-out loss" in said and "LlamaForCausalLM on 2 ranks" in said, out.out


BAD = [  # (argv after "train", what the one line must say)
    (["--model", "hf-llama", "--plans", "experts=2:2"],
     "--plans experts=… does not apply to --model hf-llama (it takes heads, mlp)"),
    (["--model", "hf-mixtral", "--plans", "mlp=32:32"],
     "--plans mlp=… does not apply to --model hf-mixtral (it takes heads, experts)"),
    (["--model", "hf-llama", "--plans", "heads=2:1"],
     "--plans heads: a plan of 3 units does not count this attention's KV-head groups"),
    (["--model", "hf-llama", "--plans", "heads=2:1:1"],
     "--plans heads: shard sizes [2, 1, 1] name 3 ranks, but the group has 2"),
    (["--model", "hf-llama", "--ranks", "9"],
     "--n-head 8, --kv-heads 2 on 9 ranks: 8 query heads cannot give each of 9 ranks"),
    (["--model", "hf-llama", "--kv-heads", "3"], "--kv-heads 3 must divide --n-head 8"),
    (["--model", "hf-llama", "--n-embd", "40"], "rotary embeddings need an even width"),
    (["--model", "hf-llama", "--sequence-parallel"],
     "--sequence-parallel applies to the GPT models (gpt, moe), not to hf-llama"),
    (["--model", "gpt", "--kv-heads", "2"], "--kv-heads applies to --model hf-llama and"),
]


TINY = ["--steps", "1", "--n-layer", "1", "--n-embd", "32", "--seq-len", "8", "--batch-size",
        "2", "--eval-batches", "1", "--no-progress"]  # should a refusal fail: a short run


@pytest.mark.parametrize("argv,says", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_refused_in_one_line(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, *argv, "--out", "run"]) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and out.err.startswith("plait: error: "), out.err
    assert says in out.err, out.err
    assert out.out == "" and not (tmp_path / "run").exists()


def test_without_transformers_one_line_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import finds nothing
    assert main(["train", *TINY, "--model", "hf-mixtral", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert err == ("plait: error: --model hf-mixtral needs transformers, which is not "
                   "installed: pip install 'plait[hf]' (see: plait train --help)\n"), err
