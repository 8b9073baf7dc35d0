"""A model built on the meta device, each rank loading only its share of a real checkpoint.

A small transformers Llama (float64, 2 layers, 8 query heads over 4 KV heads, a few MB) is
saved with ``save_pretrained`` as sharded safetensors (files of 200 kB); a Mixtral-style
MoE too, whose experts the checkpoint keeps one by one and the model holds fused. Against
the model on one process, within 1e-12 (float64):

- ``plait.from_pretrained`` on 2 ranks (even) and 3 ranks (heads [2, 1, 1], MLP columns
  uneven): the loss and logits, two SGD steps' losses, and greedy ``generate()`` tokens;
  each rank read exactly the bytes of its own tensors (its pieces, nothing else); a Llama
  whose LM head is tied to its embedding (one parameter after loading, saved once);
- Mixtral expert-parallel (2 ranks) and split by the experts' FFN dim (3 ranks);
- the same checkpoint read from a plain full ``state_dict`` into a model built on meta;
- a plait DCP checkpoint saved on 3 ranks with uneven heads, loaded into a model built on
  meta on 2 ranks;
- on a ``dp 2 × tp 2`` mesh (4 ranks), and after the balancer's kind of move (``migrate``
  of layer 0's heads to [3, 1]) a reload gives the same weights;
- refused in one line naming the file or tensor: a missing or truncated file, a tensor of
  another shape, a directory that is not a checkpoint.
"""

from __future__ import annotations

import copy

import pytest
import torch

from plait.testing import run_ranks
from plait.nn.record import applied

pytest.importorskip("transformers")

TOL = 1e-12
IDS = torch.arange(40).view(2, 20) % 256


def _llama(tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=192,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).double()


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                        experts_implementation="eager")
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).double()
    with torch.no_grad():  # sharper routing than the default init's near-uniform one
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_()
    return model


def _figures(model) -> dict:
    """Logits and loss, greedy tokens, two SGD steps' losses (the model is changed)."""
    out = model(input_ids=IDS, labels=IDS)
    tokens = model.generate(IDS[:, :6], max_new_tokens=5, do_sample=False, pad_token_id=0)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        loss = model(input_ids=IDS, labels=IDS).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"logits": out.logits.detach(), "loss": float(out.loss), "tokens": tokens.tolist(),
            "steps": losses}


def _local_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _loaded(path, plan="auto", shards=None, **kw):
    """plait.from_pretrained on every rank: the figures, and the bytes read against the bytes
    of the rank's own tensors."""
    import plait
    from plait.checkpoint import load_shards
    from plait.plan import ShardPlan

    shards = {k: ShardPlan(v) for k, v in (shards or {}).items()}
    model = plait.from_pretrained(path, plan, shards=shards, dtype=torch.float64, **kw)
    assert not any(p.is_meta for p in model.parameters())
    read = load_shards(model, path)["read_bytes"]  # again, to count: the same bytes
    return {**_figures(model), "read": read, "own": _local_bytes(model)}


def _from_state_dict(state):
    """A Llama built on meta, parallelized, its shards taken from a full state_dict."""
    import plait
    from plait.checkpoint import load_shards, materialize

    with torch.device("meta"):
        model = _llama_meta()
    model = plait.parallelize(model, "auto")
    materialize(model, "cpu")
    load_shards(model, state)
    model.eval()
    return _figures(model)


def _llama_meta():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(_llama().config).to(torch.float64)


def _saved_dcp(root):
    """3 ranks, heads [2, 1, 1]: a plait DCP checkpoint of the Llama."""
    import plait
    from plait.checkpoint import save
    from plait.plan import ShardPlan

    model = plait.parallelize(_llama(), "auto", shards={"heads": ShardPlan((2, 1, 1))})
    save(root, 1, model)


def _from_dcp(root):
    import plait
    from plait.checkpoint import load, materialize

    with torch.device("meta"):
        model = _llama_meta()
    model = plait.parallelize(model, "auto")
    materialize(model, "cpu")
    load(root, model)
    model.eval()
    return _figures(model)


def _dp_tp(path):
    import plait

    mesh = plait.parallel.dp_tp_mesh(dp=2, tp=2)
    model = plait.from_pretrained(path, mesh=mesh, dtype=torch.float64, dp_kind=None)
    out = model(input_ids=IDS, labels=IDS)
    return float(out.loss), out.logits.detach()


