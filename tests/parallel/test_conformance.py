"""``plait.parallelize``: exact or refused in one line, on every layout the conformance sweep found.

The sweep (``scripts/hf_sweep.py``, docs/conformance.md) runs every transformers causal LM
whose config ships a tensor-parallel plan; here one architecture per layout it met, tiny
(``plait.testing.tiny_hf``), through ``plait.testing.conformance.check`` on 2 and 3 ranks:
3 SGD steps' losses and every gradient and the first logits against the same model on one
process (float64; the bar is the precision the model computes in, or 10x its own noise
where larger), greedy ``generate()`` tokens equal; or a refusal in one line, the model's
weights, buffers and modules unchanged.

- plain grouped-query attention (llama); a fused q/k/v whose heads are interleaved
  ([q k v] per head: gpt_neox, with its parallel residual, partial rotary and
  ``head_size``) or in CodeGen's groups ([q v k] per group); fused q/k/v and gate/up
  gathered (phi3); Gemma's scaled, tied embeddings (gemma) and soft-capped logits
  (gemma2); per-head q/k norms in the plan (qwen3) and not in it (param2moe: plait sums
  their gradients); q/k norms over all heads, on gathered q/k (olmo2); an activation with
  parameters (apertus' xIELU); partial rotary, biases, a parallel residual (phi); experts
  (mixtral, qwen2_moe with a shared expert, deepseek_v4's clamped gate, aria_text's
  transposed weights); multi-head latent attention (deepseek_v3: heads of per-layer
  widths, the rotary key's gradient summed); per-head sinks (granite_swa's local_params);
  a q_proj of q and gate per head under grouped-query heads (qwen3_5_text);
- refused in one line: an MLP whose activation keeps the top of all columns
  (gemma3n_text), an LM head with a parameter of its own (dory), experts without
  ``act_fn`` (minimax_m3_vl_text), experts with biases and interleaved gate/up (gpt_oss).

Models written for PyTorch's vocabulary, under their own plans: PyTorch's test Transformer
(``ColwiseParallel``/``RowwiseParallel`` on attention.wq/wk/wv/wo and feed_forward.w1/w2,
its forward views q/k/v by ``self.n_heads``: plait sets it to the rank's heads, as
``Transformer.parallelize`` does) and torchtitan's Llama (0.2.2; its ``apply_tp`` plan,
sequence-parallel, recorded from the function itself): outputs and every gradient
against one process.
"""

import copy
import json
from pathlib import Path

import pytest
import torch

from plait.testing import run_ranks

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

EXACT = [  # one architecture per layout (see the module docstring), on 2 and 3 ranks
    "llama", "gpt_neox", "codegen", "phi3", "gemma2", "qwen3", "param2moe", "olmo2", "apertus",
    "phi", "qwen2_moe", "deepseek_v4", "deepseek_v3", "granite_swa", "qwen3_5_text", "aria_text"]
REFUSED = {  # architecture: what the one line must say
    "gemma3n_text": "model.layers.0.mlp (Gemma3nTextMLP) cannot be split by columns",
    "dory": "lm_head: DoryLMHead holds logit_scale",
    "minimax_m3_vl_text": "MiniMaxM3VLExperts has no act_fn",
    "gpt_oss": "experts with is_concatenated=False, has_bias=True are not supported",
}


def _sweep(archs: list[str]) -> dict:
    """``check`` with 2 steps and no noise run: these architectures do not amplify rounding,
    so every step is held to the precision's bar (the sweep runs 3 steps and the noise)."""
    from plait.testing.conformance import check

    return {arch: check(arch, steps=2, noise=False) for arch in archs}


@pytest.mark.parametrize("world", [2, 3])
def test_every_layout_is_exact_or_refused_in_one_line(world):
    refused = list(REFUSED)
    got = run_ranks(_sweep, world, EXACT + refused, timeout_s=120)
    for rank_result in got:
        for arch in EXACT:
            r = rank_result[arch]
            assert r["outcome"] == "exact", (arch, world, r)
        for arch in refused:
            r = rank_result[arch]
            assert r["outcome"] == "refused", (arch, r)
            assert REFUSED[arch] in r["why"] and r["one_line"] and r["unchanged"], (arch, r)
    notes = got[0]
    assert notes["gpt_neox"]["errors"]["logits"] < 1e-12  # float64 through and through


