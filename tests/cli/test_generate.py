"""``plait generate``: the same tokens on 2 and 3 ranks as on one process (greedy and seeded
sampling, prompts of different lengths in one batch), and its refusals, each one line
before any rank starts."""

from __future__ import annotations

import json

import torch

import pytest

from plait.cli.main import main
from plait.inference.generate import GenerateConfig, read_prompts

pytest.importorskip("transformers")

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "8", "--n-kv-head", "4",
        "--vocab-size", "128", "--max-new-tokens", "6"]


def _tokens(tmp_path, ranks: int, *flags: str) -> list:
    out = tmp_path / f"gen-{ranks}-{len(flags)}.json"
    assert main(["generate", "--ranks", str(ranks), *TINY, *flags, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    return data["tokens"], data


def test_the_same_tokens_on_2_and_3_ranks_as_on_one(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4 5\n7, 8, 9\n\n")
    greedy = ("--prompt-file", str(prompts))
    sampled = ("--prompt-ids", "3 1 4 1 5", "--sample", "--seed", "3", "--top-k", "20")
    for flags, ranks in ((greedy, 3), (sampled, 2)):
        one, _ = _tokens(tmp_path, 1, *flags)
        got, data = _tokens(tmp_path, ranks, *flags)
        assert got == one, (ranks, flags)
        assert data["world_size"] == ranks and data["ms_per_token"] > 0
        assert f"{ranks} ranks" in data["parallel"][0], data["parallel"]
    assert [len(t) for t in one] == [6]


def test_requests_in_turn_with_the_split_by_speed_decode_one_process_tokens(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4 5\n7 8 9\n10 11\n")
    flags = ("--prompt-file", str(prompts), "--requests", "each")
    one, _ = _tokens(tmp_path, 1, *flags)
    got, data = _tokens(tmp_path, 2, *flags, "--split", "adaptive", "--tolerance", "0")
    assert got == one and len(data["requests"]) == 3
    # tolerance 0: every request but the last decides on its measured speeds
    assert [r["speeds"] is not None for r in data["requests"]] == [True, True, False]
    assert all(set(r["split"]) == {"self_attn", "mlp"} for r in data["requests"])


@pytest.mark.parametrize("flags, says", [
    (["--prompt-file", "/nonexistent/prompts"], "--prompt-file /nonexistent/prompts: no such file"),
    (["--model", "gpt-9"], "--model gpt-9: no such file or directory (a model plait builds"),
    (["--max-new-tokens", "600"], "need 604 positions; the model has 512"),
    (["--prompt-ids", "1 x 3"], "'x' is not a token id"),
    (["--prompt-ids", "1 2000"], "token ids [2000] are outside the vocabulary"),
    (["--prompt-ids", "1", "--prompt-file", "p"], "give --prompt-ids or --prompt-file, not both"),
    (["--prompt", "hello"], "has no tokenizer"),
    (["--requests", "some"], "--requests must be batch or each"),
    (["--split", "fast"], "--split must be one of even, speed, adaptive"),
    (["--tolerance", "1.5"], "--tolerance must be in [0, 1)"),
    (["--slow", "5:2"], "rank 5"),
    (["--slow", "1:2@3"], "this run makes 1 request"),
    (["--requests", "each", "--prompt-ids", "1 2", "--slow", "1:2@1"], "this run makes 1 request"),
    (["--slow", "1:2", "--slow", "1:3"], "names rank 1 more than once"),
    (["--n-kv-head", "3"], "must be a multiple of --n-kv-head 3"),
    (["--transport", "shm", "--hosts", "2"], "each of the 2 ranks is on a host of its own"),
])
def test_bad_input_is_refused_in_one_line_before_any_rank(flags, says, capsys, monkeypatch):
    import plait.cli.generate as cli

    monkeypatch.setattr(cli, "run_placed", lambda *a, **k: pytest.fail("ranks started"))
    assert main(["generate", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("name, value, says", [
    ("PLAIT_CHECKS", "bogus", "PLAIT_CHECKS='bogus': choose one of carried, gather"),
    ("PLAIT_TRANSPORT", "bogus", "PLAIT_TRANSPORT='bogus': choose one of auto, shm, gloo"),
])
def test_a_bad_setting_in_the_environment_is_refused_before_any_rank(name, value, says, capsys,
                                                                      monkeypatch):
    import plait.cli.generate as cli

    monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "run_placed", lambda *a, **k: pytest.fail("ranks started"))
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_a_checkpoint_that_cannot_decode_is_refused_before_any_rank(tmp_path, capsys,
                                                                      monkeypatch):
    """What the files decide (weights missing or truncated, more ranks than the checkpoint's
    query heads) is refused in the launcher: one line, exit 2, no rank started."""
    import plait.cli.generate as cli
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(cli, "run_placed", lambda *a, **k: pytest.fail("ranks started"))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32)
    whole, bare, cut = (tmp_path / name for name in ("whole", "bare", "cut"))
    LlamaForCausalLM(config).save_pretrained(whole)
    config.save_pretrained(bare)  # a config, no weights
    LlamaForCausalLM(config).save_pretrained(cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    capsys.readouterr()  # save_pretrained's progress bars
    for folder, flags, says in (
            (bare, [], f"--model {bare}: no model.safetensors or model.safetensors.index.json "
                       "in it"),
            (cut, [], f"--model {cut}: model.safetensors: truncated or not a safetensors file"),
            (whole, ["--ranks", "5"], "--ranks 5: 4 query heads cannot give each of 5 ranks a "
                                      "whole head (the model has 4 query heads over 2 KV heads)")):
        assert main(["generate", "--model", str(folder), "--prompt-ids", "1 2", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


def test_prompt_files_and_configs_are_read_as_documented(tmp_path):
    listed = tmp_path / "p.json"
    listed.write_text("[[1, 2], [3]]")
    assert read_prompts(None, str(listed)) == ((1, 2), (3,))
    assert read_prompts("4 5", None) == ((4, 5),)
    empty = tmp_path / "empty"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no prompt in it"):
        read_prompts(None, str(empty))
    with pytest.raises(ValueError, match="--temperature must be above 0"):
        GenerateConfig(sample=True, temperature=0.0)


def _checkpoint(folder) -> tuple:
    """A tiny Llama saved with a BPE tokenizer trained on this repository's README (no
    download), its eos_token_id a token greedy decoding reaches; (model, tokenizer)."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    config = LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    greedy = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False,
                            eos_token_id=None)[0, ids.shape[1]:]
    model.config.eos_token_id = model.generation_config.eos_token_id = int(greedy[4])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


PROMPTS = ("fused operators on the wire", "a balancer", "tensor parallel decoding of text")


def test_text_in_text_out_stopping_where_transformers_generate_stops(tmp_path, capsys):
    model, tokenizer = _checkpoint(tmp_path / "ckpt")
    batch = tokenizer(list(PROMPTS), return_tensors="pt", padding=True, padding_side="left")
    flags = [f for p in PROMPTS for f in ("--prompt", p)]
    seen = []
    for sampling in ([], ["--sample", "--seed", "3", "--top-k", "20", "--temperature", "0.8"]):
        torch.manual_seed(3)
        want = model.generate(**batch, max_new_tokens=10, do_sample=bool(sampling), top_k=20,
                              temperature=0.8 if sampling else None)[:, batch["input_ids"].shape[1]:]
        out = tmp_path / f"text{len(sampling)}.json"
        assert main(["generate", "--ranks", "2", "--model", str(tmp_path / "ckpt"), *flags,
                     "--max-new-tokens", "10", *sampling, "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["tokens"] == want.tolist(), (sampling, data["tokens"], want.tolist())
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in want]
        assert data["texts"] == texts
        printed = capsys.readouterr().out
        assert all(f"→ {text}" in printed for text in texts if text)
        seen.append(data["tokens"])
    eos = model.generation_config.eos_token_id
    ended = [row for row in seen[0] if eos in row]  # greedy: the first prompt ends early
    assert ended and all(t == 0 for row in ended for t in row[row.index(eos) + 1:]), seen[0]