def _moved_then_reloaded(path):
    """from_pretrained, layer 0's heads migrated to [3, 1] (as the balancer moves them),
    then every tensor overwritten and read again: the full weights."""
    import plait
    from plait.balance import migrate
    from plait.checkpoint import load_shards
    from plait.plan import ShardPlan

    model = plait.from_pretrained(path, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    attn = applied(model).dims["model.layers.0.self_attn"]
    migrate(model, opt, {name: ShardPlan((3, 1)) for name in attn})
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_shards(model, path)
    return model.model.layers[0].self_attn.q_proj.plan.sizes, plait.full_state_dict(model)


def _tied(path):
    import plait

    model = plait.from_pretrained(path, dtype=torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return _figures(model)


def _on_two(paths, dcp):
    """Every 2-rank case, in one launch."""
    return {"llama": _loaded(paths["llama"]), "tied": _tied(paths["tied"]),
            "mixtral": _loaded(paths["mixtral"], experts_implementation="eager"),
            "state_dict": _from_state_dict(paths["state"]), "dcp": _from_dcp(dcp),
            "moved": _moved_then_reloaded(paths["llama"]), "misfit": _misfit(paths["llama"])}


def _on_three(paths, dcp):
    """Every 3-rank case, in one launch; it also saves the DCP checkpoint the 2 ranks load."""
    _saved_dcp(dcp)
    plan = {**_mixtral()._tp_plan, "model.layers.*.mlp.experts": "moe_tp_experts"}
    return {"llama": _loaded(paths["llama"], "auto", {"heads": (2, 1, 1), "mlp": (80, 64, 48)}),
            "mixtral": _loaded(paths["mixtral"], plan, {"experts": (40, 24, 32)},
                               experts_implementation="eager")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoints and their reference figures (one process, the whole model)."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name, make in (("llama", _llama), ("mixtral", _mixtral),
                       ("tied", lambda: _llama(tied=True))):
        model = make()
        model.save_pretrained(root / name, max_shard_size="200KB")
        out[name] = (root / name, _figures(copy.deepcopy(model).eval()), model.state_dict())
    return out


@pytest.fixture(scope="module")
def runs(saved, tmp_path_factory):
    """The launches on 3, 2 and 4 ranks; each rank's results."""
    paths = {name: str(path) for name, (path, _, _) in saved.items()}
    paths["state"] = saved["llama"][2]
    dcp = str(tmp_path_factory.mktemp("dcp"))
    three = run_ranks(_on_three, 3, paths, dcp, timeout_s=60)
    two = run_ranks(_on_two, 2, paths, dcp, timeout_s=60)
    four = run_ranks(_dp_tp, 4, paths["llama"], timeout_s=60)
    return {2: two, 3: three, 4: four}


def _same(got: dict, want: dict, case) -> None:
    assert float((got["logits"] - want["logits"]).abs().max()) < TOL, case
    assert abs(got["loss"] - want["loss"]) < TOL, case
    assert got["tokens"] == want["tokens"], case
    assert got["steps"] == pytest.approx(want["steps"], rel=TOL, abs=0), case


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_only_its_share_and_matches_one_process(saved, runs, world):
    path, want, state = saved["llama"]
    assert len(list(path.glob("*.safetensors"))) > 4  # sharded
    results = [r["llama"] for r in runs[world]]
    for rank, got in enumerate(results):
        _same(got, want, (world, rank))
        assert got["read"] == got["own"], (rank, got["read"], got["own"])
    whole = sum(t.numel() * t.element_size() for t in state.values())
    assert sum(r["read"] for r in results) < whole * 1.05  # the replicated norms only


def test_a_tied_head_stays_one_parameter(saved, runs):
    for rank in runs[2]:
        _same(rank["tied"], saved["tied"][1], "tied")


def test_mixtral_experts_saved_one_by_one_load_expert_parallel_and_ffn_split(saved, runs):
    assert any(".experts.0.w1.weight" in k for k in
               (saved["mixtral"][0] / "model.safetensors.index.json").read_text().split('"'))
    for rank, got in enumerate(r["mixtral"] for world in (2, 3) for r in runs[world]):
        _same(got, saved["mixtral"][1], rank)
        assert got["read"] == got["own"], (rank, got["read"], got["own"])


def test_a_full_state_dict_and_a_plait_dcp_checkpoint_load_into_a_meta_model(saved, runs):
    for rank in runs[2]:
        _same(rank["state_dict"], saved["llama"][1], "state_dict")
        _same(rank["dcp"], saved["llama"][1], "dcp")


def test_dp_tp_mesh_and_a_moved_plan(saved, runs):
    _, want, state = saved["llama"]
    for loss, logits in runs[4]:
        assert abs(loss - want["loss"]) < TOL
        assert float((logits - want["logits"]).abs().max()) < TOL
    sizes, full = runs[2][0]["moved"]
    assert sizes == (3, 1)
    assert all(torch.equal(full[k], v) for k, v in state.items()), "reloaded weights differ"


def _refusal(path) -> str:
    import plait
    from plait.checkpoint import CheckpointFileError

    with pytest.raises(CheckpointFileError) as err:
        plait.from_pretrained(path)
    return str(err.value)


def test_a_broken_checkpoint_is_refused_in_one_line_naming_it(saved, tmp_path):
    import shutil

    path = saved["llama"][0]
    missing, truncated = tmp_path / "missing", tmp_path / "truncated"
    for copy_to in (missing, truncated):
        shutil.copytree(path, copy_to)
    victim = sorted(missing.glob("*.safetensors"))[1]
    victim.unlink()
    text = _refusal(missing)
    assert text.count("\n") == 0 and victim.name in text and "missing" in text, text
    victim = sorted(truncated.glob("*.safetensors"))[2]
    victim.write_bytes(victim.read_bytes()[:-100])
    text = _refusal(truncated)
    assert text.count("\n") == 0 and victim.name in text and "truncated" in text, text
    assert "no such checkpoint directory" in _refusal(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "no model.safetensors" in _refusal(tmp_path / "empty")


def _misfit(path):
    import plait
    from plait.checkpoint import CheckpointFileError, load_shards, materialize

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**_llama().config.to_dict(), "intermediate_size": 256})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.float64)
    model = plait.parallelize(model, "auto")
    materialize(model, "cpu")
    before = [p.clone() for p in model.parameters()]
    try:
        load_shards(model, path)
    except CheckpointFileError as err:
        untouched = all(torch.equal(a, b) or a.isnan().any() for a, b in
                        zip(before, model.parameters()))
        return str(err), untouched
    return None, None


def test_a_tensor_of_another_shape_is_refused_before_any_changes(runs):
    for text, untouched in (r["misfit"] for r in runs[2]):
        assert text is not None and text.count("\n") == 0, text
        assert text == ("model.layers.0.mlp.gate_proj.weight: the checkpoint holds [192, 128], "
                        "the model [256, 128] (and 5 more)"), text
        assert untouched