# ------------------------------------------------------------------ PyTorch's vocabulary
def _torch_transformer():
    """PyTorch's test Transformer (its own Attention views by self.n_heads) and the plan
    ``Transformer.parallelize`` applies without sequence parallelism, weights tied."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    args = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=16, dim=32, n_heads=4,
                     dropout_p=0.0, weight_tying=True)
    model = Transformer(args).double()
    rep = Replicate()
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=rep, output_layouts=rep),
            "pos_embeddings": RowwiseParallel(input_layouts=rep, output_layouts=rep),
            **{f"layers.*.attention.w{p}": ColwiseParallel() for p in "qkv"},
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
            "output": ColwiseParallel(output_layouts=rep)}
    return model, plan, args.vocab_size


def _titan_plan(model) -> dict:
    """torchtitan's own plan: its ``apply_tp`` run with ``parallelize_module`` recorded."""
    import torchtitan.models.llama3.infra.parallelize as titan

    plan, paths = {}, {id(m): n for n, m in model.named_modules()}

    def record(module, device_mesh=None, parallelize_plan=None, **kw):
        base = paths[id(module)]
        plan.update({f"{base}.{k}" if base else k: v for k, v in parallelize_plan.items()})
        return module

    real, titan.parallelize_module = titan.parallelize_module, record
    try:
        titan.apply_tp(model, None, loss_parallel=False, enable_float8_tensorwise_tp=False)
    finally:
        titan.parallelize_module = real
    return plan


def _titan(n_kv: int):
    """torchtitan's Llama 3 (its view(bs, seqlen, -1, head_dim) infers the local heads)."""
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv, vocab_size=128,
                                max_seq_len=32, multiple_of=16)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    model = model.double()
    return model, _titan_plan(model), args.vocab_size


def _rel(a, b) -> float:
    scale = float(b.detach().abs().max())
    return float((a.detach() - b.detach()).abs().max()) / (scale or 1.0)


def _against_one_process(make, *args) -> dict:
    """Output and every gradient of the parallel model against the plain one, and the
    precision the plain one computes in."""
    import plait
    from plait.testing.conformance import precision

    torch.set_num_threads(1)
    ref, plan, vocab = make(*args)
    computes = precision(ref, torch.float64, torch.zeros(1, 4, dtype=torch.long))
    par = copy.deepcopy(ref)
    try:
        plait.parallelize(par, plan)
    except (ValueError, TypeError) as err:
        return {"refused": str(err)}
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = ref(ids), par(ids)
    want.double().square().mean().backward()
    got.double().square().mean().backward()
    grads = plait.full_state_dict(par, grads=True)
    floor = 1e-8 * max(float(p.grad.abs().max()) for p in ref.parameters())
    worst = max(float((grads[n] - p.grad).abs().max()) / max(float(p.grad.abs().max()), floor)
                for n, p in ref.named_parameters())
    return {"out": _rel(got, want), "grads": worst, "notes": plait.parallel.applied(par),
            "precision": computes}


def _pytorch_models(titan: bool) -> dict:
    """Both models under their own plans; on 3 ranks torchtitan's with 2 KV heads too (each
    copied into 2 sub-groups), on 2 ranks the torch Transformer without the check too."""
    import torch.distributed as dist

    out = {"torch": _against_one_process(_torch_transformer)}
    if titan:
        out["titan-4kv"] = _against_one_process(_titan, 4)
        if dist.get_world_size() == 3:
            out["titan-2kv"] = _against_one_process(_titan, 2)
    if dist.get_world_size() == 2:
        out["unchecked"] = _unchecked()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_pytorch_vocabulary_models_under_their_own_plans(world):
    pytest.importorskip("expecttest")  # torch's common_dtensor imports it
    try:
        import torchtitan.models.llama3.model.model  # noqa: F401
        titan = True
    except ImportError:
        titan = False
    from plait.testing.conformance import TOL

    got = run_ranks(_pytorch_models, world, titan, timeout_s=120)
    if world == 2:  # the bare shape error, with the check off: nothing adapts n_heads
        assert all(r.pop("unchecked").startswith("RuntimeError: shape") for r in got), got
    for rank_result in got:
        for name, r in rank_result.items():
            assert "refused" not in r, (name, r)
            # float64 models that compute partly in float32: the torch Transformer's logits
            # (output(h).float()), torchtitan's RoPE (complex64 of xq.float())
            assert r["precision"] == "float64+float32", (name, r)
            assert max(r["out"], r["grads"]) < TOL[r["precision"]], (name, r)
    notes = got[0]["torch"]["notes"]
    assert any("n_heads set to this rank's heads" in n for n in notes), notes
    if not titan:
        pytest.skip("torchtitan is not importable here (pip install torchtitan==0.2.2 triton)")


def _unchecked() -> str:
    import plait

    ref, plan, vocab = _torch_transformer()
    par = plait.parallelize(copy.deepcopy(ref), plan, check=False)
    try:
        par(torch.zeros(1, 4, dtype=torch.long))
    except RuntimeError as err:
        return f"RuntimeError: {err}"
    return "ran"


