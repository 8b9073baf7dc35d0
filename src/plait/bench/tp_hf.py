"""``plait bench tp --model hf-llama``: a transformers Llama under plait and PyTorch TP.

The model is transformers' ``LlamaForCausalLM`` built from a ``LlamaConfig``
(random weights, no download) with grouped-query attention (``--n-head`` query
heads over ``--n-kv-head`` KV heads), SwiGLU MLP of width ``ffn_width(n_embd)``
(Llama's 8/3·D rounded up to a multiple of 256: the same MLP FLOPs as the
GPT's 4·D two-matrix MLP, to within the rounding) and a vocabulary of the
character corpus padded to a multiple of 64 (so it splits over 2, 4, 8 … ranks;
the padded ids are never targets). Every rank builds it from one seed and
makes a copy parallel three ways, all with the same plan, the model's own
(``hf_plan="auto"``: transformers' ``base_model_tp_plan`` and ``_tp_plan``:
q/k/v/gate/up column-parallel, o/down row-parallel, the embedding split by
vocabulary rows, the LM head by vocabulary columns with its logits gathered)
or its decoder layers only (``hf_plan="layers"``: embedding and LM head
replicated, as the GPT bench has them):

- ``plait``: ``plait.parallelize(model, plan)`` with fused operators
  (``overlap=True``, ``chunks="auto"``);
- ``plait-plain``: the same with ``overlap=False``;
- ``pytorch-tp``: ``parallelize_module`` over a 1-D ``DeviceMesh`` with the same
  plan written in PyTorch's styles ("colwise" → ``ColwiseParallel()``,
  "rowwise" → ``RowwiseParallel()``, "embedding_rowwise" →
  ``RowwiseParallel(input_layouts=Replicate())``, "colwise_gather_output" →
  ``ColwiseParallel(output_layouts=Replicate())``), as torchtitan plans a Llama.

Head counts under DTensor: ``LlamaAttention`` reads the local head count from the local
tensor's width (``view(*input_shape, -1, head_dim)``), and ``ColwiseParallel``'s default
``use_local_output=True`` hands it plain local tensors, so the config keeps the global
counts; a contiguous ``Shard(0)`` of q and of k/v gives each rank query heads and KV heads
that are each other's groups. (``use_local_output=False`` stops at the rotary embedding:
"aten.mul.Tensor got mixed torch.Tensor and DTensor".) ``H_kv`` must be a multiple of the
ranks for DTensor; plait also splits whole groups unevenly, but the bench compares equal
splits.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..runtime import parse_rate, rank_context

__all__ = ["NOTES", "ffn_width", "padded_vocab", "llama_config", "build_llama",
           "own_plan", "torch_tp_plan", "build_hf", "split_modules", "llama_loss", "hf_wire",
           "transformers_missing", "model_info"]

NOTES = {
    "plait": "plait.parallelize(model, plan, overlap=True, chunks='auto'): fused operators "
             "(matmul_all_reduce for o/down; q/k/v's and gate/up's input grads summed, each "
             "sum all-reduced in pieces with its dgrad; their forwards and weight gradients "
             "one GEMM each)",
    "plait-plain": "plait.parallelize(model, plan, overlap=False): compute, then a blocking "
                   "collective (q/k/v's and gate/up's input grads summed before one each; "
                   "their forwards and weight gradients one GEMM each)",
    "pytorch-tp": "parallelize_module with the same plan as ColwiseParallel/RowwiseParallel on "
                  "a 1-D DeviceMesh; DTensor redistributes Partial→Replicate with a blocking "
                  "all-reduce after each row-parallel matmul (forward) and each "
                  "column-parallel input grad (backward)",
}
# transformers' plan strings for a dense Llama, and their meaning in PyTorch's styles
_TORCH_STYLES = {"colwise": dict(cls="col"), "rowwise": dict(cls="row"),
                 "embedding_rowwise": dict(cls="row", input="replicate"),
                 "colwise_gather_output": dict(cls="col", output="replicate")}


def transformers_missing() -> str | None:
    """Why transformers does not import here (``plait[hf]``), or None."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        return f"{type(err).__name__}: {err}"
    return None