# ------------------------------------------------------------------ the generated table
def test_the_conformance_page_is_what_the_sweeps_json_gives():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_sweep", ROOT / "scripts" / "hf_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    data = json.loads((ROOT / "docs" / "results" / "hf-sweep" / "sweep.json").read_text())
    assert sweep.render_docs(data) == (ROOT / "docs" / "conformance.md").read_text(), \
        "stale docs/conformance.md: run scripts/hf_sweep.py --docs-only"
    assert not [r for r in data["results"] if r["outcome"] in ("DIFFERENT", "ERROR")]


# ------------------------------------------------------------------ the check, on small models
class _Attn(torch.nn.Module):
    """Self-attention over ``heads`` heads of 8 with a fused q/k/v whose heads are ``layout``
    ("blocked": [q | k | v], "interleaved": [q k v] per head), and what it may do besides:
    ``extra`` "gate" (a replicated linear scales every local head by a gate of x),
    "whole_norm" (q normalised over all heads together), "sinks" (a parameter per head)."""

    def __init__(self, layout="blocked", extra=None, d=32, heads=4):
        super().__init__()
        self.head_dim, self.layout, self.extra = 8, layout, extra
        self.qkv = torch.nn.Linear(d, 3 * heads * 8)
        self.o = torch.nn.Linear(heads * 8, d)
        if extra == "gate":
            self.gate = torch.nn.Linear(d, 1)
        elif extra == "whole_norm":
            self.q_norm = torch.nn.LayerNorm(heads * 8)
        elif extra == "sinks":
            self.sinks = torch.nn.Parameter(torch.randn(heads))

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        if self.layout == "interleaved":
            q, k, v = qkv.view(b, s, -1, 3 * self.head_dim).chunk(3, dim=-1)
        else:
            q, k, v = (t.view(b, s, -1, self.head_dim) for t in qkv.chunk(3, dim=-1))
        if self.extra == "whole_norm":
            q = self.q_norm(q.reshape(b, s, -1)).view(b, s, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.extra == "sinks":
            out = out * self.sinks.view(1, -1, 1, 1)
        out = out.transpose(1, 2).reshape(b, s, -1)
        if self.extra == "gate":
            out = out * torch.sigmoid(self.gate(x))
        return self.o(out)


class _Scaled(torch.nn.Embedding):
    def __init__(self, *a, shift=False):
        super().__init__(*a)
        self.register_buffer("embed_scale", torch.tensor(3.0), persistent=False)
        self.shift = shift

    def forward(self, ids):
        out = super().forward(ids) * self.embed_scale.to(self.weight.dtype)
        return out + 1.0 if self.shift else out


class _Tiny(torch.nn.Module):
    def __init__(self, attn: _Attn, embedding=torch.nn.Embedding):
        super().__init__()
        self.embed = embedding(64, 32)
        self.attn = attn
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.attn(h))


_PLAN = {"embed": "embedding_rowwise", "attn.qkv": "colwise", "attn.o": "rowwise",
         "head": "colwise_gather_output"}
_CASES = {  # name: (layout, extra, embedding, what the refusal says or None: exact)
    "blocked": ("blocked", None, torch.nn.Embedding, None),
    "interleaved": ("interleaved", None, torch.nn.Embedding, None),
    "scaled": ("blocked", None, _Scaled, None),
    "shifted": ("blocked", None, lambda *a: _Scaled(*a, shift=True),
                "embed: _Scaled's forward is not nn.Embedding's lookup"),
    "gate": ("blocked", "gate", torch.nn.Embedding,
             "attn: its input's gradient through a path outside its split linears"),
    "whole_norm": ("blocked", "whole_norm", torch.nn.Embedding,
                   "attn (_Attn) cannot be split by heads: its forward fails on a rank's share"),
    "sinks": ("blocked", "sinks", torch.nn.Embedding,
              "attn (_Attn) cannot be split by heads: its forward fails on a rank's share"),
}


def _small_models() -> dict:
    import plait

    out = {}
    for name, (layout, extra, embedding, _) in _CASES.items():
        torch.manual_seed(0)
        ref = _Tiny(_Attn(layout, extra), embedding).double()
        par = copy.deepcopy(ref)
        try:
            plait.parallelize(par, dict(_PLAN))
        except ValueError as err:
            out[name] = ("refused", str(err))
            continue
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        want, got = ref(ids), par(ids)
        want.square().mean().backward()
        got.square().mean().backward()
        grads = plait.full_state_dict(par, grads=True)
        err = max([_rel(got, want)] + [_rel(grads[n], p.grad) for n, p in ref.named_parameters()])
        out[name] = ("ran", err)
    return out


def test_the_check_reads_fused_layouts_and_refuses_what_a_share_cannot_compute():
    got = run_ranks(_small_models, 2, timeout_s=60)[0]
    for name, (*_, refusal) in _CASES.items():
        kind, what = got[name]
        if refusal is None:
            assert kind == "ran" and what < 1e-12, (name, got[name])
        else:
            assert kind == "refused" and refusal in what and "\n" not in what, (name, got[name])