def ffn_width(n_embd: int) -> int:
    """Llama's MLP width: 8/3 · D rounded up to a multiple of 256."""
    return -(-(8 * n_embd // 3) // 256) * 256


def padded_vocab(vocab: int) -> int:
    return -(-vocab // 64) * 64


def llama_config(cfg, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=padded_vocab(vocab_size), hidden_size=cfg.n_embd,
                       intermediate_size=ffn_width(cfg.n_embd),
                       num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                       num_key_value_heads=cfg.n_kv_head, max_position_embeddings=cfg.seq_len,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def build_llama(cfg, vocab_size: int) -> nn.Module:
    """The single-device model, the same on every rank (seeded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(llama_config(cfg, vocab_size))


def own_plan(model: nn.Module, which: str) -> dict[str, str]:
    """The model's own plan (transformers' strings, paths from the root); ``"layers"``: its
    decoder layers' entries only."""
    from ..parallel.resolve import auto_plan

    plan = auto_plan(model)
    if which == "layers":
        plan = {k: v for k, v in plan.items() if ".layers." in k}
    return plan


def torch_tp_plan(plan: dict[str, str]) -> dict:
    """transformers' plan strings as PyTorch's ``ColwiseParallel``/``RowwiseParallel``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for path, name in plan.items():
        if name not in _TORCH_STYLES:
            raise ValueError(f"{path}: plan entry {name!r} has no PyTorch style here "
                             f"(known: {sorted(_TORCH_STYLES)})")
        spec = _TORCH_STYLES[name]
        kw = {}
        if "input" in spec:
            kw["input_layouts"] = Replicate()
        if "output" in spec:
            kw["output_layouts"] = Replicate()
        out[path] = ColwiseParallel(**kw) if spec["cls"] == "col" else RowwiseParallel(**kw)
    return out


def build_hf(system: str, cfg, vocab_size: int) -> nn.Module:
    """One system's copy of the Llama, parallel over all ranks."""
    device = rank_context().topology.device
    model = build_llama(cfg, vocab_size).to(device)
    plan = own_plan(model, cfg.hf_plan)
    if system == "pytorch-tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return parallelize_module(model, mesh, torch_tp_plan(plan))
    from ..parallel import parallelize

    # "auto" as a user writes it (the same entries as ``plan``)
    return parallelize(model, "auto" if cfg.hf_plan == "auto" else plan,
                       overlap=system == "plait", chunks="auto")


def split_modules(model: nn.Module) -> list[str]:
    """The modules a system actually split (plait's layers, or modules holding DTensor
    parameters), layer numbers written ``*``: read from the parallel model, not the plan."""
    from torch.distributed.tensor import DTensor

    found = set()
    for path, module in model.named_modules():
        own = module.parameters(recurse=False)
        if type(module).__module__.startswith("plait.") or \
                any(isinstance(p, DTensor) for p in own):
            found.add(re.sub(r"\.\d+\.", ".*.", path))
    return sorted(found)


def llama_loss(model: nn.Module, batch) -> torch.Tensor:
    """Next-character cross-entropy (the corpus's targets; the model is not told the labels,
    so every system computes the loss the same way from the logits)."""
    x, y = batch
    logits = model(input_ids=x).logits  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def hf_wire(cfg, world: int, link: str, vocab_size: int, system: str) -> dict:
    """What ``system`` sends per step: per layer 2 all-reduces of [B, S, D] fp32 forward
    (after o and down) and, backward, the input grads of q, k, v, gate and up: DTensor
    all-reduces each of the five, plait sums q/k/v's partials and gate/up's before one
    all-reduce each (:mod:`plait.ops.shared_input`), so 7 a layer against 4; with
    ``hf_plan="auto"`` also the embedding's all-reduce forward, the LM head's input grad
    backward and its logits' all-gather ([B, S, V/p] from each rank). The time at the link
    rate with ring bus factors (2(n−1)/n an all-reduce, (n−1)/n an all-gather) is a lower
    bound on the communication of these collectives."""
    tokens = cfg.batch_size * cfg.seq_len
    buf = tokens * cfg.n_embd * 4
    count = (7 if system == "pytorch-tp" else 4) * cfg.n_layer + \
        (2 if cfg.hf_plan == "auto" else 0)
    gather = tokens * padded_vocab(vocab_size) * 4 if cfg.hf_plan == "auto" else 0
    wire = (count * buf * 2 + gather) * (world - 1) / world
    rate = parse_rate(link)
    return {"allreduce_per_step": count, "allreduce_bytes": buf, "allgather_bytes": gather,
            "t_comm_link_s": wire * 8 / rate if rate else None}


def model_info(cfg, vocab_size: int) -> dict:
    """The trained model's sizes as a record holds them (``bench tp``'s ``cfg``)."""
    sizes = ("n_layer", "n_head", "n_embd", "seq_len", "batch_size")
    model = {"name": cfg.model, **{k: getattr(cfg, k) for k in sizes}}
    if cfg.model == "hf-llama":
        model.update(n_kv_head=cfg.n_kv_head, ffn=ffn_width(cfg.n_embd),
                     vocab=padded_vocab(vocab_size), plan=cfg.hf_plan)
    return model
